//! msMemScope's `python_trace_<pid>` tables (`trace --python-trace`): one per traced process
//! with intervals, in every device output, as Insight reads the table of the file it opened
//! (shared/reference/msmemscope-and-insight.md §3.2). The intervals come from
//! `ingest::py_trace`.
//!
//! Insight's rules decide the form: a table is created only with its first row (an empty
//! `python_trace_*` table makes Insight refuse the whole file); the times are TEXT of the
//! wall-clock ns, all 19 digits wide, which its string ordering then sorts right; `Process Id` is
//! the table's own pid, `Thread Id` never 0.

use std::sync::Arc;

/// One function's interval on one thread.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PyTraceRow {
    pub pid: u32,
    pub tid: u32,
    /// `file(line): name`, as msMemScope writes `FuncInfo`.
    pub info: Arc<str>,
    pub start_ns: u64,
    pub end_ns: u64,
}

/// The prefix of the tables' names (`python_trace_<pid>`).
pub const TABLE_PREFIX: &str = "python_trace_";

fn create(pid: u32) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {TABLE_PREFIX}{pid} (\"FuncInfo\" TEXT, \"StartTime(ns)\" TEXT, \
         \"EndTime(ns)\" TEXT, \"Thread Id\" INTEGER, \"Process Id\" INTEGER)"
    )
}

/// Inserts `rows` into their processes' tables, creating each with its first row.
pub fn insert(conn: &rusqlite::Connection, rows: &[PyTraceRow]) -> rusqlite::Result<()> {
    let mut created: Vec<u32> = Vec::new();
    for r in rows {
        if !created.contains(&r.pid) {
            conn.execute_batch(&create(r.pid))?;
            created.push(r.pid);
        }
        let sql = format!(
            "INSERT INTO {TABLE_PREFIX}{} (\"FuncInfo\", \"StartTime(ns)\", \"EndTime(ns)\", \"Thread Id\", \
             \"Process Id\") VALUES (?1, ?2, ?3, ?4, ?5)",
            r.pid
        );
        conn.prepare_cached(&sql)?.execute(rusqlite::params![
            &*r.info,
            r.start_ns.to_string(),
            r.end_ns.to_string(),
            r.tid,
            r.pid
        ])?;
    }
    Ok(())
}
