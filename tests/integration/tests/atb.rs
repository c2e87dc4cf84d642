//! Privileged tests of the ATB probe (`atb::Runner::Execute` in the STAND-IN libatb.so) and of the
//! advisor's ATB_WORKSPACE_MEM_ALLOC_ALG_TYPE rule, closed loop, on tests/workloads/standin_atb.py
//! over the stand-in torch_npu workspace allocator.
//!
//! Ground truth is never the tracer: the workload's ledger holds each execution as the stand-in
//! ATB reported it (the pack it ran with, its own execution counter), and the stand-in torch_npu's
//! ledger holds both pools' allocated and reserved bytes at every event. The loop: with the
//! variable unset and large intermediates the advice is `3`; the run that follows it is not
//! advised again and its peak (by the allocators' counters) is lower; with small intermediates
//! nothing is advised.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use memscope_integration::*;
use serde::Deserialize;

const ALG: &str = "ATB_WORKSPACE_MEM_ALLOC_ALG_TYPE";
const RULE: &str = "atb_workspace_mem_alloc_alg_type";

#[derive(Debug, Deserialize)]
struct Line {
    kind: String,
    #[serde(default)]
    runner: u64,
    #[serde(default)]
    workspace_ptr: u64,
    #[serde(default)]
    workspace_size: u64,
    #[serde(default)]
    intermediate_ptr: u64,
    #[serde(default)]
    intermediate_size: u64,
    #[serde(default)]
    execute_count: u64,
    #[serde(default)]
    alg_type: i32,
    #[serde(default)]
    status: i32,
}

/// One line of the stand-in torch_npu's own ledger. Segment events are the caching pool's and
/// name no pool.
#[derive(Debug, Deserialize)]
struct PoolLine {
    #[serde(default)]
    pool: Option<String>,
    #[serde(default)]
    allocated: Option<u64>,
    #[serde(default)]
    reserved: Option<u64>,
}

struct Run {
    out: Output,
    executions: Vec<Line>,
    pools: Vec<PoolLine>,
}

fn atb_lib() -> PathBuf {
    var("MEMSCOPE_ATB_LIB")
}

fn run(env: &TestEnv, tag: &str, scenario: &str, alg: Option<&str>) -> Run {
    let atb = atb_lib();
    let atb_s = atb.display().to_string();
    let extra = ["--scenario", scenario, "--atb-lib", &atb_s, "--wait-tracer"];
    // GLOBAL unset too, so the advice's words about it are deterministic.
    let job_env = [(ALG, alg), ("ATB_WORKSPACE_MEM_ALLOC_GLOBAL", None)];
    let (out, ledger) = trace_standin_run_with(
        env,
        "standin_atb.py",
        &format!("{tag}.jsonl"),
        &format!("out-{tag}"),
        &extra,
        &[&atb],
        &job_env,
    );
    let text = std::fs::read_to_string(&ledger).unwrap();
    let lines: Vec<Line> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let executions = lines.into_iter().filter(|l| l.kind == "execute").collect();
    let pool_text = std::fs::read_to_string(pool_ledger_path(&ledger)).unwrap();
    let pools = pool_text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    Run { out, executions, pools }
}

/// The peaks of both pools' allocated and of their reserved bytes together, by the allocator's
/// own counters.
fn peaks(run: &Run) -> (u64, u64) {
    let mut last: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    let (mut allocated, mut reserved) = (0, 0);
    for l in &run.pools {
        let (Some(a), Some(r)) = (l.allocated, l.reserved) else { continue };
        last.insert(l.pool.as_deref().unwrap_or("caching"), (a, r));
        allocated = allocated.max(last.values().map(|v| v.0).sum());
        reserved = reserved.max(last.values().map(|v| v.1).sum());
    }
    (allocated, reserved)
}

/// Every execution is one ATB_START/ATB_END pair on device 0, with the pack the stand-in ran with.
fn check_rows(run: &Run) {
    assert!(!run.executions.is_empty());
    let rows: Vec<&DbRow> =
        run.out.rows().filter(|r| r.event == "OP_LAUNCH" && r.event_type.starts_with("ATB_")).collect();
    assert_eq!(rows.len(), 2 * run.executions.len(), "one start and one end per Execute: {rows:#?}");
    // The stand-in's own counter: its runners ran exactly as often as the ledger says.
    let mut counts: BTreeMap<u64, u64> = BTreeMap::new();
    for e in &run.executions {
        let n = counts.entry(e.runner).or_default();
        *n += 1;
        assert_eq!(*n, e.execute_count, "the workload logged every execution");
        assert_eq!(e.status, 0);
    }
    for (pair, e) in rows.chunks(2).zip(&run.executions) {
        let (start, end) = (pair[0], pair[1]);
        assert_eq!((start.event_type.as_str(), end.event_type.as_str()), ("ATB_START", "ATB_END"));
        assert!(start.ts <= end.ts, "{start:?} {end:?}");
        for r in [start, end] {
            assert_eq!((r.folder.as_str(), r.device.as_str()), ("device_0", "0"));
            assert_eq!(r.attr_u64("runner"), Some(e.runner));
            assert_eq!(r.attr_u64("workspace_ptr"), Some(e.workspace_ptr));
            assert_eq!(r.attr_u64("workspace_size"), Some(e.workspace_size), "{r:?} vs {e:?}");
            assert_eq!(r.attr_u64("intermediate_size"), Some(e.intermediate_size), "{r:?} vs {e:?}");
            // The intermediates follow the scratch in the one buffer.
            assert_eq!(e.intermediate_ptr, e.workspace_ptr + e.workspace_size);
        }
        assert_eq!(end.attr.get("status").map(String::as_str), Some("0"));
    }
}

