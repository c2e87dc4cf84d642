//! One trace, from loading the probes to the closed DBs.
//!
//! The loop drains the ring buffer (on wakeup and on a 20 ms timer), feeds each event to the
//! model and each resulting fact to the store, commits at least every second, and looks for newly
//! loaded libraries every 250 ms. It stops on Ctrl-C, SIGTERM, SIGHUP, `--duration` or when the
//! last traced process has exited (the target, then the children it forked: [`procs`]), then
//! drains what is left, hands the probes to a thread that detaches them (slow in the kernel, see
//! `stop`), and meanwhile writes shadow frees for live blocks and closes every file: the DBs are
//! complete before the detaching is.
//!
//! The loop itself is the daemon's too ([`crate::capture::event_loop`]); this module brings what
//! a trace does at each of its points. [`facts`]: what the trace records about itself in
//! `ms_meta`; [`summary`]: what it prints at the end; [`launch`] and [`preflight`]: the target
//! started under the probes, and what is checked before anything is loaded.

pub mod facts;
pub mod k8s;
pub mod launch;
pub mod preflight;
pub mod summary;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use aya_log::EbpfLogger;
use memscope_core::apis::Backend;
use memscope_core::ingest::clock::{self, Clock};
use memscope_core::ingest::live;
use memscope_core::ingest::recorder::Recorder;
use memscope_core::model::Tracker;
use memscope_core::stacks::spec::{StackOptions, Unwind};
use memscope_core::store::{Format, Meta, RunLayout, Store, Writer};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::oneshot;

use crate::attach::libs::Library;
use crate::attach::loader::bpf_log::{BpfLog, BpfLogCounts, BpfLogLevel};
use crate::attach::loader::LoadOptions;
use crate::attach::{ProbeSet, Tracer};
use crate::capture::attaching::{
    self, announce, attach_all, describe_libraries, describe_usdt, probe_rows, rescan, skipped_meta, usdt_rows,
    Attached, SkippedLibrary,
};
use crate::capture::event_loop;
use crate::capture::procs;
use crate::capture::ring::Consumer;
use crate::capture::stop::{Detaching, Every, Signals, HANGUP};
use crate::capture::{self};
use crate::driver::Driver;
use crate::metrics::{self, JobTotals, Published, Snapshot};
use crate::terminal::say::note;
use facts::{allocator_env, command_line, device_lines, kernel_release, pool_lines, stack_meta};
use launch::Launched;
use summary::Summary;

/// How often the traced processes' maps are read again without a load reported.
const RESCAN_EVERY: Duration = Duration::from_millis(250);
/// Owners the live status names.
const STATUS_OWNERS: usize = 5;

pub enum Target {
    Pid(u32),
    Launched(Launched),
}

impl Target {
    fn pid(&self) -> u32 {
        match self {
            Self::Pid(pid) => *pid,
            Self::Launched(l) => l.pid,
        }
    }
}

pub struct Plan {
    /// The launched command line (launch mode); in attach mode it is read from /proc.
    pub command: Option<String>,
    pub target: Target,
    pub libraries: Vec<Library>,
    pub debug_dirs: Vec<PathBuf>,
    /// Output, format, writer, probes, ring, duration, status: what the daemon is told too.
    pub capture: capture::Plan,
    /// Trace the processes the target forks too, and stop when the last traced process exits.
    pub follow: bool,
    /// Report nothing until the program starts collection (markers `start()`).
    pub wait_for_start: bool,
    /// `--call-stack`, `--unwind`, `--stack-window`, `--no-infer`.
    pub stacks: StackOptions,
    /// The owner rules (built-in and `--owner-rules`) and how steps are found (`--step-frame`).
    pub rules: memscope_core::infer::Reader,
    /// `--bpf-log`: what the probes tell of their own trouble.
    pub bpf_log: Option<BpfLogLevel>,
    /// `--listen`: where Prometheus scrapes the trace's totals.
    pub listen: Option<SocketAddr>,
}

/// The traced processes other than the target that are still running: the kernel's traced set
/// (complete even before the ring delivers the fork records), or, if it cannot be read, the
/// children those records named.
fn still_traced(tracer: &Tracer, children: &BTreeSet<u32>, target: u32) -> Vec<u32> {
    let ids = tracer.traced_ids().unwrap_or_else(|_| children.iter().copied().collect());
    procs::running(ids, target)
}

