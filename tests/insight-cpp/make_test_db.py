#!/usr/bin/env python3
"""Writes a small DB in memscope-bpf's output format for insight-harness, and the slices
Insight should draw from it (expected.jsonl beside it, or the path given by --expected).

    make_test_db.py OUT.db [--expected OUT.jsonl] [--with-touching]

Tables as memscope-core writes them (memscope-core/src/store/schema.rs, py_trace.rs):
`memscope_dump` with msMemScope's 12 columns, every row on device "0", and one
`python_trace_<pid>` table per process: times TEXT of 19 digits, intervals made the way
ingest::py_trace makes them (each start moved depth+1 ns later, each end depth+1 ns earlier, so
a child starts after its parent and siblings never touch).

--with-touching adds process 4243 whose thread 201 has two outermost intervals that touch (the
first ends where the second starts), as raw samples would give without that adjustment: Insight
then draws the second one under the first (depth 1), which the expected file records.
"""
import argparse
import json
import os
import sqlite3

T0 = 1_700_000_000_000_000_000  # wall-clock ns, 19 digits
MS = 1_000_000

DUMP_COLUMNS = [
    ("ID", "INTEGER"), ("Event", "TEXT"), ("Event Type", "TEXT"), ("Name", "TEXT"),
    ("Timestamp(ns)", "INTEGER"), ("Process Id", "INTEGER"), ("Thread Id", "INTEGER"),
    ("Device Id", "TEXT"), ("Ptr", "TEXT"), ("Attr", "TEXT"),
    ("Call Stack(Python)", "TEXT"), ("Call Stack(C)", "TEXT"),
]

PID = 4242


def interval(depth, first_ms, last_ms):
    """A function seen on the stack from the sample at first_ms to the one before last_ms, with
    the ends half way to the neighbouring samples (10 ms apart), then moved in by depth+1 ns."""
    d = depth + 1
    return T0 + first_ms * MS + d, T0 + last_ms * MS - d


# (tid, FuncInfo, depth, start_ms, end_ms): what the writer means each interval to be.
TRACE = [
    (101, "train.py(10): main", 0, 0, 100),
    (101, "train.py(20): train_step", 1, 10, 60),
    (101, "model.py(5): forward", 2, 10, 30),
    (101, "model.py(40): backward", 2, 30, 60),
    (101, "torch/functional.py(77): matmul", 3, 40, 50),
    (101, "train.py(20): train_step", 1, 60, 90),
    (101, "model.py(5): forward", 2, 60, 90),
    (102, "threading.py(1012): run", 0, 5, 95),
    (102, "loader.py(33): fetch", 1, 15, 45),
    (102, "loader.py(33): fetch", 1, 45, 75),
]

TOUCHING_PID = 4243
# Raw intervals, not moved in: the second starts exactly where the first ends.
TOUCHING = [
    (201, "raw.py(1): first", 0, T0 + 10 * MS, T0 + 20 * MS),
    (201, "raw.py(2): second", 0, T0 + 20 * MS, T0 + 30 * MS),
]


def dump_rows():
    rows = []
    attr = lambda **kw: json.dumps({k: str(v) for k, v in kw.items()}, separators=(",", ":"))
    ptr_a, ptr_b = "0x0000124080000000", "0x0000124080200000"
    rows.append(("SYSTEM", "START_TRACE", "N/A", T0 - 5 * MS, "N/A", "{}"))
    rows.append(("MALLOC", "HAL", "N/A", T0 + 12 * MS, ptr_a,
                 attr(addr=ptr_a, size=2097152, owner="CANN", allocation_id=1)))
    rows.append(("MALLOC", "HAL", "N/A", T0 + 41 * MS, ptr_b,
                 attr(addr=ptr_b, size=4096, owner="CANN", allocation_id=2)))
    rows.append(("FREE", "HAL", "N/A", T0 + 58 * MS, ptr_a,
                 attr(addr=ptr_a, size=2097152, owner="CANN", allocation_id=1)))
    rows.append(("SYSTEM", "STOP_TRACE", "N/A", T0 + 105 * MS, "N/A", "{}"))
    return [
        (i + 1, ev, ty, name, ts, PID, 101, "0", ptr, at, "", "")
        for i, (ev, ty, name, ts, ptr, at) in enumerate(rows)
    ]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--expected")
    ap.add_argument("--with-touching", action="store_true")
    args = ap.parse_args()
    expected_path = args.expected or os.path.join(os.path.dirname(os.path.abspath(args.out)), "expected.jsonl")

    if os.path.exists(args.out):
        os.remove(args.out)
    con = sqlite3.connect(args.out)
    cols = ", ".join(f'"{n}" {t}' for n, t in DUMP_COLUMNS)
    con.execute(f"CREATE TABLE IF NOT EXISTS memscope_dump ({cols})")
    con.executemany(f"INSERT INTO memscope_dump VALUES ({','.join('?' * 12)})", dump_rows())

    def create_trace(pid):
        con.execute(
            f'CREATE TABLE IF NOT EXISTS python_trace_{pid} ("FuncInfo" TEXT, "StartTime(ns)" TEXT, '
            '"EndTime(ns)" TEXT, "Thread Id" INTEGER, "Process Id" INTEGER)')

    def insert_trace(pid, tid, func, start, end):
        assert len(str(start)) == 19 and len(str(end)) == 19
        con.execute(
            f'INSERT INTO python_trace_{pid} ("FuncInfo", "StartTime(ns)", "EndTime(ns)", "Thread Id", '
            '"Process Id") VALUES (?, ?, ?, ?, ?)', (func, str(start), str(end), tid, pid))

    expected = []
    create_trace(PID)
    for tid, func, depth, a, b in TRACE:
        start, end = interval(depth, a, b)
        insert_trace(PID, tid, func, start, end)
        expected.append({"kind": "slice", "tid": tid, "func": func, "start": start, "end": end, "depth": depth})
    if args.with_touching:
        create_trace(TOUCHING_PID)
        for i, (tid, func, _, start, end) in enumerate(TOUCHING):
            insert_trace(TOUCHING_PID, tid, func, start, end)
            # Insight pops a parent only once it ended before the next start: the second nests.
            expected.append({"kind": "slice", "tid": tid, "func": func, "start": start, "end": end, "depth": i})
    con.commit()
    con.close()

    # The harness prints each thread's slices in Insight's order: by start time.
    expected.sort(key=lambda s: (s["tid"], s["start"]))
    with open(expected_path, "w") as f:
        for s in expected:
            f.write(json.dumps(s, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
