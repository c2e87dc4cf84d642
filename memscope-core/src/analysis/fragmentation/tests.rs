use std::path::Path;

use super::fx::{Fx, START};
use super::*;

const M: u64 = MIB;

fn run(path: &Path) -> Report {
    analyse(&DumpDb::open_read(path).unwrap(), Options { top_k: 3, sample_every: Some(1_000_000) }).unwrap()
}

#[test]
fn holes_between_live_blocks_force_growth_and_are_sampled_at_the_peak() {
    let mut fx = Fx::new("frag-holes");
    // Two 20 MiB segments, three 6 MiB blocks each; the last of the first and the first of
    // the second freed: pieces of 8 (6 + the 2 MiB tail) and 6 MiB.
    for base in [0x1000_0000u64, 0x2000_0000] {
        fx.segment(1, base, 20 * M, false);
        for i in 0..3 {
            fx.block(1, base + i * 6 * M, 6 * M, "PTA");
        }
    }
    fx.step(1);
    fx.free(1, 0x1000_0000 + 12 * M, 6 * M);
    fx.free(1, 0x2000_0000, 6 * M);
    // 11 MiB fits neither piece: a new 12 MiB segment although 16 MiB are free.
    fx.segment(1, 0x3000_0000, 12 * M, false);
    fx.block(1, 0x3000_0000, 12 * M, "PTA");
    fx.step(2);
    let report = run(&fx.stop());
    assert!(report.has_segments);
    assert_eq!(report.growths, 3);
    assert_eq!(report.forced.len(), 1, "{:?}", report.forced);
    let g = report.forced[0];
    assert_eq!((g.request, g.segment_bytes, g.holes_before, g.largest_before), (12 * M, 12 * M, 16 * M, 8 * M));
    let peak = report.peak.unwrap();
    assert_eq!(peak.reason, Reason::PeakReserved);
    assert_eq!((peak.reserved, peak.allocated), (52 * M, 24 * M), "at the new segment, before its block");
    assert_eq!((peak.unused, peak.holes, peak.largest_free), (28 * M, 16 * M, Some(12 * M)));
    type Row = (Option<i64>, u64, u64, Option<u64>, u64);
    let steps: Vec<Row> = report
        .samples
        .iter()
        .filter(|s| s.reason == Reason::Step)
        .map(|s| (s.step, s.reserved, s.allocated, s.largest_free, s.free_pieces))
        .collect();
    assert_eq!(steps, [(Some(1), 40 * M, 36 * M, Some(2 * M), 2), (Some(2), 52 * M, 36 * M, Some(8 * M), 3)]);
    // Six blocks carved from bigger pieces, the segment-filling one not.
    assert_eq!(report.samples.last().unwrap().splits, 6);
    assert_eq!(report.samples.last().unwrap().reason, Reason::End);
    // Samples are in time order.
    assert!(report.samples.windows(2).all(|w| w[0].ts_ns <= w[1].ts_ns));
}

#[test]
fn expandable_pages_are_one_range() {
    let mut fx = Fx::new("frag-vmm");
    // Two adjacent 20 MiB pages: a 30 MiB block spans them.
    fx.segment(1, 0x4000_0000, 20 * M, true);
    fx.segment(1, 0x4000_0000 + 20 * M, 20 * M, true);
    fx.block(1, 0x4000_0000, 30 * M, "PTA");
    fx.step(1);
    fx.free(1, 0x4000_0000, 30 * M);
    // The second page unmapped: 20 MiB stay, one free piece.
    fx.hal_free(1, 0x4000_0000 + 20 * M, 20 * M);
    fx.step(2);
    let report = run(&fx.stop());
    let steps: Vec<(u64, u64, Option<u64>, u64, u64)> = report
        .samples
        .iter()
        .filter(|s| s.reason == Reason::Step)
        .map(|s| (s.reserved, s.allocated, s.largest_free, s.free_pieces, s.segments))
        .collect();
    assert_eq!(steps, [(40 * M, 30 * M, Some(10 * M), 1, 1), (20 * M, 0, Some(20 * M), 1, 1)]);
}