/// Resolves when the target process ends, with a description of how. The trace goes on while
/// traced children run (see [`procs::Ending`]).
/// Launch mode also gives the launched command's exit status (128 + the signal's number when a
/// signal ended it), for the tracer to pass on.
async fn target_exit(
    target_pid: u32,
    waiter: Option<oneshot::Receiver<std::io::Result<i32>>>,
) -> (String, Option<i32>) {
    if let Some(rx) = waiter {
        return match rx.await {
            Ok(Ok(code)) => (format!("target exited with status {code}"), Some(code)),
            _ => ("target exited".to_owned(), None),
        };
    }
    // SAFETY: plain syscall; returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, target_pid as libc::c_int, 0) };
    if fd >= 0 {
        // SAFETY: fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        // SAFETY: the AsyncFd owns the descriptor, so it stays open and the same while registered.
        if let Ok(async_fd) = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) } {
            // A pidfd becomes readable when the process exits.
            let _ = async_fd.readable().await;
            return ("target exited".to_owned(), None);
        }
    }
    // No pidfd (kernel < 5.3): poll.
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        // SAFETY: signal 0 only checks existence.
        if unsafe { libc::kill(target_pid as i32, 0) } != 0
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
        {
            return ("target exited".to_owned(), None);
        }
    }
}

/// A trace whose DBs are finished, with its probes still being detached.
pub struct Finished {
    pub summary: Summary,
    pub detaching: Detaching,
}

/// One trace: loads and attaches the probes, opens the store and the ring, lets the target go,
/// runs the loop ([`Live::trace`]) and finishes the DBs ([`Live::finish`]).
pub async fn run(plan: Plan) -> anyhow::Result<Finished> {
    let Plan {
        command,
        mut target,
        libraries,
        debug_dirs,
        capture,
        follow,
        wait_for_start,
        stacks,
        rules,
        bpf_log,
        listen,
    } = plan;
    let capture::Plan { output, duration, format, writer, probe_set, ring_bytes, quiet, status, driver, node_root } =
        capture;
    let pid = target.pid();
    // Before anything is attached: a port in use fails the trace at once.
    let metrics = serve_metrics(listen, quiet).await?;
    let clock = Clock::calibrate();
    let started = Instant::now();
    let start_wall = clock::wall_ns();

    let launch_mode = matches!(target, Target::Launched(_));
    let mut tracer = load(pid, launch_mode, follow, ring_bytes, debug_dirs.clone(), stacks, bpf_log)?;
    let bpf_log = match bpf_log {
        Some(_) => {
            let counts = Arc::new(BpfLogCounts::default());
            let logger = tracer.bpf_logger(BpfLog { counts: Arc::clone(&counts) })?;
            Some((logger, counts))
        }
        None => None,
    };
    let Attached { probes, markers, skipped } =
        attach_all(&mut tracer, &libraries, probe_set, quiet).map_err(|e| attaching::unless_exited(e, pid))?;

    let backends = attaching::backends(&probes, &markers);
    let layout =
        RunLayout::create(&output, pid, (start_wall / 1_000_000_000) as i64, Backend::folder_suffix(&backends))?;
    let command = command.unwrap_or_else(|| command_line(pid));
    let facts = RunFacts { pid, launch_mode, command, start_wall, clock, ring_bytes, format, node_root };
    let mut meta = run_meta(facts, tracer.link_kind(), &backends);
    if !skipped.is_empty() {
        meta.extend(skipped_meta(&skipped));
    }
    let run_dir = layout.root().to_owned();
    meta.extend(stacks_asked(&stacks));
    let mut store = Store::new(layout, format, start_wall, meta);
    store.debug_dirs = debug_dirs.clone();
    store.db_writer = writer;
    let mut store = Writer::start(store);
    store.add_probes(probe_rows(&probes, start_wall))?;
    store.add_probes(usdt_rows(&markers, start_wall))?;
    let driver = start_driver(&driver, pid, quiet, &mut store)?;

    let mut consumer = Consumer::new(tracer.take_ring()?, clock)?;
    consumer.set_stack_depth(stacks.call.native_depth());
    consumer.set_debug_dirs(debug_dirs.clone());

    // Before saying it is live: a SIGINT from then on must stop the trace, not kill the tracer
    // (finding the job's interpreter, below, takes a moment).
    let mut signals = Signals::new()?;
    announce(&probes, &markers, libraries.len(), pid, follow, launch_mode, quiet);
    attaching::hook_linker(&mut tracer, pid);
    if let Some(hz) = stacks.python_trace {
        let cpus = tracer.start_python_sampler(hz).context("cannot start the Python sampler (--python-trace)")?;
        note(quiet, format!("python trace: each traced thread's Python stack sampled at {hz} Hz ({cpus} CPU timers)"));
    }
    let waiter = release(&mut target)?;

    let mut tracker = if wait_for_start { Tracker::paused_until_start() } else { Tracker::new() };
    tracker.set_owner_rules(rules);
    let python = (stacks.python_depth() > 0 || stacks.python_trace.is_some()).then(BTreeSet::new);
    let status = crate::terminal::status::Status::new(status);
    let mut recorder = Recorder::new(tracker, store, procs::is_running_process);
    recorder.python_column = stacks.call.python.is_some();
    recorder.py_trace = stacks.python_trace.map(memscope_core::ingest::py_trace::Builder::new);
    if status.shown() {
        // The status's owners and step: the daemon's live view, without its periodic steps.
        let options = live::Options { warmup_steps: 1, step_marker: None, window_ns: 0, trend_every_ns: u64::MAX };
        recorder.live = Some(live::LiveView::new(options));
    }
    let mut live = Live {
        pid,
        probe_set,
        quiet,
        tracer,
        consumer,
        recorder,
        skipped,
        python,
        bpf_log,
        metrics,
        comm: String::new(),
        status,
        target_status: None,
        launched: launch_mode,
        late_libraries: Vec::new(),
        probed_at_start: !probes.is_empty(),
        loads_reported: false,
        ending: procs::Ending::default(),
        rescan_every: Every::new(RESCAN_EVERY),
        status_every: Every::new(crate::terminal::status::RENEW_EVERY),
        driver,
    };
    live.find_pythons()?;
    let stop_reason = event_loop::run(&mut live, &mut signals, duration, target_exit(pid, waiter)).await?;
    live.finish(signals, stop_reason, started, run_dir)
}

