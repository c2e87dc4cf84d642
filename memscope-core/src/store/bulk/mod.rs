//! Appending rows to one table as whole pages, through SQLite's `sqlite_dbpage` table.
//!
//! [`super::btree`] packs the rows into pages; here they go into the file through the pager
//! (`INSERT INTO sqlite_dbpage`), inside the connection's own transactions, so the WAL, locking
//! and concurrent readers behave exactly as for SQL inserts, and a commit is as durable. What the
//! B-tree layer would otherwise keep up to date is kept here: the page count in the file header,
//! and the freelist for interior pages a reshaped table no longer uses.
//!
//! The rule that keeps SQLite's own view consistent: within one transaction, SQL that allocates
//! pages or touches this table runs before the first page is written here, never after (the
//! B-tree layer counts pages at the start of a transaction), and the connection's page cache is
//! dropped before SQL reads this table's pages again ([`release_page_cache`]). When SQL has
//! changed the table (an owner rewritten in place can split a leaf), whether through this
//! connection or another (`PRAGMA data_version`: an `analyze` of the live trace rewriting Attr),
//! [`BulkTable::begin`] reads its shape back before appending.
//!
//! New pages past the committed end skip the pager when no other process has the DB open
//! ([`others_have_it_open`]), and skip the page cache too where the file system allows
//! ([`direct`]): they are not read again while the trace runs.
//!
//! Two orderings keep such pages safe, since SQLite knows nothing of them until the commit:
//! - **Durable before linked.** [`BulkTable::seal`] syncs the file's data before the commit that
//!   links the pages in: otherwise the WAL (synced at the commit, or at a checkpoint) could reach
//!   the disk while the pages it points at do not, and a power cut would leave interior pages
//!   over garbage: a corrupt table, not only lost commits.
//! - **No checkpoint cuts them off.** A checkpoint that folds the whole WAL truncates the file at
//!   its committed end, which is below these pages until the commit. No process can open the DB
//!   and start one while a transaction writes them: [`BulkTable::begin`] holds the WAL's
//!   checkpointer lock for other processes until [`BulkTable::committed`] (a `PRAGMA
//!   wal_checkpoint` elsewhere then answers busy, as it would next to any running checkpoint).
//!
//! [`BulkTable::open`] checks every property of the file the pages rely on (page size, no
//! reserved bytes, payload fractions, schema format 4, no auto-vacuum, UTF-8, the table a plain
//! rowid table with no index or trigger) and refuses otherwise: the caller then writes SQL.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use rusqlite::{Connection, OptionalExtension};

use super::btree::{pending_page, BtreeError, Col, PageWriter, TableBuilder};
use super::sqlite_raw::{another_process_locks, release_page_cache, try_lock_byte, unlock_byte, Param, RawStatement};
use direct::Run;

mod direct;

/// Where SQLite keeps its lock bytes; the page holding it is never part of a B-tree.
const PENDING_BYTE: u64 = 0x4000_0000;

#[derive(Debug, thiserror::Error)]
pub enum BulkError {
    #[error(transparent)]
    Sqlite(#[from] rusqlite::Error),
    #[error("cannot append to table {table}: {source}")]
    Shape { table: String, source: BtreeError },
    #[error("cannot append to table {0}: it does not exist or is not an ordinary rowid table")]
    NoTable(String),
    #[error("the page writer cannot append to this DB: {0}")]
    Unsupported(String),
    #[error("cannot write a page of the DB")]
    Io(#[source] std::io::Error),
    #[error(
        "this build's SQLite has no sqlite_dbpage table: build with LIBSQLITE3_FLAGS=SQLITE_ENABLE_DBPAGE_VTAB \
         (the repository's .cargo/config.toml sets it; a LIBSQLITE3_FLAGS already in the environment overrides it)"
    )]
    NoDbpage,
}

/// The DB file, for pages written past the pager, and its `-shm`, whose locks say whether
/// another process has the DB open. Closing a descriptor drops every POSIX lock the process holds
/// on that file, SQLite's included, so these must stay open for as long as SQLite's connection:
/// the owner keeps a clone ([`BulkTable::files`]) that it drops after the connection.
pub struct Files {
    db: File,
    shm: Option<File>,
    /// The DB opened for `O_DIRECT` writes of new pages, where its file system allows it.
    direct: Option<File>,
}

