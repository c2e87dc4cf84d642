//! The daemon's cost (`cargo xtask bench --daemon-only`, and a part of the full bench):
//!
//! - the stand-in training workload's wall time with nothing attached, under `memscope-bpf
//!   daemon`, and under `memscope-bpf trace` (full recording), interleaved round by round so
//!   that the machine's drift falls on all three alike; the median of each;
//! - the daemon's RSS and CPU time with 10 jobs holding `--blocks` live blocks each (1 M in all
//!   by default): while they allocate, and idle for 10 s after;
//! - the cost per pool allocation (the stand-in caching allocator's tensors: what a training
//!   step does most) with nothing attached, under bpftrace counting live bytes as bcc's memleak
//!   does (the peer, and about the least a uprobe tool can do per call), under the daemon
//!   recording every call (`--sample-bytes 0`), under its default sampling, and under `trace`,
//!   timed by the workload's own loop;
//! - a real PyTorch training loop on the CPU (PyTorch's own allocator between real kernels),
//!   under bpftrace's memleak count and each daemon, inside one process (`torch_ab`).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};

use crate::build::Built;
use crate::util::privileged;

/// A running daemon with its output in `out`; killed if dropped before [`Daemon::stop`].
pub(super) struct Daemon(Child);

impl Daemon {
    fn start(built: &Built, out: &Path) -> anyhow::Result<Self> {
        Self::start_with(built, &built.binary, out, &[])
    }