/// How long an attach waits for the driver's first reading, so that the DBs' START_TRACE rows
/// carry the device's memory (a launched job maps no driver library yet: its reading comes later
/// and is set on the row then).
const FIRST_READING_WAIT: Duration = Duration::from_secs(2);

/// Starts reading the driver's figures if the target maps a driver library already, and hands
/// the first reading to the store.
fn start_driver(config: &crate::driver::Config, pid: u32, quiet: bool, store: &mut Writer) -> anyhow::Result<Driver> {
    let mut driver = Driver::new(config);
    if let Some(line) = driver.try_start(pid) {
        note(quiet, line);
    }
    let (rows, lines) = driver.first(FIRST_READING_WAIT, &|p| p == pid);
    for line in lines {
        note(quiet, line);
    }
    if !rows.is_empty() {
        store.add_driver(rows)?;
    }
    Ok(driver)
}

/// What a trace's `ms_meta` says about the run itself.
struct RunFacts {
    pid: u32,
    /// `--node-root`: where the node's Kubernetes records are.
    node_root: std::path::PathBuf,
    launch_mode: bool,
    command: String,
    start_wall: u64,
    clock: Clock,
    ring_bytes: u32,
    format: Format,
}

/// `ms_meta`'s entries known at the start: the tool, the target, the clock, how events travel,
/// the backend, and the target's allocator settings.
fn run_meta(f: RunFacts, probe_links: String, backends: &[Backend]) -> Meta {
    let mut meta: Meta = vec![
        ("tool".into(), "memscope-bpf".into()),
        ("tool_version".into(), env!("CARGO_PKG_VERSION").into()),
        ("kernel".into(), kernel_release()),
        ("mode".into(), if f.launch_mode { "launch" } else { "attach" }.into()),
        ("target_pid".into(), f.pid.to_string()),
        ("command".into(), f.command),
        ("start_ns".into(), f.start_wall.to_string()),
        ("clock".into(), format!("CLOCK_MONOTONIC + {} ns offset measured at start", f.clock.offset().as_nanos())),
        ("ring_bytes".into(), f.ring_bytes.to_string()),
        ("format".into(), format!("{:?}", f.format).to_lowercase()),
        ("probe_links".into(), probe_links),
        ("backend".into(), Backend::meta(backends)),
    ];
    meta.extend(allocator_env(f.pid));
    // The target's rank and job (a launched command's are its own environment's, which a
    // launcher like torchrun gives each worker, not itself).
    meta.extend(facts::identity(f.pid).meta());
    meta.extend(k8s::pod_of(f.pid, &f.node_root).map(|p| p.meta()).unwrap_or_default());
    meta
}

