//! The named instants of a trace and the caching pools' reservations over time, as the views
//! that draw a trace over time show them (`export --format perfetto`, `report`): step
//! boundaries (`SYSTEM`/`STEP`, named by the step that ended), mstx marks, OOM triggers, and
//! each pool's reserved and allocated bytes (the `total` and `used` torch_npu reports on every
//! `PTA` row, per process and pool). One time-ordered pass; only changes are kept.

use super::attr::attr_fields;
use super::db::{DumpDb, DumpRow, Fed, Selection};
use super::pass::Consumer;
use super::AnalysisError;
use crate::vocab::{Event, EventType};

attr_fields! {
    struct Fields { total, used, pool, req_size }
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

/// A pool's reserved or allocated bytes changed, for process `pid`: their new values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reserved {
    pub ts: i64,
    pub pid: i64,
    /// Attr `pool` (`caching` when absent, as msMemScope's DBs write no pool).
    pub pool: String,
    /// Attr `total`: the pool's reserved bytes.
    pub total: i64,
    /// Attr `used`: the pool's allocated bytes, when the row says.
    pub used: Option<i64>,
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
    let mut reader = Reader::default();
    db.rows(reader.selection())?.for_each_row(|fed| match fed {
        Fed::Restart => reader.restart(),
        Fed::Row(row) => reader.row(row),
    })?;
    Ok(reader.finish())
}

/// The reader behind [`read`], for a pass other replays share ([`super::pass`]).
#[derive(Default)]
pub struct Reader {
    out: Instants,
    /// Each (process, pool)'s last total and used.
    last: foldhash::HashMap<(i64, String), (i64, Option<i64>)>,
}

impl Reader {
    pub fn finish(self) -> Instants {
        self.out
    }
}

impl Consumer for Reader {
    fn selection(&self) -> Selection<'static> {
        Selection { events: &EVENTS, name: true, thread: false }
    }

    fn row(&mut self, row: DumpRow<'_>) {
        let out = &mut self.out;
        let instant = |kind, name: String| Instant { ts: row.ts, kind, name };
        if row.event_type == EventType::Pta.as_str() {
            let Some(f) = Fields::parse(row.attr) else { return };
            let Some(total) = f.total.as_deref().and_then(|t| t.parse::<i64>().ok()) else { return };
            let used = f.used.as_deref().and_then(|t| t.parse::<i64>().ok());
            let pool = f.pool.as_deref().unwrap_or("caching").to_owned();
            if self.last.insert((row.pid, pool.clone()), (total, used)) != Some((total, used)) {
                out.reserved.push(Reserved { ts: row.ts, pid: row.pid, pool, total, used });
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

    fn restart(&mut self) {
        *self = Self::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::testdb::{dir, TestDb};
    use crate::store::Attr;

    #[test]
    fn pool_counters_are_kept_when_they_change_and_instants_in_time_order() {
        let mut db = TestDb::create(&dir("instants").join("d.db"));
        let pta = |total: u64, used: u64| {
            Attr::new().addr("addr", 0x10u64).with("size", 8u64).with("total", total).with("used", used)
        };
        db.row("MALLOC", "PTA", 10, 1, Some(0x10), pta(100, 8));
        db.row("FREE", "PTA", 20, 1, Some(0x10), pta(100, 8)); // no change: not kept
        db.row("MALLOC", "PTA", 30, 1, Some(0x10), pta(100, 16).with("pool", "workspace"));
        db.named("SYSTEM", "STEP", "3", 40, 1);
        db.row("OOM_DETAIL", "OOM_TRIGGER", 50, 1, None, Attr::new().with("req_size", 4096u64));
        db.named("MSTX", "Mark", "\"saved\"", 60, 1);
        let got = read(&DumpDb::open_read(&db.path).unwrap()).unwrap();
        let pools: Vec<(i64, &str, i64, Option<i64>)> =
            got.reserved.iter().map(|r| (r.ts, r.pool.as_str(), r.total, r.used)).collect();
        assert_eq!(pools, [(10, "caching", 100, Some(8)), (30, "workspace", 100, Some(16))]);
        let instants: Vec<(i64, Kind, &str)> = got.instants.iter().map(|i| (i.ts, i.kind, i.name.as_str())).collect();
        assert_eq!(instants, [(40, Kind::Step, "3"), (50, Kind::Oom, "4096"), (60, Kind::Mark, "saved")]);
    }
}
