//! Steps of a trace and the live memory at each step boundary: the timeline that the leak,
//! degradation and compare analyses share (shared/reference/msmemscope-and-insight.md §4.3).
//!
//! **Boundaries.** msMemScope takes steps from `msmemscope.step()` (a `SYSTEM`/`STEP` row whose
//! `Name` is the step that just ended) or from mstx ranges named `step start` (each starts the
//! next step). Our tracer writes a `STEP` row for both; for a range it also writes the
//! `MSTX`/`Range_start` `"step start"` row at the same instant, which is how the two are told
//! apart here. With `--step-marker NAME`, `MSTX` marks (and range starts) whose message is NAME
//! are the boundaries instead, each starting the next step, and `STEP` rows are ignored.
//!
//! **Two rows for one step.** A program that calls `memscope.step()` and also opens `step start`
//! ranges gets two `STEP` rows per step (the tracer numbers a range as the process's next step,
//! so the pair repeats a number). Every boundary is turned into the step it *starts*; one that
//! starts a step already started is the same boundary seen through the other marker and is
//! dropped (counted in [`StepSummary::duplicates`]). Steps are numbered per file, not per
//! process: one training process per device is what these analyses are for.
//!
//! **Blocks.** Replayed as `decompose` and Insight do: a `MALLOC` with a positive `size` opens
//! the block keyed by (`Process Id`, `Event Type`, `Ptr`), the next `FREE` of that key closes it;
//! `unmatched` frees close nothing and `shadow` frees (written at the stop for live blocks) are
//! not frees. Each block's step of birth and the step running when it ended go to a
//! [`BlockSink`]; the live bytes per owner are snapshotted at every boundary. O(rows) work in
//! the time-ordered read of [`super::db::TimeOrder`], memory O(live blocks + boundaries ×
//! owners).

use std::borrow::Cow;
use std::path::PathBuf;

use thiserror::Error;

use super::attr::attr_fields;
use super::blocks::{block_attr, BlockHooks, BlockKey, BlockReplay, Bounds, Family, OwnerSlots};
use super::db::{text, DumpDb, DumpRow, Fed, ReadOrder, Selection};
use super::AnalysisError;
use crate::printable::printable;
use crate::store::insight::GC;
use crate::vocab::{attr, Event, EventType};

/// msMemScope's step range message.
pub const STEP_RANGE: &str = "step start";

/// What can go wrong beyond reading the DB: the steps asked for are not in it.
#[derive(Debug, Error)]
pub enum StepError {
    #[error(transparent)]
    Analysis(#[from] AnalysisError),
    #[error("{path}: no MSTX mark or range named \"{marker}\" (--step-marker); {seen}; give one of those, or leave --step-marker out to take the steps from memscope.step() and mstx `step start` ranges")]
    NoSuchMarker { path: PathBuf, marker: String, seen: String },
}

/// A DB opened by [`DumpDb::open_read`], as the step analyses read it: they also need `Name`, and
/// the stacks when the file has them.
pub struct StepDb<'a> {
    db: &'a DumpDb,
    has_stacks: bool,
}

/// The rows a step replay reads.
pub const SELECTION: Selection = Selection {
    events: &[Event::Malloc.as_str(), Event::Free.as_str(), Event::System.as_str(), Event::Mstx.as_str()],
    name: true,
    thread: false,
};

impl<'a> StepDb<'a> {
    /// Refuses a dump table without `Name` (steps and marks are named).
    pub fn new(db: &'a DumpDb) -> Result<Self, AnalysisError> {
        db.require_columns(&["Name"])?;
        let has_stacks = db.missing_columns(&["Call Stack(Python)", "Call Stack(C)"])?.is_empty();
        Ok(Self { db, has_stacks })
    }

    fn read_err(&self) -> impl Fn(rusqlite::Error) -> AnalysisError + '_ {
        move |source| AnalysisError::Read { path: self.db.path().to_owned(), source }
    }

    /// The boundaries of a trace without steps, from its allocations' repeating pattern
    /// ([`super::step_pattern`]); none with a `--step-marker`, whose steps are the user's.
    pub fn pattern(&self, step_marker: Option<&str>) -> Result<Vec<i64>, AnalysisError> {
        match step_marker {
            Some(_) => Ok(Vec::new()),
            None => super::step_pattern::boundaries(self.db),
        }
    }

    /// Calls `f` for every memory, `SYSTEM` and `MSTX` row in time order (see [`TimeOrder`]).
    pub fn for_each_row(&self, f: impl FnMut(Fed<'_>)) -> Result<ReadOrder, AnalysisError> {
        self.db.rows(SELECTION)?.for_each_row(f)
    }

    /// The Python and C stacks and the `allocation_id` of a MALLOC row, for a reported block.
    pub fn details(&self, rowid: i64) -> Result<RowDetails, AnalysisError> {
        let stacks = if self.has_stacks { "\"Call Stack(Python)\", \"Call Stack(C)\"" } else { "'', ''" };
        let sql = format!("SELECT {stacks}, \"Attr\" FROM \"{}\" WHERE rowid = ?1", self.db.table());
        let mut stmt = self.db.conn().prepare_cached(&sql).map_err(self.read_err())?;
        let mut rows = stmt.query([rowid]).map_err(self.read_err())?;
        let Some(row) = rows.next().map_err(self.read_err())? else { return Ok(RowDetails::default()) };
        let get = |i| row.get_ref(i).map_err(self.read_err());
        let attr = DetailFields::parse(text(get(2)?)).unwrap_or_default();
        Ok(RowDetails {
            python_stack: clean_stack(text(get(0)?)),
            c_stack: clean_stack(text(get(1)?)),
            allocation_id: attr.allocation_id.map(Cow::into_owned),
            inefficient: attr.inefficient_type.map(Cow::into_owned),
            site: attr.site.map(Cow::into_owned),
        })
    }
}

