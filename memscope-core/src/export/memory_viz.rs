//! `export --format memory-viz`: one device's DB as the snapshot `torch.cuda.memory._snapshot()`
//! returns — `segments` (the pool's segments live at the end, each tiled exactly by its blocks,
//! live or free) and `device_traces` (every allocator event in time order) — pickled as PyTorch
//! pickles it, so PyTorch's memory_viz page and `_memory_viz.py` (`segsum`, `trace`,
//! `segment_plot`, `trace_plot`) open an Ascend trace as they open a CUDA one. The pickle is
//! protocol 4, as PyTorch's own snapshots are.
//!
//! What maps to what: torch_npu's segments are the `HAL` MALLOC rows its allocator made inside
//! its own call (Attr `segment`; expandable-segment pages, `vmm`, are `segment_map`s merged with
//! their neighbours as PyTorch merges them); its blocks are the `PTA` rows (`alloc`, and a free
//! as `free_requested` then `free_completed`); an `OOM_TRIGGER` is an `oom`. The shadow frees a
//! trace writes at its stop for blocks still alive are not frees: those blocks are live in the
//! final segments. Blocks inside segments taken before the trace started (an attach) would have
//! no segment to sit in, and a snapshot reader that replays the trace from the final segments
//! backwards (Insight's MemSnapDump) stops at the first: so each run of such blocks' addresses
//! gets a segment made up of them, live through the whole trace (no `segment_alloc`), counted in
//! [`Summary::pretrace_segments`]; its real size is not known. Each entry's, block's and
//! segment's `frames` are its row's call stacks when the trace recorded them (`trace --call-stack
//! c,python`; [`super::frames`]), else empty.

use std::collections::BTreeMap;
use std::io::Write;

use serde::Serialize;

