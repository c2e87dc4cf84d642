use std::collections::BTreeSet;
use std::path::Path;

use rusqlite::Connection;

use super::scenario::{Act, Trace};
use super::*;
use crate::store::Attr;

use Act::{Free, Malloc, Read, Wait, Write};

fn run(path: &Path, options: &Options) -> Report {
    analyse(&DumpDb::open_read(path).unwrap(), options).unwrap()
}

/// The flags of the block allocated at `ptr` (its last one, when the address was reused).
fn flags_at(report: &Report, ptr: u64) -> String {
    let b = report.blocks.iter().rev().find(|b| b.ptr == ptr).unwrap_or_else(|| panic!("no block at {ptr:#x}"));
    flag_list(b.flags, u8::MAX)
}

fn ptrs_with(report: &Report, flag: u8) -> BTreeSet<u64> {
    report.blocks.iter().filter(|b| b.flags & flag != 0).map(|b| b.ptr).collect()
}

const A: u64 = 0x1000;
const B: u64 = 0x2000;
const C: u64 = 0x3000;
const X: u64 = 0x4000;

#[test]
fn early_allocation_needs_a_free_between_allocation_and_first_use() {
    // B is allocated, A (another tensor) is freed in a later API, then B is first used.
    let mut t = Trace::new("early");
    t.op(&[Malloc(A, 64), Write(A)]);
    t.op(&[Malloc(B, 64)]);
    t.op(&[Read(A), Free(A)]);
    t.op(&[Write(B)]);
    t.op(&[Read(B), Free(B)]);
    let r = run(&t.finish(), &Options::default());
    assert_eq!(flags_at(&r, B), "early_allocation");
    assert_eq!(flags_at(&r, A), "");

    // Neighbour: the free happens in B's allocating API (it cannot be moved before it) and
    // B's first use is the next API: nothing lies strictly between.
    let mut t = Trace::new("early-not");
    t.op(&[Malloc(A, 64), Write(A)]);
    t.op(&[Read(A), Free(A), Malloc(B, 64)]);
    t.op(&[Write(B)]);
    t.op(&[Read(B), Free(B)]);
    let r = run(&t.finish(), &Options::default());
    assert_eq!(flags_at(&r, B), "");

    // Neighbour: the free comes after B's first use.
    let mut t = Trace::new("early-after");
    t.op(&[Malloc(A, 64), Write(A)]);
    t.op(&[Malloc(B, 64)]);
    t.op(&[Write(B)]);
    t.op(&[Read(A), Free(A)]);
    t.op(&[Read(B), Free(B)]);
    let r = run(&t.finish(), &Options::default());
    assert_eq!(flags_at(&r, B), "");
}

#[test]
fn late_deallocation_needs_an_allocation_between_last_use_and_free() {
    // (B is read before A's free: a first use after it would make B early.)
    let mut t = Trace::new("late");
    t.op(&[Malloc(A, 64), Write(A)]);
    t.op(&[Read(A)]); // A's last use
    t.op(&[Malloc(B, 64), Write(B)]); // another tensor allocated meanwhile
    t.op(&[Read(B)]);
    t.op(&[Free(A)]);
    t.op(&[Read(B), Free(B)]);
    let r = run(&t.finish(), &Options::default());
    assert_eq!(flags_at(&r, A), "late_deallocation");
    assert_eq!(flags_at(&r, B), "");

    // Neighbour: the allocation happens in A's last-use API, so A could not go before it.
    let mut t = Trace::new("late-not");
    t.op(&[Malloc(A, 64), Write(A)]);
    t.op(&[Read(A), Malloc(B, 64), Write(B)]);
    t.op(&[Read(B)]);
    t.op(&[Free(A)]);
    t.op(&[Free(B)]);
    let r = run(&t.finish(), &Options::default());
    assert_eq!(flags_at(&r, A), "");
    assert_eq!(flags_at(&r, B), "");

    // Neighbour: freed in the API of its last use.
    let mut t = Trace::new("late-same");
    t.op(&[Malloc(A, 64), Write(A)]);
    t.op(&[Malloc(B, 64), Write(B)]);
    t.op(&[Read(A), Free(A)]);
    t.op(&[Read(B), Free(B)]);
    let r = run(&t.finish(), &Options::default());
    assert_eq!(flags_at(&r, A), "");
}

