//! Privileged tests of the probe on CPython's garbage collector (the real interpreter's
//! `gc_collect_main`, in libpython) and of the advisor's "gc.collect() at epoch ends" rule, closed
//! loop, on tests/workloads/standin_gc.py over the stand-in torch_npu allocator.
//!
//! Ground truth is the workload's ledger: every free says whether the collector was running,
//! from CPython's own `gc.callbacks` (not the tracer), and every allocation logs the allocator's
//! own allocated bytes. The loop: the cyclic scenario must be advised to collect, the run that
//! collects after each step must not be, and its peak (by the allocator's counters) must be lower
//! by at least the garbage the advice reported; a run without cycles has no collector frees at all.

use std::collections::BTreeMap;

use memscope_integration::*;
use serde::Deserialize;

#[derive(Debug, Deserialize)]
struct Line {
    kind: String,
    #[serde(default)]
    ptr: u64,
    #[serde(default)]
    size: u64,
    #[serde(default)]
    gc: bool,
    #[serde(default)]
    step: u64,
    #[serde(default)]
    t: u64,
    #[serde(default)]
    allocated: u64,
}

struct Run {
    out: Output,
    ledger: Vec<Line>,
}

fn run(env: &TestEnv, tag: &str, extra: &[&str]) -> Run {
    // Waits until the markers are attached: libpython, mapped before them, is attached by then.
    let mut args = vec!["--wait-tracer"];
    args.extend_from_slice(extra);
    let (out, ledger) =
        trace_standin_run(env, "standin_gc.py", &format!("{tag}.jsonl"), &format!("out-{tag}"), &args, &[]);
    let text = std::fs::read_to_string(&ledger).unwrap();
    let ledger = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    Run { out, ledger }
}

/// The PTA frees the trace wrote (shadow ones excepted), in order: (ptr, freed by the collector).
fn traced_frees(run: &Run) -> Vec<(u64, bool)> {
    run.out
        .call_rows()
        .into_iter()
        .filter(|r| r.event == "FREE" && r.event_type == "PTA")
        .map(|r| (r.ptr_value().unwrap(), r.attr.get("freed_by").map(String::as_str) == Some("gc")))
        .collect()
}

fn ledger_frees(run: &Run) -> Vec<(u64, bool)> {
    run.ledger.iter().filter(|l| l.kind == "free").map(|l| (l.ptr, l.gc)).collect()
}

fn max_allocated(run: &Run) -> u64 {
    run.ledger.iter().filter(|l| l.kind == "tensor").map(|l| l.allocated).max().unwrap()
}

/// From the ledger alone: the collector's late frees (a step boundary between birth and free,
/// before the last boundary) and, at the allocator's peak, the bytes of such tensors born before
/// the peak's step began.
fn expected(run: &Run) -> (u64, u64, u64) {
    let steps: Vec<u64> = run.ledger.iter().filter(|l| l.kind == "step").map(|l| l.t).collect();
    let last = *steps.last().unwrap();
    let mut born: BTreeMap<u64, (u64, u64)> = BTreeMap::new(); // ptr -> (t, step)
    let mut late = Vec::new(); // (born t, born step, free t, size)
    for l in &run.ledger {
        match l.kind.as_str() {
            "tensor" => {
                born.insert(l.ptr, (l.t, l.step));
            }
            "free" => {
                let (t0, s0) = born.remove(&l.ptr).unwrap();
                if l.gc && l.step > s0 && l.t < last {
                    late.push((t0, s0, l.t, l.size));
                }
            }
            _ => {}
        }
    }
    let peak = max_allocated(run);
    let at = run.ledger.iter().find(|l| l.kind == "tensor" && l.allocated == peak).unwrap();
    let held = late.iter().filter(|&&(t0, s0, t1, _)| s0 < at.step && t0 <= at.t && at.t < t1).map(|x| x.3).sum();
    (late.len() as u64, late.iter().map(|x| x.3).sum(), held)
}

#[test]
fn collector_frees_are_marked_and_collecting_at_step_ends_is_advised_and_helps() {
    let env = env("gc");

    let cycles = run(&env, "cycles", &["--scenario", "cycles"]);
    let frees = ledger_frees(&cycles);
    assert!(frees.iter().filter(|f| f.1).count() >= 20, "the scenario's collector freed too little: {frees:?}");
    assert_eq!(traced_frees(&cycles), frees, "FREE rows marked freed_by=gc must be exactly the collector's frees");

    let advice = advise_device0(&env, &cycles.out);
    let rec = recommendation(&advice, "gc_at_epoch_end")
        .unwrap_or_else(|| panic!("no gc advice for the cyclic run: {advice:#}"));
    let ev = &rec["evidence"];
    let (late_blocks, late_bytes, held) = expected(&cycles);
    assert!(held > 0, "the scenario held no garbage at its peak");
    assert_eq!(ev["peak_bytes"], max_allocated(&cycles), "{rec:#}");
    assert_eq!(ev["late_blocks"], late_blocks, "{rec:#}");
    assert_eq!(ev["late_bytes"], late_bytes, "{rec:#}");
    assert_eq!(ev["held_at_peak"], held, "{rec:#}");
    assert_eq!(
        advice["recommendations"].as_array().unwrap().len(),
        1,
        "only the gc advice fits this scenario: {advice:#}"
    );

    // Following the advice: collect after each step.
    let fixed = run(&env, "fixed", &["--scenario", "cycles", "--gc-at-step-end"]);
    assert_eq!(traced_frees(&fixed), ledger_frees(&fixed));
    let advice = advise_device0(&env, &fixed.out);
    assert!(recommendation(&advice, "gc_at_epoch_end").is_none(), "advised again after following it: {advice:#}");
    assert!(
        max_allocated(&fixed) + held <= max_allocated(&cycles),
        "collecting at step ends must lower the allocator's peak by the garbage held: {} then {}, held {held}",
        max_allocated(&cycles),
        max_allocated(&fixed)
    );

    let clean = run(&env, "clean", &["--scenario", "clean"]);
    let frees = traced_frees(&clean);
    assert_eq!(frees, ledger_frees(&clean));
    assert!(frees.iter().all(|f| !f.1), "no collector frees without cycles: {frees:?}");
    assert!(recommendation(&advise_device0(&env, &clean.out), "gc_at_epoch_end").is_none());
}
