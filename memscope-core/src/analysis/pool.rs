//! The caching-pool model the fragmentation replay and the OOM forensics share: per process,
//! torch_npu's segments (the `HAL` MALLOC rows marked `segment=caching`; expandable-segment pages,
//! `vmm=true`, join their neighbours into one range, as they are one address range to the
//! allocator) carved into the pool's blocks (`PTA` rows) and free pieces, reserved (segments)
//! against allocated (live blocks), and the device memory outside the pools.
//!
//! The structures are updated per row in O(log n) (intervals in ordered maps and a multiset of
//! free-piece sizes), never rebuilt, so a million rows cost one scan. A split is a block carved
//! from a free piece larger than itself (the allocator cut the piece and kept the rest cached),
//! including the first block taken from a fresh segment bigger than it.
//!
//! Blocks are keyed by (process, address) in each of two maps, pools and `HAL`, as the pools see
//! them (a pool's own rows never share an address among its pools).

use std::borrow::Cow;
use std::collections::BTreeMap;

use foldhash::HashMap;
use serde::Serialize;

use super::attr::attr_fields;
use super::blocks::{Names, ATB};
use crate::vocab::EventType;

pub const MIB: u64 = 1 << 20;
/// torch_npu's large-pool segment: requests between 1 and 10 MiB share 20 MiB segments; a bigger
/// segment was made for one request of 10 MiB or more (kLargeBuffer).
pub const LARGE_SEGMENT: u64 = 20 * MIB;
/// torch_npu serves requests below this from shared 20 MiB segments (kMinLargeAlloc).
pub const SMALL_REQUEST: u64 = 10 * MIB;

/// Why a sample was taken.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// A step boundary (`SYSTEM`/`STEP`).
    Step,
    /// The first instant of the highest reserved bytes of the device.
    PeakReserved,
    /// Every N memory rows.
    Periodic,
    /// A failed allocation (an OOM incident of `ms_oom`).
    Oom,
    /// The end of the trace.
    #[default]
    End,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Step => "step",
            Self::PeakReserved => "peak_reserved",
            Self::Periodic => "periodic",
            Self::Oom => "oom",
            Self::End => "end",
        }
    }
}

/// The device's caching pools at one instant (all processes of the DB added up).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Sample {
    pub reason: Reason,
    pub ts_ns: i64,
    /// The step the sample falls in (the last `STEP` row's number), if any.
    pub step: Option<i64>,
    pub reserved: u64,
    pub allocated: u64,
    /// reserved − allocated.
    pub unused: u64,
    /// The largest free piece inside cached segments; `None` when the trace has no segment rows
    /// (msMemScope's DBs, or a pool whose segments predate an attach).
    pub largest_free: Option<u64>,
    pub free_pieces: u64,
    /// Free bytes inside segments that hold at least one live block (pinned, unlike a wholly
    /// free cached segment that can be reused or released as a whole).
    pub holes: u64,
    pub segments: u64,
    /// Splits so far (see the module doc).
    pub splits: u64,
    /// Processes with caching-pool memory.
    pub processes: u64,
}

attr_fields! {
    /// Attr values as Insight reads them: strings only; anything else reads as absent.
    pub(crate) struct Fields {
        pub size, pub owner, pub unmatched, pub shadow, pub pool, pub segment, pub vmm, pub total, pub func,
        pub req_size, pub status, pub ptr,
    }
}

impl Fields<'_> {
    pub fn flag(v: &Option<Cow<'_, str>>) -> bool {
        v.as_deref() == Some("true")
    }
    pub fn number(v: &Option<Cow<'_, str>>) -> Option<u64> {
        v.as_deref().and_then(parse_number)
    }
}

/// Decimal, or `0x` hex (addresses).
pub fn parse_number(s: &str) -> Option<u64> {
    let s = s.trim();
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
    }
}