/// msMemScope wraps stacks in quotes and writes `NA` where it had none.
pub(crate) fn clean_stack(s: &str) -> String {
    let s = s.trim().trim_matches('"').trim();
    if s == "NA" || s == "N/A" {
        String::new()
    } else {
        s.to_owned()
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RowDetails {
    pub python_stack: String,
    pub c_stack: String,
    pub allocation_id: Option<String>,
    /// Attr `inefficient_type`: msMemScope's inefficiency types, when analysed and flagged.
    pub inefficient: Option<String>,
    /// Attr `site`: the job's own line that made the block, when the trace read its stack.
    pub site: Option<String>,
}

attr_fields! {
    /// The Attr keys read here. Non-string values read as absent, as Insight's getter treats them.
    struct AttrFields { addr, size, weight, owner, unmatched, shadow, segment, pool, allocation_id, freed_by }
}
block_attr!(AttrFields);

attr_fields! {
    /// What a reported block's MALLOC row adds (read for a few rows only, off the replay's path).
    struct DetailFields { allocation_id, inefficient_type, site }
}

// ---------------------------------------------------------------- boundaries

/// What marked a boundary.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    /// `memscope.step()` / `msmemscope.step()`: a `STEP` row ending the step it names.
    Step,
    /// An mstx range named `step start`, starting the next step.
    Range,
    /// A mark named by `--step-marker`, starting the next step.
    Marker,
    /// A `STEP` row the tracer found from the job's Python stacks (`source`=`inferred`), read
    /// as `memscope.step()`'s.
    Inferred,
    /// Found here, in a trace without any of the above, from the repeating pattern of its
    /// allocations ([`super::step_pattern`]): each starts the next step.
    Pattern,
}

impl Source {
    pub fn describe(self) -> &'static str {
        match self {
            Self::Step => "memscope.step()",
            Self::Range => "mstx `step start` ranges",
            Self::Marker => "--step-marker marks",
            Self::Inferred => "steps found from the job's Python stacks (no markers)",
            Self::Pattern => "the repeating pattern of the allocations (no markers, no Python stacks)",
        }
    }
}

/// The end of one step and the start of the next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Boundary {
    /// The step that ended here (msMemScope's numbering: `step()`'s number; a `step start` range
    /// ends the step before the one it starts; the first `step start` ends step 0, the set-up).
    pub step: u64,
    pub ts: i64,
    pub source: Source,
}

#[derive(Clone, Copy, Debug)]
struct PendingStep {
    ts: i64,
    pid: i64,
    number: Option<u64>,
    source: Source,
}

/// Turns rows into boundaries, in time order.
#[derive(Debug, Default)]
pub struct StepDetector {
    /// `"NAME"`, as MSTX rows write a message, when `--step-marker NAME` was given.
    marker: Option<String>,
    /// The step running now; `None` before the first boundary.
    current: Option<u64>,
    /// A `STEP` row waiting to learn whether a `step start` range row follows it.
    pending: Option<PendingStep>,
    pub duplicates: u64,
    /// Distinct mark messages seen (a few), to say what exists when `--step-marker` matches none.
    pub marks_seen: Vec<String>,
    /// Boundaries found from the allocations' pattern, not yet reached ([`StepDb::pattern`]).
    pattern: std::collections::VecDeque<i64>,
}

