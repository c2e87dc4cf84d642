//! `memscope-bpf daemon`: every accelerator process on the node traced at once, for as long as
//! the daemon runs, each in a run folder of its own ([`jobs`]), with their totals served for
//! Prometheus.
//!
//! The probes go on library files, for every process ([`discover`]); the kernel admits a
//! process at its first probed call unless the filters deny it ([`rules`],
//! `memscope_common::filter`), so there is no per-process attach and no window between a job's
//! start and its tracing. One ring carries every job's records. The loop is a trace's
//! ([`crate::capture::event_loop`]); at its points the daemon hands each record to its
//! process's job, commits every job's rows every second (a daemon killed outright leaves DBs
//! that open), looks for library files not probed yet in the processes the kernel says just
//! started or loaded objects ([`discover`]), renews the metrics every 0.5 s (and the status on
//! a terminal every second: [`status`]), and finishes a job when its process exits. SIGINT and
//! SIGTERM finish every open job and stop; SIGHUP applies the name filters again to the
//! processes running then.

pub mod discover;
pub mod filters;
pub mod flight;
pub mod jobs;
pub mod judge;
pub mod retention;
pub mod rules;
mod status;
pub mod windows;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use memscope_core::ingest::clock::{self, Clock};
use memscope_core::printable::printable;
use memscope_core::store::ProbeRow;

use crate::attach::libs::Library;
use crate::attach::loader::{Admission, LoadOptions, Sampling};
use crate::attach::{LinkerHook, Tracer};
use crate::capture::attaching::{
    attach_found, describe_libraries, describe_usdt, probe_rows, usdt_rows, SkippedLibrary,
};
use crate::capture::ring::Consumer;
use crate::capture::stop::{Detaching, Every, Signals};
use crate::capture::{self, event_loop};
use crate::metrics::{self, Published, Snapshot};
use crate::terminal::say::{note, say};
use discover::Discovery;
use filters::Filters;
use jobs::{Context, Jobs, Outcome};

/// How often `--max-db` and `--retention` are applied (and whenever a job ends).
const SWEEP_EVERY: Duration = Duration::from_secs(10);

pub struct Plan {
    /// `--lib` and the runtime folders of the daemon's own environment: probed at the start.
    pub libraries: Vec<Library>,
    /// Output, format, writer, probes, ring, duration, status: what a trace is told too.
    pub capture: capture::Plan,
    pub listen: SocketAddr,
    /// The rules in force (the command line's and the filter file's).
    pub admission: Admission,
    /// The command line's filter flags, and `--filters`: read again on SIGHUP.
    pub filters: Filters,
    pub filters_file: Option<PathBuf>,
    /// `--max-db`, `--retention`.
    pub limits: retention::Limits,
    /// `--sample-bytes`, `--max-blocks` (`None`: every call recorded).
    pub sampling: Option<Sampling>,
    /// `--warmup-steps`, `--step-marker`, `--step-window`.
    pub live: memscope_core::ingest::live::Options,
    /// `--owner-labels`.
    pub owner_labels: usize,
    /// `--flight-rows`, `--flight-blocks` (`None`: no flight recorder).
    pub flight: Option<memscope_core::ingest::flight::Limits>,
    /// `--windows` (`None`: the sampled APIs' probes attached at all times).
    pub windows: Option<windows::Schedule>,
}

