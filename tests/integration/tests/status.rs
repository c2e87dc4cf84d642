//! Privileged tests of `trace`'s live status: the JSON lines a program reads (`--json`), and the
//! status area a person sees on a real terminal (tmux), against the stand-in job's own ledger;
//! and the progress bar of a long offline pass (`analyze` on a big DB) on that terminal.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use memscope_integration::*;

/// Device bytes the stand-in driver hands out for a ledger: each aclrtMalloc's size + 32,
/// rounded up to 32 (standin_ascendcl.c's header).
fn ledger_live_bytes(ledger: &Path) -> u64 {
    read_ledger(ledger)
        .iter()
        .filter(|e| e.api == "aclrtMalloc" && e.rc == 0)
        .filter_map(|e| e.size)
        .map(|n| (n + 32).div_ceil(32) * 32)
        .sum()
}

/// `standin_hold.py` under `trace` with `extra` flags: its blocks, then a hold.
fn hold_command(env: &TestEnv, extra: &[&str], hold: &str) -> (Vec<String>, std::path::PathBuf) {
    let ledger = env.scratch.join("hold.jsonl");
    let s = |p: &Path| p.display().to_string();
    let mut args: Vec<String> = vec![s(&env.bin), "trace".into(), "--output".into(), s(&env.scratch.join("out"))];
    args.extend(extra.iter().map(|a| a.to_string()));
    args.extend(["--".into(), "python3".into(), s(&env.workload.with_file_name("standin_hold.py"))]);
    args.extend(["--ledger".into(), s(&ledger), "--blocks".into(), "300".into(), "--size".into(), "5000".into()]);
    args.extend(["--hold".into(), hold.into(), "--ready-file".into(), s(&ledger.with_extension("ready"))]);
    (args, ledger)
}

#[test]
fn json_status_lines_say_the_ledgers_live_bytes_every_second() {
    let env = env("status_json");
    let (args, ledger) = hold_command(&env, &["--json"], "3");
    let out = Command::new(&args[0])
        .args(&args[1..])
        .env("ASCEND_HOME_PATH", &env.ascend_home)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert!(lines.len() >= 2, "a line a second over a 3 s hold: {lines:?}");
    let elapsed: Vec<f64> = lines.iter().map(|l| l["elapsed_s"].as_f64().unwrap()).collect();
    assert!(elapsed.windows(2).all(|w| w[1] > w[0] + 0.5), "{elapsed:?}");
    // During the hold every block is live: the last line has the ledger's bytes and calls.
    let last = lines.last().unwrap();
    let device = &last["devices"].as_array().unwrap().iter().find(|d| d["device"] == "0").unwrap();
    let want = ledger_live_bytes(&ledger);
    assert_eq!(device["live_bytes"].as_u64(), Some(want), "{last}");
    assert_eq!(device["peak_bytes"].as_u64(), Some(want), "{last}");
    let owners: u64 = last["owners"].as_array().unwrap().iter().map(|o| o["bytes"].as_u64().unwrap()).sum();
    assert_eq!(owners, want, "the owners add up to the device's live bytes: {last}");
    assert!(last["calls"].as_u64().unwrap() >= 301, "{last}");
    assert_eq!(last["lost"].as_u64(), Some(0));
}

/// The screen of tmux session `name`, blank lines left out.
fn screen(name: &str) -> String {
    let out = Command::new("tmux").args(["capture-pane", "-p", "-t", name]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).lines().filter(|l| !l.trim().is_empty()).collect::<Vec<_>>().join("\n")
}

struct Tmux(String);

impl Tmux {
    /// Runs `command` (shell text) on a 150x40 terminal of a tmux session of its own; the
    /// returned path exists once the command has ended. `None` (said why) without tmux.
    fn start(env: &TestEnv, what: &str, command: &str) -> Option<(Self, std::path::PathBuf)> {
        if Command::new("tmux").arg("-V").output().is_err() {
            eprintln!("SKIPPED: no tmux (`cargo xtask setup` installs it)");
            return None;
        }
        let done = env.scratch.join("done");
        let script = format!("{command}; touch '{}'; sleep 60", done.display());
        let session = Self(format!("memscope-{what}-{}", std::process::id()));
        let started = Command::new("tmux")
            .args(["new-session", "-d", "-s", &session.0, "-x", "150", "-y", "40", &script])
            .status();
        assert!(started.unwrap().success());
        Some((session, done))
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux").args(["kill-session", "-t", &self.0]).status();
    }
}

