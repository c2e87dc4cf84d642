//! Fragmentation of the caching allocator over time, replayed offline from `memscope_dump`: per
//! device, reserved − allocated, the largest free piece inside cached segments, the free pieces
//! inside segments that still hold tensors (holes), and the count of splits. It also collects the
//! evidence the advisor reasons from (growth of reserved memory that fragmentation forced, big
//! segments pinned by small tensors, cache flushes at a ceiling) and hands the live state to the
//! OOM forensics at each failed allocation. Stored as `ms_fragmentation` (docs/db-schema.md).
//!
//! Segments are the `HAL` MALLOC rows marked `segment=caching` (expandable-segment pages,
//! `vmm=true`, join their neighbours into one range, as they are one address range to the
//! allocator); pool blocks are the `PTA` rows; free pieces are segments minus the live blocks
//! inside them. The structures are updated per row in O(log n) (intervals in ordered maps and a
//! multiset of free-piece sizes), never rebuilt, so a million rows cost one scan.
//!
//! A split is a block carved from a free piece larger than itself (the allocator cut the piece
//! and kept the rest cached), including the first block taken from a fresh segment bigger than it.


use foldhash::HashMap;
use rusqlite::{params, Transaction};
use serde::Serialize;

use super::blocks::{Bounds, FreeMark, UNKNOWN_OWNER};
use super::db::{DumpDb, DumpRow, Fed, Selection};
use super::incidents::{self, Incident, Tracker};
use super::pool::{self, parse_number, Fields, Live, PoolKind, Pools};
pub use super::pool::{Reason, Sample, LARGE_SEGMENT, MIB, SMALL_REQUEST};
use super::AnalysisError;
use crate::vocab::{Event, EventType};

/// What one replay is asked for.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// Top-K of the OOM forensics (most recent and largest live blocks, owners).
    pub top_k: usize,
    /// Memory rows between two periodic samples; `None`: about 500 samples over the trace (the
    /// rows are counted first); `Some(0)`: none.
    pub sample_every: Option<u64>,
}

impl Default for Options {
    fn default() -> Self {
        Self { top_k: 10, sample_every: None }
    }
}

/// A new segment taken for a block, with the pool as it was just before. In `Report::forced`:
/// enough pinned free memory existed for the block but no piece was big enough (fragmentation
/// made the pool grow); in `Report::pinned_big`: a big block, while big segments were held by
/// small blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Growth {
    pub ts_ns: i64,
    pub pid: i64,
    /// The block the allocator was asked for.
    pub request: u64,
    /// Bytes of segments it took for it.
    pub segment_bytes: u64,
    /// Holes and largest free piece of the process's pool just before.
    pub holes_before: u64,
    pub largest_before: u64,
    /// Big segments (> 20 MiB) held by small blocks (< 10 MiB) just before, and the smallest.
    pub pinned_big: u64,
    pub pinned_big_min: u64,
}

/// Cached segments freed inside one allocator call just before it took a new one, none of them
/// big enough for the request: the pool hit a ceiling (the device or its memory fraction) with a
/// cache it could not use, and emptied it to go on. (An `empty_cache()` right before an
/// allocation looks the same in the rows unless its cache could have served the request.)
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Flush {
    pub ts_ns: i64,
    pub pid: i64,
    pub freed: u64,
    pub largest_freed: u64,
    /// Reserved bytes before the first segment was freed.
    pub reserved_before: u64,
    /// The segment taken right after.
    pub segment_bytes: u64,
}

/// One process's largest footprint on the device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ProcessPeak {
    pub pid: i64,
    pub peak_reserved: u64,
    /// Live `HAL` bytes (all device memory the process took, pools included).
    pub peak_device: u64,
}

/// Everything one pass over a DB found.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub start_ns: Option<i64>,
    pub end_ns: Option<i64>,
    pub samples: Vec<Sample>,
    /// The sample at the peak of reserved bytes (also in `samples`).
    pub peak: Option<Sample>,
    pub max_allocated: u64,
    /// Whether the pools' segments were seen (our DBs), so free pieces are known.
    pub has_segments: bool,
    /// Segment allocations of the caching pools, and those forced by fragmentation.
    pub growths: u64,
    pub forced: Vec<Growth>,
    /// Growths for requests above 20 MiB while big segments were pinned by small blocks.
    pub pinned_big: Vec<Growth>,
    pub flushes: Vec<Flush>,
    pub processes: Vec<ProcessPeak>,
    pub incidents: Vec<Incident>,
    pub unreadable: u64,
}