/// SIGUSR1 asks for a flight recording of every job.
fn ask_on_sigusr1(requests: flight::Requests) -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut usr1 = signal(SignalKind::user_defined1()).context("cannot handle SIGUSR1")?;
    tokio::spawn(async move {
        while usr1.recv().await.is_some() {
            requests.ask(None);
        }
    });
    Ok(())
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
    let requests = flight::Requests::default();
    let ask: Option<metrics::http::FlightAsk> = plan.flight.map(|_| {
        let requests = requests.clone();
        std::sync::Arc::new(move |pid| requests.ask(pid)) as metrics::http::FlightAsk
    });
    let metrics = metrics::serve(plan.listen, plan.capture.quiet, ask).await?;
    if plan.flight.is_some() {
        ask_on_sigusr1(requests.clone())?;
    }
    let clock = Clock::calibrate();
    let opts = LoadOptions {
        ring_bytes: plan.capture.ring_bytes,
        wakeup_bytes: u64::from(plan.capture.ring_bytes) / event_loop::WAKEUP_FRACTION,
        follow_forks: false,
        debug_dirs: Vec::new(),
        stack_depth: 0,
        stack_window: 0,
        // The owner rules, steps and sites read each allocation's Python stack (docs/owners.md);
        // pool frees need none.
        python_depth: memscope_core::stacks::spec::DEFAULT_DEPTH,
        python_frees: false,
        python_sample_depth: 0,
        bpf_log: None,
        admission: Some(plan.admission.clone()),
        sampling: plan.sampling,
        window_all: plan.flight.is_some(),
        windowed: plan.windows.is_some(),
    };
    // No target (pid 0 is never a process's tgid): the kernel admits processes by the rules.
    let mut tracer = Tracer::load(&opts, 0, None).context("cannot load the eBPF programs")?;
    let denied = judge_running(&mut tracer, &plan.admission)?.len();
    let mut consumer = Consumer::new(tracer.take_ring()?, clock)?;
    consumer.set_sample_bytes(plan.sampling.map_or(0, |s| s.interval));
    let cx = Context {
        output: plan.capture.output.clone(),
        format: plan.capture.format,
        writer: plan.capture.writer,
        clock,
        ring_bytes: plan.capture.ring_bytes,
        probe_links: tracer.link_kind(),
        sample_bytes: plan.sampling.map_or(0, |s| s.interval),
        live: plan.live.clone(),
        owner_labels: plan.owner_labels,
        node_root: plan.capture.node_root.clone(),
        flight: plan.flight,
    };
    let recordings = flight::Recordings::new(&plan.capture.output, plan.capture.writer);
    let windows = match plan.windows {
        Some(schedule) if tracer.windowed() => Some(windows::Windows::new(schedule, std::time::Instant::now())),
        Some(_) => {
            let why = tracer.link_kind();
            note(
                plan.capture.quiet,
                format!("no windows: the kernel cannot link uprobes as one ({why}); the pool and CPU-tensor calls are probed at all times"),
            );
            None
        }
        None => None,
    };
    let plan_status = plan.capture.status;
    let plan_driver = plan.capture.driver.clone();
    let mut daemon = Daemon {
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
        status: crate::terminal::status::Status::new(plan_status),
        status_every: Every::new(crate::terminal::status::RENEW_EVERY),
        sweep_every: Every::new(SWEEP_EVERY),
        driver: crate::driver::Driver::new(&plan_driver),
        driver_look: Every::new(std::time::Duration::from_secs(1)),
        recordings,
        requests,
        windows,
        rising: Default::default(),
        full: Default::default(),
    };
    let start: Vec<(Option<u32>, Library)> = daemon.plan.libraries.iter().map(|l| (None, l.clone())).collect();
    daemon.attach(start, "given at the start");
    daemon.scan();
    daemon.sweep();
    daemon.announce(denied);
    let mut signals = Signals::new()?;
    let duration = daemon.plan.capture.duration;
    let reason = event_loop::run(&mut daemon, &mut signals, duration, std::future::pending()).await?;
    Ok(daemon.stop(reason, signals))
}

