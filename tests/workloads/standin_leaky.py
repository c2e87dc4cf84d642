#!/usr/bin/env python3
"""A training loop on the STAND-IN torch_npu allocator (tests only) that leaks, or does not.

Both variants run the same steps with the same seeded noise; only `--variant leaky` keeps memory:
- warm-up (step 1): weights, optimizer state and one kv_cache block, kept to the end (never
  leaks: born in the warm-up), and a profile run that sizes the allocator's cache;
- every step: 3..6 activations of random sizes, allocated and freed within the step; one
  `carry` tensor of random size that lives into the next step (crosses one step boundary, never a
  whole step); a 1 MiB device buffer from aclrtMalloc, freed within the step;
- leaky only: from step 2 on, one 2 MiB `kv_cache` block per step that is never freed, and at
  step 3 a 1 MiB aclrtMalloc buffer that is never freed;
- `memscope.step()` ends every step (its number is the step that ended).
With `--hold S` the job stops for S seconds after its last step, before anything is freed, so a
live view can be read against the ledger written then (`--ready-file` says when).
At the end everything else is freed and the allocator's cache emptied.

The ledger (JSON lines) is the ground truth, made by construction, not by the tracer:
  {"kind": "tensor", "ptr", "req", "owner", "step", "leak", "t0", "t1"}   a tensor allocated
  {"kind": "free", "ptr", "t0", "t1"}                                       a tensor freed
  {"kind": "hal_malloc", "ptr", "size", "step", "leak", "t0", "t1"}        an aclrtMalloc
  {"kind": "hal_free", "ptr", "t0", "t1"}
  {"kind": "step", "step", "t0", "t1"}                                      memscope.step() ending it
The allocator's own ledger (STANDIN_TORCH_LEDGER) gives block sizes and segments.
"""

import argparse
import ctypes
import json
import os
import random
import sys
import time

import memscope

KIB = 1 << 10
MIB = 1 << 20


def now():
    return time.time_ns()


class Job:
    def __init__(self, args):
        home = os.environ["ASCEND_HOME_PATH"]
        self.acl = ctypes.CDLL(os.path.join(home, "lib64", "libascendcl.so"))
        self.acl.aclrtSetDevice.argtypes = [ctypes.c_int32]
        self.acl.aclrtMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int]
        self.acl.aclrtFree.argtypes = [ctypes.c_void_p]
        self.torch = ctypes.CDLL(args.torch_lib)
        self.torch.standin_tensor_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int]
        self.torch.standin_tensor_alloc.restype = ctypes.c_void_p
        self.torch.standin_tensor_free.argtypes = [ctypes.c_void_p]
        self.lines = []
        self.step = 1
        self.device = args.device

    def log(self, **fields):
        self.lines.append(fields)

    def tensor(self, size, owner, leak=False):
        with memscope.describe(owner):
            t0 = now()
            ptr = self.torch.standin_tensor_alloc(size, self.device)
            t1 = now()
        if not ptr:
            raise RuntimeError(f"stand-in allocator returned null for {size} bytes")
        self.log(kind="tensor", ptr=ptr, req=size, owner=f"PTA@{owner}", step=self.step, leak=leak, t0=t0, t1=t1)
        return ptr

    def free(self, ptr):
        t0 = now()
        self.torch.standin_tensor_free(ptr)
        self.log(kind="free", ptr=ptr, t0=t0, t1=now())

    def hal_malloc(self, size, leak=False):
        p = ctypes.c_void_p()
        t0 = now()
        rc = self.acl.aclrtMalloc(ctypes.byref(p), size, 0)
        t1 = now()
        if rc != 0 or not p.value:
            raise RuntimeError(f"aclrtMalloc({size}) failed: {rc}")
        self.log(kind="hal_malloc", ptr=p.value, size=size, step=self.step, leak=leak, t0=t0, t1=t1)
        return p.value

    def hal_free(self, ptr):
        t0 = now()
        rc = self.acl.aclrtFree(ptr)
        if rc != 0:
            raise RuntimeError(f"aclrtFree({ptr:#x}) failed: {rc}")
        self.log(kind="hal_free", ptr=ptr, t0=t0, t1=now())

    def end_step(self):
        t0 = now()
        n = memscope.step()
        self.log(kind="step", step=n, t0=t0, t1=now())
        if n != self.step:
            raise RuntimeError(f"memscope.step() returned {n} at step {self.step}")
        self.step += 1


def train(job, args):
    rng = random.Random(args.seed)
    leaky = args.variant == "leaky"
    sizes = [256 * KIB, 512 * KIB, 1 * MIB, 2 * MIB, 3 * MIB]
    # Warm-up: what a model keeps for the whole run, and a profile run that sizes the cache.
    kept = [job.tensor(n, "weight") for n in (4 * MIB, 2 * MIB, 1 * MIB, 512 * KIB)]
    kept += [job.tensor(4 * MIB, "optimizer_state") for _ in range(2)]
    kept.append(job.tensor(2 * MIB, "kv_cache"))
    for p in [job.tensor(3 * MIB, "activation") for _ in range(8)]:
        job.free(p)
    carry = None
    for step in range(1, args.steps + 1):
        acts = [job.tensor(rng.choice(sizes), "activation") for _ in range(rng.randint(3, 6))]
        for p in acts:
            job.free(p)
        if carry is not None:
            job.free(carry)
        carry = job.tensor(rng.choice(sizes[1:]), "carry")
        comm = job.hal_malloc(1 * MIB)
        job.hal_free(comm)
        if leaky and step >= 2:
            job.tensor(2 * MIB, "kv_cache", leak=True)
        if leaky and step == 3:
            job.hal_malloc(1 * MIB, leak=True)
        job.end_step()
    if args.hold:
        # Every step is done and nothing more is freed: what a live view sees now is the ledger
        # so far, written before the ready file says so.
        write_ledger(job, args.ledger)
        with open(args.ready_file, "w") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(args.hold)
    job.free(carry)
    for p in kept:
        job.free(p)
    job.torch.standin_empty_cache()


def write_ledger(job, path):
    with open(path, "w") as f:
        for line in job.lines:
            f.write(json.dumps(line) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", choices=["leaky", "clean"], required=True)
    ap.add_argument("--torch-lib", required=True)
    ap.add_argument("--ledger", required=True)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--device", type=int, default=0, help="the device its tensors and buffers are on")
    ap.add_argument("--tracer-timeout", type=float, default=30.0)
    ap.add_argument("--hold", type=float, default=0.0, help="after the last step, sleep this long before freeing")
    ap.add_argument("--ready-file", help="with --hold: the pid goes here once the ledger so far is written")
    args = ap.parse_args()
    if args.hold and not args.ready_file:
        ap.error("--hold needs --ready-file")

    job = Job(args)
    job.acl.aclrtSetDevice(args.device)
    if not memscope.wait_for_tracer(timeout=args.tracer_timeout):
        print(f"standin_leaky: no tracer attached within {args.tracer_timeout} s", file=sys.stderr)
        return 1
    time.sleep(0.1)  # the last attachment completes
    train(job, args)
    write_ledger(job, args.ledger)
    return 0


if __name__ == "__main__":
    sys.exit(main())
