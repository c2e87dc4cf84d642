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

use std::path::Path;

use rusqlite::{params, Connection, OpenFlags, Transaction, TransactionBehavior};
use serde::Serialize;

use super::db::{Fed, Selection, TimeOrder};
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

/// Opens a DB that `DumpDb::open` already checked, read-only, for queries of our own (the rows
/// themselves are read by [`TimeOrder`] on a connection of its own).
pub(crate) fn open_read(path: &Path) -> Result<Connection, AnalysisError> {
    let conn = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX)
        .map_err(|e| AnalysisError::NotSqlite { path: path.to_owned(), why: e.to_string() })?;
    conn.busy_timeout(std::time::Duration::from_secs(5))
        .map_err(|source| AnalysisError::Read { path: path.to_owned(), source })?;
    Ok(conn)
}

fn read_error(path: &Path) -> impl Fn(rusqlite::Error) -> AnalysisError + '_ {
    move |source| AnalysisError::Read { path: path.to_owned(), source }
}

/// `memscope_dump`, or msLeaks' older `leaks_dump`.
pub(crate) fn dump_table(path: &Path, conn: &Connection) -> Result<String, AnalysisError> {
    conn.query_row(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name IN ('memscope_dump', 'leaks_dump') \
         ORDER BY name = 'memscope_dump' DESC LIMIT 1",
        [],
        |r| r.get(0),
    )
    .map_err(read_error(path))
}

/// The rows the replay reads; columns that older writers lack (`Name`, `Thread Id`) read as
/// empty (the thread as the process).
const SELECTION: Selection = Selection {
    events: &[Event::Malloc.as_str(), Event::Free.as_str(), Event::System.as_str(), Event::OomDetail.as_str()],
    name: true,
    thread: true,
};

/// Replays a DB (already checked by `DumpDb::open`).
pub fn analyse(path: &Path, options: Options) -> Result<Report, AnalysisError> {
    let conn = open_read(path)?;
    let table = dump_table(path, &conn)?;
    let order = TimeOrder::new(&conn, path, &table, SELECTION)?;
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

/// Replaces our result tables `tables` (name, CREATE statement) and fills them with `fill`, then
/// stamps `ms_meta.<meta_key>` when the file has our `ms_meta` (msMemScope's DBs do not, and get
/// nothing else). One transaction on a connection that cannot create the file: either all of it
/// lands or the file is unchanged. Returns what `fill` counted.
pub(crate) fn write_tables(
    path: &Path,
    tables: &[(&str, &str)],
    meta_key: &str,
    run_wall_ns: u64,
    fill: impl FnOnce(&Transaction<'_>) -> rusqlite::Result<usize>,
) -> Result<usize, AnalysisError> {
    let err = |source| AnalysisError::Write { path: path.to_owned(), source };
    let mut conn =
        Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX)
            .map_err(|e| AnalysisError::NotSqlite { path: path.to_owned(), why: e.to_string() })?;
    if conn.is_readonly(rusqlite::DatabaseName::Main).unwrap_or(true) {
        return Err(AnalysisError::ReadOnly { path: path.to_owned() });
    }
    conn.busy_timeout(std::time::Duration::from_secs(5)).map_err(err)?;
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(err)?;
    for (name, create) in tables {
        tx.execute_batch(&format!("DROP TABLE IF EXISTS {name}; {create}")).map_err(err)?;
    }
    let written = fill(&tx).map_err(err)?;
    super::db::stamp_meta(&tx, &[(meta_key, run_wall_ns.to_string())]).map_err(err)?;
    tx.commit().map_err(err)?;
    Ok(written)
}

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
