//! A dump table's rows in time order (`Timestamp(ns)`, then `ID`, as Insight orders them; IDs
//! break ties because a thread's rows are written in call order; rowid last): the one way every
//! analysis reads them.
//!
//! Sorting whole rows is most of the cost of a large trace, and traces are stored nearly in that
//! order already: ours in time order but for `STOP_TRACE`, written after the shadow frees that
//! are stamped one ns later (and rows of CPUs racing for the ring, a few apart). So rows stream in
//! storage order straight from SQLite's buffers, and only those that must wait for a row stored
//! later than its place (a straggler) are held back. The stragglers are first looked for among
//! the last rows only, a cheap read that finds the late `STOP_TRACE`; every row handed over is
//! checked to come after the one before, and should a straggler turn up that the tail did not
//! show, the caller gets [`Fed::Restart`] and the rows again, now from a full first pass over the
//! keys. Files far out of order (msMemScope writes a MALLOC when its block is freed) are sorted by
//! SQLite instead. Whatever the path, the rows handed over are exactly the sorted rows.
//!
//! SQLite's side (reading pages, decoding records, putting rows in order) runs on a thread of its
//! own with its own connection, and hands the rows over a few thousand at a time, so the replay
//! of one row overlaps the reading of the next: each side is about half the work.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use rusqlite::Connection;

use super::batch::{Batch, Item, Sender, BATCHES_IN_FLIGHT};
use super::rows::{DumpRow, Fed, Key};
use super::{int, text};
use crate::analysis::AnalysisError;

/// The rows a replay reads (by `Event`) and the optional columns it needs.
#[derive(Clone, Copy, Debug)]
pub struct Selection<'e> {
    pub events: &'e [&'e str],
    pub name: bool,
    pub thread: bool,
}

/// How the rows came, for tests and for explaining a slow run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadOrder {
    /// In storage order, the few rows stored late put back in their place.
    Storage,
    /// In storage order, after a [`Fed::Restart`] and a first pass that found every late row.
    Rescanned,
    /// Sorted by SQLite (after a [`Fed::Restart`] if streaming had begun): too many rows out of
    /// place.
    Sorted,
}

/// Past this many out-of-place rows, SQLite's sort is cheaper than holding rows back.
const MAX_STRAGGLERS: usize = 100_000;
/// Rows held back at once before giving up on streaming (about 300 bytes each).
const MAX_HELD: usize = 500_000;
/// The last rows whose keys are read before streaming; enough for the late rows a trace ends with.
const TAIL: u64 = 1 << 16;

/// A row held back until its place, owning its text in one allocation.
struct HeldRow {
    key: Key,
    pid: i64,
    tid: i64,
    text: String,
    /// Ends of event, event type, name, ptr in `text`; attr is the rest.
    ends: [usize; 4],
}

impl HeldRow {
    fn from(r: &DumpRow<'_>) -> Self {
        let parts = [r.event, r.event_type, r.name, r.ptr];
        let mut text = String::with_capacity(parts.iter().map(|p| p.len()).sum::<usize>() + r.attr.len());
        let mut ends = [0; 4];
        for (end, part) in ends.iter_mut().zip(parts) {
            text.push_str(part);
            *end = text.len();
        }
        text.push_str(r.attr);
        Self { key: (r.ts, r.id, r.rowid), pid: r.pid, tid: r.tid, text, ends }
    }

    fn as_row(&self) -> DumpRow<'_> {
        let e = self.ends;
        DumpRow {
            rowid: self.key.2,
            id: self.key.1,
            event: &self.text[..e[0]],
            event_type: &self.text[e[0]..e[1]],
            name: &self.text[e[1]..e[2]],
            ts: self.key.0,
            pid: self.pid,
            tid: self.tid,
            ptr: &self.text[e[2]..e[3]],
            attr: &self.text[e[3]..],
        }
    }
}

/// How a streaming pass ended.
#[derive(PartialEq, Eq)]
enum Streamed {
    Done,
    /// A row came before one already handed over.
    OutOfPlace,
    /// More than `max_held` rows waited at once.
    TooManyHeld,
}

