//! The NVIDIA backend against the stand-in CUDA stack (tests/standin/cuda: a driver, a runtime
//! that calls it through function pointers, and a caching allocator with PyTorch's USDT probes
//! and internal names), driven by tests/workloads/standin_cuda_train.py under `trace --lib
//! libc10_cuda.so` (the runtime and the driver are found through its DT_NEEDED entries).
//!
//! Ground truth: the stand-ins' own ledgers, written as each call runs (the runtime's, the
//! driver's and the allocator's), and the workload's. What is checked:
//! - every runtime call is exactly one row with the ledger's values, the driver call it made
//!   folded into it (`hal_api`, the driver's size) and no row of its own; `cudaFree(NULL)` is no
//!   row; a refused `cudaMalloc` is an OOM_TRIGGER row, never a block;
//! - every driver call made outside the runtime (NCCL-style `cuMemAlloc_v2` and virtual memory)
//!   is exactly one row of its own kind, on the device its properties name;
//! - every block the allocator handed out and took back is one PTA row from the USDT probes,
//!   with its size, device, owner tag and the pool's allocated/reserved bytes as the allocator
//!   counted them; every segment (a `cudaMalloc` inside `alloc_block`, or a page mapped inside
//!   `map_block`) is a HAL row marked as the caching pool's; direct runtime memory is not;
//! - the run folder, `ms_meta` and the advice say the trace is CUDA's; the refused allocation
//!   is one OOM incident of the allocator (with its retry as an attempt) and no leak;
//! - a program with the runtime compiled in (`cudart_static`), launched with no `--lib`, is
//!   traced from its own `.symtab`, its driver found through its DT_NEEDED.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use memscope_integration::*;
use serde::Deserialize;

/// One call the stand-in runtime or driver logged.
#[derive(Clone, Debug, Deserialize)]
struct CudaCall {
    api: String,
    tid: u32,
    device: i64,
    size: u64,
    ptr: u64,
    #[serde(default)]
    handle: u64,
    rc: i64,
    t0: u64,
    t1: u64,
}

struct Run {
    out: Output,
    pool: Vec<PoolEntry>,
    runtime: Vec<CudaCall>,
    driver: Vec<CudaCall>,
    workload: Vec<serde_json::Value>,
    stderr: String,
    bin: PathBuf,
}

fn read_calls(path: &Path) -> Vec<CudaCall> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad ledger line {l}: {e}"))).collect()
}

/// One trace of the workload, shared by the tests of this file.
fn run() -> &'static Run {
    static RUN: OnceLock<Run> = OnceLock::new();
    RUN.get_or_init(|| {
        let env = env("cuda");
        let lib = var("MEMSCOPE_CUDA_LIB");
        let workload = var("MEMSCOPE_TAGS_WORKLOAD").with_file_name("standin_cuda_train.py");
        let s = |p: &Path| p.display().to_string();
        let (out, ledger) = (env.scratch.join("out"), env.scratch.join("workload.jsonl"));
        let ledgers =
            [("c10", "STANDIN_C10_CUDA_LEDGER"), ("cudart", "STANDIN_CUDART_LEDGER"), ("cuda", "STANDIN_CUDA_LEDGER")];
        let paths: Vec<PathBuf> = ledgers.iter().map(|(n, _)| env.scratch.join(format!("{n}.jsonl"))).collect();
        let (out_s, c10_s, lib_s, workload_s, ledger_s) =
            (s(&out), s(&lib.join("libc10_cuda.so")), s(&lib), s(&workload), s(&ledger));
        let args = [
            "trace",
            "--output",
            &out_s,
            "--lib",
            &c10_s,
            "--",
            "python3",
            &workload_s,
            "--cuda-lib",
            &lib_s,
            "--ledger",
            &ledger_s,
            "--oom-bytes",
            "2147483648",
        ];
        let markers = var("MEMSCOPE_MARKERS");
        let mut vars: Vec<(&str, Option<&std::ffi::OsStr>)> = vec![
            ("PYTHONPATH", Some(markers.as_os_str())),
            ("STANDIN_CUDA_DEVICE_MEM", Some(std::ffi::OsStr::new("1G"))),
        ];
        vars.extend(ledgers.iter().zip(&paths).map(|((_, var), p)| (*var, Some(p.as_os_str()))));
        let (code, stderr) = Tracer::spawn_with(&env, &args, &vars).finish(Duration::from_secs(120));
        assert_eq!(code, Some(0), "{stderr}");
        let workload =
            std::fs::read_to_string(&ledger).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        Run {
            out: read_output(&out),
            pool: read_pool_ledger(&paths[0]),
            runtime: read_calls(&paths[1]),
            driver: read_calls(&paths[2]),
            workload,
            stderr,
            bin: env.bin,
        }
    })
}

