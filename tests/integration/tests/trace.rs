//! Privileged tests of `memscope-bpf trace` against the stand-in runtime. Ground truth is the
//! workload's own ledger; every test fails if the behaviour it names breaks.

use std::path::Path;
use std::time::Duration;

use memscope_integration::*;

const LIVE_TIMEOUT: Duration = Duration::from_secs(30);

fn launch(env: &TestEnv, out: &Path, ledger: &Path, tracer_args: &[&str], workload: &[&str]) -> Tracer {
    let out_s = out.display().to_string();
    let mut args = vec!["trace", "--output", out_s.as_str()];
    args.extend_from_slice(tracer_args);
    args.push("--");
    let w = workload_args(env, ledger, workload);
    let mut all: Vec<&str> = args;
    all.extend(w.iter().map(String::as_str));
    let driver_ledger = driver_ledger_path(ledger);
    Tracer::spawn(env, &all, &[("ASCEND_HOME_PATH", &env.ascend_home), ("STANDIN_HAL_LEDGER", &driver_ledger)])
}

const FULL_WORKLOAD: &[&str] = &[
    "--steps",
    "6",
    "--host",
    "--vmm",
    "--with-cfg",
    "--leak",
    "--fail-step",
    "2",
    "--keep-weights",
    "--driver-direct",
    "--step-sleep-ms",
    "5",
];

#[test]
fn launch_mode_matches_the_ledger_exactly() {
    let env = env("launch_exact");
    let out = env.scratch.join("out");
    let ledger = env.scratch.join("ledger.jsonl");
    let mut tracer = launch(&env, &out, &ledger, &[], FULL_WORKLOAD);
    tracer.wait_live(LIVE_TIMEOUT);
    let (code, stderr) = tracer.finish(Duration::from_secs(120));
    assert_eq!(code, Some(0), "{stderr}");

    let driver = read_driver_ledger(&driver_ledger_path(&ledger));
    let ledger = read_ledger(&ledger);
    let out = read_output(&out);
    assert_exact(&ledger, &out);
    // The driver calls behind runtime calls are merged into them, one row each, with the driver's
    // size, flag and device; direct driver calls are rows of their own.
    assert_driver_truth(&driver, &out, 0);
    assert_frees_carry_block_sizes(&out);
    assert!(out.call_rows().iter().any(|r| r.name == "halMemAlloc"), "direct driver calls are recorded");
    assert!(out.call_rows().iter().any(|r| r.attr.get("hal_api").map(String::as_str) == Some("halMemAlloc")));

    // Two devices give two DBs (plus host memory), each starting and ending with SYSTEM rows.
    let folders: Vec<&str> = out.files.keys().map(String::as_str).collect();
    assert_eq!(folders, ["device_0", "device_1", "device_cpu"], "{stderr}");
    for (folder, (_, rows)) in &out.files {
        assert_eq!(rows.first().unwrap().event_type, "START_TRACE", "{folder}");
        assert_eq!(rows.last().unwrap().event_type, "STOP_TRACE", "{folder}");
        let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
        assert_eq!(ids, (1..=rows.len() as i64).collect::<Vec<_>>(), "{folder}: IDs are 1..n");
    }

    // The failed allocations are there as OOM triggers (one per device), not as blocks.
    let ooms = out.rows().filter(|r| r.event_type == "OOM_TRIGGER").count();
    assert_eq!(ooms, ledger.iter().filter(|e| e.rc == 207_001).count());
    assert!(ooms >= 2);

    // Leaked blocks and kept weights get shadow frees; nothing else does.
    let mut expected_live = live_at_end(&ledger);
    expected_live.sort_by_key(|(_, p)| *p);
    assert!(!expected_live.is_empty());
    assert_eq!(shadow_frees(&out), expected_live);

    // Summary: where the files are, what was recorded and lost.
    assert!(stderr.contains(": live: "), "{stderr}");
    for (path, _) in out.files.values() {
        assert!(stderr.contains(&path.display().to_string()), "summary lacks {}:\n{stderr}", path.display());
    }
    assert!(stderr.contains(" 0 lost"), "{stderr}");
    let db0 = out.db("device_0");
    assert_eq!(meta(db0, "mode").as_deref(), Some("launch"));
    assert_eq!(meta(db0, "records_lost").as_deref(), Some("0"));
    assert!(meta(db0, "stop_reason").unwrap().contains("target exited"));
    let (check, _) = db_health(db0);
    assert_eq!(check, "ok");
}

