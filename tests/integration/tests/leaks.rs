//! Privileged tests of the step analyses (`analyze --analysis leaks`, `trace --analysis leaks`,
//! `compare`) on a traced training loop: leak candidates, HAL memory never freed, the live bytes
//! at each step's end, the degradation verdict, and what grew between a clean and a leaking run.
//!
//! Ground truth: the workload (tests/workloads/standin_leaky.py) logs which tensors and device
//! buffers it keeps on purpose and at which step, and its `memscope.step()` calls; the stand-in
//! allocator logs every block's size, every segment, and its allocated counter. Candidates are the
//! workload's leaks born after the warm-up (step 1) and still live at the end of the step after
//! their birth step (msMemScope's definition, the analysis' defaults): with 14 steps, the leaks of
//! steps 2..13; the one of step 14 is too young, and the carried tensors, which cross one step
//! boundary each, must never appear.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use memscope_integration::*;

const STEPS: u64 = 14;
const MIB: u64 = 1 << 20;

struct Run {
    run_dir: PathBuf,
    db: PathBuf,
    ledger: Vec<LoopLine>,
    pool: Vec<PoolEntry>,
    driver: Vec<DriverEntry>,
    stdout: String,
}

/// Traces the workload in launch mode (`--analysis leaks` when `online`).
fn launch(env: &TestEnv, variant: &str, online: bool) -> Run {
    let workload = var("MEMSCOPE_TAGS_WORKLOAD").with_file_name("standin_leaky.py");
    let (markers, torch) = (var("MEMSCOPE_MARKERS"), var("MEMSCOPE_TORCH_WITH_DEBUG"));
    let dir = env.scratch.join(variant);
    std::fs::create_dir_all(&dir).unwrap();
    let ledger = dir.join("leaky.jsonl");
    let pool = pool_ledger_path(&ledger);
    let out = dir.join("out");
    let s = |p: &Path| p.display().to_string();
    let mut args = vec!["trace".to_owned(), "--output".into(), s(&out), "--lib".into(), s(&torch)];
    if online {
        args.extend(["--analysis".into(), "leaks".into()]);
    }
    args.extend(["--".into(), "python3".into(), s(&workload), "--variant".into(), variant.into()]);
    args.extend(["--torch-lib".into(), s(&torch), "--ledger".into(), s(&ledger), "--steps".into(), STEPS.to_string()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let driver = driver_ledger_path(&ledger);
    let vars: Vec<(&str, &Path)> = vec![
        ("PYTHONPATH", &markers),
        ("ASCEND_HOME_PATH", &env.ascend_home),
        ("STANDIN_TORCH_LEDGER", &pool),
        ("STANDIN_HAL_LEDGER", &driver),
    ];
    let mut tracer = Tracer::spawn(env, &args, &vars);
    let mut stdout = tracer.child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut stdout, &mut text).unwrap();
        text
    });
    let (code, stderr) = tracer.finish(Duration::from_secs(120));
    assert_eq!(code, Some(0), "{stderr}");
    let run_dir = run_dir(&out);
    let db = read_output(&out).db("device_0").to_owned();
    Run {
        run_dir,
        db,
        ledger: read_loop_ledger(&ledger),
        pool: read_pool_ledger(&pool),
        driver: read_driver_ledger(&driver),
        stdout: reader.join().unwrap(),
    }
}

