#!/usr/bin/env python3
"""Inefficient memory injected on purpose (tests only): tensors on the STAND-IN torch_npu
caching allocator, used inside operators announced through the markers' operator probes
(`memscope._native.op_start/op_end/tensor_access`, what `memscope.torch.trace_ops()` fires), in
a sequence built so that exactly some blocks are early, late, idle, lazy, delayed or long idle.

The ledger names each block (its address and allocation time) and the flags its scenario was
built to have, by construction: the API index advances by one per operator (every event here is
inside one), and the sequence below is laid out so that each block meets exactly its intended
condition. The time-based scenarios sleep far longer (0.4 s) than anything else takes.
"""

import argparse
import ctypes
import json
import os
import sys
import time

import memscope
from memscope import _native

SLEEP = 0.4


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--torch-lib", required=True)
    ap.add_argument("--ledger", required=True)
    args = ap.parse_args()

    home = os.environ["ASCEND_HOME_PATH"]
    ctypes.CDLL(os.path.join(home, "lib64", "libascendcl.so")).aclrtSetDevice(0)
    torch = ctypes.CDLL(args.torch_lib)
    torch.standin_tensor_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int]
    torch.standin_tensor_alloc.restype = ctypes.c_void_p
    torch.standin_tensor_free.argtypes = [ctypes.c_void_p]
    if not memscope.wait_for_tracer(timeout=30):
        sys.exit("standin_inefficient: no tracer attached to the markers")
    time.sleep(0.1)

    blocks = {}

    def op(name, alloc=(), read=(), write=(), free=()):
        _native.op_start(name)
        for label, size in alloc:
            t0 = time.time_ns()
            ptr = torch.standin_tensor_alloc(size, 0)
            blocks[label] = {"label": label, "ptr": ptr, "size": size, "t0": t0, "t1": time.time_ns(), "flags": []}
        for label in read:
            _native.tensor_access(blocks[label]["ptr"], blocks[label]["size"], 0, "float32[16]")
        for label in write:
            _native.tensor_access(blocks[label]["ptr"], blocks[label]["size"], 1, "float32[16]")
        for label in free:
            torch.standin_tensor_free(blocks[label]["ptr"])
        _native.op_end(name)

    def idle_ops(n):
        for _ in range(n):
            _native.op_start("aten.empty_op")
            _native.op_end("aten.empty_op")

    kib = 1024
    # early_allocation: E is allocated, another block is freed, then E is first used.
    op("aten.a", alloc=[("Y", 64 * kib)])
    op("aten.b", alloc=[("E", 96 * kib)])
    op("aten.c", free=["Y"])
    op("aten.d", read=["E"])
    op("aten.e", free=["E"])
    # control: N is used right after its allocation.
    op("aten.f", alloc=[("N", 80 * kib)])
    op("aten.g", read=["N"])
    op("aten.h", free=["N"])
    # late_deallocation: L's last use, then another allocation, then L's free.
    op("aten.i", alloc=[("L", 112 * kib)])
    op("aten.j", write=["L"])
    op("aten.k", alloc=[("Z", 48 * kib)])
    op("aten.l", free=["L"])
    # control: M is freed right after its last use.
    op("aten.m", alloc=[("M", 72 * kib)])
    op("aten.n", write=["M"])
    op("aten.o", free=["M"])
    # temporary_idleness: 3001 operators between two uses of I (threshold 3000).
    op("aten.p", alloc=[("I", 88 * kib)])
    op("aten.q", read=["I"])
    idle_ops(3001)
    op("aten.r", read=["I"])
    op("aten.s", free=["I"])
    # control: 2000 operators between two uses of J.
    op("aten.t", alloc=[("J", 56 * kib)])
    op("aten.u", read=["J"])
    idle_ops(2000)
    op("aten.v", read=["J"])
    op("aten.w", free=["J"])
    op("aten.x", free=["Z"])
    # Time-based: lazy (first use long after allocation), delayed (free long after the last
    # use), long idle (a long gap between uses), and a quick control.
    op("aten.y", alloc=[("T_lazy", 40 * kib)])
    time.sleep(SLEEP)
    op("aten.z", read=["T_lazy"])
    op("aten.z2", free=["T_lazy"])
    op("aten.y3", alloc=[("T_delayed", 40 * kib)])
    op("aten.y4", read=["T_delayed"])
    time.sleep(SLEEP)
    op("aten.y5", free=["T_delayed"])
    op("aten.y6", alloc=[("T_idle", 40 * kib)])
    op("aten.y7", read=["T_idle"])
    time.sleep(SLEEP)
    op("aten.y8", read=["T_idle"])
    op("aten.y9", free=["T_idle"])
    op("aten.ya", alloc=[("T_quick", 40 * kib)])
    op("aten.yb", read=["T_quick"])
    op("aten.yc", free=["T_quick"])

    truth = {"E": ["early_allocation"], "L": ["late_deallocation"], "I": ["temporary_idleness"],
             "T_lazy": ["lazy_used"], "T_delayed": ["delayed_free"], "T_idle": ["long_idle"]}
    for label, flags in truth.items():
        blocks[label]["flags"] = flags
    with open(args.ledger, "w") as out:
        for b in blocks.values():
            out.write(json.dumps(b) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
