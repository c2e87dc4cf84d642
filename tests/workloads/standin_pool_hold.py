#!/usr/bin/env python3
"""Many small tensors on the STAND-IN torch_npu caching allocator, then held (tests only).

It allocates --count tensors with sizes spread evenly on a log scale from --min to --max bytes
(seeded), freeing a random live one after about half of them, writes its pid to --ready-file
and holds what is live for --hold seconds. The allocator logs every block it hands out and takes
back, with its own allocated-bytes counter (STANDIN_TORCH_LEDGER): tests compare the daemon's
exact counters and its sampled estimates with that ledger, never with the tracer.

With --go-file, it stops after the first half of its tensors, writes --ready-file then, and
goes on once that file exists (a tracer attaches in between: the allocator's segments then
predate the trace, and the second half's blocks lie in them too).
"""

import argparse
import ctypes
import math
import os
import random
import sys
import time


def main():
    home = os.environ.get("ASCEND_HOME_PATH")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", default=os.path.join(home, "lib64", "libascendcl.so") if home else None)
    ap.add_argument("--torch-lib", required=True, help="the stand-in libtorch_npu.so")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--count", type=int, default=20_000)
    ap.add_argument("--min", type=int, default=256)
    ap.add_argument("--max", type=int, default=64 << 10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--hold", type=float, default=300)
    ap.add_argument("--ready-file", required=True)
    ap.add_argument("--delay", type=float, default=0,
                    help="seconds to wait once the allocator is loaded (a tracer finds it by the mappings)")
    ap.add_argument("--go-file", help="after half the tensors, write --ready-file and wait for this file")
    args = ap.parse_args()
    if not args.lib:
        ap.error("no library: pass --lib or set ASCEND_HOME_PATH")
    acl = ctypes.CDLL(args.lib)
    acl.aclrtSetDevice.argtypes = [ctypes.c_int32]
    if acl.aclrtSetDevice(args.device) != 0:
        print("aclrtSetDevice failed", file=sys.stderr)
        return 1
    torch = ctypes.CDLL(args.torch_lib)
    torch.standin_tensor_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int]
    torch.standin_tensor_alloc.restype = ctypes.c_void_p
    torch.standin_tensor_free.argtypes = [ctypes.c_void_p]
    time.sleep(args.delay)
    rng = random.Random(args.seed)
    lo, hi = math.log(args.min), math.log(args.max)
    live = []
    started = time.perf_counter()
    for i in range(args.count):
        if args.go_file and i == args.count // 2:
            ready(args.ready_file)
            while not os.path.exists(args.go_file):
                time.sleep(0.01)
        p = torch.standin_tensor_alloc(int(math.exp(rng.uniform(lo, hi))), args.device)
        if not p:
            print("the stand-in allocator gave up", file=sys.stderr)
            return 1
        live.append(p)
        if rng.random() < 0.5:
            torch.standin_tensor_free(live.pop(rng.randrange(len(live))))
    # The loop's own time, for benchmarks: what a tracer adds to each allocation and free.
    print(f"loop_s={time.perf_counter() - started:.6f}", flush=True)
    if not args.go_file:
        ready(args.ready_file)
    time.sleep(args.hold)
    return 0


def ready(path):
    with open(path + ".part", "w") as f:
        f.write(str(os.getpid()))
    os.rename(path + ".part", path)


if __name__ == "__main__":
    sys.exit(main())
