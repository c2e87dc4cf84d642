//! Memory no traced call explains: at each of the driver's readings, what it counted for a
//! process (npu-smi's or nvidia-smi's figure) minus the device memory the trace saw the process
//! hold then (its live `HAL` blocks: every runtime or driver allocation the probes caught). A job
//! that OOMs with "0 B allocated and 48 MiB free" has its card full of exactly this.
//!
//! The readings are our `ms_driver` rows (the tracer asks the driver's management library on a
//! timer), or, in msMemScope's DBs, the `process_used` it writes on each HAL row. A reading comes
//! between rows: the traced bytes are those live just before it. A reading is periodic, so a
//! block born and freed between two readings never shows, and an allocation racing a reading can
//! make one point off by its size; the figure to trust is a steady one (the job holding its
//! memory), which is what a leak or an unexplained reservation looks like.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

use super::attr::attr_fields;
use super::db::{DumpDb, DumpRow, Selection};
use super::pass::{self, Consumer};
use super::AnalysisError;
use crate::store::driver::TABLE as DRIVER_TABLE;
use crate::units::human_bytes;
use crate::vocab::EventType;

/// Our result table (docs/db-schema.md).
pub const TABLE: &str = "ms_unexplained";
pub const CREATE: &str = "CREATE TABLE ms_unexplained (
    pid INTEGER NOT NULL, ts_ns INTEGER NOT NULL, process_used INTEGER NOT NULL,
    traced INTEGER NOT NULL, unexplained INTEGER NOT NULL)";

/// What usually makes the difference, said under every report with some.
pub const USUAL_CAUSES: [&str; 4] = [
    "the runtime's context, streams and events, taken when a thread first uses the device (tens to hundreds of MiB per device)",
    "a communication library's buffers (HCCL, NCCL) and other libraries (cuBLAS workspaces, graph executors) allocating through calls the tracer does not probe",
    "memory allocated before the trace attached (attach mode: the blocks it never saw allocated)",
    "another process's memory that the driver counts against this one (an IPC-shared or imported handle)",
];

