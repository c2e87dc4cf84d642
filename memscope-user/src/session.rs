//! One trace, from loading the probes to the closed DBs.
//!
//! The loop drains the ring buffer (on wakeup and on a 20 ms timer), feeds each event to the
//! model and each resulting fact to the store, commits at least every second, and looks for newly
//! loaded libraries every 250 ms. It stops on Ctrl-C, SIGTERM, SIGHUP, `--duration` or when the
//! last traced process has exited (the target, then the children it forked: [`procs`]), then
//! drains what is left, hands the probes to a thread that detaches them (slow in the kernel, see
//! `stop`), and meanwhile writes shadow frees for live blocks and closes every file: the DBs are
//! complete before the detaching is.

use std::collections::BTreeSet;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use aya_log::EbpfLogger;

use anyhow::Context as _;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::oneshot;

use crate::attach::libs::{self, Library};
use crate::attach::loader::AttachError;
use crate::attach::loader::LoadOptions;
use crate::attach::{AttachedProbe, AttachedUsdt, ProbeSet, Tracer};
use crate::clock::{self, Clock};
use crate::launch::{self, Launched};
use crate::model::Tracker;
use crate::procs;
use crate::record::bpf_log::{BpfLog, BpfLogCounts, BpfLogLevel};
use crate::record::ring::Consumer;
use crate::recorder::Recorder;
use crate::say::say;
use crate::stacks::capture::CaptureStats;
use crate::stacks::spec::{StackOptions, Unwind};
use crate::stop::{Detaching, Signals};
use crate::store::{Format, Meta, ProbeRow, RunLayout, Store, Writer};
use crate::summary::{DeviceLine, PoolLine, SkippedLibrary, Summary};

const DRAIN_EVERY: Duration = Duration::from_millis(20);
const COMMIT_EVERY: Duration = Duration::from_secs(1);
const RESCAN_EVERY: Duration = Duration::from_millis(250);
/// The consumer wakes up early once this much is waiting.
const WAKEUP_FRACTION: u64 = 4;

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
    pub output: PathBuf,
    pub duration: Option<Duration>,
    pub format: Format,
    pub probe_set: ProbeSet,
    pub ring_bytes: u32,
    pub quiet: bool,
    /// Trace the processes the target forks too, and stop when the last traced process exits.
    pub follow: bool,
    /// Report nothing until the program starts collection (markers `start()`).
    pub wait_for_start: bool,
    /// `--call-stack`, `--unwind`, `--stack-window`.
    pub stacks: StackOptions,
    /// `--bpf-log`: what the probes tell of their own trouble.
    pub bpf_log: Option<BpfLogLevel>,
}

/// Environment variables that set the allocators' behaviour, stored as `env.<NAME>` in
/// `ms_meta` so the advisor can say what the job ran with (and what to change).
const ALLOCATOR_ENV: &[&str] = &[
    "PYTORCH_NPU_ALLOC_CONF",
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
    "MULTI_STREAM_MEMORY_REUSE",
    "ATB_WORKSPACE_MEM_ALLOC_ALG_TYPE",
    "ATB_WORKSPACE_MEM_ALLOC_GLOBAL",
    "TASK_QUEUE_ENABLE",
    "HCCL_BUFFSIZE",
];

/// The target's allocator settings, from its environment at attach (launch: the environment it
/// inherits from us). Absent variables are stored as absent, so "unset" stays distinguishable.
fn allocator_env(pid: u32) -> Vec<(String, String)> {
    let env = libs::process_env(pid).unwrap_or_default();
    ALLOCATOR_ENV.iter().filter_map(|k| env.get(*k).map(|v| (format!("env.{k}"), v.clone()))).collect()
}

fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease").map(|s| s.trim().to_owned()).unwrap_or_default()
}