#[test]
fn attach_by_pid_mid_run_records_every_call_after_attach_and_stops_at_target_exit() {
    let env = env("attach_mid_run");
    let ledger_path = env.scratch.join("ledger.jsonl");
    let run = trace_attached_mid_run(
        &env,
        &ledger_path,
        &[
            "--duration",
            "5",
            "--step-sleep-ms",
            "10",
            "--set-device-every-step",
            "--host",
            "--vmm",
            "--with-cfg",
            "--leak",
            "--keep-weights",
            "--driver-direct",
        ],
    );
    let (start, live, stderr) = (run.start, run.live, run.stderr);
    assert!(stderr.contains("target exited"), "the tracer stops when the target exits:\n{stderr}");

    let driver = read_driver_ledger(&driver_ledger_path(&ledger_path));
    let ledger = read_ledger(&ledger_path);
    let out = run.out;
    assert_attached(&ledger, &out, start, live, u64::MAX);
    assert_driver_truth(&driver, &out, live);
    // The driver's flag names the device of every allocation, also on threads that chose their
    // device before the attach: no allocation lands in the unknown-device output. (A runtime
    // call that reached the driver while only the runtime's probes were attached yet has no
    // flag: hence only calls after the trace was live.)
    let unknown: Vec<_> = out
        .call_rows()
        .into_iter()
        .filter(|r| {
            r.event == "MALLOC" && r.event_type == "HAL" && r.ts > live + CLOCK_TOLERANCE_NS && r.device == "N/A"
        })
        .collect();
    assert!(unknown.is_empty(), "allocations with an unknown device despite the driver flag: {unknown:#?}");
    // Calls before the attach are absent: the first recorded call ended after the tracer started.
    let first = out.call_rows().iter().map(|r| r.ts).min().unwrap();
    assert!(first + CLOCK_TOLERANCE_NS >= start);
    // Both devices were seen once threads revealed their device.
    assert!(out.files.contains_key("device_0") && out.files.contains_key("device_1"), "{:?}", out.files.keys());
    assert_eq!(meta(out.db("device_0"), "mode").as_deref(), Some("attach"));
}

#[test]
fn impl_forwarders_give_one_event_per_call_whichever_symbols_are_probed() {
    for set in ["default", "all"] {
        let env = env(&format!("impl_forwarders_{set}"));
        let out = env.scratch.join("out");
        let ledger = env.scratch.join("ledger.jsonl");
        let tracer =
            launch(&env, &out, &ledger, &["--probe-set", set], &["--steps", "4", "--impl-direct", "--with-cfg"]);
        let (code, stderr) = tracer.finish(Duration::from_secs(60));
        assert_eq!(code, Some(0), "{stderr}");
        let ledger = read_ledger(&ledger);
        assert!(ledger.iter().any(|e| e.via.as_deref() == Some("impl")), "the workload called Impl symbols directly");
        let out = read_output(&out);
        assert_exact(&ledger, &out);
        // What was attached is recorded; in `all` both the public and the Impl symbol are.
        let conn = rusqlite::Connection::open(out.db("device_0")).unwrap();
        let symbols: Vec<String> = conn
            .prepare("SELECT symbol FROM ms_probes WHERE api = 'aclrtMalloc' ORDER BY symbol")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        let want: &[&str] = if set == "all" { &["aclrtMalloc", "aclrtMallocImpl"] } else { &["aclrtMallocImpl"] };
        assert_eq!(symbols, want);
    }
}

