//! The named instants of a trace and the caching pools' reservations over time, as the views
//! that draw a trace over time show them (`export --format perfetto`, `report`): step
//! boundaries (`SYSTEM`/`STEP`, named by the step that ended), mstx marks, OOM triggers, and
//! each pool's reserved bytes (the `total` torch_npu reports on every `PTA` row, per process and
//! pool). One time-ordered pass; only changes of a pool's total are kept.

use super::attr::attr_fields;
use super::db::{DumpDb, Fed, Selection};
use super::AnalysisError;
use crate::vocab::{Event, EventType};

attr_fields! {
    struct Fields { total, pool, req_size }
}

/// What an instant marks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Step,
    Mark,
    Oom,
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Instant {
    pub ts: i64,
    pub kind: Kind,
    /// The step number, the mark's message, the OOM's requested bytes (empty when unknown).
    pub name: String,
}

/// A pool's reserved bytes changed: `total` is its new value, for process `pid`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reserved {
    pub ts: i64,
    pub pid: i64,
    /// Attr `pool` (`caching` when absent, as msMemScope's DBs write no pool).
    pub pool: String,
    pub total: i64,
}

#[derive(Clone, Debug, Default)]
pub struct Instants {
    /// In time order.
    pub instants: Vec<Instant>,
    /// In time order.
    pub reserved: Vec<Reserved>,
}

const EVENTS: [&str; 5] = [
    Event::Malloc.as_str(),
    Event::Free.as_str(),
    Event::System.as_str(),
    Event::Mstx.as_str(),
    Event::OomDetail.as_str(),
];

/// Reads the instants and pool reservations of `db`.
pub fn read(db: &DumpDb) -> Result<Instants, AnalysisError> {
    let mut out = Instants::default();
    let mut last: foldhash::HashMap<(i64, String), i64> = foldhash::HashMap::default();
    db.rows(Selection { events: &EVENTS, name: true, thread: false })?.for_each_row(|fed| match fed {
        Fed::Restart => {
            out = Instants::default();
            last.clear();
        }
        Fed::Row(row) => {
            let instant = |kind, name: String| Instant { ts: row.ts, kind, name };
            if row.event_type == EventType::Pta.as_str() {
                let Some(f) = Fields::parse(row.attr) else { return };
                let Some(total) = f.total.as_deref().and_then(|t| t.parse::<i64>().ok()) else { return };
                let pool = f.pool.as_deref().unwrap_or("caching").to_owned();
                if last.insert((row.pid, pool.clone()), total) != Some(total) {
                    out.reserved.push(Reserved { ts: row.ts, pid: row.pid, pool, total });
                }
            } else if row.event == Event::System.as_str() && row.event_type == EventType::Step.as_str() {
                out.instants.push(instant(Kind::Step, row.name.to_owned()));
            } else if row.event == Event::Mstx.as_str() && row.event_type == EventType::Mark.as_str() {
                out.instants.push(instant(Kind::Mark, row.name.trim_matches('"').to_owned()));
            } else if row.event_type == EventType::OomTrigger.as_str() {
                let req = Fields::parse(row.attr).and_then(|f| f.req_size.map(|r| r.into_owned()));
                out.instants.push(instant(Kind::Oom, req.unwrap_or_default()));
            }
        }
    })?;
    Ok(out)
}
