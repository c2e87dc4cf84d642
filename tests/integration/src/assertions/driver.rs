//! Device memory rows against what the stand-in driver itself logged, below the runtime.

use std::collections::HashMap;

use super::{tail_pairs, CLOCK_TOLERANCE_NS};
use crate::ledgers::DriverEntry;
use crate::readers::{DbRow, Output};

/// Whether a row merged into the runtime call around driver call `e` can be `e`'s. The row is
/// stamped at the runtime call's return, which can come well after the driver's (milliseconds on
/// a slow VM), but not before `e` began nor after the thread's next driver call did.
fn merged_with(ts: u64, e: &DriverEntry, driver: &[DriverEntry]) -> bool {
    let next = driver.iter().filter(|n| n.tid == e.tid && n.t0 > e.t1).map(|n| n.t0).min().unwrap_or(u64::MAX);
    ts + CLOCK_TOLERANCE_NS >= e.t0 && ts <= next.saturating_add(CLOCK_TOLERANCE_NS)
}
/// Rows of device memory against what the driver itself logged: every driver allocation made
/// after `live_ns` is exactly one MALLOC row (merged into its runtime call or on its own), with
/// the driver's size, flag and device; every driver-backed row is a real driver allocation; out-of-
/// memory rows carry the failing driver call's flag; physical memory rows carry the handle's
/// device.
pub fn assert_driver_truth(driver: &[DriverEntry], out: &Output, live_ns: u64) {
    let rows = out.call_rows();
    let backed: Vec<&&DbRow> = rows
        .iter()
        .filter(|r| r.event == "MALLOC" && r.attr.get("alloc_type").map(String::as_str) == Some("alloc"))
        .collect();
    // A thread that frees and reallocates the same address quickly has several driver calls
    // within the clock tolerance of one row, so times alone cannot pair them. A thread's calls at
    // one address happen in order, and a trace misses only those before it went live: the rows
    // of each (thread, address), in time order, are the last driver calls there, in order.
    let mut calls: HashMap<(u32, u64), Vec<&DriverEntry>> = HashMap::new();
    for e in driver.iter().filter(|e| e.api == "halMemAlloc" && e.rc == 0) {
        calls.entry((e.tid, e.ptr)).or_default().push(e);
    }
    let mut seen: HashMap<(u32, u64), Vec<&DbRow>> = HashMap::new();
    for r in &backed {
        let ptr = r.ptr_value().unwrap_or_else(|| panic!("driver-backed row without an address: {r:?}"));
        seen.entry((r.tid, ptr)).or_default().push(r);
    }
    for (key, rows_here) in &mut seen {
        rows_here.sort_by_key(|r| (r.ts, r.id));
        let here = calls
            .get_mut(key)
            .unwrap_or_else(|| panic!("driver-backed row matches no driver call: {:?}", rows_here[0]));
        here.sort_by_key(|e| e.t0);
        let (missed, paired) = tail_pairs(here, rows_here.len(), &format!("driver calls at {key:?}"));
        for (i, (r, e)) in rows_here.iter().zip(paired).enumerate() {
            // A merged row is stamped at the runtime call's return, which can be well after
            // the driver's (the runtime touches the memory it got); it cannot be before the
            // driver call started, nor after the next call at this address began.
            let next = paired.get(i + 1).map_or(u64::MAX, |n| n.t0 + CLOCK_TOLERANCE_NS);
            assert!(
                r.ts + CLOCK_TOLERANCE_NS >= e.t0 && r.ts <= next,
                "row and driver call at {key:?} are not in time order: {r:?} {e:?}"
            );
            assert_eq!(r.attr_u64("size"), Some(e.size), "size is the driver's: {r:?} {e:?}");
            assert_eq!(r.attr_u64("flag"), Some(e.flag), "flag: {r:?} {e:?}");
            assert_eq!(r.device, e.device.to_string(), "device from the flag: {r:?} {e:?}");
            assert_eq!(r.attr_u64("module_id"), Some(e.flag >> 56), "module: {r:?}");
        }
        for e in missed {
            assert!(e.t0 <= live_ns, "driver allocation has no row of its own: {e:?}");
        }
    }
    for (key, here) in &calls {
        if !seen.contains_key(key) {
            for e in here {
                assert!(e.t0 <= live_ns, "driver allocation has no row of its own: {e:?}");
            }
        }
    }
    for e in driver.iter().filter(|e| e.api == "halMemAlloc" && e.rc == 6 && e.t0 > live_ns) {
        let oom = rows.iter().find(|r| r.event_type == "OOM_TRIGGER" && r.tid == e.tid && merged_with(r.ts, e, driver));
        let oom = oom.unwrap_or_else(|| panic!("failed driver allocation without an OOM row: {e:?}"));
        assert_eq!(oom.attr_u64("flag"), Some(e.flag), "{oom:?}");
    }
    for e in driver.iter().filter(|e| e.api == "halMemCreate" && e.rc == 0 && e.t0 > live_ns) {
        let row = rows
            .iter()
            .filter(|r| {
                r.event_type == "PHYSICAL_MALLOC"
                    && r.tid == e.tid
                    && r.attr_u64("handle") == Some(e.ptr)
                    && merged_with(r.ts, e, driver)
            })
            .min_by_key(|r| r.ts.abs_diff(e.t0))
            .unwrap_or_else(|| panic!("physical allocation missing: {e:?}"));
        assert_eq!(row.attr.get("alloc_type").map(String::as_str), Some("create"));
        assert_eq!(row.device, e.device.to_string(), "{row:?}");
    }
}