/// A used in API 1 and again `gap` APIs later; op APIs in between touch only C.
fn idle_trace(name: &str, gap: usize) -> std::path::PathBuf {
    let mut t = Trace::new(name);
    t.op(&[Malloc(A, 64), Write(A), Malloc(C, 64), Write(C)]);
    for _ in 1..gap {
        t.op(&[Read(C)]);
    }
    t.op(&[Read(A), Free(A)]);
    t.op(&[Read(C), Free(C)]);
    t.finish()
}

#[test]
fn temporary_idleness_is_a_gap_above_3000_apis_by_default() {
    let r = run(&idle_trace("idle-3001", 3001), &Options::default());
    assert_eq!(flags_at(&r, A), "temporary_idleness");
    assert_eq!(r.blocks[0].api.unwrap().max_idle, Some(3001));
    assert_eq!(flags_at(&r, C), "", "C was used in every API");
    let r = run(&idle_trace("idle-3000", 3000), &Options::default());
    assert_eq!(flags_at(&r, A), "", "exactly the threshold is not above it");
}

#[test]
fn idle_threshold_is_configurable() {
    let path = idle_trace("idle-101", 101);
    let at = |n| Options { idle_threshold: n, ..Options::default() };
    assert_eq!(flags_at(&run(&path, &at(100)), A), "temporary_idleness");
    assert_eq!(flags_at(&run(&path, &at(101)), A), "");
    assert_eq!(flags_at(&run(&path, &Options::default()), A), "");
}

#[test]
fn memory_events_outside_ops_are_apis_of_their_own() {
    // No OP_LAUNCH at all: MALLOC B, FREE A, first use of B: three APIs, the free between.
    let mut t = Trace::new("standalone");
    t.acts(&[Malloc(A, 64), Write(A), Malloc(B, 64), Free(A), Write(B), Free(B)]);
    let r = run(&t.finish(), &Options::default());
    assert_eq!(flags_at(&r, B), "early_allocation");
    let facts = r.blocks[1].api.unwrap();
    assert_eq!((facts.malloc, facts.first_access, facts.free), (3, Some(5), Some(6)));

    // Neighbour: without that free.
    let mut t = Trace::new("standalone-not");
    t.acts(&[Malloc(A, 64), Write(A), Malloc(B, 64), Write(B), Free(B), Free(A)]);
    let r = run(&t.finish(), &Options::default());
    assert_eq!(flags_at(&r, B), "");
}

#[test]
fn a_free_of_memory_from_before_the_trace_is_a_free_api() {
    let mut t = Trace::new("unmatched");
    t.op(&[Malloc(B, 64)]);
    t.free_unmatched(0x9000);
    t.op(&[Write(B), Free(B)]);
    let r = run(&t.finish(), &Options::default());
    assert_eq!(flags_at(&r, B), "early_allocation");
    assert_eq!(r.stats.unmatched_frees, 1);
}

#[test]
fn the_api_index_is_per_process() {
    // Process 2 frees between process 1's allocation of B and its first use: not B's API.
    let mut t = Trace::new("pids");
    t.op(&[Malloc(B, 64)]);
    t.pid = 2;
    t.op(&[Malloc(A, 64), Write(A)]);
    t.op(&[Read(A), Free(A)]);
    t.pid = 1;
    t.op(&[Write(B), Free(B)]);
    let r = run(&t.finish(), &Options::default());
    assert_eq!(flags_at(&r, B), "");
    assert_eq!(r.stats.processes, 2);

    // Neighbour: the same free in process 1.
    let mut t = Trace::new("pids-same");
    t.op(&[Malloc(B, 64)]);
    t.op(&[Malloc(A, 64), Write(A)]);
    t.op(&[Read(A), Free(A)]);
    t.op(&[Write(B), Free(B)]);
    let r = run(&t.finish(), &Options::default());
    assert_eq!(flags_at(&r, B), "early_allocation");
}