fn memscope(env: &TestEnv, args: &[&str]) -> String {
    let out = Command::new(&env.bin).args(args).output().unwrap();
    assert!(out.status.success(), "memscope-bpf {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// `analyze --analysis leaks --json` on device 0 of a run, without writing.
fn leaks_json(env: &TestEnv, run: &Run) -> serde_json::Value {
    let text = memscope(
        env,
        &["analyze", run.run_dir.to_str().unwrap(), "--analysis", "leaks", "--device", "0", "--json", "--no-write"],
    );
    let all: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut reports: Vec<serde_json::Value> =
        all.as_array().unwrap().iter().filter(|r| r["analysis"] == "leaks").cloned().collect();
    assert_eq!(reports.len(), 1, "{all:#}");
    reports.pop().unwrap()
}

fn ptr_of(v: &serde_json::Value) -> u64 {
    u64::from_str_radix(v["ptr"].as_str().unwrap().trim_start_matches("0x"), 16).unwrap()
}

/// (family, ptr) of a list of reported blocks.
fn blocks(list: &serde_json::Value) -> BTreeSet<(String, u64)> {
    list.as_array().unwrap().iter().map(|l| (l["family"].as_str().unwrap().to_owned(), ptr_of(l))).collect()
}

/// The workload's leaks that must be candidates, as (family, ptr).
fn expected_candidates(ledger: &[LoopLine]) -> BTreeSet<(String, u64)> {
    let young = STEPS; // born in the last step: not yet live a whole step later
    ledger
        .iter()
        .filter(|l| l.leak && l.step > 1 && l.step < young)
        .map(|l| (if l.kind == "tensor" { "PTA" } else { "HAL" }.to_owned(), l.ptr))
        .collect()
}

/// Segments the allocator took and never gave back, plus the workload's own device leaks.
fn expected_never_freed(ledger: &[LoopLine], pool: &[PoolEntry]) -> BTreeSet<(String, u64)> {
    let mut segments: BTreeMap<u64, i64> = BTreeMap::new();
    for e in pool {
        match e.ev.as_str() {
            "segment_alloc" => *segments.entry(e.ptr).or_default() += 1,
            "segment_free" => *segments.entry(e.ptr).or_default() -= 1,
            _ => {}
        }
    }
    let mut want: BTreeSet<(String, u64)> =
        segments.into_iter().filter(|(_, n)| *n > 0).map(|(p, _)| ("HAL".to_owned(), p)).collect();
    for l in ledger.iter().filter(|l| l.kind == "hal_malloc" && l.leak) {
        want.insert(("HAL".to_owned(), l.ptr));
    }
    want
}

/// The allocator's allocated bytes when each `memscope.step()` was called.
fn allocated_at_steps(ledger: &[LoopLine], pool: &[PoolEntry]) -> Vec<(u64, u64)> {
    ledger
        .iter()
        .filter(|l| l.kind == "step")
        .map(|s| {
            let last = pool
                .iter()
                .filter(|e| e.ev.starts_with("block_") && e.t1.is_some_and(|t| t < s.t0))
                .max_by_key(|e| e.t1)
                .unwrap_or_else(|| panic!("no allocator event before step {}", s.step));
            (s.step, last.allocated)
        })
        .collect()
}

fn degradation<'a>(report: &'a serde_json::Value, family: &str) -> &'a serde_json::Value {
    report["degradation"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["family"] == family)
        .unwrap_or_else(|| panic!("no {family} verdict: {report:#}"))
}

