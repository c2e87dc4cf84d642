//! The SQLite sink: `memscope_dump` for Insight plus our `ms_*` tables, in WAL mode with one open
//! transaction that `commit` closes and reopens.
//!
//! `memscope_dump`'s rows are appended as whole pages ([`super::bulk`]): through SQL, a row's
//! VDBE program, binds and B-tree descent were most of the store thread's time. Plain SQL takes
//! over wherever the pages cannot be used ([`super::dump_rows`]). Everything else (our own
//! tables, owner changes of rows already written) is SQL, queued and run between two of the page
//! writer's transactions, as its rule requires. Those are rare next to the rows.
//!
//! Durability: while tracing, every commit is synced (`synchronous=FULL`: the WAL, after the page
//! writer's own sync of the pages it links in), about once a second, so a power cut loses at most
//! the rows since the last commit and never corrupts the table (docs/db-schema.md, "What a crash
//! or a power cut costs"). From the stop on, commits are not synced one by one
//! (`synchronous=NORMAL`, which still syncs the WAL before a checkpoint writes it into the DB
//! and the DB before the WAL is reused), and the finished file is synced whole at the end.
//!
//! WAL, not a rollback journal, although the WAL costs a second copy of every page (the
//! checkpoint): with a rollback journal a reader (`analyze` on a live trace, Insight opening it)
//! holds off the writer's commits and cache spills for as long as it reads, the store thread
//! waits, and the ring buffer overflows; committed rows survive a SIGKILL either way. 64 KiB pages
//! cut the per-page work (frame headers, checkpoint lookups) to a sixteenth of 4 KiB pages'.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use rusqlite::{params, Connection};

use crate::model::DeviceKey;
use crate::stacks::StackId;
use crate::vocab::{attr, Event, EventType};

use super::batch::{write_device_id, RowText};
use super::btree::Col;
use super::bulk::{BulkError, Files};
use super::driver::DriverRow;
use super::dump_rows::DumpRows;
use super::schema::{self, SCHEMA_VERSION};
use super::sqlite_raw::tune_sqlite_once;
use super::stacks::{FrameRow, StackRow, StackTable};
use super::{DbWriter, Meta, ProbeRow, Sink, StoreError};

pub struct DbSink {
    /// Declared before `conn`: its statement must be finalized before the connection closes.
    dump: DumpRows,
    conn: Connection,
    path: PathBuf,
    /// The `Device Id` of every row.
    device: String,
    queued: Queued,
    /// Rows appended since the last commit.
    uncommitted: usize,
    /// Declared after `conn`: closed only once SQLite's connection is ([`DumpRows::files`]).
    _files: Option<Arc<Files>>,
}

/// SQL waiting for the end of the page writer's transaction.
#[derive(Default)]
struct Queued {
    meta: Meta,
    probes: Vec<ProbeRow>,
    untracked: Vec<(u64, OwnedRow)>,
    owners: Vec<(u64, String, Option<&'static str>)>,
    stacks: Vec<StackRow>,
    frames: Vec<FrameRow>,
    py_stacks: Vec<(StackId, Box<str>)>,
    driver: Vec<DriverRow>,
    py_trace: Vec<super::py_trace::PyTraceRow>,
    /// The `START_TRACE` row's id and the device's (free, total), to set on it.
    start_memory: Option<(u64, (u64, u64))>,
}

impl Queued {
    fn is_empty(&self) -> bool {
        self.driver.is_empty()
            && self.py_trace.is_empty()
            && self.start_memory.is_none()
            && self.meta.is_empty()
            && self.probes.is_empty()
            && self.untracked.is_empty()
            && self.owners.is_empty()
            && self.stacks.is_empty()
            && self.py_stacks.is_empty()
    }
}

struct OwnedRow {
    event: Event,
    event_type: EventType,
    name: String,
    ts_ns: u64,
    pid: u32,
    tid: u32,
    ptr: String,
    attr: String,
    c_stack: String,
}

/// Page size of a new DB (see the module doc). It must be set before the WAL is.
const PAGE_SIZE: u32 = 65_536;
/// Pages in the WAL before a commit folds it into the DB: 32 MiB.
const WAL_AUTOCHECKPOINT: u32 = 512;
/// Rows after which the sink commits on its own (about 16 MiB of pages), whatever the session's
/// pace: the stop writes a million shadow FREE rows without a commit of the session's, and in
/// one transaction they would grow the WAL to hundreds of MB (folded, synced and truncated at
/// the end); in transactions of this size each fold finds the WAL's pages still in the page
/// cache, and the WAL is reused from its start.
const COMMIT_ROWS: usize = 65_536;

fn sqlite_error(path: &Path) -> impl Fn(rusqlite::Error) -> StoreError + '_ {
    move |source| StoreError::Sqlite { path: path.to_owned(), source }
}

