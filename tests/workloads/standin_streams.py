#!/usr/bin/env python3
"""Gradients all-reduced on a communication stream, on the STAND-IN torch_npu caching allocator
(tests only), for the advisor's MULTI_STREAM_MEMORY_REUSE rule and the tracer's marking of
blocks freed while another stream still uses them.

Each step: gradient tensors are all-reduced (the stand-in collective marks each one on the
communication stream with recordStream, as ProcessGroupHCCL does), waited for, and freed; then
activations of the same sizes are allocated, which could reuse the gradients' memory; at the
step's end the device is synchronized. Scenarios:
- `after-wait`: gradients freed after work.wait(), the usual order. With
  MULTI_STREAM_MEMORY_REUSE=0 their marks stay, the allocator keeps them until the sync, and the
  activations need new segments; with 1 (the default) wait() erases the marks and they are reused.
- `early-free`: gradients freed before work.wait() (the collective still in flight). With 1 the
  freed blocks still wait for the sync; with 3 wait() hands them back.
- `no-comm`: the same tensors and no collective.

The ledger (JSON lines) is the workload's own (tensors, frees, steps); the allocator logs its
counters and which frees it deferred (STANDIN_TORCH_LEDGER). Neither comes from the tracer.
"""

import argparse
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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=["after-wait", "early-free", "no-comm"], required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--tensors", type=int, default=6, help="gradients (and activations) per step")
    parser.add_argument("--torch-lib", required=True)
    parser.add_argument("--ledger", required=True)
    parser.add_argument("--wait-tracer", action="store_true")
    args = parser.parse_args()
    if args.wait_tracer and memscope is not None:
        memscope.wait_for_tracer()

    _, torch = standin_ctypes.load(args.torch_lib)
    lines = []

    def log(**fields):
        fields.update(pid=os.getpid(), tid=threading.get_native_id(), t=time.time_ns())
        lines.append(fields)

    def alloc(size):
        ptr = torch.standin_tensor_alloc(size, 0)
        if not ptr:
            raise RuntimeError(f"stand-in allocator returned null for {size} bytes")
        log(kind="tensor", ptr=ptr, size=size)
        return ptr

    def free(ptr):
        torch.standin_tensor_free(ptr)
        log(kind="free", ptr=ptr)

    comm = args.scenario != "no-comm"
    size = 8 * MiB
    for step in range(1, args.steps + 1):
        grads = [alloc(size) for _ in range(args.tensors)]
        if comm:
            for g in grads:
                torch.standin_comm_start(g, 0)
            log(kind="comm_start", ptrs=grads)
        if args.scenario == "early-free":
            for g in grads:
                free(g)
        if comm:
            torch.standin_comm_wait(0)
            log(kind="comm_wait")
        if args.scenario != "early-free":
            for g in grads:
                free(g)
        acts = [alloc(size) for _ in range(args.tensors)]
        for a in acts:
            free(a)
        torch.standin_synchronize(0)
        log(kind="sync")
        if memscope is not None:
            memscope.step()
        log(kind="step", number=step)

    with open(args.ledger, "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
