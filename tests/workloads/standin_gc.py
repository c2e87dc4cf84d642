#!/usr/bin/env python3
"""A training loop whose activations are (or are not) caught in Python reference cycles, on the
STAND-IN torch_npu caching allocator (tests only), for the advisor's "gc.collect() at epoch
ends" rule and the tracer's marking of frees made by the garbage collector.

Each step allocates activation tensors and drops them at its end; a weight tensor lives
throughout. Scenarios:
- `cycles`: every activation sits in a reference cycle (a graph node that points back at
  itself, as closures captured in hooks do), so dropping it frees nothing: only a pass of the
  cyclic garbage collector does, triggered by the loop's own Python objects (a growing metrics
  history), some steps later. Garbage from earlier steps piles up under the peak.
- `cycles --gc-at-step-end`: the same, with `gc.collect()` after each step: what the advice
  asks for.
- `clean`: no cycles; each activation is freed when dropped.

The ledger (JSON lines) is the workload's own: each tensor (ptr, size, step of birth), each
free with whether CPython's garbage collector was running (from `gc.callbacks`, the
interpreter's own report, not the tracer), each step, and the allocator's allocated and
reserved bytes after every allocation (`standin_stats`).
"""

import argparse
import gc
import json
import os
import threading
import time

import standin_ctypes

MiB = 1 << 20

try:
    import memscope
except ImportError:  # run without the markers package: no steps
    memscope = None

IN_GC = False


def _gc_phase(phase, _info):
    global IN_GC
    IN_GC = phase == "start"


class Job:
    def __init__(self, args):
        _, self.torch = standin_ctypes.load(args.torch_lib)
        self.lines = []
        self.step_no = 0

    def log(self, **fields):
        fields["pid"] = os.getpid()
        self.lines.append(fields)

    def stats(self):
        return standin_ctypes.stats(self.torch)

    def alloc(self, size):
        ptr = self.torch.standin_tensor_alloc(size, 0)
        if not ptr:
            raise RuntimeError(f"stand-in allocator returned null for {size} bytes")
        allocated, reserved = self.stats()
        self.log(kind="tensor", ptr=ptr, size=standin_ctypes.block_size(size), step=self.step_no, tid=threading.get_native_id(),
                 t=time.time_ns(), allocated=allocated, reserved=reserved)
        return ptr

    def free(self, ptr, size):
        by_gc = IN_GC
        self.torch.standin_tensor_free(ptr)
        self.log(kind="free", ptr=ptr, size=standin_ctypes.block_size(size), gc=by_gc, step=self.step_no, t=time.time_ns())

    def step(self):
        self.step_no += 1
        if memscope is not None:
            memscope.step()
        self.log(kind="step", number=self.step_no, t=time.time_ns())

    def dump(self, path):
        with open(path, "w") as f:
            for line in self.lines:
                f.write(json.dumps(line) + "\n")


class Tensor:
    """A stand-in tensor: its block goes back to the allocator when the object is finalized."""

    def __init__(self, job, size):
        self.job, self.size = job, size
        self.ptr = job.alloc(size)

    def __del__(self):
        self.job.free(self.ptr, self.size)


class Node:
    """An autograd-like graph node holding an activation; `cyclic` makes it point back at itself."""

    def __init__(self, tensor, cyclic):
        self.tensor = tensor
        self.me = self if cyclic else None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=["cycles", "clean"], required=True)
    parser.add_argument("--gc-at-step-end", action="store_true", help="gc.collect() after each step")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--torch-lib", required=True)
    parser.add_argument("--ledger", required=True)
    parser.add_argument("--wait-tracer", action="store_true")
    args = parser.parse_args()

    if args.wait_tracer and memscope is not None:
        memscope.wait_for_tracer()
    # Collections come from the loop's own object churn: a collection of the youngest
    # generation every few steps, of the older ones rarely.
    gc.collect()
    gc.set_threshold(400, 4, 10)
    gc.callbacks.append(_gc_phase)
    job = Job(args)
    cyclic = args.scenario == "cycles"
    weight = Tensor(job, 16 * MiB)
    history = []
    for _ in range(args.steps):
        nodes = [Node(Tensor(job, 8 * MiB), cyclic) for _ in range(4)]
        # Per-step metrics kept for the whole run: net growth of tracked objects, which is what
        # starts automatic collections.
        history.extend({"loss": float(i)} for i in range(150))
        del nodes
        job.step()
        if args.gc_at_step_end:
            gc.collect()
    del weight
    gc.collect()
    gc.callbacks.remove(_gc_phase)
    job.dump(args.ledger)


if __name__ == "__main__":
    main()
