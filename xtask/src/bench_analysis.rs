//! Analysis throughput (`cargo xtask bench`, third part): how long each offline analysis takes
//! on a real trace DB of about 10 million rows (the target: 10 M events in at most
//! 10 s). The DB is a trace of the allocation loop itself (every malloc and free a row), so its
//! shape is what `trace` writes, not a synthetic table.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::Context as _;

use crate::build::Built;
use crate::util::privileged;

const ANALYSES: [&str; 4] = ["decompose", "leaks", "inefficient", "oom"];

/// Traces `pairs` allocation pairs into `out` and times each analysis on the device DB.
pub fn run(built: &Built, out: &Path, pairs: u64) -> anyhow::Result<String> {
    eprintln!("xtask bench: analysis throughput, tracing {pairs} pairs for the DB");
    let _ = std::fs::remove_dir_all(out);
    super::bench::run_capture(
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
    let mut md = format!(
        "\n## Analysis throughput (one trace DB of {} rows: {pairs} aclrtMalloc+aclrtFree pairs)\n\n\
         | analysis | seconds | rows/s |\n|---|---|---|\n",
        rows.map_or_else(|| "?".to_owned(), |r| r.to_string())
    );
    for analysis in ANALYSES {
        let started = Instant::now();
        let result = Command::new(&built.binary)
            .args(["analyze", "--analysis", analysis])
            .arg(&db)
            .stdout(std::process::Stdio::null())
            .output()
            .with_context(|| format!("cannot run analyze --analysis {analysis}"))?;
        let secs = started.elapsed().as_secs_f64();
        if result.status.success() {
            let rate = rows.map_or_else(|| "?".to_owned(), |r| format!("{:.0}", r as f64 / secs));
            md.push_str(&format!("| {analysis} | {secs:.2} | {rate} |\n"));
        } else {
            let why = String::from_utf8_lossy(&result.stderr);
            md.push_str(&format!("| {analysis} | – | not run: {} |\n", why.lines().last().unwrap_or("").trim()));
        }
    }
    Ok(md)
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
