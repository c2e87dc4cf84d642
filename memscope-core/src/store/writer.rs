//! The store on its own thread.
//!
//! Draining the ring buffer must never wait for the disk: at high event rates a COMMIT writes
//! tens of MB, and while it runs the ring fills and the kernel drops records (measured: 2-10 % of
//! a 600k events/s burst lost with a 16 MiB ring when the store ran inline). The session hands
//! rows to [`Writer`] in batches over a bounded channel; the writer thread owns the [`Store`].
//! Rows are formatted into their batch on the session's side ([`Batch`]), and emptied batches come
//! back over a second channel to be filled again.
//! The bound keeps memory in check: if the disk is slower than the events for long, the channel
//! fills, the session waits, the ring fills, and the kernel's drop counter says so.

use std::collections::BTreeMap;
use std::sync::mpsc::{channel, sync_channel, Receiver, Sender, SyncSender};
use std::thread::JoinHandle;

use super::StackTable;
use super::{insight, Batch, DriverRow, Format, Meta, ProbeRow, Retag, Store, StoreError, Written};
use crate::model::{DeviceKey, Output, Space};
use crate::stacks::{Stack, StackId};
use crate::vocab::attr;

/// Rows per message.
const BATCH: usize = 1024;
/// Messages in flight: about 16k rows (about 10 MB) between the session and the disk. A longer
/// stall waits in the ring buffer, which holds records at a fifth of a row's size in memory here.
const IN_FLIGHT: usize = 16;

enum Msg {
    Rows(Batch),
    Stack(Box<Stack>),
    PyStack(StackId, Box<str>),
    Probes(Vec<ProbeRow>),
    Driver(Vec<DriverRow>),
    PyTrace(Vec<super::py_trace::PyTraceRow>),
    Meta(Meta),
    Retag(Retag),
    Commit,
    Stopping,
    Finish { stop_wall_ns: u64, meta: Meta, lost_per_cpu: Vec<u64> },
}

pub struct Writer {
    tx: Option<SyncSender<Msg>>,
    batch: Batch,
    format: Format,
    /// Batches the store thread has written and emptied.
    spare: Receiver<Batch>,
    /// The driver's latest (process_used, device_used) per device and process, which device
    /// memory rows carry, as msMemScope's do.
    driver: BTreeMap<(DeviceKey, u32), (Option<u64>, Option<u64>)>,
    thread: Option<JoinHandle<Result<Vec<Written>, StoreError>>>,
}

fn serve(mut store: Store, rx: Receiver<Msg>, spare: Sender<Batch>) -> Result<Vec<Written>, StoreError> {
    let mut stacks = StackTable::new(store.debug_dirs.clone());
    for msg in rx {
        match msg {
            Msg::Stack(stack) => stacks.add(&stack),
            Msg::PyStack(id, text) => stacks.add_py(id, text),
            Msg::Rows(mut rows) => {
                store.write_batch(&rows, &stacks)?;
                rows.clear();
                // The session may be gone (finishing): then the batch is simply dropped.
                let _ = spare.send(rows);
            }
            Msg::Probes(probes) => store.add_probes(&probes)?,
            Msg::Driver(rows) => store.add_driver(rows)?,
            Msg::PyTrace(rows) => store.add_py_trace(rows)?,
            Msg::Meta(meta) => store.set_meta(&meta)?,
            Msg::Retag(retag) => store.retag(&retag)?,
            Msg::Commit => store.commit(&stacks)?,
            Msg::Stopping => store.stopping()?,
            Msg::Finish { stop_wall_ns, meta, lost_per_cpu } => {
                return store.finish(stop_wall_ns, &meta, &lost_per_cpu, &stacks)
            }
        }
    }
    // The session went away without finishing (it failed): keep what was written.
    store.commit(&stacks)?;
    Ok(Vec::new())
}

impl Writer {
    pub fn start(store: Store) -> Self {
        let (tx, rx) = sync_channel(IN_FLIGHT);
        let (spare_tx, spare) = channel();
        let format = store.format();
        let thread = std::thread::Builder::new()
            .name("memscope-store".into())
            .spawn(move || serve(store, rx, spare_tx))
            .expect("spawning the store thread");
        Self { tx: Some(tx), batch: Batch::default(), format, spare, thread: Some(thread), driver: BTreeMap::new() }
    }

