//! Privileged test of the daemon's flight recorder: a stand-in job whose caching allocator runs
//! out of memory twice (tests/workloads/standin_fragment.py's `oom` scenario: fragmentation,
//! then a full device) gets a recording at its first OOM and another on request (`POST
//! /flight-recording?pid=N`), each a run folder in OUTPUT/flight/ whose DB's OOM forensics are
//! those of the job's own full DB at the same failures, with PyTorch's memory snapshot and the
//! report beside it; the metrics name the recordings.
//!
//! Under the daemon's sampling the job's own DB lacks most of the blocks; its recording must
//! not: its forensics are those of a full `trace` of the same workload.
//!
//! Ground truth: the job's own DB (the daemon records every call in the first test,
//! `--sample-bytes 0`: a full trace of the same run), a `trace` of the same deterministic
//! workload (the second), the allocator's ledger (the two failures it gave up on), PyTorch's
//! `_memory_viz.py` for the snapshot.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use memscope_integration::*;

/// The folder the daemon's log names for job `pid`'s recording for `reason`, once it does.
fn recording(daemon: &Tracer, pid: u32, reason: &str, within: Duration) -> PathBuf {
    let said = format!("job {pid}: flight recording ({reason}) in ");
    let deadline = Instant::now() + within;
    loop {
        let stderr = daemon.stderr();
        if let Some(line) = stderr.lines().find(|l| l.contains(&said)) {
            return PathBuf::from(line.split(&said).nth(1).unwrap().trim());
        }
        assert!(!stderr.lines().any(|l| l.contains("flight recording") && l.contains("failed")), "{stderr}");
        assert!(Instant::now() < deadline, "no {reason} recording of job {pid}:\n{stderr}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `analyze --analysis oom --json` of a run folder's device 0: its incidents, numbers left out.
fn incidents(env: &TestEnv, run: &Path) -> Vec<serde_json::Value> {
    let out = Command::new(&env.bin)
        .args(["analyze", "--analysis", "oom", "--device", "0", "--json", "--no-write"])
        .arg(run)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let all: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let report = all.as_array().unwrap().first().expect("device 0's report");
    let mut incidents = report["incidents"].as_array().unwrap().clone();
    for i in &mut incidents {
        i.as_object_mut().unwrap().remove("number");
    }
    incidents
}

#[test]
fn an_oom_under_the_daemon_is_recorded_with_the_forensics_of_the_jobs_full_db() {
    let env = env("daemon_flight");
    let s = |p: &Path| p.display().to_string();
    let (out, torch) = (env.scratch.join("out"), var("MEMSCOPE_TORCH_WITH_DEBUG"));
    let args = ["daemon", "--output", &s(&out), "--listen", "127.0.0.1:0", "--lib", &s(&torch), "--sample-bytes", "0"];
    let mut daemon = Tracer::spawn(&env, &args, &[("ASCEND_HOME_PATH", &env.ascend_home)]);
    daemon.wait_live(Duration::from_secs(60));
    let (mut job, ledger) = oom_job(&env, "oom");
    let pool = pool_ledger_path(&ledger);
    let pid = job.0.id();
    let oom = recording(&daemon, pid, "oom", Duration::from_secs(120));
    // The ledger is written once the scenario is over (both failures), before the hold.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !ledger.exists() {
        assert!(Instant::now() < deadline && job.0.try_wait().unwrap().is_none(), "the job ended early");
        std::thread::sleep(Duration::from_millis(200));
    }
    let metrics = metrics_address(&daemon.stderr());
    let (status, said) = post(metrics, &format!("/flight-recording?pid={pid}"));
    assert_eq!(status, 202, "{said}");
    let asked = recording(&daemon, pid, "request", Duration::from_secs(60));
    // SIGUSR1 asks for every job's.
    daemon.signal(libc::SIGUSR1);
    let said = format!("job {pid}: flight recording (request) in ");
    let deadline = Instant::now() + Duration::from_secs(60);
    let latest = loop {
        let stderr = daemon.stderr();
        let folders: Vec<&str> = stderr.lines().filter_map(|l| l.split(&said).nth(1)).collect();
        if let [_, second] = folders[..] {
            break PathBuf::from(second.trim());
        }
        assert!(Instant::now() < deadline, "no second request recording after SIGUSR1:\n{stderr}");
        std::thread::sleep(Duration::from_millis(200));
    };
    // The metrics are renewed every half second: the recordings show at the next renewal.
    let pid_label = format!("pid=\"{pid}\"");
    let folder = format!("folder=\"{}\"", latest.display());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, body) = get(metrics, "/metrics").unwrap();
        let count = |reason: &str| {
            body.lines()
                .find(|l| {
                    l.starts_with("memscope_flight_recordings_total{") && l.contains(&pid_label) && l.contains(reason)
                })
                .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        };
        let counts = (count("reason=\"oom\""), count("reason=\"request\""));
        if counts == (Some(1), Some(2)) && body.contains(&folder) {
            break;
        }
        assert!(Instant::now() < deadline, "recordings {counts:?}, the last one named {folder}?\n{body}");
        std::thread::sleep(Duration::from_millis(200));
    }
    job.0.kill().unwrap();
    job.0.wait().unwrap();
    daemon.signal(libc::SIGTERM);
    let (code, stderr) = daemon.finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");

    // The job's own DB: every call, so the forensics of a full trace of this run.
    let runs: Vec<PathBuf> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with(&format!("memscope_{pid}_")))
        .collect();
    assert_eq!(runs.len(), 1, "{runs:?}");
    let full = incidents(&env, &runs[0]);
    let gave_up = read_pool_ledger(&pool).iter().filter(|e| e.ev == "oom").count();
    let failures = full.iter().filter(|i| i["verdict"] != "recovered").count();
    assert_eq!(failures, gave_up, "the job's DB has the allocator's failures");
    let at_oom = incidents(&env, &oom);
    assert!(!at_oom.is_empty() && full.starts_with(&at_oom), "at the OOM: {at_oom:#?}\nfull: {full:#?}");
    assert_eq!(incidents(&env, &asked), full, "asked for after both failures");
    for dir in [&oom, &asked] {
        assert!(oom.parent().unwrap().ends_with("flight"), "{}", dir.display());
        let html = std::fs::read_to_string(dir.join("report.html")).unwrap();
        assert!(html.contains("\"table\":\"ms_oom\"") && html.trim_end().ends_with("</html>"), "{}", dir.display());
        let dump = dir.join("device_0/dump");
        let db = std::fs::read_dir(&dump)
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.extension().is_some_and(|x| x == "db"));
        let db = rusqlite::Connection::open(db.expect("the recording's DB")).unwrap();
        let stored: i64 = db.query_row("SELECT count(*) FROM ms_oom", [], |r| r.get(0)).unwrap();
        assert!(stored >= 1, "the forensics are stored in {}", dir.display());
        let mode: String = db.query_row("SELECT value FROM ms_meta WHERE key = 'mode'", [], |r| r.get(0)).unwrap();
        assert_eq!(mode, "flight");
    }
    if let Some((python, _)) = real_torch() {
        let said = pytorch_reads(&env, &python, &asked.join("snapshot_0.pickle"));
        assert!(said["segments"].as_u64().is_some(), "{said}");
    }
}