use crate::analysis::blocks::parse_ptr;
use crate::analysis::db::{DumpDb, Fed, Selection};
use crate::analysis::AnalysisError;
use crate::vocab::{Event, EventType};

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error(transparent)]
    Db(#[from] AnalysisError),
    #[error("cannot pickle the snapshot")]
    Pickle(#[from] serde_pickle::Error),
    #[error("cannot write the snapshot")]
    Write(#[from] std::io::Error),
}

crate::analysis::attr::attr_fields! {
    struct Fields { size, req_size, segment, vmm, shadow, pool }
}

use super::frames::{Frame, Stacks};

/// An entry of `device_traces[device]`.
#[derive(Clone, Debug, Serialize)]
pub struct TraceEntry {
    pub action: &'static str,
    /// 0 on `oom` entries, which PyTorch writes without it (they carry `device_free`): Insight's
    /// MemSnapDump reads `addr` of every entry and refuses a snapshot where one lacks it, and
    /// `_memory_viz.py` never reads an `oom` entry's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub addr: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_free: Option<u64>,
    pub size: u64,
    pub stream: u64,
    pub time_us: i64,
    frames: Vec<Frame>,
    /// The row it comes from, whose stack becomes `frames`.
    #[serde(skip)]
    row: i64,
}

#[derive(Clone, Debug, Serialize)]
struct Block {
    address: u64,
    size: u64,
    requested_size: u64,
    state: &'static str,
    frames: Vec<Frame>,
    /// The MALLOC row of an allocated block (0 for a free piece).
    #[serde(skip)]
    row: i64,
}

#[derive(Clone, Debug, Serialize)]
struct Segment {
    device: u32,
    address: u64,
    total_size: u64,
    allocated_size: u64,
    active_size: u64,
    requested_size: u64,
    stream: u64,
    segment_type: &'static str,
    segment_pool_id: (u64, u64),
    is_expandable: bool,
    frames: Vec<Frame>,
    blocks: Vec<Block>,
    #[serde(skip)]
    row: i64,
}

#[derive(Serialize)]
struct Snapshot {
    segments: Vec<Segment>,
    device_traces: Vec<Vec<TraceEntry>>,
    allocator_settings: BTreeMap<String, String>,
}

/// What the export holds, for the verb's summary line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    pub entries: usize,
    pub segments: usize,
    /// Blocks live at the end, and their requested bytes (what memory_viz counts as allocated).
    pub live_blocks: usize,
    pub live_requested: u64,
    /// Live blocks outside every segment, made up ones included (only where a made-up segment
    /// would overlap one the trace saw taken).
    pub outside: usize,
    /// Segments made up for blocks whose own segment predates the trace.
    pub pretrace_segments: usize,
    /// Entries with frames (their rows have call stacks: `trace --call-stack`).
    pub with_frames: usize,
}

/// A pool block live now, by (process, address).
#[derive(Clone, Copy)]
struct LiveBlock {
    size: u64,
    requested: u64,
    row: i64,
}

/// A segment live now, by (process, address).
#[derive(Clone, Copy)]
struct LiveSegment {
    size: u64,
    expandable: bool,
    row: i64,
}

/// Where a run of addresses lies: (process, start, end).
type Extent = (i64, u64, u64);

/// What a pending shadow free took away.
#[derive(Clone, Copy)]
enum Freed {
    Block(LiveBlock),
    Segment(LiveSegment),
}

/// The replay: the trace as it is built, and the pool as it stands.
#[derive(Default)]
struct Replay {
    trace: Vec<TraceEntry>,
    blocks: BTreeMap<(i64, u64), LiveBlock>,
    segments: BTreeMap<(i64, u64), LiveSegment>,
    /// Shadow frees (the trace's stop, or a free never seen) by (process, address, is a
    /// segment): where their entries start in `trace`, and what they freed. Kept out of the
    /// trace and restored at the end unless a later allocation at the address shows the block
    /// was really freed before.
    shadows: BTreeMap<(i64, u64, bool), (usize, Freed)>,
    /// Blocks allocated where no segment the trace saw taken was live.
    orphans: Vec<Extent>,
    /// Every segment the trace saw taken.
    taken: Vec<Extent>,
}

impl Replay {
    fn entry(&mut self, action: &'static str, addr: u64, size: u64, (ts_ns, row): (i64, i64)) {
        let frames = Vec::new();
        let time_us = ts_ns / 1000;
        let entry = TraceEntry { action, addr: Some(addr), device_free: None, size, stream: 0, time_us, frames, row };
        self.trace.push(entry);
    }

    /// A new block or segment at an address whose shadow free is pending: that free was real,
    /// and its entries stay in the trace.
    fn confirm(&mut self, key: (i64, u64, bool)) {
        self.shadows.remove(&key);
    }

    fn row(&mut self, event: &str, event_type: &str, pid: i64, (ts, row): (i64, i64), ptr: u64, f: &Fields<'_>) {
        let num = |v: &Option<std::borrow::Cow<'_, str>>| v.as_deref().and_then(|s| s.parse::<u64>().ok());
        let shadow = f.shadow.as_deref() == Some("true");
        let is = |e: Event| event == e.as_str();
        if event_type == EventType::Hal.as_str() {
            let segment = f.segment.is_some();
            let expandable = f.vmm.as_deref() == Some("true");
            if is(Event::Malloc) && segment {
                let size = num(&f.size).unwrap_or(0);
                self.confirm((pid, ptr, true));
                self.segments.insert((pid, ptr), LiveSegment { size, expandable, row });
                self.taken.push((pid, ptr, ptr + size));
                self.entry(if expandable { "segment_map" } else { "segment_alloc" }, ptr, size, (ts, row));
            } else if is(Event::Free) {
                if let Some(seg) = self.segments.remove(&(pid, ptr)) {
                    let at = self.trace.len();
                    self.entry(if seg.expandable { "segment_unmap" } else { "segment_free" }, ptr, seg.size, (ts, row));
                    if shadow {
                        self.shadows.insert((pid, ptr, true), (at, Freed::Segment(seg)));
                    }
                }
            }
        } else if event_type == EventType::Pta.as_str() {
            if is(Event::Malloc) {
                let size = num(&f.size).unwrap_or(0);
                let requested = num(&f.req_size).unwrap_or(size);
                self.confirm((pid, ptr, false));
                if !self.in_segment(pid, ptr) {
                    self.orphans.push((pid, ptr, ptr + size));
                }
                self.blocks.insert((pid, ptr), LiveBlock { size, requested, row });
                // PyTorch's trace entries carry the size asked for (`alloc`: the request; the
                // frees: the block's requested size), not the block's.
                self.entry("alloc", ptr, requested, (ts, row));
            } else if is(Event::Free) {
                if let Some(block) = self.blocks.remove(&(pid, ptr)) {
                    let at = self.trace.len();
                    self.entry("free_requested", ptr, block.requested, (ts, row));
                    self.entry("free_completed", ptr, block.requested, (ts, row));
                    if shadow {
                        self.shadows.insert((pid, ptr, false), (at, Freed::Block(block)));
                    }
                }
            }
        } else if event == Event::OomDetail.as_str() && event_type == EventType::OomTrigger.as_str() {
            let size = num(&f.req_size).unwrap_or(0);
            let time_us = ts / 1000;
            let entry = TraceEntry {
                action: "oom",
                addr: Some(0),
                device_free: Some(0),
                size,
                stream: 0,
                time_us,
                frames: Vec::new(),
                row,
            };
            self.trace.push(entry);
        }
    }

    /// Whether a live segment holds the address.
    fn in_segment(&self, pid: i64, addr: u64) -> bool {
        let before = self.segments.range((pid, 0)..=(pid, addr)).next_back();
        before.is_some_and(|(&(_, start), seg)| addr < start + seg.size)
    }

    /// Segments for the blocks allocated outside every known one: each run of their touching or
    /// overlapping addresses, unless it overlaps a segment the trace saw taken (then the blocks
    /// stay outside, as the trace cannot tell what was where). Returns how many were made.
    fn make_up_pretrace_segments(&mut self) -> usize {
        let mut runs: Vec<Extent> = Vec::new();
        self.orphans.sort_unstable();
        for &(pid, start, end) in &self.orphans {
            match runs.last_mut() {
                Some(last) if last.0 == pid && start <= last.2 => last.2 = last.2.max(end),
                _ => runs.push((pid, start, end)),
            }
        }
        let overlaps = |&(pid, start, end): &Extent, other: &Extent| pid == other.0 && start < other.2 && other.1 < end;
        let mut made = 0;
        for run in runs.iter().filter(|run| !self.taken.iter().any(|t| overlaps(run, t))) {
            let seg = LiveSegment { size: run.2 - run.1, expandable: false, row: 0 };
            self.segments.insert((run.0, run.1), seg);
            made += 1;
        }
        made
    }

    /// The shadow frees no later allocation confirmed: their blocks and segments were alive at
    /// the stop, so they are live again and their entries leave the trace.
    fn settle(&mut self) {
        let mut drop = Vec::new();
        for ((pid, addr, _), (at, freed)) in std::mem::take(&mut self.shadows) {
            match freed {
                Freed::Segment(seg) => {
                    self.segments.insert((pid, addr), seg);
                    drop.push(at);
                }
                Freed::Block(block) => {
                    self.blocks.insert((pid, addr), block);
                    drop.extend([at, at + 1]);
                }
            }
        }
        drop.sort_unstable();
        let mut next = drop.iter().peekable();
        let mut i = 0;
        self.trace.retain(|_| {
            let keep = next.peek().is_none_or(|d| **d != i);
            if !keep {
                next.next();
            }
            i += 1;
            keep
        });
    }
}

/// Reads `db` (one device's) and returns the snapshot's parts, with how many segments were made
/// up for blocks whose own predates the trace.
fn replay(db: &DumpDb) -> Result<(Replay, usize), ExportError> {
    let events = [Event::Malloc.as_str(), Event::Free.as_str(), Event::OomDetail.as_str()];
    let mut replay = Replay::default();
    db.rows(Selection { events: &events, name: false, thread: false })?.for_each_row(|fed| match fed {
        Fed::Restart => replay = Replay::default(),
        Fed::Row(row) => {
            let Some(ptr) = parse_ptr(row.ptr).or(Some(0)) else { return };
            let Some(fields) = Fields::parse(row.attr) else { return };
            replay.row(row.event, row.event_type, row.pid, (row.ts, row.rowid), ptr, &fields);
        }
    })?;
    replay.settle();
    let made_up = replay.make_up_pretrace_segments();
    Ok((replay, made_up))
}

/// Merges touching expandable ranges of a process into one segment, as PyTorch's expandable
/// segments are one range it maps pages into.
fn merged(segments: &BTreeMap<(i64, u64), LiveSegment>) -> Vec<(i64, u64, LiveSegment)> {
    let mut out: Vec<(i64, u64, LiveSegment)> = Vec::new();
    for (&(pid, addr), seg) in segments {
        if let Some(last) = out.last_mut() {
            let touches = last.0 == pid && last.1 + last.2.size == addr;
            if touches && last.2.expandable && seg.expandable {
                last.2.size += seg.size;
                continue;
            }
        }
        out.push((pid, addr, *seg));
    }
    out
}

/// The live segments, each tiled by its live blocks and the free pieces between them.
fn segments(replay: &Replay, device: u32, summary: &mut Summary) -> Vec<Segment> {
    let mut out = Vec::new();
    let mut inside = 0;
    for (pid, address, seg) in merged(&replay.segments) {
        let end = address + seg.size;
        let mut blocks = Vec::new();
        let (mut at, mut allocated, mut requested) = (address, 0, 0);
        for (&(_, addr), block) in replay.blocks.range((pid, address)..(pid, end)) {
            if addr < at || addr + block.size > end {
                continue; // overlapping what is placed already: not a layout PyTorch could have
            }
            if addr > at {
                blocks.push(Block {
                    address: at,
                    size: addr - at,
                    requested_size: 0,
                    state: "inactive",
                    frames: vec![],
                    row: 0,
                });
            }
            blocks.push(Block {
                address: addr,
                size: block.size,
                requested_size: block.requested.min(block.size),
                state: "active_allocated",
                frames: Vec::new(),
                row: block.row,
            });
            (at, allocated, requested) =
                (addr + block.size, allocated + block.size, requested + block.requested.min(block.size));
            inside += 1;
        }
        if at < end {
            let (size, state) = (end - at, "inactive");
            blocks.push(Block { address: at, size, requested_size: 0, state, frames: vec![], row: 0 });
        }
        out.push(Segment {
            device,
            address,
            total_size: seg.size,
            allocated_size: allocated,
            active_size: allocated,
            requested_size: requested,
            stream: 0,
            segment_type: if seg.size <= 2 << 20 && !seg.expandable { "small" } else { "large" },
            segment_pool_id: (0, 0),
            is_expandable: seg.expandable,
            frames: Vec::new(),
            blocks,
            row: seg.row,
        });
    }
    summary.outside = replay.blocks.len() - inside;
    out
}

/// serde-pickle writes protocol 3 (`PROTO 3` first). Every opcode of protocol 3 is one of
/// protocol 4's, whose framing is optional (PEP 3154: an unpickler reads unframed opcodes as
/// they come), so the same stream under `PROTO 4` is a protocol-4 pickle: the version
/// `torch.cuda.memory._dump_snapshot` writes. This writer changes that one byte.
struct Protocol4<'a, W: Write> {
    out: &'a mut W,
    at: u64,
}

