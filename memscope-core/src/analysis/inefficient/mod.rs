//! Inefficient memory: blocks that held memory while nothing used it, by both definitions in use
//! (shared/reference/msmemscope-and-insight.md §4.2).
//!
//! - msMemScope's, on an API index (written as `inefficient_type`): `early_allocation` (another
//!   tensor was freed between this block's allocation and its first use), `late_deallocation`
//!   (another tensor was allocated between this block's last use and its free),
//!   `temporary_idleness` (two consecutive uses more than `--idle-threshold` APIs apart). The
//!   index counts, per process and per pool family (aten ops with the PTA caching pool, ATB ops
//!   with the ATB pool), each op start and each memory event outside an op; only those two pools
//!   are judged, as msMemScope does.
//! - Insight's, on time (what its block table shows): `lazy_used` (allocation to first access),
//!   `delayed_free` (last access to free), `long_idle` (longest gap between accesses), each with a
//!   duration and/or a share of the block's lifetime as threshold; for every block.
//!
//! One pass over `memscope_dump` in (`Timestamp(ns)`, `ID`) order ([`super::db::TimeOrder`])
//! rebuilds the blocks as Insight pairs them, resolves each ACCESS to the live block that holds its
//! address, and keeps per block the few facts both definitions need, so memory is O(blocks) and
//! time is the read plus a map lookup per row. Writing and printing the results is [`super::inefficient_out`]'s.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use foldhash::{HashMap, HashMapExt};

use super::attr::attr_fields;
use super::blocks::{parse_ptr, BlockKey, ATB, Bounds, EventTypes, Family, FreeMark, Names};
use super::db::{DumpDb, DumpRow, Fed, ReadOrder, Selection, TimeOrder};
use super::AnalysisError;
use crate::vocab::{Event, EventType};

/// msMemScope's `THREHOLD` (`inefficient_analyzer.h`) and `idle_threshold`'s default offline.
pub const DEFAULT_IDLE_THRESHOLD: u64 = 3000;

/// One bit per flag, in the order reports list them.
pub const EARLY_ALLOCATION: u8 = 1;
pub const LATE_DEALLOCATION: u8 = 1 << 1;
pub const TEMPORARY_IDLENESS: u8 = 1 << 2;
pub const LAZY_USED: u8 = 1 << 3;
pub const DELAYED_FREE: u8 = 1 << 4;
pub const LONG_IDLE: u8 = 1 << 5;
/// The flags msMemScope defines; only these go into `inefficient_type`, so tools that know its
/// vocabulary never meet a value they do not know.
pub const OP_INDEX_FLAGS: u8 = EARLY_ALLOCATION | LATE_DEALLOCATION | TEMPORARY_IDLENESS;

/// Every flag with its name (msMemScope's names for the op-index ones, Insight's for the others).
pub const FLAG_NAMES: [(u8, &str); 6] = [
    (EARLY_ALLOCATION, "early_allocation"),
    (LATE_DEALLOCATION, "late_deallocation"),
    (TEMPORARY_IDLENESS, "temporary_idleness"),
    (LAZY_USED, "lazy_used"),
    (DELAYED_FREE, "delayed_free"),
    (LONG_IDLE, "long_idle"),
];

/// `early_allocation,temporary_idleness`: the set flags of `mask`, comma-joined, in list order.
pub fn flag_list(flags: u8, mask: u8) -> String {
    let names: Vec<&str> = FLAG_NAMES.iter().filter(|(f, _)| flags & mask & f != 0).map(|(_, n)| *n).collect();
    names.join(",")
}

/// A threshold for a time-based flag, as Insight takes it: a duration, a share of the block's
/// lifetime, or both (either one exceeded fires, as Insight's `value OR percentage`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TimeThreshold {
    pub value_ns: Option<u64>,
    /// Percent of the block's lifetime (allocation to free), 0 < p < 100.
    pub percent: Option<f64>,
}

impl TimeThreshold {
    /// Whether `interval` exceeds the threshold (strictly, as Insight compares). The percentage is
    /// compared by cross-multiplying, so 200 ns of a 1000 ns life is exactly 20%, not 20.000001%.
    pub fn exceeded(&self, interval: i64, lifetime: i64) -> bool {
        interval > 0
            && (self.value_ns.is_some_and(|v| interval as u64 > v)
                || self.percent.is_some_and(|p| lifetime > 0 && interval as f64 * 100.0 > p * lifetime as f64))
    }
}

impl fmt::Display for TimeThreshold {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if let Some(v) = self.value_ns {
            parts.push(human_ns(v as i64));
        }
        if let Some(p) = self.percent {
            parts.push(format!("{p}% of the block's lifetime"));
        }
        f.write_str(&parts.join(" or "))
    }
}

