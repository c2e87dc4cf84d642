#!/usr/bin/env python3
"""Allocation patterns that fragment (or do not fragment) the STAND-IN torch_npu caching allocator
(tests only), for the OOM forensics, the fragmentation analysis and the allocator-settings
advisor.

Scenarios, each built so that its allocator behaviour is known by construction:
- `holes`: 6 MiB tensors packed into 20 MiB segments, the last of each segment and the first of
  the next freed (holes of 8 and 6 MiB pinned between live tensors), then 11 MiB requests that
  fit no hole: reserved memory grows although enough of it is unused. With expandable_segments
  the segments are one range, each freed pair is one 12 MiB hole, and the requests fit.
- `bigsplit`: a 96 MiB tensor is freed (its segment stays cached), small tensors are carved from
  that big segment, and the next 96 MiB request needs a second big segment. max_split_size_mb
  keeps the big segment whole for the big request.
- `pressure`: per step, four tensors a little larger than the last step's; the cached blocks of
  earlier steps never fit, so reserved memory climbs to the per-process limit
  (STANDIN_PER_PROCESS_MEMORY_FRACTION) where the allocator must flush its cache to continue.
  garbage_collection_threshold flushes earlier.
- `clean`: same-size tensors that pack exactly and are reused every step: nothing to advise.
- `oom`: `holes`, then a request that fails for fragmentation (enough reserved but unused memory,
  no big-enough piece); everything freed and the cache emptied; then tagged tensors fill the
  device and one more request fails because the device is genuinely full. Needs a small
  STANDIN_ACL_DEVICE_MEM (the test sets it).
- `shared`: `clean` in this process and in a child process on the same device.

The ledger (JSON lines) is the workload's own: each tensor (ptr, requested size, t0/t1), each
free, each failed request with what the scenario made it (`expect`: fragmentation or full),
and step boundaries. The allocator logs its own events and counters (STANDIN_TORCH_LEDGER).
Neither comes from the tracer.
"""

import argparse
import ctypes
import json
import os
import subprocess
import sys
import threading
import time

MiB = 1 << 20
# torch_npu pads every request by 32 bytes before rounding it to 512.
NPU_PAD = 32

try:
    import memscope
except ImportError:  # run without the markers package: no steps, no owners
    memscope = None


def now():
    return time.time_ns()


class Job:
    def __init__(self, args):
        home = os.environ["ASCEND_HOME_PATH"]
        acl = ctypes.CDLL(os.path.join(home, "lib64", "libascendcl.so"))
        acl.aclrtSetDevice.argtypes = [ctypes.c_int32]
        if acl.aclrtSetDevice(args.device) != 0:
            raise RuntimeError(f"aclrtSetDevice({args.device}) failed")
        self.torch = ctypes.CDLL(args.torch_lib)
        self.torch.standin_tensor_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int]
        self.torch.standin_tensor_alloc.restype = ctypes.c_void_p
        self.torch.standin_tensor_free.argtypes = [ctypes.c_void_p]
        self.torch.standin_stats.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_size_t),
                                             ctypes.POINTER(ctypes.c_size_t)]
        self.device = args.device
        self.lines = []
        self.step_no = 0

    def log(self, **fields):
        fields["pid"] = os.getpid()
        self.lines.append(fields)

    def alloc(self, size, expect=None):
        """A tensor of `size` bytes, or None when the allocator gives up (logged as `oom`)."""
        t0 = now()
        ptr = self.torch.standin_tensor_alloc(size, self.device)
        t1 = now()
        if not ptr:
            self.log(kind="oom", req=size, device=self.device, tid=threading.get_native_id(),
                     expect=expect, t0=t0, t1=t1)
            return None
        if expect is not None:
            raise RuntimeError(f"the {size}-byte request was meant to fail ({expect}) but succeeded")
        self.log(kind="tensor", ptr=ptr, req=size, device=self.device, tid=threading.get_native_id(), t0=t0, t1=t1)
        return ptr

    def must_alloc(self, size):
        ptr = self.alloc(size)
        if ptr is None:
            raise RuntimeError(f"stand-in allocator returned null for {size} bytes")
        return ptr

    def free(self, ptr):
        t0 = now()
        self.torch.standin_tensor_free(ptr)
        self.log(kind="free", ptr=ptr, t0=t0, t1=now())

    def empty_cache(self):
        self.torch.standin_empty_cache()
        self.log(kind="empty_cache", t=now())

    def step(self):
        self.step_no += 1
        if memscope is not None:
            memscope.step()
        self.log(kind="step", number=self.step_no, t=now())

    def dump(self, path):
        with open(path, "w") as f:
            for line in self.lines:
                f.write(json.dumps(line) + "\n")


