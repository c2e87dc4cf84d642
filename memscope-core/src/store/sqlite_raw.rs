//! The hot statement of the SQLite sink, on SQLite's C API: the page writer's
//! `INSERT INTO sqlite_dbpage`, run once per 64 KiB page.
//!
//! rusqlite copies every bound blob (`SQLITE_TRANSIENT`); here a page is bound `SQLITE_STATIC`
//! from the builder's buffer, which outlives the statement's execution, and the statement is
//! prepared once. All unsafe code of the store's SQLite and file-lock use is in this file (the
//! lock query is for [`super::bulk`]).

use std::ffi::{c_int, CString};
use std::ptr;

use rusqlite::ffi;
use rusqlite::Connection;

/// A prepared statement owned outside rusqlite. Finalized on drop, so it must be dropped before
/// its connection is closed (`DbSink` declares it first).
pub struct RawStatement {
    db: *mut ffi::sqlite3,
    stmt: *mut ffi::sqlite3_stmt,
}

// SAFETY: the statement is used only by the thread that owns the sink, and SQLite is built
// threadsafe; moving it between threads with its connection is allowed.
unsafe impl Send for RawStatement {}

fn error(db: *mut ffi::sqlite3, rc: c_int) -> rusqlite::Error {
    // SAFETY: `db` is a live connection; sqlite3_errmsg returns a NUL-terminated string it owns.
    let msg = unsafe {
        let p = ffi::sqlite3_errmsg(db);
        (!p.is_null()).then(|| std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned())
    };
    rusqlite::Error::SqliteFailure(ffi::Error::new(rc), msg)
}

/// Turns off SQLite's allocation statistics before its first use in this process. With them on,
/// every allocation takes a global mutex, which showed up in the store thread's profile.
pub fn tune_sqlite_once() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: called before any connection exists (the store opens the first one); a failure
        // (SQLITE_MISUSE if already initialised) only leaves the default in place.
        unsafe {
            ffi::sqlite3_config(ffi::SQLITE_CONFIG_MEMSTATUS, 0 as c_int);
        }
    });
}

/// Frees the connection's unused page cache. Pages written through `sqlite_dbpage` (see
/// [`super::bulk`]) bypass the B-tree layer, whose decoded view of a cached page would then be
/// stale: dropping the cache before SQL touches those pages again makes SQLite read them anew.
pub fn release_page_cache(conn: &Connection) {
    // SAFETY: a live connection handle; the call only frees unreferenced cache pages (there are
    // no open statements between the transactions where it is called).
    unsafe {
        ffi::sqlite3_db_release_memory(conn.handle());
    }
}

/// Whether a process other than this one holds a lock on byte `at` of `file` (`F_GETLK` reports
/// only other processes' locks). When it cannot tell, it says yes, the careful answer.
pub fn another_process_locks(file: &std::fs::File, at: i64) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: a zeroed flock is valid; the fields that matter are set below.
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = libc::F_WRLCK as libc::c_short;
    lock.l_whence = libc::SEEK_SET as libc::c_short;
    lock.l_start = at;
    lock.l_len = 1;
    // SAFETY: a valid descriptor and a pointer to a live flock.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETLK, &mut lock) };
    rc != 0 || lock.l_type != libc::F_UNLCK as libc::c_short
}

/// Takes a write lock on byte `at` of `file` for this process, without waiting; false when
/// another process holds one there. POSIX locks belong to the process, not the descriptor:
/// SQLite's own connection in this process takes and drops the same byte freely (its unlock drops
/// this lock too), so this only keeps *other* processes off the byte.
pub fn try_lock_byte(file: &std::fs::File, at: i64) -> bool {
    set_lock(file, at, libc::F_WRLCK)
}

/// Drops this process's lock on byte `at` of `file` (see [`try_lock_byte`]).
pub fn unlock_byte(file: &std::fs::File, at: i64) {
    set_lock(file, at, libc::F_UNLCK);
}

fn set_lock(file: &std::fs::File, at: i64, kind: libc::c_int) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: a zeroed flock is valid; the fields that matter are set below.
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = kind as libc::c_short;
    lock.l_whence = libc::SEEK_SET as libc::c_short;
    lock.l_start = at;
    lock.l_len = 1;
    // SAFETY: a valid descriptor and a pointer to a live flock; F_SETLK never blocks.
    unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETLK, &lock) == 0 }
}

/// A value for one parameter.
pub enum Param<'a> {
    Int(i64),
    Blob(&'a [u8]),
}

impl RawStatement {
    pub fn prepare(conn: &Connection, sql: &str) -> rusqlite::Result<Self> {
        let sql = CString::new(sql).map_err(|_| rusqlite::Error::InvalidQuery)?;
        // SAFETY: the handle is valid while `conn` lives; the statement is finalized before the
        // connection closes (see the type's doc).
        let db = unsafe { conn.handle() };
        let mut stmt = ptr::null_mut();
        // SAFETY: valid db handle, NUL-terminated SQL, out pointer.
        let rc = unsafe { ffi::sqlite3_prepare_v2(db, sql.as_ptr(), -1, &mut stmt, ptr::null_mut()) };
        if rc != ffi::SQLITE_OK {
            return Err(error(db, rc));
        }
        Ok(Self { db, stmt })
    }

    /// Binds `params` (1-based, in order) and runs the statement once.
    ///
    /// Blobs are bound without copying; the borrow of `params` ensures they live until the
    /// statement has run and been reset, after which SQLite no longer reads them.
    pub fn execute<'a>(&mut self, params: impl IntoIterator<Item = Param<'a>>) -> rusqlite::Result<()> {
        for (index, p) in (1..).zip(params) {
            // SAFETY: valid statement; for a blob, pointer and length describe a live slice that
            // outlives the step below (SQLITE_STATIC: SQLite does not free or copy it).
            let rc = unsafe {
                match p {
                    Param::Int(v) => ffi::sqlite3_bind_int64(self.stmt, index, v),
                    Param::Blob(b) => {
                        let len = c_int::try_from(b.len()).map_err(|_| rusqlite::Error::InvalidQuery)?;
                        ffi::sqlite3_bind_blob(self.stmt, index, b.as_ptr().cast(), len, ffi::SQLITE_STATIC())
                    }
                }
            };
            if rc != ffi::SQLITE_OK {
                return Err(error(self.db, rc));
            }
        }
        // SAFETY: valid, fully bound statement.
        let rc = unsafe { ffi::sqlite3_step(self.stmt) };
        // SAFETY: as above. Resetting drops SQLite's references to the bound text.
        let reset = unsafe { ffi::sqlite3_reset(self.stmt) };
        if rc != ffi::SQLITE_DONE {
            return Err(error(self.db, if rc == ffi::SQLITE_ROW { reset } else { rc }));
        }
        Ok(())
    }
}

impl Drop for RawStatement {
    fn drop(&mut self) {
        // SAFETY: the statement was prepared by us and is finalized exactly once.
        unsafe { ffi::sqlite3_finalize(self.stmt) };
    }
}