/// `ms_meta`'s record of the stacks asked for (`--call-stack`, `--unwind`).
fn stacks_asked(stacks: &StackOptions) -> Meta {
    let mut meta = Meta::new();
    if let Some(depth) = stacks.call.c {
        meta.push(("call_stack_c".into(), depth.to_string()));
        let unwind = match stacks.unwind {
            Unwind::Fp => "fp".to_owned(),
            Unwind::Dwarf => format!("dwarf (window {} bytes)", stacks.window),
        };
        meta.push(("unwind".into(), unwind));
    }
    if let Some(depth) = stacks.call.python {
        meta.push(("call_stack_python".into(), depth.to_string()));
    }
    if let Some(hz) = stacks.python_trace {
        meta.push(("python_trace_hz".into(), hz.to_string()));
    }
    meta
}

/// `--listen`: binds the address and serves the totals published from then on.
async fn serve_metrics(listen: Option<SocketAddr>, quiet: bool) -> anyhow::Result<Option<Published>> {
    Ok(match listen {
        Some(addr) => Some(metrics::serve(addr, quiet, None).await?),
        None => None,
    })
}

/// Loads the eBPF programs and registers the target in the kernel's traced set.
fn load(
    pid: u32,
    launch_mode: bool,
    follow: bool,
    ring_bytes: u32,
    debug_dirs: Vec<PathBuf>,
    stacks: StackOptions,
    bpf_log: Option<BpfLogLevel>,
) -> anyhow::Result<Tracer> {
    let opts = LoadOptions {
        ring_bytes,
        wakeup_bytes: u64::from(ring_bytes) / event_loop::WAKEUP_FRACTION,
        follow_forks: follow,
        debug_dirs,
        stack_depth: stacks.kernel_depth(),
        stack_window: stacks.window_bytes(),
        python_depth: stacks.python_depth(),
        python_frees: stacks.call.python.is_some(),
        python_sample_depth: stacks.python_sample_depth(),
        bpf_log,
        admission: None,
        sampling: None,
        window_all: false,
        windowed: false,
    };
    // A child's uprobes hit in its own address space: following children means probing every
    // process and filtering by the traced set in the kernel, as launch mode always does.
    let scope_pid = (!launch_mode && !follow).then_some(pid);
    let mut tracer = Tracer::load(&opts, pid, scope_pid).context("cannot load the eBPF programs")?;
    tracer.trace_process(pid).context("cannot register the target process")?;
    Ok(tracer)
}

/// Lets a launched target run, now that its probes are in place; the returned channel gets its
/// exit status. An attached target is already running: no channel.
fn release(target: &mut Target) -> anyhow::Result<Option<oneshot::Receiver<std::io::Result<i32>>>> {
    let Target::Launched(launched) = target else {
        return Ok(None);
    };
    launched.release()?;
    let (tx, rx) = oneshot::channel();
    let child = launched.pid;
    std::thread::spawn(move || {
        let _ = tx.send(launch::wait(child));
    });
    Ok(Some(rx))
}

