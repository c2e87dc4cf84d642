//! Privileged tests of owner attribution: the markers package's USDT probes (tag spans, address
//! tags, steps, marks, collection gating), mstx ranges and marks, and the semaphores the tracer
//! raises through the kernel.
//!
//! Ground truth: the tagged workload (tests/workloads/standin_tags.py) logs, for each tensor, the
//! owner path its scenario gave it by construction, and the stand-in allocator logs each block's
//! size; the markers' own semaphore variables say whether a tracer is attached. None of it comes
//! from the tracer.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use memscope_integration::*;
use serde::Deserialize;

#[derive(Debug, Deserialize)]
struct Line {
    kind: String,
    #[serde(default)]
    ptr: u64,
    #[serde(default)]
    owner: String,
    #[serde(default = "yes")]
    recorded: bool,
    #[serde(default)]
    t0: u64,
    #[serde(default)]
    t1: u64,
    #[serde(default)]
    name: String,
    #[serde(default)]
    t: u64,
}

fn yes() -> bool {
    true
}

struct Tags {
    markers: PathBuf,
    workload: PathBuf,
    torch: PathBuf,
}

fn tags() -> Tags {
    Tags {
        markers: var("MEMSCOPE_MARKERS"),
        workload: var("MEMSCOPE_TAGS_WORKLOAD"),
        torch: var("MEMSCOPE_TORCH_WITH_DEBUG"),
    }
}

fn workload(env: &TestEnv, t: &Tags, scenario: &str, extra: &[&str]) -> (Command, PathBuf, PathBuf) {
    let ledger = env.scratch.join("tags.jsonl");
    let pool = pool_ledger_path(&ledger);
    let mut cmd = Command::new("python3");
    cmd.arg(&t.workload)
        .args(["--scenario", scenario, "--torch-lib"])
        .arg(&t.torch)
        .arg("--ledger")
        .arg(&ledger)
        .args(extra)
        .env("PYTHONPATH", &t.markers)
        .env("ASCEND_HOME_PATH", &env.ascend_home)
        .env("STANDIN_TORCH_LEDGER", &pool);
    (cmd, ledger, pool)
}

/// Launch mode: the tracer starts the workload (the markers module is found when Python loads
/// it, by the rescan).
fn launch(env: &TestEnv, t: &Tags, scenario: &str) -> (Output, Vec<Line>, Vec<PoolEntry>) {
    let (cmd, ledger, pool) = workload(env, t, scenario, &[]);
    let out = env.scratch.join("out");
    let out_s = out.display().to_string();
    let torch_s = t.torch.display().to_string();
    let mut args = vec!["trace".to_owned(), "--output".into(), out_s, "--lib".into(), torch_s, "--".into()];
    args.push(cmd.get_program().to_string_lossy().into_owned());
    args.extend(cmd.get_args().map(|a| a.to_string_lossy().into_owned()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let vars: Vec<(&str, &Path)> =
        vec![("PYTHONPATH", &t.markers), ("ASCEND_HOME_PATH", &env.ascend_home), ("STANDIN_TORCH_LEDGER", &pool)];
    let tracer = Tracer::spawn(env, &args, &vars);
    let (code, stderr) = tracer.finish(Duration::from_secs(120));
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stderr.lines().any(|l| l.contains("USDT:") && l.contains("11 sites in") && l.contains("memscope/_native")),
        "the markers were attached:\n{stderr}"
    );
    (read_output(&out), read_lines(&ledger), read_pool_ledger(&pool))
}

fn read_lines(path: &Path) -> Vec<Line> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("ledger {}: {e}", path.display()));
    text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad ledger line {l}: {e}"))).collect()
}

/// PTA MALLOC rows per address, in time order: (timestamp, owner).
fn pta_mallocs(out: &Output) -> BTreeMap<u64, Vec<(u64, String)>> {
    let mut by_ptr: BTreeMap<u64, Vec<(u64, String)>> = BTreeMap::new();
    for r in out.rows().filter(|r| r.event == "MALLOC" && r.event_type == "PTA") {
        let owner = r.attr.get("owner").cloned().unwrap_or_default();
        by_ptr.entry(r.ptr_value().unwrap()).or_default().push((r.ts, owner));
    }
    for rows in by_ptr.values_mut() {
        rows.sort();
    }
    by_ptr
}