// ---------------------------------------------------------------- reading rows

/// The rows the replay reads; columns that older writers lack (`Name`, `Thread Id`) read as
/// empty (the thread as the process).
const SELECTION: Selection = Selection {
    events: &[Event::Malloc.as_str(), Event::Free.as_str(), Event::System.as_str(), Event::OomDetail.as_str()],
    name: true,
    thread: true,
};

// ---------------------------------------------------------------- the replay

/// A growth in progress on one thread: the allocator took segment(s) inside its call; the block
/// it was for is the thread's next pool MALLOC.
#[derive(Clone, Copy, Default)]
struct Pending {
    growth: Growth,
    flush: Option<Flush>,
}

/// The pool model ([`super::pool`]) fed row by row, with the evidence this analysis collects on
/// top of it and the OOM tracker it hands the live state to.
#[derive(Default)]
struct Replay {
    pools: Pools,
    pending: HashMap<(i64, i64), Pending>,
    /// Cached segments freed on a thread since its last pool row (a flush in progress).
    freeing: HashMap<(i64, i64), Flush>,
    report: Report,
    group_ts: Option<i64>,
    peak_candidate: Option<Sample>,
    /// `first`: every row read; `last`: the SYSTEM, OOM and memory rows (not shadow FREEs).
    bounds: Bounds,
    rows: u64,
    every: u64,
    oom: Tracker,
}

impl Replay {
    fn push_sample(&mut self, ts: i64, reason: Reason) {
        let s = self.pools.sample(ts, reason);
        self.report.samples.push(s);
    }

    fn close_group(&mut self) {
        let Some(ts) = self.group_ts else { return };
        let s = self.pools.sample(ts, Reason::PeakReserved);
        if s.reserved > 0 && self.peak_candidate.is_none_or(|p| s.reserved > p.reserved) {
            self.peak_candidate = Some(s);
        }
        self.report.max_allocated = self.report.max_allocated.max(s.allocated);
        for p in self.pools.procs.values_mut() {
            p.peak_reserved = p.peak_reserved.max(p.reserved());
            p.peak_device = p.peak_device.max(p.hal_bytes);
        }
    }

    fn apply(&mut self, row: DumpRow<'_>) {
        if self.group_ts != Some(row.ts) {
            self.close_group();
            self.group_ts = Some(row.ts);
        }
        self.bounds.first.get_or_insert(row.ts);
        match Event::parse(row.event) {
            Some(Event::System) => {
                self.system(&row);
                self.bounds.last = Some(row.ts);
            }
            Some(Event::OomDetail) => self.oom_detail(&row),
            Some(Event::Malloc | Event::Free) => self.memory(row),
            _ => {}
        }
    }

    fn system(&mut self, row: &DumpRow<'_>) {
        self.bounds.system(row.event_type, row.ts);
        match EventType::parse(row.event_type) {
            Some(EventType::StartTrace) => {
                // msMemScope writes the device's memory here; our tracer does not know it.
                if let Some(attr) = Fields::parse(row.attr) {
                    let pools = &mut self.pools;
                    pools.capacity = pools.capacity.or(Fields::number(&attr.total).filter(|&t| t > 0));
                }
            }
            Some(EventType::Step) => {
                self.pools.step = row.name.trim().parse().ok().or(self.pools.step.map(|s| s + 1));
                self.push_sample(row.ts, Reason::Step);
            }
            _ => {}
        }
    }

