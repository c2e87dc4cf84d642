//! `memscope-bpf daemon`: trace every accelerator process on the node for as long as it runs,
//! one run folder per process, with the totals served for Prometheus. Privileged.
//!
//! As with `trace`, everything that can be checked before the probes load is checked here (the
//! filters, the output folder, the address), so a mistake costs one clear line.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context as _};
use memscope_core::ingest::live;

use super::capture::CaptureArgs;
use super::parse_duration;
use super::trace::user_libraries;
use crate::attach::libs;
use crate::attach::loader::Sampling;
use crate::attach::ProbeSet;
use crate::daemon::filters::Filters;
use crate::daemon::windows::{Schedule, Windowing};
use crate::daemon::{self, Plan, Stopped};
use crate::session::preflight;
use crate::terminal::say::say;
use crate::terminal::status::Mode;

/// The port Prometheus's exporter list gives memscope-bpf's metrics.
const DEFAULT_LISTEN: &str = "127.0.0.1:9464";

/// How often a job's degradation verdicts are computed again (they are quadratic in the
/// boundaries kept, up to `live::MAX_POINTS`).
const TREND_EVERY: Duration = Duration::from_secs(5);

/// Blocks the kernel counts at once, all jobs together: 96 bytes of kernel memory each (measured:
/// `memscope_bpf_map_memory_bytes{map="BLOCKS"}`).
const DEFAULT_MAX_BLOCKS: u32 = 1 << 20;

/// Trace every process on this node that uses the accelerator runtime, for as long as the
/// daemon runs, and serve the totals for Prometheus.
///
/// Every process: sudo memscope-bpf daemon
/// Filtered:      sudo memscope-bpf daemon --cgroup /kubepods.slice --exclude-comm python3.8
/// One job tree:  sudo memscope-bpf daemon --pid 4242
/// Bounded disk:  sudo memscope-bpf daemon --max-db 2GiB --retention 7d
///
/// The probes go on the runtime, driver and framework libraries that processes map (looked
/// for when a program starts and each time one loads libraries, as its dynamic linker says) or
/// that --lib and ASCEND_HOME_PATH name; a process is traced from
/// its first call into them, unless a filter excludes it. Each traced process is a job with its
/// own folder, OUTPUT/memscope_<pid>_<time>_ascend/, one DB per device, the folder `trace`
/// writes: every offline verb (analyze, compare, advise) and MindStudio Insight open it. Rows
/// are committed every second; a job is finished when its process exits. GET /metrics serves
/// every running job's totals (labels pid, comm, device, pool), its largest owners' live bytes,
/// and the degradation verdict of `analyze --analysis leaks` on its step boundaries, kept up to
/// date as it runs (docs/metrics.md); GET /healthz says the daemon is up. SIGINT or SIGTERM
/// finishes every job's DBs and stops; SIGHUP reads --filters again and applies every filter
/// to the processes running then. Needs root.
///
/// It always runs in the foreground (systemd or a terminal keeps it). On a terminal a status
/// area, redrawn every second, shows the calls and their rate, lost records, and per running
/// job its live and peak bytes per device, step and largest owners (as `trace` shows its
/// target); --json prints it as JSON lines instead; off a terminal only the jobs' starts and
/// ends are printed, for the journal.
#[derive(Debug, clap::Args)]
#[command(verbatim_doc_comment)]
pub struct Args {
    /// Folder for the jobs' run folders (made if missing; 0700, files 0600).
    #[arg(short, long, value_name = "DIR", default_value = "/var/lib/memscope")]
    pub output: PathBuf,

    #[command(flatten)]
    pub capture: CaptureArgs,

    /// Serve the metrics on this address: `GET /metrics` and `GET /healthz`. Use a loopback
    /// address unless the network is trusted; port 0 picks a free one (printed at the start).
    #[arg(long, value_name = "ADDR:PORT", default_value = DEFAULT_LISTEN)]
    pub listen: SocketAddr,

    #[command(flatten)]
    pub filters: Filters,

