//! Privileged tests of how `memscope-bpf trace` stops: the DB is complete soon after the signal
//! even with many probes and many live blocks (a supervisor's SIGKILL follows its SIGTERM within
//! seconds), SIGHUP stops like SIGTERM, and a closed stderr does not end the trace. Ground truth
//! is the workloads' own ledgers.

use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use memscope_integration::*;

const LIVE_TIMEOUT: Duration = Duration::from_secs(60);

/// The workload that allocates `--blocks` blocks and holds them (tests/workloads).
fn hold_workload(env: &TestEnv) -> PathBuf {
    env.workload.with_file_name("standin_hold.py")
}

/// The probe count from the tracer's "live: N probes" line.
fn probes_live(stderr: &str) -> usize {
    let line = stderr.lines().find(|l| l.contains(": live: ")).unwrap_or_else(|| panic!("no live line:\n{stderr}"));
    line.split(": live: ").nth(1).and_then(|r| r.split_whitespace().next()).and_then(|n| n.parse().ok()).unwrap()
}

/// What a finished DB has: `STOP_TRACE` last, the stop reason, its WAL folded into the file,
/// and a clean integrity check.
fn assert_complete(out: &Output, reason: &str) {
    assert!(!out.files.is_empty(), "no DB was written");
    for (folder, (path, rows)) in &out.files {
        let mut wal = path.clone().into_os_string();
        wal.push("-wal");
        let wal = PathBuf::from(wal);
        let wal_len = std::fs::metadata(&wal).map_or(0, |m| m.len());
        assert_eq!(wal_len, 0, "{folder}: the WAL {} was not folded into the DB", wal.display());
        assert_eq!(db_health(path).0, "ok", "{folder}");
        assert_eq!(rows.last().map(|r| r.event_type.as_str()), Some("STOP_TRACE"), "{folder}: no STOP_TRACE");
        let got = meta(path, "stop_reason");
        assert!(got.as_deref().is_some_and(|r| r.contains(reason)), "{folder}: stop_reason {got:?}, want {reason}");
        assert!(meta(path, "stop_ns").is_some(), "{folder}: the final ms_meta keys are missing");
    }
}

fn kill(pid: u32, sig: i32) {
    // SAFETY: plain kill(2).
    unsafe { libc::kill(pid as i32, sig) };
}

/// A supervisor's stop (`docker stop`, Kubernetes): SIGTERM, then SIGKILL 1.5 s later. With
/// more than 100 probes and 50,000 live blocks the DB must be complete by then: every live block
/// of the workload's ledger has its shadow FREE, STOP_TRACE and the final metadata are written
/// and the WAL is folded. (Before, the probes were detached first, about 0.11 s per probe in the
/// kernel, and the SIGKILL found the DB unfinished.)
#[test]
fn a_sigkill_1_5_s_after_sigterm_finds_the_db_complete() {
    let env = env("stop_sigkill_after_sigterm");
    let out = env.scratch.join("out");
    let ledger_path = env.scratch.join("ledger.jsonl");
    let ready = env.scratch.join("ready");
    let (torch, late, atb) = (var("MEMSCOPE_TORCH_WITH_DEBUG"), var("MEMSCOPE_LATE_LIB"), var("MEMSCOPE_ATB_LIB"));
    let s = |p: &Path| p.display().to_string();
    let blocks = 50_000;
    let args: Vec<String> = [
        "trace",
        "--output",
        &s(&out),
        "--probe-set",
        "all",
        "--lib",
        &s(&torch),
        "--lib",
        &s(&late),
        "--lib",
        &s(&atb),
        "--",
        "python3",
        &s(&hold_workload(&env)),
        "--ledger",
        &s(&ledger_path),
        "--blocks",
        &blocks.to_string(),
        "--ready-file",
        &s(&ready),
        "--hold",
        "120",
    ]
    .map(str::to_owned)
    .to_vec();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut tracer = Tracer::spawn(&env, &args, &[("ASCEND_HOME_PATH", &env.ascend_home)]);
    tracer.wait_live(LIVE_TIMEOUT);
    let deadline = Instant::now() + Duration::from_secs(180);
    let workload_pid: u32 = loop {
        if let Ok(text) = std::fs::read_to_string(&ready) {
            break text.trim().parse().unwrap();
        }
        assert!(tracer.child.try_wait().unwrap().is_none(), "tracer exited early:\n{}", tracer.stderr());
        assert!(Instant::now() < deadline, "the workload did not allocate its blocks:\n{}", tracer.stderr());
        std::thread::sleep(Duration::from_millis(50));
    };
    let probes = probes_live(&tracer.stderr());
    assert!(probes >= 100, "only {probes} probes: the test needs at least 100\n{}", tracer.stderr());

    let term = Instant::now();
    tracer.signal(libc::SIGTERM);
    std::thread::sleep(Duration::from_millis(1500).saturating_sub(term.elapsed()));
    tracer.signal(libc::SIGKILL);
    // The workload shares the tracer's stderr: it goes too, so the reader sees the pipe close.
    kill(workload_pid, libc::SIGKILL);
    // Generous: the old tracer took minutes to exit, closing its probes one by one.
    let (code, stderr) = tracer.finish(Duration::from_secs(180));
    println!("tracer exit {code:?} (None: killed)\n{stderr}");

    let ledger = read_ledger(&ledger_path);
    let out = read_output(&out);
    assert_complete(&out, "SIGTERM");
    let mut want = live_at_end(&ledger);
    want.sort_by_key(|(_, p)| *p);
    assert_eq!(want.len(), blocks, "the ledger's live blocks");
    assert_eq!(shadow_frees(&out), want, "every live block has its shadow FREE");
    // Every allocation is recorded, in order, with its values.
    assert_exact(&ledger, &out);
    assert!(stderr.contains("stopping"), "no stopping line:\n{stderr}");
}

