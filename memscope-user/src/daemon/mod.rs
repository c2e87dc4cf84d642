//! `memscope-bpf daemon`: every accelerator process on the node traced at once, for as long as
//! the daemon runs, each in a run folder of its own ([`jobs`]), with their totals served for
//! Prometheus.
//!
//! The probes go on library files, for every process ([`discover`]); the kernel admits a
//! process at its first probed call unless the filters deny it ([`rules`],
//! `memscope_common::filter`), so there is no per-process attach and no window between a job's
//! start and its tracing. One ring carries every job's records; the loop hands each to its
//! process's job, commits every job's rows every second (a daemon killed outright leaves DBs
//! that open), looks for library files not probed yet in the processes the kernel says just
//! started or loaded objects ([`discover`]), renews the metrics every
//! 0.5 s, and finishes a job when its process exits. SIGINT and SIGTERM finish every open job
//! and stop; SIGHUP applies the name filters again to the processes running then.

pub mod discover;
pub mod jobs;
pub mod retention;
pub mod rules;

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use crate::attach::libs::Library;
use crate::attach::loader::{Admission, LoadOptions, Sampling};
use crate::attach::{LinkerHook, ProbeSet, Tracer};
use crate::clock::{self, Clock};
use crate::metrics::{self, Published, Snapshot};
use crate::record::ring::Consumer;
use crate::say::{note, say};
use crate::session::attaching::{attach_found, describe_libraries, describe_marker_libraries, probe_rows, usdt_rows};
use crate::stop::{self, Detaching, Every, Signals};
use crate::store::{Format, ProbeRow};
use crate::summary::SkippedLibrary;

use discover::Discovery;
use jobs::{Context, Jobs, Outcome};

const DRAIN_EVERY: Duration = Duration::from_millis(20);
const PUBLISH_EVERY: Duration = Duration::from_millis(500);
const COMMIT_EVERY: Duration = Duration::from_secs(1);
/// How often `--max-db` and `--retention` are applied (and whenever a job ends).
const SWEEP_EVERY: Duration = Duration::from_secs(10);
/// The consumer wakes up early once this much of the ring is waiting.
const WAKEUP_FRACTION: u64 = 4;

pub struct Plan {
    /// `--lib` and the runtime folders of the daemon's own environment: probed at the start.
    pub libraries: Vec<Library>,
    pub output: PathBuf,
    pub duration: Option<Duration>,
    pub format: Format,
    pub probe_set: ProbeSet,
    pub ring_bytes: u32,
    pub quiet: bool,
    pub listen: SocketAddr,
    pub admission: Admission,
    /// `--exclude-pid`.
    pub exclude_pids: Vec<u32>,
    /// `--max-db`, `--retention`.
    pub limits: retention::Limits,
    /// `--sample-bytes`, `--max-blocks` (`None`: every call recorded).
    pub sampling: Option<Sampling>,
    /// `--warmup-steps`, `--step-marker`, `--step-window`.
    pub live: memscope_core::analysis::live::Options,
    /// `--owner-labels`.
    pub owner_labels: usize,
}

/// What the daemon did, once it stopped (its probes still being detached).
pub struct Stopped {
    pub reason: String,
    pub jobs: u64,
    pub calls: u64,
    pub lost: u64,
    pub detaching: Detaching,
}