/// Applies the rules to the processes running now (the kernel judges a process once, at its
/// first call or exec): writes the processes `--pid` allows into the kernel, denies the ones
/// the rules deny and lets the others be judged afresh. Returns the denied, with the flag that
/// denies each.
fn judge_running(tracer: &mut Tracer, admission: &Admission) -> anyhow::Result<Vec<(u32, &'static str)>> {
    let own = std::process::id();
    let pids: Vec<u32> = discover::all_pids().into_iter().filter(|p| *p != own).collect();
    let tree = if admission.allow_pids.is_empty() { Default::default() } else { judge::allowed_tree(admission, &pids) };
    let mut allowed: Vec<u32> = tree.iter().copied().chain(admission.allow_pids.iter().copied()).collect();
    allowed.sort_unstable();
    allowed.dedup();
    tracer.set_rules(admission, &allowed).context("cannot write the filter rules into the kernel")?;
    let mount = rules::cgroup2_mount_now();
    let mut denied = Vec::new();
    for pid in pids {
        match judge::denied_by(pid, admission, mount.as_deref(), &tree) {
            Some(flag) => {
                tracer.deny_process(pid).with_context(|| format!("cannot exclude process {pid}"))?;
                denied.push((pid, flag));
            }
            None => tracer.undeny_process(pid).with_context(|| format!("cannot judge process {pid} again"))?,
        }
    }
    Ok(denied)
}

/// A running daemon.
struct Daemon {
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
    status: crate::terminal::status::Status,
    status_every: Every,
    sweep_every: Every,
    /// The driver's own figures for the node's devices, each job's from its process's.
    driver: crate::driver::Driver,
    /// When the jobs' maps are next read for a driver library, while none is found.
    driver_look: Every,
    /// The flight recordings made and being made, and those asked for from outside the loop.
    recordings: flight::Recordings,
    requests: flight::Requests,
    /// `--windows` (`None`: the sampled APIs' probes attached at all times).
    windows: Option<windows::Windows>,
    /// Jobs whose live bytes rose for good: each brought a window forward once.
    rising: std::collections::HashSet<u32>,
    /// The devices that filled up (`windows::Fill`).
    full: windows::Fill,
}

impl Daemon {
    /// Starts the driver's helper once a job maps a driver library, and hands its readings to
    /// the jobs.
    fn driver_readings(&mut self) {
        let pids = self.jobs.pids();
        let look = self.driver.waiting() && self.driver_look.due();
        for &pid in pids.iter().filter(|_| look) {
            if !self.driver.waiting() {
                break;
            }
            if let Some(line) = self.driver.try_start(pid) {
                note(self.plan.capture.quiet, line);
            }
        }
        let (rows, lines) = self.driver.poll(&|p| pids.contains(&p));
        for line in lines {
            note(self.plan.capture.quiet, line);
        }
        for (pid, e) in self.jobs.add_driver(rows) {
            say!("memscope-bpf: warning: job {pid}: cannot write the driver's figures: {e:#}");
        }
    }

