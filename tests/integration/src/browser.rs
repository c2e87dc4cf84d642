//! A page as a user's browser shows it: tests/workloads/browser_check.py drives headless
//! Chromium (Debian's, which `cargo xtask setup` installs) over the DevTools protocol and reports
//! console errors, network requests, what expressions read from the DOM, and the DOM after clicks
//! on a canvas. Without Chromium a test says so and skips.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Debian's Chromium, or `None` after saying why the test skips.
pub fn chromium() -> Option<PathBuf> {
    let path = PathBuf::from("/usr/bin/chromium");
    if path.is_file() {
        Some(path)
    } else {
        eprintln!("SKIPPED: no Chromium at /usr/bin/chromium (`cargo xtask setup` installs Debian's chromium)");
        None
    }
}

/// What to do on the page: `evals` (NAME=EXPR) after the load, then per click fraction of the
/// canvas `timeline`, `after` (NAME=EXPR); a PNG of the page kept at `screenshot`.
#[derive(Default)]
pub struct Visit<'a> {
    pub evals: Vec<String>,
    pub clicks: Vec<f64>,
    pub after: Vec<String>,
    pub screenshot: Option<&'a Path>,
}

/// Opens `page` in `chromium` as `visit` says; the driver's JSON report.
pub fn visit(chromium: &Path, page: &Path, visit: &Visit<'_>) -> serde_json::Value {
    let driver = crate::var("MEMSCOPE_TAGS_WORKLOAD").with_file_name("browser_check.py");
    let mut cmd = Command::new("python3");
    cmd.arg(driver).arg(page).arg("--chromium").arg(chromium);
    for e in &visit.evals {
        cmd.args(["--eval", e]);
    }
    for c in &visit.clicks {
        cmd.args(["--click", &c.to_string()]);
    }
    for a in &visit.after {
        cmd.args(["--after", a]);
    }
    if let Some(shot) = visit.screenshot {
        cmd.arg("--screenshot").arg(shot);
    }
    let out = cmd.output().expect("python3 runs the browser driver");
    assert!(out.status.success(), "the browser driver failed: {}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("the driver prints JSON");
    assert_eq!(report["ready"], true, "the page never finished drawing: {report}");
    assert_eq!(report["errors"], serde_json::json!([]), "the page logged errors: {report}");
    assert_eq!(report["requests"], serde_json::json!([]), "the page asked the network: {report}");
    report
}