    /// Also read filter flags from this file, one per line as on the command line
    /// (`--exclude-comm python3.8`; blank lines and # comments are skipped), added to those
    /// given here. Read again on SIGHUP: the rules change at once for the processes running and
    /// those to come, and a file with an error leaves the rules as they were.
    #[arg(long = "filters", value_name = "FILE")]
    pub filters_file: Option<PathBuf>,

    /// Keep the run folders under OUTPUT within this much disk (e.g. 2GiB): the oldest
    /// finished jobs' folders are removed first. A running job's folder is never removed (a
    /// warning says when running jobs alone are over). Applied every 10 s and when a job ends.
    #[arg(long, value_name = "SIZE", value_parser = memscope_core::units::parse_bytes)]
    pub max_db: Option<u64>,

    /// Remove finished jobs' run folders whose last write is older than this (e.g. 7d, 12h),
    /// also those an earlier daemon left in OUTPUT.
    #[arg(long, value_name = "TIME", value_parser = parse_duration)]
    pub retention: Option<Duration>,

    /// Also probe this library: a file of any name or a folder. Repeatable. The libraries the
    /// node's processes map, and those in ASCEND_HOME_PATH's runtime folders (the daemon's and
    /// each process's), are probed without it.
    #[arg(long = "lib", value_name = "PATH")]
    pub libs: Vec<PathBuf>,

    /// Record pool and CPU-tensor blocks by Poisson sampling with this mean interval (0: record
    /// every call). A block of the interval or more is always recorded at its size; a smaller
    /// one is recorded when a sample point falls in it, its DB row carrying the bytes it stands
    /// for (Attr `weight`). Runtime and driver calls and failed allocations are always recorded,
    /// and the metrics' live bytes, peaks and counts are exact: every block probed is counted (by
    /// each job's flight-recorder window, which gets every call; with --flight-rows 0, by the
    /// kernel), and these calls are probed in --windows only.
    #[arg(long, value_name = "SIZE", default_value = "512KiB", value_parser = memscope_core::units::parse_bytes)]
    pub sample_bytes: u64,

    /// With --flight-rows 0, the most sampled-family blocks the kernel counts at once, all jobs
    /// together (96 bytes of kernel memory each, taken at the start: 96 MiB at the default).
    /// Past it the oldest are forgotten, and their frees are counted as untracked. With the
    /// flight recorder on, the kernel counts none: each job's window does.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_BLOCKS)]
    pub max_blocks: u32,

    /// Owners each job's live bytes are broken down by in memscope_owner_live_bytes: the N
    /// largest (by device and layer), the rest summed as owner="other" (0: no owner series).
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub owner_labels: usize,

    /// Boundaries ending steps up to N are the warm-up: the degradation gauges judge the live
    /// bytes from the end of step N on (as `analyze --analysis leaks --warmup-steps`).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub warmup_steps: u64,

    /// Take step boundaries from MSTX marks (or ranges) with this message instead of
    /// memscope.step() / mstx `step start` ranges (as `analyze --step-marker`).
    #[arg(long, value_name = "NAME")]
    pub step_marker: Option<String>,

    /// A job that marks no steps gets a boundary every TIME instead, so the degradation gauges
    /// judge its growth too; its first marked step replaces them (0: none).
    #[arg(long, value_name = "TIME", default_value = "1m", value_parser = parse_duration)]
    pub step_window: Duration,

    /// The flight recorder: each job's last N rows kept in memory, with every block still live
    /// however old, and written at once as a run folder of its own in OUTPUT/flight/ (its DB
    /// with the OOM forensics stored, a memory_viz snapshot per device and report.html) when an
    /// allocation fails for want of memory (once a minute per job at most), when its
    /// degradation verdict turns to a sustained rise (once), on SIGUSR1 (every job) and on
    /// `curl -X POST http://127.0.0.1:9464/flight-recording[?pid=N]` from the node itself (a
    /// loopback peer, or one at the address it reached the daemon at). 0: off. Under
    /// --sample-bytes every call is sent for the window (the job's rows stay sampled), and the
    /// window counts every block for the metrics. Memory: at most 320 bytes per row or block
    /// kept per job, and under sampling 320 per live block (docs/metrics.md). Turning it off
    /// under sampling does not make tracing cheaper: the kernel then counts the blocks in a map,
    /// which costs more per call than sending them, and the pool's probes stay attached, since
    /// --windows need this count (docs/benchmarks.md, issue 41).
    #[arg(long, value_name = "N", default_value_t = 20_000)]
    pub flight_rows: usize,