#[test]
fn sigint_and_sigterm_stop_cleanly_with_a_complete_db() {
    for (sig, name) in [(libc::SIGINT, "SIGINT"), (libc::SIGTERM, "SIGTERM")] {
        let env = env(&format!("stop_{name}"));
        let out = env.scratch.join("out");
        let ledger_path = env.scratch.join("ledger.jsonl");
        let mut tracer =
            launch(&env, &out, &ledger_path, &[], &["--duration", "5", "--step-sleep-ms", "10", "--keep-weights"]);
        tracer.wait_live(LIVE_TIMEOUT);
        std::thread::sleep(Duration::from_secs(2));
        let stop = wall_ns();
        tracer.signal(sig);
        let (code, stderr) = tracer.finish(Duration::from_secs(20));
        assert_eq!(code, Some(0), "{name}: {stderr}");
        assert!(stderr.contains(name), "{name}: {stderr}");
        // The workload was not in our signal's way: it finishes and writes its ledger.
        std::thread::sleep(Duration::from_secs(5));
        let ledger = read_ledger(&ledger_path);
        let out = read_output(&out);
        // Everything up to the stop is recorded, in order; nothing after it.
        assert_attached(&ledger, &out, 0, 0, stop - CLOCK_TOLERANCE_NS);
        assert!(out.call_rows().iter().all(|r| r.ts <= stop + 1_000_000_000), "{name}: rows after the stop");
        for (folder, (path, rows)) in &out.files {
            assert_eq!(db_health(path).0, "ok");
            assert_eq!(rows.last().unwrap().event_type, "STOP_TRACE", "{folder}");
            assert!(meta(path, "stop_reason").unwrap().contains(name));
        }
        assert!(!shadow_frees(&out).is_empty(), "weights alive at the stop get shadow frees");
    }
}

#[test]
fn sigkill_of_the_tracer_leaves_a_db_that_opens_and_holds_what_was_committed() {
    let env = env("sigkill");
    let out = env.scratch.join("out");
    let ledger_path = env.scratch.join("ledger.jsonl");
    let mut tracer = launch(&env, &out, &ledger_path, &[], &["--duration", "6", "--step-sleep-ms", "10"]);
    tracer.wait_live(LIVE_TIMEOUT);
    std::thread::sleep(Duration::from_secs(3));
    let kill = wall_ns();
    tracer.signal(libc::SIGKILL);
    // Exit itself is quick; the kernel then unregisters every uprobe, which on a loaded 2-CPU
    // machine has taken over 10 s.
    let (code, _) = tracer.finish(Duration::from_secs(60));
    assert_eq!(code, None, "killed by a signal");
    std::thread::sleep(Duration::from_secs(5));
    let ledger = read_ledger(&ledger_path);
    let out = read_output(&out);
    for (path, _) in out.files.values() {
        let (check, rows) = db_health(path);
        assert_eq!(check, "ok", "{}", path.display());
        assert!(rows > 0);
    }
    // Every row is a real call in order, and calls that ended over 1.5 s before the kill (one
    // commit period plus margin) are all there.
    assert_attached(&ledger, &out, 0, 0, kill - 1_500_000_000);
    assert!(out.call_rows().len() > 100);
}

