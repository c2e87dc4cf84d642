#!/usr/bin/env python3
"""Operators and kernel launches on the STAND-IN runtime and torch_npu allocator (tests only), for
`compare --level op|kernel` (msMemScope's call-sequence comparison).

Each iteration runs three operators; each opens an operator span with the markers' op_start /
op_end (what `memscope.torch.trace_ops()` fires), launches one kernel inside it (the kernel's name
through aclrtBinaryGetFunction), and after it allocates its result tensor on the caching
allocator: msMemScope gives a call the size of the next caching-pool event after it. Results are
freed at the end of the iteration. With --extra, iteration 2 runs one more operator,
`aten.cat.default` (kernel `cat_kernel`, a 3 MiB result), right after its matrix product: run A
without and B with, and the comparison must find exactly that call.

The ledger (JSON lines) is the script's own: each operator in order with its kernel and the size
of the tensor allocated after it.
"""

import argparse
import ctypes
import json

import memscope
import standin_ctypes
from memscope import _native

MiB = 1 << 20
OPS = [("aten.mm.default", "matmul_kernel", 4 * MiB), ("aten.relu.default", "relu_kernel", MiB),
       ("aten.add.Tensor", "add_kernel", 2 * MiB)]
EXTRA = ("aten.cat.default", "cat_kernel", 3 * MiB)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--extra", action="store_true", help="one more operator in iteration 2")
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--torch-lib", required=True)
    ap.add_argument("--ledger", required=True)
    ap.add_argument("--wait-tracer", action="store_true")
    args = ap.parse_args()
    if args.wait_tracer:
        memscope.wait_for_tracer()

    vp = ctypes.c_void_p
    acl, torch = standin_ctypes.load(args.torch_lib)

    def allocated():
        used, reserved = ctypes.c_size_t(), ctypes.c_size_t()
        torch.standin_stats(0, ctypes.byref(used), ctypes.byref(reserved))
        return used.value

    functions = {}
    ledger = []

    def run(name, kernel, size):
        if kernel not in functions:
            f = vp()
            if acl.aclrtBinaryGetFunction(None, kernel.encode(), ctypes.byref(f)) != 0:
                raise RuntimeError(f"aclrtBinaryGetFunction({kernel}) failed")
            functions[kernel] = f
        _native.op_start(name)
        args_buf = (ctypes.c_uint64 * 2)(0, 0)
        if acl.aclrtLaunchKernel(functions[kernel], 1, ctypes.addressof(args_buf), ctypes.sizeof(args_buf), None) != 0:
            raise RuntimeError(f"aclrtLaunchKernel({kernel}) failed")
        _native.op_end(name)
        before = allocated()
        ptr = torch.standin_tensor_alloc(size, 0)
        if not ptr:
            raise RuntimeError(f"stand-in allocator returned null for {size} bytes")
        # The block's bytes, as the allocator counts them (it pads and rounds the request).
        ledger.append({"op": name, "kernel": kernel, "size": allocated() - before, "req": size})
        return ptr

    for i in range(1, args.iterations + 1):
        results = []
        for op in OPS:
            results.append(run(*op))
            if args.extra and i == 2 and op[0] == "aten.mm.default":
                results.append(run(*EXTRA))
        for ptr in results:
            torch.standin_tensor_free(ptr)
        ledger.append({"op": None, "freed": len(results)})

    with open(args.ledger, "w") as f:
        for line in ledger:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