    fn oom_detail(&mut self, row: &DumpRow<'_>) {
        let Some(attr) = Fields::parse(row.attr) else {
            self.report.unreadable += 1;
            return;
        };
        self.bounds.last = Some(row.ts);
        if EventType::parse(row.event_type) == Some(EventType::OomTrigger) {
            let key = (row.pid, row.tid);
            if Tracker::is_allocator(row.name, attr.func.as_deref()) {
                // The allocator gave up: the call's growth never produced a block.
                self.pending.remove(&key);
                self.freeing.remove(&key);
            }
            incidents::capture(&mut self.oom, &self.pools, row, &attr);
        } else {
            incidents::cross_check(&mut self.oom, &self.pools, row, &attr);
        }
    }

    fn memory(&mut self, row: DumpRow<'_>) {
        let Some(attr) = Fields::parse(row.attr) else {
            self.report.unreadable += 1;
            return;
        };
        let is_free = Event::parse(row.event) == Some(Event::Free);
        let mark = if is_free { FreeMark::of(attr.shadow.as_deref(), attr.unmatched.as_deref()) } else { FreeMark::Plain };
        if mark == FreeMark::Shadow {
            return; // written at the end for blocks still live
        }
        self.bounds.last = Some(row.ts);
        if mark == FreeMark::Unmatched {
            return;
        }
        let Some(ptr) = parse_number(row.ptr) else {
            self.report.unreadable += 1;
            return;
        };
        // Host memory is not the device's.
        let Ok(pool) = pool::pool_of(row.event_type, attr.pool.as_deref()) else { return };
        self.rows += 1;
        let key = (row.pid, row.tid);
        match (pool, is_free) {
            (None, false) => self.hal_malloc(row.pid, key, row.ts, ptr, &attr),
            (None, true) => self.hal_free(row.pid, key, row.ts, ptr),
            (Some(pool), false) => self.block_malloc(row.pid, key, row.ts, ptr, pool, &attr),
            (Some(_), true) => self.block_free(row.pid, key, ptr),
        }
        if self.every > 0 && self.rows.is_multiple_of(self.every) {
            self.push_sample(row.ts, Reason::Periodic);
        }
    }

    fn owner(&mut self, attr: &Fields<'_>) -> u32 {
        self.pools.owners.id(attr.owner.as_deref().filter(|o| !o.is_empty()).unwrap_or(UNKNOWN_OWNER))
    }

    fn hal_malloc(&mut self, pid: i64, key: (i64, i64), ts: i64, ptr: u64, attr: &Fields<'_>) {
        let Some(size) = Fields::number(&attr.size).filter(|&s| s > 0) else { return };
        let segment = match attr.segment.as_deref() {
            Some("caching") => Some(PoolKind::Caching),
            Some("workspace") => Some(PoolKind::Workspace),
            Some(_) => Some(PoolKind::Other),
            None => None,
        };
        let owner = self.owner(attr);
        self.oom.memory_row(key, segment.is_some());
        let proc = self.pools.procs.entry(pid).or_default();
        proc.hal_malloc(ptr, Live { size, ts, owner, pool: None, in_region: false, segment });
        if segment != Some(PoolKind::Caching) {
            return;
        }
        let before = Growth {
            ts_ns: ts,
            pid,
            holes_before: proc.holes(),
            largest_before: proc.largest_free().unwrap_or(0),
            pinned_big: proc.pinned_big,
            pinned_big_min: if proc.pinned_big > 0 { proc.pinned_big_min() } else { 0 },
            ..Growth::default()
        };
        proc.segment_added(ptr, size, Fields::flag(&attr.vmm));
        self.report.growths += 1;
        let flush = self.freeing.remove(&key).map(|f| Flush { segment_bytes: size, ..f });
        let pending = self.pending.entry(key).or_insert(Pending { growth: before, flush: None });
        pending.growth.segment_bytes += size;
        if pending.flush.is_none() {
            pending.flush = flush;
        }
    }

    fn hal_free(&mut self, pid: i64, key: (i64, i64), ts: i64, ptr: u64) {
        self.oom.memory_row(key, true);
        let Some(proc) = self.pools.procs.get_mut(&pid) else { return };
        let Some(old) = proc.hal_free(ptr) else { return };
        if old.segment != Some(PoolKind::Caching) {
            return;
        }
        let reserved = proc.reserved();
        proc.segment_removed(ptr, old.size);
        let f =
            self.freeing.entry(key).or_insert(Flush { ts_ns: ts, pid, reserved_before: reserved, ..Flush::default() });
        f.freed += old.size;
        f.largest_freed = f.largest_freed.max(old.size);
    }