#[test]
fn csv_format_holds_the_same_calls() {
    let env = env("csv");
    let out = env.scratch.join("out");
    let ledger = env.scratch.join("ledger.jsonl");
    let tracer = launch(&env, &out, &ledger, &["--format", "csv"], FULL_WORKLOAD);
    let (code, stderr) = tracer.finish(Duration::from_secs(120));
    assert_eq!(code, Some(0), "{stderr}");
    let driver = read_driver_ledger(&driver_ledger_path(&ledger));
    let ledger = read_ledger(&ledger);
    let out = read_output(&out);
    assert!(out.files.values().all(|(p, _)| p.extension().unwrap() == "csv"));
    assert_exact(&ledger, &out);
    assert_driver_truth(&driver, &out, 0);
    // The CSV trace analysed as it is: the HAL bytes live at the stop, per device, are those its
    // own rows say (the shadow frees' sizes, read by the tests' CSV reader).
    let analysed = std::process::Command::new(&env.bin)
        .args(["analyze", "--at", "end", "--json"])
        .arg(&out.run_dir)
        .output()
        .unwrap();
    let notes = String::from_utf8_lossy(&analysed.stderr);
    assert!(analysed.status.success(), "{notes}");
    assert!(!notes.contains("msMemScope's capture"), "our own CSV is not taken for msMemScope's: {notes}");
    let trees: serde_json::Value = serde_json::from_slice(&analysed.stdout).unwrap();
    let mut checked = 0;
    for (folder, (_, rows)) in &out.files {
        let Some(device) = folder.strip_prefix("device_") else { continue };
        let want: u64 = rows
            .iter()
            .filter(|r| r.event == "FREE" && r.event_type == "HAL" && r.is_shadow())
            .map(|r| r.attr_u64("size").unwrap())
            .sum();
        let tree = trees.as_array().unwrap().iter().find(|t| t["device"] == device && t["family"] == "HAL");
        let got = tree.map_or(0, |t| t["nodes"][0]["bytes"].as_u64().unwrap());
        assert_eq!(got, want, "{folder}: HAL bytes live at the end");
        checked += u64::from(want > 0);
    }
    assert!(checked > 0, "some device held HAL memory at the stop");
}

#[test]
fn a_library_loaded_after_the_trace_started_is_picked_up() {
    let env = env("late_library");
    let out = env.scratch.join("out");
    let ledger_path = env.scratch.join("ledger.jsonl");
    let late = env.late_lib.display().to_string();
    let tracer = launch(
        &env,
        &out,
        &ledger_path,
        &[],
        &["--steps", "40", "--step-sleep-ms", "40", "--late-lib", &late, "--late-lib-step", "5"],
    );
    let (code, stderr) = tracer.finish(Duration::from_secs(120));
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("libacl_rt.so (loaded after the trace started)"), "{stderr}");
    let ledger = read_ledger(&ledger_path);
    let first_late =
        ledger.iter().filter(|e| e.lib.is_some()).map(|e| e.t0).min().expect("the workload used the late library");
    let out = read_output(&out);
    // Calls through the late copy, from a rescan period (250 ms) plus margin after it was loaded.
    let settled = first_late + 1_000_000_000;
    let rows = out.call_rows();
    assert_late_calls_recorded(&ledger, &rows, settled);
    // And everything recorded is still exactly the ledger's calls.
    assert_attached(&ledger, &out, 0, settled, u64::MAX);
    // The dynamic linker's report gets the library probed within a drain or two of its load,
    // not at the next look at the maps (every 250 ms): the first late call recorded is close.
    let first_recorded = ledger
        .iter()
        .filter(|e| e.lib.is_some() && expect(e).is_some())
        .filter(|e| rows.iter().any(|r| mismatch(e, &expect(e).unwrap(), r, false, false).is_none()))
        .map(|e| e.t0)
        .min()
        .expect("late calls were recorded");
    let window_ms = first_recorded.saturating_sub(first_late) / 1_000_000;
    // Kept beside the test's DBs, for the benchmark notes (a passing test's output is hidden).
    std::fs::write(env.scratch.join("late-window-ms"), window_ms.to_string()).unwrap();
    assert!(window_ms < 150, "the late library was probed {window_ms} ms after its first call");
    // What the library did before its probes is unknown, and the trace says so.
    let db = out.db("device_0");
    assert_eq!(meta(db, "counts_exact").as_deref(), Some("false"), "a late library's first calls are unknown");
    assert!(meta(db, "late_libraries").is_some_and(|l| l.contains("libacl_rt.so")), "{:?}", meta(db, "late_libraries"));
    assert!(stderr.contains("probed after the job loaded them:"), "{stderr}");
}

