//! `cargo xtask bench`: what tracing costs the traced program, per aclrtMalloc + aclrtFree pair,
//! untraced, under memscope-bpf, and under bpftrace probing the same symbols (the peer), in the
//! same run and interleaved so machine noise hits all three alike.
//!
//! The loop (`tests/bench/alloc_bench.c`) times itself inside the process, so process start and
//! probe attach are not counted. Each aclrtMalloc/aclrtFree of the stand-in runtime calls the
//! stand-in driver, so a full trace probes 8 functions per pair. The bpftrace script does the work
//! a leak tracer must do at minimum on the same 8: save the out-pointer at entry, read the result
//! at return and keep a live-block map, and drop the block on free. Last, the stop: SIGTERM to a
//! complete DB and to exit with many probes and live blocks ([`stop`]). Results go to
//! target/bench/results.md; copy them into docs/benchmarks.md with the command line.

mod analysis;
mod consumer;
mod daemon;
mod import;
mod loss;
mod markers;
mod measure;
mod owners;
mod python_trace;
mod report_page;
mod simulate;
mod stacks;
mod stop;
mod torch_ab;
mod usdt;
mod writers;

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context as _};

use crate::util::{output, privileged, root};
use crate::{build, dist, setup, vm};
use measure::{bpftrace_script, median, report, run_capture};

#[derive(clap::Args)]
pub struct Options {
    /// Allocation+free pairs per run.
    #[arg(long, default_value_t = 1_000_000)]
    pub pairs: u64,
    /// Runs per configuration (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Skip `cargo xtask setup`.
    #[arg(long)]
    pub no_setup: bool,
    /// Allocation pairs traced for the analysis-throughput DB (each pair is 2 rows; 0 skips it).
    #[arg(long, default_value_t = 5_000_000)]
    pub analysis_pairs: u64,
    /// Live blocks held by the job whose stop is timed (SIGTERM to a complete DB; 0 skips it).
    #[arg(long, default_value_t = 1_000_000)]
    pub stop_blocks: u64,
    /// Stops timed.
    #[arg(long, default_value_t = 3)]
    pub stop_rounds: usize,
    /// Only the stop-time measurement.
    #[arg(long)]
    pub stop_only: bool,
    /// Allocation pairs replayed through the consumer alone (`bench-consumer`; 0 skips it).
    #[arg(long, default_value_t = 1_000_000)]
    pub consumer_pairs: u64,
    /// Blocks left live at the stop for the memory figure (0 skips it).
    #[arg(long, default_value_t = 1_000_000)]
    pub live_blocks: u64,
    /// Seconds of the allocation loop per offered rate in the loss-by-rate figure (0 skips it).
    #[arg(long, default_value_t = 5)]
    pub loss_seconds: u64,
    /// Only the consumer's figures (throughput, memory, loss by rate): no pair rounds, markers
    /// or analyses.
    #[arg(long)]
    pub consumer_only: bool,
    /// Only the cost of stacks per pair (`trace --call-stack`, against bpftrace's `ustack`), and
    /// the sustained load with them (`--stacks-seconds`).
    #[arg(long)]
    pub stacks_only: bool,
    /// Only the cost of reading owners from Python stacks on a real PyTorch loop (and the
    /// Python rounds of the stacks bench, per call).
    #[arg(long)]
    pub owners_only: bool,
    /// Seconds of the sustained 500 k calls/s load with native stacks (0 skips it).
    #[arg(long, default_value_t = 60)]
    pub stacks_seconds: u64,
    /// Only the analysis throughput (`--analysis-pairs`, `--analysis-rounds`, `--baseline-bin`).
    #[arg(long)]
    pub analysis_only: bool,
    /// Times each analysis command this many times (the median is reported).
    #[arg(long, default_value_t = 1)]
    pub analysis_rounds: usize,
    /// An older memscope-bpf timed in the same run, alternating with this build's (a refactor
    /// against what it replaced): its analyses on the same DB (`--analysis-only`), and its
    /// consumer on the same records (`--consumer-only`, `--rounds` times each), and its daemon
    /// on the pool and PyTorch loops (`--daemon-only`).
    #[arg(long, value_name = "PATH")]
    pub baseline_bin: Option<std::path::PathBuf>,
    /// Only the daemon's cost: the training workload's wall time off, under the daemon and under
    /// `trace`, and the daemon's RSS and CPU with 10 jobs holding `--daemon-blocks` each.
    #[arg(long)]
    pub daemon_only: bool,
    /// Interleaved rounds of the daemon's wall-time comparison (0 skips the daemon's part).
    #[arg(long, default_value_t = 5)]
    pub daemon_rounds: usize,
    /// Only the figures inside the VMs (per-pair cost and stop time under qemu's TCG, on
    /// Debian 12's 6.1 kernel, x86-64 and arm64), each against the same figure on the host.
    /// Not part of the full run: it boots a machine per architecture (minutes each).
    #[arg(long)]
    pub vm_only: bool,
    /// Pairs per run inside the VMs (and on the host beside them).
    #[arg(long, default_value_t = 20_000)]
    pub vm_pairs: u64,
    /// Live blocks the VM figures' stop is timed with.
    #[arg(long, default_value_t = 20_000)]
    pub vm_blocks: u64,
    /// Only the cost of a hit of a 1-byte-nop USDT site (PyTorch's) against a 5-byte-nop one.
    #[arg(long)]
    pub usdt_only: bool,
    /// Only the reading of msMemScope's CSV (`import` against sqlite3's `.import`).
    #[arg(long)]
    pub import_only: bool,
    /// Only the trace DB's two writers (pages and SQL) and the cost of a synced commit.
    #[arg(long)]
    pub writers_only: bool,
    /// Rows each writer writes in that bench.
    #[arg(long, default_value_t = 2_000_000)]
    pub writer_rows: u64,
    /// Blocks (2 rows each) in the msMemScope CSV the import is timed on (0 skips it).
    #[arg(long, default_value_t = 2_000_000)]
    pub import_blocks: u64,
    /// Only the allocator replay (`advise --simulate`): seconds per million requests per setting.
    #[arg(long)]
    pub simulate_only: bool,
    /// Requests replayed per setting in that bench (0 skips it in the full run).
    #[arg(long, default_value_t = 1_000_000)]
    pub simulate_requests: u64,
    /// Only the cost of `trace --python-trace` to a CPU-bound Python loop, the rows it writes,
    /// and a driver reading's cost.
    #[arg(long)]
    pub python_trace_only: bool,
    /// Iterations of that loop (about 3 s of CPython 3.11 on this machine kind).
    #[arg(long, default_value_t = 15_000_000)]
    pub python_trace_iterations: u64,
    /// Live blocks each of the daemon bench's 10 jobs holds.
    #[arg(long, default_value_t = 100_000)]
    pub daemon_blocks: u64,
}

