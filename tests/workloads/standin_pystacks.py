"""Python stacks: allocations through the STAND-IN runtime (ctypes) from a Python call chain
known by construction, on the main thread and on a second thread (whose stack must be its own,
not the GIL holder's), then two frees from C-only threads (`pthread_create` straight onto the
runtime's `aclrtFree`: threads that never run Python and have no thread state), the second
while more Python threads are alive than the probe walks (the tracer's MAX_PY_THREADS, 256).

The ledger (--ledger) is the ground truth, from the interpreter itself: at each aclrtMalloc call
`traceback.extract_stack()` gives (file, line, function) per frame, innermost last, with the line
of the call. Lines: `alloc <ptr> <tid>` then `frame <file>:<line>:<function>` innermost first
(this script's frames only), then `end`; `cfree <ptr>` and `cfree_crowded <ptr> <threads>` for
the blocks the C-only threads free.

With `--fork`, the process waits `--wait`, then forks, and only the child allocates
(main_chain, at once): a process the tracer learns of mid-trace. With `--exec`, it waits `--wait`, then
replaces itself with a fresh interpreter running this script without `--exec` (same pid, a new
image whose interpreter lies elsewhere), which does the rest.
"""

import argparse
import ctypes
import os
import sys
import threading
import time
import traceback

parser = argparse.ArgumentParser()
parser.add_argument("--ledger", required=True)
parser.add_argument("--wait", type=float, default=1.0, help="seconds before allocating (the tracer finds the interpreter)")
parser.add_argument("--fork", action="store_true", help="allocate only in a child forked at the start")
parser.add_argument("--exec", action="store_true", help="exec a fresh interpreter on this script first")
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


if args.exec:
    time.sleep(args.wait)
    out.close()
    os.execv(sys.executable, [sys.executable, __file__, "--ledger", args.ledger, "--wait", str(args.wait)])

if args.fork:
    # The parent waits (the tracer finds its interpreter); the child allocates at once, before
    # a rescan of the tracer could have found the child's.
    time.sleep(args.wait)
    child = os.fork()
    if child != 0:
        _, status = os.waitpid(child, 0)
        raise SystemExit(os.waitstatus_to_exitcode(status))
    if acl.aclrtSetDevice(0) != 0:
        os._exit(1)
    main_chain()
    out.close()
    # Code objects are read from the live process as their records are decoded (within
    # 20 ms); a process gone by then leaves `?` frames.
    time.sleep(0.3)
    os._exit(0)

if acl.aclrtSetDevice(0) != 0:
    raise SystemExit("aclrtSetDevice failed")
time.sleep(args.wait)
t = threading.Thread(target=lambda: (acl.aclrtSetDevice(0), worker_chain()))
t.start()
t.join()
main_chain()

libc = ctypes.CDLL(None, use_errno=True)
libc.pthread_create.argtypes = [ctypes.POINTER(ctypes.c_ulong), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
libc.pthread_join.argtypes = [ctypes.c_ulong, ctypes.c_void_p]


def free_from_c_thread(tag, extra=""):
    """aclrtFree(p) as the start routine of a thread that runs no Python at all."""
    p = ctypes.c_void_p()
    assert acl.aclrtMalloc(ctypes.byref(p), 8192, 0) == 0
    out.write(f"{tag} {p.value:#x}{extra}\n")
    out.flush()
    thread = ctypes.c_ulong()
    rc = libc.pthread_create(ctypes.byref(thread), None, ctypes.cast(acl.aclrtFree, ctypes.c_void_p), p)
    assert rc == 0, rc
    assert libc.pthread_join(thread.value, None) == 0


free_from_c_thread("cfree")
crowd_go = threading.Event()
crowd = [threading.Thread(target=crowd_go.wait) for _ in range(300)]
for c in crowd:
    c.start()
free_from_c_thread("cfree_crowded", f" {len(crowd) + 1}")
crowd_go.set()
for c in crowd:
    c.join()
out.close()
time.sleep(0.3)