fn within(ts: u64, e: &CudaCall) -> bool {
    ts + CLOCK_TOLERANCE_NS >= e.t0 && ts <= e.t1 + CLOCK_TOLERANCE_NS
}

/// The driver calls made inside a runtime call (same thread, inside its span), by index.
fn nested(run: &Run) -> Vec<bool> {
    run.driver.iter().map(|d| run.runtime.iter().any(|r| r.tid == d.tid && d.t0 >= r.t0 && d.t1 <= r.t1)).collect()
}

fn rows_named<'a>(run: &'a Run, name: &str) -> Vec<&'a DbRow> {
    run.out.call_rows().into_iter().filter(|r| r.name == name).collect()
}

const RUNTIME_MALLOCS: [&str; 5] =
    ["cudaMalloc", "cudaMallocAsync", "cudaMallocManaged", "cudaMallocHost", "cudaHostAlloc"];
const RUNTIME_FREES: [&str; 3] = ["cudaFree", "cudaFreeAsync", "cudaFreeHost"];

#[test]
fn every_runtime_call_is_one_row_with_its_driver_call_folded_in() {
    let run = run();
    assert_eq!(run.workload[0]["live"], true, "the allocator's probes were live before the job began");
    let host = |api: &str| api == "cudaMallocHost" || api == "cudaHostAlloc";
    for api in RUNTIME_MALLOCS {
        let calls: Vec<&CudaCall> = run.runtime.iter().filter(|e| e.api == api && e.rc == 0).collect();
        let rows: Vec<&DbRow> = rows_named(run, api).into_iter().filter(|r| r.event == "MALLOC").collect();
        assert!(!calls.is_empty(), "the workload calls {api}");
        assert_eq!(rows.len(), calls.len(), "{api}: one MALLOC row per call: {rows:#?}");
        for e in calls {
            let r = rows
                .iter()
                .find(|r| r.ptr_value() == Some(e.ptr) && r.tid == e.tid && within(r.ts, e))
                .unwrap_or_else(|| panic!("no row for {e:?}"));
            let inner = run
                .driver
                .iter()
                .find(|d| d.tid == e.tid && d.ptr == e.ptr && d.t0 >= e.t0 && d.t1 <= e.t1)
                .unwrap_or_else(|| panic!("the stand-in runtime made no driver call for {e:?}"));
            assert_eq!(r.attr_u64("req_size"), Some(e.size), "{r:?}");
            assert_eq!(r.attr_u64("size"), Some(inner.size), "the driver's size: {r:?}");
            assert_eq!(r.attr.get("hal_api"), Some(&inner.api), "the driver call is folded in: {r:?}");
            let (folder, owner) =
                if host(api) { ("device_cpu", "HOST") } else { (&*format!("device_{}", e.device), "CUDA@RUNTIME") };
            assert_eq!(r.folder, folder, "{r:?}");
            assert!(r.attr["owner"].starts_with(owner), "{r:?}");
        }
    }
    for api in RUNTIME_FREES {
        let calls: Vec<&CudaCall> = run.runtime.iter().filter(|e| e.api == api && e.rc == 0 && e.ptr != 0).collect();
        let rows: Vec<&DbRow> = rows_named(run, api).into_iter().filter(|r| r.event == "FREE").collect();
        assert_eq!(rows.len(), calls.len(), "{api}: one FREE row per call of a real block: {rows:#?}");
        for e in calls {
            assert!(rows.iter().any(|r| r.ptr_value() == Some(e.ptr) && within(r.ts, e)), "no FREE row for {e:?}");
        }
    }
    assert!(run.runtime.iter().any(|e| e.api == "cudaFree" && e.ptr == 0), "the workload frees NULL");
    assert!(run.out.untracked.is_empty(), "cudaFree(NULL) frees nothing: {:#?}", run.out.untracked);
    // The driver calls the runtime made have no rows of their own.
    let inside = nested(run);
    for (d, _) in run.driver.iter().zip(&inside).filter(|(_, n)| **n) {
        let own =
            rows_named(run, &d.api).into_iter().filter(|r| r.ptr_value() == Some(d.ptr) && within(r.ts, d)).count();
        assert_eq!(own, 0, "a nested driver call made a row of its own: {d:?}");
    }
    // The refusals: OOM rows of the runtime call, not blocks.
    let refused: Vec<&CudaCall> = run.runtime.iter().filter(|e| e.api == "cudaMalloc" && e.rc == 2).collect();
    assert_eq!(refused.len(), 2, "the allocator asks, empties its cache, asks again: {:?}", run.runtime);
    let ooms: Vec<&DbRow> = run.out.call_rows().into_iter().filter(|r| r.event_type == "OOM_TRIGGER").collect();
    assert_eq!(ooms.len(), 2, "{ooms:#?}");
    for (r, e) in ooms.iter().zip(&refused) {
        assert!(r.name == "cudaMalloc" && within(r.ts, e) && r.attr_u64("req_size") == Some(e.size), "{r:?} {e:?}");
        assert_eq!(r.attr.get("segment").map(String::as_str), Some("caching"), "taken for the pool: {r:?}");
    }
    assert!(run.stderr.contains("backend cuda"), "{}", run.stderr);
}