/// A `STEP` row the tracer found from the stacks: its Attr is `{"source":"inferred"}` alone.
fn is_inferred(row: &DumpRow<'_>) -> bool {
    row.attr.contains(r#""source":"inferred""#)
}

fn is_step_range(row: &DumpRow<'_>) -> bool {
    row.event == Event::Mstx.as_str()
        && row.event_type == EventType::RangeStart.as_str()
        && unquote(row.name) == STEP_RANGE
}

/// MSTX names are the message in double quotes (msMemScope's form); accept bare ones too.
fn unquote(name: &str) -> &str {
    name.strip_prefix('"').and_then(|n| n.strip_suffix('"')).unwrap_or(name)
}

impl StepDetector {
    pub fn new(marker: Option<&str>) -> Self {
        Self { marker: marker.map(str::to_owned), ..Self::default() }
    }

    /// With the boundaries a trace without steps has from its allocations' pattern.
    pub fn with_pattern(marker: Option<&str>, pattern: &[i64]) -> Self {
        Self { pattern: pattern.iter().copied().collect(), ..Self::new(marker) }
    }

    /// The step running now, if a boundary was seen.
    pub fn current(&self) -> Option<u64> {
        self.current
    }

    /// Feeds one row; boundaries it completes go to `out` (at most two). Returns whether the row
    /// was only a step marker (the `Range_start` twin of a `STEP` row).
    pub fn feed(&mut self, row: &DumpRow<'_>, out: &mut Vec<Boundary>) -> bool {
        while let Some(ts) = self.pattern.front().copied().filter(|&ts| ts <= row.ts) {
            self.pattern.pop_front();
            self.commit(None, ts, Source::Pattern, out);
        }
        if let Some(p) = self.pending.take() {
            if is_step_range(row) && row.ts == p.ts && row.pid == p.pid {
                self.commit(p.number, p.ts, Source::Range, out);
                return true;
            }
            self.commit(p.number.map(|n| n.saturating_add(1)), p.ts, p.source, out);
        }
        if let Some(marker) = &self.marker {
            if row.event == Event::Mstx.as_str()
                && (row.event_type == EventType::Mark.as_str() || row.event_type == EventType::RangeStart.as_str())
            {
                let message = unquote(row.name);
                if message == marker {
                    self.commit(None, row.ts, Source::Marker, out);
                    return true;
                }
                if self.marks_seen.len() < 12 && !self.marks_seen.iter().any(|m| m == message) {
                    self.marks_seen.push(message.to_owned());
                }
            }
            return false;
        }
        if row.event == Event::System.as_str() && row.event_type == EventType::Step.as_str() {
            let number = row.name.trim().parse::<u64>().ok();
            let source = if is_inferred(row) { Source::Inferred } else { Source::Step };
            self.pending = Some(PendingStep { ts: row.ts, pid: row.pid, number, source });
            return true;
        }
        if is_step_range(row) {
            // msMemScope's own DBs: the range is the only record of the step.
            self.commit(None, row.ts, Source::Range, out);
            return true;
        }
        false
    }

    /// Completes a `STEP` row still waiting at the end of the rows.
    pub fn finish(&mut self, out: &mut Vec<Boundary>) {
        if let Some(p) = self.pending.take() {
            self.commit(p.number.map(|n| n.saturating_add(1)), p.ts, p.source, out);
        }
        while let Some(ts) = self.pattern.pop_front() {
            self.commit(None, ts, Source::Pattern, out);
        }
    }

    /// `starts`: the step this boundary starts (`None`: the next one).
    fn commit(&mut self, starts: Option<u64>, ts: i64, source: Source, out: &mut Vec<Boundary>) {
        let starts = starts.unwrap_or_else(|| self.current.map_or(1, |c| c + 1)).max(1);
        if self.current.is_some_and(|c| starts <= c) {
            self.duplicates += 1;
            return;
        }
        self.current = Some(starts);
        out.push(Boundary { step: starts - 1, ts, source });
    }
}

// ---------------------------------------------------------------- blocks and live bytes

/// What a block is, beyond its family: the leak analysis treats a pool's own reserve apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockKind {
    /// A tensor's block or a device/host allocation.
    Block,
    /// A `HAL` block that torch_npu's allocator took as a segment of its pool (Attr `segment`).
    Segment,
    /// A block of torch_npu's workspace allocator (Attr `pool` = `workspace`): operator scratch,
    /// kept and regrown across steps by design.
    Workspace,
}

/// A block that was freed, or was still live when the trace stopped.
#[derive(Clone, Copy, Debug)]
pub struct BlockEnd {
    pub family: Family,
    pub kind: BlockKind,
    pub pid: i64,
    pub ptr: u64,
    pub size: i64,
    /// Owner slot: [`Timeline::owner`] names it.
    pub slot: u32,
    /// The step it was born in and the step running when it ended. `None` when it ended before
    /// the first boundary (the step numbers are unknown then; it crossed no boundary anyway).
    pub steps: Option<(u64, u64)>,
    pub alloc_ts: i64,
    /// `None`: still live at the end of the trace (no FREE, or only a shadow one).
    pub free_ts: Option<i64>,
    /// Freed inside a pass of Python's garbage collector (FREE `freed_by` = `gc`).
    pub by_gc: bool,
    /// The MALLOC row, for [`StepDb::details`].
    pub rowid: i64,
}

/// Receives every block as it ends.
pub trait BlockSink {
    /// A block was born (in time order, like the ends): for a sink that follows the live bytes.
    fn block_start(&mut self, _family: Family, _kind: BlockKind, _size: i64, _ts: i64) {}
    fn block_end(&mut self, end: &BlockEnd);
    /// The replay starts over (see [`StepDb::for_each_row`]): forget every block so far.
    fn restart(&mut self);
}

