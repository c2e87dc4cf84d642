//! `cargo xtask bench`, loss by rate: the allocation loop on two threads, paced to a range of
//! call rates, traced by memscope-bpf; for each rate the calls recorded and lost. The highest
//! rate with nothing lost is the sustained rate the tracer keeps up with on this machine (the
//! traced threads, the consumer and the store share its CPUs).

use std::path::Path;

use anyhow::Context as _;

use super::measure::run_capture;
use crate::build::Built;
use crate::util::privileged;

/// Offered allocation pairs per second (4 traced calls each); 0 is as fast as the threads go.
const RATES: [u64; 6] = [75_000, 100_000, 125_000, 150_000, 175_000, 0];
const THREADS: u32 = 2;

struct Run {
    offered_calls_per_s: f64,
    recorded: u64,
    lost: u64,
}

fn parse_after(text: &str, key: &str) -> Option<f64> {
    let at = text.find(key)? + key.len();
    text[at..].split_whitespace().next()?.trim_end_matches(',').parse().ok()
}

/// `N calls recorded, L lost` from the summary.
fn recorded_lost(stderr: &str) -> Option<(u64, u64)> {
    let line = stderr.lines().find(|l| l.contains("calls recorded"))?;
    let words: Vec<&str> = line.split_whitespace().collect();
    let at = words.iter().position(|w| *w == "calls")?;
    let recorded = words.get(at.checked_sub(1)?)?.parse().ok()?;
    let lost_at = words.iter().position(|w| w.starts_with("lost"))?;
    let lost = words.get(lost_at.checked_sub(1)?)?.parse().ok()?;
    Some((recorded, lost))
}

fn traced(built: &Built, out: &Path, pairs: u64, rate: u64) -> anyhow::Result<Run> {
    traced_with(built, out, (pairs, rate), &[], false)
}

/// The paced loop under `trace` with `extra` flags (`--call-stack c`, `--ring-mb N`); `pinned`
/// puts the tracer on CPU 0 and the loop's threads on CPU 1, so that neither takes the other's.
fn traced_with(
    built: &Built,
    out: &Path,
    (pairs, rate): (u64, u64),
    extra: &[&str],
    pinned: bool,
) -> anyhow::Result<Run> {
    let _ = std::fs::remove_dir_all(out);
    let binary = built.binary.to_str().expect("utf-8 path");
    let mut command = if pinned { privileged("taskset") } else { privileged(binary) };
    if pinned {
        command.args(["-c", "0", binary]);
    }
    command.args(["trace", "--output"]).arg(out).arg("--lib").arg(&built.libascendcl).args(extra).arg("--");
    if pinned {
        command.args(["taskset", "-c", "1"]);
    }
    command.arg(&built.alloc_bench).args([pairs.to_string(), "0".into(), THREADS.to_string(), rate.to_string()]);
    let (stdout, stderr) = run_capture(&mut command)?;
    let _ = std::fs::remove_dir_all(out);
    let offered_calls_per_s = parse_after(&stdout, "calls_per_s ").context("alloc_bench printed no calls_per_s")?;
    let (recorded, lost) = recorded_lost(&stderr).with_context(|| format!("no summary line in:\n{stderr}"))?;
    Ok(Run { offered_calls_per_s, recorded, lost })
}

/// A sustained load: `rate` pairs/s on the two threads for `seconds`, traced with `extra`
/// (`pinned`: see [`traced_with`]); one table row (`label`, calls/s offered, recorded, lost).
pub fn sustained(
    built: &Built,
    dir: &Path,
    (seconds, rate): (u64, u64),
    (label, extra, pinned): (&str, &[&str], bool),
) -> anyhow::Result<String> {
    eprintln!("xtask bench: {label}, {rate} pairs/s for {seconds} s");
    let r = traced_with(built, &dir.join("out-sustained"), (seconds * rate, rate), extra, pinned)?;
    Ok(format!("| {label} | {seconds} | {:.0} | {} | {} |\n", r.offered_calls_per_s, r.recorded, r.lost))
}

pub fn run(built: &Built, dir: &Path, seconds: u64) -> anyhow::Result<String> {
    let mut md = format!(
        "\n## Loss by call rate ({THREADS} threads, about {seconds} s per rate)\n\n\
         | pairs/s asked | calls/s offered | calls recorded | lost | lost % |\n|---|---|---|---|---|\n"
    );
    let mut sustained = None;
    for rate in RATES {
        // As fast as they go is about 200k pairs/s per thread here; size that run the same way.
        let pairs = seconds * if rate == 0 { 200_000 } else { rate };
        eprintln!("xtask bench: loss at {} pairs/s", if rate == 0 { "max".into() } else { rate.to_string() });
        let r = traced(built, &dir.join("out-loss"), pairs, rate)?;
        let pct = 100.0 * r.lost as f64 / (r.recorded + r.lost).max(1) as f64;
        let asked = if rate == 0 { "as fast as possible".to_owned() } else { rate.to_string() };
        md.push_str(&format!("| {asked} | {:.0} | {} | {} | {pct:.2} |\n", r.offered_calls_per_s, r.recorded, r.lost));
        if r.lost == 0 {
            sustained = Some(sustained.map_or(r.offered_calls_per_s, |s: f64| s.max(r.offered_calls_per_s)));
        }
    }
    md.push_str(&match sustained {
        Some(s) => format!("\nHighest rate with nothing lost in this run: **{s:.0} calls/s**.\n"),
        None => "\nEvery rate lost records in this run.\n".to_owned(),
    });
    Ok(md)
}
