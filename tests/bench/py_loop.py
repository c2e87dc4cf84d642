"""A CPU-bound Python loop for the Python sampler's cost (`cargo xtask bench --python-trace-only`):
three levels of small functions called in a tight loop for --seconds of CPU time at most (a fixed
count of iterations, found once so each round does the same work), holding one block of the
STAND-IN runtime's device memory so the trace has a device DB. Prints `seconds <wall time of the
loop>` and `pid <pid>`.
"""

import argparse
import ctypes
import os
import time

parser = argparse.ArgumentParser()
parser.add_argument("--iterations", type=int, default=15_000_000)
parser.add_argument("--wait", type=float, default=1.5, help="seconds before the loop (the tracer finds the interpreter)")
args = parser.parse_args()


def leaf(x):
    return (x * 31 + 7) % 1009


def middle(x):
    return leaf(x) + leaf(x + 1)


def outer(n):
    total = 0
    for i in range(n):
        total += middle(i)
    return total


acl = ctypes.CDLL(os.path.join(os.environ["ASCEND_HOME_PATH"], "lib64", "libascendcl.so"))
acl.aclrtMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int]
acl.aclrtFree.argtypes = [ctypes.c_void_p]
acl.aclrtSetDevice(0)
block = ctypes.c_void_p()
acl.aclrtMalloc(ctypes.byref(block), 1 << 20, 0)
time.sleep(args.wait)
start = time.perf_counter()
outer(args.iterations)
print(f"seconds {time.perf_counter() - start:.6f}", flush=True)
print(f"pid {os.getpid()}", flush=True)
acl.aclrtFree(block)
