//! The caching allocator's rows (`PTA`) against the stand-in torch_npu allocator's own ledger:
//! its blocks, its counters, its segments, and its pool inside the driver's bytes.

use std::collections::HashMap;

use super::{tail_pairs, CLOCK_TOLERANCE_NS};
use crate::ledgers::PoolEntry;
use crate::readers::{DbRow, Output};

/// What a PTA check compares.
#[derive(Clone, Copy, Debug)]
pub struct PtaCheck {
    /// Row sizes must be the allocator's block sizes (not just the request).
    pub sizes: bool,
    /// `used` and `total` must equal the allocator's counters after each event.
    pub counters: bool,
    /// Which pools the trace can see: caching (tensors), external (MallocBlock), workspace.
    pub caching: bool,
    pub external: bool,
    pub workspace: bool,
    /// When the trace went live (0 for launch mode): earlier events may be missing, and the
    /// counters, which cannot know older blocks and segments, may only be lower.
    pub after_ns: u64,
}
/// PTA rows against the allocator's own ledger: every block it handed out and took back is one
/// MALLOC and one FREE row on its device, at its time, with its address (and size and counters
/// when `check` says the trace can know them); no PTA row is made up.
pub fn assert_pta(pool: &[PoolEntry], out: &Output, check: PtaCheck) {
    let rows: Vec<&DbRow> = out.call_rows().into_iter().filter(|r| r.event_type == "PTA").collect();
    let visible = |e: &PoolEntry| match e.pool.as_deref() {
        Some("caching") => check.caching,
        Some("external") => check.external,
        Some("workspace") => check.workspace,
        _ => false,
    };
    // A block freed and handed out again at once has several events within the clock tolerance
    // of one row, so rows and events pair up in order per (thread, address, kind).
    let mut events: HashMap<(u32, u64, &str), Vec<&PoolEntry>> = HashMap::new();
    for (ev, event) in [("block_malloc", "MALLOC"), ("block_free", "FREE")] {
        for e in pool.iter().filter(|e| e.ev == ev && visible(e)) {
            events.entry((e.tid, e.ptr, event)).or_default().push(e);
        }
    }
    let mut seen: HashMap<(u32, u64, &str), Vec<&DbRow>> = HashMap::new();
    for r in rows.iter().filter(|r| !r.attr.contains_key("implied") && !r.is_shadow()) {
        let ptr = r.ptr_value().unwrap_or_else(|| panic!("PTA row without an address: {r:?}"));
        seen.entry((r.tid, ptr, r.event.as_str())).or_default().push(r);
    }
    for (key, here) in &mut events {
        here.sort_by_key(|e| e.t0);
        let mut got = seen.remove(key).unwrap_or_default();
        got.sort_by_key(|r| (r.ts, r.id));
        let (missed, paired) = tail_pairs(here, got.len(), &format!("allocator events at {key:?}"));
        for e in missed {
            assert!(e.t0.unwrap() <= check.after_ns, "allocator event without a row: {e:?}");
        }
        for (r, e) in got.iter().zip(paired.iter()) {
            let (t0, t1) = (e.t0.unwrap(), e.t1.unwrap());
            assert!(
                r.ts + CLOCK_TOLERANCE_NS >= t0 && r.ts <= t1 + CLOCK_TOLERANCE_NS,
                "row and event apart in time: {r:?} {e:?}"
            );
            assert_eq!(r.device, e.device.to_string(), "{r:?} {e:?}");
            let want_pool = if e.pool.as_deref() == Some("workspace") { "workspace" } else { "caching" };
            assert_eq!(r.attr.get("pool").map(String::as_str), Some(want_pool), "{r:?}");
            if r.event == "MALLOC" {
                // The pool's label, then the tags open at the allocation, if any (`PTA@weight`).
                let owner = if want_pool == "workspace" { "PTA_WORKSPACE" } else { "PTA" };
                let got = r.attr.get("owner").map_or("", String::as_str);
                let tagged = got.strip_prefix(owner).is_some_and(|rest| rest.is_empty() || rest.starts_with('@'));
                assert!(tagged, "decomposition owner {owner}: {r:?}");
            }
            if check.sizes && !r.attr.contains_key("unmatched") {
                if let Some(size) = e.size {
                    assert_eq!(r.attr_u64("size"), Some(size), "block size: {r:?} {e:?}");
                }
            }
            let (used, total) = (r.attr_u64("used").unwrap(), r.attr_u64("total").unwrap());
            let pairs = e.counter_pairs();
            if check.counters && check.after_ns == 0 {
                assert!(
                    pairs.contains(&(used, total)),
                    "used/total = the allocator's allocated/reserved bytes {pairs:?}: {r:?} {e:?}"
                );
            } else if check.counters {
                assert!(
                    pairs.iter().any(|(a, t)| used <= *a && total <= *t),
                    "used/total above the allocator's allocated/reserved bytes {pairs:?}: {r:?} {e:?}"
                );
            }
        }
    }
    assert!(seen.is_empty(), "PTA rows with no allocator event: {:#?}", seen.values().collect::<Vec<_>>());
}
/// Every segment step the allocator logged is one HAL row of the runtime call it made, at the
/// segment's address, on its device and thread: `segment_alloc` an `aclrtMallocAlign32` MALLOC
/// of the segment's size, `segment_free` an `aclrtFree`, and with expandable segments each
/// page `segment_map` an `aclrtMapMem` MALLOC of the page's size and `segment_unmap` an
/// `aclrtUnmapMem` FREE.
pub fn assert_segments(pool: &[PoolEntry], out: &Output) {
    let kinds = [
        ("segment_alloc", "MALLOC", "aclrtMallocAlign32", "req_size"),
        ("segment_free", "FREE", "aclrtFree", "size"),
        ("segment_map", "MALLOC", "aclrtMapMem", "size"),
        ("segment_unmap", "FREE", "aclrtUnmapMem", "size"),
    ];
    assert_segment_rows(pool, out, &kinds);
}
/// As [`assert_segments`], with the rows each segment step is made of given as (step, Event,
/// API, the size's attr key): the CUDA allocator's are `cudaMalloc`, `cudaFree`, `cuMemMap`
/// and `cuMemUnmap`.
pub fn assert_segment_rows(pool: &[PoolEntry], out: &Output, kinds: &[(&str, &str, &str, &str)]) {
    let rows = out.call_rows();
    for &(ev, event, name, size_key) in kinds {
        let mut events: HashMap<(u32, u64), Vec<&PoolEntry>> = HashMap::new();
        for e in pool.iter().filter(|e| e.ev == ev) {
            events.entry((e.tid, e.ptr)).or_default().push(e);
        }
        let mut seen: HashMap<(u32, u64), Vec<&DbRow>> = HashMap::new();
        for r in rows.iter().filter(|r| r.event_type == "HAL" && r.event == event && r.name == name && !r.is_shadow()) {
            seen.entry((r.tid, r.ptr_value().unwrap())).or_default().push(r);
        }
        for (key, here) in &mut events {
            here.sort_by_key(|e| e.t);
            let got = seen.remove(key).unwrap_or_default();
            // The tracer may see more calls at an address than the allocator's segments (the
            // workload's own runtime calls); each segment step takes the nearest unused row.
            let mut used = vec![false; got.len()];
            for e in here.iter() {
                // The runtime call ran between the allocator's `t0` and `t`: a slow one (20 MiB
                // of fresh pages on a loaded machine) starts well before the step is logged.
                let t = e.t.unwrap();
                let t0 = e.t0.unwrap_or(t);
                let off = |ts: u64| if ts < t0 { t0 - ts } else { ts.saturating_sub(t) };
                let (i, r) = got
                    .iter()
                    .enumerate()
                    .filter(|(i, r)| !used[*i] && off(r.ts) <= CLOCK_TOLERANCE_NS)
                    .min_by_key(|(_, r)| off(r.ts))
                    .unwrap_or_else(|| panic!("no {name} {event} row for segment event {e:?}"));
                used[i] = true;
                assert_eq!(r.device, e.device.to_string(), "{r:?} {e:?}");
                assert_eq!(r.attr_u64(size_key), e.size, "segment size ({size_key}): {r:?} {e:?}");
            }
        }
    }
}
/// A pool's reserved bytes are device memory, so they never exceed the device's live driver
/// bytes at the same moment. A pool row's time and its `total` are not read at the same instant
/// of its call: another thread's segment taken in between can be in the total while its driver
/// row comes later (seen once in a fresh-clone run, by 1.9 MiB on a FREE, with two threads), so
/// the driver bytes are the most over the call's span, taken as [`CLOCK_TOLERANCE_NS`] from the
/// row.
pub fn assert_pta_within_hal(out: &Output) {
    for (folder, (_, rows)) in &out.files {
        let mut ordered: Vec<&DbRow> = rows.iter().collect();
        ordered.sort_by_key(|r| (r.ts, r.id));
        // The driver's live bytes after each HAL row, in time order.
        let mut hal: Vec<(u64, u64)> = Vec::new();
        for r in &ordered {
            if r.event_type == "HAL" && (r.event == "MALLOC" || r.event == "FREE") {
                let before = hal.last().map_or(0, |h| h.1);
                hal.push((r.ts, r.attr_u64("used").unwrap_or(before)));
            }
        }
        for r in ordered.iter().filter(|r| r.event_type == "PTA" && !r.is_shadow()) {
            let total = r.attr_u64("total").unwrap();
            let at = hal.partition_point(|h| h.0 <= r.ts);
            let now = at.checked_sub(1).map_or(0, |i| hal[i].1);
            let span = hal[at..].iter().take_while(|h| h.0 <= r.ts + CLOCK_TOLERANCE_NS).map(|h| h.1).max();
            let most = span.map_or(now, |s| s.max(now));
            assert!(total <= most, "{folder}: PTA total {total} > HAL bytes {most} (over the call's span) at {r:?}");
        }
    }
}