/// All three op-index patterns on blocks of `event_type`/`pool`, with caching-pool blocks
/// around them supplying the frees and allocations; returns the report.
fn three_patterns(name: &str, event_type: &'static str, pool: Option<&'static str>) -> Report {
    let (early, late, idle) = (0x10_0000, 0x20_0000, 0x30_0000);
    let mut t = Trace::new(name);
    t.start();
    t.malloc_as(event_type, pool, early, 64);
    t.malloc_as(event_type, pool, late, 64);
    t.malloc_as(event_type, pool, idle, 64);
    t.acts(&[Write(late), Write(idle), Malloc(A, 64), Write(A)]);
    t.end();
    t.op(&[Read(late), Read(idle)]);
    t.op(&[Read(A), Free(A), Malloc(B, 64), Write(B)]);
    for _ in 0..20 {
        t.op(&[Read(B)]);
    }
    t.op(&[Read(early), Read(idle), Free(B)]);
    // Freed before anything else is allocated: only `late` has an allocation (B's) between
    // its last use and its free.
    t.acts(&[Free(early), Free(late), Free(idle)]);
    run(&t.finish(), &Options { idle_threshold: 10, ..Options::default() })
}

#[test]
fn only_the_caching_and_atb_pools_are_judged_on_the_api_index() {
    let flagged = |r: &Report| (flags_at(r, 0x10_0000), flags_at(r, 0x20_0000), flags_at(r, 0x30_0000));
    let want = ("early_allocation".to_owned(), "late_deallocation".to_owned(), "temporary_idleness".to_owned());
    assert_eq!(flagged(&three_patterns("scope-caching", "PTA", Some("caching"))), want);
    // msMemScope's own rows carry no `pool`: caching.
    assert_eq!(flagged(&three_patterns("scope-nopool", "PTA", None)), want);
    let none = (String::new(), String::new(), String::new());
    for (name, ty, pool) in [
        ("scope-workspace", "PTA", Some("workspace")),
        ("scope-ptaws", "PTA_WORKSPACE", None),
        ("scope-hal", "HAL", None),
        ("scope-host", "HOST", None),
        ("scope-ms", "MINDSPORE", None),
    ] {
        let r = three_patterns(name, ty, pool);
        assert_eq!(flagged(&r), none, "{ty} {pool:?}");
        // Their accesses are still counted, for the time-based flags.
        assert!(r.blocks.iter().find(|b| b.ptr == 0x30_0000).unwrap().accesses == 3, "{ty}");
    }
}

#[test]
fn atb_blocks_count_on_the_atb_ops_index() {
    let mut t = Trace::new("atb");
    let atb_op = |t: &mut Trace, acts: &[Act]| {
        t.row("OP_LAUNCH", "ATB_START", None, Attr::new());
        t.acts(acts);
        t.row("OP_LAUNCH", "ATB_END", None, Attr::new());
    };
    t.row("OP_LAUNCH", "ATB_START", None, Attr::new());
    t.malloc_as("ATB", None, B, 64);
    t.malloc_as("ATB", None, A, 64);
    t.row("OP_LAUNCH", "ATB_END", None, Attr::new());
    // Aten ops and caching frees are another index: they do not make B early.
    t.op(&[Malloc(C, 64), Write(C)]);
    t.op(&[Read(C), Free(C)]);
    atb_op(&mut t, &[Write(B)]);
    let r = run(&t.finish(), &Options::default());
    assert_eq!(flags_at(&r, B), "");
    // Neighbour: an ATB block freed between.
    let mut t = Trace::new("atb-early");
    t.row("OP_LAUNCH", "ATB_START", None, Attr::new());
    t.malloc_as("ATB", None, B, 64);
    t.malloc_as("ATB", None, A, 64);
    t.row("OP_LAUNCH", "ATB_END", None, Attr::new());
    atb_op(&mut t, &[Write(A), Free(A)]);
    atb_op(&mut t, &[Write(B)]);
    let r = run(&t.finish(), &Options::default());
    assert_eq!(flags_at(&r, B), "early_allocation");
}

