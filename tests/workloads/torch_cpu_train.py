#!/usr/bin/env python3
"""A small REAL PyTorch training job on the CPU, for the third-party check of the tracer
(tests/integration/tests/real_torch.rs). Not a stand-in: every tensor's storage comes from
PyTorch's own CPU allocator (`c10::alloc_cpu` / `c10::free_cpu` in libc10.so).

Timeline (the test attaches `memscope-bpf trace --pid` to this process, which is already running):

1. import torch and the markers package (so libc10.so and memscope/_native.so are in
   /proc/PID/maps before the tracer looks), write the pid to --ready.
2. wait for the tracer: `memscope.wait_for_tracer()`, then until every probe's semaphore is
   raised, plus 0.2 s. Only now is the model built: a block allocated before the attach has no
   MALLOC row, and an address tag cannot give an owner to a row that does not exist, so the
   weights must be born while the tracer watches.
3. with --gate, wait until that file exists (the test creates it once the tracer AND bpftrace
   are live), then `memscope.mark(COUNT_BEGIN)`: the counted phase starts. It ends with
   `memscope.mark(COUNT_END)` after the last step. The test compares the number of
   alloc_cpu/free_cpu calls between the two marks as the tracer recorded them with bpftrace's
   own count between the same two marks.
4. build an MLP (256-512-256), Adam, `memscope.torch.auto_tag(model, opt)`, and train --steps
   steps of batch 32 (`memscope.step()` each; `opt.zero_grad()` with its default
   set_to_none=True, so gradient blocks are freed and reallocated every step, often at the same
   address).
5. the checkpoint, after the optimizer step of step --checkpoint-step (>= 2, so Adam's state
   exists and the step post-hook has tagged weights, gradients and state at least twice): the
   step's other tensors (batch, output, loss) are deleted and the backward graph is gone, so
   the only tensors this job holds are parameters, gradients and optimizer state. The process
   sleeps 0.1 s, takes the wall time T, writes the ledger line, sleeps 0.1 s again: no CPU
   tensor is allocated or freed within 0.1 s of T, so clock differences between this process
   and the tracer cannot move a block across T. The ledger line carries torch's own numbers:
   for weights (model.parameters()), gradients (p.grad) and optimizer state (every tensor in
   opt.state), the distinct storages as [data_ptr, nbytes] and their byte sums. A storage is
   counted once, in the first class that reaches it (weight, then gradient, then state), which
   is the rule memscope.torch uses when it tags; these numbers are computed here with torch's
   public storage API, not with the markers package.
6. the remaining steps; EMPTY_TENSORS empty tensors (each a `c10::alloc_cpu(0)` that returns
   NULL: no memory, and no failure either), COUNT_END, and exit.

Ledger: JSON lines, {"kind": "checkpoint", ...}, {"kind": "phase", "name": ..., "t": ...},
{"kind": "empty_tensors", "count": ...}, {"kind": "done", ...}. All times are time.time_ns().
"""

import argparse
import json
import os
import sys
import threading
import time

import torch

import memscope
import memscope.torch

COUNT_BEGIN = "ms-count-begin"  # short: bpftrace compares it on the BPF stack
COUNT_END = "ms-count-end"
# Zero-size storages made in the counted phase (torch asks its CPU allocator for 0 bytes).
EMPTY_TENSORS = 7


def now():
    return time.time_ns()


class Ledger:
    def __init__(self, path):
        self.f = open(path, "w")

    def write(self, **fields):
        self.f.write(json.dumps(fields) + "\n")
        self.f.flush()


def storages(tensors, seen):
    """Distinct storages behind `tensors` not yet in `seen` (data_ptrs, updated), as
    [data_ptr, nbytes]; empty tensors and non-tensors are skipped (they have no block)."""
    out = []
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        s = t.untyped_storage()
        ptr, nbytes = s.data_ptr(), s.nbytes()
        if not ptr or not nbytes or ptr in seen:
            continue
        seen.add(ptr)
        out.append([ptr, nbytes])
    return out


def wait_for_tracer(timeout):
    if not memscope.wait_for_tracer(timeout):
        sys.exit(f"torch_cpu_train: no tracer attached within {timeout} s: {memscope._native.semaphores()}")
    deadline = time.monotonic() + timeout
    while not all(v > 0 for v in memscope._native.semaphores().values()):
        if time.monotonic() > deadline:
            sys.exit(f"torch_cpu_train: not every probe is attached: {memscope._native.semaphores()}")
        time.sleep(0.01)
    time.sleep(0.2)


def wait_for_file(path, timeout):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(f"torch_cpu_train: gate file {path} did not appear within {timeout} s")
        time.sleep(0.01)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ledger", required=True)
    p.add_argument("--ready", required=True, help="file to write this process's pid to, once torch is imported")
    p.add_argument("--gate", help="file to wait for before the counted phase")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--checkpoint-step", type=int, default=3)
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args()
    if not 2 <= args.checkpoint_step <= args.steps:
        sys.exit("torch_cpu_train: --checkpoint-step must be in 2..--steps")

    torch.set_num_threads(1)  # one thread allocates: the counted phase is one ordered stream
    torch.manual_seed(0)
    ledger = Ledger(args.ledger)
    tmp = args.ready + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.rename(tmp, args.ready)

    wait_for_tracer(args.timeout)
    if args.gate:
        wait_for_file(args.gate, args.timeout)
    ledger.write(kind="phase", name="count_begin", t=now())
    memscope.mark(COUNT_BEGIN)

    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    handle = memscope.torch.auto_tag(model, opt)
    loss_fn = torch.nn.MSELoss()
    last_loss = None
    for step in range(1, args.steps + 1):
        memscope.step()
        x = torch.randn(32, 256)
        y = torch.randn(32, 256)
        opt.zero_grad()
        out = model(x)
        loss = loss_fn(out, y)
        loss.backward()
        opt.step()
        last_loss = loss.item()
        del x, y, out, loss
        if step == args.checkpoint_step:
            # Quiet point: only parameters, gradients and optimizer state are alive.
            time.sleep(0.1)
            t = now()
            seen = set()
            params = list(model.parameters())
            weight = storages(params, seen)
            gradient = storages([q.grad for q in params], seen)
            state = storages([v for st in opt.state.values() for v in st.values()], seen)
            ledger.write(
                kind="checkpoint",
                t=t,
                step=step,
                weight=weight,
                gradient=gradient,
                optimizer_state=state,
                weight_bytes=sum(n for _, n in weight),
                gradient_bytes=sum(n for _, n in gradient),
                optimizer_state_bytes=sum(n for _, n in state),
                # The markers package's own sum, for the record (the test uses the lists above).
                storage_bytes_weight=memscope.torch.storage_bytes(model.parameters()),
                pid=os.getpid(),
                tid=threading.get_native_id(),
            )
            time.sleep(0.1)
    empties = [torch.empty(0) for _ in range(EMPTY_TENSORS)]
    ledger.write(kind="empty_tensors", count=len(empties), t=now())
    del empties
    memscope.mark(COUNT_END)
    ledger.write(kind="phase", name="count_end", t=now())
    handle.remove()
    ledger.write(kind="done", t=now(), loss=last_loss, steps=args.steps)


if __name__ == "__main__":
    main()