impl BlockSink for () {
    fn block_end(&mut self, _: &BlockEnd) {}
    fn restart(&mut self) {}
}

/// One owner's live memory at an instant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OwnerBytes {
    pub slot: u32,
    pub bytes: i64,
    pub blocks: u64,
}

/// The live memory at a boundary (or at the end of the trace).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepPoint {
    /// The step that ended here; `None` for the end of the trace.
    pub step: Option<u64>,
    pub ts: i64,
    /// Live bytes per family, indexed by `Family as usize`.
    pub totals: [i64; 3],
    /// Owners with live blocks, by slot.
    pub owners: Vec<OwnerBytes>,
}

impl StepPoint {
    pub fn total(&self, family: Family) -> i64 {
        self.totals[family as usize]
    }
}

/// How the rows were read, so a surprising result can be explained.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepSummary {
    /// Boundaries per source.
    pub sources: Vec<(Source, u64)>,
    /// Boundary rows dropped because their step had already started (two markers for one step).
    pub duplicates: u64,
    /// Mark messages seen when `--step-marker` was given (a few).
    pub marks_seen: Vec<String>,
    /// Families with at least one block.
    pub families: Vec<Family>,
    pub unreadable: u64,
}

/// Marks a birth before the first boundary, whose step number is only known at that boundary.
const BEFORE_FIRST: u64 = u64::MAX;

#[derive(Clone, Copy, Debug)]
struct LiveBlock {
    slot: u32,
    family: Family,
    kind: BlockKind,
    size: i64,
    birth: u64,
    alloc_ts: i64,
    rowid: i64,
}

/// The replay: boundaries, live blocks, and the live bytes per owner at each boundary.
pub struct Timeline {
    detector: StepDetector,
    blocks: BlockReplay<LiveBlock>,
    live: LiveBytes,
    pub boundaries: Vec<Boundary>,
    /// The live memory at each boundary, in order (one per entry of `boundaries`).
    pub points: Vec<StepPoint>,
    scratch: Vec<Boundary>,
}

/// What the timeline keeps of the paired blocks: live bytes per owner slot and per family.
struct LiveBytes {
    slots: OwnerSlots,
    per_slot: Vec<(i64, u64)>,
    totals: [i64; 3],
    mallocs: [u64; 3],
    /// The step running now as stored in a block: [`BEFORE_FIRST`] until a boundary is seen.
    now: u64,
    /// The step before the first boundary (known from it).
    first_step: Option<u64>,
    /// `first` is the first row of any kind; `last` the last SYSTEM or memory row.
    bounds: Bounds,
    unreadable: u64,
}

/// The timeline's hooks into the block replay: its live bytes and the analysis's sink.
struct Hooks<'a, S> {
    live: &'a mut LiveBytes,
    sink: &'a mut S,
}

impl<S: BlockSink> Hooks<'_, S> {
    fn close(&mut self, key: BlockKey, block: LiveBlock, free_ts: Option<i64>, by_gc: bool) {
        close(self.live, key, block, free_ts, by_gc, self.sink);
    }
}

impl<S: BlockSink> BlockHooks for Hooks<'_, S> {
    type Block = LiveBlock;
    type Attr<'a> = AttrFields<'a>;

    fn skip_free_attr(&self, text: &str) -> bool {
        // Half the rows are FREEs, and all a FREE can say here is `shadow`, `unmatched` or
        // `freed_by`: most need no parsing at all.
        !text.contains(attr::shadow) && !text.contains(attr::unmatched) && !text.contains(attr::freed_by)
    }
    fn unreadable(&mut self) {
        self.live.unreadable += 1;
    }
    fn seen(&mut self, ts: i64) {
        self.live.bounds.last = Some(ts);
    }
    fn open(
        &mut self,
        row: &DumpRow<'_>,
        _: BlockKey,
        family: Family,
        owner: &str,
        size: i64,
        attr: &AttrFields<'_>,
    ) -> LiveBlock {
        let live = &mut *self.live;
        let (slot, new) = live.slots.slot(family, owner);
        if new {
            live.per_slot.push((0, 0));
        }
        let kind = if attr.segment.as_deref().is_some_and(|s| !s.is_empty()) {
            BlockKind::Segment
        } else if attr.pool.as_deref() == Some("workspace")
            || EventType::parse(row.event_type) == Some(EventType::PtaWorkspace)
        {
            BlockKind::Workspace
        } else {
            BlockKind::Block
        };
        live.mallocs[family as usize] += 1;
        LiveBlock { slot, family, kind, size, birth: live.now, alloc_ts: row.ts, rowid: row.rowid }
    }
    fn opened(&mut self, row: &DumpRow<'_>, block: &LiveBlock) {
        self.sink.block_start(block.family, block.kind, block.size, row.ts);
        let s = &mut self.live.per_slot[block.slot as usize];
        s.0 += block.size;
        s.1 += 1;
        self.live.totals[block.family as usize] += block.size;
    }
    fn realloc(&mut self, row: &DumpRow<'_>, key: BlockKey, old: LiveBlock) {
        // A MALLOC over a live block: the earlier one is taken as freed (as decompose does).
        self.close(key, old, Some(row.ts), false);
    }
    fn free(&mut self, row: &DumpRow<'_>, key: BlockKey, block: LiveBlock, attr: &AttrFields<'_>) {
        let by_gc = attr.freed_by.as_deref() == Some(GC);
        self.close(key, block, Some(row.ts), by_gc);
    }
}

