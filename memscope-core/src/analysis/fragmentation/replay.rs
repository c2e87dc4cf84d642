//! The fragmentation replay: the rows fed, in time order, to the pool model of
//! [`crate::analysis::pool`], with the evidence this analysis collects on top of it (growths,
//! forced growths, pinned big segments, flushes, samples) and the OOM tracker of
//! [`crate::analysis::incidents`] it hands the live state to at each failed allocation.

use foldhash::HashMap;

use super::{Flush, Growth, ProcessPeak, Report};
use crate::analysis::blocks::{Bounds, FreeMark, UNKNOWN_OWNER};
use crate::analysis::db::DumpRow;
use crate::analysis::incidents::{self, Tracker};
use crate::analysis::pool::{parse_number, Fields, Live, Memory, PoolKind, Pools, Reason, Sample, LARGE_SEGMENT};
use crate::vocab::{Event, EventType};

/// A growth in progress on one thread: the allocator took segment(s) inside its call; the block
/// it was for is the thread's next pool MALLOC.
#[derive(Clone, Copy, Default)]
struct Pending {
    growth: Growth,
    flush: Option<Flush>,
}

/// The pool model ([`crate::analysis::pool`]) fed row by row, with the evidence this analysis
/// collects on top of it and the OOM tracker it hands the live state to.
#[derive(Default)]
pub(super) struct Replay {
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
    /// A replay whose OOM incidents list `top_k` blocks and owners, sampling every `every`
    /// memory rows (0: never).
    pub(super) fn new(top_k: usize, every: u64) -> Self {
        Self { oom: Tracker::new(top_k), every, ..Self::default() }
    }

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

    pub(super) fn apply(&mut self, row: DumpRow<'_>) {
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
        let mark =
            if is_free { FreeMark::of(attr.shadow.as_deref(), attr.unmatched.as_deref()) } else { FreeMark::Plain };
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
        let memory = Memory::of(row.event_type, attr.pool.as_deref());
        if memory == Memory::Host {
            return; // not the device's
        }
        self.rows += 1;
        let key = (row.pid, row.tid);
        match (memory, is_free) {
            (Memory::Device, false) => self.hal_malloc(row.pid, key, row.ts, ptr, &attr),
            (Memory::Device, true) => self.hal_free(row.pid, key, row.ts, ptr),
            (Memory::Pool(pool), false) => self.block_malloc(row.pid, key, row.ts, ptr, pool, &attr),
            (Memory::Pool(_), true) => self.block_free(row.pid, key, ptr),
            (Memory::Host, _) => {}
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

    pub(super) fn finish(mut self) -> Report {
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
