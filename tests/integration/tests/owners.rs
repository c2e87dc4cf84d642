//! Privileged tests of owners inferred from Python stacks (docs/owners.md) on the stand-ins,
//! with no markers: the job's threads that run no Python take the main thread's stack.
//!
//! Ground truth: the workloads log what they did, from the interpreter itself (each block's
//! pointer, size and the innermost frame of the script at the call, from `traceback`), and the
//! frames they run under are theirs by construction; none of it comes from the tracer.

use std::path::Path;
use std::time::Duration;

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
        let (file, no) = place.strip_suffix(')').and_then(|p| p.rsplit_once('(')).unwrap();
        let site = attr("site").unwrap_or_else(|| panic!("{kind}: no site: {row:?}"));
        let (row_place, row_function) = site.split_once(' ').unwrap();
        assert_eq!(row_place, format!("{file}:{no}"), "{kind}: {row:?}");
        assert!(row_function == function || row_function.ends_with(&format!(".{function}")), "{kind}: {site}");
    }
    let meta_of = |key: &str| meta(out.db("device_0"), key).and_then(|v| v.parse::<u64>().ok());
    assert!(meta_of("py_stacks_main_thread") >= Some(3), "{:?}", meta_of("py_stacks_main_thread"));
}

#[derive(Deserialize)]
struct Tensor {
    phase: String,
    ptr: u64,
    /// The request, and the block's bytes as the allocator counted them.
    req: u64,
    size: u64,
    line: u32,
}

/// Every tensor of standin_vllm.py's ledger has the owner its worker method gives under
/// msMemScope's vLLM labels, inferred; the KV cache's bytes, and those of each kind the frames
/// tell, are the job's own. The mamba tensor is made in a branch of `_allocate_kv_cache_tensors`:
/// its kind comes from a `lines=` rule when `mamba_rule` gave one, else it is `vllm@kv_cache`,
/// as the hidden-state tensor made a line below it always is.
fn assert_vllm_owners(out: &Output, ledger: &Path, mamba_rule: bool) {
    let text = std::fs::read_to_string(ledger).unwrap();
    let tensors: Vec<Tensor> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let mut rows: Vec<&DbRow> =
        out.rows().filter(|r| r.event == "MALLOC" && r.event_type == "PTA" && r.folder == "device_0").collect();
    rows.sort_by_key(|r| r.id);
    assert_eq!(rows.len(), tensors.len(), "one PTA block per tensor: {rows:?}");
    let mut by_owner = std::collections::BTreeMap::<String, u64>::new();
    for (t, row) in tensors.iter().zip(&rows) {
        assert_eq!(row.ptr_value(), Some(t.ptr), "rows in the job's order");
        assert_eq!(row.attr_u64("req_size"), Some(t.req), "{row:?}");
        assert_eq!(row.attr_u64("size"), Some(t.size), "the block's bytes as the allocator counted them: {row:?}");
        let want = match t.phase.as_str() {
            "weights" => "PTA@vllm@weights",
            "kv_cache@attn" => "PTA@vllm@kv_cache@attn",
            "kv_cache@mamba" if mamba_rule => "PTA@vllm@kv_cache@mamba",
            "kv_cache@mamba" | "kv_cache@hidden_state" => "PTA@vllm@kv_cache",
            "graph_pool" => "PTA@vllm@warmup@graph_pool",
            "profile" => "PTA@vllm@profile",
            "serve" => "PTA@vllm@serve",
            other => panic!("phase {other}"),
        };
        assert_eq!(row.attr.get("owner").map(String::as_str), Some(want), "{}: {row:?}", t.phase);
        assert_eq!(row.attr.get("owner_source").map(String::as_str), Some("inferred"), "{row:?}");
        *by_owner.entry(want.to_owned()).or_default() += row.attr_u64("size").unwrap();
    }
    let ledger_bytes =
        |prefix: &str| -> u64 { tensors.iter().filter(|t| t.phase.starts_with(prefix)).map(|t| t.size).sum() };
    let traced_bytes =
        |prefix: &str| -> u64 { by_owner.iter().filter(|(o, _)| o.starts_with(prefix)).map(|(_, b)| b).sum() };
    for (phase, owner) in [("kv_cache", "PTA@vllm@kv_cache"), ("kv_cache@attn", "PTA@vllm@kv_cache@attn")] {
        assert!(ledger_bytes(phase) > 0, "{phase}");
        assert_eq!(traced_bytes(owner), ledger_bytes(phase), "{owner}'s bytes: {by_owner:?}");
    }
    let mamba: u64 = ledger_bytes("kv_cache@mamba");
    assert_eq!(by_owner.get("PTA@vllm@kv_cache@mamba").copied().unwrap_or(0), if mamba_rule { mamba } else { 0 });
}

/// The line of standin_vllm.py's runner module that makes the mamba tensor, as the script says.
fn mamba_line() -> u32 {
    let script = var("MEMSCOPE_TAGS_WORKLOAD").with_file_name("standin_vllm.py");
    let out = std::process::Command::new("python3").arg(&script).arg("--mamba-line").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().trim().parse().unwrap()
}

