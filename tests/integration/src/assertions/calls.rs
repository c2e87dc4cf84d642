//! The workload's calls against the rows: which row each ledger entry must produce
//! ([`expect`]), why a row does not match ([`mismatch`]), exactly (launch mode) or as a
//! subsequence after the probes went live (attach mode); the blocks left live at the end; frees
//! that carry their block's size.

use std::collections::{BTreeMap, HashMap};

use crate::ledgers::Entry;
use crate::readers::{DbRow, Output};

/// How a ledger entry must appear in the output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Expect {
    pub event: &'static str,
    pub event_type: &'static str,
    /// `None`: any device folder (address reservations are not device memory).
    pub device: Option<String>,
    /// The `Ptr` column for MALLOC/FREE rows.
    pub ptr: Option<u64>,
    /// An Attr key that must hold this value (addresses and handles of VMM rows, sizes).
    pub attrs: Vec<(&'static str, u64)>,
}
const OOM: i64 = 207_001;
/// The row a ledger entry must produce, or `None` for calls the tracer does not record.
pub fn expect(e: &Entry) -> Option<Expect> {
    let device = e.device_id();
    let malloc_api = matches!(
        e.api.as_str(),
        "aclrtMalloc"
            | "aclrtMallocAlign32"
            | "aclrtMallocCached"
            | "aclrtMallocWithCfg"
            | "aclrtMallocHost"
            | "halMemAlloc"
    );
    if e.rc != 0 {
        if malloc_api && e.rc == OOM {
            return Some(Expect {
                event: "OOM_DETAIL",
                event_type: "OOM_TRIGGER",
                device,
                ptr: None,
                attrs: vec![("req_size", e.size?)],
            });
        }
        let recorded = !matches!(e.api.as_str(), "aclrtSetDevice" | "aclrtGetDevice" | "aclrtMemcpy" | "aclrtMemset");
        return recorded.then(|| Expect {
            event: "API_ERROR",
            event_type: if e.api.ends_with("Host") { "HOST" } else { "HAL" },
            device,
            ptr: None,
            attrs: vec![],
        });
    }
    let size = |v: &mut Vec<(&'static str, u64)>| {
        if let Some(s) = e.size {
            v.push(("size", s));
        }
    };
    Some(match e.api.as_str() {
        // Pinned host memory, named as msMemScope names it (Insight's decomposition accepts it).
        "aclrtMallocHost" => Expect {
            event: "MALLOC",
            event_type: "HOST_PINNED",
            device: Some("cpu".into()),
            ptr: e.ptr,
            attrs: vec![("size", e.size?)],
        },
        "aclrtFreeHost" => Expect {
            event: "FREE",
            event_type: "HOST_PINNED",
            device: Some("cpu".into()),
            ptr: e.ptr,
            attrs: vec![("size", e.size?)],
        },
        // Device memory is taken by the driver: the row's size is the driver's (checked against
        // the driver's ledger by `assert_driver_truth`), the request is `req_size`.
        _ if malloc_api => {
            Expect { event: "MALLOC", event_type: "HAL", device, ptr: e.ptr, attrs: vec![("req_size", e.size?)] }
        }
        "aclrtFree" | "halMemFree" => Expect { event: "FREE", event_type: "HAL", device, ptr: e.ptr, attrs: vec![] },
        "aclrtMapMem" => Expect {
            event: "MALLOC",
            event_type: "HAL",
            device,
            ptr: e.ptr,
            attrs: vec![("size", e.size?), ("handle", e.handle?)],
        },
        "aclrtUnmapMem" => {
            let mut attrs = vec![];
            size(&mut attrs);
            Expect { event: "FREE", event_type: "HAL", device, ptr: e.ptr, attrs }
        }
        "aclrtReserveMemAddress" => Expect {
            event: "VMM",
            event_type: "RESERVE",
            device: None,
            ptr: None,
            attrs: vec![("addr", e.ptr?), ("size", e.size?)],
        },
        "aclrtReleaseMemAddress" => {
            Expect { event: "VMM", event_type: "RELEASE", device: None, ptr: None, attrs: vec![("addr", e.ptr?)] }
        }
        "aclrtMallocPhysical" => Expect {
            event: "VMM",
            event_type: "PHYSICAL_MALLOC",
            device,
            ptr: None,
            attrs: vec![("handle", e.handle?), ("size", e.size?)],
        },
        "aclrtFreePhysical" => {
            Expect { event: "VMM", event_type: "PHYSICAL_FREE", device, ptr: None, attrs: vec![("handle", e.handle?)] }
        }
        _ => return None,
    })
}
/// Wall-clock tolerance between the workload's clock reads and the tracer's converted timestamps.
pub const CLOCK_TOLERANCE_NS: u64 = 3_000_000;
/// Why a row does not match an entry, or `None` if it does. `unknown_device_ok` lets the row sit
/// in the unknown-device output; `size_zero_ok` accepts the "unmatched free" form (size 0).
pub fn mismatch(e: &Entry, x: &Expect, r: &DbRow, unknown_device_ok: bool, size_zero_ok: bool) -> Option<String> {
    let mut why = Vec::new();
    if r.event != x.event || r.event_type != x.event_type {
        why.push(format!("event {}/{} != {}/{}", r.event, r.event_type, x.event, x.event_type));
    }
    if r.name != e.api {
        why.push(format!("name {} != {}", r.name, e.api));
    }
    if r.tid != e.tid {
        why.push(format!("tid {} != {}", r.tid, e.tid));
    }
    if let Some(d) = &x.device {
        // The free of a block (or the release of a handle) the trace never saw made names no
        // device: it is placed on the thread's device, marked unmatched, and may be wrong for
        // peer-device memory.
        let unmatched_free = size_zero_ok && r.attr.contains_key("unmatched");
        if &r.device != d && !(unknown_device_ok && r.device == "N/A") && !unmatched_free {
            why.push(format!("device {} != {d}", r.device));
        }
    }
    if x.event == "MALLOC" || x.event == "FREE" {
        if r.ptr_value() != x.ptr {
            why.push(format!("ptr {} != {:?}", r.ptr, x.ptr.map(|p| format!("{p:#x}"))));
        }
    } else if r.ptr != "N/A" {
        why.push(format!("Ptr {} should be N/A", r.ptr));
    }
    for (k, v) in &x.attrs {
        let got = r.attr_u64(k);
        if got != Some(*v) && !(size_zero_ok && *k == "size" && got == Some(0)) {
            why.push(format!("attr {k} {got:?} != {v}"));
        }
    }
    if r.ts + CLOCK_TOLERANCE_NS < e.t0 || r.ts > e.t1 + CLOCK_TOLERANCE_NS {
        why.push(format!("timestamp {} outside the call [{}, {}]", r.ts, e.t0, e.t1));
    }
    (!why.is_empty()).then(|| why.join("; "))
}
fn per_tid<'a>(rows: &[&'a DbRow]) -> HashMap<u32, Vec<&'a DbRow>> {
    let mut by: HashMap<u32, Vec<&DbRow>> = HashMap::new();
    for r in rows {
        by.entry(r.tid).or_default().push(r);
    }
    for v in by.values_mut() {
        v.sort_by_key(|r| (r.ts, r.id));
    }
    by
}
fn expected_per_tid(ledger: &[Entry]) -> HashMap<u32, Vec<(&Entry, Expect)>> {
    let mut by: HashMap<u32, Vec<(&Entry, Expect)>> = HashMap::new();
    for e in ledger {
        if let Some(x) = expect(e) {
            by.entry(e.tid).or_default().push((e, x));
        }
    }
    for v in by.values_mut() {
        v.sort_by_key(|(e, _)| e.t0);
    }
    by
}
/// Launch mode: every recordable call is in the output exactly once, in order per thread, with
/// the right values; nothing else is.
pub fn assert_exact(ledger: &[Entry], out: &Output) {
    let rows = out.call_rows();
    let got = per_tid(&rows);
    let want = expected_per_tid(ledger);
    let mut tids: Vec<u32> = got.keys().chain(want.keys()).copied().collect();
    tids.sort_unstable();
    tids.dedup();
    for tid in tids {
        let g = got.get(&tid).map_or(&[][..], Vec::as_slice);
        let w = want.get(&tid).map_or(&[][..], Vec::as_slice);
        for (i, ((e, x), r)) in w.iter().zip(g).enumerate() {
            if let Some(why) = mismatch(e, x, r, false, false) {
                panic!("thread {tid}, call {i}: {why}\n  ledger: {e:?}\n  row:    {r:?}");
            }
        }
        assert_eq!(g.len(), w.len(), "thread {tid}: {} rows for {} ledger calls", g.len(), w.len());
    }
}
/// Attach mode: rows are the ledger's calls in order (a subsequence per thread), every call that
/// started after `live_ns` and ended before `until_ns` is there, none that ended before
/// `start_ns`. A row may be in the unknown-device output only for calls before the thread
/// revealed its device after `live_ns`.
pub fn assert_attached(ledger: &[Entry], out: &Output, start_ns: u64, live_ns: u64, until_ns: u64) {
    // Before everything is live, a driver call can be seen while the runtime call that made it
    // is not (its library was not probed yet): such rows are real driver calls, checked against
    // the driver's own ledger by `assert_driver_truth`, not against the workload's. Likewise at
    // the stop: a driver call made inside a runtime call that returned after the stop (its record
    // never came: the probes were gone) is written on its own (seen on the slow VMs).
    let cut_by_stop =
        |r: &DbRow| ledger.iter().any(|e| e.tid == r.tid && e.t0 <= r.ts && r.ts <= e.t1 && e.t1 >= until_ns);
    let rows: Vec<&DbRow> = out
        .call_rows()
        .into_iter()
        .filter(|r| !(r.name.starts_with("hal") && (r.ts < live_ns || cut_by_stop(r))))
        .collect();
    let got = per_tid(&rows);
    let want = expected_per_tid(ledger);
    // When each thread's device became known to the tracer.
    let mut known_from: HashMap<u32, u64> = HashMap::new();
    for e in ledger {
        if (e.api == "aclrtSetDevice" || e.api == "aclrtGetDevice") && e.rc == 0 && e.t0 > live_ns {
            known_from.entry(e.tid).and_modify(|t| *t = (*t).min(e.t1)).or_insert(e.t1);
        }
    }
    // Each free's allocation in the ledger (addresses are reused, so by time, not by address
    // alone): the last one at its address that returned before the free began (one that began
    // earlier may have been given the address right after this free, on another thread). A
    // free whose allocation may have been missed has no known size (the "unmatched" form) and
    // may sit in the unknown-device output.
    // Physical memory's handles the same way: a release of one made before the trace is
    // unmatched too. Keyed by (is a handle, address or handle).
    let mut allocs: HashMap<(bool, u64), Vec<&Entry>> = HashMap::new();
    for e in ledger.iter().filter(|e| e.rc == 0) {
        match expect(e) {
            Some(Expect { event: "MALLOC", ptr: Some(p), .. }) => allocs.entry((false, p)).or_default().push(e),
            Some(Expect { event_type: "PHYSICAL_MALLOC", .. }) => {
                allocs.entry((true, e.handle.expect("in its Expect"))).or_default().push(e);
            }
            _ => {}
        }
    }
    for v in allocs.values_mut() {
        v.sort_by_key(|e| e.t1);
    }
    let origin_unseen = |free: &Entry, key: (bool, u64)| -> bool {
        let origin = allocs.get(&key).and_then(|v| v.iter().rev().find(|a| a.t1 <= free.t0));
        origin.is_none_or(|a| a.t1 < live_ns || a.t0 < known_from.get(&a.tid).copied().unwrap_or(u64::MAX))
    };
    let mut total = 0;
    for (tid, w) in &want {
        let g = got.get(tid).map_or(&[][..], Vec::as_slice);
        let mut gi = 0;
        for (e, x) in w {
            let must = e.t0 > live_ns && e.t1 < until_ns;
            let Some(r) = g.get(gi) else {
                assert!(!must, "thread {tid}: call after the probes were live is missing: {e:?}");
                continue;
            };
            let before_known = e.t0 < known_from.get(tid).copied().unwrap_or(u64::MAX);
            let free_of_unseen = match (x.event, x.event_type) {
                ("FREE", _) => x.ptr.is_some_and(|p| origin_unseen(e, (false, p))),
                (_, "PHYSICAL_FREE") => e.handle.is_some_and(|h| origin_unseen(e, (true, h))),
                _ => false,
            };
            let unknown_ok = before_known || free_of_unseen;
            let size_zero_ok = free_of_unseen;
            match mismatch(e, x, r, unknown_ok, size_zero_ok) {
                None => {
                    assert!(
                        e.t1 >= start_ns,
                        "thread {tid}: recorded a call that ended before the tracer started: {e:?}"
                    );
                    gi += 1;
                    total += 1;
                }
                Some(why) => {
                    assert!(!must, "thread {tid}: call after the probes were live does not match ({why})\n  ledger: {e:?}\n  row: {r:?}");
                }
            }
        }
        assert_eq!(gi, g.len(), "thread {tid}: rows that match no ledger call: {:?}", &g[gi.min(g.len())..]);
    }
    for tid in got.keys() {
        assert!(want.contains_key(tid), "rows for thread {tid}, which the ledger never mentions");
    }
    assert!(total > 0, "nothing was recorded");
}
/// Blocks the ledger says were never freed, as (device, ptr).
///
/// Counted, not replayed in `t0` order: a call's `t0` is taken before it runs, so a MALLOC on one
/// thread can start before the FREE on another that gives it the same address (seen on a slow
/// VM), and a replay would then drop a block that is live. A pointer whose MALLOCs outnumber its
/// FREEs is live; its device is its last MALLOC's, the one that returned (`t1`) last.
pub fn live_at_end(ledger: &[Entry]) -> Vec<(String, u64)> {
    let mut blocks: BTreeMap<u64, (i64, u64, String)> = BTreeMap::new();
    for e in ledger {
        let Some(x) = expect(e) else { continue };
        match (x.event, x.ptr) {
            ("MALLOC", Some(p)) => {
                let b = blocks.entry(p).or_insert((0, 0, String::new()));
                b.0 += 1;
                if e.t1 >= b.1 {
                    (b.1, b.2) = (e.t1, x.device.unwrap_or_default());
                }
            }
            ("FREE", Some(p)) => blocks.entry(p).or_insert((0, 0, String::new())).0 -= 1,
            _ => {}
        }
    }
    blocks.into_iter().filter(|(_, (n, _, _))| *n > 0).map(|(p, (_, _, d))| (d, p)).collect()
}
/// Every FREE of a known block has its MALLOC's size (Insight pairs them and needs both).
pub fn assert_frees_carry_block_sizes(out: &Output) {
    for (folder, (_, rows)) in &out.files {
        // A segment and its first block share an address, so the layer is part of the key.
        let mut mallocs: HashMap<(String, String, String), &DbRow> = HashMap::new();
        for r in rows.iter().filter(|r| r.event == "MALLOC") {
            mallocs.insert(
                (r.event_type.clone(), r.ptr.clone(), r.attr.get("allocation_id").cloned().unwrap_or_default()),
                r,
            );
        }
        for f in rows.iter().filter(|r| r.event == "FREE" && !r.attr.contains_key("unmatched")) {
            let key = (f.event_type.clone(), f.ptr.clone(), f.attr.get("allocation_id").cloned().unwrap_or_default());
            let m = mallocs.get(&key).unwrap_or_else(|| panic!("{folder}: FREE without its MALLOC: {f:?}"));
            assert_eq!(f.attr.get("size"), m.attr.get("size"), "{folder}: {f:?} vs {m:?}");
            assert_eq!(f.event_type, m.event_type);
        }
    }
}
