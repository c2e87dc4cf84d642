//! The model against answers worked out by hand from the allocators' rules (docs/simulate.md),
//! and the replay's agreement check.

use super::allocator::{Allocator, SegmentStep::*};
use super::config::{Config, SettingError};
use super::trace::{Recorded, Step, Timed, Trace};
use super::*;
use crate::analysis::advise::AllocConf;

const M: u64 = 1 << 20;
const K: u64 = 1 << 10;

fn cfg(text: &str, fraction: Option<f64>, capacity: Option<u64>) -> Config {
    Config::parse(text, &AllocConf::default(), fraction, capacity, Flavour::Cuda).unwrap()
}

fn model(text: &str) -> Allocator {
    Allocator::new(cfg(text, None, None), Vec::new())
}

#[test]
fn large_requests_share_a_20_mib_segment_split_front_first() {
    let mut a = model("");
    let (p1, s1) = a.malloc(3 * M, 0, 0).unwrap();
    let (p2, _) = a.malloc(3 * M, 0, 0).unwrap();
    assert_eq!((s1, p2 - p1), (3 * M, 3 * M), "the second block is cut from the rest of the first segment");
    assert_eq!(a.steps, vec![Alloc(20 * M)]);
    assert_eq!(a.held().reserved, 20 * M);
}

#[test]
fn small_requests_fill_2_mib_segments() {
    let mut a = model("");
    for _ in 0..4 {
        a.malloc(600 * K, 0, 0).unwrap();
    }
    // 600 KiB rounds to itself (a multiple of 512); three fit in 2 MiB.
    assert_eq!(a.steps, vec![Alloc(2 * M), Alloc(2 * M)]);
}

#[test]
fn streams_do_not_share_free_blocks() {
    let mut a = model("");
    let (p, _) = a.malloc(3 * M, 1, 0).unwrap();
    a.free(p);
    a.malloc(3 * M, 2, 0).unwrap();
    assert_eq!(a.steps, vec![Alloc(20 * M), Alloc(20 * M)]);
}

#[test]
fn max_split_keeps_oversize_blocks_for_oversize_requests() {
    for (setting, want) in [("", vec![Alloc(40 * M)]), ("max_split_size_mb:32", vec![Alloc(40 * M), Alloc(20 * M)])] {
        let mut a = model(setting);
        let (p, _) = a.malloc(40 * M, 0, 0).unwrap();
        a.free(p);
        a.malloc(5 * M, 0, 0).unwrap();
        assert_eq!(a.steps, want, "{setting}");
    }
}

#[test]
fn a_refused_segment_frees_the_cache_and_retries() {
    let mut a = Allocator::new(cfg("", None, Some(64 * M)), Vec::new());
    let (p, _) = a.malloc(40 * M, 0, 0).unwrap();
    a.free(p);
    a.malloc(50 * M, 0, 0).unwrap();
    assert_eq!(a.steps, vec![Alloc(40 * M), Free(40 * M), Alloc(50 * M)]);
    // Memory held outside the allocator counts against the device.
    let mut b = Allocator::new(cfg("", None, Some(64 * M)), Vec::new());
    assert_eq!(b.malloc(50 * M, 0, 20 * M), None);
}

#[test]
fn expandable_segments_grow_the_free_tail_page_by_page() {
    let mut a = model("expandable_segments:True");
    a.malloc(3 * M, 0, 0).unwrap();
    a.malloc(3 * M, 0, 0).unwrap();
    assert_eq!(a.steps, vec![Map(20 * M)]);
    // 30 MiB: the 14 MiB free tail plus one more page, not a segment of its own.
    a.malloc(30 * M, 0, 0).unwrap();
    assert_eq!(a.steps, vec![Map(20 * M), Map(20 * M)]);
    // Pages mapped in one call are one mapping, as PyTorch's trace records them.
    let calls = [(1, Map(2 * M)), (1, Map(2 * M)), (2, Map(2 * M)), (2, Unmap(2 * M)), (2, Unmap(2 * M))];
    assert_eq!(canonical(calls), vec![Map(4 * M), Map(2 * M), Unmap(4 * M)]);
    assert_eq!(a.held(), Held { reserved: 40 * M, allocated: 36 * M });
    let mut plain = model("");
    for size in [3 * M, 3 * M, 30 * M] {
        plain.malloc(size, 0, 0).unwrap();
    }
    assert_eq!(plain.held().reserved, 50 * M);
}

