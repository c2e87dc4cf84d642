//! Trace DBs as analysis input and output: which files a folder holds, opening one without
//! creating or damaging anything, streaming its `memscope_dump` rows in time order, and writing
//! results into our own tables in a single transaction.
//!
//! Safety of the user's file comes first: a DB is opened without SQLITE_OPEN_CREATE (a typo never
//! leaves an empty DB behind), read-only unless results are to be written, and every write is one
//! transaction, so a failure leaves the file exactly as it was.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rusqlite::types::ValueRef;
use rusqlite::{params, Connection, DatabaseName, OpenFlags, TransactionBehavior};

use super::decompose::Report;
use super::AnalysisError;
use crate::store::schema::DUMP_TABLE;

/// The older name msMemScope (as msLeaks) and prof2memscope used; Insight accepts both.
const LEGACY_DUMP_TABLE: &str = "leaks_dump";

/// Columns the analyses read.
const NEEDED_COLUMNS: [&str; 8] =
    ["ID", "Event", "Event Type", "Timestamp(ns)", "Process Id", "Device Id", "Ptr", "Attr"];

/// Our decomposition table (docs/db-schema.md, "ms_decompose"). Dropped and recreated on every
/// run so that it always describes the latest analysis and reruns never duplicate rows.
pub const DECOMPOSE_TABLE: &str = "ms_decompose";
const CREATE_DECOMPOSE: &str = "CREATE TABLE ms_decompose (
    point TEXT NOT NULL, ts_ns INTEGER NOT NULL, family TEXT NOT NULL, owner TEXT NOT NULL,
    depth INTEGER NOT NULL, bytes INTEGER NOT NULL, blocks INTEGER NOT NULL)";

/// A DB found for analysis, with the device its folder names (`device_<id>`), if any.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DbFile {
    pub path: PathBuf,
    pub device: Option<String>,
}

/// Whether a file name is one Insight would open: `memscope_dump_*.db` (or the older `leaks_dump_*`).
fn is_dump_name(name: &str) -> bool {
    (name.starts_with("memscope_dump_") || name.starts_with("leaks_dump_")) && name.ends_with(".db")
}

/// The device a path's `device_<id>` folder names.
pub fn device_from_path(path: &Path) -> Option<String> {
    path.ancestors()
        .skip(1)
        .filter_map(|p| p.file_name()?.to_str())
        .find_map(|name| name.strip_prefix("device_").filter(|d| !d.is_empty()).map(str::to_owned))
}

/// Device order for reports: NPUs by number, then `cpu`, then anything else by name.
pub fn device_order(device: Option<&str>) -> (u8, u64, String) {
    match device {
        Some(d) => match d.parse::<u64>() {
            Ok(n) => (0, n, String::new()),
            Err(_) if d == "cpu" => (1, 0, String::new()),
            Err(_) => (2, 0, d.to_owned()),
        },
        None => (3, 0, String::new()),
    }
}

fn read_dir(dir: &Path) -> Result<Vec<PathBuf>, AnalysisError> {
    let entries = fs::read_dir(dir).map_err(|source| AnalysisError::Io { path: dir.to_owned(), source })?;
    let mut paths = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| AnalysisError::Io { path: dir.to_owned(), source })?;
        paths.push(entry.path());
    }
    paths.sort();
    Ok(paths)
}

fn dump_files_in(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), AnalysisError> {
    if !dir.is_dir() {
        return Ok(());
    }
    for path in read_dir(dir)? {
        if path.is_file() && path.file_name().and_then(|n| n.to_str()).is_some_and(is_dump_name) {
            out.push(path);
        }
    }
    Ok(())
}

fn device_dirs(run: &Path) -> Result<Vec<PathBuf>, AnalysisError> {
    Ok(read_dir(run)?
        .into_iter()
        .filter(|p| p.is_dir() && p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("device_")))
        .collect())
}