    /// The most live blocks a job's flight recorder holds beyond its last rows; past it the
    /// oldest are dropped, and its recordings say how many (`ms_meta.flight_held_dropped`).
    #[arg(long, value_name = "N", default_value_t = 50_000)]
    pub flight_blocks: usize,

    /// Probe the pool and CPU-tensor calls (those --sample-bytes samples) only in windows: for
    /// LENGTH at the start of every EVERY (default 30s/5m), or `always`. Every probed call costs
    /// a trap into the kernel whether or not it is recorded; between windows those calls cost
    /// nothing. The runtime's and driver's calls are probed at all times, so the device series
    /// (live bytes, peaks, reserved memory, OOMs) stay exact; the pool and device="cpu" series
    /// count the blocks born in windows, and memscope_window_open says when one is open
    /// (docs/metrics.md). A window opens at once when a device fills to 90 % by the driver's
    /// figure (once per crossing), and when a job's live bytes turn to a sustained rise (once per
    /// job). After a window the frees stay probed until its blocks are freed, for
    /// LENGTH more at most; those still live then are forgotten, their rows ended by a FREE
    /// marked implied. Windows need the flight recorder's count: with --sample-bytes 0 or
    /// --flight-rows 0 the default is `always`, and a schedule is refused.
    #[arg(long, value_name = "LENGTH/EVERY|always", value_parser = daemon::windows::parse)]
    pub windows: Option<Windowing>,
}

/// The windows in force: `--windows`, else the default where the flight recorder counts every
/// block, else none.
fn windows(args: &Args) -> anyhow::Result<Option<Schedule>> {
    let counted = args.sample_bytes > 0 && args.flight_rows > 0;
    Ok(match args.windows {
        Some(Windowing::Always) => None,
        None if !counted => None,
        None => Some(daemon::windows::DEFAULT),
        Some(Windowing::Every(_)) if !counted => bail!(
            "--windows needs every pool block counted by the flight recorder, and --sample-bytes 0 or --flight-rows 0 turns that off; \
             drop --windows (or give --windows always)"
        ),
        Some(Windowing::Every(schedule)) => Some(schedule),
    })
}