/// `12.5 ms`, `300 ns`: a duration in the largest unit that keeps it readable.
pub fn human_ns(ns: i64) -> String {
    let abs = ns.unsigned_abs() as f64;
    let sign = if ns < 0 { "-" } else { "" };
    match ns.unsigned_abs() {
        1_000_000_000.. => format!("{sign}{:.3} s", abs / 1e9),
        1_000_000.. => format!("{sign}{:.3} ms", abs / 1e6),
        1_000.. => format!("{sign}{:.3} us", abs / 1e3),
        _ => format!("{ns} ns"),
    }
}

/// `5ms`, `2.5us`, `1s`: a positive duration with its unit, in ns.
fn parse_time_ns(text: &str) -> Result<u64, String> {
    let split = text.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let unit_ns: f64 = match unit.trim() {
        "ns" => 1.0,
        "us" | "µs" => 1e3,
        "ms" => 1e6,
        "s" => 1e9,
        "m" | "min" => 60e9,
        "" => {
            return Err(format!(
            "`{text}` needs a unit: a duration such as 5ms, 200us, 1s, or a share of the block's lifetime such as 20%"
        ))
        }
        other => {
            return Err(format!("unknown unit `{other}` in `{text}` (use ns, us, ms, s, m, or % of the lifetime)"))
        }
    };
    let value: f64 = number.parse().map_err(|_| format!("`{text}` is not a duration (examples: 5ms, 200us, 1s)"))?;
    let ns = (value * unit_ns).round();
    if !(ns.is_finite() && ns >= 1.0 && ns < u64::MAX as f64) {
        return Err(format!("`{text}` must be a duration of at least 1ns"));
    }
    Ok(ns as u64)
}

impl FromStr for TimeThreshold {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let mut t = Self { value_ns: None, percent: None };
        for part in text.split(',').map(str::trim) {
            let twice = || format!("`{text}` gives two {}; give at most one duration and one percentage", part);
            if let Some(p) = part.strip_suffix('%') {
                let v: f64 = p.trim().parse().map_err(|_| format!("`{part}` is not a percentage (example: 20%)"))?;
                if !(v > 0.0 && v < 100.0) {
                    return Err(format!("`{part}`: a share of the block's lifetime must be above 0% and below 100%"));
                }
                if t.percent.replace(v).is_some() {
                    return Err(twice());
                }
            } else if t.value_ns.replace(parse_time_ns(part)?).is_some() {
                return Err(twice());
            }
        }
        Ok(t)
    }
}

/// `1048576`, `512KiB`, `1MiB`, `2GiB` (`K`/`M`/`G` too): bytes.
fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let scale: u64 = match unit.trim() {
        "" | "B" => 1,
        "K" | "KiB" | "KB" => 1 << 10,
        "M" | "MiB" | "MB" => 1 << 20,
        "G" | "GiB" | "GB" => 1 << 30,
        _ => return Err(format!("`{text}` is not a size (examples: 1048576, 512KiB, 1MiB)")),
    };
    number
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(scale))
        .ok_or_else(|| format!("`{text}` is not a size (examples: 1048576, 512KiB, 1MiB)"))
}

// The options of `analyze --analysis inefficient`. Plain comments here: a doc comment on a
// flattened struct would replace the verb's own help text.
#[derive(Clone, Debug, PartialEq, clap::Args)]
#[command(next_help_heading = "Inefficient memory (--analysis inefficient)")]
pub struct Options {
    /// msMemScope's temporary_idleness: flag a block when two consecutive accesses to it are
    /// more than N APIs apart (ops and memory events outside ops, counted per process).
    #[arg(long, value_name = "N", default_value_t = DEFAULT_IDLE_THRESHOLD,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub idle_threshold: u64,

    /// Flag only blocks of at least this size, by either definition (msMemScope's mem_size):
    /// 1048576, 512KiB, 1MiB. Default: every block.
    #[arg(long, value_name = "BYTES", default_value = "0", hide_default_value = true, value_parser = parse_bytes)]
    pub mem_size: u64,

    /// Insight's lazy_used: flag blocks whose first access came more than THRESHOLD after their
    /// allocation. THRESHOLD is a duration (5ms, 200us), a share of the block's lifetime (20%),
    /// or both (5ms,20%: either exceeded flags). Off unless given, as in Insight.
    #[arg(long, value_name = "THRESHOLD")]
    pub lazy_used: Option<TimeThreshold>,

    /// Insight's delayed_free: flag blocks freed more than THRESHOLD after their last access (a
    /// block still live when the trace stopped counts as freed then). THRESHOLD as for --lazy-used.
    #[arg(long, value_name = "THRESHOLD")]
    pub delayed_free: Option<TimeThreshold>,

