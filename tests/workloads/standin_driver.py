#!/usr/bin/env python3
"""A job whose memory the driver sees, on the STAND-IN libraries (tests only): device buffers
held long enough for a tracer's periodic driver queries (DCMI on Ascend, NVML on NVIDIA, both
stand-ins answering from what the stand-in driver charged each live process), then registered
and pinned host memory. No NPU or GPU is involved.

What it does, in order (`--stack npu`: libascendcl.so from $ASCEND_HOME_PATH/lib64, or --lib;
`--stack cuda`: libcudart.so.12 and libcuda.so.1 from --cuda-lib):
1. Sets device 0 (and 1 with `--devices 2`): aclrtSetDevice / cudaSetDevice. That is when the
   stand-in driver charges the device's context, STANDIN_HAL_CONTEXT_MEM / STANDIN_CUDA_CONTEXT_MEM
   bytes (default 0), once per device: memory no traced call explains, logged in the driver's
   ledger (STANDIN_HAL_LEDGER / STANDIN_CUDA_LEDGER) as api "context".
2. On each device, allocates BUFFERS (1 MiB, 3 MiB + 100 bytes, 16 MiB) with aclrtMalloc /
   cudaMalloc. What the driver charges for them is in its ledger (the stand-in runtime asks
   halMemAlloc for size+32 rounded up to 32; cudaMalloc asks cuMemAlloc_v2 for the size).
   With --comm, then the communication library takes memory itself, as HCCL and NCCL do: npu:
   the stand-in libhccl.so (beside libascendcl.so) makes a communicator per device
   (HcclCommInitRootInfo: two HCCL_BUFFSIZE MB buffers with aclrtMalloc and 1 MiB of host
   memory with aclrtMallocHost); cuda: the stand-in libnccl.so.2 makes one per device
   (ncclCommInitAll: NCCL_BUFFSIZE bytes with cuMemAlloc_v2, 1 MiB pinned with cuMemHostAlloc)
   and ncclMemAlloc maps 3 MiB (rounded to 4) through cuMemCreate/cuMemMap. The libraries log
   each buffer in STANDIN_COMM_LEDGER; the workload logs its calls to them.
3. Holds for --hold-ms ("allocated"): the driver's view is steady. During it, on each device d,
   the driver reports for this process
       used(d) = the live driver-level bytes of step 2 on d + the context bytes on d
   so the "unexplained" bytes a tracer should find are STANDIN_*_CONTEXT_MEM per device used.
4. Registers host memory, which charges no device: npu: aclrtHostRegisterV2 (PINNED|MAPPED) of a
   2 MiB page-aligned buffer and aclrtHostRegister (MAPPED) of a 1 MiB one; cuda: cudaHostRegister
   (portable|mapped) of a 2 MiB page-aligned buffer and cuMemHostAlloc (portable|devicemap) of
   1 MiB, pinned host memory from the driver.
5. Holds again ("registered"), then unregisters (aclrtHostUnregister / cudaHostUnregister) and
   frees (cuMemFreeHost, libc free), destroys the communicators (HcclCommDestroy /
   ncclMemFree, ncclCommDestroy), and frees the device buffers (aclrtFree / cudaFree).
6. Holds a third time ("freed": only the context bytes remain) and exits.

Its ledger (--ledger, JSON lines): first {"phase": "start", "pid", "stack", "devices",
"context_mem"}; then one line per call with api, device, size, ptr, rc, tid, t0, t1 (wall-clock
ns; size is the request, also on the frees; flag/flags/type where the call takes them, dev_ptr
for aclrtHostRegister); and for each hold one line per device {"phase": "hold", "hold": name,
"device": d, "t0", "t1"}. --ready-file is written with the pid once the libraries are loaded;
with --go-file, no call is made until that file exists (at most --go-timeout seconds), so a test
can attach a tracer first.
"""

import argparse
import ctypes
import json
import os
import sys
import threading
import time

from standin_ctypes import SZ, VP

