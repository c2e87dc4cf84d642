"""Benchmark loop for `cargo xtask bench`: N x (aclrtMalloc + aclrtFree) on the STAND-IN runtime,
called from Python through ctypes at the bottom of a 4-frame call chain, timed inside the
process. Prints one line: "ns_per_pair <value> pairs <N>". Usage: py_alloc_bench.py N.
"""

import ctypes
import os
import sys
import time

acl = ctypes.CDLL(os.path.join(os.environ["ASCEND_HOME_PATH"], "lib64", "libascendcl.so"))
acl.aclrtSetDevice.argtypes = [ctypes.c_int32]
acl.aclrtMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int]
acl.aclrtFree.argtypes = [ctypes.c_void_p]
malloc, free = acl.aclrtMalloc, acl.aclrtFree


def pair(p, size):
    malloc(ctypes.byref(p), size, 0)
    free(p)


def layer(n, p):
    for i in range(n):
        pair(p, 4096 + (i & 63))


def step(n, p):
    layer(n, p)


def run(n):
    p = ctypes.c_void_p()
    start = time.perf_counter_ns()
    step(n, p)
    return (time.perf_counter_ns() - start) / n


if acl.aclrtSetDevice(0) != 0:
    raise SystemExit("aclrtSetDevice failed")
n = int(sys.argv[1])
time.sleep(float(os.environ.get("BENCH_WAIT", "0")))
print(f"ns_per_pair {run(n):.1f} pairs {n}")
