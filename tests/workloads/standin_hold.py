#!/usr/bin/env python3
"""A job that holds many live blocks on the STAND-IN Ascend runtime (tests and bench only).

It allocates --blocks device blocks with aclrtMalloc on device --device (default 0), writes its ledger (the same
JSON-lines form as standin_train.py: one object per call with API, device, size, pointer, return
code, thread id and entry/exit wall-clock times), then writes its pid to --ready-file and holds
every block for --hold seconds, freeing none: a tracer stopped now has that many live blocks to
close with shadow frees. Tests compare those with this ledger; the ledger never comes from the
tracer.
"""

import argparse
import ctypes
import json
import os
import sys
import threading
import time


def main():
    home = os.environ.get("ASCEND_HOME_PATH")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", default=os.path.join(home, "lib64", "libascendcl.so") if home else None)
    ap.add_argument("--ledger", required=True, help="where to write the JSON-lines ledger")
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--size", type=int, default=64, help="bytes per block")
    ap.add_argument("--device", type=int, default=0, help="the device to allocate on")
    ap.add_argument("--oom-size", type=int, help="then ask for this many bytes, more than the device has: "
                    "an out-of-memory failure, logged with its status, before the hold")
    ap.add_argument("--hold", type=float, default=60, help="seconds to hold the blocks before exiting")
    ap.add_argument("--rename", help="once ready, take this command name (prctl PR_SET_NAME), as a process may")
    ap.add_argument("--delay", type=float, default=0, help="seconds to wait before loading the library")
    ap.add_argument("--settle", type=float, default=0, help="seconds between loading the library and the first call")
    ap.add_argument("--ready-file", help="written with the pid once every block is allocated and logged")
    args = ap.parse_args()
    if not args.lib:
        ap.error("no library: pass --lib or set ASCEND_HOME_PATH")

    time.sleep(args.delay)
    lib = ctypes.CDLL(args.lib)
    time.sleep(args.settle)
    lib.aclrtSetDevice.argtypes = [ctypes.c_int32]
    lib.aclrtMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int]
    tid = threading.get_native_id()
    now = time.time_ns
    t0 = now()
    rc = lib.aclrtSetDevice(args.device)
    entries = [{"api": "aclrtSetDevice", "rc": rc, "tid": tid, "t0": t0, "t1": now(), "device": args.device}]
    if rc != 0:
        print(f"aclrtSetDevice failed: {rc}", file=sys.stderr)
        return 1
    p = ctypes.c_void_p(0)
    pp = ctypes.byref(p)
    malloc = lib.aclrtMalloc
    for _ in range(args.blocks):
        t0 = now()
        rc = malloc(pp, args.size, 0)
        t1 = now()
        entries.append({"api": "aclrtMalloc", "rc": rc, "tid": tid, "t0": t0, "t1": t1, "device": args.device,
                        "size": args.size, "ptr": p.value if rc == 0 else None})
        if rc != 0:
            print(f"aclrtMalloc failed: {rc}", file=sys.stderr)
            return 1
    if args.oom_size:
        t0 = now()
        rc = malloc(pp, args.oom_size, 0)
        entries.append({"api": "aclrtMalloc", "rc": rc, "tid": tid, "t0": t0, "t1": now(), "device": args.device,
                        "size": args.oom_size, "ptr": p.value if rc == 0 else None})
        if rc == 0:
            print(f"aclrtMalloc of {args.oom_size} bytes did not fail", file=sys.stderr)
            return 1
    with open(args.ledger, "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in entries)
    if args.ready_file:
        with open(args.ready_file + ".part", "w") as f:
            f.write(str(os.getpid()))
        os.rename(args.ready_file + ".part", args.ready_file)
    if args.rename:
        pr_set_name = 15
        ctypes.CDLL(None).prctl(pr_set_name, args.rename.encode(), 0, 0, 0)
    time.sleep(args.hold)
    return 0


if __name__ == "__main__":
    sys.exit(main())
