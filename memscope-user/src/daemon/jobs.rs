//! The daemon's jobs: each traced process gets the run folder `trace` would give it
//! (`OUTPUT/memscope_<pid>_<time>_ascend/`, one DB per device), opened at its first recorded call
//! and finished when it exits or the daemon stops, so every offline verb and Insight open it as
//! they open a trace's.
//!
//! One process is one job: the kernel admits each process on its own (`memscope_common::filter`),
//! so a launcher's workers (torchrun, multiprocessing) are jobs of their own, each with its own
//! devices, as msMemScope writes one folder per process too.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context as _;
use memscope_core::apis::{Api, Backend, Family};
use memscope_core::cluster::identity::Identity;
use memscope_core::cluster::pod::Pod;
use memscope_core::ingest::clock::{self, Clock};
use memscope_core::ingest::flight::{Feed, Window};
use memscope_core::ingest::live::{self, LiveView};
use memscope_core::ingest::recorder::{Recorder, WriteFailed};
use memscope_core::model::{Event, EventKind, Tracker};
use memscope_core::printable::printable;
use memscope_core::stacks::NO_STACK;
use memscope_core::store::{DbWriter, Format, Meta, ProbeRow, RunLayout, Store, Writer};

use super::flight;
use crate::metrics::{self, JobTotals};
use crate::session::facts::{allocator_env, command_line, identity, kernel_release};

/// What every job's DB records about the daemon that wrote it.
pub struct Context {
    pub output: PathBuf,
    pub format: Format,
    pub writer: DbWriter,
    pub clock: Clock,
    pub ring_bytes: u32,
    pub probe_links: String,
    /// `--sample-bytes` (0: every call recorded).
    pub sample_bytes: u64,
    /// `--warmup-steps`, `--step-marker`, `--step-window`: each job's live view.
    pub live: live::Options,
    /// `--owner-labels`.
    pub owner_labels: usize,
    /// `--node-root`: where the node's Kubernetes records are.
    pub node_root: PathBuf,
    /// `--flight-rows`, `--flight-blocks`: each job's flight-recorder window (`None`: off).
    pub flight: Option<memscope_core::ingest::flight::Limits>,
}

struct Job {
    comm: String,
    /// Its rank and job, and its pod, for its series' labels.
    identity: Identity,
    pod: Option<Pod>,
    recorder: Recorder,
    run_dir: PathBuf,
    /// Its flight-recorder window's own feed, when its calls are sampled (else its recorder's
    /// rows feed the window: [`Recorder::window`]).
    feed: Option<Feed>,
    /// Its `ms_meta` facts and folder suffix, for its flight recordings.
    meta: Meta,
    suffix: &'static str,
    last_event: Instant,
    /// Rows came since the last commit (an idle job's commit would be an empty transaction).
    dirty: bool,
}

/// A finished job, for the daemon's log.
pub struct Ended {
    pub comm: String,
    pub run_dir: PathBuf,
    pub calls: u64,
}

/// What became of a job at an event.
pub enum Outcome {
    /// Its process exited: the job is to be finished.
    Exited(u32),
    /// Its DB could not be written: the job is to be finished (it ends at its last commit).
    WriteFailed(u32),
    /// Its run folder could not be made: the process is not recorded from then on.
    Failed(u32, anyhow::Error),
    /// An allocation failed for want of memory: its flight recording is due.
    OutOfMemory(u32),
}

#[derive(Default)]
pub struct Jobs {
    jobs: BTreeMap<u32, Job>,
    /// Opened since the last [`Jobs::take_opened`].
    opened: Vec<u32>,
    /// Processes whose job could not be opened: their events are dropped until they exit.
    refused: std::collections::BTreeSet<u32>,
}