/// A caching-pool segment, or a run of adjacent expandable-segment pages.
#[derive(Clone, Copy, Debug)]
struct Region {
    end: u64,
    vmm: bool,
    live: u32,
    live_bytes: u64,
    small_live: u32,
}

/// What a region adds to the process's running totals; recomputed around every change of it.
#[derive(Clone, Copy, Default)]
struct Contribution {
    holes: u64,
    pinned_big: u64,
}

impl Region {
    fn contribution(&self, start: u64) -> Contribution {
        let size = self.end - start;
        Contribution {
            holes: if self.live > 0 { size.saturating_sub(self.live_bytes) } else { 0 },
            pinned_big: u64::from(!self.vmm && size > LARGE_SEGMENT && self.small_live > 0),
        }
    }
}

/// Which pool a `PTA` block came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolKind {
    Caching,
    Workspace,
    Other,
}

/// A live block: a pool block (`PTA`), or device memory outside the pools (`HAL`).
#[derive(Clone, Copy, Debug)]
pub struct Live {
    pub size: u64,
    pub ts: i64,
    /// Index into `Pools::owners`.
    pub owner: u32,
    pub pool: Option<PoolKind>,
    /// Carved from a free piece of a known segment (so its free returns one).
    pub(crate) in_region: bool,
    /// A `HAL` block that is a pool's segment (its bytes are the pool's, not an owner's).
    pub segment: Option<PoolKind>,
}

/// One process's pools: its segments carved into blocks and free pieces, its pool blocks and
/// its device memory.
#[derive(Default)]
pub(crate) struct Proc {
    regions: BTreeMap<u64, Region>,
    gaps: BTreeMap<u64, u64>,
    gap_sizes: BTreeMap<u64, u32>,
    /// Pool blocks by address (every pool: `PTA`, `PTA_WORKSPACE`, `ATB`, `MINDSPORE`).
    pub blocks: BTreeMap<u64, Live>,
    /// `HAL` blocks by address, segments included.
    pub hal: HashMap<u64, Live>,
    pub hal_bytes: u64,
    segment_bytes: u64,
    pub seen_segments: bool,
    /// The last `total` a caching-pool row carried (the pool's own count, for DBs without
    /// segment rows).
    attr_total: u64,
    /// The caching pool's live block bytes.
    pub allocated: u64,
    holes: u64,
    /// Big segments (> 20 MiB, not expandable) holding a small block (< 10 MiB).
    pub pinned_big: u64,
    pub splits: u64,
    /// The process's highest reserved and device bytes, for fragmentation's per-process peaks.
    pub peak_reserved: u64,
    pub peak_device: u64,
}

impl Proc {
    /// The segments when they are seen (the rows' `total` may count other processes' segments
    /// on the device), else the pool's own count from the rows.
    pub fn reserved(&self) -> u64 {
        if self.seen_segments {
            self.segment_bytes
        } else {
            self.attr_total
        }
    }

    pub fn largest_free(&self) -> Option<u64> {
        self.seen_segments.then(|| self.gap_sizes.keys().next_back().copied().unwrap_or(0))
    }

    pub fn free_pieces(&self) -> u64 {
        self.gaps.len() as u64
    }

    pub fn holes(&self) -> u64 {
        self.holes
    }

    fn add_gap(&mut self, start: u64, end: u64) {
        if start < end {
            self.gaps.insert(start, end);
            *self.gap_sizes.entry(end - start).or_default() += 1;
        }
    }

    fn remove_gap(&mut self, start: u64) -> Option<u64> {
        let end = self.gaps.remove(&start)?;
        if let Some(n) = self.gap_sizes.get_mut(&(end - start)) {
            *n -= 1;
            if *n == 0 {
                self.gap_sizes.remove(&(end - start));
            }
        }
        Some(end)
    }

    fn region_at(&self, start: u64, end: u64) -> Option<(u64, Region)> {
        self.regions.range(..=start).next_back().filter(|(_, r)| r.end >= end).map(|(&s, &r)| (s, r))
    }