struct Sample {
    ns_per_pair: f64,
    detail: String,
}

fn parse_ns(stdout: &str) -> anyhow::Result<f64> {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("ns_per_pair "))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("no ns_per_pair in output:\n{stdout}"))
}

fn untraced(bench: &Path, pairs: u64) -> anyhow::Result<Sample> {
    let (stdout, _) = run_capture(Command::new(bench).arg(pairs.to_string()))?;
    Ok(Sample { ns_per_pair: parse_ns(&stdout)?, detail: String::new() })
}

fn memscope(binary: &Path, lib: &Path, bench: &Path, pairs: u64, out: &Path) -> anyhow::Result<Sample> {
    let _ = std::fs::remove_dir_all(out);
    let (stdout, stderr) = run_capture(
        privileged(binary.to_str().expect("utf-8 path"))
            .args(["trace", "--quiet", "--output"])
            .arg(out)
            .arg("--lib")
            .arg(lib)
            .arg("--")
            .arg(bench)
            .arg(pairs.to_string()),
    )?;
    let recorded = stderr
        .lines()
        .find(|l| l.contains("calls recorded"))
        .unwrap_or("")
        .trim_start_matches("memscope-bpf: ")
        .to_owned();
    Ok(Sample { ns_per_pair: parse_ns(&stdout)?, detail: recorded })
}

fn bpftrace(lib: &Path, bench: &Path, pairs: u64) -> anyhow::Result<Sample> {
    let (stdout, _) = run_capture(
        privileged("bpftrace")
            .arg("-e")
            .arg(bpftrace_script(lib))
            .arg("-c")
            .arg(format!("{} {pairs}", bench.display())),
    )?;
    Ok(Sample { ns_per_pair: parse_ns(&stdout)?, detail: String::new() })
}