#[test]
fn empty_cache_frees_whole_segments_and_unmaps_free_pages() {
    let mut a = model("");
    let (p1, _) = a.malloc(3 * M, 0, 0).unwrap();
    let (_p2, _) = a.malloc(40 * M, 0, 0).unwrap();
    a.free(p1);
    a.empty_cache();
    // The 20 MiB segment is whole again and goes; the 40 MiB one is in use.
    assert_eq!(a.steps, vec![Alloc(20 * M), Alloc(40 * M), Free(20 * M)]);
    let mut e = model("expandable_segments:True");
    let (q1, _) = e.malloc(3 * M, 0, 0).unwrap();
    let (_q2, _) = e.malloc(30 * M, 0, 0).unwrap();
    e.free(q1);
    e.steps.clear();
    e.empty_cache();
    // 3 MiB free at the front of page one: no whole page is free, nothing unmapped; the 7 MiB
    // after the 30 MiB block are the second page's tail: not whole either.
    assert_eq!(e.steps, vec![]);
}

#[test]
fn the_garbage_collector_frees_the_oldest_cached_segments_past_its_threshold() {
    let run = |text: &str| {
        let mut a = Allocator::new(cfg(text, Some(0.8), Some(100 * M)), Vec::new());
        let (pa, _) = a.malloc(24 * M, 0, 0).unwrap();
        a.free(pa);
        let (pb, _) = a.malloc(26 * M, 0, 0).unwrap();
        a.free(pb);
        a.malloc(28 * M, 0, 0).unwrap();
        a.steps
    };
    // 50 MiB reserved > 0.5 x 80 MiB: the 24 MiB segment (age 2, the average 1.5) goes.
    assert_eq!(
        run("garbage_collection_threshold:0.5"),
        vec![Alloc(24 * M), Alloc(26 * M), Free(24 * M), Alloc(28 * M)]
    );
    assert_eq!(run(""), vec![Alloc(24 * M), Alloc(26 * M), Alloc(28 * M)]);
}

#[test]
fn the_fraction_is_a_ceiling_that_empties_the_cache() {
    let mut a = Allocator::new(cfg("", Some(0.5), Some(100 * M)), Vec::new());
    let (p, _) = a.malloc(30 * M, 0, 0).unwrap();
    a.free(p);
    a.malloc(32 * M, 0, 0).unwrap();
    assert_eq!(a.steps, vec![Alloc(30 * M), Free(30 * M), Alloc(32 * M)]);
    assert_eq!(a.malloc(60 * M, 0, 0), None, "over the fraction's 50 MiB");
}

#[test]
fn roundup_power2_divisions_rounds_to_the_next_division() {
    let c = cfg("roundup_power2_divisions:4", None, None);
    // Between 1 MiB and 2 MiB in four steps of 256 KiB: 1.1 MiB becomes 1.25 MiB.
    assert_eq!(c.round_size(1126 * K), 1280 * K);
    assert_eq!(c.round_size(1 << 20), 1 << 20);
    assert_eq!(cfg("", None, None).round_size(1000), 1024);
    assert_eq!(cfg("", None, None).round_size(1), 512);
    // torch_npu pads by 32 bytes first: 512 bytes take 1024, 1 MiB leaves the small pool.
    let npu = Config::parse("", &AllocConf::default(), None, None, Flavour::Npu).unwrap();
    assert_eq!((npu.round_size(512), npu.round_size(1 << 20)), (1024, (1 << 20) + 512));
}

#[test]
fn settings_the_allocators_refuse_are_refused_with_the_fix() {
    let err = |t: &str, f: Option<f64>, c: Option<u64>| {
        Config::parse(t, &AllocConf::default(), f, c, Flavour::Cuda).unwrap_err()
    };
    assert!(err("max_split_size_mb:20", None, None).to_string().contains("must be > 20"));
    assert!(err("garbage_collection_threshold:1.5", None, None).to_string().contains("between 0.0 and 1.0"));
    assert!(err("expandable_segments:True,max_split_size_mb:64", None, None).to_string().contains("refuses"));
    assert!(matches!(err("backend:cudaMallocAsync", None, None), SettingError::Unmodelled { .. }));
    assert!(matches!(err("per_process_memory_fraction:0.5", None, None), SettingError::NoCapacity { .. }));
    assert!(err("expandable_segments:yes", None, None).to_string().contains("True or False"));
}

fn at(ts: i64, step: Step) -> Timed {
    Timed { ts, pid: 7, step, site: 0 }
}