fn bulk_error(path: &Path) -> impl Fn(BulkError) -> StoreError + '_ {
    move |e| match e {
        BulkError::Sqlite(source) => StoreError::Sqlite { path: path.to_owned(), source },
        other => StoreError::Pages { path: path.to_owned(), source: other },
    }
}

impl DbSink {
    /// A new DB at `path` for `device`'s rows, written by `writer` where it can be used.
    pub fn create(path: &Path, device: DeviceKey, meta: &Meta, writer: DbWriter) -> Result<Self, StoreError> {
        tune_sqlite_once();
        let err = sqlite_error(path);
        let conn = Connection::open(path).map_err(&err)?;
        // WAL: committed rows survive a SIGKILL of the tracer and readers never block it.
        // synchronous=FULL: each commit (about once a second) is durable (see the module doc).
        // A 32 MiB page cache: a busy second's rows spill into the WAL before their commit, which
        // writes each page once all the same.
        conn.pragma_update(None, "page_size", PAGE_SIZE).map_err(&err)?;
        conn.pragma_update(None, "journal_mode", "WAL").map_err(&err)?;
        conn.pragma_update(None, "synchronous", "FULL").map_err(&err)?;
        conn.pragma_update(None, "wal_autocheckpoint", WAL_AUTOCHECKPOINT).map_err(&err)?;
        conn.pragma_update(None, "cache_size", -32768).map_err(&err)?;
        conn.execute_batch(&schema::create_dump_table()).map_err(&err)?;
        conn.execute_batch(&schema::create_rows_table(schema::UNTRACKED_FREES_TABLE)).map_err(&err)?;
        conn.execute_batch(schema::OWN_TABLES).map_err(&err)?;
        write_meta(&conn, &[("schema_version".into(), SCHEMA_VERSION.to_string())]).map_err(&err)?;
        write_meta(&conn, meta).map_err(&err)?;
        let columns = schema::DUMP_COLUMNS.map(|(name, _)| name);
        let dump = DumpRows::open(&conn, path, schema::DUMP_TABLE, &columns, writer).map_err(bulk_error(path))?;
        let (used, why) = dump.writer();
        let mut said = vec![("writer".to_owned(), used.to_owned())];
        said.extend(why.map(|why| ("writer_why".to_owned(), why.to_owned())));
        write_meta(&conn, &said).map_err(&err)?;
        let mut text = String::new();
        write_device_id(device, &mut text);
        let _files = dump.files();
        let mut sink =
            Self { dump, conn, path: path.to_owned(), device: text, queued: Queued::default(), uncommitted: 0, _files };
        sink.begin()?;
        Ok(sink)
    }

    fn begin(&mut self) -> Result<(), StoreError> {
        self.dump.begin(&self.conn).map_err(bulk_error(&self.path))
    }

    /// Completes the table's pages, commits, then runs the queued SQL in a transaction of its
    /// own. No transaction is open afterwards.
    fn end(&mut self) -> Result<(), StoreError> {
        self.dump.seal(&self.conn).map_err(bulk_error(&self.path))?;
        let committed = self.conn.execute_batch("COMMIT");
        self.dump.committed();
        committed.map_err(sqlite_error(&self.path))?;
        self.uncommitted = 0;
        if self.queued.is_empty() {
            return Ok(());
        }
        let queued = std::mem::take(&mut self.queued);
        self.dump.hand_to_sql(&self.conn, !queued.owners.is_empty() || queued.start_memory.is_some());
        let err = sqlite_error(&self.path);
        self.conn.execute_batch("BEGIN IMMEDIATE").map_err(&err)?;
        run_queued(&self.conn, &queued, &self.device).map_err(&err)?;
        self.conn.execute_batch("COMMIT").map_err(&err)
    }
}

