"""The STAND-IN runtime and torch_npu libraries (tests only) as ctypes handles, with the argument
types the test workloads use, and the device set: one place instead of a copy per workload.
"""

import ctypes
import os

VP, SZ = ctypes.c_void_p, ctypes.c_size_t


def load(torch_lib, device=0):
    """(acl, torch): libascendcl.so from $ASCEND_HOME_PATH/lib64 with `device` set, and the
    stand-in libtorch_npu.so at `torch_lib`."""
    acl = ctypes.CDLL(os.path.join(os.environ["ASCEND_HOME_PATH"], "lib64", "libascendcl.so"))
    acl.aclrtSetDevice.argtypes = [ctypes.c_int32]
    acl.aclrtBinaryGetFunction.argtypes = [VP, ctypes.c_char_p, ctypes.POINTER(VP)]
    acl.aclrtLaunchKernel.argtypes = [VP, ctypes.c_uint32, VP, SZ, VP]
    if acl.aclrtSetDevice(device) != 0:
        raise RuntimeError(f"aclrtSetDevice({device}) failed")
    torch = ctypes.CDLL(torch_lib)
    torch.standin_tensor_alloc.argtypes = [SZ, ctypes.c_int]
    torch.standin_tensor_alloc.restype = VP
    torch.standin_tensor_free.argtypes = [VP]
    torch.standin_stats.argtypes = [ctypes.c_int, ctypes.POINTER(SZ), ctypes.POINTER(SZ)]
    torch.standin_comm_start.argtypes = [VP, ctypes.c_int]
    torch.standin_workspace_alloc.argtypes = [SZ, ctypes.c_int]
    torch.standin_workspace_alloc.restype = VP
    torch.standin_workspace_ptr.argtypes = [VP]
    torch.standin_workspace_ptr.restype = VP
    torch.standin_workspace_free.argtypes = [VP, ctypes.c_int]
    return acl, torch


def stats(torch, device=0):
    """The stand-in caching allocator's own (allocated, reserved) bytes on `device`."""
    allocated, reserved = SZ(), SZ()
    torch.standin_stats(device, ctypes.byref(allocated), ctypes.byref(reserved))
    return allocated.value, reserved.value


def block_size(request):
    """The bytes torch_npu's caching allocator holds for a request (its block): the request plus
    32 bytes (AddPadSize), rounded up to 512 (round_size; NPUCachingAllocator.cpp:2130-2143).
    The ledgers record tensors at the size the allocator counts them."""
    return max(512, (request + 32 + 511) // 512 * 512)