/// SIGHUP (a closed terminal, a supervisor's hang-up) stops the trace as SIGTERM does: exit 0,
/// a complete DB that holds every call made before the signal. (Before: killed by the signal,
/// exit 129, the DB unfinished.)
#[test]
fn sighup_stops_cleanly_with_a_complete_db() {
    let env = env("stop_sighup");
    let out = env.scratch.join("out");
    let ledger_path = env.scratch.join("ledger.jsonl");
    let out_s = out.display().to_string();
    let mut args = vec!["trace".to_owned(), "--output".into(), out_s, "--".into()];
    args.extend(workload_args(&env, &ledger_path, &["--duration", "5", "--step-sleep-ms", "10", "--keep-weights"]));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut tracer = Tracer::spawn(&env, &args, &[("ASCEND_HOME_PATH", &env.ascend_home)]);
    tracer.wait_live(LIVE_TIMEOUT);
    std::thread::sleep(Duration::from_secs(2));
    let stop = wall_ns();
    tracer.signal(libc::SIGHUP);
    let (code, stderr) = tracer.finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("SIGHUP"), "{stderr}");
    // The workload was not in the signal's way: it finishes and writes its ledger.
    std::thread::sleep(Duration::from_secs(5));
    let ledger = read_ledger(&ledger_path);
    let out = read_output(&out);
    assert_complete(&out, "SIGHUP");
    assert_attached(&ledger, &out, 0, 0, stop - CLOCK_TOLERANCE_NS);
    assert!(!shadow_frees(&out).is_empty(), "weights alive at the stop get shadow frees");
}

/// `trace ... 2>&1 | head -1`: stderr is a pipe whose reader is gone. Every write to it fails
/// (EPIPE; Rust ignores SIGPIPE), and the trace must go on and finish its DB: exit 0, every call
/// of the ledger in the DB. (Before: a panic on the first line, exit 101, an empty run folder.)
#[test]
fn a_closed_stderr_does_not_end_the_trace() {
    let env = env("stop_closed_stderr");
    let out = env.scratch.join("out");
    let ledger_path = env.scratch.join("ledger.jsonl");
    let mut fds = [0; 2];
    // SAFETY: pipe(2) fills both descriptors, which we then own.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: fresh descriptors from pipe(2), each owned once.
    let (read_end, write_end) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(read_end);
    let mut cmd = std::process::Command::new(&env.bin);
    cmd.args(["trace", "--output"]).arg(&out).arg("--");
    cmd.args(workload_args(&env, &ledger_path, &["--steps", "4", "--keep-weights"]));
    cmd.env("ASCEND_HOME_PATH", &env.ascend_home).stdin(Stdio::null()).stdout(Stdio::null());
    let mut child = cmd.stderr(Stdio::from(write_end)).spawn().expect("start memscope-bpf");
    let code = wait_child(&mut child, Duration::from_secs(120));
    assert_eq!(code, 0, "the tracer failed with a closed stderr");
    let ledger = read_ledger(&ledger_path);
    let out = read_output(&out);
    assert_complete(&out, "target exited");
    assert_exact(&ledger, &out);
}
