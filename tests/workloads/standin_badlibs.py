"""A job on the STAND-IN runtime (tests only) that maps files a tracer must not trip on while it
goes on making runtime calls, each logged to a JSON-lines ledger (the ground truth).

--non-elf DIR  maps DIR/libascendcl.so.9, a text file, executable (as a job whose loader
               mapped the wrong file would), keeps it mapped, and goes on.
--race DIR     loads two fresh copies of the runtime: Y (named libascend_hal.so, so a tracer
               attaches it after the runtime X) and then X. As soon as X's first probe is live
               (an int3 shows at one of its functions) Y is unlinked: the tracer read the maps
               naming Y, and Y is gone before it gets to it. Then calls go through X too. If Y was
               probed after all (the tracer was between two rescans), it is tried again with
               fresh copies. With --go-file, the calls through X wait for that file (the test
               creates it once the tracer says X's probes are all live).
"""

import argparse
import ctypes
import json
import mmap
import os
import shutil
import threading
import time

VP, SZ = ctypes.c_void_p, ctypes.c_size_t
PROBED = ["aclrtMallocImpl", "aclrtFreeImpl", "aclrtSetDeviceImpl", "aclrtGetDeviceImpl"]


class Ledger:
    def __init__(self, main):
        self.main = main
        self.entries = []

    def call(self, lib, api, *args, **fields):
        t0 = time.time_ns()
        rc = getattr(lib, api)(*args)
        t1 = time.time_ns()
        entry = {"api": api, "rc": rc, "tid": threading.get_native_id(), "t0": t0, "t1": t1, "device": 0}
        if lib is not self.main:
            entry["lib"] = "late"
        entry.update(fields)
        self.entries.append(entry)
        return rc, entry

    def round(self, lib, blocks=4):
        ptrs = []
        for k in range(blocks):
            size = 4096 << k
            p = VP(0)
            rc, e = self.call(lib, "aclrtMalloc", ctypes.byref(p), SZ(size), 0, size=size)
            e["ptr"] = p.value if rc == 0 else None
            if rc == 0:
                ptrs.append((p.value, size))
        for ptr, size in ptrs:
            self.call(lib, "aclrtFree", VP(ptr), ptr=ptr, size=size)
        time.sleep(0.02)

    def dump(self, path):
        with open(path, "w") as f:
            for e in sorted(self.entries, key=lambda e: e["t0"]):
                f.write(json.dumps(e) + "\n")


def probed(lib):
    """Whether a tracer's breakpoint (int3) sits at any of the library's probed functions."""
    return any(ctypes.string_at(ctypes.cast(getattr(lib, f), VP).value, 1) == b"\xcc" for f in PROBED)


def map_non_elf(folder):
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "libascendcl.so.9")
    with open(path, "wb") as f:
        f.write(b"this is not an ELF file\n" * 512)
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_EXEC)


def race(folder, source, attempts=12):
    """Returns X once Y vanished between the tracer's maps read and its attach."""
    for attempt in range(attempts):
        y_path = os.path.join(folder, str(attempt), "y", "libascend_hal.so")
        x_path = os.path.join(folder, str(attempt), "x", "libascendcl.so")
        for p in (y_path, x_path):
            os.makedirs(os.path.dirname(p), exist_ok=True)
            shutil.copyfile(source, p)
        y = ctypes.CDLL(y_path)
        x = ctypes.CDLL(x_path)
        deadline = time.monotonic() + 20
        while not probed(x) and not probed(y):
            if time.monotonic() > deadline:
                raise RuntimeError("no tracer attached the copies within 20 s")
        y_first = probed(y)
        os.unlink(y_path)
        time.sleep(1.0)
        if not y_first and not probed(y):
            return x
    raise RuntimeError(f"Y was probed in each of {attempts} attempts")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    home = os.environ.get("ASCEND_HOME_PATH", "")
    ap.add_argument("--lib", default=os.path.join(home, "lib64", "libascendcl.so"))
    ap.add_argument("--ledger", required=True)
    ap.add_argument("--rounds", type=int, default=10, help="rounds of calls before and after each event")
    ap.add_argument("--non-elf", metavar="DIR")
    ap.add_argument("--race", metavar="DIR")
    ap.add_argument("--go-file", help="with --race: wait for this file before calling through X")
    args = ap.parse_args()

    lib = ctypes.CDLL(args.lib)
    ledger = Ledger(lib)
    ledger.call(lib, "aclrtSetDevice", 0)
    for _ in range(args.rounds):
        ledger.round(lib)
    keep = []
    if args.non_elf:
        keep.append(map_non_elf(args.non_elf))
        time.sleep(1.0)  # four rescans
    if args.race:
        x = race(args.race, args.lib)
        deadline = time.monotonic() + 60
        while args.go_file and not os.path.exists(args.go_file):
            if time.monotonic() > deadline:
                raise RuntimeError("no go file within 60 s")
            time.sleep(0.01)
        ledger.call(x, "aclrtSetDevice", 0)
        for _ in range(args.rounds):
            ledger.round(x)
    for _ in range(args.rounds):
        ledger.round(lib)
    ledger.dump(args.ledger)


if __name__ == "__main__":
    main()
