//! The analyses' findings the DB holds: the result tables `analyze` and `advise` wrote into it
//! (docs/db-schema.md), copied as they are, a table at a time, up to a row limit each, with the
//! count of the rest. The report draws what it knows (fragmentation over time, the OOM
//! verdicts) from the same rows; a table the DB lacks is named with the command that writes it.

use rusqlite::types::ValueRef;
use serde::Serialize;
use serde_json::Value;

use crate::analysis::db::DumpDb;
use crate::analysis::AnalysisError;

/// A result table, the analysis behind it and the command that writes it.
pub const TABLES: &[(&str, &str, &str)] = &[
    ("ms_advice", "Allocator advice", "memscope-bpf advise"),
    ("ms_oom", "OOM forensics", "memscope-bpf analyze --analysis oom"),
    ("ms_oom_blocks", "Blocks at each OOM", "memscope-bpf analyze --analysis oom"),
    ("ms_leaks", "Leak candidates", "memscope-bpf analyze --analysis leaks"),
    ("ms_sites", "The job's lines holding memory (peak, end) and leaking", "memscope-bpf analyze --analysis sites"),
    ("ms_degradation", "Degradation over steps", "memscope-bpf analyze --analysis leaks"),
    ("ms_fragmentation", "Caching-pool fragmentation over time", "memscope-bpf advise"),
    ("ms_simulation", "Allocator replay: reserved memory as recorded and under other settings", "memscope-bpf advise"),
    ("ms_inefficient", "Inefficient memory", "memscope-bpf analyze --analysis inefficient"),
    (
        "ms_unexplained",
        "Memory no traced call explains: the driver's figure for each process against its traced device memory",
        "memscope-bpf analyze --analysis unexplained",
    ),
];

/// Columns holding `Timestamp(ns)` values: made relative to the report's origin.
const TIME_COLUMNS: &[&str] = &["ts_ns", "alloc_ts", "free_ts"];

#[derive(Clone, Debug, Serialize)]
pub struct Finding {
    pub table: &'static str,
    pub title: &'static str,
    pub command: &'static str,
    /// Whether the DB has the table (`false`: the page says which command writes it).
    pub present: bool,
    pub columns: Vec<String>,
    pub rows: Vec<Vec<Value>>,
    /// Rows in the table (more than `rows.len()` when cut at the limit).
    pub total: u64,
}

/// JavaScript's numbers are exact to 2^53 only: larger integers travel as text.
fn cell(v: ValueRef<'_>, relative_to: Option<i64>) -> Value {
    match v {
        ValueRef::Null => Value::Null,
        ValueRef::Integer(i) => {
            let i = relative_to.map_or(i, |o| i - o);
            if i.unsigned_abs() < (1 << 53) {
                Value::from(i)
            } else {
                Value::from(i.to_string())
            }
        }
        ValueRef::Real(f) => Value::from(f),
        ValueRef::Text(t) => Value::from(String::from_utf8_lossy(t).into_owned()),
        ValueRef::Blob(b) => Value::from(format!("<{} bytes>", b.len())),
    }
}

/// Whether the DB holds `table`.
pub fn has_table(db: &DumpDb, table: &str) -> Result<bool, AnalysisError> {
    let read = |source| AnalysisError::Read { path: db.path().to_owned(), source };
    db.conn()
        .query_row("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?1", [table], |r| {
            r.get::<_, i64>(0)
        })
        .map(|n| n > 0)
        .map_err(read)
}

fn read_table(db: &DumpDb, finding: &mut Finding, limit: usize, origin: i64) -> rusqlite::Result<()> {
    let conn = db.conn();
    finding.total = conn.query_row(&format!("SELECT count(*) FROM \"{}\"", finding.table), [], |r| r.get(0))?;
    let mut stmt = conn.prepare(&format!("SELECT * FROM \"{}\" ORDER BY rowid LIMIT {limit}", finding.table))?;
    finding.columns = stmt.column_names().into_iter().map(str::to_owned).collect();
    let relative: Vec<Option<i64>> =
        finding.columns.iter().map(|c| TIME_COLUMNS.contains(&c.as_str()).then_some(origin)).collect();
    let mut rows = stmt.query([])?;
    while let Some(row) = rows.next()? {
        let cells = (0..relative.len()).map(|i| row.get_ref(i).map(|v| cell(v, relative[i])));
        finding.rows.push(cells.collect::<rusqlite::Result<_>>()?);
    }
    Ok(())
}

/// Every result table of [`TABLES`], `limit` rows at most each (times ns after `origin`).
pub fn read(db: &DumpDb, limit: usize, origin: i64) -> Result<Vec<Finding>, AnalysisError> {
    let mut out = Vec::new();
    for &(table, title, command) in TABLES {
        let mut finding =
            Finding { table, title, command, present: false, columns: Vec::new(), rows: Vec::new(), total: 0 };
        if has_table(db, table)? {
            finding.present = true;
            read_table(db, &mut finding, limit, origin)
                .map_err(|source| AnalysisError::Read { path: db.path().to_owned(), source })?;
        }
        out.push(finding);
    }
    Ok(out)
}
