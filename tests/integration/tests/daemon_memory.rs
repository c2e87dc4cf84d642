//! Privileged test of the daemon's memory bound (docs/metrics.md "The daemon's own memory"): at
//! most 64 MiB + 8 MiB per open job + 256 bytes per recorded live block, and each job's flight
//! recorder's 320 bytes per row or block it keeps, read by the test as the
//! daemon's peak resident memory (`VmHWM`), while 4 stand-in jobs hold 100 000 runtime blocks
//! each (never sampled: every one of them is recorded). The jobs' ledgers say how many blocks
//! are live; the scrape says when the daemon has taken them all in.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use memscope_integration::*;

const JOBS: u32 = 4;
const BLOCKS: u64 = 100_000;

/// The bound the docs state, for `jobs` open jobs and `blocks` recorded live blocks (every one
/// is, here: runtime blocks are never sampled), with each job's flight recorder at its default
/// bounds (20 000 rows, 50 000 blocks held past them), and its feed's tracker following every
/// live block (the daemon samples by default): 320 bytes per row, block held or block tracked
/// (`memscope_core::ingest::flight::{ROW_BYTES, BLOCK_BYTES, TRACKED_BYTES}`).
fn documented_cap(jobs: u64, blocks: u64) -> u64 {
    const FLIGHT_BYTES: u64 = 320;
    let per_job = blocks / jobs.max(1);
    let kept = 20_000.min(per_job) + 50_000.min(per_job.saturating_sub(20_000));
    let flight = (kept + per_job) * FLIGHT_BYTES;
    (64 << 20) + jobs * (8 << 20) + blocks * 256 + jobs * flight
}

/// A `/proc/PID/status` figure in bytes.
fn status_bytes(pid: u32, key: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in /proc/{pid}/status"));
    kib * 1024
}

fn start_job(env: &TestEnv, i: u32) -> (Killed, PathBuf, PathBuf) {
    let s = |p: &Path| p.display().to_string();
    let (ledger, ready) = (env.scratch.join(format!("hold{i}.jsonl")), env.scratch.join(format!("hold{i}.ready")));
    let process = Command::new("python3")
        .arg(env.workload.with_file_name("standin_hold.py"))
        .args(["--ledger", &s(&ledger), "--ready-file", &s(&ready), "--device", &i.to_string()])
        .args(["--blocks", &BLOCKS.to_string(), "--size", "64", "--hold", "300"])
        .env("ASCEND_HOME_PATH", &env.ascend_home)
        .env("STANDIN_ACL_DEVICE_COUNT", "4")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("start a stand-in job");
    (Killed(process), ledger, ready)
}

#[test]
fn the_daemons_peak_memory_stays_within_its_documented_bound() {
    let env = env("daemon_memory");
    let out = env.scratch.join("out");
    let mut args = vec!["daemon", "--output", out.to_str().unwrap(), "--listen", "127.0.0.1:0"];
    args.extend(ALWAYS_PROBED);
    let mut daemon = Tracer::spawn(&env, &args, &[("ASCEND_HOME_PATH", &env.ascend_home)]);
    daemon.wait_live(Duration::from_secs(60));
    let idle = status_bytes(daemon.child.id(), "VmRSS:");
    // One after another: the test is of memory, not of four jobs' bursts at once (400 000 calls
    // in a second, with each job's flight-recorder feed, outrun a 2-core machine's ring).
    let mut jobs = Vec::new();
    for i in 0..JOBS {
        let (mut process, ledger, ready) = start_job(&env, i);
        wait_for_file(&ready, &mut process.0, Duration::from_secs(120));
        jobs.push((process, ledger, ready));
    }
    let mut live = 0;
    for (_, ledger, _) in &mut jobs {
        let entries = read_ledger(ledger);
        live += entries.iter().filter(|e| e.api == "aclrtMalloc" && e.rc == 0).count() as u64;
    }
    assert_eq!(live, u64::from(JOBS) * BLOCKS);

    // Every block taken in: the scrape's live blocks are the ledgers'.
    let metrics = metrics_address(&daemon.stderr());
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, body) = get(metrics, "/metrics").unwrap();
        let seen: u64 = body
            .lines()
            .filter(|l| l.starts_with("memscope_live_blocks{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum();
        if seen == live {
            break;
        }
        assert!(Instant::now() < deadline, "the daemon has {seen} of {live} blocks:\n{}", daemon.stderr());
        std::thread::sleep(Duration::from_millis(300));
    }
    // A renewal and a commit later: the peak includes them.
    std::thread::sleep(Duration::from_millis(1500));
    let peak = status_bytes(daemon.child.id(), "VmHWM:");
    let cap = documented_cap(u64::from(JOBS), live);
    println!(
        "daemon: {} MiB idle, peak {} MiB with {JOBS} jobs and {live} blocks; bound {} MiB",
        idle >> 20,
        peak >> 20,
        cap >> 20
    );
    assert!(peak <= cap, "peak RSS {} MiB over the documented {} MiB", peak >> 20, cap >> 20);
    drop(jobs);
    daemon.signal(libc::SIGTERM);
    let (code, stderr) = daemon.finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");
}