#[test]
fn workspace_frees_do_not_advance_the_index() {
    // A workspace block freed between B's allocation and first use: not a FREE API.
    let mut t = Trace::new("ws-free");
    t.malloc_as("PTA", Some("workspace"), X, 64);
    t.op(&[Malloc(B, 64)]);
    t.acts(&[Free(X)]);
    t.op(&[Write(B), Free(B)]);
    let r = run(&t.finish(), &Options::default());
    assert_eq!(flags_at(&r, B), "");
    let b = r.blocks.iter().find(|b| b.ptr == B).unwrap();
    assert_eq!(b.api.unwrap().first_access, Some(2), "the workspace free was no API");
}

#[test]
fn shadow_frees_are_no_frees_for_msmemscope() {
    // A is last used, B is allocated after, and A is still live when the trace stops: the
    // shadow FREE `trace` writes for it must not make it late (msMemScope hands shadow frees to
    // no analyzer).
    let mut t = Trace::new("shadow");
    t.op(&[Malloc(A, 64), Write(A)]);
    t.op(&[Malloc(B, 64), Write(B)]);
    t.op(&[Read(B), Free(B)]);
    let r = run(&t.finish(), &Options::default());
    assert_eq!(flags_at(&r, A), "");
    let a = &r.blocks[0];
    assert_eq!((a.end, a.api.unwrap().free), (End::Live, None));
    assert_eq!(a.end_ns, r.end_ns.unwrap() + 1, "ends at its shadow FREE");
    // Neighbour: a real FREE at the trace's end.
    let mut t = Trace::new("shadow-real");
    t.op(&[Malloc(A, 64), Write(A)]);
    t.op(&[Malloc(B, 64), Write(B)]);
    t.op(&[Read(B), Free(B)]);
    t.acts(&[Free(A)]);
    let r = run(&t.finish(), &Options::default());
    assert_eq!(flags_at(&r, A), "late_deallocation");
}

#[test]
fn accesses_resolve_to_the_live_block_holding_the_address() {
    let mut t = Trace::new("resolve");
    t.malloc_as("HAL", None, 0x10_0000, 0x10_0000); // a segment the pool carved from
    t.acts(&[Malloc(0x10_0000, 0x100), Malloc(0x10_0100, 0x100)]);
    t.acts(&[Read(0x10_00ff), Read(0x10_0100), Read(0x10_0180), Read(0x10_0200), Read(0x30_0000)]);
    t.acts(&[Free(0x10_0000), Read(0x10_0000)]);
    let r = run(&t.finish(), &Options::default());
    let accesses: Vec<(u64, &str, u64)> = r.blocks.iter().map(|b| (b.ptr, r.event_type(b), b.accesses)).collect();
    // The last byte of the first pool block is its; the next block's first byte is not; an
    // address in the segment outside any live pool block is the segment's.
    assert_eq!(accesses, [(0x10_0000, "HAL", 2), (0x10_0000, "PTA", 1), (0x10_0100, "PTA", 2)]);
    assert_eq!(r.stats.unresolved_accesses, 1);
}