/// A vLLM-Ascend-shaped serving job (its worker and runner named as vllm-ascend's), no markers,
/// under `trace`, with a user's rules file naming the mamba branch's line (`--owner-rules`, as
/// docs/owners.md shows for vllm-ascend 0.23).
#[test]
fn a_vllm_shaped_job_gets_weights_kv_cache_and_the_graph_pool_from_its_frames() {
    let env = env("owners_vllm");
    let line = mamba_line();
    let rules = env.scratch.join("mamba.rules");
    let rule = format!(
        "vllm_ascend/worker/model_runner_v1.py:NPUModelRunner._allocate_kv_cache_tensors  vllm@kv_cache@mamba  \
         phase=kv_cache  lines={line}\n"
    );
    std::fs::write(&rules, rule).unwrap();
    let options = ["--owner-rules", rules.to_str().unwrap()];
    let (out, ledger) =
        trace_standin_with_options(&env, "standin_vllm.py", "ledger.jsonl", "out", &options, &[], &[], &[]);
    let tensors = std::fs::read_to_string(&ledger).unwrap();
    let mamba =
        tensors.lines().map(|l| serde_json::from_str::<Tensor>(l).unwrap()).find(|t| t.phase == "kv_cache@mamba");
    assert_eq!(mamba.map(|t| t.line), Some(line), "the interpreter's line of the mamba tensor");
    assert_vllm_owners(&out, &ledger, true);
    assert_flame_at_the_peak(&env, &out, &ledger);
}

/// The report's flame view of the PTA peak: the bytes under each worker method's frame are the
/// ledger's tensors made under it and live then (all kept ones, and one request's three serving
/// tensors, live together at the peak); the profile run's, freed long before, are not there.
fn assert_flame_at_the_peak(env: &TestEnv, out: &Output, ledger: &Path) {
    let Some(chromium) = chromium() else { return };
    let page = env.scratch.join("report.html");
    let run_dir = out.db("device_0").ancestors().nth(3).unwrap().to_owned();
    let made = std::process::Command::new(&env.bin).arg("report").arg(&run_dir).arg("-o").arg(&page).output().unwrap();
    assert!(made.status.success(), "report failed: {}", String::from_utf8_lossy(&made.stderr));
    let evals = [
        "family=(document.querySelector('#family-picker [data-pick=PTA]').click(), document.querySelector('#family-picker .on').dataset.pick)",
        "flame=[...document.querySelectorAll('#flame .node[data-name]')].map(n => [n.dataset.name, +n.dataset.depth, +n.dataset.bytes])",
        "peak=+document.getElementById('peak-bytes').dataset.bytes",
    ];
    let seen =
        visit(&chromium, &page, &Visit { evals: evals.iter().map(|s| s.to_string()).collect(), ..Visit::default() });
    let dom = &seen["dom"];
    assert_eq!(dom["family"], "PTA", "{seen}");
    let nodes: Vec<(String, u64, u64)> = serde_json::from_value(dom["flame"].clone()).unwrap();
    let tensors: Vec<Tensor> =
        std::fs::read_to_string(ledger).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let kept = |phase: &str| -> u64 { tensors.iter().filter(|t| t.phase.starts_with(phase)).map(|t| t.size).sum() };
    let one_request = tensors.iter().filter(|t| t.phase == "serve").take(3).map(|t| t.size).sum::<u64>();
    let want = [
        ("load_model", kept("weights")),
        ("initialize_from_config", kept("kv_cache")),
        ("compile_or_warm_up_model", kept("graph_pool")),
        ("execute_model", one_request),
    ];
    // The worker's methods, by their last name (3.9 and 3.10 give no class) in the worker's file.
    let worker = |method: &str| {
        nodes.iter().find(|(name, _, _)| {
            name.split_once(" (").is_some_and(|(f, place)| {
                (f == method || f.ends_with(&format!(".{method}"))) && place.contains("vllm_ascend/worker/worker.py:")
            })
        })
    };
    for (method, bytes) in want {
        let node = worker(method).unwrap_or_else(|| panic!("no {method} frame in the flame: {nodes:?}"));
        assert_eq!(node.2, bytes, "{method}'s bytes at the peak: {nodes:?}");
    }
    assert!(worker("determine_available_memory").is_none(), "the profile run's tensors were freed: {nodes:?}");
    let root = nodes.iter().find(|n| n.1 == 0).expect("the flame's root");
    assert_eq!(root.2, want.iter().map(|w| w.1).sum::<u64>(), "the PTA peak is those tensors: {nodes:?}");
    assert_eq!(dom["peak"].as_u64(), Some(root.2), "the page's peak: {dom}");
}

/// The same job found by the daemon (every call recorded): its rules apply to each job's
/// blocks from the job's first call on (the job settles a second after loading the libraries,
/// so that its allocations come after the daemon opened it).
#[test]
fn the_daemon_applies_the_owner_rules_to_its_jobs() {
    let env = env("owners_daemon");
    let out = env.scratch.join("out");
    let args = ["daemon", "--output", out.to_str().unwrap(), "--listen", "127.0.0.1:0", "--sample-bytes", "0"];
    let mut daemon = Tracer::spawn(&env, &args, &[("ASCEND_HOME_PATH", &env.ascend_home)]);
    daemon.wait_live(Duration::from_secs(60));
    let ledger = env.scratch.join("ledger.jsonl");
    let torch = var("MEMSCOPE_TORCH_WITH_DEBUG");
    let workload = var("MEMSCOPE_TAGS_WORKLOAD").with_file_name("standin_vllm.py");
    let mut job = std::process::Command::new("python3")
        .arg(&workload)
        .args(["--torch-lib", torch.to_str().unwrap(), "--ledger", ledger.to_str().unwrap(), "--settle", "1"])
        .env("ASCEND_HOME_PATH", &env.ascend_home)
        .spawn()
        .unwrap();
    assert_eq!(wait_child(&mut job, Duration::from_secs(60)), 0, "the job failed");
    daemon.signal(libc::SIGTERM);
    let (code, stderr) = daemon.finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains(&format!("job {}: python: CPython", job.id())), "{stderr}");
    let folder = std::fs::read_dir(&out)
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.contains(&format!("_{}_", job.id()))))
        .unwrap_or_else(|| panic!("no run folder of job {}:\n{stderr}", job.id()));
    assert_vllm_owners(&read_run(&folder), &ledger, false);
}
