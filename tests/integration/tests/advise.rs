//! Privileged closed-loop tests of the allocator-settings advisor and the OOM forensics, on the
//! stand-in torch_npu caching allocator (tests/workloads/standin_fragment.py).
//!
//! The loop: a scenario is traced with the allocator's defaults; `advise --json` on its DB must
//! recommend the setting that scenario calls for (and nothing else); the scenario is traced again
//! with exactly the recommended PYTORCH_NPU_ALLOC_CONF value; the allocator's own ledger
//! (STANDIN_TORCH_LEDGER, never the tracer) must show the peak of reserved memory went down. A
//! clean scenario must get no advice at all. The OOM forensics are checked against the workload's
//! record of which failure it provoked and why, and the allocator's counters at each failure.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use memscope_integration::*;
use serde::Deserialize;
use serde_json::Value;

const MIB: u64 = 1 << 20;

fn workload() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../workloads/standin_fragment.py")
}

/// One line of the workload's own ledger.
#[derive(Debug, Deserialize)]
struct Line {
    kind: String,
    #[serde(default)]
    req: u64,
    #[serde(default)]
    expect: Option<String>,
    #[serde(default)]
    pid: u32,
}

struct Run {
    out: PathBuf,
    lines: Vec<Line>,
    pool: Vec<PoolEntry>,
    stderr: String,
}

impl Run {
    /// The allocator's highest reserved bytes on device 0, and its allocated bytes when it first
    /// reached them.
    fn peak(&self) -> (u64, u64) {
        let mut first: Option<&PoolEntry> = None;
        for e in self.pool.iter().filter(|e| e.device == 0) {
            if first.is_none_or(|f| e.reserved > f.reserved) {
                first = Some(e);
            }
        }
        let e = first.expect("allocator events");
        (e.reserved, e.allocated)
    }

    fn db(&self) -> PathBuf {
        read_output(&self.out).db("device_0").to_owned()
    }
}

/// Traces `scenario` in launch mode with `vars` set (and PYTORCH_NPU_ALLOC_CONF only if given).
fn trace(env: &TestEnv, scenario: &str, tag: &str, vars: &[(&str, &str)]) -> Run {
    let torch = var("MEMSCOPE_TORCH_WITH_DEBUG");
    let out = env.scratch.join(format!("out-{tag}"));
    let ledger = env.scratch.join(format!("{tag}.jsonl"));
    let pool = pool_ledger_path(&ledger);
    let log = env.scratch.join(format!("{tag}.stderr"));
    let mut child = Command::new(&env.bin)
        .args(["trace", "--output"])
        .arg(&out)
        .arg("--lib")
        .arg(&torch)
        .args(["--", "python3"])
        .arg(workload())
        .args(["--scenario", scenario, "--wait-tracer", "--torch-lib"])
        .arg(&torch)
        .arg("--ledger")
        .arg(&ledger)
        .env_remove("PYTORCH_NPU_ALLOC_CONF")
        .env("PYTHONPATH", var("MEMSCOPE_MARKERS"))
        .env("ASCEND_HOME_PATH", &env.ascend_home)
        .env("STANDIN_TORCH_LEDGER", &pool)
        .envs(vars.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("start memscope-bpf");
    let code = wait_child(&mut child, Duration::from_secs(120));
    let stderr = std::fs::read_to_string(&log).unwrap();
    assert_eq!(code, 0, "trace of {scenario} failed:\n{stderr}");
    let text = std::fs::read_to_string(&ledger).unwrap_or_else(|e| panic!("{}: {e}\n{stderr}", ledger.display()));
    let lines = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    Run { out, lines, pool: read_pool_ledger(&pool), stderr }
}

/// `memscope-bpf <verb> ARGS --json`, as a user runs it.
fn json(env: &TestEnv, args: &[&str]) -> Value {
    let out = Command::new(&env.bin).args(args).arg("--json").output().expect("run memscope-bpf");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{args:?}: {stderr}");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{args:?}: {e}: {stderr}"))
}

/// The advice for the run's device 0.
fn advise(env: &TestEnv, run: &Run) -> Value {
    let all = json(env, &["advise", run.out.to_str().unwrap()]);
    let mine: Vec<&Value> = all.as_array().unwrap().iter().filter(|a| a["device"] == "0").collect();
    assert_eq!(mine.len(), 1, "{all:#}");
    mine[0].clone()
}

