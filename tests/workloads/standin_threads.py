#!/usr/bin/env python3
"""Allocations on threads that run no Python, while the main thread waits in a backward: what a
GPU or NPU backward does (the autograd engine's device threads make the gradients; the Python
caller blocks in `torch/autograd/graph.py:_engine_run_backward`). STAND-IN libraries only: the
stand-in torch_npu's caching allocator, and a module written here at the path torch's own has,
so that the tracer's owner rules see the frame they know (tests/integration/tests/owners.rs).

Three blocks, each made by `standin_tensor_alloc_on_thread` (a new native thread makes it while
the caller waits in ctypes, with the GIL released):
- `engine`: the thread holds a Python thread state with no frame, as the engine's threads do
  (CPython's own PyGILState_Ensure / PyEval_SaveThread, handed to the library), under the
  backward frame;
- `worker`: the thread has no Python thread state at all (a C++ worker), under the backward frame;
- `plain`: a C++ worker outside any frame a rule names.
None is freed. Ledger (--ledger), JSON lines: {"kind": NAME, "ptr": P, "size": S, "site":
"FILE(LINE): FUNCTION"} with the innermost frame of this script at the call, as the interpreter
gives it, and {"kind": "main", "tid": T}.
"""

import argparse
import ctypes
import json
import os
import sys
import tempfile
import threading
import time
import traceback

import standin_ctypes

BACKWARD = '''
def _engine_run_backward(run):
    """The frame torch's backward blocks in while the engine's threads work."""
    return run()
'''


class PythonThreadApi(ctypes.Structure):
    _fields_ = [("gil_ensure", ctypes.c_void_p), ("save_thread", ctypes.c_void_p),
                ("restore_thread", ctypes.c_void_p), ("gil_release", ctypes.c_void_p)]


def python_api():
    def address(name):
        return ctypes.cast(getattr(ctypes.pythonapi, name), ctypes.c_void_p).value
    return PythonThreadApi(address("PyGILState_Ensure"), address("PyEval_SaveThread"),
                           address("PyEval_RestoreThread"), address("PyGILState_Release"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--torch-lib", required=True)
    ap.add_argument("--ledger", required=True)
    args = ap.parse_args()
    fake = tempfile.mkdtemp(prefix="standin-frames-")
    os.makedirs(os.path.join(fake, "torch", "autograd"))
    for package in ("torch", "torch/autograd"):
        open(os.path.join(fake, package, "__init__.py"), "w").close()
    with open(os.path.join(fake, "torch", "autograd", "graph.py"), "w") as f:
        f.write(BACKWARD)
    sys.path.insert(0, fake)
    from torch.autograd import graph

    _, lib = standin_ctypes.load(args.torch_lib)
    lib.standin_tensor_alloc_on_thread.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.standin_tensor_alloc_on_thread.restype = ctypes.c_void_p
    api = python_api()
    ledger = open(args.ledger, "w")

    def write(**fields):
        ledger.write(json.dumps(fields) + "\n")
        ledger.flush()

    write(kind="main", tid=threading.get_native_id())

    def on_thread(kind, size, with_state):
        here = traceback.extract_stack()[-1]
        site = f"{here.filename}({here.lineno + 3}): {here.name}"
        state = ctypes.addressof(api) if with_state else None
        ptr = lib.standin_tensor_alloc_on_thread(size, 0, state)
        if not ptr:
            sys.exit(f"standin_threads: the {kind} thread's allocation of {size} bytes failed")
        write(kind=kind, ptr=ptr, size=size, site=site)

    graph._engine_run_backward(lambda: on_thread("engine", 3 << 20, True))
    graph._engine_run_backward(lambda: on_thread("worker", 5 << 20, False))
    on_thread("plain", 7 << 20, False)
    # The tracer reads new stacks' code objects from the live process: stay a moment.
    time.sleep(0.5)


if __name__ == "__main__":
    main()