/// Runs the daemon until a stop signal or `--duration`.
pub async fn run(plan: Plan) -> anyhow::Result<Stopped> {
    // Before anything is attached: a port in use fails the daemon at once.
    let metrics = metrics::serve(plan.listen, plan.quiet).await?;
    let clock = Clock::calibrate();
    let opts = LoadOptions {
        ring_bytes: plan.ring_bytes,
        wakeup_bytes: u64::from(plan.ring_bytes) / WAKEUP_FRACTION,
        follow_forks: false,
        debug_dirs: Vec::new(),
        stack_depth: 0,
        stack_window: 0,
        python_depth: 0,
        bpf_log: None,
        admission: Some(plan.admission.clone()),
        sampling: plan.sampling,
    };
    // No target (pid 0 is never a process's tgid): the kernel admits processes by the rules.
    let mut tracer = Tracer::load(&opts, 0, None).context("cannot load the eBPF programs")?;
    let denied = deny(&mut tracer, &plan)?;
    let mut consumer = Consumer::new(tracer.take_ring()?, clock).context("cannot map the ring buffer")?;
    consumer.set_sample_bytes(plan.sampling.map_or(0, |s| s.interval));
    // SAFETY: the ring's descriptor belongs to `consumer`; `Daemon` declares `ring_fd` first, so
    // it is dropped first, and `stop` drops it before anything else.
    let ring_fd = unsafe { AsyncFd::register_with_interest(consumer.ring().as_raw_fd(), Interest::READABLE) }
        .map_err(|e| e.into_parts().1)
        .context("cannot poll the ring buffer")?;
    let cx = Context {
        output: plan.output.clone(),
        format: plan.format,
        clock,
        ring_bytes: plan.ring_bytes,
        probe_links: tracer.link_kind(),
        sample_bytes: plan.sampling.map_or(0, |s| s.interval),
        live: plan.live.clone(),
        owner_labels: plan.owner_labels,
    };
    let mut daemon = Daemon {
        ring_fd,
        consumer,
        tracer,
        metrics,
        cx,
        jobs: Jobs::default(),
        probes: Vec::new(),
        skipped: Vec::new(),
        discovery: Discovery::default(),
        plan,
        ended: 0,
        ended_calls: 0,
        over_cap: false,
        swept_at: 0,
    };
    let start: Vec<(Option<u32>, Library)> = daemon.plan.libraries.iter().map(|l| (None, l.clone())).collect();
    daemon.attach(start, "given at the start");
    daemon.scan();
    daemon.sweep();
    daemon.announce(denied);
    let mut signals = Signals::new()?;
    let reason = daemon.watch(&mut signals).await;
    Ok(daemon.stop(reason, signals))
}

/// `--exclude-pid`, and the running processes the name rules deny (the kernel judges
/// names at exec only). Returns how many were denied.
fn deny(tracer: &mut Tracer, plan: &Plan) -> anyhow::Result<usize> {
    let mut pids = plan.exclude_pids.clone();
    pids.extend(rules::running_denied(&plan.admission));
    pids.sort_unstable();
    pids.dedup();
    for pid in &pids {
        tracer.deny_process(*pid).with_context(|| format!("cannot exclude process {pid}"))?;
    }
    Ok(pids.len())
}

/// A running daemon.
struct Daemon {
    /// Declared before `consumer`, whose descriptor it polls, so that it is dropped first.
    ring_fd: AsyncFd<std::os::fd::RawFd>,
    consumer: Consumer,
    tracer: Tracer,
    metrics: Published,
    cx: Context,
    jobs: Jobs,
    /// Every probe and marker site attached so far: each new job's `ms_probes`.
    probes: Vec<ProbeRow>,
    skipped: Vec<SkippedLibrary>,
    discovery: Discovery,
    plan: Plan,
    /// Jobs finished so far, and the calls they recorded.
    ended: u64,
    ended_calls: u64,
    /// Running jobs alone were over `--max-db` at the last sweep (warned once per crossing).
    over_cap: bool,
    /// [`Self::ended`] at the last sweep: a job that ended since is swept for at once.
    swept_at: u64,
}

impl Daemon {
    /// Probes library files not probed yet; new probes go into every open job's `ms_probes`.
    fn attach(&mut self, libs: Vec<(Option<u32>, Library)>, found: &str) {
        let quiet = self.plan.quiet;
        let (added, markers) = attach_found(&mut self.tracer, libs, self.plan.probe_set, quiet, &mut self.skipped);
        let now = clock::wall_ns();
        let mut rows = probe_rows(&added, now);
        rows.extend(usdt_rows(&markers, now));
        if rows.is_empty() {
            return;
        }
        if !added.is_empty() {
            note(quiet, format!("probed {} functions in {} ({found})", added.len(), describe_libraries(&added)));
        }
        if !markers.is_empty() {
            note(quiet, format!("markers: {} USDT sites in {}", markers.len(), describe_marker_libraries(&markers)));
        }
        if let Err(e) = self.jobs.add_probes(&rows) {
            say!("memscope-bpf: warning: the new probes are not listed in the open jobs' ms_probes: {e:#}");
        }
        self.probes.extend(rows);
    }

    /// Looks at the processes due a look (reported by the kernel since the last call, or due
    /// by the clock) for library files not probed yet; hooks their dynamic linker first.
    fn scan(&mut self) {
        let mut reported = self.consumer.take_execs();
        reported.extend(self.consumer.take_loads());
        let now = std::time::Instant::now();
        let due = self.discovery.due(reported, now);
        let mut found: Vec<(Option<u32>, Library)> = Vec::new();
        for pid in due {
            self.hook_linker(pid, now);
            let tracer = &self.tracer;
            found.extend(discover::libraries_of(pid, |l| tracer.is_attached(l)));
        }
        if !found.is_empty() {
            found.sort_by_key(|(_, l)| l.file_id);
            found.dedup_by_key(|(_, l)| l.file_id);
            self.attach(found, "mapped or named by a running process");
        }
    }