    fn put_region(&mut self, start: u64, region: Region) {
        let c = region.contribution(start);
        self.holes += c.holes;
        self.pinned_big += c.pinned_big;
        self.regions.insert(start, region);
    }

    fn take_region(&mut self, start: u64) -> Option<Region> {
        let region = self.regions.remove(&start)?;
        let c = region.contribution(start);
        self.holes -= c.holes;
        self.pinned_big -= c.pinned_big;
        Some(region)
    }

    pub(crate) fn segment_added(&mut self, ptr: u64, size: u64, vmm: bool) {
        let end = ptr + size;
        self.seen_segments = true;
        self.segment_bytes += size;
        // A segment over a known one means a free was missed: the old one is gone.
        while let Some((&s, r)) = self.regions.range(..end).next_back() {
            if r.end <= ptr {
                break;
            }
            let gone = r.end - s;
            self.drop_range(s, r.end);
            self.segment_bytes -= gone.min(self.segment_bytes);
        }
        let mut region = Region { end, vmm, live: 0, live_bytes: 0, small_live: 0 };
        let mut start = ptr;
        let mut free_start = ptr;
        let mut free_end = end;
        if vmm {
            // Pages of one expandable segment are one range to the allocator: blocks and free
            // pieces run across page boundaries.
            if let Some((&ps, pr)) = self.regions.range(..ptr).next_back() {
                if pr.vmm && pr.end == ptr {
                    let prev = self.take_region(ps).unwrap();
                    start = ps;
                    region.live += prev.live;
                    region.live_bytes += prev.live_bytes;
                    region.small_live += prev.small_live;
                    if let Some((&gs, &ge)) = self.gaps.range(..ptr).next_back() {
                        if ge == ptr && gs >= ps {
                            self.remove_gap(gs);
                            free_start = gs;
                        }
                    }
                }
            }
            if self.regions.get(&end).is_some_and(|r| r.vmm) {
                let next = self.take_region(end).unwrap();
                region.end = next.end;
                region.live += next.live;
                region.live_bytes += next.live_bytes;
                region.small_live += next.small_live;
                if let Some(ge) = self.remove_gap(end) {
                    free_end = ge;
                }
            }
        }
        self.put_region(start, region);
        self.add_gap(free_start, free_end);
    }

    /// Removes [start, end) from the known segments (a segment freed, a page unmapped); what is
    /// left of its region on either side stays, with its blocks recounted.
    pub(crate) fn drop_range(&mut self, start: u64, end: u64) {
        let Some((rs, region)) = self.regions.range(..end).next_back().map(|(&s, &r)| (s, r)) else { return };
        if region.end <= start {
            return;
        }
        self.take_region(rs);
        let overlapping: Vec<(u64, u64)> =
            self.gaps.range(..end).rev().take_while(|(_, &e)| e > start).map(|(&s, &e)| (s, e)).collect();
        for (gs, ge) in overlapping {
            self.remove_gap(gs);
            self.add_gap(gs, start.max(gs).min(ge));
            self.add_gap(end.max(gs).min(ge), ge);
        }
        for (s, e) in [(rs, start.max(rs)), (end.min(region.end), region.end)] {
            if s >= e {
                continue;
            }
            let mut part = Region { end: e, vmm: region.vmm, live: 0, live_bytes: 0, small_live: 0 };
            for (_, b) in self.blocks.range(s..e).filter(|(_, b)| b.in_region) {
                part.live += 1;
                part.live_bytes += b.size;
                part.small_live += u32::from(b.size < SMALL_REQUEST);
            }
            self.put_region(s, part);
        }
        // Blocks still inside the removed range no longer belong to a known segment.
        let inside: Vec<u64> = self.blocks.range(start..end).map(|(&p, _)| p).collect();
        for p in inside {
            if let Some(b) = self.blocks.get_mut(&p) {
                b.in_region = false;
            }
        }
    }

