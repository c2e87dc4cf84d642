//! One device of a snapshot as dump rows: the state before the trace's first entry (the final
//! `segments` rewound through the entries), then one row per entry that changes memory, with the
//! counters a trace's rows carry (`used`, `total`), the stream, the frames as call stacks and the
//! owner the rules read from the Python frames.
//!
//! Mappings of expandable segments are written in 2 MiB pieces (the small pool's page; the large
//! pool's 20 MiB pages are ten of them), so that an unmapping of any part of a mapping frees
//! rows that were written; the replay counts the pieces one allocation mapped as one mapping.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Map, Value};

use super::{Entry, Snapshot};
use crate::analysis::simulate::{config::Config, Flavour};
use crate::infer::Reader;

pub use crate::export::frames::Frame;

/// The unit mappings are written in.
const PIECE: u64 = 2 << 20;

/// A row to write.
#[derive(Clone, Debug, Default)]
pub(super) struct Row {
    pub event: &'static str,
    pub event_type: &'static str,
    pub name: &'static str,
    pub ts: i64,
    pub device: String,
    pub ptr: u64,
    pub attr: Map<String, Value>,
    pub python: String,
    pub native: String,
}

#[derive(Default)]
pub(super) struct Made {
    pub rows: Vec<Row>,
    pub segments_before: u64,
    pub blocks_before: u64,
    pub timed: bool,
}

/// What is live while the rows are written.
#[derive(Default)]
struct State {
    /// Blocks: address → (size, requested, allocation id).
    blocks: BTreeMap<u64, (u64, u64, u64)>,
    /// Whole segments: address → size.
    segments: BTreeMap<u64, u64>,
    /// Mapped 2 MiB pieces of expandable segments.
    pieces: BTreeSet<u64>,
    /// The `allocation_id` of each live segment and piece, by address: one counter for every
    /// block of the file, as Insight pairs a block's rows by it alone.
    segment_ids: BTreeMap<u64, u64>,
    next_id: u64,
    allocated: u64,
}

impl State {
    fn reserved(&self) -> u64 {
        self.segments.values().sum::<u64>() + self.pieces.len() as u64 * PIECE
    }
}

fn hex(v: u64) -> Value {
    Value::String(format!("0x{v:016x}"))
}

fn num(v: u64) -> Value {
    Value::String(v.to_string())
}

/// The frames as the two stack columns: Python frames (`.py` files) as `FILE(LINE): NAME`, the
/// others as native lines, innermost first as PyTorch lists them.
fn stacks(frames: &[Frame]) -> (String, String) {
    let (mut py, mut c) = (Vec::new(), Vec::new());
    for f in frames {
        if f.filename.ends_with(".py") {
            py.push(format!("{}({}): {}", f.filename, f.line, f.name));
        } else if f.line > 0 {
            c.push(format!("{}({}) [0x0] {}:{}", f.filename, f.name, f.filename, f.line));
        } else {
            c.push(format!("{}({}) [0x0]", f.filename, f.name));
        }
    }
    (py.join("\n"), c.join("\n"))
}

/// Where a row comes from: its time, the frames of its entry, and the pool (`caching`, or
/// `workspace` for torch_npu's workspace blocks a snapshot lists).
#[derive(Clone, Copy)]
struct At<'f> {
    ts: i64,
    frames: &'f [Frame],
    pool: &'static str,
}

struct Writer<'s> {
    snap: &'s Snapshot,
    device: String,
    state: State,
    made: Made,
    owners: Reader,
    round: Config,
}