def holes(job, count=30, keep=6 * MiB, later=11 * MiB):
    """Returns the live tensors. Three `keep` tensors fill a 20 MiB segment (2 MiB left at its
    end); the last tensor of each segment and the first of the next are freed, so each hole is
    8 MiB (with the segment's tail) or 6 MiB, never `later`. With expandable segments the
    tensors are contiguous and each freed pair is one 12 MiB hole."""
    blocks = [job.must_alloc(keep) for _ in range(count)]
    job.step()
    freed = [p for i, p in enumerate(blocks) if i % 3 == 2 or (i % 3 == 0 and i > 0)]
    for p in freed:
        job.free(p)
    live = [p for p in blocks if p not in freed]
    job.step()
    if later:
        live += [job.must_alloc(later) for _ in range(count // 3 - 1)]
        job.step()
    return live


def bigsplit(job, rounds=3, big=96 * MiB, small=4 * MiB, smalls=8):
    live = []
    for _ in range(rounds):
        b = job.must_alloc(big)
        job.free(b)
        parts = [job.must_alloc(small) for _ in range(smalls)]
        b = job.must_alloc(big)
        job.step()
        for p in parts:
            job.free(p)
        job.free(b)
        job.step()
    return live


def pressure(job, steps=12, first=30 * MiB, grow=6 * MiB, per_step=2):
    for s in range(steps):
        size = first + s * grow
        blocks = [job.must_alloc(size) for _ in range(per_step)]
        job.step()
        for p in blocks:
            job.free(p)
    return []


def clean(job, steps=6, size=4 * MiB - NPU_PAD, per_step=15):
    """Five tensors, padded to 4 MiB, fill each 20 MiB segment exactly: no holes, nothing to
    advise."""
    for _ in range(steps):
        blocks = [job.must_alloc(size) for _ in range(per_step)]
        job.step()
        for p in blocks:
            job.free(p)
    return []


def label(name):
    if memscope is None:
        class Nothing:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False
        return Nothing()
    return memscope.describe(name)


def oom(job):
    # Fragmentation: 10 segments (200 MiB) hold 66 MiB of tensors; 64 MiB more does not fit the
    # device (STANDIN_ACL_DEVICE_MEM = 256 MiB), and no hole is bigger than 8 MiB.
    live = holes(job, later=0)
    job.alloc(64 * MiB, expect="fragmentation")
    job.step()
    for p in live:
        job.free(p)
    job.empty_cache()
    job.step()
    # Genuinely full: tensors that torch_npu pads (32 bytes) to 10 MiB fill 10 MiB segments
    # exactly (no split, no slack).
    kept = []
    exact = 10 * MiB - NPU_PAD
    with label("weights"):
        kept += [job.must_alloc(exact) for _ in range(16)]
    with label("activations"):
        kept += [job.must_alloc(exact) for _ in range(9)]
    job.alloc(20 * MiB, expect="full")
    job.step()
    return kept


def shared(job, args):
    child_args = [sys.executable, os.path.abspath(__file__), "--scenario", "clean", "--torch-lib", args.torch_lib,
                  "--ledger", args.ledger + ".child", "--device", str(args.device)]
    if args.wait_tracer:
        child_args.append("--wait-tracer")
    child = subprocess.Popen(child_args)
    live = clean(job)
    if child.wait() != 0:
        raise RuntimeError("the child process failed")
    return live


SCENARIOS = {"holes": holes, "bigsplit": bigsplit, "pressure": pressure, "clean": clean, "oom": oom}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", choices=sorted(SCENARIOS) + ["shared"], required=True)
    ap.add_argument("--torch-lib", required=True)
    ap.add_argument("--ledger", required=True)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--wait-tracer", action="store_true",
                    help="wait until a tracer has attached the markers (traced runs)")
    ap.add_argument("--hold", type=float, default=0.0,
                    help="after the scenario and its ledger, sleep this long before exiting (a live view's)")
    args = ap.parse_args()
    if args.wait_tracer and memscope is not None and not memscope.wait_for_tracer(timeout=30):
        print("no tracer attached to the markers within 30 s", file=sys.stderr)
        return 1
    job = Job(args)
    job.log(kind="scenario", name=args.scenario, conf=os.environ.get("PYTORCH_NPU_ALLOC_CONF", ""), t=now())
    if args.scenario == "shared":
        live = shared(job, args)
    else:
        live = SCENARIOS[args.scenario](job)
    for p in live:
        job.free(p)
    job.dump(args.ledger)
    time.sleep(args.hold)
    return 0


if __name__ == "__main__":
    sys.exit(main())