/// The DBs an input names: the file itself, or every `device_*/dump/memscope_dump_*.db` of a
/// trace folder. A folder may be the trace's output folder, the folder holding several of them
/// (`memscopeDumpResults/`), or one device's (`device_0/` or its `dump/`): users point at
/// whichever level they are looking at. Reports come per run folder, in device order.
pub fn discover(input: &Path) -> Result<Vec<DbFile>, AnalysisError> {
    let meta = fs::metadata(input).map_err(|source| match source.kind() {
        std::io::ErrorKind::NotFound => AnalysisError::NotFound { path: input.to_owned() },
        _ => AnalysisError::Io { path: input.to_owned(), source },
    })?;
    if !meta.is_dir() {
        return Ok(vec![DbFile { path: input.to_owned(), device: device_from_path(input) }]);
    }
    let mut found = Vec::new();
    dump_files_in(input, &mut found)?; // a dump/ folder
    dump_files_in(&input.join("dump"), &mut found)?; // a device_<id>/ folder
    for device in device_dirs(input)? {
        dump_files_in(&device.join("dump"), &mut found)?; // a run folder
    }
    for run in read_dir(input)?.into_iter().filter(|p| p.is_dir()) {
        for device in device_dirs(&run)? {
            dump_files_in(&device.join("dump"), &mut found)?; // the folder holding runs
        }
    }
    if found.is_empty() {
        return Err(AnalysisError::NoDbInFolder { path: input.to_owned() });
    }
    let mut files: Vec<DbFile> =
        found.into_iter().map(|path| DbFile { device: device_from_path(&path), path }).collect();
    // Run folder (three levels up: <run>/device_<id>/dump/<file>), then device, then name.
    files.sort_by_cached_key(|f| {
        let run = f.path.ancestors().nth(3).map(Path::to_path_buf);
        (run, device_order(f.device.as_deref()), f.path.clone())
    });
    files.dedup();
    Ok(files)
}

/// Text of a column; numbers written as text by other tools read as "" here, which only drops
/// rows Insight would drop too.
pub(crate) fn text(v: ValueRef<'_>) -> &str {
    match v {
        ValueRef::Text(t) => std::str::from_utf8(t).unwrap_or(""),
        _ => "",
    }
}

/// An integer column that other writers may have stored as text or real.
pub(crate) fn int(v: ValueRef<'_>) -> i64 {
    match v {
        ValueRef::Integer(i) => i,
        ValueRef::Real(f) => f as i64,
        ValueRef::Text(t) => std::str::from_utf8(t).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0),
        _ => 0,
    }
}

// ---------------------------------------------------------------- rows in time order

/// One row of the dump, borrowed from SQLite's buffers (10M rows must not mean 70M allocations).
#[derive(Clone, Copy, Debug)]
pub struct DumpRow<'a> {
    /// SQLite's rowid: the last tie-break, and how a reported row is fetched again.
    pub rowid: i64,
    pub id: i64,
    pub event: &'a str,
    pub event_type: &'a str,
    /// `Name`; "" unless [`Selection::name`] asked for it or when the table lacks it.
    pub name: &'a str,
    pub ts: i64,
    pub pid: i64,
    /// `Thread Id`; the process id unless [`Selection::thread`] asked for it or when the table
    /// lacks it.
    pub tid: i64,
    pub ptr: &'a str,
    pub attr: &'a str,
}

/// What [`TimeOrder::for_each_row`] hands over.
pub enum Fed<'a> {
    Row(DumpRow<'a>),
    /// Forget every row so far: they come again, from the first.
    Restart,
}

/// The rows a replay reads (by `Event`) and the optional columns it needs.
#[derive(Clone, Copy, Debug)]
pub struct Selection {
    pub events: &'static [&'static str],
    pub name: bool,
    pub thread: bool,
}

/// How the rows came, for tests and for explaining a slow run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadOrder {
    /// In storage order, the few rows stored late put back in their place.
    Storage,
    /// Sorted by SQLite: too many rows out of place.
    Sorted,
    /// Sorted by SQLite after a [`Fed::Restart`]: more rows had to wait than expected.
    Restarted,
}

/// (`Timestamp(ns)`, `ID`, rowid): the order rows are replayed in.
type Key = (i64, i64, i64);

/// Past this many out-of-place rows, SQLite's sort is cheaper than holding rows back.
const MAX_STRAGGLERS: usize = 100_000;
/// Rows held back at once before giving up on streaming (about 300 bytes each).
const MAX_HELD: usize = 500_000;

/// A row held back until its place, owning its text in one allocation.
struct HeldRow {
    key: Key,
    pid: i64,
    tid: i64,
    text: String,
    /// Ends of event, event type, name, ptr in `text`; attr is the rest.
    ends: [usize; 4],
}

impl HeldRow {
    fn from(r: &DumpRow<'_>) -> Self {
        let parts = [r.event, r.event_type, r.name, r.ptr];
        let mut text = String::with_capacity(parts.iter().map(|p| p.len()).sum::<usize>() + r.attr.len());
        let mut ends = [0; 4];
        for (end, part) in ends.iter_mut().zip(parts) {
            text.push_str(part);
            *end = text.len();
        }
        text.push_str(r.attr);
        Self { key: (r.ts, r.id, r.rowid), pid: r.pid, tid: r.tid, text, ends }
    }

