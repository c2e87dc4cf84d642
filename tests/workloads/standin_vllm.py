#!/usr/bin/env python3
"""A vLLM-Ascend-shaped serving job on the STAND-IN libraries, with no markers: its code runs in
modules and functions named as vllm-ascend's own (`vllm_ascend/worker/worker.py:NPUWorker`,
`vllm_ascend/worker/model_runner_v1.py:NPUModelRunner`, written here at start-up into a temporary
folder), so that the tracer's built-in owner rules have the frames they know
(tests/integration/tests/owners.rs).

The worker loads the weights (load_model), profiles (profile_run: its tensors are freed), makes
the KV cache (initialize_from_config -> initialize_kv_cache -> initialize_kv_cache_tensors ->
_allocate_kv_cache_tensors: attention layers' K and V through _allocate_int8_cache_tensor, as
vllm-ascend 0.23 does, and the last layer's mamba state and hidden states in branches of their
own), warms up and captures graphs (compile_or_warm_up_model ->
capture_model: a graph pool's blocks, kept), then serves (execute_model: per-request tensors,
freed). Every tensor is a stand-in torch_npu caching-allocator block.

Ledger (--ledger), JSON lines: {"kind": "tensor", "phase": P, "ptr": X, "size": S, "kept": bool,
"line": L} for every tensor the job made, where P names the worker method it was made under (and
the KV cache's kind: `kv_cache@attn`, `kv_cache@mamba`, `kv_cache@hidden_state`) and L is the
line of the runner's module that made it, as the interpreter reports it. `--mamba-line` prints the line of that module that
makes the mamba tensor, and exits: a rules file (`lines=`) can name it before the job runs.
"""

import argparse
import ctypes
import json
import os
import sys
import tempfile
import time

import standin_ctypes

RUNNER = '''
class GPUModelRunner:
    """vLLM's runner, which vllm-ascend's subclasses."""


class NPUModelRunner(GPUModelRunner):
    def __init__(self, alloc, free):
        self.alloc, self.free = alloc, free

    def load_model(self):
        return [self.alloc("weights", 4 << 20, True) for _ in range(3)]

    def profile_run(self):
        for t in [self.alloc("profile", 6 << 20, False) for _ in range(2)]:
            self.free(t)

    def _allocate_int8_cache_tensor(self, size):
        return self.alloc("kv_cache@attn", size, True)

    def _allocate_kv_cache_tensors(self, layers):
        tensors = []
        for layer in range(layers):
            if layer == layers - 1:
                # a linear-attention (mamba) layer: one tensor, made in this function itself
                tensors.append(self.alloc("kv_cache@mamba", 6 << 20, True))  # MAMBA
                # its hidden states, in a tensor of their own (another branch, another line)
                tensors.append(self.alloc("kv_cache@hidden_state", 2 << 20, True))
            else:
                tensors += [self._allocate_int8_cache_tensor(4 << 20) for _ in ("k", "v")]
        return tensors

    def initialize_kv_cache_tensors(self, layers):
        return self._allocate_kv_cache_tensors(layers)

    def initialize_kv_cache(self, layers):
        return self.initialize_kv_cache_tensors(layers)

    def capture_model(self):
        return [self.alloc("graph_pool", 2 << 20, True) for _ in range(2)]

    def execute_model(self):
        for t in [self.alloc("serve", 1 << 20, False) for _ in range(3)]:
            self.free(t)
'''

WORKER = '''
from vllm_ascend.worker.model_runner_v1 import NPUModelRunner


class NPUWorker:
    def __init__(self, alloc, free):
        self.model_runner = NPUModelRunner(alloc, free)

    def load_model(self):
        return self.model_runner.load_model()

    def determine_available_memory(self):
        self.model_runner.profile_run()

    def initialize_from_config(self, layers):
        return self.model_runner.initialize_kv_cache(layers)

    def compile_or_warm_up_model(self):
        return self.model_runner.capture_model()

    def execute_model(self):
        self.model_runner.execute_model()
'''


def write_package(root):
    for package in ("vllm_ascend", "vllm_ascend/worker"):
        os.makedirs(os.path.join(root, package), exist_ok=True)
        open(os.path.join(root, package, "__init__.py"), "w").close()
    for name, text in (("model_runner_v1.py", RUNNER), ("worker.py", WORKER)):
        with open(os.path.join(root, "vllm_ascend", "worker", name), "w") as f:
            f.write(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mamba-line", action="store_true", help="print the mamba tensor's line and exit")
    ap.add_argument("--torch-lib")
    ap.add_argument("--ledger")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--settle", type=float, default=0.0,
                    help="seconds to wait once the libraries are loaded (a daemon opens the job at its first call)")
    args = ap.parse_args()
    if args.mamba_line:
        print(next(i for i, text in enumerate(RUNNER.splitlines(), 1) if text.endswith("# MAMBA")))
        return
    if not (args.torch_lib and args.ledger):
        ap.error("--torch-lib and --ledger are required")
    root = tempfile.mkdtemp(prefix="standin-vllm-")
    write_package(root)
    sys.path.insert(0, root)
    from vllm_ascend.worker.worker import NPUWorker

    _, lib = standin_ctypes.load(args.torch_lib)
    time.sleep(args.settle)
    ledger = open(args.ledger, "w")
    kept = []

    def alloc(phase, size, keep):
        before = standin_ctypes.stats(lib)[0]
        ptr = lib.standin_tensor_alloc(size, 0)
        if not ptr:
            sys.exit(f"standin_vllm: a {phase} tensor of {size} bytes could not be allocated")
        line = sys._getframe(1).f_lineno
        # The request, and the block's bytes as the allocator counts them (padded, rounded, and
        # whole when the rest of a cached block is too small to split off).
        block = standin_ctypes.stats(lib)[0] - before
        ledger.write(json.dumps({"kind": "tensor", "phase": phase, "ptr": ptr, "req": size, "size": block, "kept": keep,
                                 "line": line}) + "\n")
        if keep:
            kept.append(ptr)
        return ptr

    worker = NPUWorker(alloc, lambda ptr: lib.standin_tensor_free(ctypes.c_void_p(ptr)))
    worker.load_model()
    worker.determine_available_memory()
    worker.initialize_from_config(args.layers)
    worker.compile_or_warm_up_model()
    for _ in range(args.requests):
        worker.execute_model()
    ledger.flush()
    # The tracer reads new stacks' code objects from the live process: stay a moment.
    time.sleep(0.5)


if __name__ == "__main__":
    main()
