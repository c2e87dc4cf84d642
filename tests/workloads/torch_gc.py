#!/usr/bin/env python3
"""REAL PyTorch CPU tensors, some held in reference cycles, for the check that the tracer marks
the frees CPython's garbage collector makes (tests/integration/tests/real_torch_gc.rs).

The test attaches `memscope-bpf trace --pid` to this process. Each step makes tensors in cycles
(a node pointing at itself) and plain ones, drops both; then one explicit collection frees the
cyclic ones. The ledger is the interpreter's own account: every tensor's storage pointer and
bytes, whether it was in a cycle, and, from each tensor's finalizer, whether a collection was
running (`gc.callbacks`) when its storage went back to c10::free_cpu.
"""

import argparse
import gc
import json
import os
import time
import weakref

import torch

import memscope

IN_GC = [False]


def phase(p, _info):
    IN_GC[0] = p == "start"


class Node:
    def __init__(self, numel):
        self.t = torch.empty(numel)
        self.me = self


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ledger", required=True)
    ap.add_argument("--ready", required=True)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    gc.disable()  # only the explicit collection below runs: the test knows when
    gc.callbacks.append(phase)
    with open(args.ready, "w") as f:
        f.write(str(os.getpid()))
    memscope.wait_for_tracer()
    time.sleep(0.3)
    tensors = []

    def track(t, cyclic):
        entry = {"ptr": t.untyped_storage().data_ptr(), "bytes": t.untyped_storage().nbytes(), "cyclic": cyclic}
        # The finalizer runs when the storage is released: inside a collection or not.
        weakref.finalize(t, lambda e=entry: e.update(freed_in_gc=IN_GC[0]))
        tensors.append(entry)

    for _ in range(args.steps):
        nodes = [Node(1 << 18) for _ in range(3)]
        for n in nodes:
            track(n.t, True)
        plain = torch.empty(1 << 17)
        track(plain, False)
        del nodes, plain, n
        memscope.step()
    gc.collect()
    time.sleep(0.3)
    with open(args.ledger, "w") as f:
        json.dump({"tensors": tensors}, f)


if __name__ == "__main__":
    main()