    /// Hooks the dynamic linker `pid` runs with, unless it was before; a process whose linker
    /// cannot be hooked is polled while young instead.
    fn hook_linker(&mut self, pid: u32, now: std::time::Instant) {
        // A static program, or one gone: nothing it maps later to hear of.
        let Some(ld) = crate::attach::linker::of_process(pid) else { return };
        match self.tracer.hook_linker(&ld) {
            Ok(LinkerHook::Added) => {
                note(self.plan.quiet, format!("watching the libraries loaded through {} (process {pid})", ld.shown));
            }
            Ok(LinkerHook::Known) => {}
            Ok(LinkerHook::Refused) => self.discovery.unhooked(pid, now),
            Err(e) => {
                say!(
                    "memscope-bpf: warning: {}; its processes are looked at every second instead",
                    crate::attach::with_causes(&e)
                );
                self.discovery.unhooked(pid, now);
            }
        }
    }

    fn announce(&self, denied: usize) {
        let plan = &self.plan;
        let files = self.probes.iter().map(|p| p.library.as_str()).collect::<std::collections::BTreeSet<_>>().len();
        let mut filters = Vec::new();
        let admission = &plan.admission;
        if !admission.allow_pids.is_empty() {
            filters.push(format!("{} process(es) given and their children", admission.allow_pids.len()));
        }
        if !admission.cgroups.is_empty() {
            filters.push(format!("inside {} cgroup(s) given", admission.cgroups.len()));
        }
        if !admission.deny_cgroups.is_empty() {
            filters.push(format!("outside {} cgroup(s) excluded", admission.deny_cgroups.len()));
        }
        if !plan.admission.allow_comms.is_empty() {
            filters.push(format!("{} name(s) allowed", plan.admission.allow_comms.len()));
        }
        if plan.admission.has_name_rules() || denied > 0 {
            filters.push(format!(
                "{} name(s) excluded, {denied} running process(es) denied",
                plan.admission.deny_comms.len()
            ));
        }
        let filters = if filters.is_empty() { String::new() } else { format!(" ({})", filters.join("; ")) };
        say!(
            "memscope-bpf: live: daemon: {} probes on {files} library file(s), {} dynamic linker(s) watched; tracing every process that calls them{filters}; jobs go to {}",
            self.probes.len(),
            self.tracer.linkers_hooked(),
            jobs::describe_output(&plan.output),
        );
        if files == 0 {
            note(plan.quiet, "no runtime library found yet: looking at each program started and each library loaded");
        }
    }

    /// The loop, until a stop signal or `--duration`; returns why it stopped.
    async fn watch(&mut self, signals: &mut Signals) -> String {
        let deadline = stop::deadline(self.plan.duration);
        tokio::pin!(deadline);
        let mut tick = tokio::time::interval(DRAIN_EVERY);
        let (mut publish, mut commit) = (Every::new(PUBLISH_EVERY), Every::new(COMMIT_EVERY));
        let mut sweep = Every::new(SWEEP_EVERY);
        loop {
            tokio::select! {
                stop = signals.next_or_hangup() => match stop {
                    Some(reason) => return reason.to_owned(),
                    None => self.reapply_names(),
                },
                reason = &mut deadline => return reason,
                guard = self.ring_fd.readable() => {
                    if let Ok(mut guard) = guard {
                        guard.clear_ready();
                    }
                    self.drain();
                    self.scan();
                }
                _ = tick.tick() => {
                    self.drain();
                    self.scan();
                    if publish.due() {
                        self.publish();
                    }
                    if commit.due() {
                        self.commit();
                    }
                    if sweep.due() || self.swept_at < self.ended {
                        sweep.ran();
                        self.sweep();
                    }
                }
            }
        }
    }

    /// SIGHUP: the running processes whose name the name rules deny now (one that renamed
    /// itself since its exec) are denied too, and their open jobs finished.
    fn reapply_names(&mut self) {
        let pids = rules::running_denied(&self.plan.admission);
        for pid in &pids {
            if let Err(e) = self.tracer.deny_process(*pid) {
                say!("memscope-bpf: warning: cannot exclude process {pid}: {e}");
                continue;
            }
            if self.jobs.pids().contains(pid) {
                // What it did before is kept: its job is finished as if it had exited.
                self.drain();
                let comm = memscope_common::filter::comm_key(crate::metrics::comm_of(*pid).as_bytes());
                let rule = if self.plan.admission.deny_comms.contains(&comm) { "--exclude-comm" } else { "--comm" };
                self.finish(*pid, &format!("excluded by {rule} (on SIGHUP)"));
            }
        }
        note(
            self.plan.quiet,
            format!("SIGHUP: name filters applied again ({} running process(es) denied)", pids.len()),
        );
    }