pub fn run(args: Args) -> anyhow::Result<()> {
    args.capture.check()?;
    if args.max_blocks == 0 {
        bail!("--max-blocks must be at least 1 (the default is {DEFAULT_MAX_BLOCKS})");
    }
    let mut filters = args.filters.clone();
    if let Some(path) = &args.filters_file {
        filters.extend(daemon::filters::read_file(path)?);
    }
    let admission = filters.admission()?;
    let windows = windows(&args)?;
    preflight::check_output(&args.output)?;
    crate::attach::loader::check_object()?;
    preflight::check_daemon_caps()?;
    preflight::check_uprobes()?;
    let mut libraries = user_libraries(&args.libs)?;
    let env: std::collections::HashMap<String, String> = std::env::vars().collect();
    libraries.extend(libs::from_env(&env, Path::new("/"), false));
    let libraries = libs::with_dependencies(libraries);
    args.capture.say_writer();

    let status = match Mode::choose(args.capture.quiet, args.capture.json) {
        // A journal wants events, not a status line every 10 s: Prometheus has the totals.
        Mode::Lines => Mode::Off,
        mode => mode,
    };
    let plan = Plan {
        libraries,
        capture: args.capture.plan(args.output, status),
        listen: args.listen,
        admission,
        filters: args.filters,
        filters_file: args.filters_file,
        limits: daemon::retention::Limits { max_bytes: args.max_db, retention: args.retention },
        sampling: (args.sample_bytes > 0).then_some(Sampling {
            interval: args.sample_bytes,
            max_blocks: args.max_blocks,
            frees_at_entry: args.capture.probe_set == ProbeSet::Default,
        }),
        live: live::Options {
            warmup_steps: args.warmup_steps,
            step_marker: args.step_marker,
            window_ns: u64::try_from(args.step_window.as_nanos()).unwrap_or(u64::MAX),
            trend_every_ns: TREND_EVERY.as_nanos() as u64,
        },
        owner_labels: args.owner_labels,
        windows,
        flight: (args.flight_rows > 0)
            .then_some(memscope_core::ingest::flight::Limits { recent: args.flight_rows, held: args.flight_blocks }),
    };
    let runtime =
        tokio::runtime::Builder::new_current_thread().enable_all().build().context("cannot start the async runtime")?;
    let Stopped { reason, jobs, calls, lost, detaching } = runtime.block_on(daemon::run(plan))?;
    say!(
        "memscope-bpf: daemon stopped ({reason}): {jobs} job(s) finished, {calls} calls recorded, {lost} records lost"
    );
    runtime.block_on(detaching.wait(args.capture.quiet));
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use crate::cli::Cli;

    #[test]
    fn defaults_are_a_daemons() {
        let cli = Cli::try_parse_from(["memscope-bpf", "daemon"]).unwrap();
        let text = format!("{cli:?}");
        assert!(text.contains("/var/lib/memscope") && text.contains("127.0.0.1:9464"), "{text}");
    }

    #[test]
    fn bad_filters_fail_before_anything_is_loaded() {
        let cli = Cli::try_parse_from(["memscope-bpf", "daemon", "--exclude-comm", ""]).unwrap();
        let err = format!("{:#}", cli.run().unwrap_err());
        assert!(err.contains("--exclude-comm"), "{err}");
        let cli = Cli::try_parse_from(["memscope-bpf", "daemon", "--cgroup", "/no/such/cgroup/here"]).unwrap();
        let err = format!("{:#}", cli.run().unwrap_err());
        assert!(err.contains("/no/such/cgroup/here"), "{err}");
        let cli = Cli::try_parse_from(["memscope-bpf", "daemon", "--ring-mb", "3"]).unwrap();
        assert!(format!("{:#}", cli.run().unwrap_err()).contains("power of two"));
    }

    fn windows(args: &[&str]) -> anyhow::Result<Option<crate::daemon::windows::Schedule>> {
        let cli = Cli::try_parse_from(["memscope-bpf", "daemon"].iter().chain(args)).unwrap();
        let crate::cli::Command::Daemon(args) = cli.command else { panic!("not the daemon") };
        super::windows(&args)
    }

    #[test]
    fn windows_are_the_default_where_the_flight_recorder_counts_every_block() {
        assert_eq!(windows(&[]).unwrap(), Some(crate::daemon::windows::DEFAULT));
        assert_eq!(windows(&["--windows", "always"]).unwrap(), None);
        assert!(windows(&["--windows", "10s/1m"]).unwrap().is_some_and(|w| w.every.as_secs() == 60));
        for counted_by_none in [["--sample-bytes", "0"], ["--flight-rows", "0"]] {
            assert_eq!(windows(&counted_by_none).unwrap(), None, "{counted_by_none:?}");
            let mut explicit = counted_by_none.to_vec();
            explicit.extend(["--windows", "10s/1m"]);
            let err = windows(&explicit).unwrap_err().to_string();
            assert!(err.contains("--windows") && err.contains(counted_by_none[0]), "{err}");
        }
        let err = Cli::try_parse_from(["memscope-bpf", "daemon", "--windows", "1m/10s"]).unwrap_err().to_string();
        assert!(err.contains("LENGTH/EVERY"), "{err}");
    }
}