#[test]
fn driver_calls_outside_the_runtime_are_rows_of_their_own() {
    let run = run();
    let inside = nested(run);
    let own: Vec<&CudaCall> =
        run.driver.iter().zip(&inside).filter(|(d, n)| !**n && d.rc == 0).map(|(d, _)| d).collect();
    let mut count: HashMap<&str, usize> = HashMap::new();
    for d in &own {
        *count.entry(d.api.as_str()).or_default() += 1;
        let (event, event_type) = match d.api.as_str() {
            "cuMemAlloc_v2" | "cuMemMap" => ("MALLOC", "HAL"),
            "cuMemFree_v2" | "cuMemUnmap" => ("FREE", "HAL"),
            "cuMemAddressReserve" => ("VMM", "RESERVE"),
            "cuMemAddressFree" => ("VMM", "RELEASE"),
            "cuMemCreate" => ("VMM", "PHYSICAL_MALLOC"),
            "cuMemRelease" => ("VMM", "PHYSICAL_FREE"),
            other => panic!("the workload makes no direct {other} call"),
        };
        let at = |r: &&DbRow| match d.api.as_str() {
            "cuMemCreate" | "cuMemRelease" => r.attr_u64("handle") == Some(d.handle),
            "cuMemAddressReserve" | "cuMemAddressFree" => r.attr_u64("addr") == Some(d.ptr),
            _ => r.ptr_value() == Some(d.ptr),
        };
        let rows: Vec<&DbRow> = rows_named(run, &d.api)
            .into_iter()
            .filter(|r| r.event == event && r.event_type == event_type && r.tid == d.tid && within(r.ts, d))
            .filter(at)
            .collect();
        assert_eq!(rows.len(), 1, "{d:?}: {rows:#?}");
        if d.api == "cuMemCreate" || d.api == "cuMemMap" {
            assert_eq!(rows[0].folder, format!("device_{}", d.device), "the handle's device: {:?}", rows[0]);
        }
        if d.api == "cuMemAlloc_v2" {
            assert_eq!(rows[0].attr["owner"], "CUDA@DRIVER", "{:?}", rows[0]);
        }
    }
    for (api, n) in &count {
        assert_eq!(rows_named(run, api).len(), *n, "{api}: no row beyond the driver's own calls");
    }
    assert!(count.contains_key("cuMemCreate") && count.contains_key("cuMemAlloc_v2"), "{count:?}");
}

