#!/usr/bin/env python3
"""Pool blocks on the STAND-IN torch_npu caching allocator in phases a test paces (tests only),
for the daemon's windows: each phase ends by writing DIR/readyK (its pid) and waiting for
DIR/goK.

1. --count blocks (A).
2. Half of A freed, --count blocks (B), a quarter of B freed.
3. Another quarter of B freed, --count blocks (C), half of C freed.
4. Everything freed; it exits.

The test opens a window of the daemon's around phase 2 and closes it before phase 3, so A's
frees are of blocks born before the window, B's second quarter is freed in the drain and B's
second half outlives it; C is born after the window. The allocator's ledger
(STANDIN_TORCH_LEDGER) is the truth; the test splits it by phase at each readyK.

With --paused, instead: (1) the runtime set up; (2) one tensor allocated while the allocator is
told to wait inside the call (STANDIN_TORCH_PAUSE, which the test sets and whose file it
removes once the window's probes are gone); (3) --count tensors allocated on the same thread
and kept; (4) all freed.
"""

import argparse
import os
import sys
import time

import standin_ctypes


def ready(directory, k):
    path = os.path.join(directory, f"ready{k}")
    with open(path + ".part", "w") as f:
        f.write(str(os.getpid()))
    os.rename(path + ".part", path)
    go = os.path.join(directory, f"go{k}")
    while not os.path.exists(go):
        time.sleep(0.01)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--torch-lib", required=True, help="the stand-in libtorch_npu.so")
    ap.add_argument("--dir", required=True, help="where the readyK and goK files are")
    ap.add_argument("--count", type=int, default=400)
    ap.add_argument("--size", type=int, default=64 << 10, help="bytes per block")
    ap.add_argument("--paused", action="store_true", help="the second scenario (above)")
    args = ap.parse_args()
    _, torch = standin_ctypes.load(args.torch_lib)

    def blocks():
        out = [torch.standin_tensor_alloc(args.size, 0) for _ in range(args.count)]
        if not all(out):
            raise SystemExit("the stand-in allocator gave up")
        return out

    def free(ptrs):
        for p in ptrs:
            torch.standin_tensor_free(p)

    n = args.count
    if args.paused:
        ready(args.dir, 1)
        held = [torch.standin_tensor_alloc(args.size, 0)]
        ready(args.dir, 2)
        held += blocks()
        ready(args.dir, 3)
        free(held)
        return 0
    a = blocks()
    ready(args.dir, 1)
    free(a[: n // 2])
    b = blocks()
    free(b[: n // 4])
    ready(args.dir, 2)
    free(b[n // 4 : n // 2])
    c = blocks()
    free(c[: n // 2])
    ready(args.dir, 3)
    free(a[n // 2 :] + b[n // 2 :] + c[n // 2 :])
    return 0


if __name__ == "__main__":
    sys.exit(main())