/// A `POST` with an empty body: (status, body).
fn post(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    use std::io::{Read as _, Write as _};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(s, "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let status = text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, text)
}

/// The `oom` scenario's command line (`python3 standin_fragment.py ...`), held `hold` seconds
/// after it, and its ledger.
fn oom_scenario(env: &TestEnv, tag: &str, hold: &str) -> (Vec<String>, PathBuf) {
    let s = |p: &Path| p.display().to_string();
    let (torch, ledger) = (var("MEMSCOPE_TORCH_WITH_DEBUG"), env.scratch.join(format!("{tag}.jsonl")));
    let workload = env.workload.with_file_name("standin_fragment.py");
    let args = ["python3", &s(&workload), "--scenario", "oom", "--wait-tracer", "--hold", hold];
    let mut args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    args.extend(["--torch-lib".into(), s(&torch), "--ledger".into(), s(&ledger)]);
    (args, ledger)
}

/// Its variables: a 256 MiB stand-in device, the allocator's ledger beside the job's.
fn oom_vars<'a>(cmd: &'a mut Command, env: &TestEnv, ledger: &Path) -> &'a mut Command {
    cmd.env("PYTHONPATH", var("MEMSCOPE_MARKERS"))
        .env("ASCEND_HOME_PATH", &env.ascend_home)
        .env("STANDIN_TORCH_LEDGER", pool_ledger_path(ledger))
        .env("STANDIN_ACL_DEVICE_MEM", "256M")
        .env_remove("PYTORCH_NPU_ALLOC_CONF")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
}