impl Writer<'_> {
    fn row(
        &mut self,
        event: &'static str,
        event_type: &'static str,
        ts: i64,
        ptr: u64,
        attr: Map<String, Value>,
        frames: &[Frame],
    ) {
        let (python, native) = stacks(frames);
        let device = self.device.clone();
        self.made.rows.push(Row { event, event_type, name: "", ts, device, ptr, attr, python, native });
    }

    fn block(&mut self, at: At<'_>, addr: u64, req: u64, size: u64, stream: u64) {
        let At { ts, frames, pool } = at;
        self.state.next_id += 1;
        let id = self.state.next_id;
        self.state.blocks.insert(addr, (size, req, id));
        self.state.allocated += size;
        let (python, _) = stacks(frames);
        let reading = self.owners.read(&python);
        let mut owner = if pool == "workspace" { "PTA_WORKSPACE".to_owned() } else { "PTA".to_owned() };
        let mut attr = Map::new();
        if let Some(parts) = &reading.owner {
            for p in parts.iter() {
                owner.push('@');
                owner.push_str(p);
            }
            attr.insert("owner_source".into(), "inferred".into());
        }
        attr.insert("addr".into(), hex(addr));
        attr.insert("size".into(), num(size));
        attr.insert("req_size".into(), num(req));
        attr.insert("allocation_id".into(), num(id));
        attr.insert("api".into(), "alloc".into());
        attr.insert("used".into(), num(self.state.allocated));
        attr.insert("total".into(), num(self.state.reserved()));
        attr.insert("pool".into(), pool.into());
        attr.insert("stream".into(), hex(stream));
        attr.insert("owner".into(), owner.into());
        if let Some(site) = &reading.site {
            attr.insert("site".into(), site.to_string().into());
        }
        self.row("MALLOC", "PTA", ts, addr, attr, frames);
    }

    fn free_block(&mut self, ts: i64, addr: u64, frames: &[Frame]) {
        let Some((size, _, id)) = self.state.blocks.remove(&addr) else { return };
        self.state.allocated -= size;
        let mut attr = Map::new();
        attr.insert("addr".into(), hex(addr));
        attr.insert("size".into(), num(size));
        attr.insert("allocation_id".into(), num(id));
        attr.insert("api".into(), "free_completed".into());
        attr.insert("used".into(), num(self.state.allocated));
        attr.insert("total".into(), num(self.state.reserved()));
        attr.insert("pool".into(), "caching".into());
        self.row("FREE", "PTA", ts, addr, attr, frames);
    }

    fn segment(&mut self, at: At<'_>, addr: u64, size: u64, mapped: bool, taken: bool) {
        let At { ts, frames, pool } = at;
        if taken {
            if mapped {
                self.state.pieces.insert(addr);
            } else {
                self.state.segments.insert(addr, size);
            }
        } else if mapped {
            self.state.pieces.remove(&addr);
        } else {
            self.state.segments.remove(&addr);
        }
        let id = if taken {
            self.state.next_id += 1;
            self.state.segment_ids.insert(addr, self.state.next_id);
            Some(self.state.next_id)
        } else {
            self.state.segment_ids.remove(&addr)
        };
        let mut attr = Map::new();
        attr.insert("addr".into(), hex(addr));
        attr.insert("size".into(), num(size));
        if let Some(id) = id {
            attr.insert("allocation_id".into(), num(id));
        }
        attr.insert("api".into(), if mapped { "segment_map" } else { "segment_alloc" }.into());
        attr.insert("used".into(), num(self.state.reserved()));
        if taken {
            attr.insert("req_size".into(), num(size));
            attr.insert("segment".into(), pool.into());
            let owner = if self.snap.cuda { "CUDA@RUNTIME" } else { "CANN@APP" };
            attr.insert("owner".into(), owner.into());
            if mapped {
                attr.insert("vmm".into(), "true".into());
            }
        }
        self.row(if taken { "MALLOC" } else { "FREE" }, "HAL", ts, addr, attr, frames);
    }

    fn pieces(&mut self, at: At<'_>, addr: u64, size: u64, taken: bool) {
        let start = addr - addr % PIECE;
        for piece in (start..addr + size).step_by(PIECE as usize) {
            if self.state.pieces.contains(&piece) != taken {
                self.segment(at, piece, PIECE, true, taken);
            }
        }
    }

    fn oom(&mut self, ts: i64, e: &Entry) {
        let mut attr = Map::new();
        attr.insert("func".into(), "DeviceCachingAllocator::malloc".into());
        attr.insert("req_size".into(), num(e.size));
        attr.insert("status".into(), "out of memory".into());
        let (python, native) = stacks(&e.frames);
        let device = self.device.clone();
        let row = Row {
            event: "OOM_DETAIL",
            event_type: "OOM_TRIGGER",
            name: "DeviceCachingAllocator::malloc",
            ts,
            device,
            ptr: 0,
            attr,
            python,
            native,
        };
        self.made.rows.push(row);
    }
}