#[test]
fn on_a_terminal_the_status_area_is_redrawn_in_place_and_cleared_for_the_summary() {
    let env = env("status_terminal");
    let (args, ledger) = hold_command(&env, &[], "4");
    let quoted: Vec<String> = args.iter().map(|a| format!("'{a}'")).collect();
    let command = format!("ASCEND_HOME_PATH='{}' {}", env.ascend_home.display(), quoted.join(" "));
    let Some((session, done)) = Tmux::start(&env, "status", &command) else { return };
    // While the job holds its blocks: the area, with the ledger's bytes.
    let want = format!("device 0: {} live", human(ledger_live_bytes_when_written(&ledger)));
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = screen(&session.0);
        if now.contains(&want) && now.contains("tracing for 0:0") && now.contains("owners: CANN@APP") {
            break;
        }
        assert!(Instant::now() < deadline, "no status area saying {want:?}:\n{now}");
        std::thread::sleep(Duration::from_millis(200));
    }
    // After the stop: the summary, and no trace of the area.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done.exists() {
        assert!(Instant::now() < deadline, "the trace did not end:\n{}", screen(&session.0));
        std::thread::sleep(Duration::from_millis(200));
    }
    let end = screen(&session.0);
    assert!(end.contains("live at end") && !end.contains("tracing for"), "{end}");
    assert_eq!(end.matches("memscope-bpf: live:").count(), 1, "the lines before the area are kept once:\n{end}");
}

/// The ledger's live bytes, once the job has written its ledger (its ready file comes after).
fn ledger_live_bytes_when_written(ledger: &Path) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ledger.with_extension("ready").exists() {
        assert!(Instant::now() < deadline, "the job wrote no ledger");
        std::thread::sleep(Duration::from_millis(100));
    }
    ledger_live_bytes(ledger)
}

/// Bytes as the status writes them (binary units, one decimal): an independent spelling.
fn human(bytes: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB"];
    let (mut value, mut unit) = (bytes as f64, 0);
    while value >= 1024.0 && unit < units.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", units[unit])
    }
}

#[test]
fn a_long_analysis_shows_its_progress_on_a_terminal_and_clears_it_for_the_report() {
    let env = env("status_progress");
    // Six million rows in msMemScope's layout, written by Python's sqlite3: a few seconds of
    // analysis, so a pass runs past the second after which its bar shows.
    let db = env.scratch.join("big.db");
    let made =
        Command::new("python3").arg(env.workload.with_file_name("big_db.py")).arg(&db).arg("3000000").status().unwrap();
    assert!(made.success());
    let command = format!("'{}' analyze '{}' --analysis decompose --no-write", env.bin.display(), db.display());
    let Some((session, done)) = Tmux::start(&env, "progress", &command) else { return };
    let mut seen = None;
    while !done.exists() {
        let now = screen(&session.0);
        if let Some(line) = now.lines().find(|l| l.starts_with("analyze big.db [")) {
            seen = Some(line.to_owned());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let line = seen.expect("no progress bar while the analysis ran");
    assert!(line.contains("% ") && line.contains(" rows/s, ") && line.ends_with(" left"), "{line}");
    let end = screen(&session.0);
    assert!(end.contains("blocks allocated: HAL 3000000") && !end.contains("analyze big.db ["), "{end}");
}

/// `daemon` on a terminal: the same status area, a line per running job's device with its
/// ledger's bytes, cleared when the daemon stops.
#[test]
fn on_a_terminal_the_daemon_shows_each_running_jobs_bytes_and_clears_them_when_it_stops() {
    let env = env("status_daemon");
    let out = env.scratch.join("out");
    let command = format!(
        "ASCEND_HOME_PATH='{}' '{}' daemon --output '{}' --listen 127.0.0.1:0 --duration 12",
        env.ascend_home.display(),
        env.bin.display(),
        out.display()
    );
    let Some((session, done)) = Tmux::start(&env, "daemon", &command) else { return };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !screen(&session.0).contains("memscope-bpf: live: daemon") {
        assert!(Instant::now() < deadline, "the daemon never went live:\n{}", screen(&session.0));
        std::thread::sleep(Duration::from_millis(100));
    }
    let ledger = env.scratch.join("job.jsonl");
    let s = |p: &Path| p.display().to_string();
    let ready = ledger.with_extension("ready");
    let job = Command::new("python3")
        .arg(env.workload.with_file_name("standin_hold.py"))
        .args([
            "--ledger",
            &s(&ledger),
            "--blocks",
            "200",
            "--size",
            "7000",
            "--hold",
            "30",
            "--ready-file",
            &s(&ready),
        ])
        .env("ASCEND_HOME_PATH", &env.ascend_home)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let job = Killed(job);
    let want = format!("device 0: {} live", human(ledger_live_bytes_when_written(&ledger)));
    let pid = std::fs::read_to_string(&ready).unwrap().trim().to_owned();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let now = screen(&session.0);
        let line = now.lines().find(|l| l.trim_start().starts_with(&format!("job {pid} (")));
        if line.is_some_and(|l| l.contains(&want)) && now.contains("· 1 job(s) ·") {
            break;
        }
        assert!(Instant::now() < deadline, "no status line for job {pid} saying {want:?}:\n{now}");
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(job);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done.exists() {
        assert!(Instant::now() < deadline, "the daemon did not stop:\n{}", screen(&session.0));
        std::thread::sleep(Duration::from_millis(200));
    }
    let end = screen(&session.0);
    assert!(end.contains("daemon stopped") && !end.contains("tracing for"), "{end}");
}
