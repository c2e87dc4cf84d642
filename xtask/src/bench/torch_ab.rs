//! The daemon's cost on a real PyTorch training loop on the CPU, measured inside one process
//! (part of `cargo xtask bench --daemon-only`).
//!
//! Timing whole runs against each other did not work on this VM: untraced runs of the same loop
//! spread over 15–25 % of their median, ten times the cost sought, and traced rows came out
//! faster than untraced ones. So one loop runs through the whole measurement of a tracer while
//! the tracer is attached and detached in turns, and the phases are compared within the
//! process, each on-phase against the mean of the off-phases either side of it (the machine's
//! drift of the moment). Only the steps wholly inside a phase count; the first seconds after an
//! attach are left out (the daemon finds the process and attaches within a second or two).
//!
//! Two figures per tracer:
//! - **the system time** the loop spends per second of its wall time, over the off-phases':
//!   the probes' traps and programs run in the traced process's own system time, and this loop
//!   (with glibc told to keep its pages: [`KEEP_PAGES`]) makes almost no system calls, so the
//!   difference is the tracer's direct cost, with a resolution of a tenth of a percent;
//! - **the step's wall time**, what the job sees. On this 2-vCPU VM it varies by ±10 % between
//!   phases of a few seconds, untraced too (another process busy on the other vCPU slows this
//!   one's user time as much), so it bounds the cost only loosely; it is shown with its spread.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context as _};

use super::daemon::{duty_mean, median, memleak_script, Bpftrace, Daemon, Variant, C10_ALLOC, C10_FREE, DEFAULT_MEAN};
use crate::build::Built;

/// Seconds of each phase that count.
const PHASE: f64 = 5.0;
/// Seconds left out after an attach (a daemon's: once the loop's job is open) and after a detach.
const SETTLE_ON: f64 = 2.0;
const SETTLE_OFF: f64 = 1.0;

/// glibc keeps the heap's pages rather than mapping each large tensor anew and unmapping it at
/// its free: untuned, the loop spends ~17 % of its time in page faults (its own system time,
/// which varies from phase to phase by more than the tracer's whole cost). Tuned, it runs ~30 %
/// faster, so the same allocations come more often: a harder case for the tracer, not an easier.
const KEEP_PAGES: [(&str, &str); 3] = [
    ("MALLOC_MMAP_THRESHOLD_", "1073741824"),
    ("MALLOC_TRIM_THRESHOLD_", "4294967296"),
    ("MALLOC_TOP_PAD_", "268435456"),
];

/// What is attached in the on-phases: the peer's count or a daemon.
enum Tracer<'a> {
    Peer(&'a Path),
    Daemon(&'a Variant<'a>),
}

/// A tracer attached now.
enum Attached {
    Peer(Bpftrace),
    Daemon(Daemon),
}

impl Tracer<'_> {
    fn name(&self) -> &str {
        match self {
            Tracer::Peer(_) => "bpftrace, bcc memleak's exact count on alloc_cpu/free_cpu",
            Tracer::Daemon(v) => &v.name,
        }
    }

    fn attach(&self, built: &Built, out: &Path) -> anyhow::Result<Attached> {
        Ok(match self {
            Tracer::Peer(libc10) => Attached::Peer(Bpftrace::start(&memleak_script(libc10, C10_ALLOC, C10_FREE), out)?),
            Tracer::Daemon(v) => {
                let daemon = Daemon::start_with(built, v.binary, &out.join("daemon"), v.extra)?;
                // Attached once the loop's job is open: its run folder is made at its first call.
                let jobs = out.join("daemon/jobs");
                let deadline = monotonic() + 30.0;
                let opened = || std::fs::read_dir(&jobs).is_ok_and(|d| d.flatten().any(|e| e.file_name() != "flight"));
                while !opened() {
                    if monotonic() > deadline {
                        bail!("the daemon opened no job for the PyTorch loop in 30 s");
                    }
                    sleep(0.05);
                }
                Attached::Daemon(daemon)
            }
        })
    }
}

impl Attached {
    fn detach(self) -> anyhow::Result<()> {
        match self {
            Attached::Peer(p) => drop(p),
            Attached::Daemon(d) => d.stop()?,
        }
        Ok(())
    }
}

/// CLOCK_MONOTONIC in seconds: the clock the loop's `time.monotonic()` reads.
fn monotonic() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn sleep(seconds: f64) {
    std::thread::sleep(Duration::from_secs_f64(seconds));
}

