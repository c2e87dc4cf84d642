#!/usr/bin/env python3
"""A REAL PyTorch training loop on the CPU, timed by itself, for benchmarks (`cargo xtask bench
--daemon-only`): what the daemon costs a real job, whose tensors come from PyTorch's own CPU
allocator (c10::alloc_cpu / c10::free_cpu in libc10.so) between real kernels.

It imports torch, waits --delay seconds (a daemon finds libc10.so in the process's mappings
within a second), trains an MLP (--width wide, 3 layers, Adam, batch --batch) for --steps steps
and prints `loop_s=` (the training loop's own seconds), `loop_user_s=` and `loop_sys_s=` (its
CPU seconds) and `steps=`.

With --seconds it trains for that long instead, and with --step-log it writes each step's end
(CLOCK_MONOTONIC seconds, then the process's user and system CPU seconds) as a line there: the
bench attaches and detaches a tracer while one such loop runs, and compares the phases.
"""

import argparse
import os
import resource
import time

import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--seconds", type=float, default=0.0, help="train this long instead of --steps")
    ap.add_argument("--step-log", help="write each step's end here (monotonic s, CPU s)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    time.sleep(args.delay)
    w = args.width
    model = torch.nn.Sequential(
        torch.nn.Linear(w, 2 * w), torch.nn.ReLU(), torch.nn.Linear(2 * w, 2 * w), torch.nn.ReLU(),
        torch.nn.Linear(2 * w, w),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(args.batch, w), torch.randn(args.batch, w)
    # Line-buffered: the bench reads the log while the loop runs (a write per step, ~2 us).
    log = open(args.step_log, "w", buffering=1) if args.step_log else None
    started, before = time.perf_counter(), os.times()
    steps = 0
    while (steps < args.steps) if args.seconds <= 0 else (time.perf_counter() - started < args.seconds):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        steps += 1
        if log:
            usage = resource.getrusage(resource.RUSAGE_SELF)
            log.write(f"{time.monotonic():.6f} {usage.ru_utime:.6f} {usage.ru_stime:.6f}\n")
    if log:
        log.close()
    print(f"loop_s={time.perf_counter() - started:.6f}", flush=True)
    # The probes' traps and programs run in this process's system time: their cost, apart from
    # the user time that the host's other load makes vary by several percent.
    after = os.times()
    print(f"loop_user_s={after.user - before.user:.3f}", flush=True)
    print(f"loop_sys_s={after.system - before.system:.3f}", flush=True)
    print(f"steps={steps}", flush=True)


if __name__ == "__main__":
    main()