    /// Insight's long_idle: flag blocks with a gap of more than THRESHOLD between two consecutive
    /// accesses. THRESHOLD as for --lazy-used.
    #[arg(long, value_name = "THRESHOLD")]
    pub long_idle: Option<TimeThreshold>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            idle_threshold: DEFAULT_IDLE_THRESHOLD,
            mem_size: 0,
            lazy_used: None,
            delayed_free: None,
            long_idle: None,
        }
    }
}

/// Which API index a block's events advance: msMemScope keeps one per process for aten ops and
/// the PTA caching pool, one for ATB ops and the ATB pool, and judges no other memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpFamily {
    Aten,
    Atb,
}

/// The op family of a block: PTA blocks of the caching pool (a PTA row without `pool`, as
/// msMemScope writes them, counts as caching: it writes workspace blocks as PTA too since
/// f963bc8 and its DBs cannot tell them apart) and ATB blocks.
fn op_family(event_type: &str, pool: Option<&str>) -> Option<OpFamily> {
    if event_type == EventType::Pta.as_str() {
        (pool != Some("workspace")).then_some(OpFamily::Aten)
    } else {
        (event_type == ATB).then_some(OpFamily::Atb)
    }
}

/// One process's API index for one op family, as msMemScope's `PidState`. Its list of the
/// current API's events only matters for whether it held a MALLOC and a FREE, so two bits stand
/// for it.
#[derive(Clone, Copy, Debug, Default)]
struct ApiState {
    api: u64,
    /// The newest API that held a MALLOC / a FREE (`mallocApiTmpId`, `freeApiTmpId`).
    malloc_api: Option<u64>,
    free_api: Option<u64>,
    in_op: bool,
    pending_malloc: bool,
    pending_free: bool,
}

impl ApiState {
    /// A MALLOC, FREE or ACCESS: inside an op it belongs to the op's API; outside one it is an
    /// API of its own, classified at once. Returns its API index.
    fn memory_event(&mut self, malloc: bool, free: bool) -> u64 {
        self.pending_malloc |= malloc;
        self.pending_free |= free;
        if !self.in_op {
            self.api += 1;
            self.classify();
        }
        self.api
    }

    fn op_start(&mut self) {
        self.in_op = true;
        self.api += 1;
    }

    fn op_end(&mut self) {
        self.in_op = false;
        self.classify();
    }

    fn classify(&mut self) {
        if self.pending_malloc {
            self.malloc_api = Some(self.api);
        }
        if self.pending_free {
            self.free_api = Some(self.api);
        }
        self.pending_malloc = false;
        self.pending_free = false;
    }
}

/// A block's place on its process's API index (blocks msMemScope judges only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ApiFacts {
    pub family: OpFamily,
    pub malloc: u64,
    /// msMemScope's first access: the first in an API other than the MALLOC's.
    pub first_access: Option<u64>,
    pub last_access: Option<u64>,
    pub free: Option<u64>,
    /// The largest step between two consecutive accesses.
    pub max_idle: Option<u64>,
    /// Whether the block's latest event was an access (msMemScope looks at the event before).
    last_was_access: bool,
}

/// How a block's life ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    /// Its FREE.
    Free,
    /// A MALLOC at the same address while it was live (the free was not traced).
    Realloc,
    /// Still live when the trace stopped: a `shadow` FREE, or no FREE at all; the end is then the
    /// shadow FREE's time or the trace's.
    Live,
}

/// One block of the trace with what both definitions know of it.
#[derive(Clone, Debug)]
pub struct Block {
    /// rowid and `ID` of its MALLOC row in the dump table.
    pub malloc_rowid: i64,
    pub malloc_id: i64,
    pub pid: i64,
    /// Index into [`Report::event_types`].
    pub event_type: u16,
    pub family: Family,
    pub pool: Option<Box<str>>,
    pub ptr: u64,
    pub size: u64,
    pub allocation_id: Option<Box<str>>,
    /// Index into [`Report::owners`]; 0 is "no owner".
    pub owner: u32,
    pub malloc_ns: i64,
    pub end_ns: i64,
    pub end: End,
    pub accesses: u64,
    pub first_access_ns: Option<i64>,
    pub last_access_ns: Option<i64>,
    /// The longest gap between two consecutive accesses (`None` with fewer than two).
    pub max_idle_ns: Option<i64>,
    /// `None` for blocks msMemScope does not judge.
    pub api: Option<ApiFacts>,
    pub flags: u8,
}

/// What the replay met, so an empty result can be told apart from a trace without the rows
/// the analysis needs.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Stats {
    pub rows: u64,
    pub blocks: u64,
    /// Blocks msMemScope judges (PTA caching and ATB pools).
    pub op_index_blocks: u64,
    pub accesses: u64,
    /// ACCESS rows at an address no live block holds (memory from before the trace, host buffers).
    pub unresolved_accesses: u64,
    /// OP_LAUNCH starts (ATEN_START, ATB_START).
    pub ops: u64,
    pub processes: u64,
    pub shadow_frees: u64,
    pub unmatched_frees: u64,
    pub orphan_frees: u64,
    pub reallocs: u64,
    pub no_size: u64,
    pub unreadable: u64,
    /// Blocks that met a definition but are smaller than `--mem-size`.
    pub below_mem_size: u64,
}

