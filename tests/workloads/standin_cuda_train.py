#!/usr/bin/env python3
"""A training-shaped job on the STAND-IN NVIDIA libraries (tests only): PyTorch-like tensors
from the stand-in caching allocator (libc10_cuda.so, with PyTorch's USDT probes), plus the
direct runtime and driver calls other code in such a job makes. No GPU is involved.

What it does, in order (every size a multiple of 512, so a block's size is its request):
1. `cudaFree(NULL)` (creates the context: no memory), then waits until a tracer raised the
   allocator's semaphores and the markers' (at most 10 s; the ledger says whether it did).
2. Device 0, caching pool: three 4 MiB weights under the tag `weight`, then three steps that
   allocate and free a 256 KiB, a 3 MiB and a 40 MiB activation under `activation` (the first
   step takes segments, the next reuse the cached blocks), then `empty_cache` after the last
   step (the activations' segments go back).
3. Device 1 with expandable segments: a 3 MiB tensor (a 20 MiB segment as ten mapped 2 MiB
   pages), freed, then `empty_cache` (the pages are unmapped and released).
4. The runtime directly: cudaMalloc/cudaFree (8 MiB), cudaMallocAsync/cudaFreeAsync (1 MiB),
   cudaMallocManaged (2 MiB), cudaMallocHost (64 KiB) and cudaHostAlloc (128 KiB) with
   cudaFreeHost; each runtime call makes one driver call through a function pointer.
5. The driver directly, as NCCL does: cuMemAlloc_v2/cuMemFree_v2 (1 MiB), and a reserved
   range with one 2 MiB physical page created on device 1, mapped, unmapped and released.
6. Device 0 asks for more than the device has (`--oom-bytes`): the allocator's cudaMalloc
   fails, it empties its cache and retries once, then gives up (the request returns NULL).
7. The weights are freed and the cache emptied.

The ground truth is in the stand-ins' own ledgers (STANDIN_C10_CUDA_LEDGER,
STANDIN_CUDART_LEDGER, STANDIN_CUDA_LEDGER); this script's ledger (`--ledger`) adds whether the
probes were live, the allocator's allocated/reserved bytes after each step, and the OOM.
"""

import argparse
import ctypes
import json
import os
import time

try:
    import memscope
except ImportError:  # run without the markers package: no tags or steps
    memscope = None

MiB = 1 << 20
VP, SZ, U64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64


class Prop(ctypes.Structure):
    """CUmemAllocationProp: the device is location.id."""
    _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int), ("location_type", ctypes.c_int),
                ("location_id", ctypes.c_int), ("win32", VP), ("flags", ctypes.c_uint8 * 8)]


class Job:
    def __init__(self, lib_dir, ledger):
        # Loading the allocator loads the runtime and the driver it needs, as torch does.
        self.c10 = ctypes.CDLL(os.path.join(lib_dir, "libc10_cuda.so"))
        self.rt = ctypes.CDLL(os.path.join(lib_dir, "libcudart.so.12"))
        self.drv = ctypes.CDLL(os.path.join(lib_dir, "libcuda.so.1"))
        self.c10.standin_c10_cuda_allocate.argtypes = [SZ, ctypes.c_int]
        self.c10.standin_c10_cuda_allocate.restype = VP
        self.c10.standin_c10_cuda_free.argtypes = [VP]
        self.c10.standin_c10_cuda_stats.argtypes = [ctypes.c_int, ctypes.POINTER(U64), ctypes.POINTER(U64)]
        for name in ["cudaMalloc", "cudaMallocHost"]:
            getattr(self.rt, name).argtypes = [ctypes.POINTER(VP), SZ]
        self.rt.cudaMallocAsync.argtypes = [ctypes.POINTER(VP), SZ, VP]
        self.rt.cudaMallocManaged.argtypes = [ctypes.POINTER(VP), SZ, ctypes.c_uint]
        self.rt.cudaHostAlloc.argtypes = [ctypes.POINTER(VP), SZ, ctypes.c_uint]
        for name in ["cudaFree", "cudaFreeHost"]:
            getattr(self.rt, name).argtypes = [VP]
        self.rt.cudaFreeAsync.argtypes = [VP, VP]
        self.drv.cuMemAlloc_v2.argtypes = [ctypes.POINTER(U64), SZ]
        self.drv.cuMemFree_v2.argtypes = [U64]
        self.drv.cuMemAddressReserve.argtypes = [ctypes.POINTER(U64), SZ, SZ, U64, U64]
        self.drv.cuMemAddressFree.argtypes = [U64, SZ]
        self.drv.cuMemCreate.argtypes = [ctypes.POINTER(U64), SZ, ctypes.POINTER(Prop), U64]
        self.drv.cuMemRelease.argtypes = [U64]
        self.drv.cuMemMap.argtypes = [U64, SZ, SZ, U64, U64]
        self.drv.cuMemUnmap.argtypes = [U64, SZ]
        self.ledger = open(ledger, "w")

    def log(self, **line):
        line.setdefault("t", time.time_ns())
        self.ledger.write(json.dumps(line) + "\n")
        self.ledger.flush()

    def stats(self, device, what):
        allocated, reserved = U64(), U64()
        self.c10.standin_c10_cuda_stats(device, ctypes.byref(allocated), ctypes.byref(reserved))
        self.log(kind="stats", what=what, device=device, allocated=allocated.value, reserved=reserved.value)

    def tensor(self, size, device=0):
        ptr = self.c10.standin_c10_cuda_allocate(size, device)
        if not ptr:
            raise MemoryError(f"the stand-in allocator refused {size} bytes on device {device}")
        return ptr

    def wait_for_probes(self):
        live = False
        deadline = time.monotonic() + 10
        while not live and time.monotonic() < deadline:
            live = bool(self.c10.standin_c10_cuda_probes_live())
            time.sleep(0.01)
        self.log(kind="probes", live=live)

    def check(self, rc, what):
        if rc != 0:
            raise RuntimeError(f"{what} returned {rc}")