fn ids(advice: &Value) -> Vec<String> {
    advice["recommendations"].as_array().unwrap().iter().map(|r| r["id"].as_str().unwrap().to_owned()).collect()
}

/// The recommended PYTORCH_NPU_ALLOC_CONF value of recommendation `id`.
fn conf_of(advice: &Value, id: &str) -> String {
    let rec = advice["recommendations"].as_array().unwrap().iter().find(|r| r["id"] == id).unwrap();
    assert_eq!(rec["variable"], "PYTORCH_NPU_ALLOC_CONF", "{rec:#}");
    rec["value"].as_str().unwrap().to_owned()
}

/// The advisor's numbers are the allocator's: its peak of reserved bytes, and its allocated bytes
/// at that moment.
fn assert_measured_like_the_ledger(advice: &Value, run: &Run) {
    let (reserved, allocated) = run.peak();
    let m = &advice["measured"];
    assert_eq!(m["peak_reserved"], reserved, "{m:#}");
    assert_eq!(m["allocated_at_peak"], allocated, "{m:#}");
}

/// Segment growths that fragmentation forced, from the allocator's ledger: a new segment while
/// its reserved-but-unused bytes (before the segment) covered the block it was taken for. In these
/// scenarios no whole free segment is ever cached, so all of that unused memory is holes.
fn forced_growths_in_ledger(pool: &[PoolEntry]) -> usize {
    let mut forced = 0;
    for (i, e) in pool.iter().enumerate() {
        if e.ev != "segment_alloc" || pool[..i].last().is_some_and(|p| p.ev == "segment_alloc" && p.tid == e.tid) {
            continue;
        }
        let Some(block) = pool[i + 1..].iter().find(|b| b.tid == e.tid && b.ev == "block_malloc") else { continue };
        let unused_before = (e.reserved - e.size.unwrap()).saturating_sub(e.allocated);
        forced += usize::from(unused_before >= block.size.unwrap());
    }
    forced
}

/// The closed loop: the recommended setting, re-run, must lower the allocator's peak reserved.
fn rerun_with(env: &TestEnv, scenario: &str, before: &Run, conf: &str, vars: &[(&str, &str)]) -> Run {
    let mut with = vars.to_vec();
    with.push(("PYTORCH_NPU_ALLOC_CONF", conf));
    let after = trace(env, scenario, &format!("{scenario}-advised"), &with);
    let (old, _) = before.peak();
    let (new, _) = after.peak();
    eprintln!("{scenario}: peak reserved {} MiB with the defaults, {} MiB with {conf}", old / MIB, new / MIB);
    assert!(new < old, "{scenario}: {conf} did not lower the peak reserved ({old} -> {new})");
    let applied = meta(&after.db(), "env.PYTORCH_NPU_ALLOC_CONF");
    assert_eq!(applied.as_deref(), Some(conf), "the re-run's DB records the setting it ran with");
    after
}

#[test]
fn holes_between_live_tensors_get_expandable_segments_and_it_lowers_the_peak() {
    let env = env("advise_holes");
    let run = trace(&env, "holes", "holes", &[]);
    let advice = advise(&env, &run);
    assert_eq!(ids(&advice), ["expandable_segments"], "{advice:#}");
    assert_eq!(conf_of(&advice, "expandable_segments"), "expandable_segments:True");
    assert_measured_like_the_ledger(&advice, &run);
    assert_eq!(advice["measured"]["forced_growths"], forced_growths_in_ledger(&run.pool), "{advice:#}");
    let (reserved, allocated) = run.peak();
    let after = rerun_with(&env, "holes", &run, &conf_of(&advice, "expandable_segments"), &[]);
    let (new_reserved, new_allocated) = after.peak();
    assert!(
        new_reserved - new_allocated < reserved - allocated,
        "reserved but unused at the peak: {} -> {}",
        reserved - allocated,
        new_reserved - new_allocated
    );
    // Already on: nothing more to say.
    let again = advise(&env, &after);
    assert_eq!(ids(&again), Vec::<String>::new(), "{again:#}");
}