MiB = 1 << 20
BUFFERS = [MiB, 3 * MiB + 100, 16 * MiB]
REGISTERED, PINNED = 2 * MiB, MiB
U64 = ctypes.c_uint64

# acl_rt.h
ACL_HOST_REGISTER_MAPPED = 0
ACL_HOST_REG_MAPPED, ACL_HOST_REG_PINNED = 0x2, 0x10000000
# cuda_runtime_api.h / cuda.h
CUDA_HOST_REGISTER_PORTABLE, CUDA_HOST_REGISTER_MAPPED = 0x1, 0x2
CU_MEMHOSTALLOC_PORTABLE, CU_MEMHOSTALLOC_DEVICEMAP = 0x1, 0x2


class Ledger:
    def __init__(self, path):
        self.file = open(path, "w")

    def log(self, **line):
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()

    def call(self, fn, api, *args, out=None, **fields):
        """Calls fn(*args), logs it (ptr: `out`'s value after a successful call, when given) and
        returns its status."""
        t0 = time.time_ns()
        rc = fn(*args)
        t1 = time.time_ns()
        if out is not None:
            fields["ptr"] = out.value if rc == 0 else None
        fields.setdefault("size", 0)
        self.log(api=api, rc=rc, tid=threading.get_native_id(), t0=t0, t1=t1, **fields)
        if rc != 0:
            raise RuntimeError(f"{api} returned {rc}")
        return rc


def host_buffer(size):
    """A page-aligned buffer from libc's posix_memalign, touched (as a caller's would be)."""
    p = VP()
    if libc.posix_memalign(ctypes.byref(p), 4096, SZ(size)) != 0:
        raise MemoryError(size)
    ctypes.memset(p, 0x5A, size)
    return p


libc = ctypes.CDLL(None)
libc.posix_memalign.argtypes = [ctypes.POINTER(VP), SZ, SZ]
libc.free.argtypes = [VP]


class Npu:
    def __init__(self, lib):
        self.lib = lib
        self.acl = acl = ctypes.CDLL(lib)
        acl.aclrtSetDevice.argtypes = [ctypes.c_int32]
        acl.aclrtMalloc.argtypes = [ctypes.POINTER(VP), SZ, ctypes.c_int]
        acl.aclrtFree.argtypes = [VP]
        acl.aclrtHostRegister.argtypes = [VP, U64, ctypes.c_int, ctypes.POINTER(VP)]
        acl.aclrtHostRegisterV2.argtypes = [VP, U64, ctypes.c_uint32]
        acl.aclrtHostUnregister.argtypes = [VP]

    def set_device(self, led, d):
        led.call(self.acl.aclrtSetDevice, "aclrtSetDevice", d, device=d)

    def malloc(self, led, d, size):
        p = VP()
        led.call(self.acl.aclrtMalloc, "aclrtMalloc", ctypes.byref(p), size, 0, out=p, device=d, size=size)
        return p

    def free(self, led, d, p, size):
        led.call(self.acl.aclrtFree, "aclrtFree", p, device=d, size=size, ptr=p.value)

    def host(self, led):
        a, b, alias = host_buffer(REGISTERED), host_buffer(PINNED), VP()
        flag = ACL_HOST_REG_PINNED | ACL_HOST_REG_MAPPED
        led.call(self.acl.aclrtHostRegisterV2, "aclrtHostRegisterV2", a, REGISTERED, flag, device=-1,
                 size=REGISTERED, ptr=a.value, flag=flag)
        t0 = time.time_ns()
        rc = self.acl.aclrtHostRegister(b, PINNED, ACL_HOST_REGISTER_MAPPED, ctypes.byref(alias))
        led.log(api="aclrtHostRegister", rc=rc, tid=threading.get_native_id(), t0=t0, t1=time.time_ns(), device=-1,
                size=PINNED, ptr=b.value, type=ACL_HOST_REGISTER_MAPPED, dev_ptr=alias.value if rc == 0 else None)
        if rc != 0:
            raise RuntimeError(f"aclrtHostRegister returned {rc}")
        return [a, b]

    def comm(self, led, devices):
        hccl = ctypes.CDLL(os.path.join(os.path.dirname(self.lib), "libhccl.so"))
        hccl.HcclCommInitRootInfo.argtypes = [ctypes.c_uint32, VP, ctypes.c_uint32, ctypes.POINTER(VP)]
        hccl.HcclCommDestroy.argtypes = [VP]
        root = ctypes.create_string_buffer(4108)
        led.call(hccl.HcclGetRootInfo, "HcclGetRootInfo", root, device=-1)
        comms = []
        for d in devices:
            self.set_device(led, d)
            comm = VP()
            led.call(hccl.HcclCommInitRootInfo, "HcclCommInitRootInfo", 1, root, 0, ctypes.byref(comm), device=d)
            comms.append(comm)
        return lambda: [led.call(hccl.HcclCommDestroy, "HcclCommDestroy", c, device=-1) for c in comms]

    def unhost(self, led, bufs):
        a, b = bufs
        for p, size in [(a, REGISTERED), (b, PINNED)]:
            led.call(self.acl.aclrtHostUnregister, "aclrtHostUnregister", p, device=-1, size=size, ptr=p.value)
            libc.free(p)