#[test]
fn a_job_that_loads_its_runtime_by_a_path_nothing_names_is_traced_from_the_load_on() {
    // No ASCEND_HOME_PATH, no LD_LIBRARY_PATH, no --lib: the job dlopens the stand-in runtime by
    // its full path (ctypes). The trace starts, probes the runtime once the job has loaded it,
    // and records its calls from then on; it says it could not know the first ones.
    let env = env("late_only");
    let out = env.scratch.join("out");
    let ledger = env.scratch.join("ledger.jsonl");
    let runtime = env.ascend_home.join("lib64/libascendcl.so");
    let (out_s, runtime_s) = (out.display().to_string(), runtime.display().to_string());
    let mut args = vec!["trace", "--output", &out_s, "--"];
    let workload = workload_args(
        &env,
        &ledger,
        &["--lib", &runtime_s, "--steps", "30", "--step-sleep-ms", "40", "--set-device-every-step"],
    );
    args.extend(workload.iter().map(String::as_str));
    let vars: [(&str, Option<&std::ffi::OsStr>); 2] = [("ASCEND_HOME_PATH", None), ("LD_LIBRARY_PATH", None)];
    let (code, stderr) = Tracer::spawn_with(&env, &args, &vars).finish(Duration::from_secs(120));
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("no accelerator library is known before the launch"), "{stderr}");
    assert!(stderr.contains("(loaded after the trace started)"), "{stderr}");
    let ledger = read_ledger(&ledger);
    let first = ledger.iter().map(|e| e.t0).min().expect("the workload made calls");
    let settled = first + 1_000_000_000;
    let out = read_output(&out);
    let later = ledger.iter().filter(|e| e.t0 > settled && expect(e).is_some()).count();
    assert!(later > 20, "too few calls after the load to judge: {later}");
    assert_attached(&ledger, &out, 0, settled, u64::MAX);
    let db = out.db("device_0");
    assert_eq!(meta(db, "counts_exact").as_deref(), Some("false"));
    assert!(
        meta(db, "late_libraries").is_some_and(|l| l.contains("libascendcl.so")),
        "{:?}",
        meta(db, "late_libraries")
    );
}

#[test]
fn a_runtime_loaded_from_a_folder_with_a_newline_in_its_name_is_traced() {
    // /proc/PID/maps shows the newline as `\012`; the runtime must be found all the same (the
    // sweep saw 0 of 50 calls recorded, and no warning).
    let env = env("newline_path");
    let dir = env.scratch.join("with\nnewline");
    std::fs::create_dir_all(&dir).unwrap();
    let late = dir.join("libacl_rt.so");
    std::fs::copy(&env.late_lib, &late).unwrap();
    let (out, ledger_path) = (env.scratch.join("out"), env.scratch.join("ledger.jsonl"));
    let late_s = late.display().to_string();
    let workload = ["--steps", "30", "--step-sleep-ms", "40", "--late-lib", &late_s, "--late-lib-step", "3"];
    let (code, stderr) = launch(&env, &out, &ledger_path, &[], &workload).finish(Duration::from_secs(120));
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stderr.contains("with\\nnewline/libacl_rt.so (loaded after the trace started)"),
        "named, escaped:\n{stderr}"
    );
    let ledger = read_ledger(&ledger_path);
    let first_late = ledger.iter().filter(|e| e.lib.is_some()).map(|e| e.t0).min().expect("the late library was used");
    let settled = first_late + 1_000_000_000;
    let out = read_output(&out);
    assert_late_calls_recorded(&ledger, &out.call_rows(), settled);
}

/// Every call the workload made through its late library after `settled` is one of `rows`.
fn assert_late_calls_recorded(ledger: &[Entry], rows: &[&DbRow], settled: u64) {
    let late_calls: Vec<&Entry> =
        ledger.iter().filter(|e| e.lib.is_some() && e.t0 > settled && expect(e).is_some()).collect();
    assert!(late_calls.len() > 20, "too few late calls to judge: {}", late_calls.len());
    for e in late_calls {
        let x = expect(e).unwrap();
        let same_ptr: Vec<String> = rows
            .iter()
            .filter(|r| r.ptr_value() == e.ptr && r.tid == e.tid)
            .map(|r| format!("{r:?}: {:?}", mismatch(e, &x, r, false, false)))
            .collect();
        assert!(
            rows.iter().any(|r| mismatch(e, &x, r, false, false).is_none()),
            "late-library call not recorded: {e:?}\n{same_ptr:#?}"
        );
    }
}
