//! Offline analyses of finished trace DBs (the `analyze` verb), as msMemScope's `--analysis`
//! names them. They read `memscope_dump` only, so they work on any DB Insight opens, ours or
//! msMemScope's, and need no privileges.
//!
//! - [`contract`]: the one shape every analysis has (`analyse` over an open DB, `text`, `json`,
//!   `store`) and its implementations, which the verbs pick by name.
//! - [`attr`]: the Attr values each analysis reads, parsed only as far as needed.
//! - [`db`]: finding the DBs of a trace folder, opening them safely, streaming their rows in time
//!   order (the one reader every analysis uses), and replacing our own `ms_*` result tables
//!   (never Insight's) in one transaction.
//! - [`decompose`]: where the memory was at an instant, as an owner tree (msMemScope's
//!   decomposition, the tree Insight draws).
//! - [`pass`]: one time-ordered pass over a DB feeding several replays (what `advise` reads).
//! - [`render`]: the text and JSON reports.
//! - [`inefficient`], [`inefficient_out`]: memory held while unused, by msMemScope's op-index
//!   definitions and Insight's time-based ones; results into the MALLOC rows and `ms_inefficient`.
//! - [`fragmentation`], [`oom`], [`advise`]: the caching pool's fragmentation over time, OOM
//!   forensics, and allocator settings recommended from them (`ms_fragmentation`, `ms_oom`, `ms_advice`).
//! - [`gc_held`]: tensors only Python's garbage collector freed, held past their step (the
//!   advisor's evidence for collecting at epoch ends).
//! - [`stream_reuse`]: blocks freed while another stream still used them, and the pool growth
//!   meanwhile (the evidence for MULTI_STREAM_MEMORY_REUSE).
//! - [`atb_workspace`]: ATB operations' workspaces and intermediate tensors against the device's
//!   peak (the advisor's evidence for ATB_WORKSPACE_MEM_ALLOC_ALG_TYPE).
//! - [`instants`]: steps, marks, OOMs and the pools' reserved bytes over time (what the
//!   exports and the report draw on a timeline).
//! - [`compare`]: two runs owner by owner at the instants both reached, and where what grew is
//!   judged (`compare` and `report A B` alike).
//! - [`ranks`]: a distributed job's ranks side by side, and the ones that stand out, with why
//!   (`compare` and `report` over a job's traces).
//! - [`calls`], [`opdiff`], [`calldiff`]: a trace's operator or kernel sequence with each call's
//!   memory delta, Myers' shortest edit script between two of them, and the report of
//!   `compare --level`.

pub mod advise;
pub mod atb_workspace;
pub mod attr;
pub mod blocks;
pub mod calldiff;
pub mod calls;
pub mod compare;
pub mod contract;
pub mod db;
pub mod decompose;
pub mod degradation;
pub mod fragmentation;
pub mod gc_held;
pub mod incidents;
pub mod inefficient;
pub mod instants;
pub mod leaks;
pub mod oom;
pub mod opdiff;
pub mod pass;
pub mod pool;
pub mod py_stacks;
pub mod ranks;
pub mod render;
pub mod simulate;
pub mod sites;
pub mod step_pattern;
pub mod steps;
pub mod stream_reuse;
pub mod unexplained;

/// The inefficient analysis's output, at the path it had before `inefficient/` was a folder.
use std::path::{Path, PathBuf};

use thiserror::Error;

pub use inefficient::out as inefficient_out;

/// What can go wrong with an input DB. Every message names the file and says what to do, since
/// the user's usual mistake is pointing at the wrong file (a CSV trace, a folder one level off,
/// a DB Insight made read-only), not a bug.
#[derive(Debug, Error)]
pub enum AnalysisError {
    #[error("{path}: no such file or folder; give a memscope_dump_*.db or .csv file or a trace output folder (memscope_<pid>_<time>_ascend/, msMemScope's msmemscope_<pid>_<time>_ascend/)")]
    NotFound { path: PathBuf },
    #[error("{path}: no trace under this folder (looked for dump DBs and CSVs in device_*/dump/ and dump/, in it and in its subfolders); give a trace output folder (memscope_<pid>_<time>_ascend/, msMemScope's msmemscope_<pid>_<time>_ascend/), the folder holding them, or a .db or .csv file")]
    NoDbInFolder { path: PathBuf },
    #[error("{path}: cannot read it (check that you may read it and its folder)")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path} is {what}: give a memscope_dump_*.db or memscope_dump_*.csv file, or the trace's output folder")]
    NotAFile { path: PathBuf, what: &'static str },
    #[error("{path}: not an SQLite database ({why}); give a memscope_dump_*.db or memscope_dump_*.csv file, a memory snapshot pickle, or the trace's output folder")]
    NotSqlite { path: PathBuf, why: String },
    #[error("{path}: {what}, not a trace dump; give the memscope_dump_*.csv (or .db) beside it, or the trace's output folder")]
    NotDumpCsv { path: PathBuf, what: String },
    #[error("{path}: the trace did not finish, so its last rows are still in {wal}, and SQLite cannot read them in this read-only folder (it must create the -shm index beside them); copy the trace folder somewhere writable and analyse the copy")]
    WalInReadOnlyFolder { path: PathBuf, wal: PathBuf },
    #[error(
        "{path}: another process holds the DB locked (a running trace, Insight or sqlite3); retry when it is done"
    )]
    Locked { path: PathBuf },
    #[error("{path}: no memscope_dump table (tables: {tables}); this is not a trace DB written by memscope-bpf or msMemScope")]
    NoDumpTable { path: PathBuf, tables: String },
    #[error("{path}: table {table} lacks the column(s) {missing}; the DB is not in msMemScope's format")]
    MissingColumns { path: PathBuf, table: String, missing: String },
    #[error("{path}: the file is read-only, and the results are written into it (its ms_* result tables); make it writable (chmod u+w) or pass --no-write to only print them")]
    ReadOnly { path: PathBuf },
    #[error("{path}: no operator calls to compare (OP_LAUNCH rows with ATEN_END or ATB_END); record them by running the workload inside `with memscope.torch.trace_ops():` (the markers package), or compare kernels with --level kernel, or steps and owners without --level")]
    NoOps { path: PathBuf },
    #[error("{path}: no kernel calls to compare (KERNEL_LAUNCH rows); they are recorded when aclrtLaunchKernel in libascendcl.so is probed (`memscope-bpf probes --pid PID` lists the probes; --lib adds a library), or compare operators with --level op, or steps and owners without --level")]
    NoKernels { path: PathBuf },
    #[error("{path}: cannot read the trace (the DB is damaged or was changed by another tool; trace the job again)")]
    Read { path: PathBuf, source: rusqlite::Error },
    #[error("{path}: {source}")]
    Setting { path: PathBuf, source: simulate::SettingError },
    #[error("{path}: cannot write the results, nothing was changed (if the file or its folder is read-only make it writable, if a running trace or Insight holds it retry when it is done, or pass --no-write)")]
    Write { path: PathBuf, source: rusqlite::Error },
}