#[test]
fn big_segments_pinned_by_small_blocks_are_evidence_for_max_split() {
    let mut fx = Fx::new("frag-bigsplit");
    fx.segment(1, 0x1000_0000, 96 * M, false);
    fx.block(1, 0x1000_0000, 96 * M, "PTA");
    fx.free(1, 0x1000_0000, 96 * M);
    for i in 0..4 {
        fx.block(1, 0x1000_0000 + i * 4 * M, 4 * M, "PTA");
    }
    fx.segment(1, 0x2000_0000, 96 * M, false);
    fx.block(1, 0x2000_0000, 96 * M, "PTA");
    let report = run(&fx.stop());
    assert_eq!(report.pinned_big.len(), 1);
    let g = report.pinned_big[0];
    assert_eq!((g.request, g.pinned_big, g.pinned_big_min), (96 * M, 1, 96 * M));
    assert!(report.forced.is_empty(), "80 MiB free < 96 MiB: not fragmentation");
}

#[test]
fn cache_flushes_inside_an_allocation_are_recorded() {
    let mut fx = Fx::new("frag-flush");
    fx.segment(1, 0x1000_0000, 40 * M, false);
    fx.block(1, 0x1000_0000, 40 * M, "PTA");
    fx.free(1, 0x1000_0000, 40 * M);
    // The next allocation frees the cached segment, then takes a bigger one.
    fx.hal_free(1, 0x1000_0000, 40 * M);
    fx.segment(1, 0x2000_0000, 48 * M, false);
    fx.block(1, 0x2000_0000, 48 * M, "PTA");
    // An explicit empty_cache between allocations is not a flush inside one.
    fx.free(1, 0x2000_0000, 48 * M);
    fx.hal_free(1, 0x2000_0000, 48 * M);
    fx.free(1, 0x9999, 1); // a pool row in between: the freeing belonged to no allocation
    fx.segment(1, 0x3000_0000, 52 * M, false);
    fx.block(1, 0x3000_0000, 52 * M, "PTA");
    // Nor is one right before an allocation its cache could have served.
    fx.free(1, 0x3000_0000, 52 * M);
    fx.hal_free(1, 0x3000_0000, 52 * M);
    fx.segment(1, 0x4000_0000, 20 * M, false);
    fx.block(1, 0x4000_0000, 20 * M, "PTA");
    let report = run(&fx.stop());
    assert_eq!(report.flushes.len(), 1, "{:?}", report.flushes);
    let f = report.flushes[0];
    assert_eq!((f.freed, f.largest_freed, f.reserved_before, f.segment_bytes), (40 * M, 40 * M, 40 * M, 48 * M));
}

#[test]
fn pool_counters_from_rows_stand_in_for_segments_in_msmemscope_dbs() {
    // msMemScope's DBs: PTA rows with used/total, no segment rows.
    let mut fx = Fx::new("frag-msmemscope");
    let attr = |size: u64, total: u64| serde_json::json!({"size": size.to_string(), "total": total.to_string()});
    fx.row("MALLOC", "PTA", "x", 7, 7, Some(0x10), attr(4 * M, 20 * M));
    fx.row("MALLOC", "PTA", "x", 7, 7, Some(0x20), attr(4 * M, 20 * M));
    fx.row("MALLOC", "PTA_WORKSPACE", "x", 7, 7, Some(0x30), attr(2 * M, 2 * M));
    let report = run(&fx.stop());
    assert!(!report.has_segments);
    let end = report.samples.last().unwrap();
    assert_eq!((end.reserved, end.allocated, end.unused, end.largest_free), (20 * M, 8 * M, 12 * M, None));
    assert_eq!(report.processes, [ProcessPeak { pid: 7, peak_reserved: 20 * M, peak_device: 0 }]);
}

