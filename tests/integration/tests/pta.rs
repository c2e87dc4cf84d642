//! Privileged tests of the framework-pool layer (PTA) against the stand-in torch_npu, whose
//! caching allocator logs every block and segment with its own counters. The trace attaches by
//! symbols from the debug file, by exported symbols, or through mstx, and says which in `probes`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use memscope_integration::*;

struct Torch {
    with_debug: PathBuf,
    without_debug: PathBuf,
    debug_store: PathBuf,
    kernel_hook: PathBuf,
}

fn torch(_env: &TestEnv) -> Torch {
    Torch {
        with_debug: var("MEMSCOPE_TORCH_WITH_DEBUG"),
        without_debug: var("MEMSCOPE_TORCH_WITHOUT_DEBUG"),
        debug_store: var("MEMSCOPE_TORCH_DEBUG_STORE"),
        kernel_hook: var("MEMSCOPE_KERNEL_HOOK"),
    }
}

/// Launches the workload with tensors on `torch_lib`, the tracer told about that library.
fn run(
    env: &TestEnv,
    torch_lib: &Path,
    tracer_extra: &[&str],
    workload_extra: &[&str],
    extra_env: &[(&str, &Path)],
) -> (Output, Vec<PoolEntry>, String) {
    let out = env.scratch.join("out");
    let ledger = env.scratch.join("ledger.jsonl");
    let out_s = out.display().to_string();
    let lib_s = torch_lib.display().to_string();
    let mut args = vec!["trace", "--output", &out_s, "--lib", &lib_s];
    args.extend_from_slice(tracer_extra);
    args.push("--");
    let mut w: Vec<&str> =
        vec!["--steps", "6", "--torch-lib", &lib_s, "--empty-cache-every", "2", "--pta-oom-step", "3"];
    w.extend_from_slice(workload_extra);
    let wl = workload_args(env, &ledger, &w);
    args.extend(wl.iter().map(String::as_str));
    let driver = driver_ledger_path(&ledger);
    let pool = pool_ledger_path(&ledger);
    let mut vars: Vec<(&str, &Path)> =
        vec![("ASCEND_HOME_PATH", &env.ascend_home), ("STANDIN_HAL_LEDGER", &driver), ("STANDIN_TORCH_LEDGER", &pool)];
    vars.extend_from_slice(extra_env);
    let tracer = Tracer::spawn(env, &args, &vars);
    let (code, stderr) = tracer.finish(Duration::from_secs(120));
    assert_eq!(code, Some(0), "{stderr}");
    let out = read_output(&out);
    let driver = read_driver_ledger(&driver);
    assert_driver_truth(&driver, &out, 0);
    (out, read_pool_ledger(&pool), stderr)
}

const ALL: PtaCheck =
    PtaCheck { sizes: true, counters: true, caching: true, external: true, workspace: true, after_ns: 0 };

#[test]
fn with_the_debug_file_every_block_and_counter_matches_the_allocator() {
    let env = env("pta_debug");
    let t = torch(&env);
    let (out, pool, _) = run(&env, &t.with_debug, &[], &[], &[]);
    assert!(pool.iter().any(|e| e.ev == "segment_free"), "the workload exercises empty_cache");
    assert!(pool.iter().any(|e| e.ev == "oom"), "the workload exercises the allocator's give-up");
    assert_pta(&pool, &out, ALL);
    assert_segments(&pool, &out);
    assert_pta_within_hal(&out);
    assert_frees_carry_block_sizes(&out);
    // The allocator's give-up is an out-of-memory row of its own, after its retries.
    let gave_up = out
        .call_rows()
        .iter()
        .filter(|r| r.event_type == "OOM_TRIGGER" && r.name == "DeviceCachingAllocator::malloc")
        .count();
    assert_eq!(gave_up, pool.iter().filter(|e| e.ev == "oom").count());
    // Both devices' pools, each in its own DB.
    for folder in ["device_0", "device_1"] {
        assert!(out.files[folder].1.iter().any(|r| r.event_type == "PTA"), "{folder} has no PTA rows");
    }
}

#[test]
fn debug_dir_finds_the_debug_file_by_build_id() {
    let env = env("pta_debug_dir");
    let t = torch(&env);
    let store = t.debug_store.display().to_string();
    let (out, pool, _) = run(&env, &t.without_debug, &["--debug-dir", &store], &[], &[]);
    assert_pta(&pool, &out, ALL);
    assert!(out.call_rows().iter().any(|r| r.name == "DeviceCachingAllocator::malloc"));
}