/// One tracer's measurement: (on-phase, off-phase) windows of CLOCK_MONOTONIC, and the steps.
struct Measured {
    on: Vec<(f64, f64)>,
    off: Vec<(f64, f64)>,
    /// Each step's end: (monotonic s, user CPU s, system CPU s).
    steps: Vec<(f64, f64, f64)>,
}

/// Runs one loop while `tracer` is attached `phases` times, with off-phases around each.
fn measure(
    python: &Path,
    root: &Path,
    out: &Path,
    built: &Built,
    tracer: &Tracer,
    phases: usize,
) -> anyhow::Result<Measured> {
    let log = out.join("steps.log");
    let _ = std::fs::remove_file(&log);
    // Longer than any measurement: the loop is killed once the last phase is over.
    let seconds = 3600;
    let mut child = Command::new(python)
        .arg(root.join("tests/workloads/torch_cpu_loop.py"))
        .args(["--seconds", &seconds.to_string(), "--step-log"])
        .arg(&log)
        .envs(KEEP_PAGES)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("cannot start the PyTorch loop")?;
    let started = monotonic();
    while std::fs::metadata(&log).map_or(0, |m| m.len()) == 0 {
        if monotonic() - started > 120.0 || child.try_wait()?.is_some() {
            let _ = child.kill();
            bail!("the PyTorch loop did not start stepping");
        }
        sleep(0.1);
    }
    let (mut on, mut off) = (Vec::new(), Vec::new());
    let phase = |windows: &mut Vec<(f64, f64)>| {
        let t0 = monotonic();
        sleep(PHASE);
        windows.push((t0, monotonic()));
    };
    sleep(SETTLE_OFF);
    phase(&mut off);
    for _ in 0..phases {
        let attached = tracer.attach(built, out)?;
        sleep(SETTLE_ON);
        phase(&mut on);
        attached.detach()?;
        sleep(SETTLE_OFF);
        phase(&mut off);
    }
    let _ = child.kill();
    let _ = child.wait();
    let steps = std::fs::read_to_string(&log)?
        .lines()
        .filter_map(|l| {
            let mut f = l.split(' ').map(str::parse::<f64>);
            Some((f.next()?.ok()?, f.next()?.ok()?, f.next()?.ok()?))
        })
        .collect();
    Ok(Measured { on, off, steps })
}

impl Measured {
    /// The steps wholly inside `window`.
    fn inside(&self, (t0, t1): (f64, f64)) -> Vec<&(f64, f64, f64)> {
        self.steps.iter().filter(|s| s.0 >= t0 && s.0 <= t1).collect()
    }

    /// Median step wall time in `window`.
    fn step(&self, window: (f64, f64)) -> f64 {
        let ends = self.inside(window);
        let walls: Vec<f64> = ends.windows(2).map(|w| w[1].0 - w[0].0).collect();
        if walls.is_empty() {
            f64::NAN
        } else {
            median(walls)
        }
    }

    /// System CPU seconds per wall second over `window`'s steps.
    fn system_share(&self, window: (f64, f64)) -> f64 {
        match self.inside(window)[..] {
            [first, .., last] => (last.2 - first.2) / (last.0 - first.0),
            _ => f64::NAN,
        }
    }

    /// Each on-phase against the mean of the off-phases either side: (the step's wall-time
    /// slowdown, the system time's added share of the wall time).
    fn phases(&self) -> Vec<(f64, f64)> {
        self.on
            .iter()
            .enumerate()
            .map(|(i, on)| {
                let (a, b) = (self.off[i], self.off[i + 1]);
                let wall = self.step(*on) / ((self.step(a) + self.step(b)) / 2.0) - 1.0;
                let system = self.system_share(*on) - (self.system_share(a) + self.system_share(b)) / 2.0;
                (wall, system)
            })
            .collect()
    }

    fn step_ms(&self) -> f64 {
        median(self.off.iter().map(|w| self.step(*w)).collect()) * 1e3
    }
}

/// `median (min … max)` of percentages.
fn spread(values: &[f64]) -> String {
    let pct: Vec<f64> = values.iter().map(|v| v * 100.0).collect();
    let (lo, hi) = pct.iter().fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(*v), hi.max(*v)));
    format!("{:+.2} % ({lo:+.1} … {hi:+.1})", median(pct.clone()))
}

/// The loop's allocation rate, from the peer's count over the time it was attached.
fn alloc_rate(out: &Path, attached_s: f64) -> Option<f64> {
    let said = std::fs::read_to_string(out.join("bpftrace.out")).ok()?;
    let calls: f64 = said.lines().find_map(|l| l.strip_prefix("@calls: ")?.trim().parse().ok())?;
    Some(calls / attached_s)
}