    fn as_row(&self) -> DumpRow<'_> {
        let e = self.ends;
        DumpRow {
            rowid: self.key.2,
            id: self.key.1,
            event: &self.text[..e[0]],
            event_type: &self.text[e[0]..e[1]],
            name: &self.text[e[1]..e[2]],
            ts: self.key.0,
            pid: self.pid,
            tid: self.tid,
            ptr: &self.text[e[2]..e[3]],
            attr: &self.text[e[3]..],
        }
    }
}

/// Streams a dump table's rows in time order (`Timestamp(ns)`, then `ID`, as Insight orders
/// them; IDs break ties because a thread's rows are written in call order; rowid last), the one
/// way every analysis reads them.
///
/// Sorting whole rows is most of the cost of a large trace, and traces are stored nearly in that
/// order already (ours per thread exactly, `STOP_TRACE` after the shadow frees stamped one ns
/// later, rows of CPUs racing for the ring a few apart). So a first pass reads only the keys in
/// storage order and finds the rows stored later than their place (stragglers); a second pass
/// streams the rows in storage order straight from SQLite's buffers and holds back only what
/// must wait for a straggler. Files far out of order (msMemScope writes a MALLOC when its block
/// is freed) are sorted by SQLite instead; should the held-back rows grow too many after all,
/// `f` gets [`Fed::Restart`] and the sorted rows from the start.
pub struct TimeOrder<'c> {
    conn: &'c Connection,
    path: &'c Path,
    /// `FROM "table" WHERE ...`, shared by both passes.
    from: String,
    /// The columns of a [`DumpRow`], in its order.
    columns: String,
    events: &'static [&'static str],
    max_stragglers: usize,
    max_held: usize,
}

impl<'c> TimeOrder<'c> {
    pub fn new(conn: &'c Connection, path: &'c Path, table: &str, select: Selection) -> Result<Self, AnalysisError> {
        let read = |source| AnalysisError::Read { path: path.to_owned(), source };
        let have: Vec<String> = conn
            .prepare("SELECT name FROM pragma_table_info(?1)")
            .and_then(|mut s| s.query_map([table], |r| r.get(0))?.collect())
            .map_err(read)?;
        let has = |c: &str| have.iter().any(|h| h == c);
        let name = if select.name && has("Name") { "\"Name\"" } else { "''" };
        let tid = if select.thread && has("Thread Id") { "\"Thread Id\"" } else { "\"Process Id\"" };
        let columns = format!(
            "rowid, \"ID\", \"Event\", \"Event Type\", {name}, \"Timestamp(ns)\", \"Process Id\", {tid}, \"Ptr\", \"Attr\""
        );
        // `=` terms rather than IN: SQLite probes a temporary index per row for an IN list.
        let wanted: Vec<String> =
            select.events.iter().map(|e| format!("\"Event\" = '{}'", e.replace('\'', "''"))).collect();
        let from = format!("FROM \"{}\" WHERE ({})", table.replace('"', "\"\""), wanted.join(" OR "));
        Ok(Self {
            conn,
            path,
            from,
            columns,
            events: select.events,
            max_stragglers: MAX_STRAGGLERS,
            max_held: MAX_HELD,
        })
    }

    /// Lowers the thresholds, for tests to reach the fallbacks on small files.
    #[cfg(test)]
    pub(crate) fn with_limits(mut self, max_stragglers: usize, max_held: usize) -> Self {
        (self.max_stragglers, self.max_held) = (max_stragglers, max_held);
        self
    }

    fn read_err(&self) -> impl Fn(rusqlite::Error) -> AnalysisError + '_ {
        move |source| AnalysisError::Read { path: self.path.to_owned(), source }
    }

    /// Reads the keys (the first pass) and returns what the second needs; both see one snapshot
    /// of the file, even if a trace is still appending to it, until the [`Scan`] is dropped.
    pub fn scan(&self) -> Result<Scan<'_, 'c>, AnalysisError> {
        let began = self.conn.is_autocommit();
        if began {
            self.conn.execute_batch("BEGIN").map_err(self.read_err())?;
        }
        let mut scan = Scan { order: self, began, stragglers: None, counts: None };
        scan.find_stragglers()?;
        Ok(scan)
    }

    /// [`Self::scan`], then [`Scan::for_each_row`].
    pub fn for_each_row(&self, f: impl FnMut(Fed<'_>)) -> Result<ReadOrder, AnalysisError> {
        self.scan()?.for_each_row(f)
    }

    fn row<'r>(&self, row: &'r rusqlite::Row<'r>) -> Result<DumpRow<'r>, AnalysisError> {
        let get = |i| row.get_ref(i).map_err(self.read_err());
        Ok(DumpRow {
            rowid: int(get(0)?),
            id: int(get(1)?),
            event: text(get(2)?),
            event_type: text(get(3)?),
            name: text(get(4)?),
            ts: int(get(5)?),
            pid: int(get(6)?),
            tid: int(get(7)?),
            ptr: text(get(8)?),
            attr: text(get(9)?),
        })
    }
}

