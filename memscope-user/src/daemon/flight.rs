//! The OOM flight recorder's recordings: when a job's allocation fails for want of memory, or
//! on request (SIGUSR1 for every job, `POST /flight-recording[?pid=N]` on the daemon's port,
//! loopback only), the job's window (`memscope_core::ingest::flight`) is written at once as a
//! run folder of its own under `OUTPUT/flight/`, with what an investigation opens first beside
//! the DB: the OOM forensics stored in it (`ms_oom`, as `analyze --analysis oom` writes them),
//! PyTorch's memory snapshot of each device (`snapshot_<device>.pickle`, for memory_viz) and
//! the HTML report (`report.html`).
//!
//! The window is copied in the daemon's loop (the job goes on filling its own), and the files
//! are written on a thread of the recording's, so the loop never waits on them; what each
//! recording became comes back over a channel ([`Recordings::finished`]) for the log and the
//! metrics. A job is recorded at most once per [`MIN_GAP`] for the same reason: an allocator
//! that retries after an OOM fails again at once, and one recording says it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use memscope_core::analysis::contract::{Analysis as _, Oom};
use memscope_core::analysis::db::DumpDb;
use memscope_core::export::memory_viz;
use memscope_core::ingest::flight::Window;
use memscope_core::model::DeviceKey;
use memscope_core::report::{self, html, Options, Page, Run};
use memscope_core::store::{DbWriter, Format, Meta, RunLayout, Store, Writer};

/// A job is recorded again for the same reason only this long after its last recording.
pub const MIN_GAP: Duration = Duration::from_secs(60);

/// Why a recording was made (the folder's suffix, the log's words, the metric's `reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    Oom,
    Degradation,
    Request,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Oom => "oom",
            Self::Degradation => "degradation",
            Self::Request => "request",
        }
    }
}

/// Recordings asked for from outside the loop (a signal's task, the HTTP server): `None` is
/// every job.
#[derive(Clone, Default)]
pub struct Requests(Arc<Mutex<Vec<Option<u32>>>>);

impl Requests {
    pub fn ask(&self, pid: Option<u32>) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).push(pid);
    }

    pub fn take(&self) -> Vec<Option<u32>> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// One job's window, copied, with what its folder and DB need.
pub struct Snapshot {
    pub pid: u32,
    pub reason: Reason,
    pub window: Window,
    /// The job's own `ms_meta` facts (its command, rank, pod, ...).
    pub meta: Meta,
    /// The folder's backend suffix (`ascend`, `cuda`).
    pub suffix: &'static str,
}

/// A recording that ended, for the log and the metrics.
pub struct Finished {
    pub pid: u32,
    pub reason: Reason,
    pub result: anyhow::Result<PathBuf>,
}

/// The recordings of every job: when each was last recorded, and the threads' answers.
pub struct Recordings {
    output: PathBuf,
    writer: DbWriter,
    last: HashMap<(u32, Reason), Instant>,
    tx: Sender<Finished>,
    rx: Receiver<Finished>,
    /// Recordings written so far, per job and reason (the metric's counter).
    pub counts: HashMap<(u32, Reason), u64>,
    /// Each job's last recording's folder.
    pub latest: HashMap<u32, PathBuf>,
    /// The recordings being written.
    writing: Vec<std::thread::JoinHandle<()>>,
}

impl Recordings {
    pub fn new(output: &Path, writer: DbWriter) -> Self {
        let (tx, rx) = channel();
        Self {
            output: output.join("flight"),
            writer,
            last: HashMap::new(),
            tx,
            rx,
            counts: HashMap::new(),
            latest: HashMap::new(),
            writing: Vec::new(),
        }
    }

    /// Whether job `pid` may be recorded for `reason` now (and, if so, it counts as done): a
    /// request always, an OOM once per [`MIN_GAP`], a degradation verdict once per job.
    pub fn due(&mut self, pid: u32, reason: Reason) -> bool {
        let now = Instant::now();
        let due = match (reason, self.last.get(&(pid, reason))) {
            (Reason::Request, _) | (_, None) => true,
            (Reason::Oom, Some(at)) => now.duration_since(*at) >= MIN_GAP,
            (Reason::Degradation, Some(_)) => false,
        };
        if due {
            self.last.insert((pid, reason), now);
        }
        due
    }

    /// Writes `snapshot` on a thread of its own.
    pub fn start(&mut self, snapshot: Snapshot) {
        let (output, writer, tx) = (self.output.clone(), self.writer, self.tx.clone());
        let spawned = std::thread::Builder::new().name("memscope-flight".into()).spawn(move || {
            let (pid, reason) = (snapshot.pid, snapshot.reason);
            let result = write(&output, writer, snapshot);
            let _ = tx.send(Finished { pid, reason, result });
        });
        match spawned {
            Ok(thread) => self.writing.push(thread),
            Err(e) => crate::terminal::say::say!("memscope-bpf: warning: cannot start a flight recording: {e}"),
        }
    }