fn command_line(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|raw| {
            raw.split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default()
}

fn probe_rows(probes: &[AttachedProbe], at: u64) -> Vec<ProbeRow> {
    probes
        .iter()
        .map(|p| ProbeRow {
            library: p.library.clone(),
            symbol: p.symbol.clone(),
            api: p.api.name().to_owned(),
            file_offset: p.file_offset,
            source: p.source.as_str().to_owned(),
            attached_wall_ns: at,
        })
        .collect()
}

fn usdt_rows(sites: &[AttachedUsdt], at: u64) -> Vec<ProbeRow> {
    sites
        .iter()
        .map(|s| ProbeRow {
            library: s.library.clone(),
            symbol: s.probe.clone(),
            api: "usdt".to_owned(),
            file_offset: s.file_offset,
            source: match s.semaphore_offset {
                Some(sem) => format!("stapsdt note, semaphore at file offset {sem:#x}"),
                None => "stapsdt note".to_owned(),
            },
            attached_wall_ns: at,
        })
        .collect()
}

/// Attaches the marker sites of `libs`; a library whose notes cannot be used is reported and
/// skipped (the allocation probes matter more than the markers).
fn attach_markers(tracer: &mut Tracer, libs: &[Library], quiet: bool) -> Vec<AttachedUsdt> {
    let mut attached = Vec::new();
    if !crate::attach::perf_uprobe::ref_ctr_supported() {
        // Our markers only fire when their semaphore is raised, which needs the kernel's
        // reference counter; attaching without it would look live and see nothing.
        if libs.iter().any(|l| libs::is_markers_module(&l.path)) {
            note(quiet, "warning: this kernel has no uprobe ref_ctr_offset (Linux >= 4.20): markers are not traced");
        }
        return attached;
    }
    for lib in libs {
        match tracer.attach_usdt(lib) {
            Ok((sites, skipped)) => {
                attached.extend(sites);
                for why in skipped {
                    note(quiet, format!("warning: marker site skipped: {why}"));
                }
            }
            Err(e) => note(
                quiet,
                format!("warning: markers in {} are not traced: {}", lib.shown, crate::attach::with_causes(&e)),
            ),
        }
    }
    attached
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
async fn target_exit(target_pid: u32, waiter: Option<oneshot::Receiver<std::io::Result<i32>>>) -> String {
    if let Some(rx) = waiter {
        return match rx.await {
            Ok(Ok(code)) => format!("target exited with status {code}"),
            _ => "target exited".to_owned(),
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
            return "target exited".to_owned();
        }
    }
    // No pidfd (kernel < 5.3): poll.
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        // SAFETY: signal 0 only checks existence.
        if unsafe { libc::kill(target_pid as i32, 0) } != 0
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
        {
            return "target exited".to_owned();
        }
    }
}

fn note(quiet: bool, msg: impl AsRef<str>) {
    if !quiet {
        say!("memscope-bpf: {}", msg.as_ref());
    }
}

fn describe_marker_libraries(sites: &[AttachedUsdt]) -> String {
    let libs: BTreeSet<&str> = sites.iter().map(|p| p.library.as_str()).collect();
    libs.into_iter().collect::<Vec<_>>().join(", ")
}

fn describe_libraries(probes: &[AttachedProbe]) -> String {
    let libs: BTreeSet<&str> = probes.iter().map(|p| p.library.as_str()).collect();
    libs.into_iter().collect::<Vec<_>>().join(", ")
}

/// Attaches newly mapped libraries of the traced processes; returns the new probes and marker
/// sites. The markers go last: a program's `wait_for_tracer()` returns as soon as their
/// semaphores rise, and by then every library it had mapped must be probed too. A library that
/// cannot be probed (not an ELF file, replaced or gone since the maps were read) is a warning,
/// added to `skipped` and to `ms_meta`; tracing goes on with the others. Only a process that
/// ended between its maps read and the attach is no warning.
fn rescan(
    tracer: &mut Tracer,
    pids: impl Iterator<Item = u32>,
    set: ProbeSet,
    quiet: bool,
    skipped: &mut Vec<SkippedLibrary>,
    store: &mut Writer,
) -> anyhow::Result<(Vec<AttachedProbe>, Vec<AttachedUsdt>)> {
    let mut added = Vec::new();
    let mut found = Vec::new();
    let before = skipped.len();
    for pid in pids {
        for lib in libs::from_maps(pid).unwrap_or_default() {
            if tracer.is_attached(&lib) {
                continue;
            }
            match tracer.attach(&lib, set) {
                Ok(probes) => {
                    added.extend(probes);
                    found.push(lib);
                }
                // A process that ended meanwhile takes its view of the files (`/proc/PID/root`)
                // with it: nothing is wrong with the library, which is tried again if another
                // traced process maps it.
                Err(_) if std::fs::metadata(format!("/proc/{pid}/root")).is_err() => {}
                Err(e) => skipped.push(skip(quiet, &lib, &e)),
            }
        }
    }
    if skipped.len() > before {
        store.set_meta(skipped_meta(skipped))?;
    }
    let markers = attach_markers(tracer, &found, quiet);
    Ok((added, markers))
}

/// Warns about a library that cannot be probed; the warning names the file and why.
fn skip(quiet: bool, lib: &Library, e: &AttachError) -> SkippedLibrary {
    let reason = crate::attach::with_causes(e);
    note(quiet, format!("warning: {} is not traced: {reason}", lib.shown));
    SkippedLibrary { library: lib.shown.clone(), reason }
}

/// `ms_meta.libraries_skipped` (how many) and `ms_meta.skipped_libraries` (a JSON array of
/// `{"library", "reason"}`).
fn skipped_meta(skipped: &[SkippedLibrary]) -> Meta {
    let list: Vec<serde_json::Value> =
        skipped.iter().map(|s| serde_json::json!({ "library": s.library, "reason": s.reason })).collect();
    vec![
        ("libraries_skipped".into(), skipped.len().to_string()),
        ("skipped_libraries".into(), serde_json::Value::Array(list).to_string()),
    ]
}

/// The error when no library could be probed at start: the ones without the API, and why each
/// unusable one was refused.
fn nothing_to_probe(libraries: &[Library], skipped: &[SkippedLibrary]) -> anyhow::Error {
    let refused: Vec<String> = skipped.iter().map(|s| format!("{} ({})", s.library, s.reason)).collect();
    let usable: Vec<&str> =
        libraries.iter().map(|l| l.shown.as_str()).filter(|l| !skipped.iter().any(|s| s.library == *l)).collect();
    let mut text = String::new();
    if !usable.is_empty() {
        text = format!("none of {} exports the ACL memory API (aclrtMalloc, aclrtFree, ...)", usable.join(", "));
    }
    if !refused.is_empty() {
        let sep = if text.is_empty() { "" } else { "; " };
        text = format!("{text}{sep}no usable library: {}", refused.join("; "));
    }
    anyhow::anyhow!("{text}; pass --lib with the right library")
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
        output,
        duration,
        format,
        probe_set,
        ring_bytes,
        quiet,
        follow,
        wait_for_start,
        stacks,
        bpf_log,
    } = plan;
    let pid = target.pid();
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
    let Attached { probes, markers, skipped } = attach_all(&mut tracer, &libraries, probe_set, quiet)?;

    let layout = RunLayout::create(&output, pid, (start_wall / 1_000_000_000) as i64)?;
    let command = command.unwrap_or_else(|| command_line(pid));
    let mut meta: Meta = vec![
        ("tool".into(), "memscope-bpf".into()),
        ("tool_version".into(), env!("CARGO_PKG_VERSION").into()),
        ("kernel".into(), kernel_release()),
        ("mode".into(), if launch_mode { "launch" } else { "attach" }.into()),
        ("target_pid".into(), pid.to_string()),
        ("command".into(), command),
        ("start_ns".into(), start_wall.to_string()),
        ("clock".into(), format!("CLOCK_MONOTONIC + {} ns offset measured at start", clock.offset().as_nanos())),
        ("ring_bytes".into(), ring_bytes.to_string()),
        ("format".into(), format!("{format:?}").to_lowercase()),
        ("probe_links".into(), tracer.link_kind()),
    ];
    meta.extend(allocator_env(pid));
    if !skipped.is_empty() {
        meta.extend(skipped_meta(&skipped));
    }
    let run_dir = layout.root().to_owned();
    if let Some(depth) = stacks.call.c {
        meta.push(("call_stack_c".into(), depth.to_string()));
        let unwind = match stacks.unwind {
            Unwind::Fp => "fp".to_owned(),
            Unwind::Dwarf => format!("dwarf (window {} bytes)", stacks.window),
        };
        meta.push(("unwind".into(), unwind));
    }
    let mut store = Store::new(layout, format, start_wall, meta);
    store.debug_dirs = debug_dirs.clone();
    let mut store = Writer::start(store);
    store.add_probes(probe_rows(&probes, start_wall))?;
    store.add_probes(usdt_rows(&markers, start_wall))?;

    let mut consumer = Consumer::new(tracer.take_ring()?, clock).context("cannot map the ring buffer")?;
    consumer.set_stack_depth(stacks.call.native_depth());
    consumer.set_debug_dirs(debug_dirs.clone());
    // SAFETY: the ring's descriptor belongs to `consumer`, which outlives `ring_fd`: both go into
    // `Live`, where `ring_fd` is declared first and so dropped first (and `finish` drops it
    // before `consumer`).
    let ring_fd = unsafe {
        AsyncFd::register_with_interest(std::os::fd::AsRawFd::as_raw_fd(consumer.ring()), Interest::READABLE)
    }
    .map_err(|e| e.into_parts().1)
    .context("cannot poll the ring buffer")?;

    announce(&probes, &markers, libraries.len(), pid, follow, launch_mode, quiet);
    let waiter = release(&mut target)?;

    let tracker = if wait_for_start { Tracker::paused_until_start() } else { Tracker::new() };
    let python = stacks.call.python.map(|_| BTreeSet::new());
    let mut live = Live {
        pid,
        probe_set,
        quiet,
        tracer,
        ring_fd,
        consumer,
        recorder: Recorder::new(tracker, store),
        skipped,
        python,
        bpf_log,
    };
    live.find_pythons()?;
    let mut signals = Signals::new()?;
    let stop_reason = live.trace(&mut signals, duration, waiter).await?;
    live.finish(signals, stop_reason, started, run_dir)
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
        wakeup_bytes: u64::from(ring_bytes) / WAKEUP_FRACTION,
        follow_forks: follow,
        debug_dirs,
        stack_depth: stacks.kernel_depth(),
        stack_window: stacks.window_bytes(),
        python_depth: stacks.python_depth(),
        bpf_log,
    };
    // A child's uprobes hit in its own address space: following children means probing every
    // process and filtering by the traced set in the kernel, as launch mode always does.
    let scope_pid = (!launch_mode && !follow).then_some(pid);
    let mut tracer = Tracer::load(&opts, pid, scope_pid).context("cannot load the eBPF programs")?;
    tracer.trace_process(pid).context("cannot register the target process")?;
    Ok(tracer)
}