    pub(crate) fn segment_removed(&mut self, ptr: u64, size: u64) {
        self.segment_bytes -= size.min(self.segment_bytes);
        self.drop_range(ptr, ptr + size);
    }

    /// Carves a caching block out of its free piece; returns whether it did (and whether that
    /// was a split).
    pub(crate) fn carve(&mut self, ptr: u64, size: u64) -> (bool, bool) {
        let end = ptr + size;
        let Some((rs, _)) = self.region_at(ptr, end) else { return (false, false) };
        let Some((gs, ge)) = self.gaps.range(..=ptr).next_back().map(|(&s, &e)| (s, e)).filter(|&(_, e)| e >= end)
        else {
            return (false, false);
        };
        self.remove_gap(gs);
        self.add_gap(gs, ptr);
        self.add_gap(end, ge);
        let mut region = self.take_region(rs).unwrap();
        region.live += 1;
        region.live_bytes += size;
        region.small_live += u32::from(size < SMALL_REQUEST);
        self.put_region(rs, region);
        let split = gs < ptr || end < ge;
        self.splits += u64::from(split);
        (true, split)
    }

    /// Returns a carved block's bytes to its region as a free piece, joined with free neighbours
    /// of the same region.
    pub(crate) fn uncarve(&mut self, ptr: u64, size: u64) {
        let end = ptr + size;
        let Some((rs, _)) = self.region_at(ptr, end) else { return };
        let mut region = self.take_region(rs).unwrap();
        region.live = region.live.saturating_sub(1);
        region.live_bytes = region.live_bytes.saturating_sub(size);
        region.small_live = region.small_live.saturating_sub(u32::from(size < SMALL_REQUEST));
        let mut start = ptr;
        let mut stop = end;
        if let Some((&gs, &ge)) = self.gaps.range(..ptr).next_back() {
            if ge == ptr && gs >= rs {
                self.remove_gap(gs);
                start = gs;
            }
        }
        if self.gaps.get(&end).is_some_and(|&ge| ge <= region.end) {
            stop = self.remove_gap(end).unwrap();
        }
        self.add_gap(start, stop);
        self.put_region(rs, region);
    }

    /// The smallest big segment held by small blocks.
    pub(crate) fn pinned_big_min(&self) -> u64 {
        self.regions
            .iter()
            .filter(|(&s, r)| r.contribution(s).pinned_big > 0)
            .map(|(&s, r)| r.end - s)
            .min()
            .unwrap_or(0)
    }
}

impl Proc {
    pub(crate) fn release(&mut self, ptr: u64, block: &Live) {
        if block.pool == Some(PoolKind::Caching) {
            self.allocated -= block.size.min(self.allocated);
            if block.in_region {
                self.uncarve(ptr, block.size);
            }
        }
    }

    /// A `HAL` MALLOC: a MALLOC over a live block there ends it (and the segment it was).
    pub(crate) fn hal_malloc(&mut self, ptr: u64, block: Live) {
        if let Some(old) = self.hal.insert(ptr, block) {
            self.hal_bytes -= old.size.min(self.hal_bytes);
            if old.segment == Some(PoolKind::Caching) {
                self.segment_removed(ptr, old.size);
            }
        }
        self.hal_bytes += block.size;
    }

    /// A `HAL` FREE: the block it ended, if one was live (its segment is still counted: the caller
    /// removes it once it has looked at the pool before).
    pub(crate) fn hal_free(&mut self, ptr: u64) -> Option<Live> {
        let old = self.hal.remove(&ptr)?;
        self.hal_bytes -= old.size.min(self.hal_bytes);
        Some(old)
    }

    /// A pool MALLOC: a caching block is carved from its segment's free piece; `total` is the
    /// pool's own count the row carries.
    pub(crate) fn block_malloc(&mut self, ptr: u64, mut block: Live, total: Option<u64>) {
        if let Some(old) = self.blocks.remove(&ptr) {
            self.release(ptr, &old);
        }
        if block.pool == Some(PoolKind::Caching) {
            self.allocated += block.size;
            if let Some(total) = total {
                self.attr_total = total;
            }
            block.in_region = self.carve(ptr, block.size).0;
        }
        self.blocks.insert(ptr, block);
    }