    /// Hands every record waiting in the ring to its job; finishes the jobs whose process ended.
    fn drain(&mut self) {
        let mut outcomes = Vec::new();
        let Self { consumer, jobs, cx, probes, .. } = self;
        consumer.drain(|e| outcomes.extend(jobs.on_event(e, cx, probes)));
        for (pid, comm, dir) in self.jobs.take_opened() {
            note(self.plan.quiet, format!("job {pid} ({comm}): traced, in {}", dir.display()));
        }
        for outcome in outcomes {
            match outcome {
                Outcome::Exited(pid) => self.finish(pid, "process exited"),
                Outcome::WriteFailed(pid) => self.finish(pid, "write error"),
                Outcome::Failed(pid, e) => say!("memscope-bpf: warning: process {pid} is not recorded: {e:#}"),
            }
        }
    }

    fn finish(&mut self, pid: u32, reason: &str) {
        if self.plan.sampling.is_some() {
            let _ = self.tracer.forget_counters(&std::iter::once(pid).collect());
        }
        let lost = self.tracer.lost_per_cpu().unwrap_or_default();
        match self.jobs.finish(pid, reason, &lost) {
            Ok(ended) => {
                self.ended += 1;
                self.ended_calls += ended.calls;
                note(
                    self.plan.quiet,
                    format!(
                        "job {pid} ({}): {reason}; {} calls recorded in {}",
                        ended.comm,
                        ended.calls,
                        ended.run_dir.display()
                    ),
                );
            }
            Err(e) => say!("memscope-bpf: warning: job {pid}: {e:#}"),
        }
    }

    fn publish(&mut self) {
        let lost = self.tracer.lost_per_cpu().unwrap_or_default().iter().sum();
        let calls = self.ended_calls + self.jobs.calls();
        let mut jobs = self.jobs.totals(clock::wall_ns(), self.cx.owner_labels);
        if self.plan.sampling.is_some() {
            match self.tracer.exact_counters() {
                Ok(counters) => metrics::apply_exact(&mut jobs, &counters),
                Err(e) => say!("memscope-bpf: warning: cannot read the kernel's counters: {e}"),
            }
        }
        self.metrics.publish(Snapshot { jobs, calls, lost, maps: self.tracer.map_memory() });
    }

    /// Commits every job's rows; finishes the jobs whose process is gone without an exit record
    /// (one lost in a full ring).
    fn commit(&mut self) {
        for (pid, e) in self.jobs.commit() {
            say!("memscope-bpf: warning: job {pid}: cannot commit its rows: {e:#}");
        }
        for pid in self.jobs.vanished() {
            self.finish(pid, "process exited (its exit record was lost)");
        }
    }

    /// `--max-db` and `--retention` on OUTPUT's run folders.
    fn sweep(&mut self) {
        self.swept_at = self.ended;
        let limits = self.plan.limits;
        if !limits.any() {
            return;
        }
        let running = self.jobs.run_dirs();
        let swept = retention::sweep(&self.plan.output, &running, limits, std::time::SystemTime::now());
        for (path, why) in &swept.removed {
            note(self.plan.quiet, format!("removed {} ({why})", path.display()));
        }
        if swept.over_cap && !self.over_cap {
            say!(
                "memscope-bpf: warning: the running jobs' folders alone take {} MiB, over --max-db; nothing running is removed",
                swept.bytes >> 20
            );
        }
        self.over_cap = swept.over_cap;
    }

    /// Drains what is left, finishes every open job and starts detaching the probes.
    fn stop(mut self, reason: String, signals: Signals) -> Stopped {
        note(self.plan.quiet, format!("stopping ({reason})…"));
        self.drain();
        let stop_reason = format!("daemon stopped: {reason}");
        for pid in self.jobs.pids() {
            self.finish(pid, &stop_reason);
        }
        let lost = self.tracer.lost_per_cpu().unwrap_or_default().iter().sum();
        let Self { ring_fd, tracer, ended, ended_calls, .. } = self;
        drop(ring_fd);
        Stopped { reason, jobs: ended, calls: ended_calls, lost, detaching: Detaching::start(tracer, signals) }
    }
}