impl Jobs {
    /// Feeds one event to its process's job, opening the job at the process's first event.
    /// Returns the job to finish now: its process exited, or its files failed (what goes wrong
    /// with a job's files ends that job, not the daemon).
    pub fn on_event(&mut self, event: Event, cx: &Context, probes: &[ProbeRow]) -> Option<Outcome> {
        let pid = event.pid;
        let exit = matches!(event.kind, EventKind::Exit);
        if !self.refused.is_empty() && self.refused.contains(&pid) {
            if exit {
                self.refused.remove(&pid);
            }
            return None;
        }
        let job = match self.jobs.entry(pid) {
            std::collections::btree_map::Entry::Occupied(job) => job.into_mut(),
            // An exit of a process that never made a recorded call opens nothing, nor does a
            // garbage-collector pass (no row of its own; a Python job's first event, long before
            // it loads the accelerator libraries whose backend names its folder).
            std::collections::btree_map::Entry::Vacant(_) if exit || is_gc_pass(&event) => return None,
            std::collections::btree_map::Entry::Vacant(slot) => match open(pid, &event, cx, probes) {
                Ok(job) => {
                    let job = slot.insert(job);
                    self.opened.push(pid);
                    job
                }
                Err(e) => {
                    self.refused.insert(pid);
                    return Some(Outcome::Failed(pid, e));
                }
            },
        };
        job.last_event = Instant::now();
        let left_out = match &mut job.feed {
            Some(feed) => feed.on_event(&event),
            None => matches!(&event.kind, EventKind::Call(call) if call.window_only),
        };
        if left_out {
            // Sampling left it out of the job's rows; its window has it.
            return None;
        }
        job.dirty = true;
        let oom = matches!(&event.kind, EventKind::Call(call) if call.out_of_memory);
        job.recorder.on_event(event);
        if oom {
            // The OOM's forensics (trigger, recent and largest blocks, pool state) are on disk
            // at once, not at the next commit: the process may be about to die of it.
            if let Err(e) = job.recorder.store.commit() {
                job.recorder.error.get_or_insert(WriteFailed { what: "cannot commit the OOM's rows", source: e });
            }
        }
        if exit {
            Some(Outcome::Exited(pid))
        } else if job.recorder.error.is_some() {
            Some(Outcome::WriteFailed(pid))
        } else if oom && (job.recorder.window.is_some() || job.feed.is_some()) {
            Some(Outcome::OutOfMemory(pid))
        } else {
            None
        }
    }

    /// The jobs opened since the last call, with their run folders, for the daemon's log.
    pub fn take_opened(&mut self) -> Vec<(u32, String, PathBuf)> {
        let opened = std::mem::take(&mut self.opened);
        opened
            .into_iter()
            .filter_map(|pid| self.jobs.get(&pid).map(|j| (pid, j.comm.clone(), j.run_dir.clone())))
            .collect()
    }

    /// A copy of job `pid`'s flight-recorder window, to be written for `reason`; `None` when the
    /// job is not open or has no window.
    pub fn flight_snapshot(&self, pid: u32, reason: flight::Reason) -> Option<flight::Snapshot> {
        let job = self.jobs.get(&pid)?;
        let window = job.recorder.window.clone().or_else(|| Some(job.feed.as_ref()?.window.clone()))?;
        Some(flight::Snapshot { pid, reason, window, meta: job.meta.clone(), suffix: job.suffix })
    }

    /// The pids of the jobs now open.
    pub fn pids(&self) -> Vec<u32> {
        self.jobs.keys().copied().collect()
    }

    /// The open jobs' run folders.
    pub fn run_dirs(&self) -> Vec<PathBuf> {
        self.jobs.values().map(|j| j.run_dir.clone()).collect()
    }

    /// Records newly attached probes in every open job's `ms_probes`.
    pub fn add_probes(&mut self, probes: &[ProbeRow]) -> anyhow::Result<()> {
        for job in self.jobs.values_mut() {
            job.dirty = true;
            job.recorder.store.add_probes(probes.to_vec())?;
        }
        Ok(())
    }

    /// The driver's figures: each row into its process's job (the device alone's go nowhere:
    /// the node's devices are not one job's).
    pub fn add_driver(&mut self, rows: Vec<memscope_core::store::DriverRow>) -> Vec<(u32, anyhow::Error)> {
        let mut failed = Vec::new();
        for row in rows {
            let Some(pid) = row.pid else { continue };
            if let Some(job) = self.jobs.get_mut(&pid) {
                job.dirty = true;
                if let Some(w) = job.recorder.window.as_mut().or(job.feed.as_mut().map(|f| &mut f.window)) {
                    w.add_driver(&row);
                }
                if let Err(e) = job.recorder.store.add_driver(vec![row]) {
                    failed.push((pid, anyhow::Error::new(e)));
                }
            }
        }
        failed
    }

    /// Commits every job's rows written since the last commit (so a killed daemon leaves
    /// readable DBs).
    pub fn commit(&mut self) -> Vec<(u32, anyhow::Error)> {
        let mut failed = Vec::new();
        for (pid, job) in self.jobs.iter_mut().filter(|(_, j)| j.dirty) {
            job.dirty = false;
            if let Err(e) = job.recorder.store.commit() {
                failed.push((*pid, anyhow::Error::new(e)));
            }
        }
        failed
    }

