//! Privileged test of a cluster's ranks under one daemon: two stand-in jobs of four ranks each
//! (tests/workloads/standin_leaky.py, each rank on its own device, its rank and launch in the
//! variables torchrun sets), rank 2 of the second job leaking. The daemon's series carry each
//! process's `rank` and `job_id`; `compare` and `report` over the daemon's output folder (eight
//! run folders) name the leaking rank of the right job, by the owner the workload leaked.
//!
//! Ground truth: the launch variables the test set, and the workloads' ledgers (which tensors
//! leak on purpose, at the stand-in allocator's block sizes).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use memscope_integration::*;

const STEPS: u64 = 8;
const JOBS: [(&str, Option<u32>); 2] = [("29500", None), ("29600", Some(2))];

struct Rank {
    process: Killed,
    ready: PathBuf,
    ledger: PathBuf,
    pool: PathBuf,
    driver: PathBuf,
    job: String,
    rank: u32,
}

fn start_rank(env: &TestEnv, port: &str, rank: u32, leaky: bool) -> Rank {
    let s = |p: &Path| p.display().to_string();
    let (markers, torch) = (var("MEMSCOPE_MARKERS"), var("MEMSCOPE_TORCH_WITH_DEBUG"));
    let name = format!("job{port}-rank{rank}");
    let ledger = env.scratch.join(format!("{name}.jsonl"));
    let ready = env.scratch.join(format!("{name}.ready"));
    let pool = pool_ledger_path(&ledger);
    let driver = env.scratch.join(format!("{name}.driver.jsonl"));
    let process = Command::new("python3")
        .arg(var("MEMSCOPE_TAGS_WORKLOAD").with_file_name("standin_leaky.py"))
        .args(["--variant", if leaky { "leaky" } else { "clean" }, "--torch-lib", &s(&torch)])
        .args(["--ledger", &s(&ledger), "--steps", &STEPS.to_string(), "--hold", "300", "--ready-file", &s(&ready)])
        .args(["--device", &rank.to_string(), "--seed", &(5 + rank).to_string(), "--tracer-timeout", "170"])
        .env("PYTHONPATH", &markers)
        .env("ASCEND_HOME_PATH", &env.ascend_home)
        .env("STANDIN_TORCH_LEDGER", &pool)
        .env("STANDIN_HAL_LEDGER", &driver)
        // A node of four devices, one per rank.
        .env("STANDIN_ACL_DEVICE_COUNT", "4")
        .envs([("RANK", rank.to_string()), ("LOCAL_RANK", rank.to_string()), ("WORLD_SIZE", "4".into())])
        .envs([("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", port), ("TORCHELASTIC_RUN_ID", "none")])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("start a stand-in rank");
    Rank { process: Killed(process), ready, ledger, pool, driver, job: format!("127.0.0.1:{port}"), rank }
}

/// The bytes of kv cache a rank leaked on purpose in steps 2..=STEPS: the allocator's sizes of
/// those tensors.
fn leaked_kv(r: &Rank) -> i64 {
    let pool = read_pool_ledger(&r.pool);
    read_loop_ledger(&r.ledger)
        .iter()
        .filter(|l| l.kind == "tensor" && l.leak && l.owner == "PTA@kv_cache" && (2..=STEPS).contains(&l.step))
        .map(|l| loop_block_size(&pool, l) as i64)
        .sum()
}

/// The bytes a rank took from the runtime on purpose and never gave back, as the driver gave
/// them (the runtime pads each request): its driver ledger's allocations made within those calls.
fn leaked_hal(r: &Rank) -> i64 {
    let driver = read_driver_ledger(&r.driver);
    read_loop_ledger(&r.ledger)
        .iter()
        .filter(|l| l.kind == "hal_malloc" && l.leak)
        .map(|l| {
            let within = driver.iter().filter(|d| d.api == "halMemAlloc" && d.t0 >= l.t0 && d.t1 <= l.t1);
            within.map(|d| d.size as i64).sum::<i64>()
        })
        .sum()
}

/// Every series of the scrape naming `pid`, with its labels.
fn series_of(body: &str, pid: u32) -> Vec<&str> {
    body.lines().filter(|l| !l.starts_with('#') && l.contains(&format!("pid=\"{pid}\""))).collect()
}

fn run_ranks(env: &TestEnv) -> (Vec<Rank>, Vec<u32>, String) {
    let s = |p: &Path| p.display().to_string();
    let out = env.scratch.join("out");
    let torch = var("MEMSCOPE_TORCH_WITH_DEBUG");
    let args = ["daemon", "--output", &s(&out), "--listen", "127.0.0.1:0", "--lib", &s(&torch), "--sample-bytes", "0"];
    let mut daemon = Tracer::spawn(env, &args, &[("ASCEND_HOME_PATH", &env.ascend_home)]);
    daemon.wait_live(Duration::from_secs(60));
    let mut ranks: Vec<Rank> = JOBS
        .iter()
        .flat_map(|(port, leaky)| (0..4).map(move |r| (*port, r, *leaky == Some(r))))
        .map(|(port, r, leaky)| start_rank(env, port, r, leaky))
        .collect();
    let pids: Vec<u32> = ranks
        .iter_mut()
        .map(|r| wait_for_file(&r.ready, &mut r.process.0, Duration::from_secs(240)).trim().parse().unwrap())
        .collect();
    // Each process's series carry its rank and its launch.
    let metrics = metrics_address(&daemon.stderr());
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, body) = get(metrics, "/metrics").unwrap();
        let labelled = ranks.iter().zip(&pids).all(|(r, pid)| {
            let series = series_of(&body, *pid);
            !series.is_empty()
                && series.iter().all(|l| {
                    l.contains(&format!("rank=\"{}\"", r.rank)) && l.contains(&format!("job_id=\"{}\"", r.job))
                })
        });
        if labelled {
            break;
        }
        assert!(Instant::now() < deadline, "series without their rank and job_id:\n{body}");
        std::thread::sleep(Duration::from_millis(300));
    }
    for r in &mut ranks {
        r.process.0.kill().unwrap();
        r.process.0.wait().unwrap();
    }
    daemon.signal(libc::SIGTERM);
    let (code, stderr) = daemon.finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");
    (ranks, pids, s(&out))
}

