//! Analysis throughput (`cargo xtask bench`, third part): how long each offline analysis takes
//! on a real trace DB of about 10 million rows (the target: 10 M events in at most
//! 10 s). The DB is a trace of the allocation loop itself (every malloc and free a row), so its
//! shape is what `trace` writes, not a synthetic table.
//!
//! The report's figures on the same DB follow ([`super::report_page`]).
//!
//! With `--baseline-bin` an older binary runs the same commands on the same DB in the same run,
//! alternating with this one round by round, so a refactor is compared with what it replaced
//! under the same machine noise (issue 11: "no slower than today").

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context as _};

use crate::build::Built;
use crate::util::privileged;

/// Each timed command: `analyze --analysis X DB`, then `advise DB` (every analysis it draws on).
const ANALYSES: [&str; 5] = ["decompose", "leaks", "inefficient", "oom", "advise"];

/// What to time and against what.
pub struct Plan<'a> {
    pub pairs: u64,
    pub rounds: usize,
    pub baseline: Option<&'a Path>,
}

/// Traces `plan.pairs` allocation pairs into `out` and times each analysis on the device DB,
/// `plan.rounds` times (the median is reported), alternating with the baseline binary.
pub fn run(built: &Built, out: &Path, plan: &Plan<'_>) -> anyhow::Result<String> {
    let pairs = plan.pairs;
    eprintln!("xtask bench: analysis throughput, tracing {pairs} pairs for the DB");
    let _ = std::fs::remove_dir_all(out);
    super::measure::run_capture(
        privileged(built.binary.to_str().expect("utf-8 path"))
            .args(["trace", "--quiet", "--ring-mb", "256", "--output"])
            .arg(out)
            .arg("--lib")
            .arg(&built.libascendcl)
            .arg("--")
            .arg(&built.alloc_bench)
            .arg(pairs.to_string()),
    )?;
    let db = find_db(out).context("the traced loop left no device DB")?;
    let conn_rows = Command::new("sqlite3").arg(&db).arg("SELECT COUNT(*) FROM memscope_dump").output();
    let rows = conn_rows.ok().and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse::<u64>().ok());
    let rows_text = rows.map_or_else(|| "?".to_owned(), |r| r.to_string());
    let mut md = format!(
        "\n## Analysis throughput (one trace DB of {rows_text} rows: {pairs} aclrtMalloc+aclrtFree pairs; \
         median of {} rounds)\n\n",
        plan.rounds
    );
    match plan.baseline {
        None => md.push_str("| analysis | seconds | rows/s | runs |\n|---|---|---|---|\n"),
        Some(b) => md.push_str(&format!(
            "Baseline: `{}`, run alternately with this binary on the same DB.\n\n\
             | analysis | seconds | rows/s | runs | baseline seconds | baseline runs | this / baseline |\n\
             |---|---|---|---|---|---|---|\n",
            b.display()
        )),
    }
    for analysis in ANALYSES {
        let (mut ours, mut theirs) = (Vec::new(), Vec::new());
        for round in 0..plan.rounds {
            eprintln!("xtask bench: {analysis}, round {}/{}", round + 1, plan.rounds);
            ours.push(time(&built.binary, analysis, &db)?);
            if let Some(b) = plan.baseline {
                theirs.push(time(b, analysis, &db)?);
            }
        }
        let secs = super::measure::median(ours.clone());
        let rate = rows.map_or_else(|| "?".to_owned(), |r| format!("{:.0}", r as f64 / secs));
        md.push_str(&format!("| {analysis} | {secs:.2} | {rate} | {} |", runs(&ours)));
        if !theirs.is_empty() {
            let base = super::measure::median(theirs.clone());
            md.push_str(&format!(" {base:.2} | {} | {:.3}x |", runs(&theirs), secs / base));
        }
        md.push('\n');
    }
    md.push_str(&super::report_page::run(&built.binary, &db, rows, out)?);
    Ok(md)
}

/// Seconds one command takes, whole (opening the DB, the analysis, writing its tables).
fn time(binary: &Path, analysis: &str, db: &Path) -> anyhow::Result<f64> {
    let mut cmd = Command::new(binary);
    match analysis {
        "advise" => cmd.arg("advise"),
        _ => cmd.args(["analyze", "--analysis", analysis]),
    };
    let started = Instant::now();
    let result = cmd
        .arg(db)
        .stdout(std::process::Stdio::null())
        .output()
        .with_context(|| format!("cannot run {} {analysis}", binary.display()))?;
    let secs = started.elapsed().as_secs_f64();
    if !result.status.success() {
        let why = String::from_utf8_lossy(&result.stderr);
        bail!("{} {analysis} failed: {}", binary.display(), why.lines().last().unwrap_or("").trim());
    }
    Ok(secs)
}

fn runs(v: &[f64]) -> String {
    v.iter().map(|x| format!("{x:.2}")).collect::<Vec<_>>().join(", ")
}

fn find_db(out: &Path) -> Option<std::path::PathBuf> {
    for run in std::fs::read_dir(out).ok()?.filter_map(Result::ok) {
        for device in std::fs::read_dir(run.path()).ok()?.filter_map(Result::ok) {
            if !device.file_name().to_string_lossy().starts_with("device_") || device.file_name() == "device_cpu" {
                continue;
            }
            for f in std::fs::read_dir(device.path().join("dump")).ok()?.filter_map(Result::ok) {
                if f.path().extension().is_some_and(|e| e == "db") {
                    return Some(f.path());
                }
            }
        }
    }
    None
}