/// Every recorded tensor is exactly one PTA MALLOC with the ledger's owner (per address, in
/// order: the allocator reuses addresses), and no row exists for a tensor allocated while the
/// program had paused recording.
fn assert_owners(ledger: &[Line], out: &Output) {
    let rows = pta_mallocs(out);
    let mut expected: BTreeMap<u64, Vec<&Line>> = BTreeMap::new();
    for l in ledger.iter().filter(|l| l.kind == "tensor" && l.recorded) {
        expected.entry(l.ptr).or_default().push(l);
    }
    let mut problems = Vec::new();
    for (ptr, tensors) in &expected {
        let got = rows.get(ptr).map(Vec::as_slice).unwrap_or_default();
        if got.len() != tensors.len() {
            problems.push(format!(
                "{ptr:#x}: {} recorded tensors {:?}, {} MALLOC rows {:?}",
                tensors.len(),
                tensors.iter().map(|t| &t.owner).collect::<Vec<_>>(),
                got.len(),
                got
            ));
            continue;
        }
        for (t, (ts, owner)) in tensors.iter().zip(got) {
            if owner != &t.owner {
                problems.push(format!("{ptr:#x} at {ts}: owner {owner:?}, the scenario gave it {:?}", t.owner));
            }
            if *ts + CLOCK_TOLERANCE_NS < t.t0 || *ts > t.t1 + CLOCK_TOLERANCE_NS {
                problems.push(format!("{ptr:#x}: row at {ts} outside the call [{}, {}]", t.t0, t.t1));
            }
        }
    }
    for (ptr, got) in &rows {
        if !expected.contains_key(ptr) {
            problems.push(format!("{ptr:#x}: MALLOC rows {got:?} for no recorded tensor (a paused one?)"));
        }
    }
    assert!(problems.is_empty(), "owner attribution differs from the scenario:\n{}", problems.join("\n"));
}

#[test]
fn training_owners_match_the_scenario_across_threads_spans_and_address_tags() {
    let env = env("tags_train");
    let t = tags();
    let (out, ledger, _) = launch(&env, &t, "train");
    assert!(ledger.iter().any(|l| l.kind == "tensor" && !l.recorded), "the scenario pauses recording");
    assert_owners(&ledger, &out);
    // Both devices' outputs carry the whole step and mark timeline (each thread: two `step
    // start` ranges and two step() calls; one mstx mark and one markers mark).
    for (folder, (_, rows)) in &out.files {
        if folder == "device_cpu" {
            continue;
        }
        let count = |event: &str, ty: &str| rows.iter().filter(|r| r.event == event && r.event_type == ty).count();
        assert_eq!(count("SYSTEM", "STEP"), 8, "{folder}: 2 threads x (2 ranges + 2 step calls)");
        assert_eq!(count("MSTX", "Range_start"), 10, "{folder}: and one domain range per thread");
        assert_eq!(count("MSTX", "Range_end"), 10, "{folder}");
        let marks: Vec<&str> =
            rows.iter().filter(|r| r.event == "MSTX" && r.event_type == "Mark").map(|r| r.name.as_str()).collect();
        for m in ["\"checkpoint0\"", "\"checkpoint1\"", "\"saved0\"", "\"saved1\"", "\"dmark0\"", "\"dmark1\""] {
            assert!(marks.contains(&m), "{folder}: mark {m} missing from {marks:?}");
        }
        let prefill = rows.iter().filter(|r| r.event == "MSTX" && r.name == "\"prefill0\"").count();
        assert_eq!(prefill, 2, "{folder}: range names are quoted messages");
    }
}

