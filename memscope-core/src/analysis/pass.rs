//! One pass over a DB's rows feeding several replays at once (what `advise` reads: the pool
//! model, the steps' garbage, the stream marks and ATB's workspaces). Reading and ordering the
//! rows is most of an analysis's cost, so replays that need the same file share one reader.
//!
//! Each [`Consumer`] names its own [`Selection`]; the pass reads their union and hands each
//! consumer exactly the rows, and the columns, a reader of its own selection would have: rows of
//! its events only, `Name` empty unless it asked for it, `Thread Id` the process id unless it
//! asked for it. The rows come in the one time order (`Timestamp(ns)`, `ID`, rowid: a total
//! order), so each consumer's rows are the same sequence its own pass would have read.

use std::cell::Cell;

use super::db::{DumpDb, DumpRow, Fed, ReadOrder, Selection};
use super::AnalysisError;

/// A replay fed by a shared pass.
pub trait Consumer {
    /// The rows it reads, and the optional columns it needs.
    fn selection(&self) -> Selection<'static>;

    /// One of its rows, in time order.
    fn row(&mut self, row: DumpRow<'_>);

    /// Forget every row so far: they come again, from the first (see [`Fed::Restart`]).
    fn restart(&mut self);

    /// The events whose rows it must count before its first row (see
    /// [`super::db::TimeOrder::for_each_row_counted`]), if any.
    fn counts(&self) -> Option<&'static [&'static str]> {
        None
    }

    /// How many rows of [`Self::counts`] there are; called before its first row.
    fn count(&mut self, _rows: u64) {}
}

/// What one consumer gets: its selection, and whether it wants the count.
struct Tap {
    select: Selection<'static>,
    counted: bool,
}

/// Reads `db` once, in time order, feeding every consumer its rows. At most one set of counted
/// events is read first: consumers asking for another set are refused as a programming error.
pub fn run(db: &DumpDb, consumers: &mut [&mut dyn Consumer]) -> Result<ReadOrder, AnalysisError> {
    let mut events: Vec<&'static str> = Vec::new();
    let (mut name, mut thread) = (false, false);
    let mut counted: Option<&'static [&'static str]> = None;
    let mut taps = Vec::with_capacity(consumers.len());
    for c in consumers.iter() {
        let select = c.selection();
        for e in select.events {
            if !events.contains(e) {
                events.push(e);
            }
        }
        name |= select.name;
        thread |= select.thread;
        let wants = c.counts();
        if let (Some(have), Some(want)) = (counted, wants) {
            assert_eq!(have, want, "one pass counts one set of events");
        }
        counted = counted.or(wants);
        taps.push(Tap { select, counted: wants.is_some() });
    }
    let order = db.rows(Selection { events: &events, name, thread })?;
    // Handed to the consumers that asked just before the first row (the reader counts first).
    let rows_counted = Cell::new(None);
    let feed = |fed: Fed<'_>| match fed {
        Fed::Row(row) => {
            if let Some(n) = rows_counted.take() {
                for (c, tap) in consumers.iter_mut().zip(&taps) {
                    if tap.counted {
                        c.count(n);
                    }
                }
            }
            for (c, tap) in consumers.iter_mut().zip(&taps) {
                if tap.select.events.contains(&row.event) {
                    let mut own = row;
                    if !tap.select.name {
                        own.name = "";
                    }
                    if !tap.select.thread {
                        own.tid = own.pid;
                    }
                    c.row(own);
                }
            }
        }
        Fed::Restart => consumers.iter_mut().for_each(|c| c.restart()),
    };
    let how = match counted {
        Some(events) => order.for_each_row_counted(events, |n| rows_counted.set(Some(n)), feed)?,
        None => order.for_each_row(feed)?,
    };
    // A file without rows still has its count (0).
    if let Some(n) = rows_counted.take() {
        for (c, tap) in consumers.iter_mut().zip(&taps) {
            if tap.counted {
                c.count(n);
            }
        }
    }
    Ok(how)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::testdb::{dir, TestDb};

    /// Records what it is fed, as (event, name, tid, ts), and restarts as a replay would.
    struct Record {
        select: Selection<'static>,
        seen: Vec<(String, String, i64, i64)>,
        counted: Option<u64>,
        count: bool,
    }

    impl Record {
        fn new(events: &'static [&'static str], name: bool, thread: bool, count: bool) -> Self {
            Self { select: Selection { events, name, thread }, seen: Vec::new(), counted: None, count }
        }

        /// What a pass of its own selection hands over.
        fn alone(&self, db: &DumpDb) -> Vec<(String, String, i64, i64)> {
            let mut seen = Vec::new();
            db.rows(self.select)
                .unwrap()
                .for_each_row(|fed| match fed {
                    Fed::Row(r) => seen.push((r.event.to_owned(), r.name.to_owned(), r.tid, r.ts)),
                    Fed::Restart => seen.clear(),
                })
                .unwrap();
            seen
        }
    }

    impl Consumer for Record {
        fn selection(&self) -> Selection<'static> {
            self.select
        }

        fn row(&mut self, r: DumpRow<'_>) {
            assert!(self.counted.is_some() || !self.count, "the count comes before the first row");
            self.seen.push((r.event.to_owned(), r.name.to_owned(), r.tid, r.ts));
        }

        fn restart(&mut self) {
            self.seen.clear();
        }

        fn counts(&self) -> Option<&'static [&'static str]> {
            self.count.then_some(&["MALLOC", "FREE"])
        }

        fn count(&mut self, rows: u64) {
            self.counted = Some(rows);
        }
    }

    #[test]
    fn each_consumer_gets_the_rows_and_columns_of_its_own_selection() {
        let mut db = TestDb::create(&dir("pass").join("memscope_dump_1.db"));
        db.named("OP_LAUNCH", "ATEN_START", "aten::add", 40, 7);
        db.malloc("PTA", 30, 0x30, 8, None);
        db.named("MSTX", "Mark", "step start", 20, 8);
        db.malloc("HAL", 10, 0x10, 8, None);
        db.free("HAL", 50, 0x10);
        db.system("STOP_TRACE", 60);
        let path = db.path.clone();
        drop(db);
        let dump = DumpDb::open_read(&path).unwrap();
        let mut memory = Record::new(&["MALLOC", "FREE", "SYSTEM"], false, false, true);
        let mut ops = Record::new(&["OP_LAUNCH", "MALLOC"], true, true, false);
        let mut steps = Record::new(&["MSTX", "FREE"], true, false, false);
        let want = [memory.alone(&dump), ops.alone(&dump), steps.alone(&dump)];
        run(&dump, &mut [&mut memory, &mut ops, &mut steps]).unwrap();
        assert_eq!([memory.seen, ops.seen, steps.seen], want);
        assert_eq!(memory.counted, Some(3), "two MALLOC rows and a FREE");
        assert_eq!(ops.counted, None, "only who asked gets the count");
        // The columns follow each selection: a name and a thread only where asked for.
        assert_eq!(want[1][2], ("OP_LAUNCH".to_owned(), "aten::add".to_owned(), 7, 40));
        assert_eq!(want[2][0], ("MSTX".to_owned(), "step start".to_owned(), 1, 20));
        assert!(want[0].iter().all(|r| r.1.is_empty() && r.2 == 1));
    }
}
