//! The report on a big trace (`cargo xtask bench`, with the analysis throughput, on its DB of
//! about 10 million rows): how long `report` takes, how big the page is, and how long headless
//! Chromium takes to draw it and to redraw the owner tree after a click on the timeline
//! (tests/workloads/browser_check.py, the driver the report's tests use). The page is aggregated
//! in Rust, so its size and drawing time must not grow with the rows.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context as _};

/// Times `report DB`, then opens the page in Chromium (when installed); returns the section.
pub fn run(binary: &Path, db: &Path, rows: Option<u64>, out: &Path) -> anyhow::Result<String> {
    let page = out.join("report.html");
    eprintln!("xtask bench: report of {}", db.display());
    let started = Instant::now();
    let run = Command::new(binary).arg("report").arg(db).arg("-o").arg(&page).output().context("cannot run report")?;
    let secs = started.elapsed().as_secs_f64();
    if !run.status.success() {
        bail!("report failed: {}", String::from_utf8_lossy(&run.stderr).trim());
    }
    let size = std::fs::metadata(&page)?.len();
    let db_size = std::fs::metadata(db)?.len();
    let rows_text = rows.map_or_else(|| "?".to_owned(), |r| r.to_string());
    let mut md = format!(
        "\n## Report of the same DB (`memscope-bpf report DB -o report.html`)\n\n\
         | rows | DB size | report seconds | page size | Chromium: drawn after | a click's tree after |\n\
         |---|---|---|---|---|---|\n| {rows_text} | {:.0} MiB | {secs:.2} | {:.2} MiB |",
        db_size as f64 / (1 << 20) as f64,
        size as f64 / (1 << 20) as f64,
    );
    match browse(&page) {
        Ok((load_ms, click_ms)) => md.push_str(&format!(" {load_ms} ms | {click_ms:.0} ms |\n")),
        Err(e) => md.push_str(&format!(" not measured ({e:#}) | |\n")),
    }
    Ok(md)
}

/// Chromium's drawing time of the page, and of the tree after a click (ms).
fn browse(page: &Path) -> anyhow::Result<(u64, f64)> {
    if !Path::new("/usr/bin/chromium").is_file() {
        bail!("no /usr/bin/chromium; `cargo xtask setup` installs it");
    }
    let driver = crate::util::root().join("tests/workloads/browser_check.py");
    let timed = "ms=(() => { const t = performance.now(); document.getElementById('timeline').dispatchEvent(new MouseEvent('mousedown', {clientX: 400})); document.getElementById('timeline').dispatchEvent(new MouseEvent('mouseup', {clientX: 400})); return performance.now() - t; })()";
    let out =
        Command::new("python3").arg(driver).arg(page).args(["--eval", timed]).output().context("cannot run python3")?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("the driver failed: {}", String::from_utf8_lossy(&out.stderr)))?;
    if v["ready"] != true || v["errors"] != serde_json::json!([]) {
        bail!("the page did not draw cleanly: {v}");
    }
    Ok((v["load_ms"].as_u64().unwrap_or(0), v["dom"]["ms"].as_f64().unwrap_or(f64::NAN)))
}
