#!/usr/bin/env python3
"""A small REAL PyTorch job on the CPU whose operators are traced with
`memscope.torch.trace_ops()`, for the operator check of the tracer
(tests/integration/tests/ops.rs).

Timeline (the test attaches `memscope-bpf trace --pid` to this process, which is already running):

1. import torch and the markers package (libc10.so and memscope/_native.so are then in
   /proc/PID/maps), write the pid to --ready.
2. wait for the tracer: every probe's semaphore raised, plus 0.2 s. Only then are the model and
   the data made, so their storages are blocks the tracer saw allocated (an ACCESS row needs a
   live block to resolve to).
3. inside `memscope.torch.trace_ops()` AND this file's own `Ledger` dispatch mode: a few explicit
   operators that exercise each rule (a matrix product, an in-place add, an `out=` product, a
   view, a factory, an `empty`, a list argument, a two-result operator), then --steps training
   steps of an MLP (Linear, LayerNorm, in-place ReLU, Linear; MSE loss; backward; Adam with
   foreach updates, i.e. operators over tensor lists that write in place).
4. write the ledger and exit.

The ledger is the ground truth, made by its own `TorchDispatchMode` that shares no code with the
markers package: per operator, in the order this thread ran them, the operator's name (built from
its schema: `aten::mm` + overload `""` -> `aten.mm.default`) and each tensor access with the
tensor's STORAGE pointer (`untyped_storage().data_ptr()`, which for torch's CPU allocator is the
block `c10::alloc_cpu` returned), the tensor's bytes (numel x element size), dtype and shape. The
rules, from the operator's schema (as msMemScope's aten collection reads it):

- before the operator: a read for each tensor of an argument without an alias annotation, except
  the arguments of a factory operator (`new_*`, `*_like`), whose data is not read;
- after it: a write for each tensor of an argument annotated as written (`Tensor(a!)`: in-place
  self, `out=`), then for each tensor of a return without an alias annotation, except the results
  of `empty`-family operators (allocated, not written);
- tensors without elements, or without a data pointer, are not accesses.

Ledger (JSON, one object): {"pid": ..., "ops": [{"tid": ..., "name": ..., "accesses":
[["read"|"write", storage_ptr, nbytes, dtype, [shape...]], ...]}, ...]}.
"""

import argparse
import json
import os
import sys
import threading
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import memscope
import memscope.torch


class Ledger(TorchDispatchMode):
    """Logs every operator and the storages it reads and writes. Its handler calls no operator
    itself (storage pointers, sizes and shapes are read without dispatching), so the mode below it
    sees exactly the operators this one sees."""

    def __init__(self):
        super().__init__()
        self.ops = []

    @staticmethod
    def _entries(kind, values):
        out = []
        for t in tree_leaves(values):
            if not isinstance(t, torch.Tensor) or t.numel() == 0:
                continue
            try:
                ptr = t.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):
                continue
            if ptr == 0:
                continue
            out.append([kind, ptr, t.numel() * t.element_size(), str(t.dtype).replace("torch.", ""), list(t.shape)])
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        short = schema.name.split("::", 1)[1]
        name = schema.name.replace("::", ".") + "." + (schema.overload_name or "default")
        factory = short.startswith("new_") or short.endswith("_like")
        params = list(schema.arguments)
        named = {p.name: p for p in params}
        given = list(zip(params, args)) + [(named[k], v) for k, v in kwargs.items() if k in named]
        accesses, written = [], []
        for param, value in given:
            alias = param.alias_info
            if alias is not None and alias.is_write:
                written.append(value)
            elif alias is None and not factory:
                accesses += self._entries("read", value)
        result = func(*args, **kwargs)
        for value in written:
            accesses += self._entries("write", value)
        rets = list(schema.returns)
        results = [result] if len(rets) == 1 else list(result or ())
        if "empty" not in short:
            for ret, value in zip(rets, results):
                if ret.alias_info is None:
                    accesses += self._entries("write", value)
        self.ops.append({"tid": threading.get_native_id(), "name": name, "accesses": accesses})
        return result


def wait_for_tracer(timeout):
    deadline = time.monotonic() + timeout
    while not all(v > 0 for v in memscope._native.semaphores().values()):
        if time.monotonic() > deadline:
            sys.exit(f"torch_ops: the tracer did not attach every probe: {memscope._native.semaphores()}")
        time.sleep(0.01)
    time.sleep(0.2)


def explicit_ops():
    a, b = torch.randn(16, 32), torch.randn(32, 8)
    c = torch.empty(16, 8)
    d = a @ b  # reads a, b; writes d
    d.add_(1.0)  # in place: a write of d
    torch.mm(a, b, out=c)  # out=: a write of c
    v = a.view(32, 16)  # a view: no access
    z = torch.zeros_like(v)  # factory: writes z only
    torch.empty(5)  # allocated, not written
    cat = torch.cat([a, z.view(16, 32)])  # a list argument
    values, indices = torch.max(cat, dim=1)  # two results
    return float(values.sum()) + float(indices.sum())  # .item(): a read of each sum


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ledger", required=True)
    p.add_argument("--ready", required=True, help="file to write this process's pid to, once torch is imported")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args()

    torch.set_num_threads(1)  # operators on this thread only; backward of CPU tensors runs here too
    torch.manual_seed(0)
    tmp = args.ready + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.rename(tmp, args.ready)
    wait_for_tracer(args.timeout)

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.ReLU(inplace=True),
                                torch.nn.Linear(128, 32))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    loss_fn = torch.nn.MSELoss()
    data = [(torch.randn(8, 64), torch.randn(8, 32)) for _ in range(args.steps)]

    ledger = Ledger()
    # trace_ops first, the ledger on top: each operator reaches the ledger, then the markers' mode.
    with memscope.torch.trace_ops(), ledger:
        explicit_ops()
        for x, y in data:
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
    with open(args.ledger + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "ops": ledger.ops}, f)
    os.rename(args.ledger + ".tmp", args.ledger)


if __name__ == "__main__":
    main()