/// A first pass done: the stragglers, and how many rows of each selected event there are.
pub struct Scan<'o, 'c> {
    order: &'o TimeOrder<'c>,
    /// Whether this scan opened the read transaction (and so ends it).
    began: bool,
    /// `None`: too many to stream, SQLite sorts.
    stragglers: Option<BTreeSet<Key>>,
    /// Rows per entry of [`Selection::events`]; `None` when the pass stopped early.
    counts: Option<Vec<u64>>,
}

impl Drop for Scan<'_, '_> {
    fn drop(&mut self) {
        if self.began {
            let _ = self.order.conn.execute_batch("COMMIT");
        }
    }
}

impl Scan<'_, '_> {
    /// The rows whose `Event` is one of `events` (each among the selected ones).
    pub fn count(&self, events: &[&str]) -> Result<u64, AnalysisError> {
        if let Some(counts) = &self.counts {
            let selected = self.order.events.iter().zip(counts);
            return Ok(selected.filter(|(e, _)| events.contains(e)).map(|(_, n)| n).sum());
        }
        let wanted: Vec<String> = events.iter().map(|e| format!("'{}'", e.replace('\'', "''"))).collect();
        let sql = format!("SELECT count(*) {} AND \"Event\" IN ({})", self.order.from, wanted.join(","));
        let n: i64 = self.order.conn.query_row(&sql, [], |r| r.get(0)).map_err(self.order.read_err())?;
        Ok(n as u64)
    }

    /// The keys of the rows that, in storage order, come after a row with a greater key.
    fn find_stragglers(&mut self) -> Result<(), AnalysisError> {
        let order = self.order;
        let sql = format!("SELECT \"Timestamp(ns)\", \"ID\", rowid, \"Event\" {} ORDER BY rowid", order.from);
        let mut stmt = order.conn.prepare(&sql).map_err(order.read_err())?;
        let mut rows = stmt.query([]).map_err(order.read_err())?;
        let mut max: Option<Key> = None;
        let mut stragglers = BTreeSet::new();
        let mut counts = vec![0u64; order.events.len()];
        while let Some(row) = rows.next().map_err(order.read_err())? {
            let get = |i| row.get_ref(i).map_err(order.read_err());
            let key = (int(get(0)?), int(get(1)?), int(get(2)?));
            let event = text(get(3)?);
            if let Some(n) = order.events.iter().position(|e| *e == event) {
                counts[n] += 1;
            }
            if max.is_some_and(|m| key < m) {
                stragglers.insert(key);
                if stragglers.len() > order.max_stragglers {
                    return Ok(()); // SQLite sorts; counts are looked up if asked for
                }
            } else {
                max = Some(key);
            }
        }
        (self.stragglers, self.counts) = (Some(stragglers), Some(counts));
        Ok(())
    }