/// A block ends: its bytes leave the live ones (unless it lives on past the trace) and the sink
/// learns its steps.
fn close(
    live: &mut LiveBytes,
    key: BlockKey,
    block: LiveBlock,
    free_ts: Option<i64>,
    by_gc: bool,
    sink: &mut impl BlockSink,
) {
    if free_ts.is_some() {
        let s = &mut live.per_slot[block.slot as usize];
        s.0 -= block.size;
        s.1 -= 1;
        live.totals[block.family as usize] -= block.size;
    }
    let now = live.now;
    let steps = (now != BEFORE_FIRST).then(|| {
        let birth = if block.birth == BEFORE_FIRST { live.first_step.unwrap_or(0) } else { block.birth };
        (birth, now)
    });
    sink.block_end(&BlockEnd {
        family: block.family,
        kind: block.kind,
        pid: key.pid,
        ptr: key.ptr,
        size: block.size,
        slot: block.slot,
        steps,
        alloc_ts: block.alloc_ts,
        free_ts,
        by_gc,
        rowid: block.rowid,
    });
}

impl Timeline {
    pub fn new(step_marker: Option<&str>) -> Self {
        Self::with_pattern(step_marker, &[])
    }

    /// With the boundaries of [`StepDb::pattern`].
    pub fn with_pattern(step_marker: Option<&str>, pattern: &[i64]) -> Self {
        Self {
            detector: StepDetector::with_pattern(step_marker, pattern),
            blocks: BlockReplay::default(),
            live: LiveBytes {
                slots: OwnerSlots::default(),
                per_slot: Vec::new(),
                totals: [0; 3],
                mallocs: [0; 3],
                now: BEFORE_FIRST,
                first_step: None,
                bounds: Bounds::default(),
                unreadable: 0,
            },
            boundaries: Vec::new(),
            points: Vec::new(),
            scratch: Vec::new(),
        }
    }

    /// Replays a whole DB. A `--step-marker` that names no mark is refused: it is a typo far
    /// more often than a trace without steps, and a report without steps would hide that.
    pub fn replay(db: &StepDb<'_>, step_marker: Option<&str>, sink: &mut impl BlockSink) -> Result<Self, StepError> {
        let pattern = db.pattern(step_marker)?;
        let mut timeline = Self::with_pattern(step_marker, &pattern);
        db.for_each_row(|fed| match fed {
            Fed::Row(row) => timeline.apply(&row, sink),
            Fed::Restart => {
                timeline = Self::with_pattern(step_marker, &pattern);
                sink.restart();
            }
        })?;
        timeline.finish(sink);
        timeline.check_marker(db, step_marker)?;
        Ok(timeline)
    }

    /// Refuses a finished replay whose `--step-marker` found no boundary.
    fn check_marker(&self, db: &StepDb<'_>, step_marker: Option<&str>) -> Result<(), StepError> {
        let Some(marker) = step_marker.filter(|_| self.boundaries.is_empty()) else { return Ok(()) };
        let marks = &self.detector.marks_seen;
        let seen = if marks.is_empty() {
            "the trace has no MSTX marks or ranges".to_owned()
        } else {
            let marks: Vec<_> = marks.iter().map(|m| printable(m)).collect();
            format!("marks and ranges in this trace: {}", marks.join(", "))
        };
        Err(StepError::NoSuchMarker { path: db.db.path().to_owned(), marker: marker.to_owned(), seen })
    }

    pub fn owner(&self, slot: u32) -> (Family, &str) {
        self.live.slots.get(slot)
    }

    pub fn slot_count(&self) -> usize {
        self.live.slots.len()
    }

    fn snapshot(&self, step: Option<u64>, ts: i64) -> StepPoint {
        let owners = self
            .live
            .per_slot
            .iter()
            .enumerate()
            .filter(|(_, (_, blocks))| *blocks > 0)
            .map(|(slot, &(bytes, blocks))| OwnerBytes { slot: slot as u32, bytes, blocks })
            .collect();
        StepPoint { step, ts, totals: self.live.totals, owners }
    }

    /// Boundaries the detector completed: the live memory is snapshotted at each.
    fn push_boundaries(&mut self, found: &mut Vec<Boundary>) {
        for b in found.drain(..) {
            self.live.first_step.get_or_insert(b.step);
            self.points.push(self.snapshot(Some(b.step), b.ts));
            self.boundaries.push(b);
        }
        self.live.now = self.detector.current().unwrap_or(BEFORE_FIRST);
    }