#[test]
fn compare_and_report_over_a_daemons_folders_name_the_leaking_rank_of_the_right_job() {
    let env = env("daemon_ranks");
    let (ranks, _pids, out) = run_ranks(&env);
    let compared = Command::new(&env.bin).args(["compare", &out, "--json"]).output().unwrap();
    assert!(compared.status.success(), "{}", String::from_utf8_lossy(&compared.stderr));
    let c: serde_json::Value = serde_json::from_slice(&compared.stdout).unwrap();
    let jobs: BTreeMap<&str, &serde_json::Value> =
        c["jobs"].as_array().unwrap().iter().map(|j| (j["job"].as_str().unwrap(), j)).collect();
    assert_eq!(jobs.keys().copied().collect::<Vec<_>>(), ["127.0.0.1:29500", "127.0.0.1:29600"], "{c:#}");
    for (job, j) in &jobs {
        let listed: Vec<(u64, String)> = j["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| (r["rank"].as_u64().unwrap(), r["device"].as_str().unwrap().to_owned()))
            .collect();
        assert_eq!(listed, (0..4).map(|r| (r, r.to_string())).collect::<Vec<_>>(), "{job}: each rank on its device");
        assert_eq!((j["world_size"].as_u64(), j["missing"].as_array().unwrap().len()), (Some(4), 0), "{job}");
        assert_eq!(j["compared"], serde_json::json!([1, STEPS]), "{job}");
    }
    assert_eq!(jobs["127.0.0.1:29500"]["outliers"], serde_json::json!([]), "the clean job: {c:#}");
    let outliers = jobs["127.0.0.1:29600"]["outliers"].as_array().unwrap();
    assert_eq!(outliers.iter().map(|o| o["rank"].as_u64()).collect::<Vec<_>>(), [Some(2)], "{c:#}");
    let leaky = ranks.iter().find(|r| r.job.ends_with("29600") && r.rank == 2).unwrap();
    let why = outliers[0]["why"].as_array().unwrap();
    let kv = why.iter().find(|w| w["kind"] == "leak" && w["owner"] == "PTA@kv_cache").expect("the kv cache leak");
    assert_eq!(kv["total"].as_i64(), Some(leaked_kv(leaky)), "the leaked tensors' blocks: {kv}");
    assert_eq!(kv["others_per_step"].as_i64(), Some(0), "{kv}");
    // The buffer it took from the runtime at step 3 and never freed, under the runtime's owner.
    let hal = why.iter().find(|w| w["kind"] == "leak" && w["family"] == "HAL").expect("the runtime buffer's leak");
    assert_eq!((hal["owner"].as_str(), hal["total"].as_i64()), (Some("CANN@APP"), Some(leaked_hal(leaky))), "{hal}");
    // The device's footprint did not grow (the pool had the leak's room reserved since the
    // warm-up), so a higher peak, if any, is the pool's, by the kv cache.
    for peak in why.iter().filter(|w| w["kind"] == "peak") {
        assert_eq!(peak["family"], "PTA", "{peak}");
        assert_eq!(peak["by"][0]["owner"], "PTA@kv_cache", "{peak}");
    }

    // The page over the same folder: its Ranks section says the same, and each rank is a run.
    let Some(chromium) = chromium() else { return };
    let page = env.scratch.join("ranks.html");
    let written = Command::new(&env.bin).args(["report", &out, "-o"]).arg(&page).output().unwrap();
    assert!(written.status.success(), "{}", String::from_utf8_lossy(&written.stderr));
    let evals = [
        "shown=!document.getElementById('ranks-section').hidden",
        "outliers=Object.fromEntries([...document.querySelectorAll('.rank-job')].map(j => [j.dataset.job, [...j.querySelectorAll('li.outlier')].map(li => li.dataset.rank + ': ' + li.textContent)]))",
        "cells=document.querySelectorAll('.rank-grid td.heat').length",
        "runs=document.querySelectorAll('#run-picker [data-pick]').length",
        "picked=(document.querySelector('.rank-job[data-job=\"127.0.0.1:29600\"] tr.outlier').click(), document.querySelector('#run-picker .on').dataset.pick)",
    ];
    let seen =
        visit(&chromium, &page, &Visit { evals: evals.iter().map(|s| s.to_string()).collect(), ..Visit::default() });
    let dom = &seen["dom"];
    assert_eq!(dom["shown"], true, "{dom}");
    assert_eq!(dom["outliers"]["127.0.0.1:29500"], serde_json::json!([]), "{dom}");
    let named = dom["outliers"]["127.0.0.1:29600"].as_array().unwrap();
    assert_eq!(named.len(), 1, "{dom}");
    assert!(named[0].as_str().unwrap().starts_with("2: rank 2 stands out"), "{dom}");
    assert!(named[0].as_str().unwrap().contains("PTA@kv_cache grew"), "{dom}");
    assert_eq!(dom["cells"].as_u64(), Some(2 * 4 * STEPS), "two jobs' 4 ranks × {STEPS} steps: {dom}");
    assert_eq!(dom["runs"].as_u64(), Some(8), "{dom}");
    assert_eq!(dom["picked"], "rank 2 of 127.0.0.1:29600", "{dom}");
}
