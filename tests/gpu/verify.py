#!/usr/bin/env python3
"""The GPU check's verdicts: a memscope-bpf trace of tests/gpu/train.py against what PyTorch
itself said at each checkpoint (the ledger). One PASS/FAIL line per check; exit status 1 if any
failed. Reads the trace's device-0 DB with sqlite3 only (nothing of memscope-bpf's code).

The DB's state at a checkpoint is its rows up to the checkpoint's instant: caching-pool blocks
(PTA MALLOC/FREE rows, from PyTorch's `pytorch:malloc/free` probes) and the pool's segments
(HAL MALLOC rows marked `segment: caching`, and their FREE rows). Checked at each checkpoint:
- blocks: the live PTA blocks are exactly the snapshot's allocated blocks (by address), each
  with the snapshot's requested size;
- memory_allocated(): the snapshot sizes of the DB's live blocks add up to it;
- memory_reserved(): the DB's live segments add up to it; without expandable segments they are
  exactly the snapshot's segments (address and size).
Once: the trace says it is CUDA's, and the parameters' storages are blocks tagged `weight`.
"""

import glob
import json
import os
import sqlite3
import sys

results = []


def check(name, ok, detail=""):
    results.append(ok)
    print(f"{'PASS' if ok else 'FAIL'}  {name}{'' if ok else ': ' + detail}")


def device0_db(run_root):
    found = sorted(glob.glob(os.path.join(run_root, "memscope_*", "device_0", "dump", "memscope_dump_*.db")))
    if len(found) != 1:
        raise SystemExit(f"verify.py: want one device_0 DB under {run_root}, found {found}")
    return found[0]


def rows(db):
    conn = sqlite3.connect(db)
    meta = dict(conn.execute("SELECT key, value FROM ms_meta"))
    query = 'SELECT "Event", "Event Type", "Timestamp(ns)", "Ptr", "Attr" FROM memscope_dump ORDER BY "ID"'
    out = []
    for event, event_type, ts, ptr, attr in conn.execute(query):
        attr = json.loads(attr) if attr and attr.startswith("{") else {}
        addr = int(ptr, 16) if ptr and ptr.startswith("0x") else None
        out.append((event, event_type, ts, addr, attr))
    return meta, out


class State:
    """The DB's live pool blocks and segments, replayed row by row."""

    def __init__(self):
        self.blocks = {}    # address -> (requested bytes, owner)
        self.segments = {}  # address -> bytes

    def apply(self, event, event_type, addr, attr):
        if addr is None or attr.get("shadow") == "true":
            return
        if event_type == "PTA" and attr.get("pool", "caching") == "caching":
            if event == "MALLOC":
                self.blocks[addr] = (int(attr.get("req_size", attr.get("size", 0))), attr.get("owner", ""))
            elif event == "FREE":
                self.blocks.pop(addr, None)
        elif event_type == "HAL":
            if event == "MALLOC" and attr.get("segment") == "caching":
                self.segments[addr] = int(attr["size"])
            elif event == "FREE":
                self.segments.pop(addr, None)


def at_checkpoint(cp, state):
    name = cp["name"]
    snap = {b["address"]: b for b in cp["blocks"]}
    live = set(state.blocks)
    check(f"{name}: the DB's live blocks are the snapshot's allocated blocks", live == set(snap),
          f"only in the DB {sorted(hex(a) for a in live - set(snap))}, only in the snapshot "
          f"{sorted(hex(a) for a in set(snap) - live)}")
    wrong = [hex(a) for a in live & set(snap) if state.blocks[a][0] != snap[a]["requested"]]
    check(f"{name}: each block's size is its requested size", not wrong, f"differ at {wrong}")
    allocated = sum(snap[a]["size"] for a in live if a in snap)
    check(f"{name}: memory_allocated() = {cp['allocated']}", allocated == cp["allocated"],
          f"the DB's blocks hold {allocated} B in the snapshot")
    reserved = sum(state.segments.values())
    check(f"{name}: memory_reserved() = {cp['reserved']}", reserved == cp["reserved"],
          f"the DB's live caching segments hold {reserved} B")
    if not any(s["expandable"] for s in cp["segments"]):
        want = {s["address"]: s["size"] for s in cp["segments"]}
        check(f"{name}: the DB's segments are the snapshot's", state.segments == want,
              f"DB {sorted((hex(a), s) for a, s in state.segments.items())}, snapshot "
              f"{sorted((hex(a), s) for a, s in want.items())}")


def main():
    if len(sys.argv) != 3:
        raise SystemExit("usage: verify.py TRACE_OUTPUT_FOLDER LEDGER.json")
    meta, table = rows(device0_db(sys.argv[1]))
    with open(sys.argv[2]) as f:
        ledger = json.load(f)
    check("the trace is marked as CUDA's (ms_meta backend)", meta.get("backend") == "cuda", repr(meta.get("backend")))
    check("no record was lost", meta.get("records_lost") == "0", repr(meta.get("records_lost")))
    check("PyTorch's USDT probes gave pool blocks", any(e == "MALLOC" and t == "PTA" for e, t, *_ in table))
    state, i = State(), 0
    weights = next(line for line in ledger if line["kind"] == "weights")["storages"]
    for cp in (line for line in ledger if line["kind"] == "checkpoint"):
        while i < len(table) and table[i][2] <= cp["t"]:
            event, event_type, _, addr, attr = table[i]
            state.apply(event, event_type, addr, attr)
            i += 1
        if cp["name"] == "step 1":
            untagged = [hex(w["address"]) for w in weights
                        if not state.blocks.get(w["address"], (0, ""))[1].startswith("PTA@weight")]
            check("the parameters' storages are blocks tagged weight", not untagged, f"not so at {untagged}")
        at_checkpoint(cp, state)
    failed = results.count(False)
    print(f"{len(results) - failed} of {len(results)} checks passed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