    /// Sends a message; if the writer has stopped, returns the error it stopped with.
    fn send(&mut self, msg: Msg) -> Result<(), StoreError> {
        let sent = self.tx.as_ref().is_some_and(|tx| tx.send(msg).is_ok());
        if sent {
            return Ok(());
        }
        self.tx = None;
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(Err(e))) => Err(e),
            _ => Err(StoreError::Io {
                path: "<store thread>".into(),
                source: std::io::Error::other("the store thread stopped unexpectedly"),
            }),
        }
    }

    /// A stack seen for the first time: it goes ahead of the rows that refer to it (the batch
    /// being filled is sent after it), to be symbolized on the store's thread.
    pub fn add_stack(&mut self, stack: Box<Stack>) -> Result<(), StoreError> {
        self.send(Msg::Stack(stack))
    }

    /// A Python stack text seen for the first time, ahead of the rows that refer to it.
    pub fn add_py_stack(&mut self, id: StackId, text: Box<str>) -> Result<(), StoreError> {
        self.send(Msg::PyStack(id, text))
    }

    /// Writes the row of a model output, if it has one (an [`Output::Retag`] has none). A DB's
    /// rows are formatted straight into the batch; CSV's Attr form is made from a [`Row`].
    pub fn write_output(&mut self, output: &Output, stacks: (StackId, StackId)) -> Result<(), StoreError> {
        // On every row: no allocation (a fixed pair, of which the set ones are passed).
        let figures = self.driver_figures(output);
        let mut pairs = [(attr::process_used, 0), (attr::device_used, 0)];
        let mut n = 0;
        for (key, value) in [(attr::process_used, figures.0), (attr::device_used, figures.1)] {
            if let Some(v) = value {
                pairs[n] = (key, v);
                n += 1;
            }
        }
        let extra = &pairs[..n];
        match self.format {
            Format::Db => {
                self.batch.push_output(output, stacks, extra);
            }
            Format::Csv => match insight::to_row(output) {
                Some(mut row) => {
                    for &(key, value) in extra {
                        row.attr = row.attr.with(key, value);
                    }
                    self.batch.push(&row, self.format, stacks)
                }
                None => return Ok(()),
            },
        }
        self.sent_when_full()
    }

    /// The driver's latest figures for a device memory row's process, if any reading had them.
    fn driver_figures(&self, output: &Output) -> (Option<u64>, Option<u64>) {
        match output {
            Output::Malloc { site, device, space: Space::Device, .. }
            | Output::Free { site, device, space: Space::Device, .. } => {
                self.driver.get(&(*device, site.pid)).copied().unwrap_or_default()
            }
            _ => (None, None),
        }
    }

    fn sent_when_full(&mut self) -> Result<(), StoreError> {
        if self.batch.len() >= BATCH {
            self.send_batch()?;
        }
        Ok(())
    }

    fn send_batch(&mut self) -> Result<(), StoreError> {
        if self.batch.is_empty() {
            return Ok(());
        }
        let next = self.spare.try_recv().unwrap_or_default();
        let rows = std::mem::replace(&mut self.batch, next);
        self.send(Msg::Rows(rows))
    }

    pub fn add_probes(&mut self, probes: Vec<ProbeRow>) -> Result<(), StoreError> {
        self.send_batch()?;
        self.send(Msg::Probes(probes))
    }

    /// The driver's figures at one reading ([`super::driver`]), after the rows written before.
    pub fn add_driver(&mut self, rows: Vec<DriverRow>) -> Result<(), StoreError> {
        for r in &rows {
            if let Some(pid) = r.pid {
                self.driver.insert((r.device, pid), (r.process_used, r.device_used));
            }
        }
        self.send_batch()?;
        self.send(Msg::Driver(rows))
    }

    /// Python function intervals (`trace --python-trace`).
    pub fn add_py_trace(&mut self, rows: Vec<super::py_trace::PyTraceRow>) -> Result<(), StoreError> {
        self.send(Msg::PyTrace(rows))
    }

    /// Sets run-level `ms_meta` keys learnt while tracing (written when each output closes).
    pub fn set_meta(&mut self, meta: Meta) -> Result<(), StoreError> {
        self.send(Msg::Meta(meta))
    }

    /// Changes a block's owner; ordered after the rows written before it.
    pub fn retag(&mut self, retag: Retag) -> Result<(), StoreError> {
        self.send_batch()?;
        self.send(Msg::Retag(retag))
    }

    /// Everything written so far becomes durable once the writer gets to it.
    pub fn commit(&mut self) -> Result<(), StoreError> {
        self.send_batch()?;
        self.send(Msg::Commit)
    }

    /// The stop has begun: the rows that follow (the live blocks' shadow FREEs) and
    /// [`Writer::finish`] complete the outputs, and are written for speed (see `Sink::stopping`).
    pub fn stopping(&mut self) -> Result<(), StoreError> {
        self.send_batch()?;
        self.send(Msg::Stopping)
    }

    pub fn finish(mut self, stop_wall_ns: u64, meta: Meta, lost_per_cpu: Vec<u64>) -> Result<Vec<Written>, StoreError> {
        self.send_batch()?;
        self.send(Msg::Finish { stop_wall_ns, meta, lost_per_cpu })?;
        self.tx = None;
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(result)) => result,
            _ => Err(StoreError::Io {
                path: "<store thread>".into(),
                source: std::io::Error::other("the store thread panicked"),
            }),
        }
    }
}