pub struct Report {
    pub options: Options,
    /// The blocks that were accessed, in allocation order: neither definition can flag the
    /// others, and a trace has millions of them ([`Stats::blocks`] counts every block).
    pub blocks: Vec<Block>,
    /// Owner strings; index 0 is "".
    pub owners: Vec<Box<str>>,
    pub event_types: Vec<Box<str>>,
    /// MALLOC rows that already carry `inefficient_type` (a previous run's, or msMemScope's):
    /// rowid and value.
    pub existing: Vec<(i64, Box<str>)>,
    pub start_ns: Option<i64>,
    pub end_ns: Option<i64>,
    pub stats: Stats,
}

impl Report {
    pub fn owner(&self, block: &Block) -> &str {
        &self.owners[block.owner as usize]
    }

    pub fn event_type(&self, block: &Block) -> &str {
        &self.event_types[block.event_type as usize]
    }
}

/// Runs both definitions over the DB.
pub fn analyse(db: &DumpDb, options: &Options) -> Result<Report, AnalysisError> {
    analyse_in(db, options, |order| order).map(|(report, _)| report)
}

/// The rows this analysis reads.
const SELECTION: Selection = Selection {
    events: &[
        Event::Malloc.as_str(),
        Event::Free.as_str(),
        Event::Access.as_str(),
        Event::OpLaunch.as_str(),
        Event::System.as_str(),
    ],
    name: false,
    thread: false,
};