    /// A pool FREE.
    pub(crate) fn block_free(&mut self, ptr: u64) {
        if let Some(old) = self.blocks.remove(&ptr) {
            self.release(ptr, &old);
        }
    }
}

/// The device's pools: every process's, the owner names of their blocks, and what the trace says
/// of the device.
#[derive(Default)]
pub(crate) struct Pools {
    pub procs: HashMap<i64, Proc>,
    pub owners: Names,
    /// The last `STEP` row's number.
    pub step: Option<i64>,
    /// The device's memory, when the trace says (msMemScope's START_TRACE `total`).
    pub capacity: Option<u64>,
}

impl Pools {
    /// The device's pools now.
    pub fn sample(&self, ts_ns: i64, reason: Reason) -> Sample {
        let mut s = Sample { reason, ts_ns, step: self.step, ..Sample::default() };
        let mut any_segments = false;
        for p in self.procs.values() {
            let reserved = p.reserved();
            if reserved == 0 && p.allocated == 0 {
                continue;
            }
            s.processes += 1;
            s.reserved += reserved;
            s.allocated += p.allocated;
            s.unused += reserved.saturating_sub(p.allocated);
            s.free_pieces += p.free_pieces();
            s.holes += p.holes;
            s.segments += p.regions.len() as u64;
            if let Some(l) = p.largest_free() {
                any_segments = true;
                s.largest_free = Some(s.largest_free.unwrap_or(0).max(l));
            }
        }
        if !any_segments {
            s.largest_free = None;
        }
        s.splits = self.procs.values().map(|p| p.splits).sum();
        s
    }
}

/// Whose memory a row's block is, as the pools see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Memory {
    /// Device memory from the runtime or driver (`HAL`), a pool's segment or not.
    Device,
    /// A block of one of the framework's pools.
    Pool(PoolKind),
    /// Host memory: not the device's.
    Host,
}

