"""Python stacks: allocations through the STAND-IN runtime (ctypes) from a Python call chain
known by construction, on the main thread and on a second thread, with a C-only thread (the
runtime's own calls from a thread that runs no Python: none here, but the second thread's stack
must be its own, not the GIL holder's).

The ledger (--ledger) is the ground truth, from the interpreter itself: at each aclrtMalloc call
`traceback.extract_stack()` gives (file, line, function) per frame, innermost last, with the line
of the call. Lines: `alloc <ptr> <tid>` then `frame <file>:<line>:<function>` innermost first
(this script's frames only), then `end`.
"""

import argparse
import ctypes
import os
import threading
import time
import traceback

parser = argparse.ArgumentParser()
parser.add_argument("--ledger", required=True)
parser.add_argument("--wait", type=float, default=1.0, help="seconds before allocating (the tracer finds the interpreter)")
args = parser.parse_args()

acl = ctypes.CDLL(os.path.join(os.environ["ASCEND_HOME_PATH"], "lib64", "libascendcl.so"))
acl.aclrtSetDevice.argtypes = [ctypes.c_int32]
acl.aclrtMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int]
acl.aclrtFree.argtypes = [ctypes.c_void_p]
lock = threading.Lock()
out = open(args.ledger, "w")


def record(ptr):
    here = [f for f in traceback.extract_stack()[:-2] if f.filename == __file__]
    with lock:
        out.write(f"alloc {ptr:#x} {threading.get_native_id()}\n")
        for f in reversed(here):
            out.write(f"frame {f.filename}:{f.lineno}:{f.name}\n")
        out.write("end\n")


def allocate(size):
    p = ctypes.c_void_p()
    line = traceback.extract_stack()[-1].lineno + 1
    rc = acl.aclrtMalloc(ctypes.byref(p), size, 0)
    assert rc == 0, rc
    record_at(p.value, line)
    acl.aclrtFree(p)


def record_at(ptr, line):
    # The allocating frame's line is the aclrtMalloc call's, one below where it was asked.
    here = [f for f in traceback.extract_stack()[:-2] if f.filename == __file__]
    with lock:
        out.write(f"alloc {ptr:#x} {threading.get_native_id()}\n")
        out.write(f"frame {__file__}:{line}:allocate\n")
        for f in reversed(here):
            out.write(f"frame {f.filename}:{f.lineno}:{f.name}\n")
        out.write("end\n")


class Model:
    def forward(self, n):
        return self.layer(n)

    def layer(self, n):
        allocate(4096 * n)


def worker_chain():
    for n in range(1, 3):
        Model().forward(n)


def main_chain():
    for n in range(3, 5):
        Model().forward(n)


if acl.aclrtSetDevice(0) != 0:
    raise SystemExit("aclrtSetDevice failed")
time.sleep(args.wait)
t = threading.Thread(target=lambda: (acl.aclrtSetDevice(0), worker_chain()))
t.start()
t.join()
main_chain()
out.close()
time.sleep(0.3)