    fn block_malloc(&mut self, pid: i64, key: (i64, i64), ts: i64, ptr: u64, pool: PoolKind, attr: &Fields<'_>) {
        let Some(size) = Fields::number(&attr.size).filter(|&s| s > 0) else { return };
        let owner = self.owner(attr);
        self.oom.pool_row(key, true);
        self.freeing.remove(&key);
        let pending = self.pending.remove(&key);
        let proc = self.pools.procs.entry(pid).or_default();
        let block = Live { size, ts, owner, pool: Some(pool), in_region: false, segment: None };
        proc.block_malloc(ptr, block, Fields::number(&attr.total));
        let Some(Pending { mut growth, flush }) = pending.filter(|_| pool == PoolKind::Caching) else { return };
        growth.request = size;
        if growth.holes_before >= size && growth.largest_before < size {
            self.report.forced.push(growth);
        }
        if size > LARGE_SEGMENT && growth.pinned_big > 0 {
            self.report.pinned_big.push(growth);
        }
        if let Some(flush) = flush.filter(|f| f.largest_freed < size) {
            self.report.flushes.push(flush);
        }
    }

    fn block_free(&mut self, pid: i64, key: (i64, i64), ptr: u64) {
        self.oom.pool_row(key, false);
        self.freeing.remove(&key);
        if let Some(proc) = self.pools.procs.get_mut(&pid) {
            proc.block_free(ptr);
        }
    }

    fn finish(mut self) -> Report {
        self.close_group();
        let end = self.bounds.end_ns();
        if let Some(end) = end {
            self.push_sample(end, Reason::End);
        }
        incidents::finish(&mut self.oom);
        let mut report = std::mem::take(&mut self.report);
        report.samples.extend(incidents::samples(&self.oom.incidents));
        report.samples.sort_by_key(|s| s.ts_ns);
        if let Some(peak) = self.peak_candidate {
            // In time order with the other samples, before those taken at the same instant
            // after it (a peak is the state after all rows of its timestamp).
            let at = report.samples.partition_point(|s| s.ts_ns <= peak.ts_ns);
            report.samples.insert(at, peak);
            report.peak = Some(peak);
        }
        report.start_ns = self.bounds.start_ns();
        report.end_ns = end;
        let procs = &self.pools.procs;
        report.has_segments = procs.values().any(|p| p.seen_segments);
        let mut processes: Vec<ProcessPeak> = procs
            .iter()
            .filter(|(_, p)| p.peak_reserved > 0 || p.peak_device > 0)
            .map(|(&pid, p)| ProcessPeak { pid, peak_reserved: p.peak_reserved, peak_device: p.peak_device })
            .collect();
        processes.sort_by_key(|p| p.pid);
        report.processes = processes;
        report.incidents = std::mem::take(&mut self.oom.incidents);
        report
    }
}

/// Replays a DB.
pub fn analyse(db: &DumpDb, options: Options) -> Result<Report, AnalysisError> {
    let order = db.rows(SELECTION)?;
    let every = std::cell::Cell::new(options.sample_every.unwrap_or(0));
    let new = || Replay { oom: Tracker::new(options.top_k), every: every.get(), ..Replay::default() };
    // Made at the first row: by then the rows are counted, when the period depends on that.
    let mut replay = None;
    let feed = |fed: Fed<'_>| match fed {
        Fed::Row(row) => replay.get_or_insert_with(new).apply(row),
        Fed::Restart => replay = None,
    };
    match options.sample_every {
        Some(_) => order.for_each_row(feed)?,
        None => {
            let counted = |n: u64| every.set(n.div_ceil(500).max(100));
            order.for_each_row_counted(&[Event::Malloc.as_str(), Event::Free.as_str()], counted, feed)?
        }
    };
    Ok(replay.unwrap_or_else(new).finish())
}

// ---------------------------------------------------------------- writing results