struct Pages<'s> {
    pager: &'s mut RawStatement,
    files: &'s Files,
    run: &'s mut Run,
    /// No other process has the DB open: pages past the committed end may bypass the pager.
    direct: bool,
    written_direct: &'s mut u64,
}

/// The byte of the `-shm` file a checkpointer locks (SQLite's unix VFS: the WAL locks start at
/// byte 120; the checkpointer's is the second, `WAL_CKPT_LOCK`).
const CKPT_BYTE: i64 = 121;

impl PageWriter for Pages<'_> {
    type Error = BulkError;
    fn write(&mut self, pgno: u32, page: &[u8]) -> Result<(), BulkError> {
        Ok(self.pager.execute([Param::Int(pgno.into()), Param::Blob(page)])?)
    }

    /// Straight into the file: no reader looks past the committed end, and the commit that
    /// follows moves the end past this page (see the module doc).
    fn write_new(&mut self, pgno: u32, page: &[u8]) -> Result<bool, BulkError> {
        if !self.direct {
            self.write(pgno, page)?;
            return Ok(false);
        }
        let at = u64::from(pgno - 1) * page.len() as u64;
        self.run.write(self.files.direct.as_ref(), &self.files.db, page, at).map_err(BulkError::Io)?;
        *self.written_direct += 1;
        Ok(true)
    }
}

pub struct BulkTable {
    table: String,
    root: u32,
    page_size: usize,
    pending: u32,
    builder: TableBuilder,
    /// Finalized on drop, before the connection closes (the owner declares this table before
    /// its connection).
    write: RawStatement,
    files: Arc<Files>,
    /// This transaction may write new pages past the pager ([`others_have_it_open`]), and holds
    /// the checkpointer lock against other processes until [`BulkTable::committed`].
    direct: bool,
    /// `written_direct` when this transaction began: more at the seal means a sync is due.
    direct_at_begin: u64,
    /// Those pages not in the file yet ([`direct`]): written by [`BulkTable::seal`] at the latest.
    run: Run,
    /// Pages written past the pager so far.
    written_direct: u64,
    /// SQL changed the table since the pages were last written: read its shape back first.
    stale: bool,
    /// `PRAGMA data_version` when this connection last began a transaction: it changes when
    /// another connection commits (an `analyze` of the live trace rewriting rows in place).
    data_version: Option<i64>,
    /// Rows appended since the last [`BulkTable::seal`].
    unsealed: usize,
}

fn read_page(conn: &Connection, pgno: u32) -> rusqlite::Result<Vec<u8>> {
    conn.query_row("SELECT data FROM sqlite_dbpage WHERE pgno = ?1", [pgno], |r| r.get(0))
}

/// "no such table: sqlite_dbpage" said as what to do about it.
fn no_dbpage(e: rusqlite::Error) -> BulkError {
    match e {
        rusqlite::Error::SqliteFailure(_, Some(ref m)) if m.contains("sqlite_dbpage") => BulkError::NoDbpage,
        other => other.into(),
    }
}

fn page_count(conn: &Connection) -> rusqlite::Result<u32> {
    conn.query_row("PRAGMA page_count", [], |r| r.get(0))
}

impl BulkTable {
    /// Appends to `table` of the DB at `path` (`conn`'s), which has no index.
    pub fn open(conn: &Connection, path: &Path, table: &str) -> Result<Self, BulkError> {
        Self::open_with_pending_byte(conn, path, table, PENDING_BYTE)
    }

