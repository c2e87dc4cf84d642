//! `cargo xtask bench`, the consumer's part: how fast userspace turns records into rows, and how
//! much memory the tracer holds per live block.
//!
//! - Throughput: `memscope-bpf bench-consumer` replays synthetic ring records of the allocation
//!   loop (built from the record ABI) through the trace's own decode → tracker → rows → SQLite
//!   path, with no BPF and no traced program competing for the CPUs. It reports records per
//!   second of wall time and per second of CPU time (all its threads together, that is records
//!   per core).
//! - Memory: the real tracer, tracing `alloc_bench 0 LIVE` (LIVE blocks still allocated when the
//!   program exits, so they are live at the tracer's stop, shadow frees and all). Its peak
//!   resident memory (`VmHWM`) is read from /proc every 10 ms until it exits, with the part of it
//!   that is the ring buffer's mapping (from /proc/PID/smaps); the replay's own `VmHWM` with the
//!   same live blocks is the consumer's share (no ring buffer, no BPF).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context as _};

use crate::build::Built;
use crate::util::privileged;

/// What one `bench-consumer` run printed: `key value` pairs.
struct Replay {
    fields: Vec<(String, String)>,
}

impl Replay {
    fn get(&self, key: &str) -> anyhow::Result<f64> {
        self.fields
            .iter()
            .find(|(k, _)| k == key)
            .and_then(|(_, v)| v.parse().ok())
            .with_context(|| format!("bench-consumer printed no {key}"))
    }
}

fn replay(binary: &Path, out: &Path, pairs: u64, live: u64) -> anyhow::Result<Replay> {
    replay_with(Command::new(binary), out, pairs, live, &[])
}

/// `bench-consumer` run through `command` (the binary, or `taskset` in front of it), with
/// `extra` arguments.
fn replay_with(mut command: Command, out: &Path, pairs: u64, live: u64, extra: &[&str]) -> anyhow::Result<Replay> {
    let _ = std::fs::remove_dir_all(out);
    std::fs::create_dir_all(out)?;
    let (stdout, _) = super::measure::run_capture(
        command
            .args(["bench-consumer", "--pairs", &pairs.to_string(), "--live", &live.to_string()])
            .args(extra)
            .arg("--output")
            .arg(out),
    )?;
    let line = stdout.lines().find(|l| l.starts_with("records ")).context("no result line from bench-consumer")?;
    let words: Vec<&str> = line.split_whitespace().collect();
    let fields = words.chunks(2).filter(|c| c.len() == 2).map(|c| (c[0].to_owned(), c[1].to_owned())).collect();
    let _ = std::fs::remove_dir_all(out);
    Ok(Replay { fields })
}

/// Records per second of wall time and per CPU-second of `bench-consumer --pairs PAIRS
/// --stacks STACKS`, the whole process (consumer and store thread, normalizing and
/// symbolizing included) pinned to CPU 0, so that both figures are one core's.
pub fn one_core_with_stacks(binary: &Path, out: &Path, pairs: u64, stacks: u64) -> anyhow::Result<(f64, f64)> {
    let mut command = Command::new("taskset");
    command.args(["-c", "0"]).arg(binary);
    let r = replay_with(command, out, pairs, 0, &["--stacks", &stacks.to_string()])?;
    if r.get("rejected")? != 0.0 {
        bail!("bench-consumer rejected records of its own generator");
    }
    Ok((r.get("records_per_s")?, r.get("records_per_cpu_s")?))
}

/// A `kB` line of /proc/PID/status (`VmHWM`, `RssAnon`, `RssFile`).
fn status_kib(status: &str, key: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

/// Resident KiB of the process's BPF map mappings, from /proc/PID/smaps: the ring buffer's
/// (counted in RssFile; twice its size where a reader maps its data pages twice, as aya's does)
/// and a page or two of others.
fn bpf_map_rss_kib(pid: u32) -> Option<u64> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).ok()?;
    let mut in_map = false;
    let mut total = 0;
    for line in smaps.lines() {
        // A mapping's header line has an address range and no `Key:` form.
        let first = line.split_whitespace().next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            in_map = line.ends_with("anon_inode:bpf-map");
        } else if in_map {
            total += status_kib(line, "Rss").unwrap_or(0);
        }
    }
    Some(total)
}

/// The tracer's memory at its peak, in KiB.
#[derive(Default)]
struct Peak {
    hwm: u64,
    /// `RssAnon` and `RssFile` when the peak was last raised.
    anon: u64,
    file: u64,
    /// The BPF map mappings' share (the ring buffer's), the most seen.
    ring: u64,
}

impl Peak {
    /// Reads /proc once; the breakdown only when the high-water mark rose.
    fn poll(&mut self, pid: u32) {
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else { return };
        let hwm = status_kib(&status, "VmHWM").unwrap_or(0);
        if hwm > self.hwm {
            self.hwm = hwm;
            self.anon = status_kib(&status, "RssAnon").unwrap_or(0);
            self.file = status_kib(&status, "RssFile").unwrap_or(0);
            self.ring = self.ring.max(bpf_map_rss_kib(pid).unwrap_or(0));
        }
    }
}

