#!/usr/bin/env python3
"""A REAL PyTorch training job on the CPU that nobody edited for the tracer: no markers package,
no tags, no steps marked. tests/integration/tests/real_torch_unmarked.rs attaches
`memscope-bpf trace --pid` to it with no other flag and checks that the owners, the steps and
the leak's line come from the job's Python stacks alone.

Timeline:
1. import torch, write the pid to --ready, wait until the --gate file exists (the test creates it
   once the tracer is live): everything counted is born while the tracer watches.
2. build an MLP (256-512-256) and Adam, train --steps steps (`opt.zero_grad()` with its default
   set_to_none=True; forward, MSE loss, backward, `opt.step()`), and keep one new tensor per step
   in a list that is never cleared: the leak (LEAK_BYTES each, a size nothing else has).
3. after the optimizer step of --checkpoint-step (>= 2: Adam's state exists), sit still 0.1 s,
   take the wall time T, write torch's own sums of what it holds (distinct storages of
   parameters, of their `.grad`s, of every tensor in `opt.state`; the leak's), sit still 0.1 s.
4. finish the steps, write {"kind": "done", "steps": N, "leak_line": L} (L: the line that
   allocates the leak, found with `inspect`), exit.
"""

import argparse
import inspect
import json
import os
import sys
import time

import torch

LEAK_BYTES = 12_345 * 4


def storages(tensors, seen):
    """Byte sum of the distinct storages behind `tensors` not yet in `seen` (updated)."""
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        s = t.untyped_storage()
        if s.data_ptr() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ledger", required=True)
    p.add_argument("--ready", required=True)
    p.add_argument("--gate", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--checkpoint-step", type=int, default=3)
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ledger = open(args.ledger, "w")

    def write(**fields):
        ledger.write(json.dumps(fields) + "\n")
        ledger.flush()

    tmp = args.ready + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.rename(tmp, args.ready)
    deadline = time.monotonic() + args.timeout
    while not os.path.exists(args.gate):
        if time.monotonic() > deadline:
            sys.exit(f"torch_unmarked_train: no gate file {args.gate} within {args.timeout} s")
        time.sleep(0.01)

    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.MSELoss()
    kept = []
    leak_line = None
    for step in range(1, args.steps + 1):
        x = torch.randn(32, 256)
        y = torch.randn(32, 256)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        leak_line = inspect.currentframe().f_lineno + 1
        kept.append(torch.empty(LEAK_BYTES // 4))
        del x, y, loss
        if step == args.checkpoint_step:
            time.sleep(0.1)
            t = time.time_ns()
            seen = set()
            params = list(model.parameters())
            write(
                kind="checkpoint",
                t=t,
                step=step,
                weight_bytes=storages(params, seen),
                gradient_bytes=storages([q.grad for q in params], seen),
                optimizer_state_bytes=storages([v for st in opt.state.values() for v in st.values()], seen),
                leak_bytes=storages(kept, seen),
            )
            time.sleep(0.1)
    write(kind="done", steps=args.steps, leak_line=leak_line, leak_bytes=LEAK_BYTES, file=os.path.abspath(__file__))


if __name__ == "__main__":
    main()
