//! Privileged test of the daemon's live view of its jobs: the owner series and the online
//! degradation gauges, while a leaking and a clean training loop (tests/workloads/standin_leaky.py)
//! hold their memory after their last step, and a job that marks no steps runs beside them.
//!
//! Ground truth: the workloads' ledgers (which tensor under which owner, kept or freed, which
//! ones leak on purpose) and the stand-in allocator's block sizes; and, for the verdicts, the
//! offline `analyze --analysis leaks` on the DB the daemon wrote, which must say the same.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use memscope_integration::*;

const STEPS: u64 = 14;

struct Loop {
    process: Killed,
    ready: PathBuf,
    ledger: PathBuf,
    pool: PathBuf,
}

fn start_loop(env: &TestEnv, variant: &str) -> Loop {
    let s = |p: &Path| p.display().to_string();
    let (markers, torch) = (var("MEMSCOPE_MARKERS"), var("MEMSCOPE_TORCH_WITH_DEBUG"));
    let ledger = env.scratch.join(format!("{variant}.jsonl"));
    let ready = env.scratch.join(format!("{variant}.ready"));
    let pool = pool_ledger_path(&ledger);
    let process = Command::new("python3")
        .arg(var("MEMSCOPE_TAGS_WORKLOAD").with_file_name("standin_leaky.py"))
        .args(["--variant", variant, "--torch-lib", &s(&torch), "--ledger", &s(&ledger)])
        .args(["--steps", &STEPS.to_string(), "--hold", "300", "--ready-file", &s(&ready)])
        // The daemon attaches one process after another; on an emulated arm64 machine the
        // per-probe links of the second took longer than the loop's default 30 s wait.
        .args(["--tracer-timeout", "110"])
        .env("PYTHONPATH", &markers)
        .env("ASCEND_HOME_PATH", &env.ascend_home)
        .env("STANDIN_TORCH_LEDGER", &pool)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("start the stand-in training loop");
    Loop { process: Killed(process), ready, ledger, pool }
}

/// Live bytes by owner, from the ledger: the tensors allocated and not freed, at the allocator's
/// block size.
fn ledger_owners(ledger: &Path, pool: &[PoolEntry]) -> BTreeMap<String, u64> {
    let mut live: BTreeMap<u64, (String, u64)> = BTreeMap::new();
    for l in &read_loop_ledger(ledger) {
        match l.kind.as_str() {
            "tensor" => {
                live.insert(l.ptr, (l.owner.clone(), loop_block_size(pool, l)));
            }
            "free" => {
                live.remove(&l.ptr);
            }
            _ => {}
        }
    }
    let mut owners = BTreeMap::new();
    for (owner, size) in live.into_values() {
        *owners.entry(owner).or_default() += size;
    }
    owners
}

/// Every sample of `name` in a scrape whose labels hold all of `labels`: (labels, value).
fn samples(body: &str, name: &str, labels: &[String]) -> Vec<(String, i64)> {
    body.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter(|l| labels.iter().all(|want| l.contains(want.as_str())))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_owned(), value.parse().ok()?))
        })
        .collect()
}

fn one(body: &str, name: &str, labels: &[String]) -> Option<i64> {
    samples(body, name, labels).first().map(|s| s.1)
}

fn label(series: &str, key: &str) -> String {
    let at = series.find(&format!("{key}=\"")).unwrap() + key.len() + 2;
    series[at..].split('"').next().unwrap().to_owned()
}