/// The tracer's peak resident memory while tracing a program that exits with `live` blocks
/// allocated, and its summary line of calls recorded.
fn tracer_peak(built: &Built, out: &Path, live: u64) -> anyhow::Result<(Peak, String)> {
    let _ = std::fs::remove_dir_all(out);
    let mut child = privileged(built.binary.to_str().expect("utf-8 path"))
        .args(["trace", "--quiet", "--output"])
        .arg(out)
        .arg("--lib")
        .arg(&built.libascendcl)
        .arg("--")
        .arg(&built.alloc_bench)
        .args(["0", &live.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("cannot start memscope-bpf trace")?;
    let pid = child.id();
    let mut peak = Peak::default();
    while child.try_wait()?.is_none() {
        peak.poll(pid);
        std::thread::sleep(Duration::from_millis(10));
    }
    let output = child.wait_with_output()?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        bail!("memscope-bpf trace failed ({}):\n{stderr}", output.status);
    }
    let recorded = stderr.lines().find(|l| l.contains("calls recorded")).unwrap_or("").trim().to_owned();
    let _ = std::fs::remove_dir_all(out);
    Ok((peak, recorded))
}

fn mib(kib: f64) -> f64 {
    kib / 1024.0
}

/// With `--baseline-bin`: the same replay by this build and by the other binary, alternating,
/// `rounds` times each (a refactor against what it replaced, or the release's static build
/// against this one, on a machine whose speed drifts): records per second and peak RSS.
fn against_baseline(built: &Built, baseline: &Path, dir: &Path, pairs: u64, rounds: usize) -> anyhow::Result<String> {
    let (mut ours, mut theirs) = ((Vec::new(), Vec::new()), (Vec::new(), Vec::new()));
    for round in 1..=rounds {
        eprintln!("xtask bench: consumer round {round}/{rounds}, this build then {}", baseline.display());
        for (binary, (speed, rss)) in [(built.binary.as_path(), &mut ours), (baseline, &mut theirs)] {
            let r = replay(binary, &dir.join("replay"), pairs, pairs / 10)?;
            speed.push(r.get("records_per_s")?);
            rss.push(r.get("peak_rss_kib")?);
        }
    }
    let median = super::measure::median;
    let (a, b) = (median(ours.0), median(theirs.0));
    let (ra, rb) = (mib(median(ours.1)), mib(median(theirs.1)));
    Ok(format!(
        "\nAgainst `{}` (`bench-consumer --pairs {pairs} --live {}`, {rounds} rounds alternating, medians): \
         this build **{a:.0} records/s**, peak RSS {ra:.0} MiB; the baseline {b:.0} records/s, peak RSS \
         {rb:.0} MiB: this / baseline {:.3}.\n",
        baseline.display(),
        pairs / 10,
        a / b
    ))
}

pub fn run(
    built: &Built,
    dir: &Path,
    pairs: u64,
    live: u64,
    baseline: Option<(&Path, usize)>,
) -> anyhow::Result<String> {
    let mut md = String::from("\n## The consumer: records per second, memory per live block\n\n");
    if let Some((baseline, rounds)) = baseline.filter(|_| pairs > 0) {
        md.push_str(&against_baseline(built, baseline, dir, pairs, rounds)?);
    }
    if pairs > 0 {
        eprintln!("xtask bench: replaying {pairs} allocation pairs through the consumer");
        let r = replay(&built.binary, &dir.join("replay"), pairs, 0)?;
        md.push_str(&format!(
            "`memscope-bpf bench-consumer --pairs {pairs}`: {:.0} records (4 per pair: runtime and driver \
             calls, merged into 2 rows), {:.2} s wall, {:.2} s CPU (all threads): **{:.0} records/s per core**, \
             {:.0} records/s wall.\n",
            r.get("records")?,
            r.get("wall_s")?,
            r.get("cpu_s")?,
            r.get("records_per_cpu_s")?,
            r.get("records_per_s")?,
        ));
    }
    if live > 0 {
        eprintln!("xtask bench: {live} live blocks, replayed and traced");
        let r = replay(&built.binary, &dir.join("replay"), 0, live)?;
        let (peak, recorded) = tracer_peak(built, &dir.join("out-live"), live)?;
        md.push_str(&format!(
            "\nWith {live} live blocks at the stop: the tracer's peak RSS (VmHWM) **{:.0} MiB** tracing \
             `alloc_bench 0 {live}` ({recorded}), of which the ring buffer's mapping {:.0} MiB (at the peak \
             RssAnon {:.0} MiB, RssFile {:.0} MiB with the ring in it): {:.0} MiB without it. The consumer alone (`bench-consumer --pairs 0 --live {live}`, no \
             ring, no BPF) {:.0} MiB.\n",
            mib(peak.hwm as f64),
            mib(peak.ring as f64),
            mib(peak.anon as f64),
            mib(peak.file as f64),
            mib(peak.hwm.saturating_sub(peak.ring) as f64),
            mib(r.get("peak_rss_kib")?),
        ));
    }
    Ok(md)
}