/// One read transaction, so that every pass sees the same rows even if a trace is still
/// appending to the file.
struct Snapshot<'c> {
    conn: &'c Connection,
}

impl<'c> Snapshot<'c> {
    fn begin(conn: &'c Connection) -> rusqlite::Result<Self> {
        conn.execute_batch("BEGIN")?;
        Ok(Self { conn })
    }
}

impl Drop for Snapshot<'_> {
    fn drop(&mut self) {
        let _ = self.conn.execute_batch("COMMIT");
    }
}

/// What to read, as SQL, and the thresholds: everything the reading thread needs.
struct Plan {
    /// The table's name, quoted.
    table: String,
    /// `FROM "table" WHERE (...)`, shared by every pass.
    from: String,
    /// The columns of a [`DumpRow`]: the eight always read, then those of `name_at`, `tid_at`.
    columns: String,
    name_at: Option<usize>,
    tid_at: Option<usize>,
    events: Vec<String>,
    max_stragglers: usize,
    max_held: usize,
    tail: u64,
}

/// A dump table read in time order; see the module documentation.
pub struct TimeOrder<'p> {
    path: &'p Path,
    plan: Plan,
    /// Told how the pass goes, with the table's highest rowid.
    progress: Option<(std::sync::Arc<dyn super::Progress>, u64)>,
}

impl<'p> TimeOrder<'p> {
    /// `conn` is only asked which columns the table has; the rows are read on a connection of
    /// the reading thread's own.
    pub fn new(conn: &Connection, path: &'p Path, table: &str, select: Selection<'_>) -> Result<Self, AnalysisError> {
        let read = |source| AnalysisError::Read { path: path.to_owned(), source };
        let have: Vec<String> = conn
            .prepare("SELECT name FROM pragma_table_info(?1)")
            .and_then(|mut s| s.query_map([table], |r| r.get(0))?.collect())
            .map_err(read)?;
        let has = |c: &str| have.iter().any(|h| h == c);
        // Columns nobody reads are not selected: each costs several calls per row.
        let mut columns =
            "rowid, \"ID\", \"Event\", \"Event Type\", \"Timestamp(ns)\", \"Process Id\", \"Ptr\", \"Attr\"".to_owned();
        let mut optional = |wanted: bool, column: &str| {
            (wanted && has(column)).then(|| {
                columns.push_str(&format!(", \"{column}\""));
                columns.matches(',').count()
            })
        };
        let name_at = optional(select.name, "Name");
        let tid_at = optional(select.thread, "Thread Id");
        // `=` terms rather than IN: SQLite probes a temporary index per row for an IN list.
        let wanted: Vec<String> =
            select.events.iter().map(|e| format!("\"Event\" = '{}'", e.replace('\'', "''"))).collect();
        let table = format!("\"{}\"", table.replace('"', "\"\""));
        let from = format!("FROM {table} WHERE ({})", wanted.join(" OR "));
        let plan = Plan {
            table,
            from,
            columns,
            name_at,
            tid_at,
            events: select.events.iter().map(|e| (*e).to_owned()).collect(),
            max_stragglers: MAX_STRAGGLERS,
            max_held: MAX_HELD,
            tail: TAIL,
        };
        Ok(Self { path, plan, progress: None })
    }

    /// Tells `progress` how the pass goes (see [`super::Progress`]).
    pub(crate) fn with_progress(mut self, progress: Option<std::sync::Arc<dyn super::Progress>>) -> Self {
        self.progress = progress.map(|p| {
            let conn = super::open_read_only(self.path).ok();
            let sql = format!("SELECT max(rowid) FROM {}", self.plan.table);
            let last = conn.and_then(|c| c.query_row(&sql, [], |r| r.get::<_, Option<i64>>(0)).ok().flatten());
            (p, last.unwrap_or(0).max(0) as u64)
        });
        self
    }