/// Our sampled fragmentation table (docs/db-schema.md, "ms_fragmentation").
pub const FRAGMENTATION_TABLE: &str = "ms_fragmentation";
const CREATE_FRAGMENTATION: &str = "CREATE TABLE ms_fragmentation (
    device TEXT NOT NULL, ts_ns INTEGER NOT NULL, reason TEXT NOT NULL, step INTEGER,
    reserved INTEGER NOT NULL, allocated INTEGER NOT NULL, unused INTEGER NOT NULL,
    largest_free INTEGER, free_pieces INTEGER NOT NULL, holes INTEGER NOT NULL,
    segments INTEGER NOT NULL, splits INTEGER NOT NULL, processes INTEGER NOT NULL)";

pub(crate) fn fill_samples(tx: &Transaction<'_>, device: &str, samples: &[Sample]) -> rusqlite::Result<usize> {
    let mut insert = tx.prepare(
        "INSERT INTO ms_fragmentation (device, ts_ns, reason, step, reserved, allocated, unused, largest_free, \
         free_pieces, holes, segments, splits, processes) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)",
    )?;
    for s in samples {
        insert.execute(params![
            device,
            s.ts_ns,
            s.reason.as_str(),
            s.step,
            s.reserved as i64,
            s.allocated as i64,
            s.unused as i64,
            s.largest_free.map(|v| v as i64),
            s.free_pieces as i64,
            s.holes as i64,
            s.segments as i64,
            s.splits as i64,
            s.processes as i64
        ])?;
    }
    Ok(samples.len())
}

pub(crate) fn create_fragmentation() -> (&'static str, &'static str) {
    (FRAGMENTATION_TABLE, CREATE_FRAGMENTATION)
}

// ---------------------------------------------------------------- fed by a shared pass

/// [`analyse`]'s replay, fed by a [`super::pass`] that other replays share (`advise` reads the
/// DB once for all of them). Made at its first row, as in [`analyse`], once the rows are counted.
pub(crate) struct Shared {
    options: Options,
    every: u64,
    replay: Option<Replay>,
}

impl Shared {
    pub(crate) fn new(options: Options) -> Self {
        Self { every: options.sample_every.unwrap_or(0), options, replay: None }
    }

    fn fresh(top_k: usize, every: u64) -> Replay {
        Replay { oom: Tracker::new(top_k), every, ..Replay::default() }
    }

    pub(crate) fn finish(self) -> Report {
        self.replay.unwrap_or_else(|| Self::fresh(self.options.top_k, self.every)).finish()
    }
}

impl super::pass::Consumer for Shared {
    fn selection(&self) -> Selection<'static> {
        SELECTION
    }

    fn row(&mut self, row: DumpRow<'_>) {
        let (top_k, every) = (self.options.top_k, self.every);
        self.replay.get_or_insert_with(|| Self::fresh(top_k, every)).apply(row);
    }

    fn restart(&mut self) {
        self.replay = None;
    }

    fn counts(&self) -> Option<&'static [&'static str]> {
        self.options.sample_every.is_none().then_some(&["MALLOC", "FREE"])
    }

    fn count(&mut self, rows: u64) {
        self.every = rows.div_ceil(500).max(100);
    }
}

/// Trace DBs for the tests of this module, `oom` and `advise`: pool segments, blocks, OOM rows,
/// steps and settings with the Attr keys the tracer writes (docs/db-schema.md).
#[cfg(any(test, feature = "testing"))]
pub mod fx {
    use std::path::PathBuf;

    use rusqlite::params;
    use serde_json::json;

    use crate::analysis::testdb::{dir, TestDb};

    pub const START: i64 = 1_000_000_000_000;

    pub struct Fx {
        db: TestDb,
        id: i64,
        /// The next row's timestamp; each row advances it by 1 µs.
        pub ts: i64,
    }

    impl Fx {
        pub fn new(name: &str) -> Self {
            let db = TestDb::create(&dir(name).join("memscope_dump_1.db"));
            let mut fx = Self { db, id: 1, ts: START };
            fx.row("SYSTEM", "START_TRACE", "START_TRACE", 1, 1, None, json!({"tool": "memscope-bpf"}));
            fx
        }