/// [`analyse`], with the reader adjusted by `tune` (tests lower its thresholds); also says how
/// the rows were read.
fn analyse_in(
    db: &DumpDb,
    options: &Options,
    tune: impl FnOnce(TimeOrder<'_>) -> TimeOrder<'_>,
) -> Result<(Report, ReadOrder), AnalysisError> {
    let mut replay = Replay::new(options.clone());
    let how = tune(db.rows(SELECTION)?).for_each_row(|fed| match fed {
        Fed::Row(row) => replay.apply(row),
        Fed::Restart => replay = Replay::new(options.clone()),
    })?;
    Ok((replay.finish(), how))
}

attr_fields! {
    /// The Attr keys this analysis reads.
    struct Fields { addr, size, owner, pool, allocation_id, shadow, unmatched, inefficient_type }
}

struct Replay {
    options: Options,
    /// Live blocks by slot (slots of ended blocks are reused), with their allocation number.
    slots: Vec<Option<(u64, Block)>>,
    free_slots: Vec<u32>,
    /// Ended blocks that were accessed, with their allocation number.
    ended: Vec<(u64, Block)>,
    live: HashMap<BlockKey, u32>,
    /// Live blocks by (process, start), for finding the block that holds an address: pool blocks
    /// first (they lie inside device segments), then device and host blocks.
    pool_index: BTreeMap<(i64, u64), u32>,
    other_index: BTreeMap<(i64, u64), u32>,
    apis: HashMap<(i64, OpFamily), ApiState>,
    /// Owner names; 0 is "no owner".
    owners: Names,
    event_types: EventTypes,
    existing: Vec<(i64, Box<str>)>,
    pids: foldhash::HashSet<i64>,
    /// `first` and `last`: every row of the events read.
    bounds: Bounds,
    stats: Stats,
}

impl Replay {
    fn new(options: Options) -> Self {
        Self {
            options,
            slots: Vec::new(),
            free_slots: Vec::new(),
            ended: Vec::new(),
            live: HashMap::new(),
            pool_index: BTreeMap::new(),
            other_index: BTreeMap::new(),
            apis: HashMap::new(),
            owners: Names::starting_with(""),
            event_types: EventTypes::default(),
            existing: Vec::new(),
            pids: Default::default(),
            bounds: Bounds::default(),
            stats: Stats::default(),
        }
    }

    fn owner(&mut self, owner: Option<&str>) -> u32 {
        owner.filter(|o| !o.is_empty()).map_or(0, |o| self.owners.id(o))
    }

    /// A live block.
    fn block(&mut self, idx: u32) -> &mut Block {
        &mut self.slots[idx as usize].as_mut().expect("a live block's slot").1
    }

    fn api(&mut self, pid: i64, family: OpFamily) -> &mut ApiState {
        self.apis.entry((pid, family)).or_default()
    }

    fn apply(&mut self, row: DumpRow<'_>) {
        self.stats.rows += 1;
        match Event::parse(row.event) {
            Some(Event::Malloc) => self.malloc(&row),
            Some(Event::Free) => self.free(&row),
            Some(Event::Access) => self.access(&row),
            Some(Event::OpLaunch) => self.op(&row),
            Some(Event::System) => self.bounds.system(row.event_type, row.ts),
            _ => return,
        }
        self.bounds.seen(row.ts);
    }

    fn fields<'a>(&mut self, attr: &'a str) -> Option<Fields<'a>> {
        let parsed = Fields::parse(attr);
        if parsed.is_none() {
            self.stats.unreadable += 1;
        }
        parsed
    }

    fn malloc(&mut self, row: &DumpRow<'_>) {
        let Some(f) = self.fields(row.attr) else { return };
        if let Some(old) = f.inefficient_type.as_deref() {
            self.existing.push((row.rowid, old.into()));
        }
        let Some(block_family) = Family::of(row.event_type) else { return };
        let Some(ptr) = parse_ptr(row.ptr).or_else(|| f.addr.as_deref().and_then(parse_ptr)) else {
            self.stats.unreadable += 1;
            return;
        };
        let Some(size) = f.size.as_deref().and_then(|s| s.trim().parse::<u64>().ok()).filter(|&s| s > 0) else {
            self.stats.no_size += 1;
            return;
        };
        let key = self.event_types.key(row, ptr);
        let ty = key.event_type;
        if let Some(old) = self.live.remove(&key) {
            self.stats.reallocs += 1;
            self.close(old, row.ts, End::Realloc);
        }
        self.pids.insert(row.pid);
        let family = op_family(row.event_type, f.pool.as_deref());
        let api = family.map(|family| ApiFacts {
            family,
            malloc: self.api(row.pid, family).memory_event(true, false),
            first_access: None,
            last_access: None,
            free: None,
            max_idle: None,
            last_was_access: false,
        });
        let owner = self.owner(f.owner.as_deref());
        let block = Block {
            malloc_rowid: row.rowid,
            malloc_id: row.id,
            pid: row.pid,
            event_type: ty,
            family: block_family,
            pool: f.pool.as_deref().map(Into::into),
            ptr,
            size,
            allocation_id: f.allocation_id.as_deref().map(Into::into),
            owner,
            malloc_ns: row.ts,
            end_ns: row.ts,
            end: End::Live,
            accesses: 0,
            first_access_ns: None,
            last_access_ns: None,
            max_idle_ns: None,
            api,
            flags: 0,
        };
        let slot = Some((self.stats.blocks, block));
        let idx = match self.free_slots.pop() {
            Some(idx) => {
                self.slots[idx as usize] = slot;
                idx
            }
            None => {
                self.slots.push(slot);
                (self.slots.len() - 1) as u32
            }
        };
        self.stats.blocks += 1;
        self.stats.op_index_blocks += u64::from(family.is_some());
        self.live.insert(key, idx);
        self.index_of(block_family).insert((row.pid, ptr), idx);
    }

    fn index_of(&mut self, family: Family) -> &mut BTreeMap<(i64, u64), u32> {
        if family == Family::Pta {
            &mut self.pool_index
        } else {
            &mut self.other_index
        }
    }

    /// Ends a block's life (its FREE, a shadow FREE, or a MALLOC over it). No access can reach
    /// it any more, so only an accessed block is kept.
    fn close(&mut self, idx: u32, ts: i64, end: End) {
        let (seq, mut b) = self.slots[idx as usize].take().expect("a live block's slot");
        self.free_slots.push(idx);
        b.end_ns = ts;
        b.end = end;
        let index = self.index_of(b.family);
        if index.get(&(b.pid, b.ptr)) == Some(&idx) {
            index.remove(&(b.pid, b.ptr));
        }
        if b.accesses > 0 {
            self.ended.push((seq, b));
        }
    }

    fn free(&mut self, row: &DumpRow<'_>) {
        let Some(f) = self.fields(row.attr) else { return };
        if Family::of(row.event_type).is_none() {
            return;
        }
        let Some(ptr) = parse_ptr(row.ptr).or_else(|| f.addr.as_deref().and_then(parse_ptr)) else {
            self.stats.unreadable += 1;
            return;
        };
        let key = self.event_types.key(row, ptr);
        let mark = FreeMark::of(f.shadow.as_deref(), f.unmatched.as_deref());
        if mark == FreeMark::Shadow {
            // Written when the trace stopped for blocks still live; msMemScope hands its shadow
            // frees to no analyzer, so they end the block's time but are no FREE API.
            self.stats.shadow_frees += 1;
            if let Some(idx) = self.live.remove(&key) {
                self.close(idx, row.ts, End::Live);
            }
            return;
        }
        let found = if mark == FreeMark::Unmatched {
            self.stats.unmatched_frees += 1;
            None
        } else {
            let found = self.live.remove(&key);
            self.stats.orphan_frees += u64::from(found.is_none());
            found
        };
        let Some(idx) = found else {
            // A block from before the trace was freed: still a FREE API for the others.
            if let Some(family) = op_family(row.event_type, f.pool.as_deref()) {
                self.api(row.pid, family).memory_event(false, true);
            }
            return;
        };
        if let Some(family) = self.block(idx).api.map(|a| a.family) {
            let st = {
                let s = self.api(row.pid, family);
                s.memory_event(false, true);
                *s
            };
            let b = self.block(idx);
            let facts = b.api.as_mut().expect("family came from it");
            facts.free = Some(st.api);
            // late_deallocation: the event before this FREE was an access, in an earlier API, and
            // an API after it allocated: the block could have been freed before that allocation.
            if facts.last_was_access {
                let la = facts.last_access.expect("set with last_was_access");
                if la != st.api && st.malloc_api.is_some_and(|m| la < m && st.api > m) {
                    b.flags |= LATE_DEALLOCATION;
                }
            }
            facts.last_was_access = false;
        }
        self.close(idx, row.ts, End::Free);
    }

    /// The live block holding `addr`: a pool block if one does, else a device or host block.
    fn resolve(&self, pid: i64, addr: u64) -> Option<u32> {
        for index in [&self.pool_index, &self.other_index] {
            if let Some((_, &idx)) = index.range((pid, 0)..=(pid, addr)).next_back() {
                let b = &self.slots[idx as usize].as_ref().expect("a live block's slot").1;
                if addr < b.ptr.saturating_add(b.size) {
                    return Some(idx);
                }
            }
        }
        None
    }

    fn access(&mut self, row: &DumpRow<'_>) {
        let addr = match parse_ptr(row.ptr) {
            Some(a) => Some(a),
            None => self.fields(row.attr).and_then(|f| f.addr.as_deref().and_then(parse_ptr)),
        };
        let Some(idx) = addr.and_then(|a| self.resolve(row.pid, a)) else {
            self.stats.unresolved_accesses += 1;
            return;
        };
        self.stats.accesses += 1;
        let b = self.block(idx);
        b.accesses += 1;
        if let Some(prev) = b.last_access_ns {
            let gap = row.ts - prev;
            b.max_idle_ns = Some(b.max_idle_ns.map_or(gap, |m| m.max(gap)));
        }
        b.first_access_ns.get_or_insert(row.ts);
        b.last_access_ns = Some(row.ts);
        let Some(family) = b.api.map(|a| a.family) else { return };
        let st = {
            let s = self.apis.entry((row.pid, family)).or_default();
            s.memory_event(false, false);
            *s
        };
        let threshold = self.options.idle_threshold;
        let b = self.block(idx);
        let facts = b.api.as_mut().expect("family came from it");
        let api = st.api;
        // temporary_idleness: this access and the one before it are too many APIs apart.
        if facts.last_was_access {
            let prev = facts.last_access.expect("set with last_was_access");
            if api > prev {
                let gap = api - prev;
                facts.max_idle = Some(facts.max_idle.map_or(gap, |m| m.max(gap)));
                if gap > threshold {
                    b.flags |= TEMPORARY_IDLENESS;
                }
            }
        }
        if facts.first_access.is_none() && api != facts.malloc {
            facts.first_access = Some(api);
        }
        facts.last_access = Some(api);
        facts.last_was_access = true;
        // early_allocation: a FREE API lies strictly between the MALLOC's and the first access's,
        // so the block could have been allocated after that free and reused its memory. Checked
        // at every access with the newest FREE API, as msMemScope does.
        if let (Some(free), Some(first)) = (st.free_api, facts.first_access) {
            if facts.malloc != free && first > free && facts.malloc < free {
                b.flags |= EARLY_ALLOCATION;
            }
        }
    }

    fn op(&mut self, row: &DumpRow<'_>) {
        let (family, start) = match EventType::parse(row.event_type) {
            Some(EventType::AtenStart) => (OpFamily::Aten, true),
            Some(EventType::AtenEnd) => (OpFamily::Aten, false),
            Some(EventType::AtbStart) => (OpFamily::Atb, true),
            Some(EventType::AtbEnd) => (OpFamily::Atb, false),
            _ => return,
        };
        let st = self.api(row.pid, family);
        if start {
            st.op_start();
            self.stats.ops += 1;
        } else {
            st.op_end();
        }
    }

    fn finish(mut self) -> Report {
        let end_ns = self.bounds.end_ns();
        let live: Vec<u32> = self.live.drain().map(|(_, idx)| idx).collect();
        for idx in live {
            let (seq, mut b) = self.slots[idx as usize].take().expect("a live block's slot");
            b.end_ns = end_ns.unwrap_or(b.malloc_ns).max(b.malloc_ns);
            b.end = End::Live;
            if b.accesses > 0 {
                self.ended.push((seq, b));
            }
        }
        self.ended.sort_unstable_by_key(|(seq, _)| *seq);
        let mut blocks: Vec<Block> = self.ended.into_iter().map(|(_, b)| b).collect();
        let o = &self.options;
        for b in &mut blocks {
            let life = b.end_ns - b.malloc_ns;
            // Insight's conditions: an access after the allocation instant, then the threshold.
            if let (Some(t), Some(first)) = (o.lazy_used, b.first_access_ns) {
                if first > b.malloc_ns && t.exceeded(first - b.malloc_ns, life) {
                    b.flags |= LAZY_USED;
                }
            }
            if let (Some(t), Some(last)) = (o.delayed_free, b.last_access_ns) {
                if last > b.malloc_ns && t.exceeded(b.end_ns - last, life) {
                    b.flags |= DELAYED_FREE;
                }
            }
            if let (Some(t), Some(idle)) = (o.long_idle, b.max_idle_ns) {
                if t.exceeded(idle, life) {
                    b.flags |= LONG_IDLE;
                }
            }
            if b.flags != 0 && b.size < o.mem_size {
                b.flags = 0;
                self.stats.below_mem_size += 1;
            }
        }
        self.stats.processes = self.pids.len() as u64;
        Report {
            options: self.options,
            blocks,
            owners: self.owners.into_names(),
            event_types: self.event_types.into_names(),
            existing: self.existing,
            start_ns: self.bounds.start_ns(),
            end_ns,
            stats: self.stats,
        }
    }
}