    fn open_with_pending_byte(
        conn: &Connection,
        path: &Path,
        table: &str,
        pending_byte: u64,
    ) -> Result<Self, BulkError> {
        let root: Option<u32> = conn
            .query_row("SELECT rootpage FROM sqlite_master WHERE type = 'table' AND name = ?1", [table], |r| r.get(0))
            .optional()?;
        let root = root.filter(|&r| r > 1).ok_or_else(|| BulkError::NoTable(table.to_owned()))?;
        let page_size: usize = conn.query_row("PRAGMA page_size", [], |r| r.get(0))?;
        check_header(&read_page(conn, 1).map_err(no_dbpage)?, page_size).map_err(BulkError::Unsupported)?;
        let attached: i64 = conn.query_row(
            "SELECT count(*) FROM sqlite_master WHERE tbl_name = ?1 AND type IN ('index', 'trigger')",
            [table],
            |r| r.get(0),
        )?;
        if attached > 0 {
            return Err(BulkError::Unsupported(format!("table {table} has an index or a trigger to keep up")));
        }
        let pending = pending_page(pending_byte, page_size);
        let builder = TableBuilder::new(page_size, root, page_count(conn)?, pending);
        let write =
            RawStatement::prepare(conn, "INSERT INTO sqlite_dbpage (pgno, data) VALUES (?1, ?2)").map_err(no_dbpage)?;
        let db = std::fs::OpenOptions::new().write(true).open(path).map_err(BulkError::Io)?;
        let mut shm_path = path.as_os_str().to_owned();
        shm_path.push("-shm");
        let shm = std::fs::OpenOptions::new().read(true).write(true).open(shm_path).ok();
        let files = Arc::new(Files { db, shm, direct: direct::open(path) });
        Ok(Self {
            table: table.to_owned(),
            root,
            page_size,
            pending,
            builder,
            write,
            files,
            direct: false,
            run: Run::default(),
            written_direct: 0,
            direct_at_begin: 0,
            stale: true,
            data_version: None,
            unsealed: 0,
        })
    }

    /// The descriptors this table holds, to be closed only after the SQLite connection.
    pub fn files(&self) -> Arc<Files> {
        Arc::clone(&self.files)
    }

    /// A write transaction has just begun: learn the pages SQL added, and the table's shape if
    /// SQL changed it.
    pub fn begin(&mut self, conn: &Connection) -> Result<(), BulkError> {
        let version: i64 = conn.query_row("PRAGMA data_version", [], |r| r.get(0))?;
        if self.data_version.replace(version) != Some(version) {
            // Another connection committed since: it may have changed this table.
            self.stale = true;
        }
        self.run.clear();
        let count = page_count(conn)?;
        if self.stale {
            let shape = |source| BulkError::Shape { table: self.table.clone(), source };
            let mut read_error = None;
            let found = TableBuilder::find(self.root, |pgno| {
                read_page(conn, pgno).unwrap_or_else(|e| {
                    read_error.get_or_insert(e);
                    Vec::new()
                })
            });
            if let Some(e) = read_error {
                return Err(e.into());
            }
            let found = found.map_err(shape)?;
            let last = read_page(conn, TableBuilder::last_leaf(&found))?;
            self.builder =
                TableBuilder::resume(self.page_size, self.root, count, self.pending, found, &last).map_err(shape)?;
            self.stale = false;
        }
        self.builder.set_page_count(count);
        self.direct =
            self.files.shm.as_ref().is_some_and(|shm| !others_have_it_open(shm) && try_lock_byte(shm, CKPT_BYTE));
        self.direct_at_begin = self.written_direct;
        Ok(())
    }

    /// Whether another process has the DB open now (see [`others_have_it_open`]); true when it
    /// cannot tell (no `-shm` file: not a WAL DB).
    pub fn shared(&self) -> bool {
        self.files.shm.as_ref().is_none_or(others_have_it_open)
    }

    /// The transaction has committed (or rolled back): other processes may checkpoint again.
    pub fn committed(&mut self) {
        if std::mem::take(&mut self.direct) {
            if let Some(shm) = &self.files.shm {
                unlock_byte(shm, CKPT_BYTE);
            }
        }
    }

    /// Pages written straight into the file so far (the rest went through the pager).
    #[cfg(test)]
    pub fn written_direct(&self) -> u64 {
        self.written_direct
    }

