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
//! time is the read plus a map lookup per row. Writing and printing the results is [`out`]'s.

use super::blocks::Family;
use super::db::{DumpDb, Fed, ReadOrder, Selection, TimeOrder};
use super::AnalysisError;
use crate::vocab::Event;

mod flags;
pub mod out;
mod replay;
#[cfg(any(test, feature = "testing"))]
pub mod scenario;
#[cfg(test)]
mod tests;

pub use flags::*;
use replay::Replay;

/// Which API index a block's events advance: msMemScope keeps one per process for aten ops and
/// the PTA caching pool, one for ATB ops and the ATB pool, and judges no other memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpFamily {
    Aten,
    Atb,
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
