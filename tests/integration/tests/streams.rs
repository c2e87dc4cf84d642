//! Privileged closed-loop tests of torch_npu's stream marks (`recordStream` / `eraseStream`, on
//! the stand-in) and the advisor's MULTI_STREAM_MEMORY_REUSE rule, on
//! tests/workloads/standin_streams.py.
//!
//! Ground truth is the stand-in allocator's own ledger (STANDIN_TORCH_LEDGER): which frees it
//! kept back for another stream (`deferred`), and its reserved bytes. The loop: gradients freed
//! after the collective with reuse off must be advised `1`, and reuse 1 must lower the peak;
//! gradients freed before the collective was waited for, with the default, must be advised `3`,
//! and 3 must lower the peak; without a collective nothing is advised.

use memscope_integration::*;
use serde_json::Value;

struct Run {
    out: Output,
    pool: Vec<Value>,
}

fn run(env: &TestEnv, tag: &str, scenario: &str, reuse: Option<&str>) -> Run {
    let vars: Vec<(&str, &str)> = reuse.map(|r| ("MULTI_STREAM_MEMORY_REUSE", r)).into_iter().collect();
    let args = ["--wait-tracer", "--scenario", scenario];
    let (out, ledger) =
        trace_standin_run(env, "standin_streams.py", &format!("{tag}.jsonl"), &format!("out-{tag}"), &args, &vars);
    let text = std::fs::read_to_string(pool_ledger_path(&ledger)).unwrap();
    let pool = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    Run { out, pool }
}

/// The frees the allocator kept back, in order (their block addresses).
fn ledger_deferred(run: &Run) -> Vec<u64> {
    run.pool
        .iter()
        .filter(|e| e["ev"] == "block_free" && e["deferred"] == true)
        .map(|e| e["ptr"].as_u64().unwrap())
        .collect()
}

/// The PTA FREE rows the trace marked as still used by another stream, in order.
fn traced_deferred(run: &Run) -> Vec<u64> {
    run.out
        .call_rows()
        .into_iter()
        .filter(|r| r.event == "FREE" && r.event_type == "PTA" && r.attr.contains_key("stream_uses"))
        .map(|r| r.ptr_value().unwrap())
        .collect()
}

fn peak_reserved(run: &Run) -> u64 {
    run.pool.iter().filter_map(|e| e["reserved"].as_u64()).max().unwrap()
}

/// The MULTI_STREAM_MEMORY_REUSE recommendation for device 0, if any.
fn reuse_advice(env: &TestEnv, run: &Run) -> Option<Value> {
    recommendation(&advise_device0(env, &run.out), "multi_stream_memory_reuse").cloned()
}

#[test]
fn blocks_freed_while_marked_are_seen_and_multi_stream_reuse_is_advised_and_helps() {
    let env = env("streams");

    let off = run(&env, "off", "after-wait", Some("0"));
    let deferred = ledger_deferred(&off);
    assert!(deferred.len() >= 10, "the scenario deferred too little: {deferred:?}");
    assert_eq!(traced_deferred(&off), deferred, "FREE rows with stream_uses must be exactly the deferred frees");
    let rec = reuse_advice(&env, &off).expect("reuse off, marked frees and growth: advice expected");
    assert_eq!((rec["value"].as_str(), rec["current"].as_str()), (Some("1"), Some("0")), "{rec:#}");
    assert_eq!(rec["evidence"]["deferred_blocks"], deferred.len() as u64, "{rec:#}");
    assert!(rec["evidence"]["grown_while_deferred"].as_u64().unwrap() > 0, "{rec:#}");

    let on = run(&env, "on", "after-wait", Some("1"));
    assert!(ledger_deferred(&on).is_empty() && traced_deferred(&on).is_empty());
    assert!(reuse_advice(&env, &on).is_none());
    assert!(
        peak_reserved(&on) < peak_reserved(&off),
        "following the advice must lower the allocator's peak reserved: {} then {}",
        peak_reserved(&off),
        peak_reserved(&on)
    );

    let early = run(&env, "early", "early-free", None);
    assert_eq!(traced_deferred(&early), ledger_deferred(&early));
    let rec = reuse_advice(&env, &early).expect("gradients freed before wait(): advice expected");
    assert_eq!((rec["value"].as_str(), rec["current"].as_str()), (Some("3"), None), "{rec:#}");
    let three = run(&env, "three", "early-free", Some("3"));
    assert!(reuse_advice(&env, &three).is_none(), "3 is set: nothing more to advise");
    assert!(peak_reserved(&three) < peak_reserved(&early), "{} then {}", peak_reserved(&early), peak_reserved(&three));

    let none = run(&env, "none", "no-comm", None);
    assert!(traced_deferred(&none).is_empty());
    assert!(reuse_advice(&env, &none).is_none());
}
