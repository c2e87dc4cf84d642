//! The cost of `trace --python-trace` to the target, on a CPU-bound Python loop
//! (`tests/bench/py_loop.py`, three levels of small functions): the loop's wall time untraced,
//! under `trace` without the sampler and with it at its default rate (99 Hz), interleaved round
//! by round and compared by medians; the `python_trace` rows written per second of the loop;
//! and what one reading of the driver's figures (`--driver-every`) cost the helper, from the
//! traced runs' `ms_meta` (the stand-in DCMI here: a real driver's calls cost more).

use std::path::Path;
use std::process::Command;

use super::measure::{median, run_capture};
use crate::build::Built;
use crate::util::{privileged, root};

fn seconds(stdout: &str) -> anyhow::Result<f64> {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("seconds "))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no `seconds` in:\n{stdout}"))
}

fn job(iterations: u64) -> Vec<String> {
    let script = root().join("tests/bench/py_loop.py");
    vec!["python3".into(), script.display().to_string(), "--iterations".into(), iterations.to_string()]
}

/// One traced run: the loop's seconds and the run's DB of device 0.
fn traced(built: &Built, out: &Path, iterations: u64, extra: &[&str]) -> anyhow::Result<(f64, std::path::PathBuf)> {
    let _ = std::fs::remove_dir_all(out);
    let (stdout, _) = run_capture(
        privileged(built.binary.to_str().expect("utf-8 path"))
            .env("ASCEND_HOME_PATH", &built.ascend_home)
            .args(["trace", "--quiet", "--output"])
            .arg(out)
            .args(extra)
            .arg("--")
            .args(job(iterations)),
    )?;
    let run = std::fs::read_dir(out)?.next().ok_or_else(|| anyhow::anyhow!("no run folder in {}", out.display()))??;
    let dump = run.path().join("device_0/dump");
    let db = std::fs::read_dir(&dump)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "db"))
        .ok_or_else(|| anyhow::anyhow!("no DB in {}", dump.display()))?;
    Ok((seconds(&stdout)?, db))
}

fn query(db: &Path, sql: &str) -> Option<String> {
    let out = Command::new("sqlite3").arg(db).arg(sql).output().ok()?;
    Some(String::from_utf8_lossy(&out.stdout).trim().to_owned()).filter(|s| !s.is_empty())
}

pub fn run(built: &Built, dir: &Path, rounds: usize, iterations: u64) -> anyhow::Result<String> {
    let (mut off, mut plain, mut sampled) = (Vec::new(), Vec::new(), Vec::new());
    let (mut rows_per_s, mut query_us) = (Vec::new(), Vec::new());
    for round in 0..rounds.max(1) {
        eprintln!("xtask bench: python trace round {} of {}", round + 1, rounds.max(1));
        let args = job(iterations);
        let (stdout, _) =
            run_capture(Command::new(&args[0]).args(&args[1..]).env("ASCEND_HOME_PATH", &built.ascend_home))?;
        off.push(seconds(&stdout)?);
        plain.push(traced(built, &dir.join("out-pytrace-plain"), iterations, &[])?.0);
        let (s, db) = traced(built, &dir.join("out-pytrace"), iterations, &["--python-trace"])?;
        sampled.push(s);
        let table = query(&db, "SELECT name FROM sqlite_master WHERE name LIKE 'python_trace_%'").unwrap_or_default();
        if let Some(rows) = query(&db, &format!("SELECT count(*) FROM \"{table}\"")).and_then(|r| r.parse::<f64>().ok())
        {
            rows_per_s.push(rows / s);
        }
        if let Some(us) = query(&db, "SELECT value FROM ms_meta WHERE key = 'driver_query_us_mean'") {
            query_us.extend(us.parse::<f64>().ok());
        }
    }
    let (off, plain, sampled) = (median(off), median(plain), median(sampled));
    let pct = |v: f64| 100.0 * (v - off) / off;
    let mut md = format!(
        "\n## Python trace: the target's cost ({} rounds, medians, interleaved; {iterations} iterations of a \
         3-level call loop)\n\n| run | loop seconds | slowdown |\n|---|---|---|\n",
        rounds.max(1)
    );
    md.push_str(&format!("| untraced | {off:.3} | – |\n"));
    md.push_str(&format!("| `trace` | {plain:.3} | {:+.1} % |\n", pct(plain)));
    md.push_str(&format!(
        "| `trace --python-trace` (99 Hz) | {sampled:.3} | {:+.1} % ({:+.1} % against `trace`: the sampler's own) |\n",
        pct(sampled),
        100.0 * (sampled - plain) / plain
    ));
    if !rows_per_s.is_empty() {
        md.push_str(&format!("\n`python_trace` rows written: {:.0} per second of the loop.\n", median(rows_per_s)));
    }
    if !query_us.is_empty() {
        md.push_str(&format!(
            "The driver's figures (`--driver-every 1s`, stand-in DCMI): {:.0} µs per reading of every device \
             (the helper's own time; the trace's threads never wait on it).\n",
            median(query_us)
        ));
    }
    Ok(md)
}