    /// Lowers the thresholds, for tests to reach every path on small files.
    #[cfg(test)]
    pub(crate) fn with_limits(mut self, max_stragglers: usize, max_held: usize, tail: u64) -> Self {
        (self.plan.max_stragglers, self.plan.max_held, self.plan.tail) = (max_stragglers, max_held, tail);
        self
    }

    /// Calls `f` for every selected row in time order, then says how they came.
    pub fn for_each_row(&self, f: impl FnMut(Fed<'_>)) -> Result<ReadOrder, AnalysisError> {
        self.hand_over(None, None::<fn(u64)>, f)
    }

    /// [`Self::for_each_row`] for a replay that needs, before its first row, how many rows of
    /// `events` (each among the selected ones) there are: `on_count` gets that number first. It
    /// costs a first pass over every key.
    pub fn for_each_row_counted(
        &self,
        events: &[&str],
        on_count: impl FnOnce(u64),
        f: impl FnMut(Fed<'_>),
    ) -> Result<ReadOrder, AnalysisError> {
        self.hand_over(Some(events), Some(on_count), f)
    }

    fn hand_over(
        &self,
        count: Option<&[&str]>,
        mut on_count: Option<impl FnOnce(u64)>,
        mut f: impl FnMut(Fed<'_>),
    ) -> Result<ReadOrder, AnalysisError> {
        let (full_tx, full_rx) = mpsc::sync_channel::<Batch>(BATCHES_IN_FLIGHT);
        let (empty_tx, empty_rx) = mpsc::channel::<Batch>();
        std::thread::scope(|scope| {
            let read = move || {
                let mut out = Sender::new(full_tx, empty_rx);
                let how = self.read(count, &mut out);
                out.send();
                how
            };
            let reading = std::thread::Builder::new()
                .name("memscope-read".into())
                .spawn_scoped(scope, read)
                .map_err(|source| AnalysisError::Io { path: self.path.to_owned(), source })?;
            if let Some((p, last)) = &self.progress {
                p.start(*last);
            }
            let mut rowid = 0;
            for mut batch in full_rx {
                batch.replay(&mut on_count, &mut |fed: Fed<'_>| {
                    if let Fed::Row(row) = &fed {
                        rowid = row.rowid;
                    }
                    f(fed)
                });
                if let Some((p, _)) = &self.progress {
                    p.at(rowid.max(0) as u64);
                }
                batch.clear();
                let _ = empty_tx.send(batch);
            }
            if let Some((p, _)) = &self.progress {
                p.finish();
            }
            match reading.join() {
                Ok(how) => how,
                Err(panic) => std::panic::resume_unwind(panic),
            }
        })
    }

    /// The reading thread: every pass, on its own connection, in one snapshot of the file.
    fn read(&self, count: Option<&[&str]>, out: &mut Sender) -> Result<ReadOrder, AnalysisError> {
        let read = |source| AnalysisError::Read { path: self.path.to_owned(), source };
        let conn = super::open_read_only(self.path)?;
        conn.busy_timeout(Duration::from_secs(5)).map_err(read)?;
        let _snapshot = Snapshot::begin(&conn).map_err(read)?;
        let reader = Reader { conn: &conn, path: self.path, plan: &self.plan };
        let mut f = |fed: Fed<'_>| out.push_fed(fed);
        let Some(count) = count else { return reader.for_each_row(&mut f) };
        let Keys { stragglers, counts } = reader.stragglers()?;
        let n = match counts {
            Some(counts) => {
                let selected = self.plan.events.iter().zip(counts);
                selected.filter(|(e, _)| count.contains(&e.as_str())).map(|(_, n)| n).sum()
            }
            None => reader.count(count)?,
        };
        out.push(Item::Count(n));
        let mut f = |fed: Fed<'_>| out.push_fed(fed);
        if let Some(stragglers) = stragglers {
            // With every straggler known, only too many held rows stop the stream.
            if reader.stream(stragglers, &mut f)? == Streamed::Done {
                return Ok(ReadOrder::Storage);
            }
            f(Fed::Restart);
        }
        reader.sorted(&mut f)?;
        Ok(ReadOrder::Sorted)
    }
}

/// What a pass over every key found.
struct Keys {
    /// The rows that, in storage order, come after a row with a greater key; `None`: more than
    /// `max_stragglers`.
    stragglers: Option<BTreeSet<Key>>,
    /// Rows per entry of [`Selection::events`]; `None` when the pass stopped early.
    counts: Option<Vec<u64>>,
}

/// The passes over the rows, on the reading thread's connection.
struct Reader<'r> {
    conn: &'r Connection,
    path: &'r Path,
    plan: &'r Plan,
}

impl Reader<'_> {
    fn read_err(&self) -> impl Fn(rusqlite::Error) -> AnalysisError + '_ {
        move |source| AnalysisError::Read { path: self.path.to_owned(), source }
    }

    /// Streams from the tail's stragglers, and goes back for every key if a late row was missed.
    fn for_each_row(&self, f: &mut impl FnMut(Fed<'_>)) -> Result<ReadOrder, AnalysisError> {
        match self.stream(self.tail_stragglers()?, f)? {
            Streamed::Done => return Ok(ReadOrder::Storage),
            Streamed::OutOfPlace => {
                f(Fed::Restart);
                if let Some(stragglers) = self.stragglers()?.stragglers {
                    if self.stream(stragglers, f)? == Streamed::Done {
                        return Ok(ReadOrder::Rescanned);
                    }
                    f(Fed::Restart);
                }
            }
            Streamed::TooManyHeld => f(Fed::Restart), // holding every straggler would hold more
        }
        self.sorted(f)?;
        Ok(ReadOrder::Sorted)
    }

    fn row<'a>(&self, row: &'a rusqlite::Row<'a>) -> Result<DumpRow<'a>, AnalysisError> {
        let get = |i| row.get_ref(i).map_err(self.read_err());
        let pid = int(get(5)?);
        Ok(DumpRow {
            rowid: int(get(0)?),
            id: int(get(1)?),
            event: text(get(2)?),
            event_type: text(get(3)?),
            name: match self.plan.name_at {
                Some(i) => text(get(i)?),
                None => "",
            },
            ts: int(get(4)?),
            pid,
            tid: match self.plan.tid_at {
                Some(i) => int(get(i)?),
                None => pid,
            },
            ptr: text(get(6)?),
            attr: text(get(7)?),
        })
    }

    /// The rows of the last [`TAIL`] rowids that come after a row with a greater key: where a
    /// trace's late rows are, found without reading the whole file.
    fn tail_stragglers(&self) -> Result<BTreeSet<Key>, AnalysisError> {
        let plan = self.plan;
        let sql = format!(
            "SELECT \"Timestamp(ns)\", \"ID\", rowid {} AND rowid > (SELECT max(rowid) FROM {}) - {} ORDER BY rowid",
            plan.from, plan.table, plan.tail
        );
        let mut stmt = self.conn.prepare(&sql).map_err(self.read_err())?;
        let mut rows = stmt.query([]).map_err(self.read_err())?;
        let mut max: Option<Key> = None;
        let mut stragglers = BTreeSet::new();
        while let Some(row) = rows.next().map_err(self.read_err())? {
            let get = |i| row.get_ref(i).map_err(self.read_err());
            let key = (int(get(0)?), int(get(1)?), int(get(2)?));
            if max.is_some_and(|m| key < m) {
                stragglers.insert(key);
            } else {
                max = Some(key);
            }
        }
        Ok(stragglers)
    }

    /// Reads every key; see [`Keys`].
    fn stragglers(&self) -> Result<Keys, AnalysisError> {
        let plan = self.plan;
        let sql = format!("SELECT \"Timestamp(ns)\", \"ID\", rowid, \"Event\" {} ORDER BY rowid", plan.from);
        let mut stmt = self.conn.prepare(&sql).map_err(self.read_err())?;
        let mut rows = stmt.query([]).map_err(self.read_err())?;
        let mut max: Option<Key> = None;
        let mut stragglers = BTreeSet::new();
        let mut counts = vec![0u64; plan.events.len()];
        while let Some(row) = rows.next().map_err(self.read_err())? {
            let get = |i| row.get_ref(i).map_err(self.read_err());
            let key = (int(get(0)?), int(get(1)?), int(get(2)?));
            let event = text(get(3)?);
            if let Some(n) = plan.events.iter().position(|e| e == event) {
                counts[n] += 1;
            }
            if max.is_some_and(|m| key < m) {
                stragglers.insert(key);
                if stragglers.len() > plan.max_stragglers {
                    return Ok(Keys { stragglers: None, counts: None });
                }
            } else {
                max = Some(key);
            }
        }
        Ok(Keys { stragglers: Some(stragglers), counts: Some(counts) })
    }

    /// The rows whose `Event` is one of `events`, counted by SQLite.
    fn count(&self, events: &[&str]) -> Result<u64, AnalysisError> {
        let wanted: Vec<String> = events.iter().map(|e| format!("'{}'", e.replace('\'', "''"))).collect();
        let sql = format!("SELECT count(*) {} AND \"Event\" IN ({})", self.plan.from, wanted.join(","));
        let n: i64 = self.conn.query_row(&sql, [], |r| r.get(0)).map_err(self.read_err())?;
        Ok(n as u64)
    }

    /// Streams in storage order, holding back the rows that come after a key in `pending` until
    /// that row is read. Every row handed over is checked to come after the previous one, so a
    /// pass that ends [`Streamed::Done`] handed over exactly the sorted rows, whatever `pending`
    /// missed.
    fn stream(&self, mut pending: BTreeSet<Key>, f: &mut impl FnMut(Fed<'_>)) -> Result<Streamed, AnalysisError> {
        let sql = format!("SELECT {} {} ORDER BY rowid", self.plan.columns, self.plan.from);
        let mut stmt = self.conn.prepare(&sql).map_err(self.read_err())?;
        let mut rows = stmt.query([]).map_err(self.read_err())?;
        let mut held: BTreeMap<Key, HeldRow> = BTreeMap::new();
        let mut last: Option<Key> = None;
        while let Some(row) = rows.next().map_err(self.read_err())? {
            let r = self.row(row)?;
            let key = (r.ts, r.id, r.rowid);
            if last.is_some_and(|l| key < l) {
                return Ok(Streamed::OutOfPlace);
            }
            if !pending.is_empty() {
                pending.remove(&key);
            }
            if held.is_empty() && pending.first().is_none_or(|p| key < *p) {
                last = Some(key);
                f(Fed::Row(r));
                continue;
            }
            held.insert(key, HeldRow::from(&r));
            if held.len() > self.plan.max_held {
                return Ok(Streamed::TooManyHeld);
            }
            while let Some(entry) = held.first_entry() {
                if pending.first().is_some_and(|p| p < entry.key()) {
                    break;
                }
                last = Some(*entry.key());
                f(Fed::Row(entry.remove().as_row()));
            }
        }
        for r in held.into_values() {
            f(Fed::Row(r.as_row()));
        }
        Ok(Streamed::Done)
    }

    fn sorted(&self, f: &mut impl FnMut(Fed<'_>)) -> Result<(), AnalysisError> {
        let sql = format!("SELECT {} {} ORDER BY \"Timestamp(ns)\", \"ID\", rowid", self.plan.columns, self.plan.from);
        let mut stmt = self.conn.prepare(&sql).map_err(self.read_err())?;
        let mut rows = stmt.query([]).map_err(self.read_err())?;
        while let Some(row) = rows.next().map_err(self.read_err())? {
            f(Fed::Row(self.row(row)?));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use rusqlite::OpenFlags;

    use super::*;
    use crate::analysis::testdb::{dir, TestDb};
    use crate::store::schema::DUMP_TABLE;

    /// (ts, rowid) in the order rows are handed over after the last restart, the restarts, and
    /// how they were read.
    fn fed(read: impl FnOnce(&mut dyn FnMut(Fed<'_>)) -> ReadOrder) -> (Vec<(i64, i64)>, usize, ReadOrder) {
        let mut seen = Vec::new();
        let mut restarts = 0;
        let how = read(&mut |fed| match fed {
            Fed::Row(r) => seen.push((r.ts, r.rowid)),
            Fed::Restart => {
                seen.clear();
                restarts += 1;
            }
        });
        (seen, restarts, how)
    }

    #[test]
    fn rows_come_in_time_order_whatever_the_file_order_and_the_path() {
        // Written as our tracer writes (a late STOP_TRACE, one thread's rows a little behind
        // another's) and as msMemScope does (MALLOCs written when the block is freed).
        let orders: [&[i64]; 4] = [
            &[1, 2, 2, 3, 4, 8, 9],
            &[1, 2, 3, 5, 4, 6, 7, 9, 9, 8],
            &[10, 20, 30, 31, 32, 25, 33, 34, 29, 40],
            &[5, 6, 1, 7, 2, 8, 3, 9, 4, 10],
        ];
        let select = Selection { events: &["MALLOC"], name: false, thread: false };
        for (i, order) in orders.iter().enumerate() {
            let mut db = TestDb::create(&dir(&format!("order{i}")).join("memscope_dump_1.db"));
            for (k, ts) in order.iter().enumerate() {
                db.malloc("PTA", *ts, 0x10 + k as u64, 1, None);
                db.row("ACCESS", "READ", 0, 1, None, crate::store::Attr::new());
                // not selected
            }
            let path = db.path.clone();
            drop(db);
            let mut want: Vec<(i64, i64)> = order.iter().enumerate().map(|(k, ts)| (*ts, 2 * k as i64 + 1)).collect();
            want.sort();
            let conn = Connection::open_with_flags(&path, OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
            let limits = |stragglers, held, tail| {
                TimeOrder::new(&conn, &path, DUMP_TABLE, select).unwrap().with_limits(stragglers, held, tail)
            };
            let run = |order: TimeOrder<'_>| fed(|f| order.for_each_row(f).unwrap());
            let in_order = i == 0;
            let (many, all) = (usize::MAX, u64::MAX);
            let restart = usize::from(!in_order);
            let after_restart = |how| if in_order { ReadOrder::Storage } else { how };
            // The tail covers these small files: every late row is known before streaming.
            assert_eq!(run(limits(many, many, all)), (want.clone(), 0, ReadOrder::Storage), "{order:?}");
            // No tail read: the first late row sends the reader back for every key.
            let got = run(limits(many, many, 0));
            assert_eq!(got, (want.clone(), restart, after_restart(ReadOrder::Rescanned)), "{order:?}");
            // Too many rows to hold back, or out of place: SQLite sorts.
            let got = run(limits(many, 1, all));
            assert_eq!(got, (want.clone(), restart, after_restart(ReadOrder::Sorted)), "{order:?}");
            let got = run(limits(0, many, 0));
            assert_eq!(got, (want.clone(), restart, after_restart(ReadOrder::Sorted)), "{order:?}");
            // Counted first: a full first pass, so nothing to restart; the count comes before the
            // first row, from that pass or from SQLite when it stopped early.
            for stragglers in [many, 0] {
                let reader = limits(stragglers, many, all);
                for (events, n) in [(&["MALLOC"], order.len() as u64), (&["FREE"], 0)] {
                    let log = std::cell::RefCell::new(Vec::new());
                    let on_count = |n: u64| log.borrow_mut().push(Some(n));
                    let how = reader
                        .for_each_row_counted(events, on_count, |fed| {
                            if let Fed::Row(_) = fed {
                                log.borrow_mut().push(None);
                            }
                        })
                        .unwrap();
                    let log = log.into_inner();
                    assert_eq!((log[0], log.len()), (Some(n), order.len() + 1), "{order:?}");
                    let sorted = if in_order || stragglers > 0 { ReadOrder::Storage } else { ReadOrder::Sorted };
                    assert_eq!(how, sorted, "{order:?}");
                }
            }
        }
    }
}