    pub fn apply(&mut self, row: &DumpRow<'_>, sink: &mut impl BlockSink) {
        self.live.bounds.first.get_or_insert(row.ts);
        let mut found = std::mem::take(&mut self.scratch);
        found.clear();
        let consumed = self.detector.feed(row, &mut found);
        self.push_boundaries(&mut found);
        self.scratch = found;
        if consumed {
            return;
        }
        if row.event == Event::System.as_str() {
            self.live.bounds.system(row.event_type, row.ts);
            self.live.bounds.last = Some(row.ts);
            return;
        }
        self.blocks.apply(&mut Hooks { live: &mut self.live, sink }, row);
    }

    /// Ends the replay: blocks still live are reported as never freed, in the order they were
    /// allocated (so reports and tables do not depend on hash order).
    pub fn finish(&mut self, sink: &mut impl BlockSink) {
        let mut found = Vec::new();
        self.detector.finish(&mut found);
        self.push_boundaries(&mut found);
        let mut live: Vec<(BlockKey, LiveBlock)> = self.blocks.drain().collect();
        live.sort_by_key(|(k, b)| (b.alloc_ts, b.rowid, k.ptr));
        for (key, block) in live {
            close(&mut self.live, key, block, None, false, sink);
        }
    }

    /// The live memory when the trace stopped (`STOP_TRACE`, else the last row), shadow frees not
    /// counted.
    pub fn end_point(&self) -> Option<StepPoint> {
        Some(self.snapshot(None, self.live.bounds.end_ns()?))
    }

    /// `START_TRACE`'s timestamp, else the first memory row's or boundary's.
    pub fn start_ns(&self) -> Option<i64> {
        self.live.bounds.start_ns()
    }

    pub fn summary(&self) -> StepSummary {
        let mut sources: Vec<(Source, u64)> = Vec::new();
        for b in &self.boundaries {
            match sources.iter_mut().find(|(s, _)| *s == b.source) {
                Some((_, n)) => *n += 1,
                None => sources.push((b.source, 1)),
            }
        }
        StepSummary {
            sources,
            duplicates: self.detector.duplicates,
            marks_seen: self.detector.marks_seen.clone(),
            families: Family::ALL.into_iter().filter(|f| self.live.mallocs[*f as usize] > 0).collect(),
            unreadable: self.live.unreadable,
        }
    }
}

/// A [`Timeline`] fed by a shared pass ([`super::pass`]) with other replays, its blocks' ends
/// going to `sink`: what [`Timeline::replay`] does on a pass of its own.
pub struct Replay<S> {
    pub timeline: Timeline,
    pub sink: S,
    marker: Option<String>,
    pattern: Vec<i64>,
}

impl<S: BlockSink> Replay<S> {
    pub fn new(db: &StepDb<'_>, step_marker: Option<&str>, sink: S) -> Result<Self, AnalysisError> {
        let pattern = db.pattern(step_marker)?;
        let timeline = Timeline::with_pattern(step_marker, &pattern);
        Ok(Self { timeline, sink, marker: step_marker.map(str::to_owned), pattern })
    }

    /// After the pass: the finished timeline and the sink, or [`Timeline::replay`]'s refusal of
    /// a marker that named no boundary.
    pub fn finish(mut self, db: &StepDb<'_>) -> Result<(Timeline, S), StepError> {
        self.timeline.finish(&mut self.sink);
        self.timeline.check_marker(db, self.marker.as_deref())?;
        Ok((self.timeline, self.sink))
    }

    /// [`Self::finish`] for a replay without a step marker (it cannot be refused).
    pub fn finish_unmarked(mut self) -> (Timeline, S) {
        debug_assert!(self.marker.is_none());
        self.timeline.finish(&mut self.sink);
        (self.timeline, self.sink)
    }
}

impl<S: BlockSink> super::pass::Consumer for Replay<S> {
    fn selection(&self) -> Selection<'static> {
        SELECTION
    }

    fn row(&mut self, row: DumpRow<'_>) {
        self.timeline.apply(&row, &mut self.sink);
    }

    fn restart(&mut self) {
        self.timeline = Timeline::with_pattern(self.marker.as_deref(), &self.pattern);
        self.sink.restart();
    }
}

/// Step and mark rows for the tests of the step analyses.
#[cfg(any(test, feature = "testing"))]
pub mod testrows {
    use crate::analysis::testdb::{dir, TestDb};
    use crate::store::Attr;

    const MIB: u64 = 1 << 20;

    /// A `STEP` row named `n`, as `memscope.step()` makes it.
    pub fn step(db: &mut TestDb, ts: i64, n: u64) {
        db.row("SYSTEM", "STEP", ts, 1, None, Attr::new());
        let sql = "UPDATE memscope_dump SET Name = ?1 WHERE rowid = last_insert_rowid()";
        db.conn().execute(sql, [n.to_string()]).unwrap();
    }