/// (layer, sustained, rise) of device 0's HAL and PTA, by `analyze --analysis leaks` on each
/// job's run folder under `out`.
fn offline_verdicts(env: &TestEnv, out: &Path, pids: &[u32]) -> Vec<(String, i64, i64)> {
    let s = |p: &Path| p.display().to_string();
    let folders: BTreeMap<u32, PathBuf> = std::fs::read_dir(out)
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter_map(|p| Some((p.file_name()?.to_str()?.split('_').nth(1)?.parse().ok()?, p)))
        .collect();
    let mut offline = Vec::new();
    for pid in pids {
        let run = &folders[pid];
        let json = Command::new(&env.bin)
            .args(["analyze", &s(run), "--analysis", "leaks", "--device", "0", "--json", "--no-write"])
            .output()
            .unwrap();
        assert!(json.status.success(), "{}", String::from_utf8_lossy(&json.stderr));
        let all: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
        let report = all.as_array().unwrap().iter().find(|r| r["analysis"] == "leaks").unwrap();
        for layer in ["HAL", "PTA"] {
            let d = report["degradation"].as_array().unwrap().iter().find(|d| d["family"] == layer).unwrap();
            // The offline window ends at the trace's end, after the loop freed everything: its
            // boundaries are the same 14 steps.
            assert_eq!(d["points"].as_u64(), Some(STEPS), "{d:#}");
            offline.push((
                layer.to_owned(),
                i64::from(d["verdict"] == "sustained_rise"),
                d["rise"].as_f64().unwrap() as i64,
            ));
        }
    }
    offline
}

/// A stand-in job on device 1 that holds its blocks and marks no steps; and its ready file.
fn start_unmarked(env: &TestEnv) -> (Killed, PathBuf) {
    let s = |p: &Path| p.display().to_string();
    let (ledger, ready) = (env.scratch.join("unmarked.jsonl"), env.scratch.join("unmarked.ready"));
    let process = Command::new("python3")
        .arg(env.workload.with_file_name("standin_hold.py"))
        .args(["--ledger", &s(&ledger), "--ready-file", &s(&ready)])
        .args(["--device", "1", "--blocks", "50", "--size", "5000", "--hold", "300"])
        .env("ASCEND_HOME_PATH", &env.ascend_home)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("start a stand-in job");
    (Killed(process), ready)
}

/// The leaking job's sustained verdict wrote its flight recording, once; the clean one's none.
fn degradation_recorded(daemon: &Tracer, leaking: u32, clean: u32) {
    let said = |pid: u32| format!("job {pid}: flight recording (degradation) in ");
    // The log names it once written (its DB, forensics, snapshot and page): slow under emulation.
    let deadline = Instant::now() + Duration::from_secs(180);
    while !daemon.stderr().contains(&said(leaking)) {
        assert!(Instant::now() < deadline, "no degradation recording of the leaking job:\n{}", daemon.stderr());
        std::thread::sleep(Duration::from_millis(200));
    }
    let stderr = daemon.stderr();
    assert_eq!(stderr.matches(&said(leaking)).count(), 1, "{stderr}");
    assert!(!stderr.contains(&said(clean)), "the clean job has no sustained rise:\n{stderr}");
}

