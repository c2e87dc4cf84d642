//! Writing the trace: one output per device, in msMemScope's layout and formats so MindStudio
//! Insight opens it (shared/reference/msmemscope-and-insight.md §3), plus our own tables beside
//! the Insight one (docs/db-schema.md).
//!
//! - [`insight`]: model outputs to `memscope_dump` rows (Event / Event Type / Attr vocabulary).
//! - [`attr`]: the Attr column, as compact JSON with string values (DB) or msMemScope's CSV form.
//! - [`batch`]: rows formatted on the producing side, moved to the store thread a batch at a time.
//! - [`schema`]: table and column definitions.
//! - [`layout`]: where files go; `owner`: their modes and owner (0700/0600, the `sudo` user).
//! - [`sqlite`], [`csv`]: the two sinks. The store creates one per device on first use.
//!
//! Durability: rows go into an open transaction that [`Store::commit`] closes at least every
//! second; a SIGKILLed tracer therefore loses at most the last second, and the WAL-mode DB still
//! opens. [`Store::finish`] writes the closing rows and checkpoints the WAL into the single file
//! Insight expects.

pub mod attr;
pub mod batch;
mod btree;
mod bulk;
#[cfg(test)]
mod crash_tests;
pub mod csv;
pub mod driver;
mod dump_rows;
pub mod insight;
pub mod layout;
mod owner;
pub mod py_trace;
#[cfg(test)]
mod python_peer;
pub mod schema;
pub mod sqlite;
mod sqlite_raw;
pub mod stacks;
pub mod writer;

use std::collections::BTreeMap;
use std::path::PathBuf;

use thiserror::Error;

#[cfg(any(test, feature = "testing"))]
pub use attr::Attr;
pub use batch::{Batch, RowText};
pub use driver::DriverRow;
#[cfg(test)]
pub use insight::Row;
pub use layout::RunLayout;
pub use stacks::StackTable;
pub use writer::Writer;

use crate::model::{DeviceKey, OwnerBy};
use crate::stacks::StackId;
use crate::vocab::{Event, EventType};

#[derive(Debug, Error)]
pub enum StoreError {
    #[error("cannot write {path} (check the free space and permissions of the --output folder)")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("cannot write the trace DB {path} (check the free space and permissions of the --output folder)")]
    Sqlite { path: PathBuf, source: rusqlite::Error },
    #[error("cannot append rows to the trace DB {path}")]
    Pages { path: PathBuf, source: bulk::BulkError },
}

/// Output format, as msMemScope's `--format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// SQLite, one `memscope_dump_<digits>.db` per device (what Insight opens).
    Db,
    /// msMemScope's CSV layout, one `memscope_dump_<digits>.csv` per device.
    Csv,
}

/// How a DB's `memscope_dump` rows reach the file (`--writer`; docs/db-schema.md, "Writers").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum DbWriter {
    /// Whole B-tree pages, the fast writer; plain SQL wherever it cannot be used (said on stderr
    /// and in `ms_meta.writer`).
    #[default]
    Pages,
    /// Plain SQL inserts in the same transactions: slower, for when the page writer is in doubt.
    Sql,
}

impl DbWriter {
    /// Why this build cannot use the page writer at all, if it cannot: said once at the start
    /// of a trace, where the DBs would otherwise say it one by one.
    pub fn unavailable_here() -> Option<String> {
        let conn = rusqlite::Connection::open_in_memory().ok()?;
        let found = conn.query_row("SELECT count(*) FROM sqlite_dbpage", [], |r| r.get::<_, i64>(0));
        found.is_err().then(|| bulk::BulkError::NoDbpage.to_string())
    }
}

/// An attached probe, as recorded in `ms_probes`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeRow {
    pub library: String,
    pub symbol: String,
    pub api: String,
    pub file_offset: u64,
    pub source: String,
    pub attached_wall_ns: u64,
}

/// Run-level facts written to every device's `ms_meta`.
pub type Meta = Vec<(String, String)>;

/// What a finished sink reports.
#[derive(Clone, Debug)]
pub struct Written {
    pub device: DeviceKey,
    pub path: PathBuf,
    /// What the user must know about the file (it could not be made one self-contained file).
    pub note: Option<String>,
}