def span(label):
    return memscope.describe(label) if memscope is not None else _Nothing()


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def caching_pool(job, steps):
    with span("weight"):
        weights = [job.tensor(4 * MiB) for _ in range(3)]
    job.stats(0, "weights")
    for step in range(steps):
        with span("activation"):
            acts = [job.tensor(256 << 10), job.tensor(3 * MiB), job.tensor(40 * MiB)]
        job.stats(0, f"step {step + 1} peak")
        for a in acts:
            job.c10.standin_c10_cuda_free(a)
        if memscope is not None:
            memscope.step()
    job.c10.standin_c10_cuda_empty_cache()
    job.stats(0, "after empty_cache")
    return weights


def expandable(job):
    job.c10.standin_c10_cuda_set_expandable(1)
    t = job.tensor(3 * MiB, device=1)
    job.stats(1, "expandable")
    job.c10.standin_c10_cuda_free(t)
    job.c10.standin_c10_cuda_empty_cache()
    job.stats(1, "expandable released")
    job.c10.standin_c10_cuda_set_expandable(0)


def runtime_calls(job):
    rt, p = job.rt, VP()
    job.check(rt.cudaSetDevice(0), "cudaSetDevice")
    job.check(rt.cudaMalloc(ctypes.byref(p), 8 * MiB), "cudaMalloc")
    job.check(rt.cudaFree(p), "cudaFree")
    job.check(rt.cudaMallocAsync(ctypes.byref(p), MiB, None), "cudaMallocAsync")
    job.check(rt.cudaFreeAsync(p, None), "cudaFreeAsync")
    job.check(rt.cudaMallocManaged(ctypes.byref(p), 2 * MiB, 1), "cudaMallocManaged")
    job.check(rt.cudaFree(p), "cudaFree")
    job.check(rt.cudaMallocHost(ctypes.byref(p), 64 << 10), "cudaMallocHost")
    job.check(rt.cudaFreeHost(p), "cudaFreeHost")
    job.check(rt.cudaHostAlloc(ctypes.byref(p), 128 << 10, 0), "cudaHostAlloc")
    job.check(rt.cudaFreeHost(p), "cudaFreeHost")


def driver_calls(job):
    drv, d = job.drv, U64()
    job.check(drv.cuMemAlloc_v2(ctypes.byref(d), MiB), "cuMemAlloc_v2")
    job.check(drv.cuMemFree_v2(d), "cuMemFree_v2")
    va, handle = U64(), U64()
    job.check(drv.cuMemAddressReserve(ctypes.byref(va), 64 * MiB, 2 * MiB, 0, 0), "cuMemAddressReserve")
    prop = Prop(type=1, location_type=1, location_id=1)
    job.check(drv.cuMemCreate(ctypes.byref(handle), 2 * MiB, ctypes.byref(prop), 0), "cuMemCreate")
    job.check(drv.cuMemMap(va, 2 * MiB, 0, handle, 0), "cuMemMap")
    job.check(drv.cuMemUnmap(va, 2 * MiB), "cuMemUnmap")
    job.check(drv.cuMemRelease(handle), "cuMemRelease")
    job.check(drv.cuMemAddressFree(va, 64 * MiB), "cuMemAddressFree")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cuda-lib", required=True, help="the folder of the stand-in NVIDIA libraries")
    parser.add_argument("--ledger", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--oom-bytes", type=int, default=16 << 30, help="a request larger than the device")
    args = parser.parse_args()

    job = Job(args.cuda_lib, args.ledger)
    job.check(job.rt.cudaFree(None), "cudaFree(NULL)")
    job.wait_for_probes()
    if memscope is not None:
        memscope.wait_for_tracer()
    weights = caching_pool(job, args.steps)
    expandable(job)
    runtime_calls(job)
    driver_calls(job)
    t0 = time.time_ns()
    refused = not job.c10.standin_c10_cuda_allocate(args.oom_bytes, 0)
    job.log(kind="oom", size=args.oom_bytes, refused=refused, t0=t0)
    job.stats(0, "after the OOM")
    for w in weights:
        job.c10.standin_c10_cuda_free(w)
    job.c10.standin_c10_cuda_empty_cache()
    job.stats(0, "end")


if __name__ == "__main__":
    main()
