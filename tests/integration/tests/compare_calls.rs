//! Privileged test of `compare --level op|kernel` (msMemScope's call-sequence comparison) on two
//! real traces of tests/workloads/standin_ops.py: B runs one operator more than A.
//!
//! Ground truth is the two runs' own ledgers: the operators and kernels each ran, in order, and
//! the size of the tensor each allocated right after it (msMemScope's memory delta of a call is
//! the next caching-pool event). The comparison must match every call A and B share, with equal
//! deltas, and find exactly the one extra call of B with its size.

use std::process::Command;

use memscope_integration::*;
use serde_json::Value;

fn run(env: &TestEnv, tag: &str, extra: bool) -> (Output, Vec<Value>) {
    let mut args = vec!["--wait-tracer"];
    if extra {
        args.push("--extra");
    }
    let (out, ledger) =
        trace_standin_run(env, "standin_ops.py", &format!("{tag}.jsonl"), &format!("out-{tag}"), &args, &[]);
    let text = std::fs::read_to_string(ledger).unwrap();
    (out, text.lines().map(|l| serde_json::from_str(l).unwrap()).collect())
}

fn compare(env: &TestEnv, a: &Output, b: &Output, level: &str) -> Value {
    let (a, b) = (a.run_dir.to_str().unwrap(), b.run_dir.to_str().unwrap());
    let out = Command::new(&env.bin)
        .args(["compare", a, b, "--level", level, "--device", "0", "--json"])
        .output()
        .expect("run memscope-bpf compare");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let all: Value = serde_json::from_slice(&out.stdout).unwrap();
    all.as_array().expect("one element per device pair")[0].clone()
}

#[test]
fn one_inserted_operator_is_found_with_its_memory() {
    let env = env("compare_calls");
    let (a, ledger_a) = run(&env, "a", false);
    let (b, ledger_b) = run(&env, "b", true);
    let calls = |l: &[Value]| l.iter().filter(|e| !e["op"].is_null()).count();
    let (calls_a, calls_b) = (calls(&ledger_a), calls(&ledger_b));
    assert_eq!(calls_b, calls_a + 1);
    let names_a: Vec<&str> = ledger_a.iter().filter_map(|e| e["op"].as_str()).collect();
    let extra: Vec<&Value> =
        ledger_b.iter().filter(|e| e["op"].as_str().is_some_and(|n| !names_a.contains(&n))).collect();
    assert_eq!(extra.len(), 1, "the workload's extra operator: {extra:?}");
    let extra = extra[0];

    for (level, key) in [("op", "op"), ("kernel", "kernel")] {
        let diff = compare(&env, &a, &b, level);
        let s = &diff["summary"];
        assert_eq!(
            (s["calls_a"].as_u64(), s["calls_b"].as_u64(), s["matched"].as_u64()),
            (Some(calls_a as u64), Some(calls_b as u64), Some(calls_a as u64)),
            "{level}: {diff:#}"
        );
        assert_eq!((s["only_a"].as_u64(), s["only_b"].as_u64()), (Some(0), Some(1)), "{level}: {s:#}");
        assert_eq!(s["only_b_delta"], extra["size"], "{level}: {s:#}");
        assert!(diff["largest_delta_diffs"].as_array().unwrap().is_empty(), "{level}: equal deltas expected: {diff:#}");
        let inserted: Vec<&Value> = diff["rows"].as_array().unwrap().iter().filter(|r| r["kind"] == "only_b").collect();
        assert_eq!(inserted.len(), 1, "{level}: {diff:#}");
        assert_eq!(inserted[0]["name"], extra[key], "{level}");
        assert_eq!(inserted[0]["delta_b"], extra["size"], "{level}");
    }
}