    /// Probes library files not probed yet; new probes go into every open job's `ms_probes`.
    fn attach(&mut self, libs: Vec<(Option<u32>, Library)>, found: &str) {
        let quiet = self.plan.capture.quiet;
        let (added, markers) =
            attach_found(&mut self.tracer, libs, self.plan.capture.probe_set, quiet, &mut self.skipped);
        for e in self.tracer.take_window_failures() {
            say!(
                "memscope-bpf: warning: {}; its pool and CPU-tensor calls are seen from the next window",
                crate::attach::with_causes(&e)
            );
        }
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
            note(quiet, describe_usdt(&markers));
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
                let ld = printable(&ld.shown);
                note(self.plan.capture.quiet, format!("watching the libraries loaded through {ld} (process {pid})"));
            }
            Ok(LinkerHook::Known) => {}
            Ok(LinkerHook::Refused) => self.discovery.unhooked(pid, now),
            Err(e) => {
                say!(
                    "memscope-bpf: warning: {}; its processes are looked at every second instead",
                    printable(&crate::attach::with_causes(&e))
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
        if admission.has_name_rules() || denied > 0 {
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
            jobs::describe_output(&plan.capture.output),
        );
        if files == 0 {
            note(
                plan.capture.quiet,
                "no runtime library found yet: looking at each program started and each library loaded",
            );
        }
        if let (Some(w), true) = (plan.windows, self.windows.is_some()) {
            let (length, every) = (w.length.as_secs_f64(), w.every.as_secs_f64());
            note(
                plan.capture.quiet,
                format!(
                    "pool and CPU-tensor calls probed in windows: {length} s every {every} s, from now (--windows)"
                ),
            );
        }
    }

    /// SIGHUP: the filter file is read again (a file with an error leaves the rules as they
    /// were), and the rules applied again to the processes running now: one that renamed itself
    /// since its exec, or that new rules deny, is denied and its open job finished; one that
    /// new rules no longer deny is judged afresh at its next call.
    fn reload(&mut self) {
        match self.read_filters() {
            Ok(admission) => self.plan.admission = admission,
            Err(e) => say!("memscope-bpf: warning: SIGHUP: {e:#}; the rules stay as they were"),
        }
        let denied = match judge_running(&mut self.tracer, &self.plan.admission) {
            Ok(denied) => denied,
            Err(e) => {
                say!("memscope-bpf: warning: SIGHUP: {e:#}");
                return;
            }
        };
        for (pid, flag) in &denied {
            if self.jobs.pids().contains(pid) {
                // What it did before is kept: its job is finished as if it had exited.
                self.drain();
                self.finish(*pid, &format!("excluded by {flag} (on SIGHUP)"));
            }
        }
        note(
            self.plan.capture.quiet,
            format!("SIGHUP: filters applied again ({} running process(es) denied)", denied.len()),
        );
    }

    /// The command line's filter flags and the filter file's, checked.
    fn read_filters(&self) -> anyhow::Result<Admission> {
        let mut filters = self.plan.filters.clone();
        if let Some(path) = &self.plan.filters_file {
            filters.extend(filters::read_file(path)?);
        }
        Ok(filters.admission()?)
    }

    /// Hands every record waiting in the ring to its job; finishes the jobs whose process ended.
    fn drain(&mut self) {
        let mut outcomes = Vec::new();
        let Self { consumer, jobs, cx, probes, .. } = self;
        consumer.drain(|e| outcomes.extend(jobs.on_event(e, cx, probes)));
        for (pid, comm, dir) in self.jobs.take_opened() {
            note(self.plan.capture.quiet, format!("job {pid} ({}): traced, in {}", printable(&comm), dir.display()));
            // A job's first call opens it: from then on its allocations carry its Python stack.
            match crate::capture::python::register(&mut self.tracer, &mut self.consumer, pid) {
                Ok(Some(line)) => note(self.plan.capture.quiet, format!("job {pid}: {line}")),
                Ok(None) => {}
                Err(e) => say!("memscope-bpf: warning: job {pid}: {e:#}"),
            }
        }
        for outcome in outcomes {
            match outcome {
                Outcome::Exited(pid) => self.finish(pid, "process exited"),
                Outcome::WriteFailed(pid) => self.finish(pid, "write error"),
                Outcome::Failed(pid, e) => say!("memscope-bpf: warning: process {pid} is not recorded: {e:#}"),
                Outcome::OutOfMemory(pid) => self.record(pid, flight::Reason::Oom),
            }
        }
    }

    /// Starts job `pid`'s flight recording for `reason`, unless one was made for it just now.
    fn record(&mut self, pid: u32, reason: flight::Reason) {
        if !self.recordings.due(pid, reason) {
            return;
        }
        if let Some(snapshot) = self.jobs.flight_snapshot(pid, reason) {
            self.recordings.start(snapshot);
        }
    }

    /// The recordings asked for since the last look, started; those finished, told.
    fn flight_work(&mut self) {
        for asked in self.requests.take() {
            let pids = match asked {
                Some(pid) if !self.jobs.pids().contains(&pid) => {
                    say!("memscope-bpf: warning: a flight recording of process {pid} was asked for: it is no job of this daemon");
                    continue;
                }
                Some(pid) => vec![pid],
                None => self.jobs.pids(),
            };
            for pid in pids {
                self.record(pid, flight::Reason::Request);
            }
        }
        for done in self.recordings.finished() {
            let (pid, why) = (done.pid, done.reason.as_str());
            match done.result {
                Ok(dir) => say!("memscope-bpf: job {pid}: flight recording ({why}) in {}", dir.display()),
                Err(e) => say!("memscope-bpf: warning: job {pid}: the flight recording ({why}) failed: {e:#}"),
            }
        }
    }

    /// Brings the next window forward, saying why, unless one is open, draining or due.
    fn open_window_soon(&mut self, why: impl FnOnce() -> String) {
        if let Some(w) = &mut self.windows {
            if w.open_soon(std::time::Instant::now()) {
                note(self.plan.capture.quiet, format!("a window opens early: {}", why()));
            }
        }
    }

    /// A device that filled up brings the next window forward.
    fn near_full(&mut self) {
        let memory: Vec<_> = self.driver.device_memory().collect();
        for (device, used, total) in memory {
            if self.full.crossed(device, used, total) {
                let device = metrics::device_label(device);
                self.open_window_soon(|| {
                    format!("device {device} holds {} of its {} MiB (the driver's figure)", used >> 20, total >> 20)
                });
            }
        }
    }

    /// Takes the window's next step, if one is due.
    fn window_work(&mut self) {
        self.near_full();
        let Some(w) = &mut self.windows else { return };
        let (jobs, tracer) = (&self.jobs, &self.tracer);
        let Some(step) = w.next(std::time::Instant::now(), || jobs.sampled_blocks(), || tracer.window_detached())
        else {
            return;
        };
        match step {
            windows::Step::Open => match self.tracer.open_window() {
                Ok(failed) => {
                    for e in failed {
                        say!(
                            "memscope-bpf: warning: this window misses a library's pool and CPU calls: {}",
                            crate::attach::with_causes(&e)
                        );
                    }
                }
                Err(e) => say!("memscope-bpf: warning: cannot open a window: {}", crate::attach::with_causes(&e)),
            },
            windows::Step::Close => self.tracer.close_window(),
            windows::Step::EndDrain => self.tracer.end_drain(),
            windows::Step::Forget => {
                // Every free that ran while its probe was attached is in the ring: seen first.
                self.drain();
                let forgotten = self.jobs.forget_sampled(clock::wall_ns());
                if let Some(w) = &mut self.windows {
                    w.forgotten += forgotten as u64;
                }
            }
        }
    }

    fn finish(&mut self, pid: u32, reason: &str) {
        self.recordings.forget(pid);
        if self.plan.sampling.is_some() {
            let _ = self.tracer.forget_counters(&std::iter::once(pid).collect());
        }
        let lost = self.tracer.lost_per_cpu().unwrap_or_default();
        match self.jobs.finish(pid, reason, &lost) {
            Ok(ended) => {
                self.ended += 1;
                self.ended_calls += ended.calls;
                note(
                    self.plan.capture.quiet,
                    format!(
                        "job {pid} ({}): {reason}; {} calls recorded in {}",
                        printable(&ended.comm),
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
        for job in &mut jobs {
            let pid = job.pid;
            job.driver = self.driver.latest(&|p| p == pid);
        }
        // The kernel counts a sampled job's blocks only while no flight recorder gets every call
        // (else the job's feed counts them: `Jobs::totals`).
        if self.plan.sampling.is_some() && self.plan.flight.is_none() {
            match self.tracer.exact_counters() {
                Ok(counters) => metrics::apply_exact(&mut jobs, &counters),
                Err(e) => say!("memscope-bpf: warning: cannot read the kernel's counters: {e}"),
            }
        }
        // A job whose live bytes now rise for good gets its flight recording, once.
        let rising: Vec<u32> = jobs
            .iter()
            .filter(|j| {
                j.trends.iter().any(|t| t.trend.verdict == memscope_core::analysis::degradation::Verdict::SustainedRise)
            })
            .map(|j| j.pid)
            .collect();
        for pid in rising {
            self.record(pid, flight::Reason::Degradation);
            if self.rising.insert(pid) {
                self.open_window_soon(|| format!("job {pid}'s live bytes rise for good"));
            }
        }
        for job in &mut jobs {
            job.flights = self
                .recordings
                .counts
                .iter()
                .filter(|((p, _), _)| *p == job.pid)
                .map(|((_, r), n)| (r.as_str(), *n))
                .collect();
            job.flights.sort_unstable();
            job.flight_latest = self.recordings.latest.get(&job.pid).map(|d| d.display().to_string());
        }
        if self.status.shown() && self.status_every.due() {
            self.status.renew(&status::facts(&jobs, calls, lost));
        }
        let windows =
            Some(self.windows.as_ref().map_or(metrics::WindowFacts { open: true, ..Default::default() }, |w| {
                metrics::WindowFacts { open: w.is_open(), opened: w.opened, forgotten: w.forgotten }
            }));
        self.metrics.publish(Snapshot { jobs, calls, lost, maps: self.tracer.map_memory(), windows });
    }

    /// Commits every job's rows; finishes the jobs whose process is gone without an exit record
    /// (one lost in a full ring).
    fn commit_all(&mut self) {
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
        let swept = retention::sweep(&self.plan.capture.output, &running, limits, std::time::SystemTime::now());
        for (path, why) in &swept.removed {
            note(self.plan.capture.quiet, format!("removed {} ({why})", path.display()));
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
        self.status.finish();
        note(self.plan.capture.quiet, format!("stopping ({reason})…"));
        self.drain();
        // The recordings asked for or made until now are written whole first.
        self.flight_work();
        self.recordings.wait();
        self.flight_work();
        let stop_reason = format!("daemon stopped: {reason}");
        for pid in self.jobs.pids() {
            self.finish(pid, &stop_reason);
        }
        let lost = self.tracer.lost_per_cpu().unwrap_or_default().iter().sum();
        let Self { tracer, ended, ended_calls, .. } = self;
        Stopped { reason, jobs: ended, calls: ended_calls, lost, detaching: Detaching::start(tracer, signals) }
    }
}

/// The daemon in the one loop: every job on the node, libraries looked for in the processes the
/// kernel reports (and on a schedule), SIGHUP a reload of the filters, and the run folders swept
/// every [`SWEEP_EVERY`] and whenever a job ends.
impl event_loop::Capturing for Daemon {
    fn wakeup(&self) -> impl std::future::Future<Output = ()> + '_ {
        self.consumer.woken()
    }

    fn drain(&mut self) {
        Daemon::drain(self);
    }

    fn woken(&mut self) -> anyhow::Result<()> {
        self.scan();
        Ok(())
    }

    fn publish(&mut self) {
        Daemon::publish(self);
    }

    /// A job's failed commit ends that job, not the daemon.
    fn commit(&mut self) -> anyhow::Result<()> {
        self.commit_all();
        Ok(())
    }

    fn tick(&mut self) -> anyhow::Result<Option<String>> {
        self.window_work();
        self.flight_work();
        self.scan();
        self.driver_readings();
        if self.sweep_every.due() || self.swept_at < self.ended {
            self.sweep_every.ran();
            self.sweep();
        }
        Ok(None)
    }

    fn hangup(&mut self) -> Option<String> {
        self.reload();
        None
    }

    fn awaits_target(&self) -> bool {
        false
    }

    fn target_exited(&mut self, _: event_loop::TargetExit) -> Option<String> {
        None
    }

    /// A write error ends its job only (see [`Jobs::on_event`]).
    fn check(&mut self) -> anyhow::Result<()> {
        Ok(())
    }
}