/// A running trace: the probes, the ring and what its records go to.
struct Live {
    pid: u32,
    probe_set: ProbeSet,
    quiet: bool,
    tracer: Tracer,
    consumer: Consumer,
    recorder: Recorder,
    skipped: Vec<SkippedLibrary>,
    /// `--call-stack python`: the processes whose interpreter was looked for (found or not).
    python: Option<BTreeSet<u32>>,
    /// `--bpf-log`: the probes' messages, read on every drain, and their counts.
    bpf_log: Option<(EbpfLogger<BpfLog>, Arc<BpfLogCounts>)>,
    /// `--listen`: the totals the next scrape reports, renewed at every drain tick.
    metrics: Option<Published>,
    /// The target's command name, for the metrics' `comm` label (the last one read).
    comm: String,
    status: crate::terminal::status::Status,
    /// The launched command's exit status, once it has exited (launch mode).
    target_status: Option<i32>,
    /// The target was launched under the probes (nothing it allocated predates the trace).
    launched: bool,
    /// Libraries probed only after a traced process loaded them (`ms_meta.late_libraries`).
    late_libraries: Vec<String>,
    /// Some library was probed before the job started (else the trace only watched its loads).
    probed_at_start: bool,
    /// The dynamic linker reported a load since the last look at the maps: look now.
    loads_reported: bool,
    /// Whether the target has exited, and when the children still traced are looked at.
    ending: procs::Ending,
    rescan_every: Every,
    status_every: Every,
    /// The driver's own figures, read by a helper process.
    driver: Driver,
}

impl Live {
    /// Looks for the interpreter of each traced process not looked at yet, and lets the probe
    /// walk it. A process that has not loaded Python yet is looked at again at the next rescan.
    fn find_pythons(&mut self) -> anyhow::Result<()> {
        let Some(seen) = &mut self.python else { return Ok(()) };
        for pid in std::iter::once(self.pid).chain(self.recorder.children.iter().copied()) {
            if seen.contains(&pid) {
                continue;
            }
            match crate::capture::python::register(&mut self.tracer, &mut self.consumer, pid)? {
                None => continue,
                Some(line) => note(self.quiet, line),
            }
            seen.insert(pid);
        }
        Ok(())
    }

    /// Feeds every record waiting in the ring to the model and the store.
    fn drain(&mut self) {
        let Self { consumer, recorder, bpf_log, python, tracer, .. } = self;
        consumer.drain(|e| recorder.on_event(e));
        // A process that replaced its image has its interpreter, if any, looked for again, and
        // the dynamic linker it now runs hooked.
        for pid in consumer.take_execs() {
            if let Some(seen) = python.as_mut() {
                seen.remove(&pid);
            }
            attaching::hook_linker(tracer, pid);
        }
        self.loads_reported |= !consumer.take_loads().is_empty();
        if let Some((logger, _)) = bpf_log {
            logger.flush();
        }
    }

    /// `--listen`: the totals as they are now, for the next scrape.
    fn publish_metrics(&mut self) {
        if let Some(metrics) = &self.metrics {
            // Read each time: a launched target takes its name at its exec, after the start.
            let comm = metrics::comm_of(self.pid);
            if !comm.is_empty() {
                self.comm = comm;
            }
            let lost = self.tracer.lost_per_cpu().unwrap_or_default().iter().sum();
            let mut job = JobTotals::of(self.pid, self.comm.clone(), &self.recorder.tracker);
            let (pid, children) = (self.pid, &self.recorder.children);
            job.driver = self.driver.latest(&|p| p == pid || children.contains(&p));
            let maps = self.tracer.map_memory();
            metrics.publish(Snapshot { jobs: vec![job], calls: self.recorder.calls, lost, maps, windows: None });
        }
    }

    /// The live status, renewed from the tracker and the live view.
    fn renew_status(&mut self) {
        let tracker = &self.recorder.tracker;
        let devices = tracker
            .devices()
            .map(|(key, s)| crate::terminal::status::DeviceFacts {
                job: None,
                device: metrics::device_label(key),
                live_bytes: s.used,
                peak_bytes: s.peak,
                out_of_memory: s.out_of_memory,
            })
            .collect();
        let view = self.recorder.live.as_ref();
        let mut owners: Vec<crate::terminal::status::OwnerFacts> = view
            .map(|v| v.owners(STATUS_OWNERS))
            .unwrap_or_default()
            .into_iter()
            .filter(|o| o.bytes > 0)
            .map(|o| crate::terminal::status::OwnerFacts {
                job: None,
                device: metrics::device_label(o.device),
                owner: o.owner,
                bytes: o.bytes,
            })
            .collect();
        owners.sort_by_key(|o| std::cmp::Reverse(o.bytes));
        let lost = self.tracer.lost_per_cpu().unwrap_or_default().iter().sum();
        let step = view.and_then(|v| v.step()).map(|(n, _)| n);
        let facts =
            crate::terminal::status::Facts { calls: self.recorder.calls, lost, devices, owners, step, jobs: None };
        self.status.renew(&facts);
    }