#[cfg(any(test, feature = "testing"))]
pub mod scenario {
    //! Synthetic traces whose ground truth is their construction: each block is placed so that,
    //! by the definition's wording, it must or must not be flagged; the analysis is never asked.

    use std::collections::HashMap;
    use std::path::PathBuf;

    use crate::analysis::testdb::{dir, TestDb};
    use crate::store::Attr;

    /// One thing a program does.
    #[derive(Clone, Copy, Debug)]
    pub enum Act {
        Malloc(u64, u64),
        Read(u64),
        Write(u64),
        Free(u64),
        Wait(i64),
    }

    /// A trace being written: one process at a time, 10 ns per row unless told to wait.
    pub struct Trace {
        db: TestDb,
        pub now: i64,
        pub pid: i64,
        next_alloc: u64,
        /// Live blocks: (pid, ptr) -> Event Type and pool.
        live: HashMap<(i64, u64), (&'static str, Option<&'static str>)>,
    }

    pub const START_NS: i64 = 1_000_000_000;

    impl Trace {
        pub fn new(name: &str) -> Self {
            let db = TestDb::create(&dir(&format!("ineff-{name}")).join("memscope_dump_1.db"));
            db.conn().execute_batch("BEGIN").unwrap();
            let mut t = Self { db, now: START_NS, pid: 1, next_alloc: 1, live: HashMap::new() };
            t.db.system("START_TRACE", t.now);
            t
        }

