//! Handing rows from the thread that reads them to the replay: packed into batches of one string
//! each, sent over a bounded channel, and sent back empty to be filled again, so the hand-over
//! allocates nothing once the first batches exist.

use std::sync::mpsc;

use super::rows::{DumpRow, Fed, Key};

/// Rows per batch handed from the reading thread, and batches in flight: enough to keep both
/// threads busy, little enough to stay in cache (a row is about 300 bytes).
const BATCH_ROWS: usize = 2048;
pub(super) const BATCHES_IN_FLIGHT: usize = 4;

/// What the reading thread hands over, in order.
pub(super) enum Item {
    Row {
        key: Key,
        pid: i64,
        tid: i64,
        /// Ends of event, event type, name, ptr and attr in the batch's text.
        ends: [usize; 5],
    },
    Restart,
    /// The rows of the events [`super::TimeOrder::for_each_row_counted`] was asked to count.
    Count(u64),
}

/// Rows packed into one string, reused once the replay is done with them.
#[derive(Default)]
pub(super) struct Batch {
    text: String,
    items: Vec<Item>,
}

impl Batch {
    fn push_row(&mut self, r: &DumpRow<'_>) {
        let mut ends = [0; 5];
        for (end, part) in ends.iter_mut().zip([r.event, r.event_type, r.name, r.ptr, r.attr]) {
            self.text.push_str(part);
            *end = self.text.len();
        }
        self.items.push(Item::Row { key: (r.ts, r.id, r.rowid), pid: r.pid, tid: r.tid, ends });
    }

    pub(super) fn replay(&self, on_count: &mut Option<impl FnOnce(u64)>, f: &mut impl FnMut(Fed<'_>)) {
        let mut start = 0;
        for item in &self.items {
            match *item {
                Item::Row { key, pid, tid, ends } => {
                    let t = &self.text;
                    f(Fed::Row(DumpRow {
                        rowid: key.2,
                        id: key.1,
                        event: &t[start..ends[0]],
                        event_type: &t[ends[0]..ends[1]],
                        name: &t[ends[1]..ends[2]],
                        ts: key.0,
                        pid,
                        tid,
                        ptr: &t[ends[2]..ends[3]],
                        attr: &t[ends[3]..ends[4]],
                    }));
                    start = ends[4];
                }
                Item::Restart => f(Fed::Restart),
                Item::Count(n) => {
                    if let Some(on_count) = on_count.take() {
                        on_count(n);
                    }
                }
            }
        }
    }

    pub(super) fn clear(&mut self) {
        self.text.clear();
        self.items.clear();
    }
}

/// The reading thread's end of the hand-over.
pub(super) struct Sender {
    batch: Batch,
    full: mpsc::SyncSender<Batch>,
    empty: mpsc::Receiver<Batch>,
}

impl Sender {
    pub(super) fn new(full: mpsc::SyncSender<Batch>, empty: mpsc::Receiver<Batch>) -> Self {
        Self { batch: Batch::default(), full, empty }
    }

    pub(super) fn push(&mut self, item: Item) {
        self.batch.items.push(item);
        self.send_if_full();
    }

    pub(super) fn push_fed(&mut self, fed: Fed<'_>) {
        match fed {
            Fed::Row(r) => self.batch.push_row(&r),
            Fed::Restart => self.batch.items.push(Item::Restart),
        }
        self.send_if_full();
    }

    fn send_if_full(&mut self) {
        if self.batch.items.len() >= BATCH_ROWS {
            self.send();
        }
    }

    /// Hands the batch over; if the replay has gone (it panicked), the rest are dropped.
    pub(super) fn send(&mut self) {
        let next = self.empty.try_recv().unwrap_or_default();
        let full = std::mem::replace(&mut self.batch, next);
        let _ = self.full.send(full);
    }
}
