#!/usr/bin/env python3
"""An inference loop that runs STAND-IN ATB graph operations (tests only) on workspaces from the
STAND-IN torch_npu workspace allocator, for the advisor's ATB_WORKSPACE_MEM_ALLOC_ALG_TYPE rule
and the tracer's ATB_START/ATB_END rows.

The job keeps 32 MiB of weights, and per step allocates a 4 MiB activation, then runs two graph
operations the way op-plugin runs ATB operations: Setup says how much workspace the operation
needs (kernel scratch plus intermediate tensors, the latter laid out by the stand-in's model of
ATB_WORKSPACE_MEM_ALLOC_ALG_TYPE, read from this process's environment), the caller takes that
much from torch_npu's workspace allocator (allocate_workspace), Execute runs on it
(atb::Runner::Execute), and the workspace use ends. Scenarios:
- `large`: the layer graph's tensors are 1 MiB per unit (44 MiB of intermediates with the
  default layout), a large share of the device peak;
- `small`: 64 KiB per unit, a small share.

The ledger (JSON lines) is the workload's own: every setup and execution as the stand-in ATB
reported them (the pack it ran with, its own execution count), every workspace use, and the
stand-in torch_npu's allocated and reserved bytes (`standin_stats`). The pool's own ledger
(STANDIN_TORCH_LEDGER) has both pools' counters at each event.
"""

import argparse
import ctypes
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


class Execution(ctypes.Structure):
    _fields_ = [
        ("runner", ctypes.c_uint64),
        ("workspace_ptr", ctypes.c_uint64),
        ("workspace_size", ctypes.c_uint64),
        ("intermediate_ptr", ctypes.c_uint64),
        ("intermediate_size", ctypes.c_uint64),
        ("execute_count", ctypes.c_uint64),
        ("t0", ctypes.c_uint64),
        ("t1", ctypes.c_uint64),
        ("status", ctypes.c_int32),
        ("alg_type", ctypes.c_int32),
    ]


class Job:
    def __init__(self, args):
        _, self.torch = standin_ctypes.load(args.torch_lib)
        a = ctypes.CDLL(args.atb_lib)
        a.standin_atb_graph_create.argtypes = [ctypes.c_uint64]
        a.standin_atb_graph_create.restype = ctypes.c_void_p
        a.standin_atb_graph_setup.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64),
                                              ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_int32)]
        a.standin_atb_graph_setup.restype = ctypes.c_uint64
        a.standin_atb_graph_execute.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64,
                                                ctypes.POINTER(Execution)]
        a.standin_atb_graph_execute.restype = ctypes.c_int32
        self.atb = a
        self.lines = []

    def log(self, **fields):
        fields["pid"] = os.getpid()
        self.lines.append(fields)

    def stats(self):
        return standin_ctypes.stats(self.torch)

    def tensor(self, size):
        ptr = self.torch.standin_tensor_alloc(size, 0)
        if not ptr:
            raise RuntimeError(f"stand-in allocator returned null for {size} bytes")
        allocated, reserved = self.stats()
        self.log(kind="tensor", ptr=ptr, size=size, t=time.time_ns(), allocated=allocated, reserved=reserved)
        return ptr

    def run_graph(self, graph, name):
        """One ATB operation, as op-plugin runs it: Setup, a workspace, Execute, the workspace back."""
        scratch, intermediate, alg = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_int32()
        size = self.atb.standin_atb_graph_setup(graph, ctypes.byref(scratch), ctypes.byref(intermediate),
                                                ctypes.byref(alg))
        self.log(kind="setup", graph=name, size=size, workspace_size=scratch.value,
                 intermediate_size=intermediate.value, alg_type=alg.value)
        holder = self.torch.standin_workspace_alloc(size, 0)
        ptr = self.torch.standin_workspace_ptr(holder)
        if not ptr:
            raise RuntimeError(f"stand-in workspace allocator returned null for {size} bytes")
        out = Execution()
        status = self.atb.standin_atb_graph_execute(graph, ptr, size, ctypes.byref(out))
        if status != 0:
            raise RuntimeError(f"stand-in ATB Execute failed: {status}")
        self.log(kind="execute", graph=name, tid=threading.get_native_id(),
                 **{f: getattr(out, f) for f, _ in Execution._fields_})
        self.torch.standin_workspace_free(holder, 0)

    def dump(self, path):
        with open(path, "w") as f:
            for line in self.lines:
                f.write(json.dumps(line) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=["large", "small"], required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--torch-lib", required=True)
    parser.add_argument("--atb-lib", required=True)
    parser.add_argument("--ledger", required=True)
    parser.add_argument("--wait-tracer", action="store_true")
    args = parser.parse_args()

    if args.wait_tracer and memscope is not None:
        memscope.wait_for_tracer()
    job = Job(args)
    unit = MiB if args.scenario == "large" else 64 << 10
    layer = job.atb.standin_atb_graph_create(unit)
    head = job.atb.standin_atb_graph_create(unit // 4)
    weights = job.tensor(32 * MiB)
    for step in range(args.steps):
        act = job.tensor(4 * MiB)
        job.run_graph(layer, "layer")
        job.run_graph(head, "head")
        job.torch.standin_tensor_free(act)
        job.log(kind="free", ptr=act, t=time.time_ns())
        if memscope is not None:
            memscope.step()
        job.log(kind="step", number=step + 1, t=time.time_ns())
    job.torch.standin_tensor_free(weights)
    job.dump(args.ledger)


if __name__ == "__main__":
    main()