/// A block allocated at `malloc`, accessed at each of `accesses`, freed at `free` (ns after
/// the trace start, at which moments nothing else happens).
fn timed(name: &str, malloc: i64, accesses: &[i64], free: i64) -> std::path::PathBuf {
    let mut t = Trace::new(name);
    let at = |t: &mut Trace, ns: i64| t.now = scenario::START_NS + ns - 10;
    at(&mut t, malloc);
    t.malloc(A, 4096);
    for &ns in accesses {
        at(&mut t, ns);
        t.access("READ", A);
    }
    at(&mut t, free);
    t.free(A);
    t.finish()
}

fn time_flags(path: &Path, options: &Options) -> String {
    flags_at(&run(path, options), A)
}

#[test]
fn lazy_used_is_the_wait_for_the_first_access() {
    let t = |s: &str| Some(s.parse::<TimeThreshold>().unwrap());
    let lazy = |s: &str| Options { lazy_used: t(s), ..Options::default() };
    // Life 1000..2000 ns; first access 300 ns after the allocation: 30% of the life.
    let path = timed("lazy", 1000, &[1300, 1400], 2000);
    assert_eq!(time_flags(&path, &lazy("299ns")), "lazy_used");
    assert_eq!(time_flags(&path, &lazy("300ns")), "");
    assert_eq!(time_flags(&path, &lazy("29%")), "lazy_used");
    assert_eq!(time_flags(&path, &lazy("30%")), "");
    assert_eq!(time_flags(&path, &lazy("1us,29.9%")), "lazy_used", "either threshold");
    assert_eq!(time_flags(&path, &lazy("1us,31%")), "");
    assert_eq!(time_flags(&path, &Options::default()), "", "off unless asked");
    // Insight: an access at the allocation instant is no wait at all.
    let path = timed("lazy-zero", 1000, &[1000, 1900], 2000);
    assert_eq!(time_flags(&path, &lazy("1%")), "");
}

#[test]
fn delayed_free_is_the_wait_after_the_last_access() {
    let delayed = |s: &str| Options { delayed_free: Some(s.parse().unwrap()), ..Options::default() };
    // Last access at 1600: freed 400 ns (40%) later.
    let path = timed("delayed", 1000, &[1100, 1600], 2000);
    assert_eq!(time_flags(&path, &delayed("399ns")), "delayed_free");
    assert_eq!(time_flags(&path, &delayed("400ns")), "");
    assert_eq!(time_flags(&path, &delayed("39%")), "delayed_free");
    assert_eq!(time_flags(&path, &delayed("40%")), "");
    // Never accessed: nothing to be late after (Insight's rule), so not even in the report.
    let path = timed("delayed-none", 1000, &[], 2000);
    let r = run(&path, &delayed("1ns"));
    assert_eq!((r.blocks.len(), r.stats.blocks), (0, 1));
}

#[test]
fn long_idle_is_the_longest_gap_between_accesses() {
    let idle = |s: &str| Options { long_idle: Some(s.parse().unwrap()), ..Options::default() };
    // Gaps 100, 500, 200: the longest is 500 ns, 50% of the life (Insight's own column
    // would say last - first = 800 ns: its loop never moves the previous access).
    let path = timed("idle", 1000, &[1050, 1150, 1650, 1850], 2000);
    let r = run(&path, &Options::default());
    assert_eq!(r.blocks[0].max_idle_ns, Some(500));
    assert_eq!(time_flags(&path, &idle("499ns")), "long_idle");
    assert_eq!(time_flags(&path, &idle("500ns")), "");
    assert_eq!(time_flags(&path, &idle("49%")), "long_idle");
    assert_eq!(time_flags(&path, &idle("50%")), "");
    // One access: no gap.
    let path = timed("idle-one", 1000, &[1500], 2000);
    assert_eq!(time_flags(&path, &idle("1ns")), "");
}