/// The segments, mapped pieces and live blocks of `device` before its first entry.
fn before(snap: &Snapshot, device: usize, entries: &[Entry]) -> State {
    let mut s = State::default();
    for seg in snap.segments.iter().filter(|g| g.device.max(0) as usize == device) {
        if seg.expandable {
            s.pieces.extend((seg.address..seg.address + seg.total_size).step_by(PIECE as usize));
        } else {
            s.segments.insert(seg.address, seg.total_size);
        }
        let mut at = seg.address;
        for b in &seg.blocks {
            let address = if b.address != 0 { b.address } else { at };
            if b.state != "inactive" {
                s.blocks.insert(address, (b.size, b.requested_size, 0));
            }
            at = address + b.size;
        }
    }
    for e in entries.iter().rev() {
        let range = (e.addr - e.addr % PIECE..e.addr + e.size).step_by(PIECE as usize);
        match e.action.as_str() {
            "alloc" => {
                s.blocks.remove(&e.addr);
            }
            "free_completed" => {
                s.blocks.insert(e.addr, (0, e.size, 0));
            }
            "segment_alloc" => {
                s.segments.remove(&e.addr);
            }
            "segment_free" => {
                s.segments.insert(e.addr, e.size);
            }
            "segment_map" => range.for_each(|p| {
                s.pieces.remove(&p);
            }),
            "segment_unmap" => range.for_each(|p| {
                s.pieces.insert(p);
            }),
            _ => {}
        }
    }
    s
}

/// The rows of one device.
pub(super) fn device_rows(snap: &Snapshot, device: usize) -> Made {
    let entries: &[Entry] = snap.traces.get(device).map_or(&[], Vec::as_slice);
    let flavour = if snap.cuda { Flavour::Cuda } else { Flavour::Npu };
    let conf = crate::analysis::advise::AllocConf::parse(snap.alloc_conf.as_deref().unwrap_or(""));
    let round = Config::parse("", &conf, None, None, flavour)
        .or_else(|_| Config::parse("", &Default::default(), None, None, flavour))
        .expect("the empty configuration parses");
    let mut w = Writer {
        snap,
        device: device.to_string(),
        state: State::default(),
        made: Made::default(),
        owners: Reader::default(),
        round,
    };
    w.made.timed = !entries.is_empty() && entries.iter().all(|e| e.time_us.is_some());
    let time =
        |i: usize, e: &Entry, timed: bool| if timed { e.time_us.unwrap_or(0) * 1000 } else { (i as i64 + 1) * 1000 };
    let first = entries.first().map_or(1000, |e| time(0, e, w.made.timed));
    let start = before(snap, device, entries);
    w.made.segments_before = start.segments.len() as u64 + start.pieces.len() as u64;
    w.made.blocks_before = start.blocks.len() as u64;
    let at = At { ts: first - 1000, frames: &[], pool: "caching" };
    for (&addr, &size) in &start.segments {
        w.segment(at, addr, size, false, true);
    }
    for &piece in &start.pieces {
        w.segment(at, piece, PIECE, true, true);
    }
    for (&addr, &(size, req, _)) in &start.blocks {
        let size = if size > 0 { size } else { w.round.round_size(req) };
        w.block(at, addr, req, size, 0);
    }
    let mut workspace = false;
    for (i, e) in entries.iter().enumerate() {
        let ts = time(i, e, w.made.timed);
        let at = At { ts, frames: &e.frames, pool: if workspace { "workspace" } else { "caching" } };
        match e.action.as_str() {
            "alloc" => {
                let size = w.round.round_size(e.size);
                w.block(at, e.addr, e.size, size, e.stream);
                workspace = false;
            }
            "free_completed" => w.free_block(ts, e.addr, &e.frames),
            "segment_alloc" => w.segment(at, e.addr, e.size, false, true),
            "segment_free" => w.segment(at, e.addr, e.size, false, false),
            "segment_map" => w.pieces(at, e.addr, e.size, true),
            "segment_unmap" => w.pieces(at, e.addr, e.size, false),
            "oom" => w.oom(ts, e),
            "workspace_snapshot" => workspace = true,
            _ => {}
        }
    }
    w.made
}