/// The per-pair rounds (untraced, memscope-bpf, bpftrace interleaved) and their table; also says
/// whether bpftrace is there for the later peer comparisons.
fn pair_rounds(opts: &Options, built: &build::Built, dir: &Path) -> anyhow::Result<(String, bool)> {
    let have_bpftrace = output(Command::new("bpftrace").arg("--version")).is_some();
    let (mut base, mut ours, mut peer) = (Vec::new(), Vec::new(), Vec::new());
    let mut details = Vec::new();
    for round in 1..=opts.rounds {
        eprintln!("xtask bench: round {round}/{}", opts.rounds);
        base.push(untraced(&built.alloc_bench, opts.pairs)?.ns_per_pair);
        let s = memscope(&built.binary, &built.libascendcl, &built.alloc_bench, opts.pairs, &dir.join("out"))?;
        ours.push(s.ns_per_pair);
        details.push(s.detail);
        if have_bpftrace {
            peer.push(bpftrace(&built.libascendcl, &built.alloc_bench, opts.pairs)?.ns_per_pair);
        }
    }
    let (b, o) = (median(base.clone()), median(ours.clone()));
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let cpus = std::thread::available_parallelism().map_or(0, std::num::NonZero::get);
    let mut md = String::new();
    md.push_str(&format!(
        "Command: `cargo xtask bench --pairs {} --rounds {}` (kernel {}, {cpus} CPUs). Median of {} runs; \
         each run times {} aclrtMalloc+aclrtFree pairs on the stand-in runtime inside the process.\n\n",
        opts.pairs,
        opts.rounds,
        kernel.trim(),
        opts.rounds,
        opts.pairs
    ));
    md.push_str("| configuration | ns per pair (median) | added by tracing | runs |\n|---|---|---|---|\n");
    let fmt_runs = |v: &[f64]| v.iter().map(|x| format!("{x:.0}")).collect::<Vec<_>>().join(", ");
    md.push_str(&format!("| untraced | {b:.0} | – | {} |\n", fmt_runs(&base)));
    md.push_str(&format!(
        "| memscope-bpf trace (8 probes: runtime + driver, merged rows, SQLite) | {o:.0} | {:.0} | {} |\n",
        o - b,
        fmt_runs(&ours)
    ));
    if have_bpftrace {
        let p = median(peer.clone());
        md.push_str(&format!(
            "| bpftrace, same 8 probes, live maps only | {p:.0} | {:.0} | {} |\n",
            p - b,
            fmt_runs(&peer)
        ));
        md.push_str(&format!(
            "\nmemscope-bpf / bpftrace: {:.3}x per traced pair, {:.3}x of the added cost (target: at most 1.05x).\n",
            o / p,
            (o - b) / (p - b)
        ));
    } else {
        md.push_str("\nbpftrace is not installed (`cargo xtask setup` installs it): no peer comparison.\n");
    }
    md.push_str(&format!("\nmemscope-bpf per run: {}\n", details.join("; ")));
    Ok((md, have_bpftrace))
}

/// `--baseline-bin` must name a file before minutes of building.
fn check_baseline(opts: &Options) -> anyhow::Result<()> {
    match &opts.baseline_bin {
        Some(b) if !b.is_file() => {
            bail!("--baseline-bin {}: no such file; give the path of an older memscope-bpf binary", b.display())
        }
        _ => Ok(()),
    }
}