#[test]
fn big_segments_split_for_small_tensors_get_max_split_size_and_it_lowers_the_peak() {
    let env = env("advise_bigsplit");
    let run = trace(&env, "bigsplit", "bigsplit", &[]);
    let advice = advise(&env, &run);
    assert_eq!(ids(&advice), ["max_split_size_mb"], "{advice:#}");
    assert_eq!(conf_of(&advice, "max_split_size_mb"), "max_split_size_mb:64");
    assert_measured_like_the_ledger(&advice, &run);
    rerun_with(&env, "bigsplit", &run, &conf_of(&advice, "max_split_size_mb"), &[]);
}

#[test]
fn a_pool_flushing_at_its_ceiling_gets_garbage_collection_and_it_lowers_the_peak() {
    let env = env("advise_pressure");
    let limit = [("STANDIN_ACL_DEVICE_MEM", "1G"), ("STANDIN_PER_PROCESS_MEMORY_FRACTION", "0.5")];
    let run = trace(&env, "pressure", "pressure", &limit);
    // Ground truth: the allocator freed segments at its limit.
    assert!(run.pool.iter().any(|e| e.ev == "segment_free"), "the scenario reaches the limit");
    let advice = advise(&env, &run);
    assert_eq!(ids(&advice), ["garbage_collection_threshold"], "{advice:#}");
    assert_measured_like_the_ledger(&advice, &run);
    let conf = conf_of(&advice, "garbage_collection_threshold");
    assert!(conf.starts_with("garbage_collection_threshold:0."), "{conf}");
    rerun_with(&env, "pressure", &run, &conf, &limit);
}

#[test]
fn a_clean_pool_gets_no_advice() {
    let env = env("advise_clean");
    let run = trace(&env, "clean", "clean", &[]);
    let advice = advise(&env, &run);
    assert_eq!(ids(&advice), Vec::<String>::new(), "{advice:#}");
    assert_measured_like_the_ledger(&advice, &run);
    assert_eq!(advice["measured"]["forced_growths"], 0);
    assert_eq!(forced_growths_in_ledger(&run.pool), 0);
    // The text form, as `trace` prints it at its end, says so too.
    let out = Command::new(&env.bin).args(["advise", "--no-write"]).arg(&run.out).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("advice: nothing to change"), "{text}");
}

#[test]
fn processes_sharing_a_device_are_told_to_split_it() {
    let env = env("advise_shared");
    let run = trace(&env, "shared", "shared", &[]);
    let advice = advise(&env, &run);
    assert_eq!(ids(&advice), ["per_process_memory_fraction"], "{advice:#}");
    // The processes are the workload's own two (the child logs to <ledger>.child).
    let child = std::fs::read_to_string(env.scratch.join("shared.jsonl.child")).unwrap();
    let child: Line = serde_json::from_str(child.lines().next().unwrap()).unwrap();
    let mut want = vec![run.lines[0].pid, child.pid];
    want.sort_unstable();
    let got: Vec<u32> =
        advice["measured"]["processes"].as_array().unwrap().iter().map(|p| p["pid"].as_u64().unwrap() as u32).collect();
    assert_eq!(got, want);
    let rec = &advice["recommendations"][0];
    assert!(rec["setting"].as_str().unwrap().contains("set_per_process_memory_fraction(0.47)"), "{rec:#}");
}

/// The largest free piece inside the allocator's segments when it logged `until`, from its ledger.
fn largest_free_in_ledger(pool: &[PoolEntry], until: usize) -> u64 {
    let mut segments: BTreeMap<u64, u64> = BTreeMap::new();
    let mut blocks: BTreeMap<u64, u64> = BTreeMap::new();
    for e in &pool[..until] {
        match e.ev.as_str() {
            "segment_alloc" => {
                segments.insert(e.ptr, e.size.unwrap());
            }
            "segment_free" => {
                segments.remove(&e.ptr);
            }
            "block_malloc" => {
                blocks.insert(e.ptr, e.size.unwrap());
            }
            "block_free" => {
                blocks.remove(&e.ptr);
            }
            _ => {}
        }
    }
    let mut largest = 0;
    for (&start, &size) in &segments {
        let mut at = start;
        for (&p, &n) in blocks.range(start..start + size) {
            largest = largest.max(p - at);
            at = p + n;
        }
        largest = largest.max(start + size - at);
    }
    largest
}

