//! Trace DBs as analysis input and output: which files a folder holds, opening one without
//! creating or damaging anything, streaming its `memscope_dump` rows in time order, and writing
//! results into our own tables in a single transaction.
//!
//! Safety of the user's file comes first: a DB is opened without SQLITE_OPEN_CREATE (a typo never
//! leaves an empty DB behind), read-only unless results are to be written, and every write is one
//! transaction, so a failure leaves the file exactly as it was.

use std::fs;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rusqlite::types::ValueRef;
use rusqlite::{Connection, DatabaseName, OpenFlags, Transaction, TransactionBehavior};

mod batch;
mod order;
mod rows;

pub use order::{ReadOrder, Selection, TimeOrder};
pub use rows::{DumpRow, Fed};

use super::AnalysisError;
use crate::store::schema::DUMP_TABLE;
use crate::vocab::Event;

/// The older name msMemScope (as msLeaks) and prof2memscope used; Insight accepts both.
const LEGACY_DUMP_TABLE: &str = "leaks_dump";

/// Columns the analyses read.
const NEEDED_COLUMNS: [&str; 8] =
    ["ID", "Event", "Event Type", "Timestamp(ns)", "Process Id", "Device Id", "Ptr", "Attr"];

/// A trace found for analysis, with the device its folder names (`device_<id>`), if any.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DbFile {
    pub path: PathBuf,
    pub device: Option<String>,
    /// What `path` holds: a DB, or a dump CSV the verbs import first.
    pub format: Format,
    /// For a DB imported from a CSV, the CSV: what the user gave, and what reports name.
    pub source: Option<PathBuf>,
}

impl DbFile {
    pub fn new(path: PathBuf, format: Format) -> Self {
        Self { device: device_from_path(&path), path, format, source: None }
    }

    /// The file the user knows this trace by.
    pub fn shown(&self) -> &Path {
        self.source.as_deref().unwrap_or(&self.path)
    }
}

/// The forms a dump comes in: SQLite (ours, msMemScope's `--format db`), msMemScope's CSV (its
/// default, and ours with `--format csv`), or PyTorch's / torch_npu's memory snapshot (a pickle,
/// given as a file; [`crate::import::snapshot`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Db,
    Csv,
    Snapshot,
}

/// What a file in a dump folder is, by content: msMemScope and msLeaks named their files
/// `memscope_dump_*`/`leaks_dump_*`, users rename them, and a folder also holds other CSVs
/// (Python traces) and our own untracked frees, which are no trace of their own.
fn dump_format(path: &Path) -> Option<Format> {
    let name = path.file_name()?.to_str()?;
    if name.starts_with('.') || name.starts_with(crate::store::schema::UNTRACKED_FREES_TABLE) {
        return None;
    }
    match crate::import::sniff(path).ok()? {
        crate::import::Kind::Sqlite => Some(Format::Db),
        crate::import::Kind::DumpCsv => Some(Format::Csv),
        // Named as a dump but not one: taken, so that opening it says what is wrong with it.
        _ if name.starts_with("memscope_dump_") || name.starts_with("leaks_dump_") => {
            Some(if name.ends_with(".csv") { Format::Csv } else { Format::Db })
        }
        _ => None,
    }
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

/// The dumps in `dir`; of a CSV and a DB with the same name (a CSV imported beside itself) only
/// the DB.
fn dump_files_in(dir: &Path, out: &mut Vec<DbFile>) -> Result<(), AnalysisError> {
    if !dir.is_dir() {
        return Ok(());
    }
    let mut found: Vec<DbFile> = Vec::new();
    for path in read_dir(dir)? {
        if let Some(format) = path.is_file().then(|| dump_format(&path)).flatten() {
            found.push(DbFile::new(path, format));
        }
    }
    let dbs: Vec<PathBuf> =
        found.iter().filter(|f| f.format == Format::Db).map(|f| f.path.with_extension("")).collect();
    found.retain(|f| f.format == Format::Db || !dbs.contains(&f.path.with_extension("")));
    out.extend(found);
    Ok(())
}

fn device_dirs(run: &Path) -> Result<Vec<PathBuf>, AnalysisError> {
    Ok(read_dir(run)?
        .into_iter()
        .filter(|p| p.is_dir() && p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("device_")))
        .collect())
}