impl AnalysisError {
    /// A DB that SQLite could not open or read the schema of: locked by someone else (a lock
    /// held past the busy timeout), or not an SQLite database at all.
    pub(crate) fn opening(path: &Path, e: rusqlite::Error) -> Self {
        use rusqlite::ErrorCode::{DatabaseBusy, DatabaseLocked};
        match e.sqlite_error_code() {
            Some(DatabaseBusy | DatabaseLocked) => Self::Locked { path: path.to_owned() },
            _ => Self::NotSqlite { path: path.to_owned(), why: e.to_string() },
        }
    }
}

#[cfg(any(test, feature = "testing"))]
pub mod testdb {
    //! Small trace DBs for tests, written with the real schema and Attr format.

    use std::path::{Path, PathBuf};

    use rusqlite::{params, Connection};

    use crate::store::schema::create_dump_table;
    use crate::store::Attr;

    /// A fresh, empty folder for one test.
    pub fn dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("memscope-analysis-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    pub struct TestDb {
        pub path: PathBuf,
        conn: Connection,
        next_id: i64,
    }

    impl TestDb {
        /// A DB at `path` with `memscope_dump` (and `ms_meta`, as `trace` writes it).
        pub fn create(path: &Path) -> Self {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            let conn = Connection::open(path).unwrap();
            conn.execute_batch(&create_dump_table()).unwrap();
            conn.execute_batch("CREATE TABLE ms_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)").unwrap();
            Self { path: path.to_owned(), conn, next_id: 1 }
        }

        pub fn row(&mut self, event: &str, event_type: &str, ts: i64, pid: i64, ptr: Option<u64>, attr: Attr) {
            let ptr = ptr.map_or_else(|| "N/A".to_owned(), |p| format!("0x{p:016x}"));
            self.conn
                .execute(
                    "INSERT INTO memscope_dump VALUES (?1, ?2, ?3, 'x', ?4, ?5, ?5, '0', ?6, ?7, '', '')",
                    params![self.next_id, event, event_type, ts, pid, ptr, attr.to_json()],
                )
                .unwrap();
            self.next_id += 1;
        }

        /// A row with a `Name` (an operator, a kernel) on thread `tid` of process 1.
        pub fn named(&mut self, event: &str, event_type: &str, name: &str, ts: i64, tid: i64) {
            self.row(event, event_type, ts, 1, None, Attr::new());
            let sql = "UPDATE memscope_dump SET Name = ?1, \"Thread Id\" = ?2 WHERE rowid = last_insert_rowid()";
            self.conn.execute(sql, params![name, tid]).unwrap();
        }

        pub fn system(&mut self, what: &str, ts: i64) {
            self.row("SYSTEM", what, ts, 1, None, Attr::new().with("tool", "memscope-bpf"));
        }

        pub fn malloc(&mut self, ty: &str, ts: i64, ptr: u64, size: u64, owner: Option<&'static str>) {
            let attr = Attr::new().addr("addr", ptr).with("size", size).with_opt("owner", owner);
            self.row("MALLOC", ty, ts, 1, Some(ptr), attr);
        }

        pub fn free(&mut self, ty: &str, ts: i64, ptr: u64) {
            self.row("FREE", ty, ts, 1, Some(ptr), Attr::new().addr("addr", ptr).with("size", 1u64));
        }

        pub fn free_marked(&mut self, ty: &str, ts: i64, ptr: u64, mark: &'static str) {
            let attr = Attr::new().addr("addr", ptr).with("size", 0u64).with(mark, "true");
            self.row("FREE", ty, ts, 1, Some(ptr), attr);
        }

        pub fn conn(&self) -> &Connection {
            &self.conn
        }
    }
}