#[test]
fn oom_forensics_tell_fragmentation_from_a_full_device() {
    let env = env("advise_oom");
    let run = trace(&env, "oom", "oom", &[("STANDIN_ACL_DEVICE_MEM", "256M")]);
    let provoked: Vec<&Line> = run.lines.iter().filter(|l| l.kind == "oom").collect();
    let gave_up: Vec<(usize, &PoolEntry)> = run.pool.iter().enumerate().filter(|(_, e)| e.ev == "oom").collect();
    assert_eq!(provoked.len(), 2, "{}", run.stderr);
    assert_eq!(gave_up.len(), 2);
    let report = json(&env, &["analyze", run.out.to_str().unwrap(), "--device", "0", "--analysis", "oom:5"]);
    let incidents: Vec<&Value> =
        report[0]["incidents"].as_array().unwrap().iter().filter(|i| i["verdict"] != "recovered").collect();
    // One incident per failure the workload provoked, with the verdict it provoked it for.
    let verdicts: Vec<&str> = incidents.iter().map(|i| i["verdict"].as_str().unwrap()).collect();
    let want: Vec<&str> = provoked.iter().map(|l| l.expect.as_deref().unwrap()).collect();
    assert_eq!(verdicts, want, "{report:#}");
    for ((inc, line), (at, entry)) in incidents.iter().zip(&provoked).zip(&gave_up) {
        let s = &inc["state"];
        assert_eq!(inc["func"], "DeviceCachingAllocator::malloc");
        assert_eq!(inc["req_size"], line.req);
        assert_eq!((s["reserved"].as_u64(), s["allocated"].as_u64()), (Some(entry.reserved), Some(entry.allocated)));
        assert_eq!(s["largest_free"], largest_free_in_ledger(&run.pool, *at), "{inc:#}");
        assert!(!inc["attempts"].as_array().unwrap().is_empty(), "the runtime refusals are folded in: {inc:#}");
    }
    let frag = &incidents[0];
    assert!(frag["explanation"].as_str().unwrap().starts_with("fragmentation: "), "{frag:#}");
    let owners: Vec<(String, u64)> = incidents[1]["state"]["owners"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| (o["owner"].as_str().unwrap().to_owned(), o["bytes"].as_u64().unwrap()))
        .collect();
    assert_eq!(owners, [("PTA@weights".to_owned(), 160 * MIB), ("PTA@activations".to_owned(), 90 * MIB)]);
    // Stored, one row per incident; and the fragmentation failure is advice.
    let conn = rusqlite::Connection::open(run.db()).unwrap();
    let stored: i64 =
        conn.query_row("SELECT count(*) FROM ms_oom WHERE verdict != 'recovered'", [], |r| r.get(0)).unwrap();
    assert_eq!(stored, 2);
    let advice = advise(&env, &run);
    assert_eq!(ids(&advice), ["expandable_segments"], "{advice:#}");
    assert_eq!(advice["measured"]["fragmentation_ooms"], 1);
}

/// Segments the allocator took on device 0, from its ledger; with expandable segments,
/// mappings: the pages one allocation mapped in a row count once, as PyTorch's trace records a
/// `segment_map` per mapping.
fn segments_in_ledger(run: &Run) -> u64 {
    let events: Vec<&str> = run.pool.iter().filter(|e| e.device == 0).map(|e| e.ev.as_str()).collect();
    let allocs = events.iter().filter(|e| **e == "segment_alloc").count();
    let mappings = events
        .iter()
        .enumerate()
        .filter(|(i, e)| **e == "segment_map" && (*i == 0 || events[i - 1] != "segment_map"))
        .count();
    (allocs + mappings) as u64
}