        fn tick(&mut self) -> i64 {
            self.now += 10;
            self.now
        }

        pub fn wait(&mut self, ns: i64) {
            self.now += ns;
        }

        pub fn row(&mut self, event: &str, event_type: &str, ptr: Option<u64>, attr: Attr) {
            let ts = self.tick();
            self.db.row(event, event_type, ts, self.pid, ptr, attr);
        }

        pub fn start(&mut self) {
            self.row("OP_LAUNCH", "ATEN_START", None, Attr::new());
        }

        pub fn end(&mut self) {
            self.row("OP_LAUNCH", "ATEN_END", None, Attr::new());
        }

        /// An aten op doing `acts`.
        pub fn op(&mut self, acts: &[Act]) {
            self.start();
            self.acts(acts);
            self.end();
        }

        pub fn acts(&mut self, acts: &[Act]) {
            for act in acts {
                match *act {
                    Act::Malloc(p, s) => self.malloc(p, s),
                    Act::Read(p) => self.access("READ", p),
                    Act::Write(p) => self.access("WRITE", p),
                    Act::Free(p) => self.free(p),
                    Act::Wait(ns) => self.wait(ns),
                }
            }
        }

        /// A block of torch_npu's caching pool.
        pub fn malloc(&mut self, ptr: u64, size: u64) {
            self.malloc_as("PTA", Some("caching"), ptr, size);
        }

        pub fn malloc_as(&mut self, event_type: &'static str, pool: Option<&'static str>, ptr: u64, size: u64) {
            let owner = if event_type == "HAL" { "CANN@APP" } else { "PTA@test" };
            let attr = Attr::new()
                .addr("addr", ptr)
                .with("size", size)
                .with("allocation_id", self.next_alloc)
                .with_opt("pool", pool)
                .with("owner", owner);
            self.next_alloc += 1;
            self.live.insert((self.pid, ptr), (event_type, pool));
            self.row("MALLOC", event_type, Some(ptr), attr);
        }

