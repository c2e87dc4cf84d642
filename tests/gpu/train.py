#!/usr/bin/env python3
"""The GPU check's workload: a short real training loop on an NVIDIA GPU, tagged with the
markers, that logs what PyTorch itself says about its CUDA memory at checkpoints.

At each checkpoint (after steps 1, 3 and 5, and after `torch.cuda.empty_cache()`) the job
synchronizes, sits still for 50 ms on each side of the instant it logs (no allocation or free
happens near it), fires `memscope.mark(name)`, and writes to the ledger:
`torch.cuda.memory_allocated()`, `memory_reserved()`, and from `torch.cuda.memory._snapshot()`
every segment of device 0 (address, total size) and every allocated block (address, size,
requested size). It also logs the parameters' storages (address, bytes), which were allocated
under the tag `weight`. Run by tests/gpu/run.sh under `memscope-bpf trace`; not part of CI.
"""

import argparse
import json
import time

import torch

import memscope

QUIET_S = 0.05


def snapshot_of_device0():
    segments, blocks = [], []
    for seg in torch.cuda.memory._snapshot()["segments"]:
        if seg["device"] != 0:
            continue
        segments.append({"address": seg["address"], "size": seg["total_size"],
                         "expandable": seg.get("is_expandable", False)})
        for block in seg["blocks"]:
            if block["state"] == "active_allocated":
                blocks.append({"address": block["address"], "size": block["size"],
                               "requested": block.get("requested_size", block["size"])})
    return segments, blocks


def checkpoint(name, ledger):
    torch.cuda.synchronize()
    time.sleep(QUIET_S)
    segments, blocks = snapshot_of_device0()
    line = {"kind": "checkpoint", "name": name, "t": time.time_ns(),
            "allocated": torch.cuda.memory_allocated(0), "reserved": torch.cuda.memory_reserved(0),
            "segments": segments, "blocks": blocks}
    memscope.mark(name)
    time.sleep(QUIET_S)
    ledger.append(line)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ledger", required=True)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("train.py: torch sees no CUDA device")
    if not memscope.wait_for_tracer(timeout=60):
        raise SystemExit("train.py: no tracer attached within 60 s")
    torch.cuda.set_device(0)
    ledger = []
    with memscope.describe("weight"):
        model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).cuda()
    ledger.append({"kind": "weights", "storages": [
        {"address": p.untyped_storage().data_ptr(), "bytes": p.untyped_storage().nbytes()} for p in model.parameters()]})
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = torch.randn(256, 1024, device="cuda")
    for step in range(1, args.steps + 1):
        with memscope.describe("activation"):
            loss = model(data).square().mean()
        loss.backward()
        with memscope.describe("optimizer_state"):
            opt.step()
        opt.zero_grad(set_to_none=True)
        del loss
        memscope.step()
        if step in (1, 3, args.steps):
            checkpoint(f"step {step}", ledger)
    del opt, data
    torch.cuda.empty_cache()
    checkpoint("after empty_cache", ledger)
    with open(args.ledger, "w") as f:
        json.dump(ledger, f)


if __name__ == "__main__":
    main()