/// A trace of three 3 MiB tensors and a 30 MiB one, recorded with one 20 MiB segment and one
/// of 30 MiB (PyTorch's default settings).
fn recorded_trace(segments: &[(crate::analysis::simulate::allocator::SegmentStep, u64)]) -> Trace {
    let mut t = Trace::default();
    let mut ts = 0;
    let mut step = |s: Step| {
        ts += 10;
        t.steps.push(at(ts, s));
    };
    step(Step::Alloc { req: 3 * M, stream: 0, ptr: 0xa000, rounded: false, block: 0 });
    step(Step::Alloc { req: 3 * M, stream: 0, ptr: 0xb000, rounded: false, block: 0 });
    step(Step::Free { ptr: 0xa000 });
    step(Step::Alloc { req: 30 * M, stream: 0, ptr: 0xc000, rounded: false, block: 0 });
    step(Step::Free { ptr: 0xc000 });
    t.segments.insert(7, segments.iter().map(|&(step, ptr)| Recorded { step, ptr, call: 0 }).collect());
    t
}

#[test]
fn the_replay_states_its_agreement_with_the_recorded_segments() {
    let trace = recorded_trace(&[(Alloc(20 * M), 1 << 30), (Alloc(30 * M), 2 << 30)]);
    let options = Options { settings: vec!["expandable_segments:True".into()], ..Options::default() };
    let r = run(&trace, "", &options).unwrap();
    assert_eq!(
        (r.reproduction.recorded_segments, r.reproduction.matched_segments, r.reproduction.agrees),
        (2, 2, true)
    );
    let sim = &r.simulations[0];
    assert_eq!(
        (sim.setting.as_str(), sim.figures.peak_reserved_bytes, sim.figures.segments),
        ("expandable_segments:True", 40 * M, 2)
    );
    assert_eq!(r.baseline.as_ref().unwrap().figures.peak_reserved_bytes, 50 * M);
    // A recorded run the model does not reproduce says where they part.
    let other = recorded_trace(&[(Alloc(20 * M), 1 << 30), (Alloc(32 * M), 2 << 30)]);
    let r = run(&other, "", &Options::default()).unwrap();
    assert!(!r.reproduction.agrees);
    assert_eq!(r.reproduction.matched_segments, 1);
    let why = r.reproduction.first_difference.unwrap();
    assert!(why.contains("segment step 2") && why.contains("32.0 MiB") && why.contains("30.0 MiB"), "{why}");
}

#[test]
fn torch_npu_starts_big_expandable_blocks_on_16_kib() {
    let npu = Config::parse("expandable_segments:True", &AllocConf::default(), None, None, Flavour::Npu).unwrap();
    let mut a = Allocator::new(npu, Vec::new());
    let (p1, s1) = a.malloc(3 * M + 100, 0, 0).unwrap();
    // 3 MiB + 132 B rounds to 3 MiB + 512 B: the next block would start off a 16 KiB boundary.
    let (p2, s2) = a.malloc(3 * M, 0, 0).unwrap();
    assert_eq!(s1, 3 * M + 512);
    assert_eq!(p2 % (16 * K), 0);
    assert_eq!(p2 - p1, 3 * M + 16 * K, "the 15.5 KiB before the boundary stay free");
    assert_eq!(s2, 3 * M + 512);
    // PyTorch's allocator has no such rule.
    let mut cuda = model("expandable_segments:True");
    let (q1, _) = cuda.malloc(3 * M + 132, 0, 0).unwrap();
    let (q2, _) = cuda.malloc(3 * M, 0, 0).unwrap();
    assert_eq!(q2 - q1, 3 * M + 512);
}

#[test]
fn a_replayed_out_of_memory_names_the_request_and_its_line() {
    let mut trace = recorded_trace(&[(Alloc(20 * M), 1 << 30), (Alloc(30 * M), 2 << 30)]);
    trace.sites = vec![String::new(), "train.py:12 main".to_owned()];
    trace.steps[3].site = 1; // the 30 MiB request
    let options = Options { settings: vec![String::new()], capacity: Some(40 * M), ..Options::default() };
    let r = run(&trace, "", &options).unwrap();
    let oom = r.simulations[0].figures.first_oom.clone().expect("20 MiB held, 30 MiB more do not fit 40 MiB");
    assert_eq!(
        (oom.request_bytes, oom.reserved_bytes, oom.site.as_deref()),
        (30 * M, 20 * M, Some("train.py:12 main"))
    );
    assert_eq!(r.simulations[0].figures.ooms, 1);
}
