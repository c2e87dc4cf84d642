//! Privileged tests of `export`: a traced stand-in pool job's DB, exported, read by the tool the
//! format belongs to. Ground truth: the stand-in allocator's own ledger (every block it handed
//! out and took back, with the request and the rounded size), never the tracer.

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use memscope_integration::*;

/// The opcodes the memory_viz page's own unpickler (torch/utils/viz/MemoryViz.js, `unpickle`)
/// handles; a snapshot with any other opcode does not open there.
const PAGE_OPCODES: &[&str] = &[
    "PROTO",
    "APPEND",
    "APPENDS",
    "LIST",
    "TUPLE",
    "NEWFALSE",
    "NEWTRUE",
    "NONE",
    "BINGET",
    "BININT",
    "BININT1",
    "BININT2",
    "EMPTY_DICT",
    "EMPTY_LIST",
    "FRAME",
    "LONG1",
    "LONG_BINGET",
    "MARK",
    "MEMOIZE",
    "BINPUT",
    "LONG_BINPUT",
    "SETITEMS",
    "SETITEM",
    "DICT",
    "SHORT_BINUNICODE",
    "BINUNICODE",
    "STOP",
    "EMPTY_TUPLE",
    "TUPLE1",
    "TUPLE2",
    "TUPLE3",
    "BINFLOAT",
];

/// The blocks live at the end by the allocator's ledger: address -> (request, size).
fn live_blocks(ledger: &Path) -> HashMap<u64, (u64, u64)> {
    let mut live = HashMap::new();
    for line in std::fs::read_to_string(ledger).unwrap().lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let ptr = v["ptr"].as_u64().unwrap_or(0);
        match v["ev"].as_str() {
            Some("block_malloc") => {
                live.insert(ptr, (v["req"].as_u64().unwrap(), v["size"].as_u64().unwrap()));
            }
            Some("block_free") => {
                live.remove(&ptr);
            }
            _ => {}
        }
    }
    live
}

#[test]
fn a_memory_viz_export_is_read_by_pytorchs_own_code_with_the_ledgers_live_blocks() {
    let env = env("export_memory_viz");
    let Some((python, _)) = real_torch() else { return };
    let site = Command::new(&python).args(["-c", "import torch, os; print(os.path.dirname(torch.__file__))"]).output();
    let viz = Path::new(String::from_utf8_lossy(&site.unwrap().stdout).trim()).join("cuda/_memory_viz.py");
    assert!(viz.is_file(), "no {}", viz.display());

    // A job that ends holding about half its tensors: the trace's stop writes shadow frees for
    // them, which the export must not take for frees.
    let torch = var("MEMSCOPE_TORCH_WITH_DEBUG");
    let (ledger, ready, out) = (env.scratch.join("pool.jsonl"), env.scratch.join("ready"), env.scratch.join("out"));
    let s = |p: &Path| p.display().to_string();
    let args = [
        "trace",
        "--output",
        &s(&out),
        "--lib",
        &s(&torch),
        "--",
        "python3",
        &s(&env.workload.with_file_name("standin_pool_hold.py")),
        "--torch-lib",
        &s(&torch),
        "--ready-file",
        &s(&ready),
        "--count",
        "3000",
        "--max",
        "4194304",
        "--hold",
        "0.2",
    ];
    let vars: Vec<(&str, &Path)> = vec![("ASCEND_HOME_PATH", &env.ascend_home), ("STANDIN_TORCH_LEDGER", &ledger)];
    let (code, stderr) = Tracer::spawn(&env, &args, &vars).finish(Duration::from_secs(120));
    assert_eq!(code, Some(0), "{stderr}");
    let live = live_blocks(&ledger);
    assert!(live.len() > 1000, "{} blocks live at the end", live.len());

    let snapshot = env.scratch.join("snapshot.pickle");
    let export = Command::new(&env.bin)
        .args(["export", "--format", "memory-viz", "--device", "0", "-o"])
        .arg(&snapshot)
        .arg(read_output(&out).db("device_0").parent().unwrap().parent().unwrap().parent().unwrap())
        .output()
        .unwrap();
    assert!(export.status.success(), "{}", String::from_utf8_lossy(&export.stderr));

    let check = Command::new(&python)
        .arg(env.workload.with_file_name("memory_viz_check.py"))
        .args([&viz, &snapshot])
        .arg("0")
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "PyTorch's _memory_viz.py refused the export:\n{}",
        String::from_utf8_lossy(&check.stderr)
    );
    let said: serde_json::Value = serde_json::from_slice(&check.stdout).unwrap();
    // PyTorch's own accounting of the segments equals the allocator's ledger.
    let requested: u64 = live.values().map(|(req, _)| req).sum();
    assert_eq!(said["allocated"].as_u64(), Some(requested), "{said}");
    assert_eq!(said["active_blocks"].as_u64(), Some(live.len() as u64), "{said}");
    assert!(said["entries"].as_u64().unwrap() > 3000, "{said}");
    assert!(said["protocol"].as_u64().unwrap() <= 4, "{said}");
    for op in said["opcodes"].as_array().unwrap() {
        assert!(PAGE_OPCODES.contains(&op.as_str().unwrap()), "opcode {op} is not one the memory_viz page reads");
    }
}