/// The stand-in job of the `oom` scenario, held after it so its series stay.
fn oom_job(env: &TestEnv, tag: &str) -> (Killed, PathBuf) {
    let (args, ledger) = oom_scenario(env, tag, "300");
    let child =
        oom_vars(Command::new(&args[0]).args(&args[1..]), env, &ledger).spawn().expect("start the stand-in job");
    (Killed(child), ledger)
}

/// An incident as two runs of one workload share it: without instants, processes, threads and
/// addresses (the stand-in device's come from the host's heap), nor the device's capacity: it
/// comes from the driver's first reading, a second after a job starts, so a trace has it by
/// its end and a recording made at an OOM in the job's first second has not.
fn portable(mut v: serde_json::Value) -> serde_json::Value {
    match &mut v {
        serde_json::Value::Object(map) => {
            for key in ["ts_ns", "pid", "tid", "ptr", "capacity"] {
                map.remove(key);
            }
            for value in map.values_mut() {
                *value = portable(value.take());
            }
        }
        serde_json::Value::Array(items) => {
            for item in items.iter_mut() {
                *item = portable(item.take());
            }
        }
        _ => {}
    }
    v
}

/// MALLOC rows of the pool in a run folder's device 0 DB.
fn pool_mallocs(run: &Path) -> i64 {
    let dump = run.join("device_0/dump");
    let db =
        std::fs::read_dir(&dump).unwrap().map(|e| e.unwrap().path()).find(|p| p.extension().is_some_and(|x| x == "db"));
    let db = rusqlite::Connection::open(db.expect("a DB")).unwrap();
    db.query_row("SELECT count(*) FROM memscope_dump WHERE Event = 'MALLOC' AND \"Event Type\" = 'PTA'", [], |r| {
        r.get(0)
    })
    .unwrap()
}

#[test]
fn an_oom_under_the_sampling_daemon_is_recorded_as_a_full_trace_has_it() {
    let env = env("daemon_flight_sampled");
    let s = |p: &Path| p.display().to_string();
    let torch = var("MEMSCOPE_TORCH_WITH_DEBUG");
    // The full trace: the same workload under `trace`, every call recorded.
    let traced = env.scratch.join("traced");
    let (args, ledger) = oom_scenario(&env, "traced", "0");
    let mut trace = Command::new(&env.bin);
    trace.args(["trace", "--output", &s(&traced), "--lib", &s(&torch), "--"]).args(&args);
    let mut child =
        oom_vars(&mut trace, &env, &ledger).stderr(Stdio::null()).spawn().expect("start memscope-bpf trace");
    assert_eq!(wait_child(&mut child, Duration::from_secs(120)), 0, "the trace of the workload failed");
    let full: Vec<serde_json::Value> = incidents(&env, &run_dir(&traced)).into_iter().map(portable).collect();
    assert!(full.len() >= 2, "{full:#?}");

    // Every block below 64 MiB sampled: the job's own rows are a few of its blocks.
    let out = env.scratch.join("out");
    let (out_s, torch_s) = (s(&out), s(&torch));
    let mut args =
        vec!["daemon", "--output", &out_s, "--listen", "127.0.0.1:0", "--lib", &torch_s, "--sample-bytes", "64MiB"];
    args.extend(ALWAYS_PROBED);
    let mut daemon = Tracer::spawn(&env, &args, &[("ASCEND_HOME_PATH", &env.ascend_home)]);
    daemon.wait_live(Duration::from_secs(60));
    let (mut job, _) = oom_job(&env, "sampled");
    let pid = job.0.id();
    let oom = recording(&daemon, pid, "oom", Duration::from_secs(120));
    job.0.kill().unwrap();
    job.0.wait().unwrap();
    daemon.signal(libc::SIGTERM);
    let (code, stderr) = daemon.finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");
    let recorded: Vec<serde_json::Value> = incidents(&env, &oom).into_iter().map(portable).collect();
    assert!(!recorded.is_empty() && full.starts_with(&recorded), "recorded: {recorded:#?}\nfull trace: {full:#?}");
    let job_run = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.file_name().unwrap().to_string_lossy().starts_with(&format!("memscope_{pid}_")))
        .expect("the job's run folder");
    let (sampled, window) = (pool_mallocs(&job_run), pool_mallocs(&oom));
    assert!(sampled * 2 < window, "the job's DB is sampled ({sampled} pool blocks), its recording is not ({window})");
}