/// The traces an input names: the file itself, or every dump (DB or CSV, known by content) in
/// the `device_*/dump/` folders of a trace folder. A folder may be the trace's output folder, the folder holding several of them
/// (`memscopeDumpResults/`), or one device's (`device_0/` or its `dump/`): users point at
/// whichever level they are looking at. Reports come per run folder, in device order.
pub fn discover(input: &Path) -> Result<Vec<DbFile>, AnalysisError> {
    let meta = fs::metadata(input).map_err(|source| match source.kind() {
        std::io::ErrorKind::NotFound => AnalysisError::NotFound { path: input.to_owned() },
        _ => AnalysisError::Io { path: input.to_owned(), source },
    })?;
    if !meta.is_dir() && !meta.is_file() {
        return Err(AnalysisError::NotAFile { path: input.to_owned(), what: crate::files::what(meta.file_type()) });
    }
    if !meta.is_dir() {
        let kind =
            crate::import::sniff(input).map_err(|source| AnalysisError::Io { path: input.to_owned(), source })?;
        let format = match kind {
            crate::import::Kind::DumpCsv => Format::Csv,
            crate::import::Kind::Pickle => Format::Snapshot,
            crate::import::Kind::OtherCsv(header) => {
                let what = crate::import::describe_other_csv(&header);
                return Err(AnalysisError::NotDumpCsv { path: input.to_owned(), what: what.to_owned() });
            }
            // Opening it says what is wrong with anything else.
            _ => Format::Db,
        };
        return Ok(vec![DbFile::new(input.to_owned(), format)]);
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
    let mut files = found;
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

/// Opens a trace DB read-only.
///
/// A DB still in WAL mode (its trace was killed before folding the WAL in) can only be read
/// with its `-shm` index, which SQLite creates beside it: in a read-only folder without one it
/// cannot open at all. With no `-wal` left to read (or an empty one), the main file is the
/// whole DB and is opened `immutable`; otherwise the rows in the `-wal` cannot be read here,
/// and the error says to copy the folder somewhere writable.
pub fn open_read_only(path: &Path) -> Result<Connection, AnalysisError> {
    let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let err = match open_checked(path, flags) {
        Ok(conn) => return Ok(conn),
        Err(e) => e,
    };
    if !wal_index_missing(&err, path) {
        return Err(AnalysisError::opening(path, err));
    }
    let wal = PathBuf::from(format!("{}-wal", path.display()));
    if fs::metadata(&wal).is_ok_and(|m| m.len() > 0) {
        return Err(AnalysisError::WalInReadOnlyFolder { path: path.to_owned(), wal });
    }
    let uri = format!("file:{}?immutable=1", uri_path(path));
    Connection::open_with_flags(uri, flags | OpenFlags::SQLITE_OPEN_URI).map_err(|e| AnalysisError::opening(path, e))
}

/// Opens `path` and reads its schema once, where a missing WAL index shows.
fn open_checked(path: &Path, flags: OpenFlags) -> rusqlite::Result<Connection> {
    let conn = Connection::open_with_flags(path, flags)?;
    // Insight or a still-running trace may hold the lock for a moment.
    conn.busy_timeout(Duration::from_secs(5))?;
    conn.query_row("SELECT count(*) FROM sqlite_master", [], |_| Ok(()))?;
    Ok(conn)
}

/// Whether an open failed because a WAL-mode DB's `-shm` cannot be made beside it.
fn wal_index_missing(err: &rusqlite::Error, path: &Path) -> bool {
    let code = err.sqlite_error_code();
    matches!(code, Some(rusqlite::ErrorCode::CannotOpen | rusqlite::ErrorCode::ReadOnly)) && in_wal_mode(path)
}

/// Whether the file's header says WAL mode (read and write versions 2).
fn in_wal_mode(path: &Path) -> bool {
    let mut head = [0u8; 20];
    fs::File::open(path).and_then(|mut f| f.read_exact(&mut head)).is_ok() && head[18] == 2 && head[19] == 2
}

/// A path as the path part of an SQLite URI (percent-encoded but for `/` and unreserved bytes).
fn uri_path(path: &Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let mut out = String::new();
    for &b in path.as_os_str().as_bytes() {
        if b.is_ascii_alphanumeric() || b"/-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Who wrote a DB: `trace` (or the daemon), msMemScope itself, or `import` from a CSV (msMemScope's,
/// or `trace --format csv`'s: `ours`). msMemScope's lack what only our tracer records (the
/// allocator settings, pool segments, stack ids), which the verbs say; a CSV of ours lacks only
/// what `ms_meta` would have held (the settings among them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    Trace,
    MsMemScope,
    Imported {
        csv: String,
        ours: bool,
    },
    /// PyTorch's or torch_npu's memory snapshot ([`crate::import::snapshot`]); `settings`: it
    /// held the allocator's settings (PyTorch's do, torch_npu's do not).
    Snapshot {
        pickle: String,
        settings: bool,
    },
}

impl Origin {
    /// Whether msMemScope wrote the capture (its DB, or a DB imported from its CSV).
    pub fn is_msmemscope(&self) -> bool {
        matches!(self, Self::MsMemScope | Self::Imported { ours: false, .. })
    }

    /// Whether the allocator settings at the start are known: a DB `trace` wrote has them, and a
    /// snapshot of PyTorch's.
    pub fn has_settings(&self) -> bool {
        matches!(self, Self::Trace | Self::Snapshot { settings: true, .. })
    }
}

/// An open trace DB.
pub struct DumpDb {
    /// The file as reports and errors name it (a CSV's, for a DB imported from one).
    path: PathBuf,
    /// The file opened, where the reading thread opens it again.
    file: PathBuf,
    conn: Connection,
    table: &'static str,
    /// Told how each pass over the rows goes ([`DumpDb::with_progress`]).
    progress: Option<std::sync::Arc<dyn Progress>>,
}

/// Told how a pass over a DB's rows goes, so that a long one can show its progress (the CLI
/// draws a bar): `start` with the table's highest rowid, `at` with the rowid of the last row
/// handed over (rows come in storage order, rowid order, but for the few put back in time
/// order), `finish` when the pass ends.
pub trait Progress: Send + Sync {
    fn start(&self, last_rowid: u64);
    fn at(&self, rowid: u64);
    fn finish(&self);
}

impl DumpDb {
    /// Opens and checks `path`: an SQLite file with a dump table holding the columns the analyses
    /// read. With `write`, also that the results can be written back.
    pub fn open(path: &Path, write: bool) -> Result<Self, AnalysisError> {
        Self::check_header(path)?;
        let not_sqlite = |e: rusqlite::Error| AnalysisError::opening(path, e);
        let conn = if write {
            // Where it cannot even be read, the read-only open says why; the write check below
            // then names the fix for the results.
            match open_checked(path, OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX) {
                Ok(conn) => conn,
                Err(e) if wal_index_missing(&e, path) => open_read_only(path)?,
                Err(e) => return Err(not_sqlite(e)),
            }
        } else {
            open_read_only(path)?
        };
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
            "it is a CSV trace; the verbs import one when given it, or `memscope-bpf import` makes a DB of it"
        } else if head != b"SQLite format 3\0" {
            "no SQLite header"
        } else {
            return Ok(());
        };
        Err(AnalysisError::NotSqlite { path: path.to_owned(), why: why.to_owned() })
    }

    /// The checks that need an open connection (split out so tests can hand in a read-only one).
    fn from_connection(path: &Path, conn: Connection, write: bool) -> Result<Self, AnalysisError> {
        let not_sqlite = |e: rusqlite::Error| AnalysisError::opening(path, e);
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
        Ok(Self { path: path.to_owned(), file: path.to_owned(), conn, table, progress: None })
    }

    /// Opens `path` for reading only: what every analysis and verb that writes nothing uses.
    pub fn open_read(path: &Path) -> Result<Self, AnalysisError> {
        Self::open(path, false)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reports and errors name `shown` from now on (the CSV a temporary DB was imported from).
    pub fn shown_as(mut self, shown: &Path) -> Self {
        shown.clone_into(&mut self.path);
        self
    }

    /// Where this DB came from, from its `ms_meta` (msMemScope writes none).
    pub fn origin(&self) -> Result<Origin, AnalysisError> {
        if !self.has_meta()? {
            return Ok(Origin::MsMemScope);
        }
        let get = |key: &str| self.meta(key);
        Ok(match get("imported_from")? {
            None => Origin::Trace,
            Some(source) => match get("source_format")?.as_deref() {
                Some(crate::import::snapshot::SOURCE_FORMAT) => {
                    let settings = get("allocator_settings")?.as_deref() == Some("recorded");
                    Origin::Snapshot { pickle: source, settings }
                }
                format => Origin::Imported { csv: source, ours: format == Some("memscope-bpf-csv") },
            },
        })
    }

    fn has_meta(&self) -> Result<bool, AnalysisError> {
        let has: i64 = self
            .conn
            .query_row("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'ms_meta'", [], |r| r.get(0))
            .map_err(self.read_err())?;
        Ok(has > 0)
    }

    /// One `ms_meta` value; `None` where the key is absent or the DB has no `ms_meta`
    /// (msMemScope's).
    pub fn meta(&self, key: &str) -> Result<Option<String>, AnalysisError> {
        if !self.has_meta()? {
            return Ok(None);
        }
        self.conn
            .query_row("SELECT value FROM ms_meta WHERE key = ?1", [key], |r| r.get(0))
            .map(Some)
            .or_else(|e| if e == rusqlite::Error::QueryReturnedNoRows { Ok(None) } else { Err(e) })
            .map_err(self.read_err())
    }

    /// The connection, for an analysis's own queries (settings, one row's details).
    pub fn conn(&self) -> &Connection {
        &self.conn
    }

    /// The dump table's name: msMemScope's `memscope_dump`, or the older `leaks_dump`.
    pub fn table(&self) -> &'static str {
        self.table
    }

    /// For msMemScope's capture ([`Origin::is_msmemscope`]), what its data lacks that our traces
    /// hold, in words ("msMemScope's capture, without ..."), so that results resting on it are not
    /// taken for a finding: the verbs say it, the report shows it. `None` for our traces.
    pub fn capture_note(&self) -> Result<Option<String>, AnalysisError> {
        if !self.origin()?.is_msmemscope() {
            return Ok(None);
        }
        let sql = format!(
            "SELECT count(*), coalesce(sum(Attr LIKE '%\"owner\":\"%@%'), 0) FROM \"{}\" WHERE Event = 'MALLOC'",
            self.table
        );
        let (blocks, owned): (i64, i64) =
            self.conn.query_row(&sql, [], |r| Ok((r.get(0)?, r.get(1)?))).map_err(self.read_err())?;
        let owners = match blocks - owned {
            0 => String::new(),
            n => format!(
                "; {n} of its {blocks} block{} {} no owner below {} allocator (msMemScope names owners only \
                 under --analysis=decompose, and users' tags only where the job described them)",
                if blocks == 1 { "" } else { "s" },
                if n == 1 { "has" } else { "have" },
                if n == 1 { "its" } else { "their" }
            ),
        };
        Ok(Some(format!(
            "msMemScope's capture, without what only memscope-bpf records: pool segments and pool names (the \
             pool's reserved bytes are its rows' `total`), the allocator settings, symbolized stacks{owners}"
        )))
    }

    /// A time-ordered reader of the rows `select` names (see [`TimeOrder`]), for analyses that
    /// tune it or count rows first.
    pub fn rows(&self, select: Selection<'_>) -> Result<TimeOrder<'_>, AnalysisError> {
        Ok(TimeOrder::new(&self.conn, &self.file, self.table, select)?.with_progress(self.progress.clone()))
    }

    /// Every pass over the rows from now on tells `progress` how it goes.
    pub fn with_progress(mut self, progress: std::sync::Arc<dyn Progress>) -> Self {
        self.progress = Some(progress);
        self
    }

    fn read_err(&self) -> impl Fn(rusqlite::Error) -> AnalysisError + '_ {
        move |source| AnalysisError::Read { path: self.path.clone(), source }
    }

    /// The distinct `Device Id`s of the memory rows (for a DB whose folder does not name its device).
    pub fn devices(&self) -> Result<Vec<String>, AnalysisError> {
        // `=` terms rather than IN, as in [`TimeOrder`]: this reads the whole table.
        let sql = format!(
            "SELECT DISTINCT \"Device Id\" FROM \"{}\" WHERE \"Event\" = '{}' OR \"Event\" = '{}' LIMIT 16",
            self.table,
            Event::Malloc,
            Event::Free
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
        let events = [Event::Malloc.as_str(), Event::Free.as_str(), Event::System.as_str()];
        let select = Selection { events: &events, name: false, thread: false };
        self.rows(select)?.for_each_row(f)
    }

    /// Calls `f` for every row whose `Event` is one of `events`, in time order (as
    /// [`Self::for_each_row`]), with the `Name` and `Thread Id` that call sequences need.
    pub fn for_each_named_row(&self, events: &[&str], f: impl FnMut(Fed<'_>)) -> Result<ReadOrder, AnalysisError> {
        self.require_columns(&["Name", "Thread Id"])?;
        let select = Selection { events, name: true, thread: true };
        self.rows(select)?.for_each_row(f)
    }

    /// Which of `wanted`, columns beyond those every analysis reads, the dump table lacks.
    pub fn missing_columns<'w>(&self, wanted: &[&'w str]) -> Result<Vec<&'w str>, AnalysisError> {
        let columns: Vec<String> = self
            .conn
            .prepare("SELECT name FROM pragma_table_info(?1)")
            .and_then(|mut s| s.query_map([self.table], |r| r.get(0))?.collect())
            .map_err(self.read_err())?;
        Ok(wanted.iter().copied().filter(|c| !columns.iter().any(|h| h == c)).collect())
    }

    /// Refuses a dump table that lacks any of `wanted` (see [`Self::missing_columns`]).
    pub fn require_columns(&self, wanted: &[&str]) -> Result<(), AnalysisError> {
        let missing = self.missing_columns(wanted)?;
        if missing.is_empty() {
            return Ok(());
        }
        let (path, table) = (self.path.clone(), self.table.to_owned());
        Err(AnalysisError::MissingColumns { path, table, missing: missing.join(", ") })
    }

    /// Replaces our result tables `tables` (name, CREATE statement: dropped and recreated, so
    /// they always describe the latest run and reruns never duplicate rows), fills them with
    /// `fill` (which may also change the dump's own rows, as inefficient's `inefficient_type`
    /// does), and stamps the `ms_meta` keys `meta` when the file has our `ms_meta` (msMemScope's
    /// DBs do not, and get nothing else). One transaction: either all of it lands or the file is
    /// unchanged. Returns what `fill` returned.
    pub fn replace_tables<T>(
        &self,
        tables: &[(&str, &str)],
        meta: &[(&str, String)],
        fill: impl FnOnce(&Transaction<'_>) -> rusqlite::Result<T>,
    ) -> Result<T, AnalysisError> {
        let err = |source| AnalysisError::Write { path: self.path.clone(), source };
        // `&self`: analyses read and store through one shared handle; the transaction is the
        // only one on this connection, as nothing else here opens one.
        let tx = Transaction::new_unchecked(&self.conn, TransactionBehavior::Immediate).map_err(err)?;
        for (name, create) in tables {
            tx.execute_batch(&format!("DROP TABLE IF EXISTS {name}; {create}")).map_err(err)?;
        }
        let filled = fill(&tx).map_err(err)?;
        stamp_meta(&tx, meta).map_err(err)?;
        tx.commit().map_err(err)?;
        Ok(filled)
    }
}

/// Sets `ms_meta` keys inside a result-writing transaction, when the file has `ms_meta` (ours do;
/// msMemScope's do not, and get none). Delete then insert: works whether or not `key` is unique.
fn stamp_meta(tx: &Transaction<'_>, pairs: &[(&str, String)]) -> rusqlite::Result<()> {
    let has: i64 =
        tx.query_row("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'ms_meta'", [], |r| r.get(0))?;
    if has == 0 {
        return Ok(());
    }
    for (key, value) in pairs {
        tx.execute("DELETE FROM ms_meta WHERE key = ?1", [key])?;
        tx.execute("INSERT INTO ms_meta (key, value) VALUES (?1, ?2)", [key, value.as_str()])?;
    }
    Ok(())
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
    fn replace_tables_replaces_and_a_failed_one_changes_nothing() {
        let d = dir("replace");
        let mut db = TestDb::create(&d.join("memscope_dump_1.db"));
        db.malloc("HAL", 10, 0x1, 100, None);
        let path = db.path.clone();
        drop(db);
        let count = |sql: &str| -> i64 { Connection::open(&path).unwrap().query_row(sql, [], |r| r.get(0)).unwrap() };
        let tables = [("ms_a", "CREATE TABLE ms_a (x INTEGER)"), ("ms_b", "CREATE TABLE ms_b (y TEXT)")];
        let fill = |rows: i64| {
            move |tx: &Transaction<'_>| -> rusqlite::Result<i64> {
                for i in 0..rows {
                    tx.execute("INSERT INTO ms_a VALUES (?1)", [i])?;
                }
                tx.execute("INSERT INTO ms_b VALUES ('b')", [])?;
                Ok(rows)
            }
        };
        let dump = DumpDb::open(&path, true).unwrap();
        for run in 1..=2 {
            assert_eq!(dump.replace_tables(&tables, &[("a_at", run.to_string())], fill(3)).unwrap(), 3);
        }
        assert_eq!(count("SELECT count(*) FROM ms_a"), 3, "a rerun replaces, never appends");
        assert_eq!(count("SELECT count(*) FROM ms_meta WHERE key = 'a_at' AND value = '2'"), 1);
        assert_eq!(count("SELECT count(*) FROM ms_meta WHERE key = 'a_at'"), 1);
        // Fail the last statement, after both tables were dropped, recreated and refilled.
        Connection::open(&path)
            .unwrap()
            .execute_batch("CREATE TRIGGER no_meta BEFORE INSERT ON ms_meta BEGIN SELECT RAISE(ABORT, 'no'); END")
            .unwrap();
        let err = dump.replace_tables(&tables, &[("a_at", "3".into())], fill(5)).unwrap_err();
        assert!(matches!(err, AnalysisError::Write { .. }), "{err}");
        assert!(err.to_string().contains("nothing was changed"), "{err}");
        assert_eq!(count("SELECT count(*) FROM ms_a"), 3, "the last run's rows are still there");
        assert_eq!(count("SELECT count(*) FROM ms_b"), 1);
        assert_eq!(count("SELECT count(*) FROM ms_meta WHERE key = 'a_at' AND value = '2'"), 1);
        assert_eq!(count("SELECT count(*) FROM memscope_dump"), 1);
        // And the handle is still usable: the failed transaction was rolled back.
        Connection::open(&path).unwrap().execute_batch("DROP TRIGGER no_meta").unwrap();
        assert_eq!(dump.replace_tables(&tables, &[], fill(1)).unwrap(), 1);
        assert_eq!(count("SELECT count(*) FROM ms_a"), 1);
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
        assert_eq!(discover(&file).unwrap(), vec![DbFile::new(file.clone(), Format::Db)]);
        assert_eq!(discover(&file).unwrap()[0].device.as_deref(), Some("cpu"));
        // A folder with nothing in it.
        let empty = dir("discover-empty");
        assert!(matches!(discover(&empty), Err(AnalysisError::NoDbInFolder { .. })));
    }

    #[test]
    fn folders_are_read_by_content_not_by_name() {
        let root = dir("content");
        let header = crate::store::schema::csv_header() + "\n1,SYSTEM,ACL_INIT,N/A,1,1,1,N/A,N/A,\n";
        let dump = root.join("msmemscope_7_20250101000000_ascend/device_3/dump");
        fs::create_dir_all(&dump).unwrap();
        fs::write(dump.join("renamed.csv"), &header).unwrap();
        fs::write(
            dump.join("python_trace_7_20250101000000.csv"),
            "FuncInfo,StartTime(ns),EndTime(ns),Thread Id,Process Id\n",
        )
        .unwrap();
        fs::write(dump.join("ms_untracked_frees_20250101000000.csv"), &header).unwrap();
        fs::write(dump.join(".memscope_dump_1.db.partial"), "SQLite format 3\0").unwrap();
        fs::write(dump.join("notes.txt"), "hello\n").unwrap();
        // A CSV imported beside itself: the DB is read, not the CSV.
        fs::write(dump.join("memscope_dump_1.csv"), &header).unwrap();
        TestDb::create(&dump.join("memscope_dump_1.db"));
        let found = discover(&root).unwrap();
        let names: Vec<(String, Format)> =
            found.iter().map(|f| (f.path.file_name().unwrap().to_string_lossy().into_owned(), f.format)).collect();
        assert_eq!(names, [("memscope_dump_1.db".to_owned(), Format::Db), ("renamed.csv".to_owned(), Format::Csv)]);
        assert!(found.iter().all(|f| f.device.as_deref() == Some("3")));
        // msLeaks' older layout: <output>/dump/leaks_dump_<ts>.csv, no device folder.
        let old = root.join("leaksDumpResults/dump");
        fs::create_dir_all(&old).unwrap();
        fs::write(old.join("leaks_dump_1746006014.csv"), &header).unwrap();
        let found = discover(&root.join("leaksDumpResults")).unwrap();
        assert_eq!(found, [DbFile::new(old.join("leaks_dump_1746006014.csv"), Format::Csv)]);
        // A file given directly is taken by content too; another CSV says what it is.
        let err = discover(&dump.join("python_trace_7_20250101000000.csv")).unwrap_err();
        assert!(err.to_string().contains("Python trace"), "{err}");
        assert_eq!(discover(&dump.join("renamed.csv")).unwrap()[0].format, Format::Csv);
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

    /// What a pass told its progress observer.
    #[derive(Default)]
    struct Told(std::sync::Mutex<Vec<(&'static str, u64)>>);

    impl Progress for Told {
        fn start(&self, last_rowid: u64) {
            self.0.lock().unwrap().push(("start", last_rowid));
        }
        fn at(&self, rowid: u64) {
            self.0.lock().unwrap().push(("at", rowid));
        }
        fn finish(&self) {
            self.0.lock().unwrap().push(("finish", 0));
        }
    }

    #[test]
    fn a_pass_tells_its_progress_from_the_last_rowid_to_the_end() {
        let d = crate::analysis::testdb::dir("progress");
        let mut db = crate::analysis::testdb::TestDb::create(&d.join("p.db"));
        for i in 0..7u64 {
            db.malloc("HAL", 100 + i as i64, 0x1000 + i * 64, 64, None);
        }
        let told = std::sync::Arc::new(Told::default());
        let dump = DumpDb::open_read(&db.path).unwrap().with_progress(told.clone());
        let mut rows = 0;
        dump.for_each_row(|fed| rows += u64::from(matches!(fed, Fed::Row(_)))).unwrap();
        assert_eq!(rows, 7);
        let told = told.0.lock().unwrap().clone();
        assert_eq!(told.first(), Some(&("start", 7)), "{told:?}");
        assert_eq!(told.last(), Some(&("finish", 0)), "{told:?}");
        let at: Vec<u64> = told.iter().filter(|(k, _)| *k == "at").map(|(_, r)| *r).collect();
        assert_eq!(at.last(), Some(&7), "the last row's rowid is the end: {told:?}");
        assert!(at.windows(2).all(|w| w[0] <= w[1]), "{told:?}");
    }
}