/// The allocator model (`advise --simulate`) against the stand-in allocator, an independent
/// implementation of torch_npu's rules with its own ledger: a scenario runs under each setting;
/// each run's replay under its own settings reproduces its segments, and the replay of the run
/// with the defaults predicts every other run's segments and peak reserved bytes exactly.
fn replay_predicts(env: &TestEnv, scenario: &str, settings: &[&str], limit: &[(&str, &str)], sim_args: &[&str]) {
    let runs: Vec<(&str, Run)> = settings
        .iter()
        .map(|&s| {
            let mut vars = limit.to_vec();
            if !s.is_empty() {
                vars.push(("PYTORCH_NPU_ALLOC_CONF", s));
            }
            let tag = format!("sim-{scenario}-{}", s.replace([':', '.'], "_"));
            (s, trace(env, scenario, &tag, &vars))
        })
        .collect();
    for (setting, run) in &runs {
        let mut args = vec!["advise", run.out.to_str().unwrap(), "--no-write"];
        args.extend_from_slice(sim_args);
        let all = json(env, &args);
        let advice = all.as_array().unwrap().iter().find(|a| a["device"] == "0").unwrap();
        let r = &advice["reproduction"];
        let taken = segments_in_ledger(run);
        assert!(taken > 0, "{scenario} {setting:?} took segments");
        assert_eq!(
            (&r["agrees"], &r["recorded_segments"], &r["matched_segments"]),
            (&Value::Bool(true), &taken.into(), &taken.into()),
            "{scenario} {setting:?}: {r:#}"
        );
        assert_eq!(advice["baseline"]["peak_reserved_bytes"], run.peak().0, "{scenario} {setting:?}");
    }
    let (_, defaults) = &runs[0];
    let mut args = vec!["advise", defaults.out.to_str().unwrap(), "--no-write"];
    args.extend_from_slice(sim_args);
    for (setting, _) in &runs[1..] {
        args.extend(["--simulate", setting]);
    }
    let all = json(env, &args);
    let advice = all.as_array().unwrap().iter().find(|a| a["device"] == "0").unwrap();
    let sims = advice["simulations"].as_array().unwrap();
    for ((setting, run), sim) in runs[1..].iter().zip(sims) {
        assert_eq!(sim["setting"], *setting);
        let got = (sim["segments"].as_u64().unwrap(), sim["peak_reserved_bytes"].as_u64().unwrap());
        eprintln!(
            "{scenario}: {setting}: predicted {got:?}, the allocator's ledger {:?}",
            (segments_in_ledger(run), run.peak().0)
        );
        assert_eq!(got, (segments_in_ledger(run), run.peak().0), "{scenario} {setting}: {sim:#}");
        assert_eq!(sim["oom"], false);
    }
    // The text says how far the replay agrees before it predicts.
    let out = Command::new(&env.bin).args(["advise", "--no-write"]).arg(&defaults.out).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let taken = segments_in_ledger(defaults);
    assert!(text.contains(&format!("replay matches the recorded run: {taken}/{taken} segments")), "{text}");
    replay_chart(env, defaults, &runs[1..].iter().map(|(s, _)| *s).collect::<Vec<_>>(), sim_args);
}

/// The report draws the stored replays: a series per setting beside the recorded one.
fn replay_chart(env: &TestEnv, run: &Run, settings: &[&str], sim_args: &[&str]) {
    let Some(chromium) = memscope_integration::browser::chromium() else { return };
    let mut args = vec!["advise", run.out.to_str().unwrap()];
    args.extend_from_slice(sim_args);
    for s in settings {
        args.extend(["--simulate", s]);
    }
    let out = Command::new(&env.bin).args(&args).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let page = env.scratch.join(format!("replay-{}.html", settings.len()));
    let out = Command::new(&env.bin).arg("report").arg(&run.out).arg("-o").arg(&page).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let evals =
        vec!["series=[...document.querySelectorAll('#simulation-legend li')].map(l => l.textContent)".to_owned()];
    let visit = memscope_integration::browser::Visit { evals, ..Default::default() };
    let seen = memscope_integration::browser::visit(&chromium, &page, &visit);
    let series: Vec<&str> = seen["dom"]["series"].as_array().unwrap().iter().filter_map(|v| v.as_str()).collect();
    for want in ["recorded", "replayed as run"].iter().chain(settings) {
        assert!(series.contains(want), "no {want} among the chart's series {series:?}");
    }
}

#[test]
fn a_replay_predicts_the_segments_and_peak_of_each_setting_for_holes() {
    let env = env("simulate_holes");
    replay_predicts(&env, "holes", &["", "expandable_segments:True", "max_split_size_mb:64"], &[], &[]);
}

#[test]
fn a_replay_predicts_the_segments_and_peak_of_each_setting_under_a_ceiling() {
    let env = env("simulate_pressure");
    let limit = [("STANDIN_ACL_DEVICE_MEM", "1G"), ("STANDIN_PER_PROCESS_MEMORY_FRACTION", "0.5")];
    let settings = ["", "garbage_collection_threshold:0.6", "max_split_size_mb:64", "expandable_segments:True"];
    replay_predicts(&env, "pressure", &settings, &limit, &["--capacity", "1GiB", "--fraction", "0.5"]);
}
