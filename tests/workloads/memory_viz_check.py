#!/usr/bin/env python3
"""Reads an exported memory_viz snapshot with PyTorch's OWN code (tests only): loads
torch/cuda/_memory_viz.py by path (it needs only the standard library) and runs segsum, trace,
segment_plot and trace_plot on the snapshot, then prints, as JSON, what PyTorch's `memory()`
flamegraph lines say is allocated (the requested bytes of active blocks) and how many active
blocks there are, the pickle opcodes the file uses (the memory_viz page's own unpickler
knows only some), and each allocation's frames as PyTorch's `_frames_fmt` prints them.

Usage: memory_viz_check.py MEMORY_VIZ_PY SNAPSHOT DEVICE
"""

import importlib.util
import json
import pickle
import pickletools
import sys


def main():
    viz_path, snapshot_path, device = sys.argv[1], sys.argv[2], int(sys.argv[3])
    spec = importlib.util.spec_from_file_location("memory_viz", viz_path)
    viz = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(viz)
    raw = open(snapshot_path, "rb").read()
    data = pickle.loads(raw)
    summary = viz.segsum(data)  # asserts that every segment's blocks tile it exactly
    text = viz.trace(data)
    pages = [viz.segment_plot(data), viz.trace_plot(data)]
    lines = viz.memory(data, format_flamegraph=lambda lines: lines).splitlines()
    active = [int(l.rsplit(" ", 1)[1]) for l in lines if ";active_allocated;" in l and "<gaps>" not in l]
    print(json.dumps({
        "allocated": sum(active),
        "active_blocks": len(active),
        "segments": len(data["segments"]),
        "entries": len(data["device_traces"][device]),
        "trace_lines": len(text.splitlines()),
        "segsum_total_allocated": [l for l in summary.splitlines() if l.startswith("total_allocated")][0],
        "pages": [len(p) for p in pages],
        "protocol": raw[1],
        "opcodes": sorted({op.name for op, _, _ in pickletools.genops(raw)}),
        # Per allocation of the trace, the frames PyTorch's own formatting prints for it.
        "alloc_frames": [viz._frames_fmt(e["frames"]) for e in data["device_traces"][device] if e["action"] == "alloc"],
        "block_frames": sum(1 for s in data["segments"] for b in s["blocks"] if b["frames"]),
    }))


if __name__ == "__main__":
    main()