fn write_meta(conn: &Connection, meta: &[(String, String)]) -> rusqlite::Result<()> {
    let mut stmt = conn.prepare_cached("INSERT OR REPLACE INTO ms_meta (key, value) VALUES (?1, ?2)")?;
    for (k, v) in meta {
        stmt.execute(params![k, v])?;
    }
    Ok(())
}

fn run_queued(conn: &Connection, q: &Queued, device: &str) -> rusqlite::Result<()> {
    write_meta(conn, &q.meta)?;
    let mut stmt = conn.prepare_cached(
        "INSERT INTO ms_probes (library, symbol, api, file_offset, source, attached_ns) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    )?;
    for p in &q.probes {
        stmt.execute(params![p.library, p.symbol, p.api, p.file_offset as i64, p.source, p.attached_wall_ns as i64])?;
    }
    let columns: Vec<String> = schema::DUMP_COLUMNS.iter().map(|(name, _)| format!("\"{name}\"")).collect();
    let sql = format!(
        "INSERT INTO {} ({}) VALUES (?1,?2,?3,?4,?5,?6,?7,?8,?9,?10,'',?11)",
        schema::UNTRACKED_FREES_TABLE,
        columns.join(", ")
    );
    let mut stmt = conn.prepare_cached(&sql)?;
    for (id, r) in &q.untracked {
        stmt.execute(params![
            *id as i64,
            r.event.as_str(),
            r.event_type.as_str(),
            r.name,
            r.ts_ns as i64,
            r.pid,
            r.tid,
            device,
            r.ptr,
            r.attr,
            r.c_stack
        ])?;
    }
    for (id, owner, source) in &q.owners {
        set_owner(conn, *id, owner, *source)?;
    }
    if let Some((id, free_total)) = q.start_memory {
        super::driver::set_start_memory(conn, id, free_total)?;
    }
    super::driver::insert(conn, &q.driver)?;
    super::py_trace::insert(conn, &q.py_trace)?;
    write_stacks(conn, &q.stacks, &q.frames)?;
    write_py_stacks(conn, &q.py_stacks)
}

/// `ms_py_stacks` (docs/db-schema.md), created when the trace read Python stacks.
fn write_py_stacks(conn: &Connection, stacks: &[(StackId, Box<str>)]) -> rusqlite::Result<()> {
    if stacks.is_empty() {
        return Ok(());
    }
    conn.execute_batch(schema::PY_STACK_TABLE)?;
    let mut stmt = conn.prepare_cached("INSERT OR REPLACE INTO ms_py_stacks (id, text) VALUES (?1, ?2)")?;
    for (id, text) in stacks {
        stmt.execute(params![*id as i64, &**text])?;
    }
    Ok(())
}

/// `ms_stacks` and `ms_frames` (docs/db-schema.md), created when the trace has stacks.
fn write_stacks(conn: &Connection, stacks: &[StackRow], frames: &[FrameRow]) -> rusqlite::Result<()> {
    if stacks.is_empty() {
        return Ok(());
    }
    conn.execute_batch(schema::STACK_TABLES)?;
    let mut stmt =
        conn.prepare_cached("INSERT INTO ms_stacks (id, pid, cut, frames, text) VALUES (?1, ?2, ?3, ?4, ?5)")?;
    for s in stacks {
        stmt.execute(params![s.id, s.pid, s.cut.as_str(), s.frames, &*s.text])?;
    }
    let mut stmt = conn.prepare_cached(
        "INSERT INTO ms_frames (stack_id, frame, depth, addr, path, build_id, file_offset, symbol, symbol_offset, \
         file, line, inlined, status) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)",
    )?;
    for f in frames {
        stmt.execute(params![
            f.stack,
            f.frame,
            f.depth,
            f.addr as i64,
            f.path,
            f.build_id,
            f.file_offset.map(|o| o as i64),
            f.symbol,
            f.symbol_offset.map(|o| o as i64),
            f.file,
            f.line,
            f.inlined,
            f.status
        ])?;
    }
    Ok(())
}

/// Rows are appended in ID order, so a row's rowid is its ID: found by rowid, the row is one
/// B-tree lookup away, where `ID = ?` alone (no index) scans the whole table per retag (0.6 s on
/// 2 M rows). The `ID` term keeps it right regardless, and the scan remains the fallback.
fn set_owner(conn: &Connection, id: u64, owner: &str, source: Option<&str>) -> rusqlite::Result<()> {
    static SQL: OnceLock<[String; 2]> = OnceLock::new();
    let [by_rowid, by_id] = SQL.get_or_init(|| {
        let (table, owner, source) = (schema::DUMP_TABLE, attr::owner, attr::owner_source);
        // `json_remove` first: the allocator's label alone writes no `owner_source`.
        let set = format!(
            "UPDATE {table} SET Attr = CASE WHEN ?3 IS NULL THEN json_remove(json_set(Attr, '$.{owner}', ?1), \
             '$.{source}') ELSE json_set(Attr, '$.{owner}', ?1, '$.{source}', ?3) END"
        );
        [format!("{set} WHERE rowid = ?2 AND ID = ?2"), format!("{set} WHERE ID = ?2")]
    });
    if conn.prepare_cached(by_rowid)?.execute(params![owner, id as i64, source])? == 0 {
        conn.prepare_cached(by_id)?.execute(params![owner, id as i64, source])?;
    }
    Ok(())
}

impl Sink for DbSink {
    fn insert(&mut self, id: u64, row: RowText<'_>) -> Result<(), StoreError> {
        let head = row.head;
        self.dump
            .append(
                &self.conn,
                &[
                    Col::Int(id as i64),
                    Col::Text(head.event.as_str()),
                    Col::Text(head.event_type.as_str()),
                    Col::Text(row.name),
                    Col::Int(head.ts_ns as i64),
                    Col::Int(head.pid.into()),
                    Col::Int(head.tid.into()),
                    Col::Text(&self.device),
                    Col::Text(row.ptr),
                    Col::Text(row.attr),
                    Col::Text(row.py_text),
                    Col::Text(row.c_stack),
                ],
            )
            .map_err(bulk_error(&self.path))?;
        self.uncommitted += 1;
        if self.uncommitted >= COMMIT_ROWS {
            self.commit()?;
        }
        Ok(())
    }

    fn insert_untracked(&mut self, id: u64, row: RowText<'_>) -> Result<(), StoreError> {
        // Rare (frees of blocks from before an attach): queued SQL is enough.
        let head = row.head;
        self.queued.untracked.push((
            id,
            OwnedRow {
                event: head.event,
                event_type: head.event_type,
                name: row.name.to_owned(),
                ts_ns: head.ts_ns,
                pid: head.pid,
                tid: head.tid,
                ptr: row.ptr.to_owned(),
                attr: row.attr.to_owned(),
                c_stack: row.c_stack.to_owned(),
            },
        ));
        Ok(())
    }

    /// Written with the last commit: a stack's rows only grow until then.
    fn add_stacks(&mut self, stacks: &StackTable) -> Result<(), StoreError> {
        self.queued.stacks = stacks.rows().to_vec();
        self.queued.frames = stacks.frames().to_vec();
        Ok(())
    }

    fn add_py_stacks(&mut self, first: StackId, texts: &[Box<str>]) -> Result<(), StoreError> {
        self.queued.py_stacks.extend(texts.iter().zip(first..).map(|(t, id)| (id, t.clone())));
        Ok(())
    }

    /// Applied with the next commit, after the row's page is written.
    fn update_owner(&mut self, id: u64, owner: &str, source: Option<&'static str>) -> Result<(), StoreError> {
        self.queued.owners.push((id, owner.to_owned(), source));
        Ok(())
    }

    fn set_meta(&mut self, meta: &Meta) -> Result<(), StoreError> {
        self.queued.meta.extend(meta.iter().cloned());
        Ok(())
    }

    /// The stop's commits are not synced one by one: a power cut during the stop may cost its
    /// rows, never what was committed before it (NORMAL still orders the checkpoint's syncs),
    /// and the DB is synced whole at the end of [`Sink::finish`]. (The level can only change
    /// between transactions.)
    fn stopping(&mut self) -> Result<(), StoreError> {
        self.end()?;
        self.conn.execute_batch("PRAGMA synchronous = NORMAL").map_err(sqlite_error(&self.path))?;
        self.begin()
    }

    fn commit(&mut self) -> Result<(), StoreError> {
        self.end()?;
        self.begin()
    }

    fn add_probes(&mut self, probes: &[ProbeRow]) -> Result<(), StoreError> {
        self.queued.probes.extend_from_slice(probes);
        Ok(())
    }

    fn add_driver(&mut self, rows: &[DriverRow]) -> Result<(), StoreError> {
        self.queued.driver.extend_from_slice(rows);
        Ok(())
    }

    fn add_py_trace(&mut self, rows: &[super::py_trace::PyTraceRow]) -> Result<(), StoreError> {
        self.queued.py_trace.extend_from_slice(rows);
        Ok(())
    }

    /// Applied with the next commit, after the row's page is written.
    fn set_start_memory(&mut self, id: u64, free_total: (u64, u64)) -> Result<(), StoreError> {
        self.queued.start_memory = Some((id, free_total));
        Ok(())
    }

    fn finish(mut self: Box<Self>, meta: &Meta, lost_per_cpu: &[u64]) -> Result<PathBuf, StoreError> {
        self.queued.meta.extend(meta.iter().cloned());
        let shared = self.dump.shared_transactions();
        if shared > 0 {
            // Said where a reader of the DB looks: how often SQL stood in for the pages.
            self.queued.meta.push(("writer_sql_transactions".into(), shared.to_string()));
        }
        self.end()?;
        let err = sqlite_error(&self.path);
        {
            self.conn.execute_batch("BEGIN IMMEDIATE").map_err(&err)?;
            let mut stmt =
                self.conn.prepare_cached("INSERT OR REPLACE INTO ms_lost (cpu, lost) VALUES (?1, ?2)").map_err(&err)?;
            for (cpu, lost) in lost_per_cpu.iter().enumerate() {
                stmt.execute(params![cpu as i64, *lost as i64]).map_err(&err)?;
            }
        }
        self.conn.execute_batch("COMMIT").map_err(&err)?;
        let folded = fold(&self.conn).map_err(&err)?;
        let path = self.path.clone();
        let Self { dump, conn, _files, .. } = *self;
        drop(dump);
        conn.close().map_err(|(_, source)| StoreError::Sqlite { path: path.clone(), source })?;
        drop(_files);
        let io = |source| StoreError::Io { path: path.clone(), source };
        std::fs::File::open(&path).and_then(|f| f.sync_all()).map_err(io)?;
        if !folded {
            // The stop's commits live in the WAL, not synced one by one (see `stopping`).
            std::fs::File::open(wal_path(&path)).and_then(|f| f.sync_all()).map_err(io)?;
        }
        Ok(path)
    }
}

/// How long the fold waits for readers of the live DB to let go.
const FOLD_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Folds the WAL back into the main file and leaves WAL mode, so the .db alone is the whole
/// trace (Insight opens one file, and may copy it without its -wal). The checkpoint must sync the
/// DB before it empties the WAL (NORMAL or above), or a power cut then could lose rows that were
/// durable in the WAL.
///
/// Returns false when another process kept reading the DB for [`FOLD_WAIT`] (a user polling the
/// live trace): the DB is then left whole in WAL mode, its `-wal` beside it, rather than the stop
/// failing and the trace losing its end.
fn fold(conn: &Connection) -> rusqlite::Result<bool> {
    conn.busy_timeout(FOLD_WAIT)?;
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    let busy: i64 = conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| r.get(0))?;
    if busy != 0 {
        return Ok(false);
    }
    match conn.pragma_update(None, "journal_mode", "DELETE") {
        Ok(()) => Ok(true),
        Err(rusqlite::Error::SqliteFailure(e, _)) if e.code == rusqlite::ErrorCode::DatabaseBusy => Ok(false),
        Err(e) => Err(e),
    }
}