    /// The driver's readings since the last look, into the store.
    fn driver_readings(&mut self) -> anyhow::Result<()> {
        let (pid, children) = (self.pid, &self.recorder.children);
        let (rows, lines) = self.driver.poll(&|p| p == pid || children.contains(&p));
        for line in lines {
            note(self.quiet, line);
        }
        if !rows.is_empty() {
            self.recorder.store.add_driver(rows)?;
        }
        Ok(())
    }

    /// The traced processes other than the target still running ([`still_traced`]).
    fn still_traced(&self) -> Vec<u32> {
        still_traced(&self.tracer, &self.recorder.children, self.pid)
    }

    /// Probes the libraries the traced processes mapped since the last look.
    fn rescan(&mut self) -> anyhow::Result<()> {
        self.find_pythons()?;
        if let Some(line) = self.driver.try_start(self.pid) {
            note(self.quiet, line);
        }
        let pids = std::iter::once(self.pid).chain(self.recorder.children.iter().copied()).collect::<Vec<_>>();
        let (quiet, store) = (self.quiet, &mut self.recorder.store);
        let before = self.skipped.len();
        let (added, markers) = rescan(&mut self.tracer, pids.into_iter(), self.probe_set, quiet, &mut self.skipped);
        if self.skipped.len() > before {
            store.set_meta(skipped_meta(&self.skipped))?;
        }
        if !added.is_empty() {
            // Python's collector only marks frees `freed_by: gc`: probed late, it makes no count
            // inexact (and a launched interpreter's is always found after its exec).
            let counted = added.iter().filter(|p| p.api.family() != memscope_core::apis::Family::PythonGc);
            for probe in counted {
                if !self.late_libraries.contains(&probe.library) {
                    self.late_libraries.push(probe.library.clone());
                }
            }
            let libraries = describe_libraries(&added);
            note(
                quiet,
                format!("attached {} more probes in {libraries} (loaded after the trace started)", added.len()),
            );
            store.add_probes(probe_rows(&added, clock::wall_ns()))?;
        }
        if !markers.is_empty() {
            note(quiet, format!("{} (loaded after the trace started)", describe_usdt(&markers)));
            store.add_probes(usdt_rows(&markers, clock::wall_ns()))?;
        }
        Ok(())
    }