        pub fn free(&mut self, ptr: u64) {
            let (event_type, pool) = self.live.remove(&(self.pid, ptr)).expect("free of a live block");
            let attr = Attr::new().addr("addr", ptr).with("size", 1u64).with_opt("pool", pool);
            self.row("FREE", event_type, Some(ptr), attr);
        }

        /// A FREE row the tracer writes for memory from before the trace.
        pub fn free_unmatched(&mut self, ptr: u64) {
            let attr =
                Attr::new().addr("addr", ptr).with("size", 0u64).with("pool", "caching").with("unmatched", "true");
            self.row("FREE", "PTA", Some(ptr), attr);
        }

        pub fn access(&mut self, kind: &str, addr: u64) {
            let attr = Attr::new().addr("addr", addr).with("size", 4u64).with("type", "PTA");
            self.row("ACCESS", kind, Some(addr), attr);
        }

        /// STOP_TRACE, then a shadow FREE for every block still live, as `trace` writes them.
        pub fn finish(mut self) -> PathBuf {
            let stop = self.tick();
            self.db.system("STOP_TRACE", stop);
            let mut live: Vec<_> = self.live.drain().collect();
            live.sort_by_key(|(k, _)| *k);
            for ((pid, ptr), (event_type, _)) in live {
                self.pid = pid;
                let attr = Attr::new().addr("addr", ptr).with("size", 1u64).with("shadow", "true");
                self.db.row("FREE", event_type, stop + 1, pid, Some(ptr), attr);
            }
            self.db.conn().execute_batch("COMMIT").unwrap();
            self.db.path.clone()
        }
    }

    pub const A: u64 = 0x1000;
    pub const B: u64 = 0x2000;
    pub const C: u64 = 0x3000;

    /// B (1 MiB) early: C is freed between its allocation and first use; 5 us then pass and
    /// two APIs until its last use (long idle at 1 us, temporarily idle at 1 API). A and C are
    /// used in consecutive APIs and freed in the API of their last use: never flagged.
    pub fn small_trace(name: &str) -> PathBuf {
        let mut t = Trace::new(name);
        t.op(&[Act::Malloc(A, 64), Act::Write(A), Act::Malloc(C, 32), Act::Write(C)]);
        t.op(&[Act::Malloc(B, 1 << 20), Act::Read(A)]);
        t.op(&[Act::Read(C), Act::Free(C)]);
        t.op(&[Act::Write(B), Act::Read(A), Act::Free(A)]);
        t.wait(5_000);
        t.op(&[]);
        t.op(&[Act::Read(B), Act::Free(B)]);
        t.finish()
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use std::collections::BTreeSet;

    use super::scenario::{Act, Trace};
    use rusqlite::Connection;

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
        let options =
            Options { idle_threshold: 20, lazy_used: us100, delayed_free: us100, long_idle: us100, mem_size: 0 };
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
        let options =
            Options { idle_threshold: 3, lazy_used: us100, delayed_free: us100, long_idle: us100, mem_size: 0 };
        let (sorted, how) = analyse_in(&DumpDb::open_read(&path).unwrap(), &options, |o| o).unwrap();
        assert_eq!(how, ReadOrder::Storage, "written in time order");
        assert!(sorted.blocks.iter().filter(|b| b.flags != 0).count() > 50);
        // The same rows stored in another order: pairs of neighbours swapped (as two CPUs racing
        // for the ring leave them), and every MALLOC moved to the end (as msMemScope writes them).
        let conn = Connection::open(&path).unwrap();
        let swapped = path.with_file_name("memscope_dump_2.db");
        let moved = path.with_file_name("memscope_dump_3.db");
        for (copy, order) in
            [(&swapped, "((rowid - 1) / 2) * 2 + (rowid % 2)"), (&moved, "(\"Event\" = 'MALLOC'), rowid")]
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
        let (r, how) =
            analyse_in(&DumpDb::open_read(&swapped).unwrap(), &options, |o| o.with_limits(0, many, 0)).unwrap();
        assert_eq!(how, ReadOrder::Sorted, "no straggler allowed: the first swap sends it to SQLite");
        assert_eq!(outcome(&r), outcome(&sorted));
        let (r, how) =
            analyse_in(&DumpDb::open_read(&swapped).unwrap(), &options, |o| o.with_limits(many, 0, all)).unwrap();
        assert_eq!(how, ReadOrder::Sorted, "no row may wait: the replay starts again, sorted");
        assert_eq!(outcome(&r), outcome(&sorted));
        let (r, how) =
            analyse_in(&DumpDb::open_read(&moved).unwrap(), &options, |o| o.with_limits(100, many, 0)).unwrap();
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
}