/// What the start's attach found: the API probes, the marker sites and the libraries refused.
struct Attached {
    probes: Vec<AttachedProbe>,
    markers: Vec<AttachedUsdt>,
    skipped: Vec<SkippedLibrary>,
}

/// Attaches the libraries given at start. One unusable file among the candidates is a warning;
/// none usable is the error.
fn attach_all(tracer: &mut Tracer, libraries: &[Library], set: ProbeSet, quiet: bool) -> anyhow::Result<Attached> {
    let mut probes = Vec::new();
    let mut skipped = Vec::new();
    let mut usable = Vec::new();
    for lib in libraries {
        match tracer.attach(lib, set) {
            Ok(attached) => {
                probes.extend(attached);
                usable.push(lib.clone());
            }
            Err(e) => skipped.push(skip(quiet, lib, &e)),
        }
    }
    let markers = attach_markers(tracer, &usable, quiet);
    if probes.is_empty() {
        return Err(nothing_to_probe(libraries, &skipped));
    }
    Ok(Attached { probes, markers, skipped })
}

/// The "live" line: what is probed and which processes are traced.
fn announce(
    probes: &[AttachedProbe],
    markers: &[AttachedUsdt],
    libraries: usize,
    pid: u32,
    follow: bool,
    launch_mode: bool,
    quiet: bool,
) {
    say!(
        "memscope-bpf: live: {} probes on {} ({}); tracing pid {pid}{}",
        probes.len(),
        if libraries == 1 { "1 library".to_owned() } else { format!("{libraries} libraries") },
        describe_libraries(probes),
        match (follow, launch_mode) {
            (true, true) => " and its children".to_owned(),
            (true, false) => format!(" and the children it forks from now on (--no-follow traces pid {pid} alone)"),
            (false, _) => String::new(),
        },
    );
    if !markers.is_empty() {
        note(quiet, format!("markers: {} USDT sites in {}", markers.len(), describe_marker_libraries(markers)));
    }
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
    /// Declared before `consumer`, whose descriptor it polls, so that it is dropped first.
    ring_fd: AsyncFd<std::os::fd::RawFd>,
    consumer: Consumer,
    recorder: Recorder,
    skipped: Vec<SkippedLibrary>,
    /// `--call-stack python`: the processes whose interpreter was looked for (found or not).
    python: Option<BTreeSet<u32>>,
    /// `--bpf-log`: the probes' messages, read on every drain, and their counts.
    bpf_log: Option<(EbpfLogger<BpfLog>, Arc<BpfLogCounts>)>,
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
            match crate::stacks::python::find(pid) {
                Ok(None) => continue,
                Ok(Some(py)) => {
                    let process = memscope_common::python::PyProcess { runtime: py.runtime, offsets: py.walk };
                    self.tracer.set_python(pid, process).context("cannot register the Python interpreter")?;
                    self.consumer.set_python(pid, py.layout);
                    note(
                        self.quiet,
                        format!("python: CPython 3.{} in process {pid} ({})", py.minor, py.path.display()),
                    );
                }
                Err(e) => note(self.quiet, format!("python: process {pid}: no Python stacks: {e}")),
            }
            seen.insert(pid);
        }
        Ok(())
    }

    /// Feeds every record waiting in the ring to the model and the store.
    fn drain(&mut self) {
        let Self { consumer, recorder, bpf_log, python, .. } = self;
        consumer.drain(|e| recorder.on_event(e));
        // A process that replaced its image has its interpreter, if any, looked for again.
        for pid in consumer.take_execs() {
            if let Some(seen) = python.as_mut() {
                seen.remove(&pid);
            }
        }
        if let Some((logger, _)) = bpf_log {
            logger.flush();
        }
    }

    /// The traced processes other than the target still running ([`still_traced`]).
    fn still_traced(&self) -> Vec<u32> {
        still_traced(&self.tracer, &self.recorder.children, self.pid)
    }

    /// The first write error, which ends the trace.
    fn write_error(&mut self) -> anyhow::Result<()> {
        self.recorder.error.take().map_or(Ok(()), Err)
    }

    /// The loop: drains the ring until a signal, the deadline or the end of the last traced
    /// process; returns why it stopped.
    async fn trace(
        &mut self,
        signals: &mut Signals,
        duration: Option<Duration>,
        waiter: Option<oneshot::Receiver<std::io::Result<i32>>>,
    ) -> anyhow::Result<String> {
        let deadline = async {
            match duration {
                Some(d) => {
                    tokio::time::sleep(d).await;
                    format!("--duration {:.1} s reached", d.as_secs_f64())
                }
                None => std::future::pending().await,
            }
        };
        tokio::pin!(deadline);
        let exited = target_exit(self.pid, waiter);
        tokio::pin!(exited);
        let mut ending = procs::Ending::default();
        let mut drain_tick = tokio::time::interval(DRAIN_EVERY);
        let mut last_commit = Instant::now();
        let mut last_rescan = Instant::now();

        loop {
            tokio::select! {
                reason = signals.next() => return Ok(reason.to_owned()),
                reason = &mut deadline => return Ok(reason),
                reason = &mut exited, if !ending.target_gone() => {
                    // Its children are in the kernel's traced set already; drain so that their fork
                    // records reach the model and the rescan before the rest is traced alone.
                    self.drain();
                    match ending.target_exited(reason, &self.still_traced()) {
                        Ok(reason) => return Ok(reason),
                        Err(waiting) => note(self.quiet, waiting),
                    }
                }
                guard = self.ring_fd.readable() => {
                    if let Ok(mut guard) = guard {
                        guard.clear_ready();
                    }
                    self.drain();
                }
                _ = drain_tick.tick() => {
                    self.drain();
                    if ending.check_due() {
                        if let Some(reason) = ending.check(&self.still_traced()) {
                            return Ok(reason);
                        }
                    }
                    if last_commit.elapsed() >= COMMIT_EVERY {
                        self.recorder.store.commit()?;
                        last_commit = Instant::now();
                    }
                    if last_rescan.elapsed() >= RESCAN_EVERY {
                        last_rescan = Instant::now();
                        self.rescan()?;
                    }
                }
            }
            self.write_error()?;
        }
    }

    /// Probes the libraries the traced processes mapped since the last look.
    fn rescan(&mut self) -> anyhow::Result<()> {
        self.find_pythons()?;
        let pids = std::iter::once(self.pid).chain(self.recorder.children.iter().copied()).collect::<Vec<_>>();
        let (quiet, store) = (self.quiet, &mut self.recorder.store);
        let (added, markers) =
            rescan(&mut self.tracer, pids.into_iter(), self.probe_set, quiet, &mut self.skipped, store)?;
        if !added.is_empty() {
            let libraries = describe_libraries(&added);
            note(
                quiet,
                format!("attached {} more probes in {libraries} (loaded after the trace started)", added.len()),
            );
            store.add_probes(probe_rows(&added, clock::wall_ns()))?;
        }
        if !markers.is_empty() {
            let libraries = describe_marker_libraries(&markers);
            note(
                quiet,
                format!("markers: {} USDT sites in {libraries} (loaded after the trace started)", markers.len()),
            );
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
        note(self.quiet, format!("stopping ({stop_reason})…"));
        // Everything the target did before we stopped is in the ring already.
        self.drain();
        self.write_error()?;
        let stop_wall = clock::wall_ns();
        let lost_per_cpu = self.tracer.lost_per_cpu().unwrap_or_default();
        let lost: u64 = lost_per_cpu.iter().sum();
        let bpf_log = self.bpf_log.as_ref().map(|(_, counts)| counts.get());
        let Self { tracer, ring_fd, consumer, recorder, skipped, .. } = self;
        drop(ring_fd);
        // From here on nothing is read from the probes: they detach while the DBs are finished.
        let detaching = Detaching::start(tracer, signals);

        let Recorder { mut tracker, mut store, calls, markers, .. } = recorder;
        // Taken before the shadow frees below, which are not the program's own.
        let mut devices = device_lines(&tracker);
        let pools = pool_lines(&tracker);
        store.stopping()?;
        tracker.finish(stop_wall, |output| {
            store.write_output(&output, (crate::stacks::NO_STACK, crate::stacks::NO_STACK))
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
        let final_meta: Meta = final_meta.into_iter().chain(crate::summary::loss_meta(lost)).collect();
        let written = store.finish(stop_wall, final_meta, lost_per_cpu)?;
        if written.is_empty() {
            let _ = std::fs::remove_dir(&run_dir);
        }
        for line in &mut devices {
            line.file = written.iter().find(|w| w.device == line.device).map(|w| w.path.clone());
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
        };
        Ok(Finished { summary, detaching })
    }
}

/// The summary's line of each device, its file still unknown.
/// `ms_meta`'s stack counts, and the summary's lines for them and for `--bpf-log`.
fn stack_meta(stacks: &CaptureStats, bpf_log: Option<(u64, u64)>, quiet: bool) -> Meta {
    let mut meta: Meta = Vec::new();
    if stacks.stacks > 0 {
        meta.extend([
            ("stacks_captured".into(), stacks.stacks.to_string()),
            ("stacks_unique".into(), stacks.unique.to_string()),
            ("stacks_failed".into(), stacks.failed.to_string()),
            ("stack_frames_unmapped".into(), stacks.unknown_frames.to_string()),
        ]);
        note(
            quiet,
            format!(
                "native stacks: {} taken, {} distinct, {} the kernel could not walk, {} frames in no mapped file",
                stacks.stacks, stacks.unique, stacks.failed, stacks.unknown_frames
            ),
        );
    }
    if stacks.py_stacks > 0 {
        meta.extend([
            ("py_stacks_captured".into(), stacks.py_stacks.to_string()),
            ("py_stacks_unique".into(), stacks.py_unique.to_string()),
            ("py_stacks_at_depth".into(), stacks.py_at_depth.to_string()),
            ("py_stacks_no_thread".into(), stacks.py_no_thread.to_string()),
            ("py_stacks_read_failed".into(), stacks.py_read_failed.to_string()),
            ("py_stacks_threads_bound".into(), stacks.py_threads_bound.to_string()),
        ]);
        note(
            quiet,
            format!(
                "Python stacks: {} taken, {} distinct, {} cut at the depth asked for, {} on threads running no Python, \
                 {} with failed reads, {} of threads past the {}-thread bound",
                stacks.py_stacks,
                stacks.py_unique,
                stacks.py_at_depth,
                stacks.py_no_thread,
                stacks.py_read_failed,
                stacks.py_threads_bound,
                memscope_common::python::MAX_PY_THREADS
            ),
        );
    }
    if let Some((warnings, other)) = bpf_log {
        meta.extend([("bpf_log_warnings".into(), warnings.to_string()), ("bpf_log_other".into(), other.to_string())]);
        note(quiet, format!("bpf log: {warnings} warnings, {other} other messages from the probes"));
    }
    meta
}

fn device_lines(tracker: &Tracker) -> Vec<DeviceLine> {
    tracker
        .devices()
        .map(|(device, s)| DeviceLine {
            device,
            peak: s.peak,
            live_bytes: s.used,
            live_blocks: s.live_blocks,
            mallocs: s.mallocs,
            frees: s.frees,
            untracked_frees: s.untracked_frees,
            failures: s.failures,
            file: None,
        })
        .collect()
}

/// The summary's line of each caching pool.
fn pool_lines(tracker: &Tracker) -> Vec<PoolLine> {
    tracker
        .pools()
        .map(|((device, pool, pid), s)| PoolLine {
            device,
            pid,
            pool: pool.as_str(),
            peak_used: s.peak_used,
            peak_total: s.peak_total,
            used: s.used,
            total: s.total,
            live_blocks: s.live_blocks,
        })
        .collect()
}
