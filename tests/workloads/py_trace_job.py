"""A Python job whose function calls are known by construction, for `trace --python-trace`: on
the main thread `main` -> `step` (x STEPS) -> `forward`, `backward`, each spinning on the CPU
for a set time, after a second thread's `loader` -> `decode` (which `main` waits for). It holds one
block of the STAND-IN runtime's device memory throughout, so the trace has a device DB (Insight
draws a DB's Python trace beside its memory).

The ledger (--ledger, JSON lines) is the ground truth from the interpreter itself: for each call
of those functions `{"func": "file(first line): qualified name", "tid": native thread id, "t0",
"t1"}` with `time.time_ns()` (CLOCK_REALTIME, as the trace's rows are stamped) taken on entry
and on return; and `{"pid": pid}` first.

Between two calls of one function from one place the thread runs something else on the CPU
(`between`) for several sampling periods: a sampler cannot tell back-to-back calls apart (the
same frames are on the stack at every sample), nor see a thread that sleeps.
"""

import argparse
import ctypes
import json
import os
import threading
import time

parser = argparse.ArgumentParser()
parser.add_argument("--ledger", required=True)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--wait", type=float, default=1.0, help="seconds before the first call (the tracer finds the interpreter)")
args = parser.parse_args()

lock = threading.Lock()
out = open(args.ledger, "w")


def record(func, t0, t1):
    code = func.__code__
    line = {"func": f"{code.co_filename}({code.co_firstlineno}): {func.__qualname__}", "tid": threading.get_native_id(), "t0": t0, "t1": t1}
    with lock:
        out.write(json.dumps(line) + "\n")
        out.flush()


def timed(func):
    """Records each call of `func` in the ledger; the wrapper's own frame is `inner`."""
    def inner(*a):
        t0 = time.time_ns()
        try:
            return func(*a)
        finally:
            record(func, t0, time.time_ns())
    return inner


def spin(seconds):
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        n += 1
    return n


def forward():
    return spin(0.12)


def backward():
    return spin(0.08)


def between():
    return spin(0.03)


def step(i):
    timed(forward)()
    timed(backward)()


def decode():
    return spin(0.15)


def loader():
    for _ in range(2):
        timed(decode)()
        between()


def main():
    # One busy Python thread at a time: on a 2-core machine beside the tracer, two would be
    # descheduled often enough to space their samples past a period.
    threading_loader = threading.Thread(target=timed(loader))
    threading_loader.start()
    threading_loader.join()
    for i in range(args.steps):
        timed(step)(i)
        between()


acl = ctypes.CDLL(os.path.join(os.environ["ASCEND_HOME_PATH"], "lib64", "libascendcl.so"))
acl.aclrtSetDevice.argtypes = [ctypes.c_int32]
acl.aclrtMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int]
acl.aclrtFree.argtypes = [ctypes.c_void_p]
out.write(json.dumps({"pid": os.getpid()}) + "\n")
time.sleep(args.wait)
acl.aclrtSetDevice(0)
block = ctypes.c_void_p()
acl.aclrtMalloc(ctypes.byref(block), 1 << 20, 0)
# Not in the ledger: `main` waits for the loader off the CPU, where no sample sees it.
main()
acl.aclrtFree(block)