    /// Every open job's totals, with its live view brought up to `now_ns` (wall clock).
    pub fn totals(&mut self, now_ns: u64, owner_labels: usize) -> Vec<JobTotals> {
        self.jobs
            .iter_mut()
            .map(|(pid, job)| {
                // A sampled job's feed counts every call: its totals are exact.
                let tracker = job.feed.as_ref().map_or(&job.recorder.tracker, |f| f.tracker());
                let mut totals = JobTotals::of(*pid, job.comm.clone(), tracker);
                totals.identity = job.identity.clone();
                totals.pod = job.pod.clone();
                match &mut job.recorder.live {
                    Some(view) => {
                        view.tick(now_ns);
                        totals.with_live(view, owner_labels)
                    }
                    None => totals,
                }
            })
            .collect()
    }

    /// Live blocks of the sampled APIs, every job's together (those born in the daemon's
    /// windows: `daemon::windows`).
    pub fn sampled_blocks(&self) -> usize {
        self.jobs.values().filter_map(|j| j.feed.as_ref()).map(|f| f.tracker().sampled_blocks()).sum()
    }

    /// Forgets the live blocks of the sampled APIs in every job at `wall_ns`: the window's
    /// probes are gone, so their frees cannot be seen. Each job's rows get an implied FREE for
    /// those it recorded. Returns how many blocks were forgotten.
    pub fn forget_sampled(&mut self, wall_ns: u64) -> usize {
        let mut forgotten = 0;
        for job in self.jobs.values_mut() {
            let Some(feed) = &mut job.feed else { continue };
            forgotten += feed.forget_sampled(wall_ns);
            if job.recorder.forget_sampled(wall_ns) > 0 {
                job.dirty = true;
            }
        }
        forgotten
    }

    pub fn calls(&self) -> u64 {
        self.jobs.values().map(|j| j.recorder.calls).sum()
    }

    /// Finishes job `pid`: shadow frees for its live blocks, its totals in `ms_meta`, the DBs
    /// closed. `lost_per_cpu` is the daemon's own count (the ring is shared by every job).
    pub fn finish(&mut self, pid: u32, reason: &str, lost_per_cpu: &[u64]) -> anyhow::Result<Ended> {
        let job = self.jobs.remove(&pid).context("no such job")?;
        let Job { comm, recorder, run_dir, .. } = job;
        let Recorder { mut tracker, mut store, calls, markers, error, .. } = recorder;
        if let Some(e) = error {
            // The DB is left as its last commit had it; nothing more can be written to it.
            return Err(anyhow::Error::new(e)
                .context(format!("job {pid} ({}): its DB ends at the last commit", printable(&comm))));
        }
        let stop_wall = clock::wall_ns();
        store.stopping()?;
        tracker.finish(stop_wall, |output| store.write_output(&output, (NO_STACK, NO_STACK)))?;
        let lost: u64 = lost_per_cpu.iter().sum();
        let meta: Meta = vec![
            ("stop_ns".into(), stop_wall.to_string()),
            ("stop_reason".into(), reason.to_owned()),
            ("calls_recorded".into(), calls.to_string()),
            ("markers_recorded".into(), markers.to_string()),
            ("records_lost".into(), lost.to_string()),
            ("records_lost_scope".into(), "the daemon's ring, shared by every job, until this job ended".into()),
        ];
        let written = store.finish(stop_wall, meta, lost_per_cpu.to_vec())?;
        if written.is_empty() {
            let _ = std::fs::remove_dir(&run_dir);
        }
        for note in written.iter().filter_map(|w| w.note.as_deref()) {
            crate::terminal::say::say!("memscope-bpf: warning: job {pid}: {note}");
        }
        Ok(Ended { comm, run_dir, calls })
    }

    /// Jobs whose process is gone though no exit record came (one lost in a full ring).
    pub fn vanished(&self) -> Vec<u32> {
        let quiet_for = std::time::Duration::from_secs(1);
        self.jobs
            .iter()
            .filter(|(pid, job)| {
                job.last_event.elapsed() > quiet_for
                    && crate::capture::procs::liveness(**pid) == crate::capture::procs::Liveness::Exited
            })
            .map(|(pid, _)| *pid)
            .collect()
    }
}

