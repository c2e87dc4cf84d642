//! Privileged tests of owners inferred from Python stacks (docs/owners.md) on the stand-ins,
//! with no markers: the job's threads that run no Python take the main thread's stack.
//!
//! Ground truth: the workloads log what they did, from the interpreter itself (each block's
//! pointer, size and the innermost frame of the script at the call, from `traceback`), and the
//! frames they run under are theirs by construction; none of it comes from the tracer.

use std::path::Path;

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
    site: String,
    #[serde(default)]
    tid: u32,
}

fn read_lines(path: &Path) -> Vec<Line> {
    std::fs::read_to_string(path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// A backward on a device: the gradients are made by native threads while the main thread waits
/// in `_engine_run_backward` (one thread with a Python thread state and no frame, as the autograd
/// engine's; one with none, a C++ worker). Their blocks are owned through the main thread's stack
/// (`PTA@gradient`, inferred), say so (`py_stack_of`), and name the job's line that waited; a
/// block made the same way outside any rule's frame keeps the allocator's label, with its site.
#[test]
fn threads_without_python_frames_take_the_main_threads_stack() {
    let env = env("owners_threads");
    let (out, ledger) = trace_standin_script(&env, "standin_threads.py", "ledger.jsonl");
    let lines = read_lines(&ledger);
    let main_tid = lines.iter().find(|l| l.kind == "main").expect("the main thread's line").tid;
    let rows: Vec<&DbRow> =
        out.rows().filter(|r| r.event == "MALLOC" && r.event_type == "PTA" && r.folder == "device_0").collect();
    for (kind, owner) in [("engine", Some("PTA@gradient")), ("worker", Some("PTA@gradient")), ("plain", None)] {
        let line = lines.iter().find(|l| l.kind == kind).unwrap_or_else(|| panic!("no {kind} line"));
        let row = rows
            .iter()
            .find(|r| r.ptr_value() == Some(line.ptr))
            .unwrap_or_else(|| panic!("{kind}: no PTA MALLOC row at {:#x}: {rows:?}", line.ptr));
        assert_eq!(row.attr_u64("size").map(|s| s >= line.size), Some(true), "{kind}: {row:?}");
        assert_ne!(row.tid, main_tid, "{kind}: made on a thread of its own");
        let attr = |key: &str| row.attr.get(key).map(String::as_str);
        assert_eq!(attr("py_stack_of"), Some("main_thread"), "{kind}: {row:?}");
        assert_eq!(attr("owner"), Some(owner.unwrap_or("PTA")), "{kind}: {row:?}");
        assert_eq!(attr("owner_source"), owner.map(|_| "inferred"), "{kind}: {row:?}");
        // `traceback` names the function by its last name; 3.11+ frames by the qualified one.
        let (place, function) = line.site.split_once(": ").unwrap();
        let site = attr("site").unwrap_or_else(|| panic!("{kind}: no site: {row:?}"));
        let (row_place, row_function) = site.split_once(": ").unwrap();
        assert_eq!(row_place, place, "{kind}: {row:?}");
        assert!(row_function == function || row_function.ends_with(&format!(".{function}")), "{kind}: {site}");
    }
    let meta_of = |key: &str| meta(out.db("device_0"), key).and_then(|v| v.parse::<u64>().ok());
    assert!(meta_of("py_stacks_main_thread") >= Some(3), "{:?}", meta_of("py_stacks_main_thread"));
}

/// A vLLM-Ascend-shaped serving job (its worker and runner named as vllm-ascend's), no markers:
/// every tensor's owner is the one its worker method gives under msMemScope's vLLM labels, and
/// the KV cache's bytes are the job's own.
#[test]
fn a_vllm_shaped_job_gets_weights_kv_cache_and_the_graph_pool_from_its_frames() {
    let env = env("owners_vllm");
    let (out, ledger) = trace_standin_script(&env, "standin_vllm.py", "ledger.jsonl");
    #[derive(Deserialize)]
    struct Tensor {
        phase: String,
        ptr: u64,
        size: u64,
    }
    let text = std::fs::read_to_string(&ledger).unwrap();
    let tensors: Vec<Tensor> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let mut rows: Vec<&DbRow> =
        out.rows().filter(|r| r.event == "MALLOC" && r.event_type == "PTA" && r.folder == "device_0").collect();
    rows.sort_by_key(|r| r.id);
    assert_eq!(rows.len(), tensors.len(), "one PTA block per tensor: {rows:?}");
    let mut kv_bytes = 0;
    for (t, row) in tensors.iter().zip(&rows) {
        assert_eq!(row.ptr_value(), Some(t.ptr), "rows in the job's order");
        assert_eq!(row.attr_u64("req_size"), Some(t.size), "{row:?}");
        let want = match t.phase.as_str() {
            "weights" => "PTA@vllm@weights",
            "kv_cache" => "PTA@vllm@kv_cache",
            "graph_pool" => "PTA@vllm@warmup@graph_pool",
            "profile" => "PTA@vllm@profile",
            "serve" => "PTA@vllm@serve",
            other => panic!("phase {other}"),
        };
        assert_eq!(row.attr.get("owner").map(String::as_str), Some(want), "{}: {row:?}", t.phase);
        assert_eq!(row.attr.get("owner_source").map(String::as_str), Some("inferred"), "{row:?}");
        if want == "PTA@vllm@kv_cache" {
            kv_bytes += row.attr_u64("req_size").unwrap();
        }
    }
    let ledger_kv: u64 = tensors.iter().filter(|t| t.phase == "kv_cache").map(|t| t.size).sum();
    assert!(ledger_kv > 0);
    assert_eq!(kv_bytes, ledger_kv, "the KV cache's bytes");
}
