//! Privileged tests of the uses of memory: copies, sets and kernel launches as ACCESS and
//! KERNEL_LAUNCH rows, and the live blocks listed with each out-of-memory trigger.
//!
//! Ground truth: tests/workloads/standin_access.py logs the blocks it allocated and, for every
//! copy, set and launch, which of its blocks (by start address and kind) each address it passed
//! falls in; the stand-in allocator's ledger gives its segments. None of it comes from the
//! tracer.

use std::collections::BTreeSet;

use memscope_integration::*;
use serde::Deserialize;

#[derive(Debug, Deserialize)]
struct Line {
    kind: String,
    #[serde(default, rename = "type")]
    block_type: String,
    #[serde(default)]
    ptr: u64,
    #[serde(default)]
    access: String,
    #[serde(default)]
    block: u64,
    #[serde(default)]
    addr: u64,
    #[serde(default)]
    api: String,
    #[serde(default)]
    name: String,
    #[serde(default)]
    args_size: u64,
    #[serde(default)]
    rc: i64,
}

fn run(env: &TestEnv) -> (Output, Vec<Line>, Vec<PoolEntry>) {
    let (out, ledger) = trace_standin_script(env, "standin_access.py", "access.jsonl");
    let text = std::fs::read_to_string(&ledger).unwrap();
    let lines = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    (out, lines, read_pool_ledger(&pool_ledger_path(&ledger)))
}

#[test]
fn copies_sets_and_kernel_arguments_are_accesses_of_the_blocks_they_touch() {
    let env = env("access_rows");
    let (out, ledger, _) = run(&env);
    let rows: Vec<&DbRow> = out.rows().filter(|r| r.event == "ACCESS").collect();
    let got: BTreeSet<(String, String, u64, u64, String)> = rows
        .iter()
        .map(|r| {
            let ty = r.attr.get("type").cloned().unwrap_or_default();
            let kind = if ty.starts_with("PTA") { "PTA" } else { ty.as_str() };
            let block = u64::from_str_radix(r.attr["block"].trim_start_matches("0x"), 16).unwrap();
            (r.event_type.clone(), kind.to_owned(), block, r.ptr_value().unwrap(), r.attr["api"].clone())
        })
        .collect();
    let want: BTreeSet<(String, String, u64, u64, String)> = ledger
        .iter()
        .filter(|l| l.kind == "access")
        .map(|l| (l.access.clone(), l.block_type.clone(), l.block, l.addr, l.api.clone()))
        .collect();
    assert_eq!(got, want, "ACCESS rows against the workload's own record of what it touched");
    assert_eq!(rows.len(), want.len(), "one row per use (no duplicates for a block named twice)");
    // Each row carries its block's allocation id, the one on the block's MALLOC row.
    for r in &rows {
        let block = &r.attr["block"];
        let malloc = out
            .rows()
            .filter(|m| m.event == "MALLOC" && &m.attr["addr"] == block && m.ts <= r.ts)
            .max_by_key(|m| m.ts)
            .unwrap_or_else(|| panic!("no MALLOC for the block of {r:?}"));
        assert_eq!(r.attr.get("allocation_id"), malloc.attr.get("allocation_id"), "{r:?}");
    }
    let launches: Vec<&DbRow> = out.rows().filter(|r| r.event == "KERNEL_LAUNCH").collect();
    let expected: Vec<&Line> = ledger.iter().filter(|l| l.kind == "launch").collect();
    assert_eq!(launches.len(), expected.len());
    for (row, line) in launches.iter().zip(&expected) {
        assert_eq!(row.name, line.name, "the kernel is named from aclrtBinaryGetFunction");
        assert_eq!(row.attr_u64("args_size"), Some(line.args_size));
    }
}

/// Blocks of one kind live on device 0 just before an out-of-memory trigger, from the ledgers:
/// (start, size, birth order).
fn live_before(kind: &str, ledger: &[Line], pool: &[PoolEntry], trigger_ts: u64, out: &Output) -> Vec<(u64, u64)> {
    // The DB's MALLOC rows before the trigger that the ledgers know, minus those freed before it.
    let known: BTreeSet<u64> = match kind {
        "HAL" => ledger
            .iter()
            .filter(|l| l.kind == "block" && l.block_type == "HAL")
            .map(|l| l.ptr)
            .chain(pool.iter().filter(|e| e.ev == "segment_alloc").map(|e| e.ptr))
            .collect(),
        _ => pool.iter().filter(|e| e.ev == "block_malloc").map(|e| e.ptr).collect(),
    };
    let mut live: Vec<(u64, u64, u64)> = Vec::new();
    for r in out.rows().filter(|r| r.event_type == kind && r.ts < trigger_ts && !r.is_shadow()) {
        let Some(ptr) = r.ptr_value() else { continue };
        match r.event.as_str() {
            "MALLOC" if known.contains(&ptr) => live.push((r.ts, ptr, r.attr_u64("size").unwrap())),
            "FREE" => live.retain(|(_, p, _)| *p != ptr),
            _ => {}
        }
    }
    live.sort();
    live.into_iter().map(|(_, p, s)| (p, s)).collect()
}

#[test]
fn out_of_memory_lists_the_recent_and_largest_live_blocks() {
    let env = env("access_oom");
    let (out, ledger, pool) = run(&env);
    assert!(ledger.iter().any(|l| l.kind == "oom" && l.api == "aclrtMalloc" && l.rc == 207_001));
    for (trigger_name, kind) in [("aclrtMalloc", "HAL"), ("DeviceCachingAllocator::malloc", "PTA")] {
        let trigger = out
            .rows()
            .find(|r| r.event_type == "OOM_TRIGGER" && r.name == trigger_name)
            .unwrap_or_else(|| panic!("no OOM_TRIGGER of {trigger_name}"));
        let live = live_before(kind, &ledger, &pool, trigger.ts, &out);
        assert!(!live.is_empty());
        let listed = |ty: &str| -> Vec<(u64, u64)> {
            let mut rows: Vec<&DbRow> =
                out.rows().filter(|r| r.event_type == ty && r.ts == trigger.ts && r.name == trigger_name).collect();
            rows.sort_by_key(|r| r.attr_u64("rank"));
            rows.iter().map(|r| (r.ptr_value().unwrap(), r.attr_u64("size").unwrap())).collect()
        };
        let mut newest_first = live.clone();
        newest_first.reverse();
        newest_first.truncate(10);
        assert_eq!(listed("OOM_RECENT_ALLOC"), newest_first, "{trigger_name}: the most recent {kind} blocks");
        let mut largest = live.clone();
        largest.sort_by_key(|b| std::cmp::Reverse(b.1));
        largest.truncate(10);
        let got: Vec<u64> = listed("OOM_TOP_ALLOC").iter().map(|(_, s)| *s).collect();
        let want: Vec<u64> = largest.iter().map(|(_, s)| *s).collect();
        assert_eq!(got, want, "{trigger_name}: the largest {kind} blocks");
    }
}
