#!/usr/bin/env python3
"""A job that forks a worker process on the STAND-IN Ascend runtime (tests only).

The parent and the child each set a device and make allocation pairs (aclrtMalloc + aclrtFree)
through the stand-in libascendcl.so, and each writes its own ledger in standin_train.py's format
(PARENT_LEDGER and CHILD_LEDGER, named on the command line): the ground truth the tests compare
the tracer's DB with.

--orphan: the parent makes a tenth of the pairs, forks and exits; the child waits until it has
been reparented (its parent is gone), then makes its pairs. --go-file: the parent loads the
library, writes --ready-file, and makes no call until the test creates the go file (after
attaching the tracer); then it forks, and both make their pairs. --child-lib: the child makes
its pairs through a library only it loads, once the test says the tracer has probed it.
"""

import argparse
import ctypes
import json
import os
import sys
import threading
import time


def load(path):
    lib = ctypes.CDLL(path)
    vpp = ctypes.POINTER(ctypes.c_void_p)
    lib.aclrtSetDevice.argtypes = [ctypes.c_int32]
    lib.aclrtMalloc.argtypes = [vpp, ctypes.c_size_t, ctypes.c_int]
    lib.aclrtFree.argtypes = [ctypes.c_void_p]
    return lib


def call(ledger, fn, api, *args, **fields):
    t0 = time.time_ns()
    rc = fn(*args)
    t1 = time.time_ns()
    entry = {"api": api, "rc": rc, "pid": os.getpid(), "tid": threading.get_native_id(), "t0": t0, "t1": t1}
    entry.update(fields)
    ledger.append(entry)
    return rc, entry


def pairs(lib, device, count, pause_every, path):
    """aclrtSetDevice, then `count` allocation pairs; the ledger goes to `path`."""
    ledger = []
    rc, _ = call(ledger, lib.aclrtSetDevice, "aclrtSetDevice", device, device=device)
    if rc != 0:
        raise RuntimeError(f"aclrtSetDevice({device}) failed: {rc}")
    for i in range(count):
        size = 4096 + 64 * (i % 16)
        p = ctypes.c_void_p(0)
        rc, e = call(ledger, lib.aclrtMalloc, "aclrtMalloc", ctypes.byref(p), size, 0, device=device, size=size)
        if rc != 0:
            raise RuntimeError(f"aclrtMalloc failed: {rc}")
        e["ptr"] = p.value
        call(ledger, lib.aclrtFree, "aclrtFree", ctypes.c_void_p(p.value), ptr=p.value, size=size, device=device)
        if pause_every and i % pause_every == pause_every - 1:
            time.sleep(0.002)
    with open(path, "w") as f:
        for e in ledger:
            f.write(json.dumps(e) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parent_ledger")
    ap.add_argument("child_ledger")
    ap.add_argument("--pairs", type=int, default=3000, help="allocation pairs per process")
    ap.add_argument("--pause-every", type=int, default=100, help="sleep 2 ms after this many pairs")
    ap.add_argument("--orphan", action="store_true")
    ap.add_argument("--ready-file")
    ap.add_argument("--go-file")
    ap.add_argument("--child-lib", help="the child loads this copy of the runtime after the fork, writes "
                    "--child-ready, waits for --child-go and makes its pairs through it")
    ap.add_argument("--child-ready")
    ap.add_argument("--child-go")
    args = ap.parse_args()
    lib = load(os.path.join(os.environ["ASCEND_HOME_PATH"], "lib64", "libascendcl.so"))
    if args.ready_file:
        with open(args.ready_file, "w") as f:
            f.write(str(os.getpid()))
    if args.go_file:
        while not os.path.exists(args.go_file):
            time.sleep(0.01)
    parent = os.getpid()
    if args.orphan:
        pairs(lib, 0, args.pairs // 10, args.pause_every, args.parent_ledger)
    child = os.fork()
    if child == 0:
        code = 0
        try:
            if args.orphan:
                while os.getppid() == parent:
                    time.sleep(0.005)
            if args.child_lib:
                lib = load(args.child_lib)
                with open(args.child_ready, "w") as f:
                    f.write(str(os.getpid()))
                while not os.path.exists(args.child_go):
                    if os.getppid() != parent:
                        raise RuntimeError("the parent died (the test gave up) before the go")
                    time.sleep(0.01)
            pairs(lib, 1, args.pairs, args.pause_every, args.child_ledger)
        except BaseException as e:  # the exit code says it failed
            print(f"child: {e!r}", file=sys.stderr)
            code = 1
        os._exit(code)
    if args.orphan:
        # The child does its work after we are gone. Linger a moment first: the tracer reads our
        # libraries through /proc/PID/root, which vanishes with us (not what this tests).
        time.sleep(1)
        return 0
    pairs(lib, 0, args.pairs, args.pause_every, args.parent_ledger)
    _, status = os.waitpid(child, 0)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main())