pub fn run(opts: &Options) -> anyhow::Result<()> {
    check_baseline(opts)?;
    if opts.writers_only {
        return writers::run(&root(), opts.writer_rows); // the core crate alone
    }
    if !opts.no_setup {
        setup::run(&setup::Options { check: false })?;
    }
    let built = build::run()?;
    let root = root();
    let dir = root.join("target/bench");
    std::fs::create_dir_all(&dir)?;
    if opts.import_only {
        let md = import::run(&built.binary, &dir.join("out-import"), opts.import_blocks, opts.rounds)?;
        return report(&dir.join("results-import.md"), &md);
    }
    if opts.simulate_only {
        let md = simulate::run(&built.binary, opts.simulate_requests, opts.rounds)?;
        return report(&dir.join("results-simulate.md"), &md);
    }
    if opts.python_trace_only {
        let md = python_trace::run(&built, &dir, opts.rounds, opts.python_trace_iterations)?;
        return report(&dir.join("results-python-trace.md"), &md);
    }
    if opts.stop_only {
        let md = stop::run(&built, &root, &dir.join("out-stop"), opts.stop_blocks, opts.stop_rounds)?;
        return report(&dir.join("results-stop.md"), &md);
    }
    if opts.vm_only {
        let arches = [dist::Arch::X86_64, dist::Arch::Aarch64];
        let release = dist::run(&dist::Options { arch: arches.to_vec() })?;
        let params = vm::figures::Params { pairs: opts.vm_pairs, blocks: opts.vm_blocks, rounds: opts.rounds };
        let md = vm::figures(&built, &release, &arches, &params)?;
        return report(&dir.join("results-vm.md"), &md);
    }
    if opts.daemon_only {
        let sizes = (opts.daemon_rounds.max(1), opts.daemon_blocks);
        let md = daemon::run(&built, &root, &dir.join("out-daemon"), sizes, opts.baseline_bin.as_deref())?;
        std::fs::write(dir.join("results-daemon.md"), &md)?;
        println!("{md}");
        return Ok(());
    }
    let analysis_plan = analysis::Plan {
        pairs: opts.analysis_pairs,
        rounds: opts.analysis_rounds.max(1),
        baseline: opts.baseline_bin.as_deref(),
    };
    if opts.stacks_only {
        let mut md = stacks::run(&built, &dir, opts.pairs, opts.rounds)?;
        md.push_str(&stacks::consumer(&built, &dir, opts.pairs)?);
        if opts.stacks_seconds > 0 {
            md.push_str(&stacks::sustained(&built, &dir, opts.stacks_seconds)?);
        }
        return report(&dir.join("results-stacks.md"), &md);
    }
    if opts.owners_only {
        let mut md = owners::run(&built, &root, &dir.join("out-owners"), opts.rounds)?;
        md.push_str(&stacks::python_rounds(&built, &dir, opts.pairs / 4, opts.rounds)?);
        return report(&dir.join("results-owners.md"), &md);
    }
    if opts.usdt_only {
        let have_bpftrace = output(Command::new("bpftrace").arg("--version")).is_some();
        let md = usdt::run(&built, &dir.join("out-usdt"), have_bpftrace)?;
        return report(&dir.join("results-usdt.md"), &md);
    }
    if opts.analysis_only {
        let md = analysis::run(&built, &dir.join("out-analysis"), &analysis_plan)?;
        return report(&dir.join("results-analysis.md"), &md);
    }
    if opts.consumer_only {
        let baseline = opts.baseline_bin.as_deref().map(|b| (b, opts.rounds));
        let mut md = consumer::run(&built, &dir, opts.consumer_pairs, opts.live_blocks, baseline)?;
        if opts.loss_seconds > 0 {
            md.push_str(&loss::run(&built, &dir, opts.loss_seconds)?);
        }
        std::fs::write(dir.join("results.md"), &md)?;
        println!("{md}");
        return Ok(());
    }
    let md = everything(opts, &built, &dir, &analysis_plan)?;
    std::fs::write(dir.join("results.md"), &md)?;
    println!("{md}");
    Ok(())
}

/// The full run: every part, in order.
fn everything(
    opts: &Options,
    built: &build::Built,
    dir: &Path,
    analysis_plan: &analysis::Plan<'_>,
) -> anyhow::Result<String> {
    let root = root();
    let (mut md, have_bpftrace) = pair_rounds(opts, built, dir)?;
    md.push_str(&markers::run(built, &root, &dir.join("out-markers"), have_bpftrace)?);
    md.push_str(&usdt::run(built, &dir.join("out-usdt"), have_bpftrace)?);
    md.push_str(&stacks::run(built, dir, opts.pairs, opts.rounds)?);
    md.push_str(&owners::run(built, &root, &dir.join("out-owners"), opts.rounds)?);
    md.push_str(&stacks::consumer(built, dir, opts.consumer_pairs)?);
    md.push_str(&consumer::run(built, dir, opts.consumer_pairs, opts.live_blocks, None)?);
    if opts.loss_seconds > 0 {
        md.push_str(&loss::run(built, dir, opts.loss_seconds)?);
    }
    if opts.analysis_pairs > 0 {
        md.push_str(&analysis::run(built, &dir.join("out-analysis"), analysis_plan)?);
    }
    if opts.simulate_requests > 0 {
        md.push_str(&simulate::run(&built.binary, opts.simulate_requests, opts.rounds)?);
    }
    if opts.import_blocks > 0 {
        md.push_str(&import::run(&built.binary, &dir.join("out-import"), opts.import_blocks, opts.rounds)?);
    }
    if opts.stop_blocks > 0 {
        md.push_str(&stop::run(built, &root, &dir.join("out-stop"), opts.stop_blocks, opts.stop_rounds)?);
    }
    if opts.daemon_rounds > 0 {
        let sizes = (opts.daemon_rounds, opts.daemon_blocks);
        md.push_str(&daemon::run(built, &root, &dir.join("out-daemon"), sizes, opts.baseline_bin.as_deref())?);
    }
    Ok(md)
}