/// The section: every tracer's slowdowns on one loop each. Skipped where `cargo xtask setup`
/// could not make the torch venv.
pub fn run(root: &Path, out: &Path, built: &Built, rounds: usize, daemons: &[Variant]) -> anyhow::Result<String> {
    let python = match crate::torch_env::python() {
        Ok(p) => p,
        Err(why) => return Ok(format!("\n## Daemon: a real PyTorch loop\n\nNot run: {why}\n")),
    };
    let site = Command::new(&python)
        .args(["-c", "import torch, os; print(os.path.dirname(torch.__file__))"])
        .stderr(Stdio::null())
        .output()?;
    let libc10: PathBuf = Path::new(String::from_utf8_lossy(&site.stdout).trim()).join("lib/libc10.so");
    let have_bpftrace = Command::new("bpftrace").arg("--version").output().is_ok_and(|o| o.status.success());
    let mut tracers: Vec<Tracer> = Vec::new();
    if have_bpftrace {
        tracers.push(Tracer::Peer(&libc10));
    }
    tracers.extend(daemons.iter().map(Tracer::Daemon));
    // The default's duty cycle measured too, scaled to the phases: a window of 1 s every 5 s (and
    // its drain) inside each 5 s phase, as 30 s every 5 min.
    let scaled = Variant {
        name: "`daemon --windows 1s/5s` (the default's duty cycle, scaled to the 5 s phases)".into(),
        binary: &built.binary,
        extra: &["--windows", "1s/5s"],
        window: None,
    };
    tracers.push(Tracer::Daemon(&scaled));
    let phases = 2 * rounds.max(1);
    let (mut table, mut rate, mut step_ms) = (String::new(), None, f64::NAN);
    // Each daemon's system time and wall slowdown (median, least, most), for the duty cycle's mean.
    let (mut systems, mut walls) = (vec![Vec::new(); 3], vec![Vec::new(); 3]);
    for tracer in &tracers {
        eprintln!("xtask bench: daemon, a real PyTorch loop, {} phases of {}", phases, tracer.name());
        let m = measure(&python, root, out, built, tracer, phases)?;
        if let Tracer::Peer(_) = tracer {
            // Its count is of the last attach alone (each attach is a new bpftrace).
            rate = alloc_rate(out, SETTLE_ON + PHASE);
        }
        step_ms = m.step_ms();
        let (wall, system): (Vec<f64>, Vec<f64>) = m.phases().into_iter().unzip();
        table.push_str(&format!("| {} | {} | {} |\n", tracer.name(), spread(&system), spread(&wall)));
        // The scaled daemon comes last: the others' figures line up with `daemons`.
        if let Tracer::Daemon(_) = tracer {
            for (all, values) in [(&mut systems, system), (&mut walls, wall)] {
                let (lo, hi) = values.iter().fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(*v), hi.max(*v)));
                for (i, figure) in [median(values), lo, hi].into_iter().enumerate() {
                    all[i].push(figure);
                }
            }
        }
    }
    let mean = |figures: &[Vec<f64>]| -> Option<String> {
        let [m, lo, hi] = [0, 1, 2].map(|i| duty_mean(daemons, &figures[i]).map(|f| f * 100.0));
        Some(format!("{:+.2} % ({:+.1} … {:+.1})", m?, lo?, hi?))
    };
    if let (Some(system), Some(wall)) = (mean(&systems), mean(&walls)) {
        table.push_str(&format!("| {DEFAULT_MEAN} | {system} | {wall} |\n"));
    }
    let rate = rate.map_or("–".to_owned(), |r| format!("{r:.0}"));
    Ok(format!(
        "\n## Daemon: a real PyTorch training loop on the CPU, inside one process (torch_cpu_loop.py: MLP \
         512-1024-1024-512, Adam, batch 64, 1 thread, glibc keeping its pages; {step_ms:.1} ms a step; ~{rate} \
         c10::alloc_cpu calls a second)\n\n\
         Each tracer attached {phases} times for {PHASE} s (after {SETTLE_ON} s to settle) while one loop runs; each \
         on-phase against the mean of the off-phases either side; the median over the phases, then the least and \
         most. The system time's share is the tracer's direct cost (its traps and programs run in the loop's own \
         system time); the step's wall time varies by ±10 % between phases here, untraced too.\n\n\
         | attached | system time added, share of the loop's wall time | a step's wall time, slowdown |\n\
         |---|---|---|\n{table}"
    ))
}