#[test]
fn probes_read_the_packs_layout_from_dwarf() {
    let env = env("atb-probes");
    let atb = atb_lib();
    let out = Command::new(&env.bin).args(["probes", "--lib"]).arg(&atb).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("_ZN3atb6Runner7ExecuteERNS_17RunnerVariantPackE"), "{text}");
    assert!(
        text.contains(
            "RunnerVariantPack from the library's DWARF: workspaceBuffer +13784, workspaceBufferSize +13792, intermediateBufferSize +13808"
        ),
        "{text}"
    );
}

#[test]
fn atb_workspaces_are_traced_and_alg_type_3_is_advised_and_lowers_the_peak() {
    let env = env("atb");

    let default = run(&env, "default", "large", None);
    check_rows(&default);
    assert!(default.executions.iter().all(|e| e.alg_type == 1), "the stand-in ran its default layout");
    let advice = advise_device0(&env, &default.out);
    let rec =
        recommendation(&advice, RULE).unwrap_or_else(|| panic!("no ATB advice for large intermediates: {advice:#}"));
    assert_eq!((rec["variable"].as_str(), rec["value"].as_str()), (Some(ALG), Some("3")), "{rec:#}");
    assert!(rec["current"].is_null(), "{rec:#}");
    let ev = &rec["evidence"];
    let largest = default.executions.iter().map(|e| e.intermediate_size).max().unwrap();
    assert_eq!(ev["largest_intermediate"], largest, "{rec:#}");
    assert_eq!(ev["executions"], default.executions.len(), "{rec:#}");
    let (allocated_before, reserved_before) = peaks(&default);
    assert_eq!(ev["peak_bytes"], reserved_before, "the device peak is both pools' reserved bytes: {rec:#}");
    let why = rec["why"].as_str().unwrap();
    assert!(why.contains("ATB_WORKSPACE_MEM_ALLOC_GLOBAL is unset: set it to 1"), "{why}");
    assert_eq!(advice["recommendations"].as_array().unwrap().len(), 1, "only the ATB advice fits: {advice:#}");
    eprintln!("advice for the default layout: {}", rec["setting"]);
    eprintln!("why: {why}");

    // Following the advice.
    let fixed = run(&env, "alg3", "large", Some("3"));
    check_rows(&fixed);
    assert!(fixed.executions.iter().all(|e| e.alg_type == 3));
    let advice = advise_device0(&env, &fixed.out);
    assert_eq!(advice["settings"][ALG], "3", "{advice:#}");
    assert!(recommendation(&advice, RULE).is_none(), "advised again after following it: {advice:#}");
    let (allocated_after, reserved_after) = peaks(&fixed);
    eprintln!(
        "peaks (allocator ledgers): reserved {reserved_before} -> {reserved_after}, allocated {allocated_before} -> {allocated_after}"
    );
    assert!(reserved_after < reserved_before, "reserved {reserved_before} -> {reserved_after}");
    assert!(allocated_after < allocated_before, "allocated {allocated_before} -> {allocated_after}");
    let saved = largest - fixed.executions.iter().map(|e| e.intermediate_size).max().unwrap();
    assert!(saved > 0 && reserved_after + saved <= reserved_before + (2 << 20), "saved {saved}");

    // Small intermediates: ATB is measured, nothing is advised.
    let small = run(&env, "small", "small", None);
    check_rows(&small);
    let advice = advise_device0(&env, &small.out);
    assert!(recommendation(&advice, RULE).is_none(), "small intermediates advised: {advice:#}");
    let atb = &advice["measured"]["atb"];
    assert_eq!(atb["executions"], small.executions.len(), "{advice:#}");
    let share = atb["largest_intermediate"].as_f64().unwrap() / atb["peak_bytes"].as_f64().unwrap();
    assert!(share > 0.0 && share < 0.10, "{share}: {advice:#}");
}