/// Where the readings came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// `ms_driver` (our tracer).
    DriverTable,
    /// `process_used` on HAL rows (msMemScope).
    RowAttr,
    /// Neither: the trace has no driver figures.
    None,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Point {
    pub ts_ns: i64,
    pub process_used: i64,
    pub traced: i64,
    pub unexplained: i64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Process {
    pub pid: i64,
    pub points: Vec<Point>,
}

impl Process {
    pub fn last(&self) -> Option<&Point> {
        self.points.last()
    }

    pub fn largest(&self) -> Option<&Point> {
        self.points.iter().max_by_key(|p| (p.unexplained, -p.ts_ns))
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Report {
    pub source: Source,
    pub processes: Vec<Process>,
    /// The device's used and total bytes at its last reading, when the driver said.
    pub device: Option<(i64, i64)>,
    /// The first row's time, for `+T` in the text.
    #[serde(skip)]
    pub start_ns: Option<i64>,
}

/// A reading of one process.
#[derive(Clone, Copy, Debug)]
struct Reading {
    ts: i64,
    pid: i64,
    process_used: i64,
    device: Option<(i64, i64)>,
}

fn table_readings(db: &DumpDb) -> Result<Option<Vec<Reading>>, AnalysisError> {
    let read = |source| AnalysisError::Read { path: db.path().to_owned(), source };
    let conn = db.conn();
    let has: i64 = conn
        .query_row("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?1", [DRIVER_TABLE], |r| {
            r.get(0)
        })
        .map_err(read)?;
    if has == 0 {
        return Ok(None);
    }
    let mut stmt = conn
        .prepare(&format!(
            "SELECT ts_ns, pid, process_used, device_used, device_total FROM {DRIVER_TABLE} \
             WHERE pid IS NOT NULL AND process_used IS NOT NULL ORDER BY ts_ns, rowid"
        ))
        .map_err(read)?;
    let rows = stmt
        .query_map([], |r| {
            let (used, total): (Option<i64>, Option<i64>) = (r.get(3)?, r.get(4)?);
            Ok(Reading { ts: r.get(0)?, pid: r.get(1)?, process_used: r.get(2)?, device: used.zip(total) })
        })
        .and_then(|rows| rows.collect::<Result<Vec<_>, _>>())
        .map_err(read)?;
    Ok((!rows.is_empty()).then_some(rows))
}

attr_fields! {
    struct BlockAttr { size, shadow, process_used, device_used }
}

/// Follows each process's live HAL bytes and puts each reading against them.
#[derive(Default)]
struct Replay {
    /// Readings from the table not reached yet, newest first (the next is last).
    pending: Vec<Reading>,
    /// All of them, for a restart.
    all: Vec<Reading>,
    /// No table: readings are read from the rows' Attr.
    from_rows: bool,
    live: BTreeMap<(i64, u64), i64>,
    held: BTreeMap<i64, i64>,
    points: BTreeMap<i64, Vec<Point>>,
    device: Option<(i64, i64)>,
    first_ts: Option<i64>,
}

fn ptr_value(text: &str) -> Option<u64> {
    let hex = text.strip_prefix("0x")?;
    u64::from_str_radix(hex, 16).ok()
}

impl Replay {
    fn place(&mut self, r: Reading) {
        let traced = self.held.get(&r.pid).copied().unwrap_or(0);
        let point = Point { ts_ns: r.ts, process_used: r.process_used, traced, unexplained: r.process_used - traced };
        self.points.entry(r.pid).or_default().push(point);
        self.device = r.device.or(self.device);
    }

    /// Places every pending reading taken before `ts`.
    fn catch_up(&mut self, ts: i64) {
        while self.pending.last().is_some_and(|r| r.ts < ts) {
            let r = self.pending.pop().expect("checked");
            self.place(r);
        }
    }

    fn apply(&mut self, row: &DumpRow<'_>, a: &BlockAttr<'_>) {
        let Some(ptr) = ptr_value(row.ptr) else { return };
        let key = (row.pid, ptr);
        let size = a.size.as_deref().and_then(|s| s.parse::<i64>().ok()).unwrap_or(0);
        let delta = match row.event {
            "MALLOC" if size > 0 => {
                self.live.insert(key, size);
                size
            }
            "FREE" => -self.live.remove(&key).unwrap_or(0),
            _ => 0,
        };
        *self.held.entry(row.pid).or_default() += delta;
    }

    fn finish(mut self, source: Source) -> Report {
        self.catch_up(i64::MAX);
        let processes = self.points.into_iter().map(|(pid, points)| Process { pid, points }).collect();
        Report { source, processes, device: self.device, start_ns: self.first_ts }
    }
}

impl Consumer for Replay {
    fn selection(&self) -> Selection<'static> {
        Selection { events: &["MALLOC", "FREE"], name: false, thread: false }
    }

    fn row(&mut self, row: DumpRow<'_>) {
        self.first_ts.get_or_insert(row.ts);
        if row.event_type != EventType::Hal.as_str() {
            return;
        }
        self.catch_up(row.ts);
        let a = BlockAttr::parse(row.attr).unwrap_or_default();
        // A shadow free is the stop's bookkeeping, not the process letting go.
        if a.shadow.is_some() {
            return;
        }
        self.apply(&row, &a);
        if self.from_rows {
            if let Some(used) = a.process_used.as_deref().and_then(|s| s.parse::<i64>().ok()).filter(|u| *u >= 0) {
                let device = a.device_used.as_deref().and_then(|s| s.parse().ok()).map(|d| (d, -1));
                self.place(Reading { ts: row.ts, pid: row.pid, process_used: used, device });
            }
        }
    }

    fn restart(&mut self) {
        let all = std::mem::take(&mut self.all);
        *self = Self { pending: all.clone(), all, from_rows: self.from_rows, ..Self::default() };
    }
}

/// Puts the DB's driver readings against its traced HAL blocks.
pub fn analyse(db: &DumpDb) -> Result<Report, AnalysisError> {
    let table = table_readings(db)?;
    let source = if table.is_some() { Source::DriverTable } else { Source::RowAttr };
    let mut pending = table.unwrap_or_default();
    pending.reverse();
    let mut replay =
        Replay { pending: pending.clone(), all: pending, from_rows: source == Source::RowAttr, ..Replay::default() };
    pass::run(db, &mut [&mut replay])?;
    let mut report = replay.finish(source);
    if report.processes.is_empty() {
        report.source = Source::None;
    }
    if report.device.is_some_and(|(_, total)| total < 0) {
        report.device = None;
    }
    Ok(report)
}

fn at(p: &Point, start: Option<i64>) -> String {
    match start {
        Some(s) => format!("+{:.1} s", (p.ts_ns - s) as f64 / 1e9),
        None => format!("{} ns", p.ts_ns),
    }
}

fn share(p: &Point) -> String {
    if p.process_used > 0 {
        format!(" ({:.1} % of it)", 100.0 * p.unexplained as f64 / p.process_used as f64)
    } else {
        String::new()
    }
}

/// The text report of one DB.
pub fn text(report: &Report, path: &Path, device: &str) -> String {
    let mut out = format!("unexplained memory, device {device} ({})\n", path.display());
    if report.source == Source::None {
        out.push_str(
            "  no driver readings in this trace: trace with --driver-every (on by default where the driver's \
             management library, libdcmi.so or libnvidia-ml.so.1, is found) to compare the driver's figure with \
             the traced calls\n",
        );
        return out;
    }
    for p in &report.processes {
        let (Some(last), Some(big)) = (p.last(), p.largest()) else { continue };
        out.push_str(&format!(
            "  pid {}: {} readings; at the last ({}) the driver counted {} for the process, the traced calls \
             explain {}: {} unexplained{}\n",
            p.pid,
            p.points.len(),
            at(last, report.start_ns),
            human_bytes(last.process_used),
            human_bytes(last.traced),
            human_bytes(last.unexplained),
            share(last),
        ));
        out.push_str(&format!(
            "    most unexplained: {} at {}\n",
            human_bytes(big.unexplained),
            at(big, report.start_ns)
        ));
    }
    if let Some((used, total)) = report.device {
        out.push_str(&format!("  the device: {} used of {}\n", human_bytes(used), human_bytes(total)));
    }
    if report.processes.iter().filter_map(Process::largest).any(|p| p.unexplained > 0) {
        out.push_str("  what usually explains it:\n");
        for cause in USUAL_CAUSES {
            out.push_str(&format!("    - {cause}\n"));
        }
    }
    out
}

/// The JSON report of one DB.
pub fn json(report: &Report, path: &Path, device: &str) -> serde_json::Value {
    serde_json::json!({
        "analysis": "unexplained",
        "path": path.display().to_string(),
        "device": device,
        "source": report.source,
        "device_used": report.device.map(|d| d.0),
        "device_total": report.device.map(|d| d.1),
        "processes": report.processes.iter().map(|p| serde_json::json!({
            "pid": p.pid,
            "last": p.last(),
            "largest": p.largest(),
            "points": p.points,
        })).collect::<Vec<_>>(),
        "usual_causes": USUAL_CAUSES,
    })
}

/// The table's rows: (pid, ts, process_used, traced, unexplained).
pub fn rows(report: &Report) -> Vec<[i64; 5]> {
    let each = |p: &Process| {
        p.points.iter().map(|q| [p.pid, q.ts_ns, q.process_used, q.traced, q.unexplained]).collect::<Vec<_>>()
    };
    report.processes.iter().flat_map(each).collect()
}

#[cfg(test)]
mod tests;