        #[expect(clippy::too_many_arguments, reason = "one row's columns")]
        pub fn row(
            &mut self,
            event: &str,
            ty: &str,
            name: &str,
            pid: i64,
            tid: i64,
            ptr: Option<u64>,
            attr: serde_json::Value,
        ) {
            let ptr = ptr.map_or_else(|| "N/A".to_owned(), |p| format!("0x{p:016x}"));
            self.db
                .conn()
                .execute(
                    "INSERT INTO memscope_dump VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, '0', ?8, ?9, '', '')",
                    params![self.id, event, ty, name, self.ts, pid, tid, ptr, attr.to_string()],
                )
                .unwrap();
            self.id += 1;
            self.ts += 1000;
        }

        /// A caching-pool segment (`aclrtMallocAlign32`, or a mapped expandable page).
        pub fn segment(&mut self, pid: i64, ptr: u64, size: u64, vmm: bool) {
            let mut attr = json!({"addr": format!("0x{ptr:x}"), "size": size.to_string(), "owner": "CANN@APP",
                                  "segment": "caching"});
            if vmm {
                attr["vmm"] = json!("true");
            }
            self.row(
                "MALLOC",
                "HAL",
                if vmm { "aclrtMapMem" } else { "aclrtMallocAlign32" },
                pid,
                pid,
                Some(ptr),
                attr,
            );
        }

        pub fn hal(&mut self, pid: i64, ptr: u64, size: u64, owner: &str) {
            let attr = json!({"size": size.to_string(), "owner": owner});
            self.row("MALLOC", "HAL", "aclrtMalloc", pid, pid, Some(ptr), attr);
        }

        pub fn hal_free(&mut self, pid: i64, ptr: u64, size: u64) {
            self.row("FREE", "HAL", "aclrtFree", pid, pid, Some(ptr), json!({"size": size.to_string()}));
        }

        pub fn block(&mut self, pid: i64, ptr: u64, size: u64, owner: &str) {
            let attr = json!({"size": size.to_string(), "pool": "caching", "owner": owner});
            self.row("MALLOC", "PTA", "DeviceCachingAllocator::malloc", pid, pid, Some(ptr), attr);
        }

        pub fn free(&mut self, pid: i64, ptr: u64, size: u64) {
            let attr = json!({"size": size.to_string(), "pool": "caching"});
            self.row("FREE", "PTA", "DeviceCachingAllocator::free", pid, pid, Some(ptr), attr);
        }

        /// An OOM_TRIGGER row, named as the tracer names the failing function.
        pub fn oom(&mut self, pid: i64, name: &str, req: u64) {
            let attr = json!({"func": name, "req_size": req.to_string(), "status": "207001"});
            self.row("OOM_DETAIL", "OOM_TRIGGER", name, pid, pid, None, attr);
        }

        pub fn step(&mut self, n: i64) {
            self.row("SYSTEM", "STEP", &n.to_string(), 1, 1, None, json!({}));
        }

        /// An ATB operation's ATB_START and ATB_END rows, as the tracer writes them.
        pub fn atb(&mut self, pid: i64, runner: u64, workspace: u64, intermediate: u64) {
            let attr = json!({"workspace_ptr": "0x0000000000009000", "workspace_size": workspace.to_string(),
                              "intermediate_size": intermediate.to_string(), "runner": format!("0x{runner:016x}")});
            for ty in ["ATB_START", "ATB_END"] {
                self.row("OP_LAUNCH", ty, "atb::Runner::Execute", pid, pid, None, attr.clone());
            }
        }

        pub fn meta(&mut self, key: &str, value: &str) {
            self.db.conn().execute("INSERT INTO ms_meta VALUES (?1, ?2)", params![key, value]).unwrap();
        }

        pub fn path(&self) -> PathBuf {
            self.db.path.clone()
        }

        /// STOP_TRACE, and the file's path.
        pub fn stop(mut self) -> PathBuf {
            self.row("SYSTEM", "STOP_TRACE", "STOP_TRACE", 1, 1, None, json!({}));
            self.db.path.clone()
        }
    }
}

#[cfg(test)]
mod tests {
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


}