#[test]
fn shadow_and_unmatched_frees_change_nothing() {
    let mut fx = Fx::new("frag-marks");
    fx.segment(1, 0x1000_0000, 20 * M, false);
    fx.block(1, 0x1000_0000, 5 * M, "PTA");
    let unmatched = serde_json::json!({"size": "0", "unmatched": "true"});
    fx.row("FREE", "PTA", "x", 1, 1, Some(0x1000_0000), unmatched);
    let ts = fx.ts;
    let shadow = serde_json::json!({"size": "5242880", "shadow": "true"});
    let path = {
        let mut fx = fx;
        fx.row("SYSTEM", "STOP_TRACE", "STOP_TRACE", 1, 1, None, serde_json::json!({}));
        fx.row("FREE", "PTA", "x", 1, 1, Some(0x1000_0000), shadow);
        fx.stop()
    };
    let report = run(&path);
    let end = report.samples.iter().find(|s| s.reason == Reason::End).unwrap();
    assert_eq!((end.ts_ns, end.allocated, end.largest_free), (ts + 2000, 5 * M, Some(15 * M)), "{report:?}");
    assert_eq!(report.unreadable, 0);
}

#[test]
fn periodic_samples_every_n_memory_rows() {
    let mut fx = Fx::new("frag-periodic");
    fx.segment(1, 0x1000_0000, 20 * M, false);
    for i in 0..9 {
        fx.block(1, 0x1000_0000 + i * M, M, "PTA");
    }
    let path = fx.stop();
    let report = analyse(&DumpDb::open_read(&path).unwrap(), Options { top_k: 3, sample_every: Some(5) }).unwrap();
    let periodic: Vec<u64> =
        report.samples.iter().filter(|s| s.reason == Reason::Periodic).map(|s| s.allocated).collect();
    assert_eq!(periodic, [4 * M, 9 * M], "after the 5th and the 10th memory row");
    assert!(START < report.samples[0].ts_ns);
}

#[test]
fn many_rows_cost_one_scan() {
    // 75k rows over 500 segments of 100 blocks: per-row work is O(log n), nothing is rebuilt.
    let fx = Fx::new("frag-many");
    let conn = rusqlite::Connection::open(fx.path()).unwrap();
    conn.execute_batch("BEGIN").unwrap();
    let mut id = 100;
    let mut insert = |event: &str, ty: &str, ptr: u64, attr: String| {
        conn.execute(
            "INSERT INTO memscope_dump VALUES (?1, ?2, ?3, 'x', ?4, 1, 1, '0', ?5, ?6, '', '')",
            params![id, event, ty, START + id, format!("0x{ptr:016x}"), attr],
        )
        .unwrap();
        id += 1;
    };
    for s in 0..500u64 {
        let base = 0x1_0000_0000 + s * 0x200_0000;
        insert("MALLOC", "HAL", base, format!("{{\"size\":\"{}\",\"segment\":\"caching\"}}", 20 * M));
        for i in 0..100u64 {
            insert("MALLOC", "PTA", base + i * 4096, "{\"size\":\"4096\"}".into());
        }
        for i in (0..100u64).step_by(2) {
            insert("FREE", "PTA", base + i * 4096, "{\"size\":\"4096\"}".into());
        }
    }
    conn.execute_batch("COMMIT").unwrap();
    let t = std::time::Instant::now();
    let report = analyse(&DumpDb::open_read(&fx.stop()).unwrap(), Options::default()).unwrap();
    let elapsed = t.elapsed();
    let end = report.samples.last().unwrap();
    assert_eq!(end.allocated, 500 * 50 * 4096);
    assert_eq!(end.free_pieces, 500 * 51);
    assert!(report.samples.iter().filter(|s| s.reason == Reason::Periodic).count() <= 501);
    eprintln!("{} memory rows replayed in {elapsed:?}", 500 * 151);
    assert!(elapsed.as_secs() < 20, "{elapsed:?}");
}