    /// An MSTX row (`Mark`, `Range_start`) with its quoted message.
    pub fn mstx(db: &mut TestDb, ts: i64, kind: &str, message: &str) {
        db.row("MSTX", kind, ts, 1, None, Attr::new());
        let sql = "UPDATE memscope_dump SET Name = ?1 WHERE rowid = last_insert_rowid()";
        db.conn().execute(sql, [format!("\"{message}\"")]).unwrap();
    }

    /// A training run with `memscope.step()` at the end of each of 6 steps (boundaries at 100,
    /// 200, ..., 600: the step running after boundary k is k + 1).
    pub fn training(name: &str) -> TestDb {
        let mut db = TestDb::create(&dir(name).join("memscope_dump_1.db"));
        db.system("START_TRACE", 1);
        db.malloc("PTA", 10, 0x100, 8 * MIB, Some("PTA@weight")); // step 1: warm-up, kept
        db.malloc("PTA", 20, 0x110, MIB, Some("PTA@kv_cache")); // step 1: warm-up, kept
        for k in 1..=6u64 {
            let ts = 100 * k as i64;
            step(&mut db, ts, k);
            // Temporaries of the step that begins here.
            db.malloc("PTA", ts + 10, 0x900 + k, 3 * MIB, Some("PTA@activation"));
            db.free("PTA", ts + 20, 0x900 + k);
        }
        db
    }