#[test]
fn expandable_segments_count_mapped_pages_as_reserved() {
    let env = env("pta_expandable");
    let t = torch(&env);
    let conf = env.scratch.join("conf");
    std::fs::write(&conf, "").unwrap();
    let (out, pool, _) =
        run(&env, &t.with_debug, &[], &[], &[("PYTORCH_NPU_ALLOC_CONF", Path::new("expandable_segments:True"))]);
    assert!(pool.iter().any(|e| e.ev == "segment_map"), "the allocator used expandable segments");
    assert!(pool.iter().any(|e| e.ev == "segment_unmap"), "empty_cache unmapped pages");
    assert_pta(&pool, &out, ALL);
    assert_segments(&pool, &out);
    assert_pta_within_hal(&out);
    // Mapped pages are the device memory (HAL rows from aclrtMapMem); reservations are not.
    let maps = out.call_rows().iter().filter(|r| r.name == "aclrtMapMem" && r.event == "MALLOC").count();
    assert_eq!(maps, pool.iter().filter(|e| e.ev == "segment_map").count());
}

#[test]
fn max_split_and_garbage_collection_settings_are_followed() {
    let env = env("pta_max_split_gc");
    let t = torch(&env);
    let (out, pool, _) = run(
        &env,
        &t.with_debug,
        &[],
        &[],
        &[
            // torch_npu refuses max_split_size_mb of 20 or less.
            ("PYTORCH_NPU_ALLOC_CONF", Path::new("max_split_size_mb:21,garbage_collection_threshold:0.5")),
            ("STANDIN_PER_PROCESS_MEMORY_FRACTION", Path::new("0.02")),
        ],
    );
    assert_pta(&pool, &out, ALL);
    assert_segments(&pool, &out);
    assert_pta_within_hal(&out);
}

#[test]
fn without_debug_info_mstx_regions_give_every_block() {
    let env = env("pta_mstx");
    let t = torch(&env);
    // torch_npu reports regions only when msLeaks' kernel hook is preloaded.
    let (out, pool, _) = run(&env, &t.without_debug, &[], &[], &[("LD_PRELOAD", &t.kernel_hook)]);
    assert_pta(&pool, &out, ALL);
    assert_pta_within_hal(&out);
    assert!(out.call_rows().iter().any(|r| r.name == "mstxMemRegionsRegister"), "tensor blocks came from mstx");
    assert!(
        out.call_rows().iter().any(|r| r.name == "MallocBlock"),
        "external blocks from the exported symbol, merged with mstx"
    );
}

#[test]
fn without_debug_info_or_mstx_only_exported_paths_are_seen_and_probes_says_so() {
    let env = env("pta_exported");
    let t = torch(&env);
    let (out, pool, _) = run(&env, &t.without_debug, &[], &[], &[]);
    // External blocks (exact: 256 KiB needs no rounding) and workspace uses; tensors are not
    // visible without the internals or mstx, and no PTA row claims otherwise.
    let check =
        PtaCheck { sizes: true, counters: false, caching: false, external: true, workspace: false, after_ns: 0 };
    let rows: Vec<_> = out.call_rows().into_iter().filter(|r| r.event_type == "PTA").collect();
    assert!(
        rows.iter().all(|r| ["MallocBlock", "FreeBlock", "allocate_workspace"].contains(&r.name.as_str())),
        "{rows:#?}"
    );
    let without_workspace: Vec<PoolEntry> =
        pool.iter().filter(|e| e.pool.as_deref() != Some("workspace")).cloned().collect();
    let external_only = Output {
        run_dir: out.run_dir.clone(),
        files: out
            .files
            .iter()
            .map(|(k, (p, r))| {
                (k.clone(), (p.clone(), r.iter().filter(|r| r.name != "allocate_workspace").cloned().collect()))
            })
            .collect(),
        untracked: out.untracked.clone(),
    };
    assert_pta(&without_workspace, &external_only, check);
    // Every workspace use is a MALLOC at its address; its end is implied by the next use.
    for e in pool.iter().filter(|e| e.ev == "block_malloc" && e.pool.as_deref() == Some("workspace")) {
        assert!(
            rows.iter().any(|r| r.event == "MALLOC"
                && r.name == "allocate_workspace"
                && r.ptr_value() == Some(e.ptr)
                && r.tid == e.tid),
            "{e:?}"
        );
    }
    let probes = Command::new(&env.bin).args(["probes", "--lib"]).arg(&t.without_debug).output().unwrap();
    let text = String::from_utf8_lossy(&probes.stdout);
    assert!(text.contains("debug file: not found"), "{text}");
    let hidden_malloc = "_ZN7c10_npu19NPUCachingAllocator22DeviceCachingAllocator6mallocEimPvh";
    assert!(listed(&text, "missing", "DeviceCachingAllocator::malloc", hidden_malloc, "hidden"), "{text}");
    assert!(text.contains("seen only through mstx"), "{text}");
    assert!(
        listed(&text, "attach", "MallocBlock", "_ZN7c10_npu19NPUCachingAllocator11MallocBlockEmPvi", "dynsym"),
        "{text}"
    );
}

