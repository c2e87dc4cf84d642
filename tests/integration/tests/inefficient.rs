//! Privileged test of the inefficient-memory analysis on a real trace: the operator and access
//! rows come through the markers' USDT probes and the tracer, the blocks from the stand-in
//! caching allocator, and `analyze --analysis inefficient` must flag exactly the blocks the
//! scenario (tests/workloads/standin_inefficient.py) was built to make early, late, idle, lazy,
//! delayed or long idle — precision and recall 1 on the scenario's own truth.

use std::collections::BTreeMap;

use memscope_integration::*;
use serde::Deserialize;

/// msMemScope's op-index types (the only ones written into `inefficient_type`).
const MSMEMSCOPE_TYPES: [&str; 3] = ["early_allocation", "late_deallocation", "temporary_idleness"];

#[derive(Debug, Deserialize)]
struct Block {
    label: String,
    ptr: u64,
    t0: u64,
    t1: u64,
    flags: Vec<String>,
}

#[test]
fn injected_inefficiencies_are_flagged_exactly() {
    let env = env("inefficient");
    let (output, ledger) = trace_standin_script(&env, "standin_inefficient.py", "blocks.jsonl");
    let blocks: Vec<Block> =
        std::fs::read_to_string(&ledger).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let db = output.db("device_0");
    let run = std::process::Command::new(&env.bin)
        .args(["analyze", "--analysis", "inefficient", "--lazy-used", "200ms", "--delayed-free", "200ms"])
        .args(["--long-idle", "200ms"])
        .arg(db)
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));

    // The DB after the analysis: each PTA MALLOC's Attr and its ms_inefficient flags.
    let after = read_db(db, "device_0");
    let conn = rusqlite::Connection::open(db).unwrap();
    let table: BTreeMap<i64, String> = conn
        .prepare("SELECT malloc_id, flags FROM ms_inefficient")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    // The allocator reuses addresses within microseconds, so a block's MALLOC row is found by
    // order at its address: the scenario's n-th block at an address is the n-th PTA MALLOC there.
    let mut rows_at: BTreeMap<u64, Vec<&DbRow>> = BTreeMap::new();
    for r in after.iter().filter(|r| r.event == "MALLOC" && r.event_type == "PTA") {
        rows_at.entry(r.ptr_value().unwrap()).or_default().push(r);
    }
    let mut blocks_at: BTreeMap<u64, Vec<&Block>> = BTreeMap::new();
    for b in &blocks {
        blocks_at.entry(b.ptr).or_default().push(b);
    }
    let mut problems = Vec::new();
    for (ptr, mut at) in blocks_at {
        at.sort_by_key(|b| b.t0);
        let mut rows = rows_at.get(&ptr).cloned().unwrap_or_default();
        rows.sort_by_key(|r| (r.ts, r.id));
        assert_eq!(rows.len(), at.len(), "{ptr:#x}: one MALLOC row per block the scenario allocated there");
        for (b, malloc) in at.into_iter().zip(rows) {
            assert!(malloc.ts + CLOCK_TOLERANCE_NS >= b.t0 && malloc.ts <= b.t1 + CLOCK_TOLERANCE_NS, "{}", b.label);
            let msmemscope: Vec<&str> = malloc.attr.get("inefficient_type").map_or(vec![], |t| t.split(',').collect());
            let want_ms: Vec<&str> =
                b.flags.iter().map(String::as_str).filter(|f| MSMEMSCOPE_TYPES.contains(f)).collect();
            if msmemscope != want_ms {
                problems.push(format!("{}: inefficient_type {msmemscope:?}, the scenario built {want_ms:?}", b.label));
            }
            let all: Vec<&str> =
                table.get(&malloc.id).map_or(vec![], |f| f.split(',').filter(|s| !s.is_empty()).collect());
            let want_all: Vec<&str> = b.flags.iter().map(String::as_str).collect();
            if all != want_all {
                problems.push(format!("{}: flags {all:?}, the scenario built {want_all:?}", b.label));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    // Every flag type was exercised, and some blocks were built to have none.
    for flag in
        ["early_allocation", "late_deallocation", "temporary_idleness", "lazy_used", "delayed_free", "long_idle"]
    {
        assert!(blocks.iter().any(|b| b.flags.iter().any(|f| f == flag)), "{flag}");
    }
    assert!(blocks.iter().filter(|b| b.flags.is_empty()).count() >= 5);
}