class Cuda:
    def __init__(self, lib_dir):
        self.lib_dir = lib_dir
        self.rt = rt = ctypes.CDLL(os.path.join(lib_dir, "libcudart.so.12"))
        self.drv = drv = ctypes.CDLL(os.path.join(lib_dir, "libcuda.so.1"))
        rt.cudaSetDevice.argtypes = [ctypes.c_int]
        rt.cudaMalloc.argtypes = [ctypes.POINTER(VP), SZ]
        rt.cudaFree.argtypes = [VP]
        rt.cudaHostRegister.argtypes = [VP, SZ, ctypes.c_uint]
        rt.cudaHostUnregister.argtypes = [VP]
        drv.cuMemHostAlloc.argtypes = [ctypes.POINTER(VP), SZ, ctypes.c_uint]
        drv.cuMemFreeHost.argtypes = [VP]

    def set_device(self, led, d):
        led.call(self.rt.cudaSetDevice, "cudaSetDevice", d, device=d)

    def malloc(self, led, d, size):
        p = VP()
        led.call(self.rt.cudaMalloc, "cudaMalloc", ctypes.byref(p), size, out=p, device=d, size=size)
        return p

    def free(self, led, d, p, size):
        led.call(self.rt.cudaFree, "cudaFree", p, device=d, size=size, ptr=p.value)

    def host(self, led):
        a, b = host_buffer(REGISTERED), VP()
        flags = CUDA_HOST_REGISTER_PORTABLE | CUDA_HOST_REGISTER_MAPPED
        led.call(self.rt.cudaHostRegister, "cudaHostRegister", a, REGISTERED, flags, device=-1, size=REGISTERED,
                 ptr=a.value, flags=flags)
        flags = CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP
        led.call(self.drv.cuMemHostAlloc, "cuMemHostAlloc", ctypes.byref(b), PINNED, flags, out=b, device=-1,
                 size=PINNED, flags=flags)
        return [a, b]

    def comm(self, led, devices):
        nccl = ctypes.CDLL(os.path.join(self.lib_dir, "libnccl.so.2"))
        nccl.ncclCommInitAll.argtypes = [ctypes.POINTER(VP), ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        nccl.ncclCommDestroy.argtypes = [VP]
        nccl.ncclMemAlloc.argtypes = [ctypes.POINTER(VP), SZ]
        nccl.ncclMemFree.argtypes = [VP]
        comms, devlist = (VP * len(devices))(), (ctypes.c_int * len(devices))(*devices)
        led.call(nccl.ncclCommInitAll, "ncclCommInitAll", comms, len(devices), devlist, device=-1)
        mem = VP()
        led.call(nccl.ncclMemAlloc, "ncclMemAlloc", ctypes.byref(mem), 3 * MiB, out=mem, device=devices[-1], size=3 * MiB)

        def destroy():
            led.call(nccl.ncclMemFree, "ncclMemFree", mem, device=devices[-1], ptr=mem.value)
            for c in comms:
                led.call(nccl.ncclCommDestroy, "ncclCommDestroy", c, device=-1)
        return destroy

    def unhost(self, led, bufs):
        a, b = bufs
        led.call(self.rt.cudaHostUnregister, "cudaHostUnregister", a, device=-1, size=REGISTERED, ptr=a.value)
        libc.free(a)
        led.call(self.drv.cuMemFreeHost, "cuMemFreeHost", b, device=-1, size=PINNED, ptr=b.value)


def hold(led, name, devices, ms):
    t0 = time.time_ns()
    time.sleep(ms / 1000)
    t1 = time.time_ns()
    for d in devices:
        led.log(phase="hold", hold=name, device=d, t0=t0, t1=t1)


def main():
    home = os.environ.get("ASCEND_HOME_PATH")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stack", choices=["npu", "cuda"], required=True)
    ap.add_argument("--ledger", required=True, help="where to write the JSON-lines ledger")
    ap.add_argument("--hold-ms", type=int, default=1500, help="milliseconds each hold lasts")
    ap.add_argument("--devices", type=int, choices=[1, 2], default=1, help="use device 0, or devices 0 and 1")
    ap.add_argument("--lib", default=os.path.join(home, "lib64", "libascendcl.so") if home else None,
                    help="npu: the stand-in libascendcl.so (default: from ASCEND_HOME_PATH)")
    ap.add_argument("--cuda-lib", help="cuda: the folder of the stand-in NVIDIA libraries")
    ap.add_argument("--comm", action="store_true",
                    help="have the communication library (stand-in HCCL or NCCL) take memory itself")
    ap.add_argument("--ready-file", help="written with the pid once the libraries are loaded")
    ap.add_argument("--go-file", help="make no call until this file exists")
    ap.add_argument("--go-timeout", type=float, default=30, help="seconds to wait for --go-file")
    args = ap.parse_args()
    if args.stack == "npu" and not args.lib:
        ap.error("npu: pass --lib or set ASCEND_HOME_PATH")
    if args.stack == "cuda" and not args.cuda_lib:
        ap.error("cuda: pass --cuda-lib")

    job = Npu(args.lib) if args.stack == "npu" else Cuda(args.cuda_lib)
    devices = list(range(args.devices))
    context_var = "STANDIN_HAL_CONTEXT_MEM" if args.stack == "npu" else "STANDIN_CUDA_CONTEXT_MEM"
    led = Ledger(args.ledger)
    led.log(phase="start", pid=os.getpid(), stack=args.stack, devices=devices,
            context_mem=os.environ.get(context_var, "0"), t=time.time_ns())
    if args.ready_file:
        with open(args.ready_file + ".part", "w") as f:
            f.write(str(os.getpid()))
        os.rename(args.ready_file + ".part", args.ready_file)
    if args.go_file:
        deadline = time.monotonic() + args.go_timeout
        while not os.path.exists(args.go_file):
            if time.monotonic() > deadline:
                print(f"no {args.go_file} after {args.go_timeout} s", file=sys.stderr)
                return 1
            time.sleep(0.01)

    buffers = []
    for d in devices:
        job.set_device(led, d)
        buffers += [(d, job.malloc(led, d, size), size) for size in BUFFERS]
    destroy_comm = job.comm(led, devices) if args.comm else (lambda: None)
    hold(led, "allocated", devices, args.hold_ms)
    host = job.host(led)
    hold(led, "registered", devices, args.hold_ms)
    job.unhost(led, host)
    destroy_comm()
    for d, p, size in buffers:
        job.free(led, d, p, size)
    hold(led, "freed", devices, args.hold_ms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
