#!/usr/bin/env python3
"""A REAL PyTorch FSDP2 job on the CPU: two ranks (gloo), each an MLP whose layers and root are
`fully_shard`ed, Adam, a few steps; no markers. tests/integration/tests/real_torch.rs launches it
under `memscope-bpf trace` (each rank a forked child the trace follows) and checks that each
rank's sharded weights and gradients, as the tracer inferred them from its Python stacks, are
its local shards' bytes as torch itself counts them.

Each rank, after the optimizer step of --checkpoint-step, sits still 0.1 s on each side of an
instant T (both ranks wait at a barrier first, so nothing else allocates) and writes a ledger
line: {"kind": "checkpoint", "rank", "pid", "t", "weight_bytes", "gradient_bytes"}: the byte
sums of the distinct storages behind its parameters' local shards (`to_local()`) and behind
their gradients' local shards.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def storages(tensors, seen):
    total = 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def rank_main(rank, args):
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(1, args.steps + 1):
        opt.zero_grad()
        loss = model(torch.randn(16, 256)).pow(2).mean()
        loss.backward()
        opt.step()
        del loss
        if step == args.checkpoint_step:
            dist.barrier()
            time.sleep(0.1)
            t = time.time_ns()
            params = list(model.parameters())
            weight = storages([p.to_local() for p in params], set())
            gradient = storages([p.grad.to_local() for p in params], set())
            line = dict(kind="checkpoint", rank=rank, pid=os.getpid(), t=t, weight_bytes=weight, gradient_bytes=gradient)
            with open(args.ledger, "a") as f:
                f.write(json.dumps(line) + "\n")
            time.sleep(0.1)
            dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ledger", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--checkpoint-step", type=int, default=2)
    p.add_argument("--port", type=int, default=29531)
    args = p.parse_args()
    # Forked: the ranks are children the trace follows, with the interpreter it already found.
    mp.start_processes(rank_main, args=(args,), nprocs=2, start_method="fork")


if __name__ == "__main__":
    main()