#[test]
fn mem_size_keeps_blocks_below_it_unflagged() {
    let mut t = Trace::new("memsize");
    t.op(&[Malloc(B, 100)]);
    t.op(&[Malloc(A, 64), Write(A)]);
    t.op(&[Read(A), Free(A)]);
    t.op(&[Write(B), Free(B)]);
    let path = t.finish();
    let sized = |n| Options { mem_size: n, ..Options::default() };
    assert_eq!(flags_at(&run(&path, &sized(100)), B), "early_allocation");
    let r = run(&path, &sized(101));
    assert_eq!(flags_at(&r, B), "");
    assert_eq!(r.stats.below_mem_size, 1);
}

/// Which blocks of [`long_trace`] must carry each flag, by construction.
#[derive(Default)]
struct Truth {
    early: BTreeSet<u64>,
    late: BTreeSet<u64>,
    idle: BTreeSet<u64>,
    lazy: BTreeSet<u64>,
    delayed: BTreeSet<u64>,
    long_idle: BTreeSet<u64>,
}

/// A chain of ops, each reading and freeing the previous op's output, then allocating and
/// writing its own, so every op both frees and allocates and no chain block is ever
/// inefficient by either definition. Faults (and their near misses) are scheduled into it:
/// op-index faults in the first part (no waits), time faults in the second (a wait inside an
/// op while only the fault's block is live).
fn long_trace(idle_threshold: usize, wait: i64, near_wait: i64) -> (std::path::PathBuf, Truth) {
    let mut plan: std::collections::HashMap<usize, Vec<Act>> = Default::default();
    let mut at = |op: usize, acts: &[Act]| plan.entry(op).or_default().extend_from_slice(acts);
    let mut truth = Truth::default();
    let mut next = 0x9000_0000u64;
    let mut block = || {
        next += 0x1000;
        next
    };
    let groups = 10;
    for g in 0..groups {
        let a = 5 + g * (idle_threshold + 20);
        let e = block();
        at(a, &[Malloc(e, 256)]);
        at(a + 3, &[Read(e), Free(e)]);
        truth.early.insert(e);
        let near = block();
        at(a, &[Malloc(near, 256)]);
        at(a + 1, &[Read(near), Free(near)]);
        let l = block();
        at(a, &[Malloc(l, 256), Write(l)]);
        at(a + 1, &[Read(l)]);
        at(a + 4, &[Free(l)]);
        truth.late.insert(l);
        let near = block();
        at(a, &[Malloc(near, 256), Write(near)]);
        at(a + 1, &[Read(near)]);
        at(a + 2, &[Free(near)]);
        let i = block();
        at(a, &[Malloc(i, 256), Write(i)]);
        at(a + 1, &[Read(i)]);
        at(a + 2 + idle_threshold, &[Read(i), Free(i)]);
        truth.idle.insert(i);
        let near = block();
        at(a, &[Malloc(near, 256), Write(near)]);
        at(a + 1, &[Read(near)]);
        at(a + 1 + idle_threshold, &[Read(near), Free(near)]);
    }
    let timed_from = 5 + groups * (idle_threshold + 20) + 10;
    for h in 0..groups {
        for (k, w) in [(0, wait), (1, near_wait)] {
            let b = timed_from + h * 20 + k * 10;
            let z = block();
            at(b, &[Malloc(z, 512)]);
            at(b + 1, &[Wait(w), Read(z), Free(z)]);
            let d = block();
            at(b + 3, &[Malloc(d, 512), Write(d)]);
            at(b + 4, &[Read(d), Wait(w), Free(d)]);
            let y = block();
            at(b + 6, &[Malloc(y, 512), Write(y)]);
            at(b + 7, &[Read(y), Wait(w), Read(y), Free(y)]);
            if k == 0 {
                truth.lazy.insert(z);
                truth.delayed.insert(d);
                truth.long_idle.insert(y);
            }
        }
    }
    let ops = timed_from + groups * 20 + 10;
    let mut t = Trace::new(&format!("long-{idle_threshold}-{wait}"));
    let chain = |i: usize| 0x1000_0000 + i as u64 * 0x1000;
    for i in 0..ops {
        t.start();
        if i > 0 {
            t.acts(&[Read(chain(i - 1)), Free(chain(i - 1))]);
        }
        t.acts(plan.get(&i).map_or(&[][..], Vec::as_slice));
        t.acts(&[Malloc(chain(i), 128), Write(chain(i))]);
        t.end();
    }
    (t.finish(), truth)
}