/// The `-wal` file of the DB at `path`.
pub fn wal_path(path: &Path) -> PathBuf {
    let mut wal = path.as_os_str().to_owned();
    wal.push("-wal");
    PathBuf::from(wal)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::DeviceKey;
    use crate::store::batch::single;
    use crate::store::insight::Head;
    use crate::store::schema::{DUMP_COLUMNS, INSIGHT_OWNED_TABLES};
    use crate::store::{Attr, Format, Row};

    /// `row` as the store hands it to the sink.
    fn insert(sink: &mut DbSink, id: u64, row: &Row<'_>) {
        sink.insert(id, single(row, Format::Db).get(0)).unwrap();
    }

    /// The column list as shared/reference/msmemscope-and-insight.md §3.2-3.3 gives it: Insight
    /// reads columns by position, so both names and order are the contract.
    const INSIGHT_COLUMNS: [&str; 12] = [
        "ID",
        "Event",
        "Event Type",
        "Name",
        "Timestamp(ns)",
        "Process Id",
        "Thread Id",
        "Device Id",
        "Ptr",
        "Attr",
        "Call Stack(Python)",
        "Call Stack(C)",
    ];

    fn tmp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("memscope-sqlite-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("memscope_dump_20260101000000.db")
    }

    fn row(ts: u64) -> Row<'static> {
        Row {
            head: Head {
                event: Event::parse("MALLOC").unwrap(),
                event_type: EventType::parse("HAL").unwrap(),
                ts_ns: ts,
                pid: 1,
                tid: 2,
                device: DeviceKey::Npu(0),
                ptr: Some(0x10),
                broadcast: false,
                untracked: false,
                shadow: false,
            },
            name: "aclrtMalloc".into(),
            attr: Attr::new().with("size", 8u64),
        }
    }

    #[test]
    fn schema_matches_insight_and_leaves_its_tables_alone() {
        let path = tmp("schema");
        let mut sink = Box::new(
            DbSink::create(&path, DeviceKey::Npu(0), &vec![("mode".into(), "attach".into())], DbWriter::Pages).unwrap(),
        );
        insert(&mut sink, 1, &row(5));
        sink.finish(&vec![], &[0, 3]).unwrap();
        let conn = Connection::open(&path).unwrap();
        let cols: Vec<(String, String)> = conn
            .prepare("SELECT name, type FROM pragma_table_info('memscope_dump') ORDER BY cid")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        let names: Vec<&str> = cols.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, INSIGHT_COLUMNS);
        assert_eq!(cols.len(), DUMP_COLUMNS.len());
        assert_eq!(cols[0].1, "INTEGER");
        assert_eq!(cols[4].1, "INTEGER");
        for t in INSIGHT_OWNED_TABLES {
            let n: i64 =
                conn.query_row("SELECT count(*) FROM sqlite_master WHERE name = ?1", [t], |r| r.get(0)).unwrap();
            assert_eq!(n, 0, "{t} must be left to Insight");
        }
        // Insight's device query and its Attr getter.
        let (ptr, attr): (String, String) = conn
            .query_row(
                "SELECT Ptr, Attr FROM memscope_dump WHERE \"Device Id\" NOT IN ('N/A','','host') ORDER BY \"Timestamp(ns)\"",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap();
        assert_eq!(ptr, "0x0000000000000010");
        assert_eq!(attr, r#"{"size":"8"}"#);
        let lost: i64 = conn.query_row("SELECT sum(lost) FROM ms_lost", [], |r| r.get(0)).unwrap();
        assert_eq!(lost, 3);
        let mode: String = conn.query_row("SELECT value FROM ms_meta WHERE key='mode'", [], |r| r.get(0)).unwrap();
        assert_eq!(mode, "attach");
        let journal: String = conn.query_row("PRAGMA journal_mode", [], |r| r.get(0)).unwrap();
        assert_eq!(journal, "delete", "a finished DB is one self-contained file");
    }

    #[test]
    fn owner_update_finds_a_row_whose_rowid_is_not_its_id() {
        let path = tmp("owner-id");
        let mut sink = Box::new(DbSink::create(&path, DeviceKey::Npu(0), &vec![], DbWriter::Pages).unwrap());
        // IDs 7 and 1 get rowids 1 and 2: the rowid lookup of ID 1 meets row 7 and must not
        // touch it, and ID 7 is only found by its ID.
        insert(&mut sink, 7, &row(7));
        insert(&mut sink, 1, &row(1));
        sink.update_owner(1, "PTA@a", Some("marker")).unwrap();
        sink.update_owner(7, "PTA@b", Some("marker")).unwrap();
        let path = sink.finish(&vec![], &[]).unwrap();
        let conn = rusqlite::Connection::open(&path).unwrap();
        let owners: Vec<(i64, String)> = conn
            .prepare("SELECT ID, json_extract(Attr, '$.owner') FROM memscope_dump ORDER BY ID")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(owners, [(1, "PTA@a".to_owned()), (7, "PTA@b".to_owned())]);
    }

    #[test]
    fn owner_update_rewrites_only_that_rows_owner_even_while_batched() {
        let path = tmp("owner");
        let mut sink = Box::new(DbSink::create(&path, DeviceKey::Npu(0), &vec![], DbWriter::Pages).unwrap());
        let mut tagged = row(1);
        tagged.attr = Attr::new().with("size", 8u64).with("owner", "PTA").with("used", 8u64);
        insert(&mut sink, 1, &tagged);
        insert(&mut sink, 2, &row(2));
        sink.update_owner(1, "PTA@kv_cache", None).unwrap();
        sink.update_owner(2, "HOST@weight", Some("marker")).unwrap();
        let path = sink.finish(&vec![], &[]).unwrap();
        let conn = rusqlite::Connection::open(&path).unwrap();
        let attrs: Vec<String> = conn
            .prepare("SELECT Attr FROM memscope_dump ORDER BY ID")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(attrs[0], r#"{"size":"8","owner":"PTA@kv_cache","used":"8"}"#, "in place, compact, other keys kept");
        assert_eq!(
            attrs[1], r#"{"size":"8","owner":"HOST@weight","owner_source":"marker"}"#,
            "added when the row had none, with where it came from"
        );
    }

    #[test]
    fn batches_keep_every_row_in_order() {
        let path = tmp("batches");
        let mut sink = Box::new(DbSink::create(&path, DeviceKey::Cpu, &vec![], DbWriter::Pages).unwrap());
        let n = 70_000;
        for id in 1..=n {
            let mut r = row(id * 10);
            r.head.ptr = Some(id);
            // A broadcast row comes with another output's device.
            r.head.device = if id % 2 == 0 { DeviceKey::Npu(1) } else { DeviceKey::Cpu };
            insert(&mut sink, id, &r);
        }
        sink.finish(&vec![], &[]).unwrap();
        let conn = Connection::open(&path).unwrap();
        let rows: Vec<(i64, i64, String, String)> = conn
            .prepare("SELECT ID, \"Timestamp(ns)\", \"Device Id\", Ptr FROM memscope_dump ORDER BY rowid")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(rows.len() as u64, n);
        for (i, (id, ts, dev, ptr)) in rows.iter().enumerate() {
            let want = i as i64 + 1;
            assert_eq!((*id, *ts), (want, want * 10));
            assert_eq!(dev, "cpu", "every row has its output's device");
            assert_eq!(ptr, &format!("0x{want:016x}"));
        }
    }

    #[test]
    fn committed_rows_are_visible_before_finish() {
        let path = tmp("commit");
        let mut sink = DbSink::create(&path, DeviceKey::Npu(0), &vec![], DbWriter::Pages).unwrap();
        insert(&mut sink, 1, &row(1));
        sink.commit().unwrap();
        insert(&mut sink, 2, &row(2));
        // A second connection (as after a crash of the tracer) sees the committed row only.
        let reader = Connection::open(&path).unwrap();
        let n: i64 = reader.query_row("SELECT count(*) FROM memscope_dump", [], |r| r.get(0)).unwrap();
        assert_eq!(n, 1);
        drop(sink);
    }
}