    /// Appends one row inside the open transaction; returns its rowid.
    pub fn append(&mut self, cols: &[Col<'_>]) -> Result<i64, BulkError> {
        debug_assert!(!self.stale, "begin() reads the table back before appending");
        self.unsealed += 1;
        let mut pages = Pages {
            pager: &mut self.write,
            files: &self.files,
            run: &mut self.run,
            direct: self.direct,
            written_direct: &mut self.written_direct,
        };
        self.builder.append(cols, &mut pages)
    }

    /// Writes what the table needs to hold every appended row: call before the commit, and
    /// before any SQL of the same transaction reads the table.
    pub fn seal(&mut self, conn: &Connection) -> Result<(), BulkError> {
        if self.unsealed == 0 {
            return Ok(());
        }
        let mut pages = Pages {
            pager: &mut self.write,
            files: &self.files,
            run: &mut self.run,
            direct: self.direct,
            written_direct: &mut self.written_direct,
        };
        let sealed = self.builder.seal(&mut pages)?;
        // In the file, and durable, before the commit that links them in (see the module doc).
        self.run.flush(self.files.direct.as_ref(), &self.files.db).map_err(BulkError::Io)?;
        if self.written_direct > self.direct_at_begin {
            self.files.db.sync_data().map_err(BulkError::Io)?;
            self.direct_at_begin = self.written_direct;
        }
        let mut page1 = read_page(conn, 1)?;
        let mut count = sealed.page_count.max(u32::from_be_bytes(page1[28..32].try_into().expect("4 bytes")));
        for pgno in sealed.unused {
            // An empty freelist trunk page, pushed on the list.
            let mut trunk = vec![0u8; self.page_size];
            trunk[..4].copy_from_slice(&page1[32..36]);
            self.write.execute([Param::Int(pgno.into()), Param::Blob(&trunk)])?;
            page1[32..36].copy_from_slice(&pgno.to_be_bytes());
            let free = u32::from_be_bytes(page1[36..40].try_into().expect("4 bytes")) + 1;
            page1[36..40].copy_from_slice(&free.to_be_bytes());
            count = count.max(pgno);
        }
        page1[28..32].copy_from_slice(&count.to_be_bytes());
        self.write.execute([Param::Int(1), Param::Blob(&page1)])?;
        self.unsealed = 0;
        Ok(())
    }

    /// SQL is about to read or change the table (after the commit of [`BulkTable::seal`]'s
    /// pages): SQLite must see them, and appending must later start from what SQL left.
    ///
    /// `changes_table`: the SQL may change this table, whose shape must then be read back.
    pub fn hand_to_sql(&mut self, conn: &Connection, changes_table: bool) {
        release_page_cache(conn);
        self.stale |= changes_table;
    }
}

/// What the pages rely on in the file's header (<https://sqlite.org/fileformat2.html> 1.3): the
/// size the builder packs for, no reserved bytes, the fixed payload fractions, schema format 4
/// (records use the serial types 8 and 9 for 0 and 1), no auto-vacuum (its pointer-map pages
/// would need keeping up), UTF-8 text, and versions this code knows.
fn check_header(page1: &[u8], page_size: usize) -> Result<(), String> {
    let be32 = |at: usize| u32::from_be_bytes(page1[at..at + 4].try_into().expect("4 bytes"));
    let header_size = match u16::from_be_bytes([page1[16], page1[17]]) {
        1 => 65_536,
        n => usize::from(n),
    };
    let fail = |what: String| Err(what);
    if page1.len() < 100 || header_size != page_size {
        return fail(format!("its header's page size ({header_size}) is not the connection's ({page_size})"));
    }
    if !(1..=2).contains(&page1[18]) || !(1..=2).contains(&page1[19]) {
        return fail(format!("file format versions {}/{} are newer than this writer", page1[18], page1[19]));
    }
    if page1[20] != 0 {
        return fail(format!("{} bytes of each page are reserved (an extension's)", page1[20]));
    }
    if page1[21..24] != [64, 32, 32] {
        return fail("its payload fractions are not SQLite's fixed 64/32/32".into());
    }
    if be32(44) != 4 {
        return fail(format!("schema format {} (the pages are written in format 4)", be32(44)));
    }
    if be32(52) != 0 || be32(64) != 0 {
        return fail("auto_vacuum is on (pointer-map pages would need keeping up)".into());
    }
    if be32(56) != 1 {
        return fail(format!("text encoding {} is not UTF-8", be32(56)));
    }
    Ok(())
}

/// Whether a process other than this one has the DB open. Every connection holds a shared lock
/// on the `-shm` file's "DMS" byte (SQLite's unix VFS: byte 128, after the 8 WAL locks at 120)
/// for as long as it is open, and `F_GETLK` reports only other processes' locks.
///
/// Pages written past the committed end of the file are safe from readers (none looks there) but
/// not from another connection's checkpoint, which cuts the file at the committed end. Only a
/// connection that is open can checkpoint, and one opened after this check can neither write
/// (this transaction holds the write lock) nor, unless asked to explicitly, checkpoint.
fn others_have_it_open(shm: &File) -> bool {
    const DMS_BYTE: i64 = 128;
    another_process_locks(shm, DMS_BYTE)
}

#[cfg(test)]
mod tests;