#[test]
fn faults_injected_into_a_long_trace_are_found_exactly() {
    let (path, truth) = long_trace(20, 1_000_000, 50_000);
    let us100 = Some("100us".parse().unwrap());
    let options = Options { idle_threshold: 20, lazy_used: us100, delayed_free: us100, long_idle: us100, mem_size: 0 };
    let r = run(&path, &options);
    // Precision and recall 1 for every flag: exactly the injected blocks, nothing else.
    assert_eq!(ptrs_with(&r, EARLY_ALLOCATION), truth.early);
    assert_eq!(ptrs_with(&r, LATE_DEALLOCATION), truth.late);
    assert_eq!(ptrs_with(&r, TEMPORARY_IDLENESS), truth.idle);
    assert_eq!(ptrs_with(&r, LAZY_USED), truth.lazy);
    assert_eq!(ptrs_with(&r, DELAYED_FREE), truth.delayed);
    assert_eq!(ptrs_with(&r, LONG_IDLE), truth.long_idle);
    assert_eq!(truth.early.len() + truth.late.len() + truth.idle.len(), 30);
    assert_eq!(r.stats.unresolved_accesses, 0);
    // The near misses' waits (50 us) fire once the thresholds come down below them.
    let us40 = Some("40us".parse().unwrap());
    let low = Options { lazy_used: us40, delayed_free: us40, long_idle: us40, ..options };
    assert_eq!(ptrs_with(&run(&path, &low), LAZY_USED).len(), 2 * truth.lazy.len());
}

/// The facts and flags of every block, to compare two analyses.
fn outcome(r: &Report) -> Vec<String> {
    r.blocks
        .iter()
        .map(|b| format!("{:#x} {:?} {:?} {}", b.ptr, b.api, (b.first_access_ns, b.max_idle_ns, b.end_ns), b.flags))
        .collect()
}

#[test]
fn rows_out_of_time_order_are_replayed_in_order() {
    let (path, _) = long_trace(3, 1_000_000, 50_000);
    let us100 = Some("100us".parse().unwrap());
    let options = Options { idle_threshold: 3, lazy_used: us100, delayed_free: us100, long_idle: us100, mem_size: 0 };
    let (sorted, how) = analyse_in(&DumpDb::open_read(&path).unwrap(), &options, |o| o).unwrap();
    assert_eq!(how, ReadOrder::Storage, "written in time order");
    assert!(sorted.blocks.iter().filter(|b| b.flags != 0).count() > 50);
    // The same rows stored in another order: pairs of neighbours swapped (as two CPUs racing
    // for the ring leave them), and every MALLOC moved to the end (as msMemScope writes them).
    let conn = Connection::open(&path).unwrap();
    let swapped = path.with_file_name("memscope_dump_2.db");
    let moved = path.with_file_name("memscope_dump_3.db");
    for (copy, order) in [(&swapped, "((rowid - 1) / 2) * 2 + (rowid % 2)"), (&moved, "(\"Event\" = 'MALLOC'), rowid")]
    {
        let _ = std::fs::remove_file(copy);
        conn.execute("ATTACH ?1 AS c", [copy.to_str().unwrap()]).unwrap();
        conn.execute_batch(&format!(
            "CREATE TABLE c.memscope_dump AS SELECT * FROM memscope_dump WHERE 0; \
             INSERT INTO c.memscope_dump SELECT * FROM memscope_dump ORDER BY {order}; DETACH c"
        ))
        .unwrap();
    }
    let (many, all) = (usize::MAX, u64::MAX);
    let (r, how) =
        analyse_in(&DumpDb::open_read(&swapped).unwrap(), &options, |o| o.with_limits(many, many, all)).unwrap();
    assert_eq!(how, ReadOrder::Storage, "a swap holds back one row");
    assert_eq!(outcome(&r), outcome(&sorted));
    let (r, how) =
        analyse_in(&DumpDb::open_read(&swapped).unwrap(), &options, |o| o.with_limits(many, many, 0)).unwrap();
    assert_eq!(how, ReadOrder::Rescanned, "the first swap found while streaming sends it back for the keys");
    assert_eq!(outcome(&r), outcome(&sorted));
    let (r, how) = analyse_in(&DumpDb::open_read(&swapped).unwrap(), &options, |o| o.with_limits(0, many, 0)).unwrap();
    assert_eq!(how, ReadOrder::Sorted, "no straggler allowed: the first swap sends it to SQLite");
    assert_eq!(outcome(&r), outcome(&sorted));
    let (r, how) =
        analyse_in(&DumpDb::open_read(&swapped).unwrap(), &options, |o| o.with_limits(many, 0, all)).unwrap();
    assert_eq!(how, ReadOrder::Sorted, "no row may wait: the replay starts again, sorted");
    assert_eq!(outcome(&r), outcome(&sorted));
    let (r, how) = analyse_in(&DumpDb::open_read(&moved).unwrap(), &options, |o| o.with_limits(100, many, 0)).unwrap();
    assert_eq!(how, ReadOrder::Sorted);
    assert_eq!(outcome(&r), outcome(&sorted));
}