    /// 12 steps; `leak` MiB of kv cache kept per step after the warm-up, under the same noisy
    /// carried-over tensor in both runs.
    pub fn noisy_run(name: &str, leak: bool) -> std::path::PathBuf {
        let mut db = training(name);
        let mut seed = 11u64;
        let mut carried: Option<u64> = None;
        for k in 7..=12u64 {
            step(&mut db, 100 * k as i64, k);
        }
        // Re-walk the steps' insides: one carried tensor of random size alive across each boundary.
        for k in 1..=12u64 {
            let ts = 100 * k as i64 - 50;
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let size = MIB / 2 + (seed >> 33) % (3 * MIB);
            if let Some(p) = carried.take() {
                db.free("PTA", ts, p);
            }
            db.malloc("PTA", ts + 1, 0x5000 + k, size, Some("PTA@carry"));
            carried = Some(0x5000 + k);
            if leak && k >= 2 {
                db.malloc("PTA", ts + 2, 0x7000 + k, 2 * MIB, Some("PTA@kv_cache"));
            }
        }
        db.system("STOP_TRACE", 1_300);
        db.path.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::testrows::{mstx, step};
    use super::*;
    use crate::analysis::testdb::{dir, TestDb};

    #[derive(Default)]
    struct Ends(Vec<BlockEnd>);
    impl BlockSink for Ends {
        fn block_end(&mut self, end: &BlockEnd) {
            self.0.push(*end);
        }
        fn restart(&mut self) {
            self.0.clear();
        }
    }

    fn replay(db: TestDb, marker: Option<&str>) -> (Timeline, Vec<BlockEnd>) {
        let path = db.path.clone();
        drop(db);
        let mut ends = Ends::default();
        let dump = DumpDb::open_read(&path).unwrap();
        let t = Timeline::replay(&StepDb::new(&dump).unwrap(), marker, &mut ends).unwrap();
        (t, ends.0)
    }

    fn steps(t: &Timeline) -> Vec<(u64, i64, Source)> {
        t.boundaries.iter().map(|b| (b.step, b.ts, b.source)).collect()
    }

    #[test]
    fn step_rows_end_the_step_they_name_and_ranges_start_the_next() {
        let mut db = TestDb::create(&dir("steps-kinds").join("memscope_dump_1.db"));
        step(&mut db, 10, 1);
        step(&mut db, 20, 2);
        let (t, _) = replay(db, None);
        assert_eq!(steps(&t), [(1, 10, Source::Step), (2, 20, Source::Step)]);

        // Found from the stacks: read as `step()`'s rows, and said so.
        let mut db = TestDb::create(&dir("steps-inferred").join("memscope_dump_1.db"));
        for (ts, n) in [(10, 1), (20, 2)] {
            db.row("SYSTEM", "STEP", ts, 1, None, crate::store::Attr::new().with("source", "inferred"));
            let sql = "UPDATE memscope_dump SET Name = ?1 WHERE rowid = last_insert_rowid()";
            db.conn().execute(sql, [n.to_string()]).unwrap();
        }
        let (t, _) = replay(db, None);
        assert_eq!(steps(&t), [(1, 10, Source::Inferred), (2, 20, Source::Inferred)]);

        // The tracer's form of a range: a STEP row numbered as the next step, then its twin.
        let mut db = TestDb::create(&dir("steps-ranges").join("memscope_dump_1.db"));
        step(&mut db, 10, 1);
        mstx(&mut db, 10, "Range_start", STEP_RANGE);
        step(&mut db, 20, 2);
        mstx(&mut db, 20, "Range_start", STEP_RANGE);
        let (t, _) = replay(db, None);
        assert_eq!(steps(&t), [(0, 10, Source::Range), (1, 20, Source::Range)]);

        // msMemScope's form: the range row alone.
        let mut db = TestDb::create(&dir("steps-msmemscope").join("memscope_dump_1.db"));
        mstx(&mut db, 10, "Range_start", STEP_RANGE);
        mstx(&mut db, 15, "Range_start", "forward");
        mstx(&mut db, 20, "Range_start", STEP_RANGE);
        let (t, _) = replay(db, None);
        assert_eq!(steps(&t), [(0, 10, Source::Range), (1, 20, Source::Range)]);
    }

    /// `memscope.step()` at the bottom of the loop and a `step start` range at the top: the
    /// tracer writes range 1, step 1, range 2, step 2, ...; each step boundary counts once.
    #[test]
    fn both_markers_for_one_step_count_once() {
        let mut db = TestDb::create(&dir("steps-both").join("memscope_dump_1.db"));
        for i in 1..=3u64 {
            let top = i as i64 * 100;
            step(&mut db, top, i);
            mstx(&mut db, top, "Range_start", STEP_RANGE);
            step(&mut db, top + 90, i);
        }
        let (t, _) = replay(db, None);
        // Range 1 starts step 1; step() 1 ends it; range 2 would start step 2 again: dropped.
        assert_eq!(
            steps(&t),
            [(0, 100, Source::Range), (1, 190, Source::Step), (2, 290, Source::Step), (3, 390, Source::Step)]
        );
        assert_eq!(t.summary().duplicates, 2);
    }

    #[test]
    fn a_step_marker_replaces_step_rows() {
        let mut db = TestDb::create(&dir("steps-marker").join("memscope_dump_1.db"));
        step(&mut db, 5, 1);
        mstx(&mut db, 10, "Mark", "iter");
        mstx(&mut db, 15, "Mark", "other");
        mstx(&mut db, 20, "Mark", "iter");
        let (t, _) = replay(db, Some("iter"));
        assert_eq!(steps(&t), [(0, 10, Source::Marker), (1, 20, Source::Marker)]);
        assert_eq!(t.summary().marks_seen, ["other"]);
    }

    #[test]
    fn the_marks_a_missing_step_marker_lists_are_escaped() {
        let mut db = TestDb::create(&dir("steps-marker-escaped").join("memscope_dump_1.db"));
        mstx(&mut db, 10, "Mark", "x\u{1b}[2J\nmemscope-bpf: forged");
        let path = db.path.clone();
        drop(db);
        let dump = DumpDb::open_read(&path).unwrap();
        let replayed = Timeline::replay(&StepDb::new(&dump).unwrap(), Some("iter"), &mut Ends::default());
        let msg = replayed.err().unwrap().to_string();
        assert!(!msg.contains('\u{1b}') && !msg.contains('\n'), "{msg}");
        assert!(msg.contains("marks and ranges in this trace: x\\u{1b}[2J\\nmemscope-bpf: forged;"), "{msg}");
    }

    #[test]
    fn blocks_get_their_birth_and_end_steps_and_live_bytes_are_snapshotted() {
        let mut db = TestDb::create(&dir("steps-blocks").join("memscope_dump_1.db"));
        db.malloc("PTA", 1, 0xa, 100, Some("PTA@weight")); // before the first boundary: step 1
        db.malloc("PTA", 2, 0xb, 10, None);
        db.free("PTA", 3, 0xb); // ends before any boundary: no step numbers
        step(&mut db, 10, 1);
        db.malloc("PTA", 11, 0xc, 50, Some("PTA@kv"));
        step(&mut db, 20, 2);
        db.free("PTA", 21, 0xc);
        db.malloc("HAL", 22, 0xd, 7, Some("CANN@APP"));
        db.system("STOP_TRACE", 30);
        db.free_marked("HAL", 31, 0xd, "shadow");
        let (t, ends) = replay(db, None);
        type Got = (u64, Option<(u64, u64)>, Option<i64>);
        let got: Vec<Got> = ends.iter().map(|e| (e.ptr, e.steps, e.free_ts)).collect();
        assert_eq!(
            got,
            [(0xb, None, Some(3)), (0xc, Some((2, 3)), Some(21)), (0xa, Some((1, 3)), None), (0xd, Some((3, 3)), None)]
        );
        let totals: Vec<(Option<u64>, i64)> = t.points.iter().map(|p| (p.step, p.total(Family::Pta))).collect();
        assert_eq!(totals, [(Some(1), 100), (Some(2), 150)]);
        let at2: Vec<(&str, i64)> = t.points[1].owners.iter().map(|o| (t.owner(o.slot).1, o.bytes)).collect();
        assert_eq!(at2, [("PTA@weight", 100), ("PTA@kv", 50)]);
        let end = t.end_point().unwrap();
        assert_eq!((end.ts, end.total(Family::Pta), end.total(Family::Hal)), (30, 100, 7));
    }
}
