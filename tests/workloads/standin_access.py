#!/usr/bin/env python3
"""Uses of memory on the STAND-IN runtime and torch_npu allocator (tests only): copies, sets,
kernel launches and out-of-memory failures, with a ledger of what each one touched.

Every expectation in the ledger comes from what this script itself passed to the runtime: the
blocks it allocated (address and size), the addresses it gave to memcpy/memset, the words it put
in a kernel's argument buffer, and which of its blocks were alive when an allocation failed.
A block is named by its start address and its kind (`HAL` for aclrtMalloc, `PTA` for tensors).
"""

import argparse
import ctypes
import json
import os
import sys
import time

ACL_MEMCPY_HOST_TO_DEVICE = 1
ACL_MEMCPY_DEVICE_TO_DEVICE = 3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--torch-lib", required=True)
    ap.add_argument("--ledger", required=True)
    ap.add_argument("--start-delay", type=float, default=0.5, help="let a launch-mode tracer attach the torch library")
    args = ap.parse_args()

    home = os.environ["ASCEND_HOME_PATH"]
    acl = ctypes.CDLL(os.path.join(home, "lib64", "libascendcl.so"))
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    acl.aclrtSetDevice.argtypes = [ctypes.c_int32]
    acl.aclrtMalloc.argtypes = [ctypes.POINTER(vp), sz, ctypes.c_int]
    acl.aclrtFree.argtypes = [vp]
    acl.aclrtMemcpy.argtypes = [vp, sz, vp, sz, ctypes.c_int]
    acl.aclrtMemcpyAsync.argtypes = [vp, sz, vp, sz, ctypes.c_int, vp]
    acl.aclrtMemset.argtypes = [vp, sz, ctypes.c_int32, sz]
    acl.aclrtBinaryGetFunction.argtypes = [vp, ctypes.c_char_p, ctypes.POINTER(vp)]
    acl.aclrtLaunchKernel.argtypes = [vp, ctypes.c_uint32, vp, sz, vp]
    acl.aclrtKernelArgsInit.argtypes = [vp, ctypes.POINTER(vp)]
    acl.aclrtKernelArgsAppend.argtypes = [vp, vp, sz, ctypes.POINTER(vp)]
    acl.aclrtKernelArgsFinalize.argtypes = [vp]
    acl.aclrtLaunchKernelWithConfig.argtypes = [vp, ctypes.c_uint32, vp, vp, vp, vp]
    torch = ctypes.CDLL(args.torch_lib)
    torch.standin_tensor_alloc.argtypes = [sz, ctypes.c_int]
    torch.standin_tensor_alloc.restype = vp
    torch.standin_tensor_free.argtypes = [vp]

    time.sleep(args.start_delay)
    ledger = []
    acl.aclrtSetDevice(0)

    def malloc(size):
        p = vp()
        rc = acl.aclrtMalloc(ctypes.byref(p), size, 0)
        if rc != 0:
            raise RuntimeError(f"aclrtMalloc({size}) = {rc}")
        ledger.append({"kind": "block", "type": "HAL", "ptr": p.value, "size": size})
        return p.value

    def expect(kind, block_type, block, addr, api):
        ledger.append({"kind": "access", "access": kind, "type": block_type, "block": block, "addr": addr, "api": api})

    a, b, c = malloc(64 << 10), malloc(128 << 10), malloc(32 << 10)
    host = ctypes.create_string_buffer(4096)
    # Host to device: only the destination is a traced block.
    check(acl.aclrtMemcpy(a + 16, 4096, ctypes.addressof(host), 4096, ACL_MEMCPY_HOST_TO_DEVICE))
    expect("WRITE", "HAL", a, a + 16, "aclrtMemcpy")
    # Device to device: the source is read, the destination written.
    check(acl.aclrtMemcpyAsync(b, 8192, a, 8192, ACL_MEMCPY_DEVICE_TO_DEVICE, None))
    expect("READ", "HAL", a, a, "aclrtMemcpyAsync")
    expect("WRITE", "HAL", b, b, "aclrtMemcpyAsync")
    check(acl.aclrtMemset(c + 100, 1000, 7, 1000))
    expect("WRITE", "HAL", c, c + 100, "aclrtMemset")

    # A tensor on the caching allocator: its block is a PTA block inside a HAL segment, and a
    # use of it is the PTA block's.
    t = torch.standin_tensor_alloc(256 << 10, 0)
    ledger.append({"kind": "block", "type": "PTA", "ptr": t, "size": 256 << 10})
    check(acl.aclrtMemset(t, 4096, 0, 4096))
    expect("WRITE", "PTA", t, t, "aclrtMemset")

    # A kernel whose arguments name three blocks (one by an inner address), a plain integer, a
    # host address and a block freed before the launch.
    f = vp()
    check(acl.aclrtBinaryGetFunction(None, b"matmul_kernel", ctypes.byref(f)))
    gone = malloc(16 << 10)
    check(acl.aclrtFree(gone))
    words = [a, b + 8, 12345, t + 64, ctypes.addressof(host), gone]
    buf = (ctypes.c_uint64 * len(words))(*words)
    check(acl.aclrtLaunchKernel(f, 8, ctypes.addressof(buf), ctypes.sizeof(buf), None))
    ledger.append({"kind": "launch", "name": "matmul_kernel", "args_size": ctypes.sizeof(buf)})
    for block_type, block, addr in [("HAL", a, a), ("HAL", b, b + 8), ("PTA", t, t + 64)]:
        expect("UNKNOWN", block_type, block, addr, "aclrtLaunchKernel")

    # The newer path: parameters appended one by one to an argument handle (two block addresses,
    # an integer, a 16-byte struct whose second word is an address inside a block), then launched.
    g = vp()
    check(acl.aclrtBinaryGetFunction(None, b"add_kernel", ctypes.byref(g)))
    handle = vp()
    check(acl.aclrtKernelArgsInit(g, ctypes.byref(handle)))
    params = [(ctypes.c_uint64 * 1)(c + 32), (ctypes.c_uint64 * 1)(t), (ctypes.c_uint64 * 1)(7),
              (ctypes.c_uint64 * 2)(0, a + 100)]
    for p in params:
        check(acl.aclrtKernelArgsAppend(handle, ctypes.addressof(p), ctypes.sizeof(p), None))
    check(acl.aclrtKernelArgsFinalize(handle))
    check(acl.aclrtLaunchKernelWithConfig(g, 4, None, None, handle, None))
    ledger.append({"kind": "launch", "name": "add_kernel", "args_size": sum(ctypes.sizeof(p) for p in params)})
    for block_type, block, addr in [("HAL", c, c + 32), ("PTA", t, t), ("HAL", a, a + 100)]:
        expect("UNKNOWN", block_type, block, addr, "aclrtLaunchKernelWithConfig")

    # Out of memory at the runtime: every live HAL block of the device is listed (3 + the
    # allocator's segment), largest and newest first; then at the allocator: its live blocks.
    p = vp()
    rc = acl.aclrtMalloc(ctypes.byref(p), 1 << 50, 0)
    ledger.append({"kind": "oom", "api": "aclrtMalloc", "rc": rc, "req": 1 << 50})
    huge = torch.standin_tensor_alloc(1 << 50, 0)
    ledger.append({"kind": "oom", "api": "pool", "rc": 0 if huge is None else 1, "req": 1 << 50})

    torch.standin_tensor_free(t)
    for ptr in (a, b, c):
        check(acl.aclrtFree(ptr))
    with open(args.ledger, "w") as out:
        for line in ledger:
            out.write(json.dumps(line) + "\n")
    return 0


def check(rc):
    if rc != 0:
        raise RuntimeError(f"stand-in call failed with {rc}")


if __name__ == "__main__":
    sys.exit(main())