/// The owner tree at the scenario's `serving` point, as `analyze` prints it, against the
/// allocator's block sizes of the tensors the scenario had alive then.
#[test]
fn serving_owners_and_decomposition_match_the_scenario() {
    let env = env("tags_serve");
    let t = tags();
    let (out, ledger, pool) = launch(&env, &t, "serve");
    assert_owners(&ledger, &out);

    let at = ledger.iter().find(|l| l.kind == "point" && l.name == "serving").expect("serving point").t;
    let mut truth: BTreeMap<String, u64> = BTreeMap::new();
    for l in ledger.iter().filter(|l| l.kind == "tensor" && l.t1 < at) {
        let freed = ledger.iter().any(|f| f.kind == "free" && f.ptr == l.ptr && f.t0 > l.t1 && f.t0 < at);
        if freed {
            continue;
        }
        let size = pool
            .iter()
            .find(|e| e.ev == "block_malloc" && e.ptr == l.ptr && e.t0 == e.t0.min(Some(l.t1)) && e.t1 >= Some(l.t0))
            .and_then(|e| e.size)
            .unwrap_or_else(|| panic!("no allocator block for tensor {:#x}", l.ptr));
        *truth.entry(l.owner.clone()).or_default() += size;
    }
    assert!(truth.len() >= 3, "weights, kv cache and activations are alive at the point: {truth:?}");

    let db = out.db("device_0");
    let run = Command::new(&env.bin)
        .args(["analyze", "--analysis", "decompose", "--json", "--at"])
        .arg(at.to_string())
        .arg(db)
        .output()
        .unwrap();
    assert!(run.status.success(), "analyze failed: {}", String::from_utf8_lossy(&run.stderr));
    let reports: serde_json::Value = serde_json::from_slice(&run.stdout).expect("analyze --json prints JSON");
    let at_point = reports
        .as_array()
        .expect("an array of reports")
        .iter()
        .find(|r| r["point"] == "at" && r["family"] == "PTA")
        .unwrap_or_else(|| panic!("no PTA report at --at in {reports:#}"));
    let nodes: BTreeMap<String, u64> = at_point["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| (n["path"].as_str().unwrap().to_owned(), n["bytes"].as_u64().unwrap()))
        .collect();
    for (owner, bytes) in &truth {
        assert_eq!(nodes.get(owner), Some(bytes), "{owner} at the serving point; tree {nodes:#?}");
    }
    let vllm: u64 = truth.values().sum();
    assert_eq!(nodes.get("PTA@vllm"), Some(&vllm), "a node is the sum of its subtree");
    // The table analyze wrote into the DB says the same.
    let conn = rusqlite::Connection::open(db).unwrap();
    let stored: u64 = conn
        .query_row(
            "SELECT bytes FROM ms_decompose WHERE point = 'at' AND family = 'PTA' AND owner = 'PTA@vllm@kv_cache'",
            [],
            |r| r.get::<_, i64>(0),
        )
        .unwrap() as u64;
    assert_eq!(Some(&stored), truth.get("PTA@vllm@kv_cache"));
}

/// Reads the workload's semaphores by asking it: it prints them on SIGUSR1? Simpler and
/// independent of the tracer: a helper process that only imports the markers and reports its
/// own semaphore variables to a file every 20 ms.
struct SemaphoreWatcher {
    child: Child,
    file: PathBuf,
}

impl SemaphoreWatcher {
    fn start(env: &TestEnv, t: &Tags) -> Self {
        let file = env.scratch.join("semaphores.txt");
        let script = "import memscope, sys, time\n\
                      while True:\n    \
                      open(sys.argv[1] + '.part', 'w').write(repr(sorted(memscope._native.semaphores().values())))\n    \
                      __import__('os').replace(sys.argv[1] + '.part', sys.argv[1])\n    \
                      time.sleep(0.02)\n";
        let child = Command::new("python3")
            .args(["-c", script])
            .arg(&file)
            .env("PYTHONPATH", &t.markers)
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        Self { child, file }
    }

    /// Waits until the process reports its semaphores (sorted) as `want`.
    fn wait_for(&self, want: &[u32], timeout: Duration) {
        let want = format!("{want:?}");
        let deadline = Instant::now() + timeout;
        loop {
            let now = std::fs::read_to_string(&self.file).unwrap_or_default();
            if now == want {
                return;
            }
            assert!(Instant::now() < deadline, "semaphores are {now}, expected {want}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// What the semaphores must read (sorted) while every marker site is probed, from the
    /// process's maps and the module's notes. The kernel raises a site's semaphore once for each
    /// mapping that holds the site's page and could run it (private, not writable): one on a
    /// library laid out page by page (gcc's x86-64 build), more where the loader maps a library
    /// of 64 KiB-aligned segments that share pages (lld's arm64 build) over one reservation whose
    /// gaps stay mapped from the file, `---p`.
    fn traced_values(&self) -> Vec<u32> {
        let maps = std::fs::read_to_string(format!("/proc/{}/maps", self.child.id())).unwrap();
        // (file offset, length, permissions, path) of each mapping of the markers' module.
        let module: Vec<(u64, u64, &str, &str)> = maps
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                let path = *f.get(5)?;
                if !path.contains("/memscope/_native") {
                    return None;
                }
                let (start, end) = f[0].split_once('-')?;
                let hex = |s: &str| u64::from_str_radix(s, 16).unwrap();
                Some((hex(f[2]), hex(end) - hex(start), f[1], path))
            })
            .collect();
        let path = Path::new(module.first().expect("the watcher has the markers' module mapped").3);
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
        let mut per_semaphore: BTreeMap<u64, u32> = BTreeMap::new();
        for note in sdt_notes(path).into_iter().filter(|n| n.semaphore != 0) {
            let site_page = file_offset(path, note.location) / page * page;
            let holding = module
                .iter()
                .filter(|(off, len, perms, _)| {
                    !perms.contains('w') && perms.ends_with('p') && *off <= site_page && site_page < off + len
                })
                .count();
            *per_semaphore.entry(note.semaphore).or_default() += holding as u32;
        }
        let mut values: Vec<u32> = per_semaphore.into_values().collect();
        values.sort_unstable();
        assert_eq!(values.len(), 11, "the markers' semaphores, from readelf -n");
        values
    }
}

impl Drop for SemaphoreWatcher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn semaphores_rise_while_traced_and_drop_when_the_tracer_exits_or_is_killed() {
    let env = env("tags_semaphores");
    let t = tags();
    let watcher = SemaphoreWatcher::start(&env, &t);
    watcher.wait_for(&[0; 11], Duration::from_secs(10));
    let traced = watcher.traced_values();
    let pid = watcher.child.id().to_string();
    for (how, sig) in [("SIGINT", libc::SIGINT), ("SIGKILL", libc::SIGKILL)] {
        let out = env.scratch.join(format!("out-{how}"));
        let out_s = out.display().to_string();
        // The watcher maps no Ascend library: --lib gives the tracer one, and the markers
        // module is found in the process's maps.
        let lib = env.libascendcl.display().to_string();
        let mut tracer = Tracer::spawn(&env, &["trace", "--pid", &pid, "--output", &out_s, "--lib", &lib], &[]);
        tracer.wait_live(Duration::from_secs(30));
        watcher.wait_for(&traced, Duration::from_secs(10));
        tracer.signal(sig);
        let (code, stderr) = tracer.finish(Duration::from_secs(30));
        if sig == libc::SIGINT {
            assert_eq!(code, Some(0), "{stderr}");
        }
        // The kernel lowers the counters when the tracer's perf events close, however it ended.
        watcher.wait_for(&[0; 11], Duration::from_secs(10));
    }
}

#[test]
fn markers_fired_before_the_attach_are_harmless_and_later_ones_count() {
    let env = env("tags_pre_attach");
    let t = tags();
    let ready = env.scratch.join("ready");
    let (mut cmd, ledger, pool) = workload(&env, &t, "train", &["--pre-attach", "--ready-file"]);
    cmd.arg(&ready);
    let mut child = cmd.spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ready.exists() {
        assert!(Instant::now() < deadline, "workload did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    let out = env.scratch.join("out");
    let out_s = out.display().to_string();
    let pid = child.id().to_string();
    // No --lib: the allocator, the runtime and the markers all come from the process itself.
    let tracer = Tracer::spawn(&env, &["trace", "--pid", &pid, "--output", &out_s], &[]);
    assert_eq!(wait_child(&mut child, Duration::from_secs(60)), 0, "the workload survives markers before the attach");
    let (code, stderr) = tracer.finish(Duration::from_secs(30));
    assert_eq!(code, Some(0), "{stderr}");
    let out = read_output(&out);
    let ledger = read_lines(&ledger);
    assert!(read_pool_ledger(&pool).iter().any(|e| e.ev == "block_malloc"));
    // The span opened before the attach is unknown to the tracer: its tensor is plain PTA, and
    // its later close finds nothing to close. Everything after the attach is attributed.
    assert!(ledger.iter().any(|l| l.kind == "tensor" && l.owner == "PTA"));
    assert_owners(&ledger, &out);
}

/// msMemScope's API mode through the compatibility module: with `--wait-for-start`, only what
/// the program allocates between its `start()` and `stop()` is recorded.
#[test]
fn wait_for_start_records_only_between_the_programs_start_and_stop() {
    let env = env("tags_wait_for_start");
    let t = tags();
    let ptrs = env.scratch.join("ptrs.json");
    let script = "import ctypes, json, os, sys, time, memscope\n\
                  from memscope import msmemscope\n\
                  ctypes.CDLL(os.environ['ASCEND_HOME_PATH'] + '/lib64/libascendcl.so').aclrtSetDevice(0)\n\
                  torch = ctypes.CDLL(sys.argv[1])\n\
                  torch.standin_tensor_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int]\n\
                  torch.standin_tensor_alloc.restype = ctypes.c_void_p\n\
                  memscope.wait_for_tracer(timeout=30)\n\
                  time.sleep(0.1)\n\
                  msmemscope.config(analysis='decompose')\n\
                  a = torch.standin_tensor_alloc(1 << 20, 0)\n\
                  msmemscope.start()\n\
                  b = torch.standin_tensor_alloc(2 << 20, 0)\n\
                  msmemscope.stop()\n\
                  c = torch.standin_tensor_alloc(3 << 20, 0)\n\
                  json.dump({'before': a, 'between': b, 'after': c}, open(sys.argv[2], 'w'))\n";
    let out = env.scratch.join("out");
    let (out_s, torch_s, ptrs_s) =
        (out.display().to_string(), t.torch.display().to_string(), ptrs.display().to_string());
    let args = [
        "trace",
        "--wait-for-start",
        "--output",
        &out_s,
        "--lib",
        &torch_s,
        "--",
        "python3",
        "-c",
        script,
        &torch_s,
        &ptrs_s,
    ];
    let conf = Path::new("max_split_size_mb:64");
    let vars: Vec<(&str, &Path)> =
        vec![("PYTHONPATH", &t.markers), ("ASCEND_HOME_PATH", &env.ascend_home), ("PYTORCH_NPU_ALLOC_CONF", conf)];
    let (code, stderr) = Tracer::spawn(&env, &args, &vars).finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");
    let truth: BTreeMap<String, u64> = serde_json::from_str(&std::fs::read_to_string(&ptrs).unwrap()).unwrap();
    let output = read_output(&out);
    // The allocator settings the program ran with are kept for the advisor.
    assert_eq!(meta(output.db("device_0"), "env.PYTORCH_NPU_ALLOC_CONF").as_deref(), Some("max_split_size_mb:64"));
    let rows = pta_mallocs(&output);
    let recorded: Vec<u64> = rows.keys().copied().collect();
    assert_eq!(recorded, [truth["between"]], "only the block allocated between start() and stop(); truth {truth:?}");
}

/// `trace --analysis decompose` stores the same trees that `analyze` computes offline on the
/// same DB afterwards.
#[test]
fn online_decomposition_equals_the_offline_one() {
    let env = env("tags_online_analysis");
    let t = tags();
    let (cmd, _, pool) = workload(&env, &t, "serve", &[]);
    let out = env.scratch.join("out");
    let (out_s, torch_s) = (out.display().to_string(), t.torch.display().to_string());
    let mut args: Vec<String> =
        ["trace", "--analysis", "decompose", "--output", &out_s, "--lib", &torch_s, "--"].map(str::to_owned).to_vec();
    args.push(cmd.get_program().to_string_lossy().into_owned());
    args.extend(cmd.get_args().map(|a| a.to_string_lossy().into_owned()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let vars: Vec<(&str, &Path)> =
        vec![("PYTHONPATH", &t.markers), ("ASCEND_HOME_PATH", &env.ascend_home), ("STANDIN_TORCH_LEDGER", &pool)];
    let (code, stderr) = Tracer::spawn(&env, &args, &vars).finish(Duration::from_secs(120));
    assert_eq!(code, Some(0), "{stderr}");
    let db = read_output(&out).db("device_0").to_owned();
    let table = |path: &Path| -> Vec<(String, i64, String, String, i64, i64)> {
        let conn = rusqlite::Connection::open(path).unwrap();
        let mut stmt = conn
            .prepare(
                "SELECT point, ts_ns, family, owner, bytes, blocks FROM ms_decompose ORDER BY point, family, owner",
            )
            .unwrap();
        stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    };
    let online = table(&db);
    assert!(online.iter().any(|r| r.3 == "PTA@vllm@kv_cache"), "the online run stored the trees: {online:?}");
    let copy = env.scratch.join("copy.db");
    std::fs::copy(&db, &copy).unwrap();
    let offline = std::process::Command::new(&env.bin).args(["analyze", "--decompose"]).arg(&copy).output().unwrap();
    assert!(offline.status.success(), "{}", String::from_utf8_lossy(&offline.stderr));
    assert_eq!(table(&copy), online);
}

/// The daemon: a tagged job started before it waits for its markers to be attached (the
/// semaphores), then every tensor carries the owner its scenario gave it; killing the daemon
/// outright lowers the semaphores of every process mapping the markers again.
#[test]
fn the_daemon_attributes_a_job_started_before_it_and_a_kill_lowers_the_semaphores() {
    let env = env("tags_daemon");
    let t = tags();
    let watcher = SemaphoreWatcher::start(&env, &t);
    watcher.wait_for(&[0; 11], Duration::from_secs(10));
    let traced = watcher.traced_values();
    let ready = env.scratch.join("ready");
    let (mut cmd, ledger, _) = workload(&env, &t, "serve", &["--ready-file"]);
    let mut job = cmd.arg(&ready).stdin(Stdio::null()).spawn().unwrap();
    wait_for_file(&ready, &mut job, Duration::from_secs(30));
    let out = env.scratch.join("out");
    let out_s = out.display().to_string();
    // Every call recorded: sampling would leave tensors out of the owner check.
    let args = ["daemon", "--output", &out_s, "--listen", "127.0.0.1:0", "--sample-bytes", "0"];
    let mut daemon = Tracer::spawn(&env, &args, &[("ASCEND_HOME_PATH", &env.ascend_home)]);
    daemon.wait_live(Duration::from_secs(60));
    assert_eq!(wait_child(&mut job, Duration::from_secs(60)), 0, "the job saw its markers attached and ran");
    watcher.wait_for(&traced, Duration::from_secs(10));
    // Its job is finished when it exits; then the daemon is killed.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !daemon.stderr().contains("process exited") {
        assert!(Instant::now() < deadline, "the job's end was not seen:\n{}", daemon.stderr());
        std::thread::sleep(Duration::from_millis(50));
    }
    daemon.signal(libc::SIGKILL);
    let (_, stderr) = daemon.finish(Duration::from_secs(10));
    watcher.wait_for(&[0; 11], Duration::from_secs(10));
    assert!(
        stderr.lines().any(|l| l.contains("USDT:") && l.contains("11 sites in") && l.contains("memscope/_native")),
        "the markers were attached:\n{stderr}"
    );
    assert_owners(&read_lines(&ledger), &read_output(&out));
}