    /// Waits for the recordings being written (the daemon stops: none is left half made).
    pub fn wait(&mut self) {
        for thread in self.writing.drain(..) {
            let _ = thread.join();
        }
    }

    /// The recordings finished since the last call, counted.
    pub fn finished(&mut self) -> Vec<Finished> {
        self.writing.retain(|t| !t.is_finished());
        let done: Vec<Finished> = self.rx.try_iter().collect();
        for f in &done {
            if let Ok(dir) = &f.result {
                *self.counts.entry((f.pid, f.reason)).or_default() += 1;
                self.latest.insert(f.pid, dir.clone());
            }
        }
        done
    }

    /// A job ended: its rate limits go (its counters stay, as counters do, until it is gone).
    pub fn forget(&mut self, pid: u32) {
        self.last.retain(|(p, _), _| *p != pid);
        self.counts.retain(|(p, _), _| *p != pid);
        self.latest.remove(&pid);
    }
}

/// The recording's folder: the window's DB, its forensics, snapshots and report.
fn write(output: &Path, writer: DbWriter, snapshot: Snapshot) -> anyhow::Result<PathBuf> {
    let Snapshot { pid, reason, window, mut meta, suffix } = snapshot;
    let now = memscope_core::ingest::clock::wall_ns();
    let start = window.start_ns().unwrap_or(now);
    std::fs::create_dir_all(output).with_context(|| format!("cannot make {}", output.display()))?;
    let layout = RunLayout::create(output, pid, (now / 1_000_000_000) as i64, &format!("{suffix}_{}", reason.as_str()))
        .with_context(|| format!("cannot make a flight recording's folder in {}", output.display()))?;
    let dir = layout.root().to_owned();
    let dropped = window.dropped();
    meta.extend([
        ("mode".to_owned(), "flight".to_owned()),
        ("flight_reason".to_owned(), reason.as_str().to_owned()),
        ("flight_rows_dropped".to_owned(), dropped.rows.to_string()),
        ("flight_held_dropped".to_owned(), dropped.held.to_string()),
        ("start_ns".to_owned(), start.to_string()),
    ]);
    let mut store = Store::new(layout, Format::Db, start, meta);
    store.db_writer = writer;
    let mut store = Writer::start(store);
    window.write(&mut store).context("cannot write the window")?;
    let written = store.finish(
        now,
        vec![("stop_reason".to_owned(), format!("flight recording: {}", reason.as_str()))],
        vec![],
    )?;
    drop(window);
    let mut devices = Vec::new();
    for w in &written {
        let db = DumpDb::open(&w.path, true).with_context(|| format!("cannot open {}", w.path.display()))?;
        let forensics = Oom::analyse(&db, &memscope_core::analysis::oom::DEFAULT_TOP_K)?;
        Oom::store(&db, &forensics, now)?;
        if let DeviceKey::Npu(index) = w.device {
            let pickle = dir.join(format!("snapshot_{index}.pickle"));
            whole(&pickle, |out| Ok(memory_viz::export(&db, index, out).map(|_| ())?))?;
        }
        let origin = report::first_ts(&db)?.unwrap_or(start as i64);
        devices.push(report::device(&db, &device_name(w.device), origin, &Options::default())?);
    }
    let origin_ns = devices.first().map_or(start as i64, |_| start as i64).to_string();
    let page = Page {
        tool: "memscope-bpf",
        version: env!("CARGO_PKG_VERSION"),
        runs: vec![Run { label: dir.display().to_string(), origin_ns, devices, identity: None }],
        compare: vec![],
        ranks: None,
    };
    let title = format!("memscope-bpf flight recording: job {pid} ({})", reason.as_str());
    whole(&dir.join("report.html"), |out| Ok(html::write(&page, &title, out).map(|_| ())?))?;
    Ok(dir)
}

fn device_name(device: DeviceKey) -> String {
    crate::metrics::device_label(device)
}

/// Writes `path` whole: beside it first, renamed over it once complete.
fn whole(
    path: &Path,
    f: impl FnOnce(&mut std::io::BufWriter<std::fs::File>) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let partial = path.with_extension("partial");
    let file = std::fs::File::create(&partial).with_context(|| format!("cannot create {}", partial.display()))?;
    let mut out = std::io::BufWriter::new(file);
    f(&mut out)?;
    std::io::Write::flush(&mut out)?;
    std::fs::rename(&partial, path).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}