/// One device's output. Every row it gets has its device's `Device Id`, whatever the row's
/// `device` (a broadcast row's is another output's).
pub trait Sink: Send {
    /// Appends a row; `id` is the row's `ID` (1-based, per file).
    fn insert(&mut self, id: u64, row: RowText<'_>) -> Result<(), StoreError>;
    /// The trace's stacks (`ms_stacks`, `ms_frames`), before [`Sink::finish`]; formats without
    /// such tables keep only the rows' column.
    fn add_stacks(&mut self, _stacks: &StackTable) -> Result<(), StoreError> {
        Ok(())
    }
    /// Python stacks' texts, `first` being the first one's id (`ms_py_stacks`), each once and
    /// in id order, with the next commit; formats without such a table keep only the rows'
    /// column.
    fn add_py_stacks(&mut self, _first: StackId, _texts: &[Box<str>]) -> Result<(), StoreError> {
        Ok(())
    }
    /// Appends the FREE of a block the trace never saw allocated to `ms_untracked_frees` (its
    /// own `ID`s, 1-based), out of Insight's table.
    fn insert_untracked(&mut self, id: u64, row: RowText<'_>) -> Result<(), StoreError>;
    /// Makes everything inserted so far durable.
    fn commit(&mut self) -> Result<(), StoreError>;
    /// The stop has begun: what follows is its rows, then [`Sink::finish`], which must complete
    /// the output as fast as it can.
    fn stopping(&mut self) -> Result<(), StoreError> {
        Ok(())
    }
    /// Sets the `owner` in the Attr of row `id` (an address tag re-owned a live block, or the
    /// block did not outlive its phase), and its `owner_source`.
    fn update_owner(&mut self, id: u64, owner: &str, source: Option<&'static str>) -> Result<(), StoreError>;
    fn add_probes(&mut self, probes: &[ProbeRow]) -> Result<(), StoreError>;
    /// The driver's figures ([`driver`]); formats without a table for them ignore them.
    fn add_driver(&mut self, rows: &[DriverRow]) -> Result<(), StoreError> {
        driver::ignored(rows)
    }
    /// Python function intervals ([`py_trace`]); formats without a table for them ignore them.
    fn add_py_trace(&mut self, _rows: &[py_trace::PyTraceRow]) -> Result<(), StoreError> {
        Ok(())
    }
    /// Sets the device's (free, total) on the `START_TRACE` row `id`, written without them.
    fn set_start_memory(&mut self, _id: u64, _free_total: (u64, u64)) -> Result<(), StoreError> {
        Ok(())
    }
    /// Run metadata learnt while tracing, durable with the next commit (a tracer killed later
    /// still leaves it); formats without a metadata table ignore it.
    fn set_meta(&mut self, _meta: &Meta) -> Result<(), StoreError> {
        Ok(())
    }
    /// Final metadata and per-CPU losses, then close.
    fn finish(self: Box<Self>, meta: &Meta, lost_per_cpu: &[u64]) -> Result<PathBuf, StoreError>;
}

struct Open {
    sink: Box<dyn Sink>,
    next_id: u64,
    next_untracked_id: u64,
    /// Python stacks handed to the sink so far (ids 1 to this).
    py_stacks: usize,
    /// The `ID` of each live block's MALLOC row, by (pid, Event Type, Ptr), so an owner change
    /// can find it. One entry per live block (a million in a large job), so the key is packed
    /// and the map a B-tree, which never doubles its storage the way a growing hash table does.
    malloc_ids: BTreeMap<(u32, u8, u64), u64>,
    /// Its `START_TRACE` row has the device's free and total.
    start_memory: bool,
}

impl Open {
    fn add_new_py_stacks(&mut self, stacks: &StackTable) -> Result<(), StoreError> {
        let new = &stacks.py_texts()[self.py_stacks..];
        if !new.is_empty() {
            self.sink.add_py_stacks(self.py_stacks as StackId + 1, new)?;
            self.py_stacks += new.len();
        }
        Ok(())
    }
}

/// The block row kinds an owner change can name, as a byte for [`Open::malloc_ids`].
fn event_type_code(event_type: EventType) -> u8 {
    match event_type {
        EventType::Hal => 0,
        EventType::Host => 1,
        EventType::Pta => 2,
        EventType::HostPinned => 3,
        EventType::PtaWorkspace => 4,
        _ => u8::MAX,
    }
}

/// Routes rows to per-device sinks, creating them lazily.
pub struct Store {
    layout: RunLayout,
    format: Format,
    start_wall_ns: u64,
    meta: Meta,
    probes: Vec<ProbeRow>,
    open: BTreeMap<DeviceKey, Open>,
    /// Rows every output gets (steps, marks, operators): kept to replay into outputs created
    /// later, at most [`REPLAY_LIMIT`].
    broadcast: Batch,
    /// Broadcast rows past the limit, which an output created after them does not get.
    not_replayed: u64,
    /// The stop has begun ([`Store::stopping`]): only its rows and [`Store::finish`] follow.
    stopping: bool,
    /// Where the stacks' symbolizer also looks for separate debug files (`--debug-dir`).
    pub debug_dirs: Vec<PathBuf>,
    /// How DBs' rows are written (`--writer`).
    pub db_writer: DbWriter,
    /// Driver readings for outputs not created yet, and each device's first free and total.
    driver: driver::Pending,
    /// Python intervals so far, for outputs created later (at most [`REPLAY_LIMIT`]).
    py_trace: Vec<py_trace::PyTraceRow>,
}

/// Broadcast rows kept for replay into outputs created later.
const REPLAY_LIMIT: usize = 65_536;

/// An owner change of a live block (see [`Store::retag`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Retag {
    pub device: DeviceKey,
    pub pid: u32,
    pub event_type: EventType,
    pub ptr: u64,
    pub owner: String,
    /// `owner_source`'s new value.
    pub by: OwnerBy,
}

impl Store {
    pub fn new(layout: RunLayout, format: Format, start_wall_ns: u64, meta: Meta) -> Self {
        Self {
            layout,
            format,
            start_wall_ns,
            meta,
            probes: Vec::new(),
            open: BTreeMap::new(),
            broadcast: Batch::default(),
            not_replayed: 0,
            stopping: false,
            debug_dirs: Vec::new(),
            db_writer: DbWriter::default(),
            driver: driver::Pending::default(),
            py_trace: Vec::new(),
        }
    }

    /// The form rows must be formatted in for this store's sinks.
    pub fn format(&self) -> Format {
        self.format
    }

    fn sink(&mut self, device: DeviceKey) -> Result<&mut Open, StoreError> {
        if !self.open.contains_key(&device) {
            self.layout.create_dump_dir(device)?;
            let mut sink: Box<dyn Sink> = match self.format {
                Format::Db => {
                    // Created here with its mode and owner; SQLite gives its -wal and -shm files
                    // the same.
                    let path = self.layout.dump_file(device, "db");
                    self.layout.create_file(&path)?;
                    Box::new(sqlite::DbSink::create(&path, device, &self.meta, self.db_writer)?)
                }
                Format::Csv => {
                    Box::new(csv::CsvSink::create(&self.layout.dump_file(device, "csv"), device, self.layout.owner())?)
                }
            };
            sink.add_probes(&self.probes)?;
            let memory = self.driver.first(device);
            let mut open = Open {
                sink,
                next_id: 1,
                next_untracked_id: 1,
                py_stacks: 0,
                malloc_ids: BTreeMap::new(),
                start_memory: memory.is_some(),
            };
            let start = insight::system_row(EventType::StartTrace, self.start_wall_ns, device, &self.meta, memory);
            open.sink.insert(open.next_id, batch::single(&start, self.format).get(0))?;
            open.next_id += 1;
            open.sink.add_driver(&self.driver.take(device))?;
            open.sink.add_py_trace(&self.py_trace)?;
            for row in self.broadcast.iter() {
                open.sink.insert(open.next_id, row)?;
                open.next_id += 1;
            }
            self.open.insert(device, open);
        }
        Ok(self.open.get_mut(&device).expect("inserted above"))
    }

    /// Writes a batch's rows, each with the `Call Stack(C)` text of its stack in `stacks`.
    pub fn write_batch(&mut self, rows: &Batch, stacks: &StackTable) -> Result<(), StoreError> {
        rows.iter().try_for_each(|row| {
            self.write(RowText { c_stack: stacks.text(row.stack), py_text: stacks.py_text(row.py_stack), ..row })
        })
    }

    pub fn write(&mut self, row: RowText<'_>) -> Result<(), StoreError> {
        let head = row.head;
        if head.broadcast {
            for open in self.open.values_mut() {
                open.sink.insert(open.next_id, row)?;
                open.next_id += 1;
            }
            // Kept for outputs created later, up to a bound: operator rows can be millions, and
            // a job's device outputs normally all exist after its first allocations.
            if self.broadcast.len() < REPLAY_LIMIT {
                self.broadcast.push_text(row);
            } else {
                self.not_replayed += 1;
            }
            return Ok(());
        }
        let stop_shadow = self.stopping && head.shadow;
        let open = self.sink(head.device)?;
        if head.untracked {
            open.sink.insert_untracked(open.next_untracked_id, row)?;
            open.next_untracked_id += 1;
            return Ok(());
        }
        let id = open.next_id;
        open.sink.insert(id, row)?;
        open.next_id += 1;
        // Once the stop has begun no owner change can follow: the shadow FREEs of its live blocks
        // leave their entries to the map's drop, which is quicker than a million removals.
        if let (Some(ptr), false) = (head.ptr, stop_shadow) {
            let key = (head.pid, event_type_code(head.event_type), ptr);
            match head.event {
                Event::Malloc => {
                    open.malloc_ids.insert(key, id);
                }
                Event::Free => {
                    open.malloc_ids.remove(&key);
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Rewrites the owner of a live block's MALLOC row; a block whose row is unknown (born
    /// before the trace) is left alone.
    pub fn retag(&mut self, retag: &Retag) -> Result<(), StoreError> {
        let key = (retag.pid, event_type_code(retag.event_type), retag.ptr);
        let Some(open) = self.open.get_mut(&retag.device) else { return Ok(()) };
        let Some(&id) = open.malloc_ids.get(&key) else { return Ok(()) };
        open.sink.update_owner(id, &retag.owner, retag.by.as_str())
    }

    pub fn add_probes(&mut self, probes: &[ProbeRow]) -> Result<(), StoreError> {
        for open in self.open.values_mut() {
            open.sink.add_probes(probes)?;
        }
        self.probes.extend_from_slice(probes);
        Ok(())
    }

    /// The driver's figures at one reading: into the device's output if it exists, else held
    /// for it; the device's first free and total go onto its `START_TRACE` row.
    pub fn add_driver(&mut self, rows: Vec<DriverRow>) -> Result<(), StoreError> {
        for row in rows {
            self.driver.note_first(&row);
            match self.open.get_mut(&row.device) {
                Some(open) => {
                    if !open.start_memory {
                        if let Some(ft) = self.driver.first(row.device) {
                            // The START_TRACE row is every output's first.
                            open.sink.set_start_memory(1, ft)?;
                            open.start_memory = true;
                        }
                    }
                    open.sink.add_driver(std::slice::from_ref(&row))?;
                }
                None => self.driver.hold(row),
            }
        }
        Ok(())
    }

    /// Python function intervals: into every output, and kept for those created later.
    pub fn add_py_trace(&mut self, rows: Vec<py_trace::PyTraceRow>) -> Result<(), StoreError> {
        for open in self.open.values_mut() {
            open.sink.add_py_trace(&rows)?;
        }
        let room = REPLAY_LIMIT.saturating_sub(self.py_trace.len());
        self.py_trace.extend(rows.into_iter().take(room));
        Ok(())
    }

    /// Sets run-level metadata learnt while tracing: outputs created from now on start with it,
    /// open ones get it with their next commit, and every output gets it when it is finished.
    pub fn set_meta(&mut self, meta: &Meta) -> Result<(), StoreError> {
        for (k, v) in meta {
            self.meta.retain(|(key, _)| key != k);
            self.meta.push((k.clone(), v.clone()));
        }
        for open in self.open.values_mut() {
            open.sink.set_meta(meta)?;
        }
        Ok(())
    }

    /// The stop has begun: what follows is the shadow FREEs of the live blocks and [`Store::finish`],
    /// which the sinks may write as fast as they can ([`Sink::stopping`]).
    pub fn stopping(&mut self) -> Result<(), StoreError> {
        self.stopping = true;
        for open in self.open.values_mut() {
            open.sink.stopping()?;
        }
        Ok(())
    }

    /// Makes every output durable, with the Python stacks new since the last commit: a row's
    /// `py_stack` then names a stack its DB has, up to the last durable commit.
    pub fn commit(&mut self, stacks: &StackTable) -> Result<(), StoreError> {
        for open in self.open.values_mut() {
            open.add_new_py_stacks(stacks)?;
            open.sink.commit()?;
        }
        Ok(())
    }

    /// Writes STOP_TRACE and the final metadata into every output and closes them.
    pub fn finish(
        mut self,
        stop_wall_ns: u64,
        final_meta: &Meta,
        lost_per_cpu: &[u64],
        stacks: &StackTable,
    ) -> Result<Vec<Written>, StoreError> {
        let mut meta = self.meta.clone();
        if self.not_replayed > 0 {
            meta.push(("broadcast_rows_not_replayed".into(), self.not_replayed.to_string()));
        }
        for (k, v) in final_meta {
            meta.retain(|(key, _)| key != k);
            meta.push((k.clone(), v.clone()));
        }
        let mut written = Vec::new();
        for (device, mut open) in std::mem::take(&mut self.open) {
            let stop = insight::system_row(EventType::StopTrace, stop_wall_ns, device, &meta, None);
            open.sink.insert(open.next_id, batch::single(&stop, self.format).get(0))?;
            if !stacks.is_empty() {
                open.sink.add_stacks(stacks)?;
            }
            open.add_new_py_stacks(stacks)?;
            let path = open.sink.finish(&meta, lost_per_cpu)?;
            let note = sqlite::wal_path(&path).exists().then(|| {
                format!(
                    "{} is left in WAL mode with its -wal file beside it: another process was reading it at the \
                     stop; keep the two together (`sqlite3 FILE 'PRAGMA journal_mode=DELETE'` folds them once \
                     nothing reads it)",
                    path.display()
                )
            });
            written.push(Written { device, path, note });
        }
        // Whatever else was created in the run folder (by SQLite, by another writer) gets the
        // same modes and owner.
        self.layout.hand_over()?;
        Ok(written)
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;
    use crate::apis::Api;
    use crate::model::{Output, Site, Space};

    fn free(device: DeviceKey, size: Option<u64>) -> Batch {
        let site = Site::of(Api::AclrtFree, 7, 1, 1);
        let (space, ptr, allocation_id, used, shadow, driver) = (Space::Device, 0x10, size.map(|_| 1), 0, false, None);
        let output =
            Output::Free { site, device, space, ptr, size, allocation_id, used, shadow, implied: false, driver };
        batch::single(&insight::to_row(&output).unwrap(), Format::Db)
    }

    fn live_block_rows(shadow: bool) -> Batch {
        let site = Site::of(Api::AclrtMalloc, 7, 1, 1);
        let (device, space, ptr, size) = (DeviceKey::Npu(0), Space::Device, 0x20, 8);
        let origin = crate::model::Origin::Direct { policy: None, module: None, driver: None };
        let (req_size, allocation_id, used, owner, segment) = (8, 1, 8, Some(std::sync::Arc::from("CANN@APP")), None);
        let malloc = Output::Malloc {
            site,
            device,
            space,
            ptr,
            size,
            req_size,
            allocation_id,
            used,
            origin,
            owner,
            segment,
            from: Default::default(),
        };
        let site = Site { api: Api::AclrtFree, ..site };
        let (size, allocation_id, driver) = (Some(8), Some(1), None);
        let free =
            Output::Free { site, device, space, ptr, size, allocation_id, used: 0, shadow, implied: false, driver };
        let mut batch = Batch::default();
        for output in [malloc, free] {
            batch.push(
                &insight::to_row(&output).unwrap(),
                Format::Db,
                (crate::stacks::NO_STACK, crate::stacks::NO_STACK),
            );
        }
        batch
    }

    #[test]
    fn rows_after_the_stop_began_complete_the_db() {
        let out = std::env::temp_dir().join(format!("memscope-store-stop-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        let layout = RunLayout::create_for(&out, 9, 1_700_000_000, "ascend", layout::Owner::default()).unwrap();
        let mut store = Store::new(layout, Format::Db, 5, vec![]);
        let rows = live_block_rows(true);
        store.write(rows.get(0)).unwrap();
        store.stopping().unwrap();
        store.write(rows.get(1)).unwrap();
        let written = store.finish(9, &vec![], &[], &StackTable::default()).unwrap();
        let db = rusqlite::Connection::open(&written[0].path).unwrap();
        let events: Vec<String> = db
            .prepare("SELECT \"Event Type\" || ':' || Event FROM memscope_dump ORDER BY ID")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(events, ["START_TRACE:SYSTEM", "HAL:MALLOC", "HAL:FREE", "STOP_TRACE:SYSTEM"]);
        let journal: String = db.query_row("PRAGMA journal_mode", [], |r| r.get(0)).unwrap();
        assert_eq!(journal, "delete", "the WAL is folded");
        let wal = written[0].path.with_extension("db-wal");
        assert!(!wal.exists(), "{} is left", wal.display());
        std::fs::remove_dir_all(&out).unwrap();
    }

    fn reading(device: u32, ts_ns: u64, process_used: u64) -> DriverRow {
        DriverRow {
            ts_ns,
            device: DeviceKey::Npu(device),
            pid: Some(9),
            process_used: Some(process_used),
            device_used: Some(3 << 30),
            device_total: Some(32 << 30),
            source: "dcmi",
        }
    }

    fn start_memory(path: &std::path::Path) -> (Option<String>, Option<String>) {
        let conn = rusqlite::Connection::open(path).unwrap();
        conn.query_row(
            "SELECT Attr ->> '$.free', Attr ->> '$.total' FROM memscope_dump WHERE \"Event Type\" = 'START_TRACE'",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap()
    }

    #[test]
    fn driver_readings_reach_their_device_and_its_start_row_before_or_after_it_exists() {
        let out = std::env::temp_dir().join(format!("memscope-store-driver-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        let layout = RunLayout::create_for(&out, 9, 1_700_000_000, "ascend", layout::Owner::default()).unwrap();
        let mut store = Store::new(layout, Format::Db, 5, vec![]);
        // Device 0's reading comes before its first row; device 1's output exists first.
        store.add_driver(vec![reading(0, 6, 100)]).unwrap();
        store.write_batch(&free(DeviceKey::Npu(0), Some(8)), &StackTable::default()).unwrap();
        store.write_batch(&free(DeviceKey::Npu(1), Some(8)), &StackTable::default()).unwrap();
        store.commit(&StackTable::default()).unwrap();
        store.add_driver(vec![reading(1, 7, 200), reading(0, 8, 300)]).unwrap();
        let written = store.finish(9, &vec![], &[], &StackTable::default()).unwrap();
        let path = |d| written.iter().find(|w| w.device == d).unwrap().path.clone();
        let expected = (Some((29u64 << 30).to_string()), Some((32u64 << 30).to_string()));
        for device in [0, 1] {
            let db = path(DeviceKey::Npu(device));
            assert_eq!(start_memory(&db), expected, "device {device}");
            let conn = rusqlite::Connection::open(&db).unwrap();
            let used: Vec<i64> = conn
                .prepare("SELECT process_used FROM ms_driver ORDER BY ts_ns")
                .unwrap()
                .query_map([], |r| r.get(0))
                .unwrap()
                .map(Result::unwrap)
                .collect();
            assert_eq!(used, if device == 0 { vec![100, 300] } else { vec![200] });
        }
        std::fs::remove_dir_all(&out).unwrap();
    }

    fn count(path: &std::path::Path, table: &str) -> i64 {
        let conn = rusqlite::Connection::open(path).unwrap();
        conn.query_row(&format!("SELECT count(*) FROM {table}"), [], |r| r.get(0)).unwrap()
    }

    #[test]
    fn untracked_frees_and_unknown_devices_stay_out_of_the_files_insight_opens() {
        let out = std::env::temp_dir().join(format!("memscope-store-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        let layout = RunLayout::create_for(&out, 9, 1_700_000_000, "ascend", layout::Owner::default()).unwrap();
        let mut store = Store::new(layout.clone(), Format::Db, 5, vec![]);
        store.write_batch(&free(DeviceKey::Npu(0), None), &StackTable::default()).unwrap();
        store.write_batch(&free(DeviceKey::Npu(0), Some(8)), &StackTable::default()).unwrap();
        store.write_batch(&free(DeviceKey::Unknown, None), &StackTable::default()).unwrap();
        let written = store.finish(9, &vec![], &[], &StackTable::default()).unwrap();
        let path = |d| written.iter().find(|w| w.device == d).unwrap().path.clone();
        let (npu0, unknown) = (path(DeviceKey::Npu(0)), path(DeviceKey::Unknown));
        // START_TRACE, the known free, STOP_TRACE; the untracked one in our own table.
        assert_eq!((count(&npu0, "memscope_dump"), count(&npu0, "ms_untracked_frees")), (3, 1));
        assert_eq!(unknown.parent(), Some(layout.root()));
        assert!(unknown.file_name().unwrap().to_str().unwrap().starts_with("unknown_device_"));
        assert_eq!(count(&unknown, "ms_untracked_frees"), 1);
        let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        for p in [npu0.as_path(), unknown.as_path()] {
            assert_eq!(mode(p), 0o600, "{}", p.display());
        }
        for p in [layout.root(), npu0.parent().unwrap(), npu0.parent().unwrap().parent().unwrap()] {
            assert_eq!(mode(p), 0o700, "{}", p.display());
        }
        std::fs::remove_dir_all(&out).unwrap();
    }
}