impl Memory {
    /// From a memory row's `Event Type` and its Attr `pool`.
    pub(crate) fn of(event_type: &str, pool: Option<&str>) -> Self {
        match EventType::parse(event_type) {
            Some(EventType::Hal) => Self::Device,
            Some(EventType::Pta) => Self::Pool(match pool {
                None | Some("caching") => PoolKind::Caching,
                Some("workspace") => PoolKind::Workspace,
                Some(_) => PoolKind::Other,
            }),
            Some(EventType::PtaWorkspace) => Self::Pool(PoolKind::Workspace),
            Some(EventType::Mindspore) => Self::Pool(PoolKind::Other),
            None if event_type == ATB => Self::Pool(PoolKind::Other),
            _ => Self::Host,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A naive model of one process's segments and blocks, recomputed from scratch: what the
    /// incremental structures must always agree with.
    #[derive(Default)]
    struct Naive {
        /// (start, end, vmm) of every segment or page, as taken.
        segments: Vec<(u64, u64, bool)>,
        blocks: BTreeMap<u64, u64>,
    }

    impl Naive {
        /// Regions: segments, with adjacent expandable pages joined.
        fn regions(&self) -> Vec<(u64, u64)> {
            let mut s = self.segments.clone();
            s.sort();
            let mut out: Vec<(u64, u64, bool)> = Vec::new();
            for (a, b, vmm) in s {
                match out.last_mut() {
                    Some(last) if vmm && last.2 && last.1 == a => last.1 = b,
                    _ => out.push((a, b, vmm)),
                }
            }
            out.into_iter().map(|(a, b, _)| (a, b)).collect()
        }

        fn pieces(&self) -> Vec<(u64, u64)> {
            let mut out = Vec::new();
            for (a, b) in self.regions() {
                let mut at = a;
                for (&p, &n) in self.blocks.range(a..b) {
                    if p > at {
                        out.push((at, p));
                    }
                    at = p + n;
                }
                if at < b {
                    out.push((at, b));
                }
            }
            out
        }

        fn holes(&self) -> u64 {
            self.regions()
                .iter()
                .map(|&(a, b)| {
                    let used: u64 = self.blocks.range(a..b).map(|(_, n)| n).sum();
                    if self.blocks.range(a..b).next().is_some() {
                        (b - a) - used
                    } else {
                        0
                    }
                })
                .sum()
        }
    }

    #[test]
    fn incremental_free_pieces_agree_with_a_naive_recount() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut rand = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n.max(1)
        };
        for round in 0..40 {
            let mut proc = Proc::default();
            let mut naive = Naive::default();
            let mut splits = 0;
            for _ in 0..400 {
                match rand(10) {
                    // A segment or an expandable page, at a free, 64-aligned place (pages often
                    // next to each other).
                    0 | 1 => {
                        let vmm = round % 2 == 1 && rand(2) == 0;
                        let start = rand(32) * 64;
                        let size = if vmm { 64 } else { 16 + rand(49) };
                        let end = start + size;
                        if naive.segments.iter().all(|&(a, b, _)| end <= a || start >= b) {
                            naive.segments.push((start, end, vmm));
                            proc.segment_added(start, size, vmm);
                        }
                    }
                    // A block carved from a free piece.
                    2..=5 => {
                        let pieces = naive.pieces();
                        if pieces.is_empty() {
                            continue;
                        }
                        let (a, b) = pieces[rand(pieces.len() as u64) as usize];
                        let at = a + rand(b - a);
                        let size = 1 + rand(b - at);
                        naive.blocks.insert(at, size);
                        splits += u64::from(at > a || at + size < b);
                        assert!(proc.carve(at, size).0);
                        proc.blocks.insert(
                            at,
                            Live {
                                size,
                                ts: 0,
                                owner: 0,
                                pool: Some(PoolKind::Caching),
                                in_region: true,
                                segment: None,
                            },
                        );
                    }
                    // A block freed.
                    6..=8 => {
                        if naive.blocks.is_empty() {
                            continue;
                        }
                        let i = rand(naive.blocks.len() as u64) as usize;
                        let (&p, &n) = naive.blocks.iter().nth(i).unwrap();
                        naive.blocks.remove(&p);
                        proc.blocks.remove(&p);
                        proc.uncarve(p, n);
                    }
                    // A segment or page with no block in it given back.
                    _ => {
                        let free: Vec<usize> = (0..naive.segments.len())
                            .filter(|&i| {
                                let (a, b, _) = naive.segments[i];
                                // No block overlaps it (one may span pages of an expandable range).
                                naive.blocks.range(..b).next_back().is_none_or(|(&p, &n)| p + n <= a)
                            })
                            .collect();
                        if free.is_empty() {
                            continue;
                        }
                        let (a, b, _) = naive.segments.remove(free[rand(free.len() as u64) as usize]);
                        proc.segment_removed(a, b - a);
                    }
                }
                let pieces = naive.pieces();
                let got: Vec<(u64, u64)> = proc.gaps.iter().map(|(&a, &b)| (a, b)).collect();
                assert_eq!(got, pieces, "round {round}");
                assert_eq!(proc.largest_free(), Some(pieces.iter().map(|(a, b)| b - a).max().unwrap_or(0)));
                assert_eq!(proc.holes, naive.holes(), "round {round}");
                assert_eq!(proc.regions.len(), naive.regions().len());
                assert_eq!(proc.splits, splits);
            }
        }
    }

    #[test]
    fn numbers_parse_as_the_tracer_writes_them() {
        assert_eq!(parse_number("4096"), Some(4096));
        assert_eq!(parse_number("0x00007f0000001000"), Some(0x7f00_0000_1000));
        assert_eq!(parse_number("N/A"), None);
        assert_eq!(parse_number("-1"), None);
    }
}