#[test]
fn probes_reports_where_each_allocator_symbol_comes_from() {
    let env = env("pta_probes");
    let t = torch(&env);
    let probes = Command::new(&env.bin).args(["probes", "--lib"]).arg(&t.with_debug).output().unwrap();
    assert!(probes.status.success());
    let text = String::from_utf8_lossy(&probes.stdout);
    assert!(text.contains(".gnu_debuglink"), "{text}");
    // Checked against the debug file's own symbol table (nm), not the tracer's reading of it.
    let debug = t.with_debug.with_file_name("libtorch_npu.so.debug");
    let nm = Command::new("nm").arg(&debug).output().unwrap();
    let symtab = String::from_utf8_lossy(&nm.stdout);
    for symbol in [
        "_ZN7c10_npu19NPUCachingAllocator22DeviceCachingAllocator6mallocEimPvh",
        "_ZN7c10_npu21NPUWorkspaceAllocator24DeviceWorkspaceAllocator4freeEPv",
    ] {
        let line = symtab.lines().find(|l| l.ends_with(symbol)).expect("in the debug file");
        let addr = u64::from_str_radix(line.split_whitespace().next().unwrap(), 16).unwrap();
        // The stand-in's text segment maps file offset == address, so the offsets agree.
        assert!(text.contains(&format!("{symbol} (debug file, offset {addr:#x})")), "{symbol} at {addr:#x}:\n{text}");
    }
    // The exported ones come from .dynsym even when the debug file has them too.
    assert!(
        listed(&text, "skip", "MallocBlock", "_ZN7c10_npu19NPUCachingAllocator11MallocBlockEmPvi", "dynsym"),
        "{text}"
    );
}

#[test]
fn attached_by_pid_mid_run_every_later_block_is_seen_without_preload() {
    let env = env("pta_attach");
    let t = torch(&env);
    let ledger = env.scratch.join("ledger.jsonl");
    let lib = t.with_debug.display().to_string();
    // No --lib: the tracer finds libtorch_npu.so in the process's maps and its debug file
    // through .gnu_debuglink.
    let run = trace_attached_mid_run(
        &env,
        &ledger,
        &["--duration", "5", "--step-sleep-ms", "10", "--torch-lib", &lib, "--empty-cache-every", "3"],
    );
    let (out, live) = (run.out, run.live);
    // Frees of blocks from before the attach are in ms_untracked_frees (not Insight's table),
    // and the summary counts them.
    assert!(!out.untracked.is_empty(), "the weights, allocated before the attach, are freed after it");
    assert_eq!(summary_untracked_frees(&run.stderr), out.untracked.len() as u64, "{}", run.stderr);
    let pool = read_pool_ledger(&pool_ledger_path(&ledger));
    assert!(pool.iter().any(|e| e.t0.is_some_and(|t| t < live)), "the workload allocated before the attach");
    let check = PtaCheck { after_ns: live, ..ALL };
    assert_pta(&pool, &out, check);
    assert_pta_within_hal(&out);
    assert_driver_truth(&read_driver_ledger(&driver_ledger_path(&ledger)), &out, live);
    let rows: Vec<_> = out.call_rows().into_iter().filter(|r| r.event_type == "PTA").collect();
    assert!(rows.iter().any(|r| r.name == "DeviceCachingAllocator::malloc"), "internals traced by pid");
    // The block's own device field (read at the DWARF offset) places every block, also on
    // threads that chose their device before the attach.
    assert!(rows.iter().all(|r| r.device != "N/A"), "PTA rows with an unknown device");
    // The weights, allocated before the attach and freed at the end, are frees of blocks the
    // trace never saw allocated.
    assert!(
        rows.iter().any(|r| r.event == "FREE" && r.attr.contains_key("unmatched")),
        "pre-attach blocks freed after it"
    );
}