#[test]
fn leak_candidates_degradation_and_compare_match_the_ledgers() {
    let env = env("leaks");
    let leaky = launch(&env, "leaky", true);
    let clean = launch(&env, "clean", false);

    // --- leaky: candidates are exactly the workload's leaks old enough (precision and recall 1).
    let report = leaks_json(&env, &leaky);
    let want = expected_candidates(&leaky.ledger);
    assert_eq!(want.len() as u64, STEPS - 2 + 1, "12 kv blocks and one device buffer");
    assert_eq!(blocks(&report["candidates"]), want, "{:#}", report["candidates"]);
    for c in report["candidates"].as_array().unwrap() {
        let line = leaky.ledger.iter().find(|l| l.leak && l.ptr == ptr_of(c)).unwrap();
        assert_eq!(c["birth_step"], line.step, "{c}");
        assert_eq!(c["free_ts"], serde_json::Value::Null, "{c}");
        if line.kind == "tensor" {
            assert_eq!(c["owner"], line.owner.as_str(), "{c}");
            assert_eq!(c["size"].as_u64(), Some(loop_block_size(&leaky.pool, line)), "{c}");
            assert_eq!(c["steps_alive"].as_u64(), Some(STEPS - line.step), "{c}");
        } else {
            // What the driver took for the 1 MiB asked.
            let taken = leaky.driver.iter().find(|e| e.api == "halMemAlloc" && e.rc == 0 && e.ptr == line.ptr);
            assert_eq!(c["size"].as_u64(), taken.map(|e| e.size), "{c}");
            assert!(taken.unwrap().size >= MIB);
        }
    }
    assert_eq!(blocks(&report["never_freed"]), expected_never_freed(&leaky.ledger, &leaky.pool));

    // The live bytes at each step's end are the allocator's allocated bytes at that step() call.
    let steps: Vec<(u64, u64)> = report["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["step"].as_u64().unwrap(), s["PTA"].as_u64().unwrap()))
        .collect();
    assert_eq!(steps, allocated_at_steps(&leaky.ledger, &leaky.pool));

    // Degradation: a sustained PTA rise, made of the kv cache.
    let pta = degradation(&report, "PTA");
    assert_eq!(pta["verdict"], "sustained_rise", "{pta:#}");
    let kv_leaked: u64 =
        leaky.ledger.iter().filter(|l| l.kind == "tensor" && l.leak).map(|l| loop_block_size(&leaky.pool, l)).sum();
    assert_eq!(pta["owners"][0]["owner"], "PTA@kv_cache", "{pta:#}");
    assert_eq!(
        pta["owners"][0]["delta"].as_u64(),
        Some(kv_leaked),
        "steps 2..14 leaked; the window starts at step 1's end"
    );

    // Online (`trace --analysis leaks`) wrote the same candidates into the DB and printed them.
    assert!(leaky.stdout.contains("PTA: SUSTAINED RISE") && leaky.stdout.contains("PTA@kv_cache"), "{}", leaky.stdout);
    let conn = rusqlite::Connection::open(&leaky.db).unwrap();
    let stored: BTreeSet<(String, u64)> = conn
        .prepare("SELECT family, ptr FROM ms_leaks WHERE kind = 'candidate'")
        .unwrap()
        .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))
        .unwrap()
        .map(|r| r.unwrap())
        .map(|(f, p)| (f, u64::from_str_radix(p.trim_start_matches("0x"), 16).unwrap()))
        .collect();
    assert_eq!(stored, want, "online and offline agree");

    // --- clean: nothing to report, no rise, the same noise.
    let report = leaks_json(&env, &clean);
    assert_eq!(blocks(&report["candidates"]), BTreeSet::new(), "{:#}", report["candidates"]);
    assert_eq!(blocks(&report["never_freed"]), expected_never_freed(&clean.ledger, &clean.pool));
    assert!(report["never_freed"].as_array().unwrap().is_empty(), "the clean run empties the cache");
    for d in report["degradation"].as_array().unwrap() {
        assert_ne!(d["verdict"], "sustained_rise", "{d:#}");
    }
    assert_eq!(report["steps"].as_array().unwrap().len() as u64, STEPS);

    // --- compare clean (A) with leaky (B): the kv cache is what grew, by the leaked blocks.
    let text = memscope(
        &env,
        &["compare", clean.run_dir.to_str().unwrap(), leaky.run_dir.to_str().unwrap(), "--device", "0", "--json"],
    );
    let pairs: serde_json::Value = serde_json::from_str(&text).unwrap();
    let pair = &pairs.as_array().unwrap()[0];
    assert_eq!(pair["at"], STEPS, "{pair:#}");
    let grew = &pair["grew"][0];
    assert_eq!((grew["family"].as_str(), grew["owner"].as_str()), (Some("PTA"), Some("PTA@kv_cache")), "{pair:#}");
    assert_eq!(grew["diff"].as_u64(), Some(kv_leaked), "{grew}");
    let text =
        memscope(&env, &["compare", clean.run_dir.to_str().unwrap(), leaky.run_dir.to_str().unwrap(), "--device", "0"]);
    let grew_line = text.lines().skip_while(|l| !l.contains("what grew in B")).nth(1).unwrap_or_default().to_owned();
    assert!(grew_line.trim_start().starts_with("PTA@kv_cache"), "{text}");
}

/// Bad input costs one line and leaves the DB as it was.
#[test]
fn a_wrong_step_marker_is_refused_without_touching_the_db() {
    let env = env("leaks_bad_input");
    let run = launch(&env, "clean", false);
    let before = std::fs::read(&run.db).unwrap();
    let out = Command::new(&env.bin)
        .args(["analyze", run.db.to_str().unwrap(), "--analysis", "leaks", "--step-marker", "iteration"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("no MSTX mark or range named \"iteration\"") && stderr.contains("leave --step-marker out"),
        "{stderr}"
    );
    assert_eq!(std::fs::read(&run.db).unwrap(), before, "the DB is unchanged");
}