#[test]
fn pool_blocks_come_from_the_usdt_probes_and_segments_from_the_internals() {
    let run = run();
    let check = PtaCheck { sizes: true, counters: true, caching: true, external: false, workspace: false, after_ns: 0 };
    assert_pta(&run.pool, &run.out, check);
    let kinds = [
        ("segment_alloc", "MALLOC", "cudaMalloc", "req_size"),
        ("segment_free", "FREE", "cudaFree", "size"),
        ("segment_map", "MALLOC", "cuMemMap", "size"),
        ("segment_unmap", "FREE", "cuMemUnmap", "size"),
    ];
    assert_segment_rows(&run.pool, &run.out, &kinds);
    for ev in ["segment_alloc", "segment_map", "segment_unmap", "block_malloc", "block_free"] {
        assert!(run.pool.iter().any(|e| e.ev == ev), "the workload makes {ev} events");
    }
    // Segment rows say whose they are; the job's own runtime memory does not.
    let segments: Vec<(u32, u64)> =
        run.pool.iter().filter(|e| e.ev == "segment_alloc" || e.ev == "segment_map").map(|e| (e.tid, e.ptr)).collect();
    for r in run.out.call_rows().into_iter().filter(|r| r.event == "MALLOC" && r.event_type == "HAL") {
        let segment = r.attr.get("segment").map(String::as_str);
        let is_segment = segments.contains(&(r.tid, r.ptr_value().unwrap()));
        assert_eq!(segment, is_segment.then_some("caching"), "{r:?}");
    }
    // The tags the job opened name the blocks (PyTorch's pool keeps msMemScope's PTA label).
    let owners = |owner: &str| {
        run.out
            .call_rows()
            .into_iter()
            .filter(|r| r.event == "MALLOC" && r.attr.get("owner").map(String::as_str) == Some(owner))
            .count()
    };
    let steps = run.out.rows().filter(|r| r.event_type == "STEP").count() / run.out.files.len().max(1);
    assert_eq!(owners("PTA@weight"), 3);
    assert_eq!(owners("PTA@activation"), 9, "three activations in each of {steps} steps");
}

#[test]
fn the_run_is_marked_cuda_and_its_oom_is_the_allocators_give_up_not_a_leak() {
    let run = run();
    let name = run.out.run_dir.file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.ends_with("_cuda"), "{name}");
    let db = run.out.db("device_0");
    assert_eq!(meta(db, "backend").as_deref(), Some("cuda"));
    let dir = run.out.run_dir.to_str().unwrap();
    let advise = Command::new(&run.bin).args(["advise", dir, "--device", "0"]).output().unwrap();
    assert!(advise.status.success(), "{}", String::from_utf8_lossy(&advise.stderr));
    let text = String::from_utf8_lossy(&advise.stdout);
    assert!(text.contains("settings at the start: PYTORCH_CUDA_ALLOC_CONF unset"), "{text}");
    let analyze = Command::new(&run.bin).args(["analyze", dir, "--analysis", "oom,leaks", "--json"]).output().unwrap();
    assert!(analyze.status.success(), "{}", String::from_utf8_lossy(&analyze.stderr));
    let reports: Vec<serde_json::Value> = serde_json::from_slice(&analyze.stdout).unwrap();
    let of = |device: &str, leaks: bool| {
        reports
            .iter()
            .find(|r| r["device"] == device && (r["analysis"] == "leaks") == leaks)
            .unwrap_or_else(|| panic!("no {device} report in {reports:#?}"))
    };
    let incidents = of("0", false)["incidents"].as_array().unwrap();
    assert_eq!(incidents.len(), 1, "one give-up, its retry an attempt: {incidents:#?}");
    assert_eq!(incidents[0]["level"], "allocator");
    assert_eq!(incidents[0]["attempts"].as_array().map(Vec::len), Some(1));
    assert_eq!(incidents[0]["verdict"], "full");
    // Everything the job allocated was freed: a refused request made into a block would be
    // device memory never freed.
    for device in ["0", "1", "cpu"] {
        let leaks = of(device, true);
        assert_eq!(leaks["never_freed"].as_array().map(Vec::len), Some(0), "{leaks}");
        assert_eq!(leaks["candidates"].as_array().map(Vec::len), Some(0), "{leaks}");
    }
}