    pub(super) fn start_with(built: &Built, binary: &Path, out: &Path, extra: &[&str]) -> anyhow::Result<Self> {
        let _ = std::fs::remove_dir_all(out);
        std::fs::create_dir_all(out)?;
        let child = privileged(binary.to_str().expect("utf-8 path"))
            .args(["daemon", "--quiet", "--listen", "127.0.0.1:0", "--output"])
            .arg(out.join("jobs"))
            .args(extra)
            .env("ASCEND_HOME_PATH", &built.ascend_home)
            .stdin(Stdio::null())
            .stderr(std::fs::File::create(out.join("stderr"))?)
            .spawn()
            .context("cannot start memscope-bpf daemon")?;
        let daemon = Self(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        while !std::fs::read_to_string(out.join("stderr")).unwrap_or_default().contains(": live:") {
            if Instant::now() > deadline {
                bail!(
                    "the daemon did not go live: {}",
                    std::fs::read_to_string(out.join("stderr")).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(daemon)
    }

    /// (RSS bytes, CPU seconds) of the daemon now.
    fn usage(&self) -> (u64, f64) {
        let pid = self.0.id();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let rss_kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0);
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // Fields after the command name: utime and stime are the 12th and 13th.
        let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
        let ticks: u64 = after.split_whitespace().skip(11).take(2).filter_map(|t| t.parse::<u64>().ok()).sum();
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        (rss_kib * 1024, ticks as f64 / hz)
    }

    /// Runs and nanoseconds of every BPF program the daemon loaded (kernel.bpf_stats_enabled).
    fn program_time(&self) -> (u64, u64) {
        let dir = format!("/proc/{}/fdinfo", self.0.id());
        let mut total = (0, 0);
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            let field = |key: &str| text.lines().find_map(|l| l.strip_prefix(key)?.trim().parse::<u64>().ok());
            if let (Some(runs), Some(ns)) = (field("run_cnt:"), field("run_time_ns:")) {
                total = (total.0 + runs, total.1 + ns);
            }
        }
        total
    }

    pub(super) fn stop(mut self) -> anyhow::Result<()> {
        // SAFETY: plain kill(2) on our child.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let status = self.0.wait()?;
        if !status.success() {
            bail!("the daemon failed ({status})");
        }
        Ok(())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// The training workload's wall time, in seconds.
fn train(built: &Built, root: &Path, out: &Path, traced: bool) -> anyhow::Result<f64> {
    let workload = root.join("tests/workloads/standin_train.py");
    let ledger = out.join("ledger.jsonl");
    let steps = ["--steps", "400", "--blocks-per-step", "64", "--devices", "2"];
    let mut cmd = if traced {
        let mut cmd = privileged(built.binary.to_str().expect("utf-8 path"));
        cmd.args(["trace", "--quiet", "--output"]).arg(out.join("trace")).arg("--").arg("python3");
        cmd
    } else {
        Command::new("python3")
    };
    cmd.arg(&workload).arg("--ledger").arg(&ledger).args(steps).env("ASCEND_HOME_PATH", &built.ascend_home);
    let start = Instant::now();
    let out = cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).status()?;
    if !out.success() {
        bail!("the training workload failed ({out})");
    }
    Ok(start.elapsed().as_secs_f64())
}

pub(super) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Wall time off / under the daemon / under `trace`; returns the section.
fn wall_time(built: &Built, root: &Path, out: &Path, rounds: usize) -> anyhow::Result<String> {
    let (mut off, mut daemon_on, mut trace_on, mut peer) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let calls = |dir: &Path| std::fs::read_to_string(dir.join("ledger.jsonl")).map_or(0, |l| l.lines().count());
    let mut per_run = 0;
    let have_bpftrace = Command::new("bpftrace").arg("--version").output().is_ok_and(|o| o.status.success());
    // The pair bench's peer: the runtime's and the driver's allocation and free, entry and
    // return, with a live-set update each, the calls that make up most of this workload.
    let script = super::measure::bpftrace_script(&built.ascend_home.join("lib64/libascendcl.so"));
    for round in 1..=rounds {
        eprintln!("xtask bench: daemon, wall time, round {round}/{rounds}");
        off.push(train(built, root, out, false)?);
        per_run = calls(out);
        if have_bpftrace {
            let bpftrace = Bpftrace::start(&script, out)?;
            peer.push(train(built, root, out, false)?);
            drop(bpftrace);
        }
        let daemon = Daemon::start(built, &out.join("daemon"))?;
        daemon_on.push(train(built, root, out, false)?);
        daemon.stop()?;
        trace_on.push(train(built, root, out, true)?);
    }
    let (off, daemon_on, trace_on) = (median(off), median(daemon_on), median(trace_on));
    let pct = |t: f64| (t / off - 1.0) * 100.0;
    let per_call = |t: f64| (t - off) * 1e9 / per_run.max(1) as f64;
    let peer = if peer.is_empty() {
        "| bpftrace (the same 8 probes as the pair bench) | not run (no bpftrace) | – | – |\n".to_owned()
    } else {
        let t = median(peer);
        format!(
            "| bpftrace (the runtime's and driver's malloc and free, entry and return, a map update each) | {t:.3} \
             | {:+.2} % | {:.0} |\n",
            pct(t),
            per_call(t)
        )
    };
    Ok(format!(
        "\n## Daemon: the training workload's wall time (standin_train.py --steps 400 --blocks-per-step 64 --devices 2, \
         {per_run} runtime calls; median of {rounds} interleaved rounds)\n\n\
         | run | wall s | vs off | ns per call |\n|---|---|---|---|\n\
         | nothing attached | {off:.3} | – | – |\n{peer}\
         | `memscope-bpf daemon` | {daemon_on:.3} | {:+.2} % | {:.0} |\n\
         | `memscope-bpf trace` (full recording) | {trace_on:.3} | {:+.2} % | {:.0} |\n",
        pct(daemon_on),
        per_call(daemon_on),
        pct(trace_on),
        per_call(trace_on),
    ))
}

/// The daemon's RSS and CPU with 10 jobs holding `blocks` live blocks each.
fn ten_jobs(built: &Built, root: &Path, out: &Path, blocks: u64) -> anyhow::Result<String> {
    eprintln!("xtask bench: daemon, 10 jobs of {blocks} live blocks");
    let daemon = Daemon::start(built, &out.join("daemon"))?;
    let (rss_idle, cpu_idle) = daemon.usage();
    let started = Instant::now();
    let mut jobs = Vec::new();
    for i in 0..10 {
        let ready = out.join(format!("ready-{i}"));
        let _ = std::fs::remove_file(&ready);
        let child = Command::new("python3")
            .arg(root.join("tests/workloads/standin_hold.py"))
            .arg("--ledger")
            .arg(out.join(format!("hold-{i}.jsonl")))
            .args(["--blocks", &blocks.to_string(), "--hold", "600", "--device", &(i % 2).to_string()])
            .arg("--ready-file")
            .arg(&ready)
            .env("ASCEND_HOME_PATH", &built.ascend_home)
            .stdin(Stdio::null())
            .spawn()?;
        jobs.push((child, ready));
    }
    let deadline = Instant::now() + Duration::from_secs(1200);
    while !jobs.iter().all(|(_, r)| r.exists()) {
        if Instant::now() > deadline {
            bail!("the jobs did not allocate their blocks");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let allocating = started.elapsed().as_secs_f64();
    // What the ring still holds is drained within a few ticks.
    std::thread::sleep(Duration::from_secs(2));
    let (rss_full, cpu_full) = daemon.usage();
    std::thread::sleep(Duration::from_secs(10));
    let (_, cpu_after) = daemon.usage();
    for (mut child, _) in jobs {
        let _ = child.kill();
        let _ = child.wait();
    }
    daemon.stop()?;
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    Ok(format!(
        "\n## Daemon: 10 jobs, {} live blocks in all (standin_hold.py --blocks {blocks} each)\n\n\
         | measure | value |\n|---|---|\n\
         | RSS, no job | {:.1} MiB |\n\
         | RSS, 10 jobs holding their blocks | {:.1} MiB |\n\
         | CPU while the jobs allocated ({allocating:.1} s wall) | {:.2} s |\n\
         | CPU over the next 10 s, jobs idle | {:.3} s ({:.2} % of a core) |\n",
        10 * blocks,
        mib(rss_idle),
        mib(rss_full),
        cpu_full - cpu_idle,
        cpu_after - cpu_full,
        (cpu_after - cpu_full) * 10.0,
    ))
}

/// A daemon timed on the pool and PyTorch loops: its row's name, binary and flags.
pub(super) struct Variant<'a> {
    pub(super) name: String,
    pub(super) binary: &'a Path,
    pub(super) extra: &'static [&'static str],
    /// This build's daemon with a window open, or between windows: the default's cost is the
    /// mean of the two over its duty cycle ([`duty_mean`]).
    pub(super) window: Option<bool>,
}

/// The share of the time the default `--windows 30s/5m` probes the pool: a window of 30 s and
/// its drain (the frees alone, 30 s at most) every 300 s, counted as open throughout.
const DUTY: f64 = 60.0 / 300.0;

/// The default daemon's cost over its duty cycle, from `cost` of each variant (in `daemons`'
/// order): an upper bound, as the drain costs less than an open window.
pub(super) fn duty_mean(daemons: &[Variant], cost: &[f64]) -> Option<f64> {
    let of = |open| daemons.iter().position(|v| v.window == Some(open)).map(|i| cost[i]);
    Some(DUTY * of(true)? + (1.0 - DUTY) * of(false)?)
}

/// The daemon recording every call, at its defaults with a window open and between windows,
/// this build's and, with `--baseline-bin`, the older binary's (recording every call and at its
/// defaults), timed in the same rounds.
fn variants<'a>(built: &'a Built, baseline: Option<&'a Path>) -> Vec<Variant<'a>> {
    let binary = built.binary.as_path();
    let mut all = vec![
        Variant {
            name: "`daemon --sample-bytes 0` (every call recorded)".into(),
            binary,
            extra: &["--sample-bytes", "0"],
            window: None,
        },
        Variant {
            name: "`daemon --windows always` (default sampling, 512 KiB; as in a window)".into(),
            binary,
            extra: &["--windows", "always"],
            window: Some(true),
        },
        Variant {
            name: "`daemon --windows 1s/1h`, after its window (as between windows)".into(),
            binary,
            extra: &["--windows", "1s/1h"],
            window: Some(false),
        },
    ];
    if let Some(binary) = baseline {
        all.push(Variant {
            name: "`daemon --sample-bytes 0` (every call recorded) (baseline)".into(),
            binary,
            extra: &["--sample-bytes", "0"],
            window: None,
        });
        all.push(Variant { name: "`daemon` (its defaults) (baseline)".into(), binary, extra: &[], window: None });
    }
    all
}

/// Allocations (and about as many frees) each pool run makes.
const POOL_ALLOCS: u64 = 200_000;

/// One run of the pool workload: its loop's seconds.
fn pool_loop(built: &Built, root: &Path, out: &Path) -> anyhow::Result<f64> {
    pool_loop_with(built, root, out, None)
}

/// One run of the pool workload, launched by `memscope-bpf trace` when `trace` names its output.
fn pool_loop_with(built: &Built, root: &Path, out: &Path, trace: Option<&Path>) -> anyhow::Result<f64> {
    let ready = out.join("pool.ready");
    let _ = std::fs::remove_file(&ready);
    let mut cmd = match trace {
        Some(dir) => {
            let _ = std::fs::remove_dir_all(dir);
            let mut cmd = privileged(built.binary.to_str().expect("utf-8 path"));
            cmd.args(["trace", "--quiet", "--output"]).arg(dir).arg("--").arg("python3");
            cmd
        }
        None => Command::new("python3"),
    };
    let run = cmd
        .arg(root.join("tests/workloads/standin_pool_hold.py"))
        .arg("--torch-lib")
        .arg(&built.torch.with_debug)
        .args(["--count", &POOL_ALLOCS.to_string(), "--hold", "0", "--max", "65536"])
        // The daemon finds the allocator in the job's mappings within a second.
        .args(["--delay", "2"])
        .arg("--ready-file")
        .arg(&ready)
        .env("ASCEND_HOME_PATH", &built.ascend_home)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()?;
    loop_seconds(&run, "the pool workload")
}

/// The `loop_s=` a finished workload printed: its loop's own seconds.
fn loop_seconds(run: &std::process::Output, what: &str) -> anyhow::Result<f64> {
    if !run.status.success() {
        bail!("{what} failed ({})", run.status);
    }
    let stdout = String::from_utf8_lossy(&run.stdout);
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("loop_s=")?.trim().parse().ok())
        .with_context(|| format!("{what} printed no loop time: {stdout}"))
}

/// The peer: bcc memleak's exact live-bytes count, written for bpftrace, on one allocator's
/// `alloc` and `free` symbols in `lib` (an entry and a return probe per allocation, an entry
/// probe per free, as the daemon has under sampling); the allocations counted are printed at
/// exit (`@calls`).
pub(super) fn memleak_script(lib: &Path, alloc: &str, free: &str) -> String {
    let l = lib.display();
    format!(
        "uprobe:{l}:{alloc} {{ @size[tid] = arg0; @calls = count(); }} \
         uretprobe:{l}:{alloc} /@size[tid]/ {{ @live[retval] = @size[tid]; @bytes += @size[tid]; \
         delete(@size[tid]); }} \
         uprobe:{l}:{free} /@live[arg0]/ {{ @bytes -= @live[arg0]; delete(@live[arg0]); }} \
         END {{ clear(@size); clear(@live); clear(@bytes); }}"
    )
}

/// `kernel.bpf_stats_enabled` on until dropped, then as it was.
struct BpfStats(Option<String>);

impl BpfStats {
    const PATH: &'static str = "/proc/sys/kernel/bpf_stats_enabled";

    fn on() -> Self {
        let before = std::fs::read_to_string(Self::PATH).ok();
        let _ = std::fs::write(Self::PATH, "1");
        Self(before)
    }
}

impl Drop for BpfStats {
    fn drop(&mut self) {
        if let Some(before) = &self.0 {
            let _ = std::fs::write(Self::PATH, before.trim());
        }
    }
}

/// A bpftrace running `script` until dropped; started once its probes are attached.
pub(super) struct Bpftrace(Child);

impl Bpftrace {
    pub(super) fn start(script: &str, out: &Path) -> anyhow::Result<Self> {
        let log = out.join("bpftrace.out");
        let child = privileged("bpftrace")
            .arg("-e")
            .arg(script)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log)?)
            .stderr(Stdio::null())
            .spawn()
            .context("cannot start bpftrace")?;
        let peer = Self(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        while !std::fs::read_to_string(&log).unwrap_or_default().contains("Attaching") {
            if Instant::now() > deadline {
                bail!("bpftrace did not attach: {}", std::fs::read_to_string(&log).unwrap_or_default());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // "Attaching N probes..." is printed before the last of them is in.
        std::thread::sleep(Duration::from_millis(500));
        Ok(peer)
    }
}

impl Drop for Bpftrace {
    fn drop(&mut self) {
        // SAFETY: plain kill(2) on our child.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGINT) };
        let _ = self.0.wait();
    }
}

/// Pool allocations off / under bpftrace's memleak count / under each daemon variant / under
/// `trace`.
fn pool_cost(built: &Built, root: &Path, out: &Path, rounds: usize, daemons: &[Variant]) -> anyhow::Result<String> {
    let have_bpftrace = Command::new("bpftrace").arg("--version").output().is_ok_and(|o| o.status.success());
    // off, the peer, `trace`, then the daemons.
    let mut runs: Vec<Vec<f64>> = vec![Vec::new(); 3 + daemons.len()];
    // The kernel times each BPF program run while this is on (it costs two clock reads a run,
    // in every daemon row alike).
    let stats = BpfStats::on();
    let mut programs = vec![(0u64, 0u64); daemons.len()];
    for round in 1..=rounds {
        eprintln!("xtask bench: daemon, pool allocations, round {round}/{rounds}");
        runs[0].push(pool_loop(built, root, out)?);
        if have_bpftrace {
            let peer = Bpftrace::start(
                &memleak_script(&built.torch.with_debug, "standin_tensor_alloc", "standin_tensor_free"),
                out,
            )?;
            runs[1].push(pool_loop(built, root, out)?);
            drop(peer);
        }
        runs[2].push(pool_loop_with(built, root, out, Some(&out.join("pool-trace")))?);
        for (i, v) in daemons.iter().enumerate() {
            let daemon = Daemon::start_with(built, v.binary, &out.join("daemon"), v.extra)?;
            runs[3 + i].push(pool_loop(built, root, out)?);
            let (n, ns) = daemon.program_time();
            programs[i] = (programs[i].0 + n, programs[i].1 + ns);
            daemon.stop()?;
        }
    }
    drop(stats);
    let medians: Vec<f64> = runs.into_iter().map(|v| if v.is_empty() { f64::NAN } else { median(v) }).collect();
    let off = medians[0];
    // Each allocation is one traced call and each free another: about 1.5 calls per allocation.
    let per_alloc = |t: f64| (t - off) * 1e9 / POOL_ALLOCS as f64;
    let row = |name: &str, t: f64, bpf: String| {
        if t.is_nan() {
            format!("| {name} | not run (no bpftrace) | – | – | – | – |\n")
        } else {
            let peer = per_alloc(t) / per_alloc(medians[1]);
            format!(
                "| {name} | {t:.3} | {:+.1} % | {:.0} | {peer:.2} | {bpf} |\n",
                (t / off - 1.0) * 100.0,
                per_alloc(t)
            )
        }
    };
    let mut table = row(
        "bpftrace, bcc memleak's exact count (entry + return per allocation, entry per free)",
        medians[1],
        "–".into(),
    );
    table.push_str(&row("`trace` (every call recorded, start and stop outside the loop)", medians[2], "–".into()));
    for (i, v) in daemons.iter().enumerate() {
        let (n, ns) = programs[i];
        let bpf = if n == 0 {
            "–".to_owned()
        } else {
            format!("{:.0} ns × {:.2}", ns as f64 / n as f64, n as f64 / (rounds as u64 * POOL_ALLOCS) as f64)
        };
        table.push_str(&row(&v.name, medians[3 + i], bpf));
    }
    if let Some(mean) = duty_mean(daemons, &medians[3..]) {
        table.push_str(&row(DEFAULT_MEAN, mean, "–".into()));
    }
    Ok(format!(
        "\n## Daemon: pool allocations (standin_pool_hold.py --count {POOL_ALLOCS}: tensors of 256 B to 64 KiB on \
         the stand-in caching allocator, about half freed again; the loop's own time, median of {rounds} \
         interleaved rounds)\n\n\
         | run | loop s | vs off | ns per allocation (with its share of frees) | × memleak's | BPF time per program run × runs per allocation (kernel.bpf_stats_enabled, all rounds) |\n\
         |---|---|---|---|---|---|\n\
         | nothing attached | {off:.3} | – | – | – | – |\n{table}"
    ))
}

/// The row of the default daemon's cost over its duty cycle.
pub(super) const DEFAULT_MEAN: &str =
    "**`daemon` (its defaults: `--windows 30s/5m`), over the duty cycle: 0.2 × in a window + 0.8 × between**";

/// PyTorch's CPU allocator, as libc10.so exports it.
pub(super) const C10_ALLOC: &str = "_ZN3c109alloc_cpuEm";
pub(super) const C10_FREE: &str = "_ZN3c108free_cpuEPv";

/// The daemon's part of results.md.
pub fn run(
    built: &Built,
    root: &Path,
    out: &Path,
    (rounds, blocks): (usize, u64),
    baseline: Option<&Path>,
) -> anyhow::Result<String> {
    std::fs::create_dir_all(out)?;
    let daemons = variants(built, baseline);
    let mut md = wall_time(built, root, out, rounds)?;
    md.push_str(&pool_cost(built, root, out, rounds, &daemons)?);
    md.push_str(&super::torch_ab::run(root, out, built, rounds, &daemons)?);
    md.push_str(&ten_jobs(built, root, out, blocks)?);
    Ok(md)
}
