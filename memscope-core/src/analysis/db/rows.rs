//! A dump row as every reader sees it, and the key rows are replayed in: what the reading thread
//! packs into batches ([`super::batch`]) and the time order hands over ([`super::order`]).

/// One row of the dump, borrowed from SQLite's buffers or from the batch the reading thread
/// handed over (10M rows must not mean 70M allocations).
#[derive(Clone, Copy, Debug)]
pub struct DumpRow<'a> {
    /// SQLite's rowid: the last tie-break, and how a reported row is fetched again.
    pub rowid: i64,
    pub id: i64,
    pub event: &'a str,
    pub event_type: &'a str,
    /// `Name`; "" unless [`super::Selection::name`] asked for it or when the table lacks it.
    pub name: &'a str,
    pub ts: i64,
    pub pid: i64,
    /// `Thread Id`; the process id unless [`super::Selection::thread`] asked for it or when the table
    /// lacks it.
    pub tid: i64,
    pub ptr: &'a str,
    pub attr: &'a str,
}

/// What [`super::TimeOrder::for_each_row`] hands over.
pub enum Fed<'a> {
    Row(DumpRow<'a>),
    /// Forget every row so far: they come again, from the first.
    Restart,
}

/// (`Timestamp(ns)`, `ID`, rowid): the order rows are replayed in.
pub(super) type Key = (i64, i64, i64);