impl<W: Write> Write for Protocol4<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = if self.at < 2 && self.at + buf.len() as u64 >= 2 {
            let i = (1 - self.at) as usize;
            let mut head = buf[..=i].to_vec();
            if head[i] == 3 && (i == 0 || head[0] == 0x80) {
                head[i] = 4;
            }
            self.out.write_all(&head)?;
            head.len()
        } else {
            self.out.write(buf)?
        };
        self.at += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

/// Writes `db` (the DB of one device, `device`) to `out` as a memory_viz snapshot.
pub fn export(db: &DumpDb, device: u32, out: &mut impl Write) -> Result<Summary, ExportError> {
    let (replay, pretrace_segments) = replay(db)?;
    let mut summary = Summary {
        pretrace_segments,
        entries: replay.trace.len(),
        live_blocks: replay.blocks.len(),
        live_requested: replay.blocks.values().map(|b| b.requested.min(b.size)).sum(),
        ..Summary::default()
    };
    let mut segments = segments(&replay, device, &mut summary);
    summary.segments = segments.len();
    let mut trace = replay.trace;
    let stacks = Stacks::read(db)?;
    if !stacks.is_empty() {
        trace.iter_mut().for_each(|e| e.frames = stacks.of(e.row));
        for s in &mut segments {
            s.frames = stacks.of(s.row);
            s.blocks.iter_mut().filter(|b| b.row != 0).for_each(|b| b.frames = stacks.of(b.row));
        }
        summary.with_frames = trace.iter().filter(|e| !e.frames.is_empty()).count();
    }
    let mut device_traces: Vec<Vec<TraceEntry>> = (0..device).map(|_| Vec::new()).collect();
    device_traces.push(trace);
    let snapshot = Snapshot { segments, device_traces, allocator_settings: BTreeMap::new() };
    serde_pickle::to_writer(&mut Protocol4 { out, at: 0 }, &snapshot, serde_pickle::SerOptions::new())?;
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::testdb::{dir, TestDb};
    use crate::store::Attr;

    const SEG: u64 = 0x1000_0000;

    fn segment(db: &mut TestDb, ts: i64, ptr: u64, size: u64) {
        let attr = Attr::new().addr("addr", ptr).with("size", size).with("segment", "caching");
        db.row("MALLOC", "HAL", ts, 1, Some(ptr), attr);
    }

    fn block(db: &mut TestDb, ts: i64, ptr: u64, size: u64, req: u64) {
        let attr = Attr::new().addr("addr", ptr).with("size", size).with("req_size", req).with("pool", "caching");
        db.row("MALLOC", "PTA", ts, 1, Some(ptr), attr);
    }

    fn replayed(db: &TestDb) -> (Replay, Vec<Segment>, Summary) {
        let (replay, pretrace_segments) = replay(&DumpDb::open_read(&db.path).unwrap()).unwrap();
        let mut summary = Summary { pretrace_segments, ..Summary::default() };
        let segments = segments(&replay, 0, &mut summary);
        (replay, segments, summary)
    }

    #[test]
    fn blocks_tile_their_segment_and_a_stop_s_shadow_free_is_not_a_free() {
        let mut db = TestDb::create(&dir("mv-tile").join("d.db"));
        segment(&mut db, 10, SEG, 4096);
        block(&mut db, 20, SEG, 1024, 1000);
        block(&mut db, 30, SEG + 2048, 512, 500);
        block(&mut db, 40, SEG + 3072, 512, 512);
        db.free("PTA", 50, SEG + 3072);
        // The stop: shadow frees for what is alive, the segment included.
        db.free_marked("PTA", 90, SEG, "shadow");
        db.free_marked("PTA", 90, SEG + 2048, "shadow");
        db.free_marked("HAL", 91, SEG, "shadow");
        let (replay, segments, summary) = replayed(&db);
        let actions: Vec<&str> = replay.trace.iter().map(|e| e.action).collect();
        assert_eq!(
            actions,
            ["segment_alloc", "alloc", "alloc", "alloc", "free_requested", "free_completed"],
            "the stop's shadow frees are not in the trace"
        );
        assert_eq!(segments.len(), 1);
        let layout: Vec<(u64, u64, &str)> =
            segments[0].blocks.iter().map(|b| (b.address - SEG, b.size, b.state)).collect();
        assert_eq!(
            layout,
            [
                (0, 1024, "active_allocated"),
                (1024, 1024, "inactive"),
                (2048, 512, "active_allocated"),
                (2560, 1536, "inactive")
            ]
        );
        assert_eq!(segments[0].blocks.iter().map(|b| b.size).sum::<u64>(), segments[0].total_size);
        assert_eq!((segments[0].allocated_size, segments[0].requested_size), (1536, 1500));
        assert_eq!(summary.outside, 0);
    }

    #[test]
    fn a_shadow_free_followed_by_a_reuse_of_the_address_was_a_free() {
        let mut db = TestDb::create(&dir("mv-reuse").join("d.db"));
        segment(&mut db, 10, SEG, 4096);
        block(&mut db, 20, SEG, 1024, 1024);
        // Its free was never seen: the allocator handed the address out again.
        db.free_marked("PTA", 30, SEG, "shadow");
        block(&mut db, 30, SEG, 2048, 2048);
        let (replay, segments, _) = replayed(&db);
        let actions: Vec<&str> = replay.trace.iter().map(|e| e.action).collect();
        assert_eq!(actions, ["segment_alloc", "alloc", "free_requested", "free_completed", "alloc"]);
        assert_eq!(segments[0].blocks[0].size, 2048);
    }

    #[test]
    fn expandable_pages_merge_into_one_segment_and_blocks_without_one_get_one_made_up() {
        let mut db = TestDb::create(&dir("mv-vmm").join("d.db"));
        for (i, ts) in [(0u64, 10), (1, 11)] {
            let ptr = SEG + i * 2048;
            let attr =
                Attr::new().addr("addr", ptr).with("size", 2048u64).with("segment", "caching").with("vmm", "true");
            db.row("MALLOC", "HAL", ts, 1, Some(ptr), attr);
        }
        block(&mut db, 20, SEG + 1024, 2048, 2048); // across the two pages
                                                    // In a segment taken before the trace: two blocks side by side, and one freed since.
        block(&mut db, 21, 0x9000_0000, 64, 64);
        block(&mut db, 22, 0x9000_0040, 64, 64);
        block(&mut db, 23, 0x9000_1000, 512, 512);
        db.row("FREE", "PTA", 24, 1, Some(0x9000_1000), Attr::new());
        let (replay, segments, summary) = replayed(&db);
        assert_eq!(replay.trace[0].action, "segment_map");
        assert_eq!(segments.len(), 3);
        assert!(segments[0].is_expandable && segments[0].total_size == 4096);
        assert_eq!(segments[0].blocks.iter().filter(|b| b.state == "active_allocated").count(), 1);
        // Made up: live through the trace (no segment_alloc), tiled by the blocks seen in it.
        let made: Vec<(u64, u64, usize)> = segments[1..]
            .iter()
            .map(|s| (s.address, s.total_size, s.blocks.iter().filter(|b| b.state == "active_allocated").count()))
            .collect();
        assert_eq!(made, [(0x9000_0000, 128, 2), (0x9000_1000, 512, 0)]);
        let segment_entries: Vec<&str> =
            replay.trace.iter().filter(|e| e.action.starts_with("segment")).map(|e| e.action).collect();
        assert_eq!(segment_entries, ["segment_map", "segment_map"], "the two pages, nothing of the made-up ones");
        assert_eq!((summary.outside, summary.pretrace_segments), (0, 2));
    }

    /// A block seen before a segment the trace saw taken at its address (the old segment freed
    /// unseen, a new one taken there) gets no made-up segment: it would overlap the new one.
    #[test]
    fn no_segment_is_made_up_over_one_the_trace_saw_taken() {
        let mut db = TestDb::create(&dir("mv-overlap").join("d.db"));
        block(&mut db, 10, SEG + 64, 64, 64);
        db.row("FREE", "PTA", 11, 1, Some(SEG + 64), Attr::new());
        segment(&mut db, 20, SEG, 4096);
        block(&mut db, 30, SEG, 1024, 1000);
        let (_, segments, summary) = replayed(&db);
        assert_eq!(segments.len(), 1);
        assert_eq!((segments[0].address, summary.pretrace_segments), (SEG, 0));
    }

    #[test]
    fn the_pickle_reads_back_as_the_snapshot() {
        let mut db = TestDb::create(&dir("mv-pickle").join("d.db"));
        segment(&mut db, 10, SEG, 4096);
        block(&mut db, 20, SEG, 1024, 1000);
        let mut bytes = Vec::new();
        let summary = export(&DumpDb::open_read(&db.path).unwrap(), 1, &mut bytes).unwrap();
        assert_eq!((summary.entries, summary.segments, summary.live_blocks, summary.live_requested), (2, 1, 1, 1000));
        // Read back as a generic value (the privileged tier has PyTorch's own code read it).
        let value: serde_pickle::Value = serde_pickle::value_from_slice(&bytes, Default::default()).unwrap();
        let text = format!("{value:?}");
        for key in ["segments", "device_traces", "total_size", "active_allocated", "segment_alloc", "time_us"] {
            assert!(text.contains(key), "{key} missing from {text}");
        }
        assert_eq!(bytes[..2], [0x80, 4], "protocol 4, as PyTorch writes its snapshots");
    }
}