#[test]
fn the_daemon_exports_each_jobs_owners_and_the_offline_degradation_verdict_while_it_runs() {
    let env = env("daemon_live");
    let out = env.scratch.join("out");
    let s = |p: &Path| p.display().to_string();
    let torch = var("MEMSCOPE_TORCH_WITH_DEBUG");
    let args = [
        "daemon",
        "--output",
        &s(&out),
        "--listen",
        "127.0.0.1:0",
        "--lib",
        &s(&torch),
        // Every block recorded, so the owners' bytes are the ledger's exactly.
        "--sample-bytes",
        "0",
        "--step-window",
        "1s",
    ];
    let mut daemon = Tracer::spawn(&env, &args, &[("ASCEND_HOME_PATH", &env.ascend_home)]);
    daemon.wait_live(Duration::from_secs(60));
    let mut loops = [start_loop(&env, "leaky"), start_loop(&env, "clean")];
    // A job that marks no steps: its boundaries are --step-window's.
    let (mut unmarked, unmarked_ready) = start_unmarked(&env);
    let pids: Vec<u32> = loops
        .iter_mut()
        .map(|l| wait_for_file(&l.ready, &mut l.process.0, Duration::from_secs(120)).trim().parse().unwrap())
        .collect();
    let unmarked_pid: u32 =
        wait_for_file(&unmarked_ready, &mut unmarked.0, Duration::from_secs(60)).trim().parse().unwrap();
    let owners: Vec<BTreeMap<String, u64>> =
        loops.iter().map(|l| ledger_owners(&l.ledger, &read_pool_ledger(&l.pool))).collect();
    assert!(owners[0]["PTA@kv_cache"] > owners[1]["PTA@kv_cache"], "{owners:?}");

    let metrics = metrics_address(&daemon.stderr());
    let pid_label = |pid: u32| format!("pid=\"{pid}\"");
    let pta = |pid: u32| vec![pid_label(pid), "device=\"0\"".to_owned(), "layer=\"PTA\"".to_owned()];
    // The owners' series are the ledgers' live tensors (8 labels is more than the loops' owners).
    let scraped_owners = |body: &str, pid: u32| -> BTreeMap<String, u64> {
        samples(body, "memscope_owner_live_bytes", &pta(pid))
            .into_iter()
            .filter(|(_, v)| *v > 0)
            .map(|(series, v)| (label(&series, "owner"), v as u64))
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let body = loop {
        let (_, body) = get(metrics, "/metrics").unwrap();
        let got: Vec<_> = pids.iter().map(|p| scraped_owners(&body, *p)).collect();
        let steps: Vec<_> =
            pids.iter().map(|p| one(&body, "memscope_step", &[pid_label(*p), "source=\"markers\"".into()])).collect();
        let window = one(&body, "memscope_step", &[pid_label(unmarked_pid), "source=\"window\"".into()]);
        // The verdicts are redone now and then, so each can trail the steps by a round (seen on
        // a slow VM, for either job and either layer): their points are the last thing waited
        // for, every job's and layer's that is compared with the offline analysis below.
        let points: Vec<Option<i64>> = pids
            .iter()
            .flat_map(|&pid| {
                ["HAL", "PTA"].map(|layer| {
                    let labels = [pid_label(pid), "device=\"0\"".into(), format!("layer=\"{layer}\"")];
                    one(&body, "memscope_degradation_points", &labels)
                })
            })
            .collect();
        if got == owners
            && steps == [Some(STEPS as i64); 2]
            && window.is_some_and(|w| w >= 2)
            && points.iter().all(|p| *p == Some(STEPS as i64))
        {
            break body;
        }
        assert!(
            Instant::now() < deadline,
            "scraped owners {got:?} steps {steps:?} window {window:?} points {points:?}, the ledgers {owners:?}:\n{body}\n{}",
            daemon.stderr()
        );
        std::thread::sleep(Duration::from_millis(300));
    };
    let gauge = |pid, name: &str| one(&body, name, &pta(pid));
    assert_eq!(gauge(pids[0], "memscope_degradation_sustained"), Some(1), "{body}");
    assert_eq!(gauge(pids[1], "memscope_degradation_sustained"), Some(0), "{body}");
    // Boundaries ending steps 1..=14 (step 1 is the warm-up's end).
    assert_eq!(gauge(pids[0], "memscope_degradation_points"), Some(STEPS as i64));
    let unmarked_labels = [pid_label(unmarked_pid), "device=\"1\"".into(), "layer=\"HAL\"".into()];
    assert_eq!(one(&body, "memscope_degradation_sustained", &unmarked_labels), Some(0), "{body}");
    let online: Vec<(String, i64, i64)> = pids
        .iter()
        .flat_map(|&pid| {
            ["HAL", "PTA"].map(|layer| {
                let labels = [pid_label(pid), "device=\"0\"".into(), format!("layer=\"{layer}\"")];
                let sustained = one(&body, "memscope_degradation_sustained", &labels).unwrap();
                (layer.to_owned(), sustained, one(&body, "memscope_degradation_rise_bytes", &labels).unwrap())
            })
        })
        .collect();

    degradation_recorded(&daemon, pids[0], pids[1]);
    for l in &mut loops {
        l.process.0.kill().unwrap();
        l.process.0.wait().unwrap();
    }
    daemon.signal(libc::SIGTERM);
    let (code, stderr) = daemon.finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");

    // The offline analysis of the DBs the daemon wrote gives the same verdicts and rises.
    let offline = offline_verdicts(&env, &out, &pids);
    assert_eq!(online, offline, "online (daemon) against offline (analyze) verdicts and rises");
}