fn is_gc_pass(event: &Event) -> bool {
    matches!(&event.kind, EventKind::Call(call) if matches!(call.op, memscope_core::model::Op::GcPass { .. }))
}

/// The accelerator stacks of a job at its first event: that call's, else those of the
/// libraries the process maps, else those of the node's attached probes (`ms_probes` rows: an
/// API's name, or a USDT site's `provider:name`).
fn job_backends(pid: u32, first: &Event, probes: &[ProbeRow]) -> Vec<Backend> {
    if let EventKind::Call(call) = &first.kind {
        if let Some(backend) = call.api.family().backend() {
            return vec![backend];
        }
    }
    let mapped = crate::attach::libs::from_maps(pid).unwrap_or_default();
    let families = Family::ALL.into_iter().filter(|f| {
        mapped
            .iter()
            .any(|l| Path::new(&l.shown).file_name().is_some_and(|n| crate::attach::libs::is_family_file(n, *f)))
    });
    let from_maps: Vec<Backend> = {
        let set: std::collections::BTreeSet<Backend> = families.filter_map(Family::backend).collect();
        set.into_iter().collect()
    };
    if !from_maps.is_empty() {
        return from_maps;
    }
    let api = |p: &ProbeRow| {
        Api::from_name(&p.api)
            .or_else(|| p.symbol.split_once(':').and_then(|(pr, n)| memscope_core::apis::usdt_api(pr, n)))
    };
    Backend::of(probes.iter().filter_map(api))
}

/// Opens a job's run folder and store, as `trace` does for its target.
fn open(pid: u32, first: &Event, cx: &Context, probes: &[ProbeRow]) -> anyhow::Result<Job> {
    let start_wall = clock::wall_ns();
    let backends = job_backends(pid, first, probes);
    let suffix = Backend::folder_suffix(&backends);
    let layout = RunLayout::create(&cx.output, pid, (start_wall / 1_000_000_000) as i64, suffix)
        .with_context(|| format!("cannot make a run folder for process {pid} in {}", cx.output.display()))?;
    let run_dir = layout.root().to_owned();
    let comm = metrics::comm_of(pid);
    let mut meta: Meta = vec![
        ("tool".into(), "memscope-bpf".into()),
        ("tool_version".into(), env!("CARGO_PKG_VERSION").into()),
        ("kernel".into(), kernel_release()),
        ("mode".into(), "daemon".into()),
        ("target_pid".into(), pid.to_string()),
        ("command".into(), command_line(pid)),
        ("start_ns".into(), start_wall.to_string()),
        ("clock".into(), format!("CLOCK_MONOTONIC + {} ns offset measured at start", cx.clock.offset().as_nanos())),
        ("ring_bytes".into(), cx.ring_bytes.to_string()),
        ("format".into(), format!("{:?}", cx.format).to_lowercase()),
        ("probe_links".into(), cx.probe_links.clone()),
        ("sample_bytes".into(), cx.sample_bytes.to_string()),
        ("backend".into(), Backend::meta(&backends)),
    ];
    meta.extend(allocator_env(pid));
    let identity = identity(pid);
    meta.extend(identity.meta());
    let pod = crate::session::k8s::pod_of(pid, &cx.node_root);
    meta.extend(pod.as_ref().map(Pod::meta).unwrap_or_default());
    let mut store = Store::new(layout, cx.format, start_wall, meta.clone());
    store.db_writer = cx.writer;
    let mut store = Writer::start(store);
    store.add_probes(probes.to_vec())?;
    let mut recorder = Recorder::new(Tracker::new(), store, crate::capture::procs::is_running_process);
    // Python stacks serve the owner rules and sites; rows carry no stack column.
    recorder.python_column = false;
    recorder.live = Some(LiveView::new(cx.live.clone()));
    // Sampled, the job's rows are not every call: its window gets a feed of its own.
    let sampled = cx.sample_bytes > 0;
    recorder.window = cx.flight.filter(|_| !sampled).map(Window::new);
    let feed = cx.flight.filter(|_| sampled).map(Feed::new);
    let last_event = Instant::now();
    Ok(Job { comm, identity, pod, recorder, run_dir, feed, meta, suffix, last_event, dirty: true })
}

/// Where a job's folders go: shown once at the start.
pub fn describe_output(output: &Path) -> String {
    format!("{}/memscope_<pid>_<time>_<ascend|cuda>/", output.display())
}