    /// Stops reading: drains what is left, hands the probes to a thread that detaches them, and
    /// meanwhile finishes the DBs (shadow frees for live blocks, `ms_meta`'s totals).
    fn finish(
        mut self,
        signals: Signals,
        stop_reason: String,
        started: Instant,
        run_dir: PathBuf,
    ) -> anyhow::Result<Finished> {
        self.status.finish();
        note(self.quiet, format!("stopping ({stop_reason})…"));
        // Everything the target did before we stopped is in the ring already.
        self.drain();
        event_loop::Capturing::check(&mut self)?;
        let stop_wall = clock::wall_ns();
        let lost_per_cpu = self.tracer.lost_per_cpu().unwrap_or_default();
        let lost: u64 = lost_per_cpu.iter().sum();
        let bpf_log = self.bpf_log.as_ref().map(|(_, counts)| counts.get());
        // Its last readings, then the helper goes.
        let _ = self.driver_readings();
        let driver_meta = self.driver.meta();
        let Self { tracer, consumer, recorder, skipped, driver, .. } = self;
        drop(driver);
        // From here on nothing is read from the probes: they detach while the DBs are finished.
        let detaching = Detaching::start(tracer, signals);

        let mut recorder = recorder;
        recorder.finish_py_trace();
        let py_samples = recorder.py_trace.as_ref().map(|b| b.samples);
        let Recorder { mut tracker, mut store, calls, markers, .. } = recorder;
        // Taken before the shadow frees below, which are not the program's own.
        let mut devices = device_lines(&tracker);
        let pools = pool_lines(&tracker);
        store.stopping()?;
        tracker.finish(stop_wall, |output| {
            store.write_output(&output, (memscope_core::stacks::NO_STACK, memscope_core::stacks::NO_STACK))
        })?;
        let undecodable = consumer.stats.undecodable;
        let stacks = consumer.stack_stats();
        let mut final_meta: Meta = vec![
            ("stop_ns".into(), stop_wall.to_string()),
            ("stop_reason".into(), stop_reason.clone()),
            ("calls_recorded".into(), calls.to_string()),
            ("markers_recorded".into(), markers.to_string()),
            ("records_lost".into(), lost.to_string()),
            ("records_undecodable".into(), undecodable.to_string()),
        ];
        final_meta.extend(stack_meta(&stacks, bpf_log, self.quiet));
        final_meta.extend(driver_meta);
        if let Some(samples) = py_samples {
            final_meta.push(("python_trace_samples".into(), samples.to_string()));
        }
        let late = self.late_libraries.clone();
        if !self.probed_at_start && late.is_empty() {
            crate::terminal::say::say!(
                "memscope-bpf: warning: the job loaded no accelerator library the tracer knows: nothing was probed \
                 (name the runtime with --lib if it has another name)"
            );
        }
        let final_meta: Meta = final_meta.into_iter().chain(crate::session::summary::loss_meta(lost, &late)).collect();
        let written = store.finish(stop_wall, final_meta, lost_per_cpu)?;
        if written.is_empty() {
            let _ = std::fs::remove_dir(&run_dir);
        }
        for line in &mut devices {
            line.file = written.iter().find(|w| w.device == line.device).map(|w| w.path.clone());
        }
        for note in written.iter().filter_map(|w| w.note.as_deref()) {
            crate::terminal::say::say!("memscope-bpf: warning: {note}");
        }
        let elapsed = started.elapsed();
        let summary = Summary {
            stop_reason,
            elapsed,
            calls,
            lost,
            undecodable,
            run_dir,
            devices,
            pools,
            skipped_libraries: skipped,
            target_status: self.target_status,
            launched: self.launched,
            late_libraries: late,
        };
        Ok(Finished { summary, detaching })
    }
}

/// A trace in the one loop: one target and the children it forks, each loaded library probed
/// as the dynamic linker reports it (and every [`RESCAN_EVERY`] besides), stopped by SIGHUP and
/// by the end of the last traced process.
impl event_loop::Capturing for Live {
    fn wakeup(&self) -> impl std::future::Future<Output = ()> + '_ {
        self.consumer.woken()
    }

    fn drain(&mut self) {
        Live::drain(self);
    }

    fn woken(&mut self) -> anyhow::Result<()> {
        if std::mem::take(&mut self.loads_reported) {
            self.rescan()?;
        }
        Ok(())
    }

    fn publish(&mut self) {
        self.publish_metrics();
    }

    fn commit(&mut self) -> anyhow::Result<()> {
        Ok(self.recorder.store.commit()?)
    }

    fn tick(&mut self) -> anyhow::Result<Option<String>> {
        if self.status_every.due() && self.status.shown() {
            self.renew_status();
        }
        if self.ending.check_due() {
            if let Some(reason) = self.ending.check(&self.still_traced()) {
                return Ok(Some(reason));
            }
        }
        if self.rescan_every.due() || std::mem::take(&mut self.loads_reported) {
            self.rescan()?;
        }
        self.driver_readings()?;
        Ok(None)
    }

    fn hangup(&mut self) -> Option<String> {
        Some(HANGUP.to_owned())
    }

    fn awaits_target(&self) -> bool {
        !self.ending.target_gone()
    }

    fn target_exited(&mut self, (reason, status): event_loop::TargetExit) -> Option<String> {
        self.target_status = status;
        // Its children are in the kernel's traced set already; drain so that their fork
        // records reach the model and the rescan before the rest is traced alone.
        Live::drain(self);
        match self.ending.target_exited(reason, &self.still_traced()) {
            Ok(reason) => Some(reason),
            Err(waiting) => {
                note(self.quiet, waiting);
                None
            }
        }
    }

    /// The first write error, which ends the trace.
    fn check(&mut self) -> anyhow::Result<()> {
        self.recorder.error.take().map_or(Ok(()), |e| Err(e.into()))
    }
}