#[test]
fn thresholds_parse_or_say_what_is_wrong() {
    let t = |s: &str| s.parse::<TimeThreshold>();
    assert_eq!(t("5ms").unwrap(), TimeThreshold { value_ns: Some(5_000_000), percent: None });
    assert_eq!(t("20%").unwrap(), TimeThreshold { value_ns: None, percent: Some(20.0) });
    assert_eq!(t("2.5us, 12.5%").unwrap(), TimeThreshold { value_ns: Some(2500), percent: Some(12.5) });
    assert_eq!(t("30%,1s").unwrap(), TimeThreshold { value_ns: Some(1_000_000_000), percent: Some(30.0) });
    assert!(t("5").unwrap_err().contains("needs a unit"));
    assert!(t("150%").unwrap_err().contains("below 100%"));
    assert!(t("0%").unwrap_err().contains("above 0%"));
    assert!(t("0ms").unwrap_err().contains("at least 1ns"));
    assert!(t("5ms,6ms").unwrap_err().contains("at most one duration"));
    assert!(t("5 parsecs").unwrap_err().contains("unknown unit"));
    assert!(t("fast").is_err());
    assert_eq!(parse_bytes("1048576"), Ok(1 << 20));
    assert_eq!(parse_bytes("512KiB"), Ok(512 << 10));
    assert_eq!(parse_bytes("2G"), Ok(2 << 30));
    assert!(parse_bytes("1.5MiB").unwrap_err().contains("examples"));
}

#[test]
fn owners_reach_the_text_escaped_and_the_json_exact() {
    let path = super::scenario::small_trace("owner-escaped");
    let hostile = r"UPDATE memscope_dump SET Attr = replace(Attr, 'PTA@test', 'PTA@x\u001b[2J\nforged')";
    Connection::open(&path).unwrap().execute_batch(hostile).unwrap();
    let r = run(&path, &Options::default());
    let text = super::out::text(&r, &path, "0");
    assert!(!text.contains('\u{1b}') && !text.contains("\nforged"), "{text}");
    assert!(text.contains(r"PTA PTA@x\u{1b}[2J\nforged  early_allocation"), "{text}");
    let json = super::out::json(&r, &path, "0").to_string();
    assert!(json.contains(r#""PTA@x\u001b[2J\nforged""#), "{json}");
}
