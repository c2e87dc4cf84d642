//! Stop time (`cargo xtask bench`, last part): how long after SIGTERM the DB is complete and the
//! tracer has exited, with over 100 probes and many live blocks (the target: the DB
//! complete within 1 s with 100 probe links and 1 M live blocks; a supervisor's SIGKILL follows
//! its SIGTERM within seconds).
//!
//! The traced job is `tests/workloads/standin_hold.py`: it allocates the blocks, says so in a
//! ready file and holds them. The tracer probes every stand-in library with `--probe-set all`.
//! "DB complete" is seen from outside, as a supervisor or Insight would: every device DB is
//! there and its `-wal` file is gone (the tracer folds the WAL into the DB as its last write),
//! checked afterwards to end with `STOP_TRACE`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};

use crate::build::Built;
use crate::util::privileged;

/// Every `device_*/dump/*.db` under the run folders of `out`, and whether each has no WAL.
fn dbs(out: &Path) -> Vec<(PathBuf, bool)> {
    let mut found = Vec::new();
    for run in std::fs::read_dir(out).into_iter().flatten().flatten() {
        for dev in std::fs::read_dir(run.path()).into_iter().flatten().flatten() {
            for f in std::fs::read_dir(dev.path().join("dump")).into_iter().flatten().flatten() {
                let path = f.path();
                if path.extension().is_some_and(|e| e == "db") {
                    let mut wal = path.clone().into_os_string();
                    wal.push("-wal");
                    found.push((path, !Path::new(&wal).exists()));
                }
            }
        }
    }
    found
}

fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    while !done() {
        if Instant::now() > deadline {
            bail!("{what} after {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

/// One stop: returns (probes, seconds to a complete DB, seconds to exit, live blocks it closed).
fn one(built: &Built, root: &Path, out: &Path, blocks: u64) -> anyhow::Result<(String, f64, f64, String)> {
    let _ = std::fs::remove_dir_all(out);
    std::fs::create_dir_all(out)?;
    let ready = out.join("ready");
    let mut tracer = privileged(built.binary.to_str().expect("utf-8 path"))
        .args(["trace", "--ring-mb", "256", "--probe-set", "all", "--output"])
        .arg(out.join("trace"))
        .arg("--lib")
        .arg(&built.torch.with_debug)
        .arg("--lib")
        .arg(&built.late_lib)
        .arg("--lib")
        .arg(&built.atb)
        .arg("--")
        .arg("python3")
        .arg(root.join("tests/workloads/standin_hold.py"))
        .arg("--ledger")
        .arg(out.join("ledger.jsonl"))
        .args(["--blocks", &blocks.to_string(), "--hold", "600", "--ready-file"])
        .arg(&ready)
        .env("ASCEND_HOME_PATH", &built.ascend_home)
        .stdin(Stdio::null())
        .stderr(std::fs::File::create(out.join("stderr"))?)
        .spawn()
        .context("cannot start memscope-bpf")?;
    wait_for("the workload did not allocate its blocks", Duration::from_secs(1200), || ready.exists())?;
    let workload: Option<i32> = std::fs::read_to_string(&ready).ok().and_then(|t| t.trim().parse().ok());
    // Let the tracer take in what the ring still holds, as a running job's tracer would have.
    std::thread::sleep(Duration::from_secs(2));
    let signalled = Instant::now();
    // SAFETY: plain kill(2) on our child.
    unsafe { libc::kill(tracer.id() as i32, libc::SIGTERM) };
    wait_for("the DB is not complete", Duration::from_secs(300), || {
        let found = dbs(&out.join("trace"));
        !found.is_empty() && found.iter().all(|(_, done)| *done)
    })?;
    let complete = signalled.elapsed().as_secs_f64();
    let status = tracer.wait()?;
    let exited = signalled.elapsed().as_secs_f64();
    if let Some(pid) = workload {
        // SAFETY: plain kill(2) on the workload, which holds its blocks until killed.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let stderr = std::fs::read_to_string(out.join("stderr")).unwrap_or_default();
    if !status.success() {
        bail!("the tracer failed ({status}):\n{stderr}");
    }
    for (db, _) in dbs(&out.join("trace")) {
        let last = Command::new("sqlite3")
            .arg(&db)
            .arg("SELECT \"Event Type\" FROM memscope_dump ORDER BY \"ID\" DESC LIMIT 1")
            .output()?;
        let last = String::from_utf8_lossy(&last.stdout).trim().to_owned();
        if last != "STOP_TRACE" {
            bail!("{} ends with {last:?}, not STOP_TRACE", db.display());
        }
    }
    let probes = stderr.split(": live: ").nth(1).and_then(|r| r.split_whitespace().next()).unwrap_or("?").to_owned();
    let live = stderr
        .split("live at end")
        .nth(1)
        .and_then(|r| r.split(" in ").nth(1))
        .map_or("?", |r| r.split_whitespace().next().unwrap_or("?"));
    Ok((probes, complete, exited, live.to_owned()))
}

/// Measures the stop `rounds` times with `blocks` live blocks; returns the results section.
pub fn run(built: &Built, root: &Path, out: &Path, blocks: u64, rounds: usize) -> anyhow::Result<String> {
    let mut md = format!(
        "\n## Stop time ({blocks} live blocks, --probe-set all on every stand-in library)\n\n\
         | run | probes | live blocks closed | SIGTERM → DB complete (s) | SIGTERM → exit (s) |\n|---|---|---|---|---|\n"
    );
    for round in 1..=rounds {
        eprintln!("xtask bench: stop time, run {round}/{rounds} ({blocks} live blocks)");
        let (probes, complete, exited, live) = one(built, root, out, blocks)?;
        md.push_str(&format!("| {round} | {probes} | {live} | {complete:.3} | {exited:.3} |\n"));
    }
    Ok(md)
}