#[test]
fn a_program_with_the_runtime_linked_in_is_traced_from_its_own_symbols() {
    let env = env("cuda_static");
    let program = var("MEMSCOPE_CUDA_LIB").join("../../bin/static_cudart");
    let nm = Command::new("nm").arg("-D").arg(&program).output().unwrap();
    assert!(!String::from_utf8_lossy(&nm.stdout).contains("cudaMalloc"), "the premise: no exported runtime");
    let (out, runtime, driver) = (env.scratch.join("out"), env.scratch.join("rt.jsonl"), env.scratch.join("drv.jsonl"));
    let (out_s, program_s) = (out.display().to_string(), program.display().to_string());
    let vars: Vec<(&str, Option<&std::ffi::OsStr>)> = vec![
        ("STANDIN_CUDART_LEDGER", Some(runtime.as_os_str())),
        ("STANDIN_CUDA_LEDGER", Some(driver.as_os_str())),
        ("ASCEND_HOME_PATH", None),
        ("LD_LIBRARY_PATH", None),
    ];
    let tracer = Tracer::spawn_with(&env, &["trace", "--output", &out_s, "--", &program_s], &vars);
    let (code, stderr) = tracer.finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains(&program_s) && stderr.contains("backend cuda"), "{stderr}");
    let out = read_output(&out);
    let (runtime, driver) = (read_calls(&runtime), read_calls(&driver));
    let rows = out.call_rows();
    for e in runtime.iter().filter(|e| e.api.starts_with("cudaMalloc")) {
        let inner = driver.iter().find(|d| d.ptr == e.ptr && d.t0 >= e.t0 && d.t1 <= e.t1).expect("its driver call");
        let r = rows
            .iter()
            .find(|r| r.event == "MALLOC" && r.name == e.api && r.ptr_value() == Some(e.ptr) && within(r.ts, e))
            .unwrap_or_else(|| panic!("no row for {e:?}: {rows:#?}"));
        assert_eq!(r.attr.get("hal_api"), Some(&inner.api), "{r:?}");
        let folder = if e.api == "cudaMallocHost" { "device_cpu".to_owned() } else { format!("device_{}", e.device) };
        assert_eq!(r.folder, folder, "the device cudaSetDevice chose: {r:?}");
    }
    let frees = runtime.iter().filter(|e| e.api.starts_with("cudaFree")).count();
    assert_eq!(rows.iter().filter(|r| r.event == "FREE").count(), frees, "{rows:#?}");
    assert_eq!(rows.iter().filter(|r| r.event == "MALLOC").count(), 3, "{rows:#?}");
}

/// The daemon, with no library known at its start, traces a CUDA job from its first call: it
/// hears of the libraries as the job loads them, raises PyTorch's semaphores in time (the job
/// waits for them), names the job's folder `_cuda`, and records every block the allocator's
/// ledger has (USDT hits are never sampled).
#[test]
fn the_daemon_traces_a_cuda_job_it_never_saw_start() {
    let env = env("cuda_daemon");
    let lib = var("MEMSCOPE_CUDA_LIB");
    let out = env.scratch.join("out");
    let mut args = vec!["daemon", "--output", out.to_str().unwrap(), "--listen", "127.0.0.1:0", "--comm", "python3"];
    args.extend(ALWAYS_PROBED);
    let mut daemon = Tracer::spawn_with(&env, &args, &[("ASCEND_HOME_PATH", None), ("LD_LIBRARY_PATH", None)]);
    daemon.wait_live(Duration::from_secs(60));
    let (pool, ledger) = (env.scratch.join("c10.jsonl"), env.scratch.join("workload.jsonl"));
    let workload = var("MEMSCOPE_TAGS_WORKLOAD").with_file_name("standin_cuda_train.py");
    let status = Command::new("python3")
        .arg(&workload)
        .args(["--cuda-lib", lib.to_str().unwrap(), "--ledger", ledger.to_str().unwrap()])
        .args(["--oom-bytes", "2147483648"])
        .env("PYTHONPATH", var("MEMSCOPE_MARKERS"))
        .env("STANDIN_C10_CUDA_LEDGER", &pool)
        .env("STANDIN_CUDA_DEVICE_MEM", "1G")
        .env_remove("ASCEND_HOME_PATH")
        .status()
        .unwrap();
    assert!(status.success(), "the workload failed");
    let done = |text: &str| text.contains("process exited");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !done(&daemon.stderr()) {
        assert!(std::time::Instant::now() < deadline, "the job never finished:\n{}", daemon.stderr());
        std::thread::sleep(Duration::from_millis(50));
    }
    daemon.signal(libc::SIGTERM);
    let (code, stderr) = daemon.finish(Duration::from_secs(30));
    assert_eq!(code, Some(0), "{stderr}");
    let line = std::fs::read_to_string(&ledger).unwrap();
    assert!(line.starts_with(r#"{"kind": "probes", "live": true"#), "the semaphores rose before the job began: {line}");
    // Its OOM has its flight recording beside the run folders, in flight/.
    let runs: Vec<PathBuf> =
        std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().path()).filter(|p| !p.ends_with("flight")).collect();
    assert_eq!(runs.len(), 1, "{runs:?}\n{stderr}");
    assert!(runs[0].to_string_lossy().ends_with("_cuda"), "{runs:?}");
    let out = read_run(&runs[0]);
    let check = PtaCheck { sizes: true, counters: true, caching: true, external: false, workspace: false, after_ns: 0 };
    assert_pta(&read_pool_ledger(&pool), &out, check);
}