    /// Calls `f` for every selected row in time order, then returns how they came.
    pub fn for_each_row(mut self, mut f: impl FnMut(Fed<'_>)) -> Result<ReadOrder, AnalysisError> {
        let mut how = ReadOrder::Sorted;
        if let Some(stragglers) = self.stragglers.take() {
            if self.stream_storage_order(stragglers, &mut f)? {
                return Ok(ReadOrder::Storage);
            }
            f(Fed::Restart);
            how = ReadOrder::Restarted;
        }
        let order = self.order;
        let sql = format!("SELECT {} {} ORDER BY \"Timestamp(ns)\", \"ID\", rowid", order.columns, order.from);
        let mut stmt = order.conn.prepare(&sql).map_err(order.read_err())?;
        let mut rows = stmt.query([]).map_err(order.read_err())?;
        while let Some(row) = rows.next().map_err(order.read_err())? {
            f(Fed::Row(order.row(row)?));
        }
        Ok(how)
    }

    /// The second pass; `false` when it gave up (too many rows held back).
    fn stream_storage_order(
        &self,
        mut pending: BTreeSet<Key>,
        f: &mut impl FnMut(Fed<'_>),
    ) -> Result<bool, AnalysisError> {
        let order = self.order;
        let sql = format!("SELECT {} {} ORDER BY rowid", order.columns, order.from);
        let mut stmt = order.conn.prepare(&sql).map_err(order.read_err())?;
        let mut rows = stmt.query([]).map_err(order.read_err())?;
        let mut held: BTreeMap<Key, HeldRow> = BTreeMap::new();
        while let Some(row) = rows.next().map_err(order.read_err())? {
            let r = order.row(row)?;
            let key = (r.ts, r.id, r.rowid);
            if !pending.is_empty() {
                pending.remove(&key);
            }
            // Everything not yet read has a greater key than `key`, except the stragglers to come.
            if held.is_empty() && pending.first().is_none_or(|p| key < *p) {
                f(Fed::Row(r));
                continue;
            }
            held.insert(key, HeldRow::from(&r));
            if held.len() > order.max_held {
                return Ok(false);
            }
            while let Some(entry) = held.first_entry() {
                if pending.first().is_some_and(|p| p < entry.key()) {
                    break;
                }
                f(Fed::Row(entry.remove().as_row()));
            }
        }
        for r in held.into_values() {
            f(Fed::Row(r.as_row()));
        }
        Ok(true)
    }
}

/// An open trace DB.
pub struct DumpDb {
    path: PathBuf,
    conn: Connection,
    table: &'static str,
}

impl DumpDb {
    /// Opens and checks `path`: an SQLite file with a dump table holding the columns the analyses
    /// read. With `write`, also that the results can be written back.
    pub fn open(path: &Path, write: bool) -> Result<Self, AnalysisError> {
        Self::check_header(path)?;
        let flags = if write { OpenFlags::SQLITE_OPEN_READ_WRITE } else { OpenFlags::SQLITE_OPEN_READ_ONLY }
            | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let not_sqlite = |e: rusqlite::Error| AnalysisError::NotSqlite { path: path.to_owned(), why: e.to_string() };
        let conn = Connection::open_with_flags(path, flags).map_err(not_sqlite)?;
        // Insight or a still-running trace may hold the lock for a moment.
        conn.busy_timeout(Duration::from_secs(5)).map_err(not_sqlite)?;
        Self::from_connection(path, conn, write)
    }

    fn check_header(path: &Path) -> Result<(), AnalysisError> {
        let io = |source| AnalysisError::Io { path: path.to_owned(), source };
        let mut head = Vec::with_capacity(16);
        fs::File::open(path).map_err(io)?.take(16).read_to_end(&mut head).map_err(io)?;
        let why = if head.is_empty() {
            "the file is empty"
        } else if head.starts_with(b"ID,Event") {
            "it is a CSV trace"
        } else if head != b"SQLite format 3\0" {
            "no SQLite header"
        } else {
            return Ok(());
        };
        Err(AnalysisError::NotSqlite { path: path.to_owned(), why: why.to_owned() })
    }

    /// The checks that need an open connection (split out so tests can hand in a read-only one).
    fn from_connection(path: &Path, conn: Connection, write: bool) -> Result<Self, AnalysisError> {
        let not_sqlite = |e: rusqlite::Error| AnalysisError::NotSqlite { path: path.to_owned(), why: e.to_string() };
        // The first real read: a damaged or encrypted file fails here.
        let tables: Vec<String> = conn
            .prepare("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
            .and_then(|mut s| s.query_map([], |r| r.get(0))?.collect())
            .map_err(not_sqlite)?;
        let table = if tables.iter().any(|t| t == DUMP_TABLE) {
            DUMP_TABLE
        } else if tables.iter().any(|t| t == LEGACY_DUMP_TABLE) {
            LEGACY_DUMP_TABLE
        } else {
            let tables = if tables.is_empty() { "none".to_owned() } else { tables.join(", ") };
            return Err(AnalysisError::NoDumpTable { path: path.to_owned(), tables });
        };
        let columns: Vec<String> = conn
            .prepare("SELECT name FROM pragma_table_info(?1)")
            .and_then(|mut s| s.query_map([table], |r| r.get(0))?.collect())
            .map_err(|source| AnalysisError::Read { path: path.to_owned(), source })?;
        let missing: Vec<&str> = NEEDED_COLUMNS.into_iter().filter(|c| !columns.iter().any(|have| have == c)).collect();
        if !missing.is_empty() {
            return Err(AnalysisError::MissingColumns {
                path: path.to_owned(),
                table: table.to_owned(),
                missing: missing.join(", "),
            });
        }
        // Checked before the analysis, so a read-only file costs one line, not a wasted pass.
        if write && conn.is_readonly(DatabaseName::Main).unwrap_or(true) {
            return Err(AnalysisError::ReadOnly { path: path.to_owned() });
        }
        Ok(Self { path: path.to_owned(), conn, table })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn read_err(&self) -> impl Fn(rusqlite::Error) -> AnalysisError + '_ {
        move |source| AnalysisError::Read { path: self.path.clone(), source }
    }

    /// The distinct `Device Id`s of the memory rows (for a DB whose folder does not name its device).
    pub fn devices(&self) -> Result<Vec<String>, AnalysisError> {
        let sql = format!(
            "SELECT DISTINCT \"Device Id\" FROM \"{}\" WHERE \"Event\" IN ('MALLOC','FREE') LIMIT 16",
            self.table
        );
        let mut stmt = self.conn.prepare(&sql).map_err(self.read_err())?;
        let mut rows = stmt.query([]).map_err(self.read_err())?;
        let mut devices = Vec::new();
        while let Some(row) = rows.next().map_err(self.read_err())? {
            let v = row.get_ref(0).map_err(self.read_err())?;
            devices.push(match v {
                ValueRef::Integer(i) => i.to_string(),
                v => text(v).to_owned(),
            });
        }
        devices.sort_by_key(|d| device_order(Some(d)));
        Ok(devices)
    }

    /// Calls `f` for every MALLOC, FREE and SYSTEM row in time order (see [`TimeOrder`]).
    pub fn for_each_row(&self, f: impl FnMut(Fed<'_>)) -> Result<ReadOrder, AnalysisError> {
        let select = Selection { events: &["MALLOC", "FREE", "SYSTEM"], name: false, thread: false };
        TimeOrder::new(&self.conn, &self.path, self.table, select)?.for_each_row(f)
    }

    /// Replaces `ms_decompose` with `report` and stamps `ms_meta.decompose_at` (when the DB has our
    /// `ms_meta`; msMemScope's DBs do not, and we add nothing else to them). One transaction:
    /// either all of it lands or the file is unchanged. Returns the rows written.
    pub fn write_decompose(&mut self, report: &Report, run_wall_ns: u64) -> Result<usize, AnalysisError> {
        let path = self.path.clone();
        let err = |source| AnalysisError::Write { path: path.clone(), source };
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(err)?;
        tx.execute_batch(&format!("DROP TABLE IF EXISTS {DECOMPOSE_TABLE}; {CREATE_DECOMPOSE}")).map_err(err)?;
        let mut written = 0;
        {
            let mut insert = tx
                .prepare(&format!(
                    "INSERT INTO {DECOMPOSE_TABLE} (point, ts_ns, family, owner, depth, bytes, blocks) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)"
                ))
                .map_err(err)?;
            for point in &report.points {
                for tree in &point.trees {
                    for node in &tree.nodes {
                        insert
                            .execute(params![
                                point.kind.as_str(),
                                point.ts_ns,
                                tree.family.as_str(),
                                node.path,
                                node.depth as i64,
                                node.bytes,
                                node.blocks as i64
                            ])
                            .map_err(err)?;
                        written += 1;
                    }
                }
            }
        }
        let has_meta: bool = tx
            .query_row("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'ms_meta'", [], |r| {
                r.get::<_, i64>(0)
            })
            .map_err(err)?
            > 0;
        if has_meta {
            // Delete then insert: works whether or not `key` is unique in this file.
            tx.execute("DELETE FROM ms_meta WHERE key = 'decompose_at'", []).map_err(err)?;
            tx.execute("INSERT INTO ms_meta (key, value) VALUES ('decompose_at', ?1)", [run_wall_ns.to_string()])
                .map_err(err)?;
        }
        tx.commit().map_err(err)?;
        Ok(written)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::testdb::{dir, TestDb};

    #[test]
    fn missing_file_is_named_with_the_fix() {
        let d = dir("missing");
        let err = discover(&d.join("nope.db")).unwrap_err();
        assert!(matches!(err, AnalysisError::NotFound { .. }));
        assert!(err.to_string().contains("nope.db") && err.to_string().contains("memscope_dump_*.db"));
        // Opening directly must not create it either.
        assert!(DumpDb::open(&d.join("nope.db"), true).is_err());
        assert!(!d.join("nope.db").exists());
    }

    #[test]
    fn non_db_files_are_refused_untouched() {
        let d = dir("nondb");
        let csv = d.join("memscope_dump_1.csv");
        fs::write(&csv, "ID,Event,Event Type\n1,MALLOC,HAL\n").unwrap();
        let err = DumpDb::open(&csv, true).err().unwrap();
        assert!(err.to_string().contains("CSV trace"), "{err}");
        let junk = d.join("junk.db");
        fs::write(&junk, "hello, not a database at all").unwrap();
        assert!(matches!(DumpDb::open(&junk, true), Err(AnalysisError::NotSqlite { .. })));
        assert_eq!(fs::read(&junk).unwrap(), b"hello, not a database at all");
        let empty = d.join("empty.db");
        fs::write(&empty, "").unwrap();
        let err = DumpDb::open(&empty, true).err().unwrap();
        assert!(err.to_string().contains("empty"), "{err}");
    }

    #[test]
    fn db_without_dump_table_is_refused() {
        let d = dir("notable");
        let path = d.join("other.db");
        Connection::open(&path).unwrap().execute_batch("CREATE TABLE t (x); CREATE TABLE u (y)").unwrap();
        let err = DumpDb::open(&path, true).err().unwrap();
        assert!(matches!(err, AnalysisError::NoDumpTable { .. }));
        assert!(err.to_string().contains("no memscope_dump table (tables: t, u)"), "{err}");
        // A dump table missing columns Insight needs.
        Connection::open(&path).unwrap().execute_batch("CREATE TABLE memscope_dump (ID, Event)").unwrap();
        let err = DumpDb::open(&path, false).err().unwrap();
        assert!(err.to_string().contains("\"Event Type\"") || err.to_string().contains("Event Type"), "{err}");
    }

    #[test]
    fn read_only_db_is_refused_before_any_work() {
        let d = dir("readonly");
        let db = TestDb::create(&d.join("memscope_dump_1.db"));
        let path = db.path.clone();
        drop(db);
        // Root ignores file modes, so hand in a read-only connection instead of chmod-ing.
        let conn = Connection::open_with_flags(&path, OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
        let err = DumpDb::from_connection(&path, conn, true).err().unwrap();
        assert!(matches!(err, AnalysisError::ReadOnly { .. }));
        assert!(err.to_string().contains("--no-write"));
        // Without writing, a read-only file is fine.
        let conn = Connection::open_with_flags(&path, OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
        assert!(DumpDb::from_connection(&path, conn, false).is_ok());
    }

    #[test]
    fn a_failed_write_changes_nothing() {
        use crate::analysis::decompose::{analyse, TimeSpec};
        let d = dir("rollback");
        let mut db = TestDb::create(&d.join("memscope_dump_1.db"));
        db.malloc("HAL", 10, 0x1, 100, Some("CANN@APP"));
        db.malloc("HAL", 20, 0x2, 50, Some("CANN@HCCL"));
        let path = db.path.clone();
        drop(db);
        let count = |sql: &str| -> i64 { Connection::open(&path).unwrap().query_row(sql, [], |r| r.get(0)).unwrap() };
        let mut dump = DumpDb::open(&path, true).unwrap();
        let first = analyse(&dump, &[TimeSpec::End]).unwrap();
        assert_eq!(dump.write_decompose(&first, 1).unwrap(), 4);
        // Make the last statement of the next write fail, after ms_decompose was dropped and refilled.
        Connection::open(&path)
            .unwrap()
            .execute_batch("CREATE TRIGGER no_meta BEFORE INSERT ON ms_meta BEGIN SELECT RAISE(ABORT, 'no'); END")
            .unwrap();
        let second = analyse(&dump, &[TimeSpec::Peak, TimeSpec::End]).unwrap();
        let err = dump.write_decompose(&second, 2).unwrap_err();
        assert!(matches!(err, AnalysisError::Write { .. }), "{err}");
        assert!(err.to_string().contains("nothing was changed"));
        assert_eq!(count("SELECT count(*) FROM ms_decompose"), 4, "the first run's rows are still there");
        assert_eq!(count("SELECT count(*) FROM ms_meta WHERE key = 'decompose_at' AND value = '1'"), 1);
        assert_eq!(count("SELECT count(*) FROM memscope_dump"), 2);
    }

    #[test]
    fn folders_are_searched_at_every_level_in_device_order() {
        let root = dir("discover");
        let run = root.join("memscope_42_20260101000000_ascend");
        for dev in ["cpu", "10", "2", "unknown", "0"] {
            TestDb::create(&run.join(format!("device_{dev}/dump/memscope_dump_20260101000000.db")));
        }
        fs::write(run.join("device_0/dump/memscope_dump_20260101000000.csv"), "ID,Event").unwrap();
        let want = ["0", "2", "10", "cpu", "unknown"];
        for input in [&root, &run] {
            let found = discover(input).unwrap();
            let devices: Vec<_> = found.iter().map(|f| f.device.clone().unwrap()).collect();
            assert_eq!(devices, want, "from {}", input.display());
        }
        // One device's folder, or its dump/.
        assert_eq!(discover(&run.join("device_2")).unwrap().len(), 1);
        assert_eq!(discover(&run.join("device_2/dump")).unwrap()[0].device.as_deref(), Some("2"));
        // A file is taken as is.
        let file = run.join("device_cpu/dump/memscope_dump_20260101000000.db");
        assert_eq!(discover(&file).unwrap(), vec![DbFile { path: file.clone(), device: Some("cpu".into()) }]);
        // A folder with nothing in it.
        let empty = dir("discover-empty");
        assert!(matches!(discover(&empty), Err(AnalysisError::NoDbInFolder { .. })));
    }

    #[test]
    fn rows_stream_in_time_then_id_order() {
        let d = dir("order");
        let mut db = TestDb::create(&d.join("memscope_dump_1.db"));
        db.malloc("HAL", 30, 0x30, 1, None);
        db.malloc("HAL", 10, 0x10, 1, None);
        db.malloc("HAL", 30, 0x31, 1, None);
        db.row("ACCESS", "READ", 5, 1, Some(0x10), crate::store::Attr::new());
        let path = db.path.clone();
        drop(db);
        let dump = DumpDb::open(&path, false).unwrap();
        let mut seen = Vec::new();
        let how = dump
            .for_each_row(|fed| match fed {
                Fed::Row(r) => seen.push((r.ts, r.ptr.to_owned())),
                Fed::Restart => seen.clear(),
            })
            .unwrap();
        let want = [(10, "0x0000000000000010"), (30, "0x0000000000000030"), (30, "0x0000000000000031")];
        assert_eq!(seen, want.map(|(ts, p)| (ts, p.to_owned())));
        assert_eq!(how, ReadOrder::Storage);
        assert_eq!(dump.devices().unwrap(), vec!["0".to_owned()]);
    }

    /// (ts, rowid) in the order the reader hands rows over after its last restart, the restarts,
    /// and how it read them.
    fn fed(order: &TimeOrder<'_>) -> (Vec<(i64, i64)>, usize, ReadOrder) {
        let mut seen = Vec::new();
        let mut restarts = 0;
        let how = order
            .for_each_row(|fed| match fed {
                Fed::Row(r) => seen.push((r.ts, r.rowid)),
                Fed::Restart => {
                    seen.clear();
                    restarts += 1;
                }
            })
            .unwrap();
        (seen, restarts, how)
    }

    #[test]
    fn rows_come_in_time_order_whatever_the_file_order() {
        // Written as our tracer writes (a late STOP_TRACE, one thread's rows a little behind
        // another's) and as msMemScope does (MALLOCs written when the block is freed).
        let orders: [&[i64]; 4] = [
            &[1, 2, 2, 3, 4, 8, 9],
            &[1, 2, 3, 5, 4, 6, 7, 9, 9, 8],
            &[10, 20, 30, 31, 32, 25, 33, 34, 29, 40],
            &[5, 6, 1, 7, 2, 8, 3, 9, 4, 10],
        ];
        let select = Selection { events: &["MALLOC"], name: false, thread: false };
        for (i, order) in orders.iter().enumerate() {
            let mut db = TestDb::create(&dir(&format!("order{i}")).join("memscope_dump_1.db"));
            for (k, ts) in order.iter().enumerate() {
                db.malloc("PTA", *ts, 0x10 + k as u64, 1, None);
                db.row("ACCESS", "READ", 0, 1, None, crate::store::Attr::new());
                // not selected
            }
            let path = db.path.clone();
            drop(db);
            let mut want: Vec<(i64, i64)> = order.iter().enumerate().map(|(k, ts)| (*ts, 2 * k as i64 + 1)).collect();
            want.sort();
            let conn = Connection::open_with_flags(&path, OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
            let reader = || TimeOrder::new(&conn, &path, DUMP_TABLE, select).unwrap();
            assert_eq!(fed(&reader()), (want.clone(), 0, ReadOrder::Storage), "order {order:?}");
            // Too many rows to hold back: the same rows, sorted by SQLite, after a restart.
            let (got, restarts, how) = fed(&reader().with_limits(MAX_STRAGGLERS, 1));
            assert_eq!(got, want, "order {order:?}");
            assert_eq!(restarts, usize::from(i > 0), "order {order:?}: only files out of order hold rows back");
            assert_eq!(how, if i > 0 { ReadOrder::Restarted } else { ReadOrder::Storage });
            // Too many rows out of place: sorted by SQLite from the start.
            let (got, restarts, how) = fed(&reader().with_limits(0, MAX_HELD));
            assert_eq!((got, restarts), (want, 0), "order {order:?}");
            assert_eq!(how, if i > 0 { ReadOrder::Sorted } else { ReadOrder::Storage });
            // The counts come from the first pass, or from SQLite when it stopped early.
            for limits in [(MAX_STRAGGLERS, MAX_HELD), (0, MAX_HELD)] {
                let scan_of = reader().with_limits(limits.0, limits.1);
                let scan = scan_of.scan().unwrap();
                assert_eq!(scan.count(&["MALLOC"]).unwrap(), order.len() as u64);
                assert_eq!(scan.count(&["FREE"]).unwrap(), 0);
            }
        }
    }
}
