//! Fragmentation of the caching allocator over time, replayed offline from `memscope_dump`: per
//! device, reserved − allocated, the largest free piece inside cached segments, the free pieces
//! inside segments that still hold tensors (holes), and the count of splits. It also collects the
//! evidence the advisor reasons from (growth of reserved memory that fragmentation forced, big
//! segments pinned by small tensors, cache flushes at a ceiling) and hands the live state to the
//! OOM forensics at each failed allocation. Stored as `ms_fragmentation` (docs/db-schema.md).
//!
//! The pools themselves (segments carved into blocks and free pieces, splits) are
//! [`super::pool`]'s model, shared with the OOM forensics; the replay (`replay.rs`) feeds it the
//! rows and collects this analysis's evidence on top. This module holds the results and their
//! table.

use rusqlite::{params, Transaction};
use serde::Serialize;

use super::db::{DumpDb, DumpRow, Fed, Selection};
use super::incidents::Incident;
pub use super::pool::{Reason, Sample, LARGE_SEGMENT, MIB, SMALL_REQUEST};
use super::AnalysisError;
use crate::vocab::Event;

/// Trace DBs for the tests of this module, `oom` and `advise`: pool segments, blocks, OOM rows,
/// steps and settings with the Attr keys the tracer writes (docs/db-schema.md).
#[cfg(any(test, feature = "testing"))]
pub mod fx;
mod replay;
#[cfg(test)]
mod tests;

use replay::Replay;

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

/// Replays a DB.
pub fn analyse(db: &DumpDb, options: Options) -> Result<Report, AnalysisError> {
    let order = db.rows(SELECTION)?;
    let every = std::cell::Cell::new(options.sample_every.unwrap_or(0));
    let new = || Replay::new(options.top_k, every.get());
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
        Replay::new(top_k, every)
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
        const COUNTED: &[&str] = &[Event::Malloc.as_str(), Event::Free.as_str()];
        self.options.sample_every.is_none().then_some(COUNTED)
    }

    fn count(&mut self, rows: u64) {
        self.every = rows.div_ceil(500).max(100);
    }
}
