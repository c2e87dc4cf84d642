//! Privileged tests of `export`: a traced stand-in pool job's DB, exported, read by the tool the
//! format belongs to. Ground truth: the stand-in allocator's own ledger (every block it handed
//! out and took back, with the request and the rounded size), never the tracer.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
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

/// Runs `python3 WORKLOAD --torch-lib TORCH ARGS` (the stand-in torch_npu with its allocator's
/// symbols) launched under `trace --output OUT TRACER_ARGS`, with `vars`, to its end. The
/// interpreter itself is launched, not pyenv's `python3` shim (an exec more before Python runs).
fn traced(env: &TestEnv, (out, tracer): (&Path, &[&str]), workload: &Path, args: &[&str], vars: &[(&str, &Path)]) {
    let torch = var("MEMSCOPE_TORCH_WITH_DEBUG");
    let s = |p: &Path| p.display().to_string();
    let mut all = vec!["trace".to_owned(), "--output".into(), s(out), "--lib".into(), s(&torch)];
    all.extend(tracer.iter().map(|a| a.to_string()));
    all.push("--".into());
    let python = Command::new("python3").args(["-c", "import sys; print(sys.executable)"]).output().unwrap();
    let python = String::from_utf8_lossy(&python.stdout).trim().to_owned();
    all.extend([python, s(workload), "--torch-lib".into(), s(&torch)]);
    all.extend(args.iter().map(|a| a.to_string()));
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    let (code, stderr) = Tracer::spawn(env, &all, vars).finish(Duration::from_secs(120));
    assert_eq!(code, Some(0), "{stderr}");
}

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

    // A job that ends holding about half its tensors: the trace's stop writes shadow frees for
    // them, which the export must not take for frees.
    let (ledger, ready, out) = (env.scratch.join("pool.jsonl"), env.scratch.join("ready"), env.scratch.join("out"));
    let s = |p: &Path| p.display().to_string();
    let pool = env.workload.with_file_name("standin_pool_hold.py");
    // --delay: the tracer finds the interpreter of a launched command at its first rescan.
    let args = ["--ready-file", &s(&ready), "--count", "3000", "--max", "4194304", "--hold", "0.2", "--delay", "1"];
    let vars: Vec<(&str, &Path)> = vec![("ASCEND_HOME_PATH", &env.ascend_home), ("STANDIN_TORCH_LEDGER", &ledger)];
    traced(&env, (&out, &["--call-stack", "python"]), &pool, &args, &vars);
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

    let said = pytorch_reads(&env, &python, &snapshot);
    // PyTorch's own accounting of the segments equals the allocator's ledger.
    let requested: u64 = live.values().map(|(req, _)| req).sum();
    assert_eq!(said["allocated"].as_u64(), Some(requested), "{said}");
    assert_eq!(said["active_blocks"].as_u64(), Some(live.len() as u64), "{said}");
    assert!(said["entries"].as_u64().unwrap() > 3000, "{said}");
    assert_eq!(said["protocol"].as_u64(), Some(4), "protocol 4, as PyTorch writes snapshots: {said}");
    for op in said["opcodes"].as_array().unwrap() {
        assert!(PAGE_OPCODES.contains(&op.as_str().unwrap()), "opcode {op} is not one the memory_viz page reads");
    }
    // Each allocation carries the Python frame that made it, as PyTorch's own formatting prints
    // it: the workload's file, the line of its allocating call (read from its source), `main`.
    let source = std::fs::read_to_string(&pool).unwrap();
    let line =
        1 + source.lines().position(|l| l.contains("= torch.standin_tensor_alloc(")).expect("the allocating call");
    let want = format!("standin_pool_hold.py:{line}:main");
    let allocs = said["alloc_frames"].as_array().unwrap();
    let with = allocs.iter().filter(|f| f.as_array().unwrap().iter().any(|x| x.as_str() == Some(&want))).count();
    assert!(
        with * 10 >= allocs.len() * 9,
        "{with} of {} allocations have the frame {want}: {:?}",
        allocs.len(),
        &allocs[..3]
    );
    assert!(said["block_frames"].as_u64().unwrap() as usize >= live.len() * 9 / 10, "{said}");

    memsnapdump_loads(&env, &snapshot, live.len(), 3000);

    // Read back: `import` of the snapshot gives the trace's block rows (address, request, order)
    // and their Python stacks.
    let db = read_output(&out).db("device_0").to_owned();
    let back = env.scratch.join("snapshot_memscope");
    let import = Command::new(&env.bin).arg("import").arg(&snapshot).arg("-o").arg(&back).output().unwrap();
    assert!(import.status.success(), "{}", String::from_utf8_lossy(&import.stderr));
    let imported = std::fs::read_dir(back.join("device_0/dump")).unwrap().next().unwrap().unwrap().path();
    let blocks = |db: &Path| -> Vec<(String, String, String, String)> {
        let conn = rusqlite::Connection::open(db).unwrap();
        let sql = "SELECT Event, Ptr, coalesce(json_extract(Attr, '$.req_size'), ''), \"Call Stack(Python)\" FROM memscope_dump \
                   WHERE \"Event Type\" = 'PTA' AND json_extract(Attr, '$.pool') = 'caching' \
                   AND json_extract(Attr, '$.shadow') IS NULL ORDER BY \"Timestamp(ns)\", ID";
        let mut stmt = conn.prepare(sql).unwrap();
        let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))).unwrap();
        rows.collect::<Result<_, _>>().unwrap()
    };
    let (mine, theirs) = (blocks(&db), blocks(&imported));
    assert!(mine.len() > 3000, "{} block rows", mine.len());
    let requests = |rows: &[(String, String, String, String)]| -> Vec<(String, String, String)> {
        rows.iter()
            .map(|r| (r.0.clone(), r.1.clone(), if r.0 == "MALLOC" { r.2.clone() } else { String::new() }))
            .collect()
    };
    assert_eq!(requests(&theirs), requests(&mine), "the snapshot's blocks, read back");
    let stacks = |rows: &[(String, String, String, String)]| {
        rows.iter().filter(|r| r.0 == "MALLOC").map(|r| r.3.clone()).collect::<Vec<_>>()
    };
    assert_eq!(stacks(&theirs), stacks(&mine), "their Python stacks");
}

/// A trace attached to a running pool job knows none of the segments the allocator took
/// before: the export makes one up for each run of blocks seen in them, so PyTorch's reader
/// finds every block the trace saw allocated and still live in a segment, and Insight's
/// MemSnapDump, which replays from the final segments backwards, loads it.
#[test]
fn an_attached_traces_export_has_segments_for_the_blocks_of_segments_taken_before_the_attach() {
    let env = env("export_memory_viz_attached");
    let Some((python, _)) = real_torch() else { return };
    let (ledger, ready, go, out) =
        (env.scratch.join("pool.jsonl"), env.scratch.join("ready"), env.scratch.join("go"), env.scratch.join("out"));
    let torch = var("MEMSCOPE_TORCH_WITH_DEBUG");
    let mut job = Command::new("python3")
        .arg(env.workload.with_file_name("standin_pool_hold.py"))
        .arg("--torch-lib")
        .arg(&torch)
        .args(["--count", "2000", "--max", "4194304", "--hold", "0.3", "--ready-file"])
        .arg(&ready)
        .arg("--go-file")
        .arg(&go)
        .env("ASCEND_HOME_PATH", &env.ascend_home)
        .env("STANDIN_TORCH_LEDGER", &ledger)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !ready.exists() {
        assert!(std::time::Instant::now() < deadline, "the job never reached its pause");
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid = job.id().to_string();
    let out_s = out.display().to_string();
    let mut tracer = Tracer::spawn(&env, &["trace", "--pid", &pid, "--output", &out_s], &[]);
    tracer.wait_live(Duration::from_secs(30));
    let attached_ns = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    std::fs::write(&go, "").unwrap();
    assert!(job.wait().unwrap().success());
    let (code, stderr) = tracer.finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");

    let snapshot = env.scratch.join("snapshot.pickle");
    let export = Command::new(&env.bin)
        .args(["export", "--format", "memory-viz", "--device", "0", "-o"])
        .arg(&snapshot)
        .arg(&out)
        .output()
        .unwrap();
    let said_export = String::from_utf8_lossy(&export.stderr);
    assert!(export.status.success(), "{said_export}");
    assert!(said_export.contains("segments were taken before the trace started"), "{said_export}");
    // The ledger's blocks live at the end that the job allocated after the attach: the ones the
    // trace saw made (those from before are unknown to it).
    let mut born: HashMap<u64, u64> = HashMap::new();
    for line in std::fs::read_to_string(&ledger).unwrap().lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        if v["ev"] == "block_malloc" && v["t0"].as_u64().unwrap() > attached_ns {
            born.insert(v["ptr"].as_u64().unwrap(), v["req"].as_u64().unwrap());
        }
    }
    let live = live_blocks(&ledger);
    let seen: Vec<u64> = live.keys().filter(|p| born.contains_key(p)).map(|p| born[p]).collect();
    assert!(
        seen.len() > 200 && seen.len() < live.len(),
        "{} of {} live blocks after the attach",
        seen.len(),
        live.len()
    );
    let said = pytorch_reads(&env, &python, &snapshot);
    assert_eq!(said["active_blocks"].as_u64(), Some(seen.len() as u64), "{said}");
    assert_eq!(said["allocated"].as_u64(), Some(seen.iter().sum::<u64>()), "{said}");
    memsnapdump_loads(&env, &snapshot, seen.len(), 1000);
}

/// MindStudio Insight opens a snapshot by running its own MemSnapDump scripts on it
/// (`tools/dump2db.py`, which replays the trace backwards from the final segments and refuses
/// any inconsistency) and reading the tables they write. Those scripts are not in any registry
/// CI reaches, so this part runs where `MEMSCOPE_INSIGHT_MEMSNAPDUMP` names a checkout's
/// `scripts/MemSnapDump` folder, and says it skipped otherwise.
fn memsnapdump_loads(env: &TestEnv, snapshot: &Path, live: usize, min_entries: i64) {
    let Some(scripts) = std::env::var_os("MEMSCOPE_INSIGHT_MEMSNAPDUMP").map(PathBuf::from) else {
        eprintln!(
            "SKIPPED: Insight's MemSnapDump on the export: set MEMSCOPE_INSIGHT_MEMSNAPDUMP to a checkout of \
             MindStudio Insight's scripts/MemSnapDump"
        );
        return;
    };
    let (out, log) = (env.scratch.join("memsnapdump"), env.scratch.join("memsnapdump.log"));
    std::fs::create_dir_all(&out).unwrap();
    let run = Command::new("python3")
        .current_dir(&scripts)
        .arg("tools/dump2db.py")
        .arg(snapshot)
        .arg("-o")
        .arg(&out)
        .arg("--log")
        .arg(&log)
        .output()
        .unwrap();
    let said = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        run.status.success() && said.contains("Successfully dump the snapshot to database"),
        "MemSnapDump refused the export:\n{}{}\n{said}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    let db = out.join(format!("{}.db", snapshot.file_name().unwrap().to_string_lossy()));
    let conn = rusqlite::Connection::open(&db).unwrap_or_else(|e| panic!("{}: {e}", db.display()));
    let count = |sql: &str| -> i64 { conn.query_row(sql, [], |r| r.get(0)).unwrap() };
    // Its replay ends where the trace did: the ledger's live blocks, allocated.
    let entries = count("SELECT count(*) FROM trace_entry_0");
    assert!(entries > min_entries, "{entries} trace entries");
    let blocks = count("SELECT count(*) FROM block_0");
    assert!(blocks as usize >= live, "{blocks} blocks in MemSnapDump's table for {live} live at the end");
}

/// An event's `Timestamp(ns)`: its `ts` (µs after the origin) plus the origin.
fn ts_ns(e: &serde_json::Value, origin: i64) -> i64 {
    origin + (e["ts"].as_f64().unwrap() * 1000.0).round() as i64
}

/// The latest value at or before `at_ns` of each counter track: name -> value.
fn counters_at(events: &[serde_json::Value], origin: i64, at_ns: i64) -> HashMap<String, i64> {
    let mut latest: HashMap<String, (i64, i64)> = HashMap::new();
    for e in events.iter().filter(|e| e["ph"] == "C") {
        let ts = ts_ns(e, origin);
        let value = e["args"].as_object().unwrap().values().next().unwrap().as_i64().unwrap();
        let name = e["name"].as_str().unwrap().to_owned();
        if ts <= at_ns && latest.get(&name).is_none_or(|(t, _)| *t <= ts) {
            latest.insert(name, (ts, value));
        }
    }
    latest.into_iter().map(|(k, (_, v))| (k, v)).collect()
}

#[test]
fn a_perfetto_export_s_owner_tracks_equal_the_decomposition_and_its_instants_the_db_s_steps() {
    let env = env("export_perfetto");
    // The tagged serving scenario: owners under PTA@vllm and CANN, eight steps.
    let out = env.scratch.join("out");
    let ledger = env.scratch.join("tags.jsonl");
    let s = |p: &Path| p.display().to_string();
    let markers = var("MEMSCOPE_MARKERS");
    let workload = var("MEMSCOPE_TAGS_WORKLOAD");
    let args = ["--scenario", "serve", "--ledger", &s(&ledger)];
    let vars: Vec<(&str, &Path)> = vec![("PYTHONPATH", &markers), ("ASCEND_HOME_PATH", &env.ascend_home)];
    traced(&env, (&out, &[]), &workload, &args, &vars);
    let output = read_output(&out);
    let db = output.db("device_0").to_owned();

    let json = env.scratch.join("trace.json");
    let export = Command::new(&env.bin)
        .args(["export", "--format", "perfetto", "--device", "0", "-o"])
        .arg(&json)
        .arg(&db)
        .output()
        .unwrap();
    assert!(export.status.success(), "{}", String::from_utf8_lossy(&export.stderr));
    let trace: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).expect("the trace parses");
    let events = trace["traceEvents"].as_array().unwrap();
    let origin: i64 = trace["otherData"]["memscope_origin_ns"].as_str().unwrap().parse().unwrap();
    assert!(events.iter().any(|e| e["ph"] == "M" && e["name"] == "process_name" && e["args"]["name"] == "NPU 0"));

    // The instants are the DB's step rows, at their times.
    let conn = rusqlite::Connection::open(&db).unwrap();
    let steps: Vec<(String, i64)> = conn
        .prepare("SELECT Name, \"Timestamp(ns)\" FROM memscope_dump WHERE Event = 'SYSTEM' AND \"Event Type\" = 'STEP' ORDER BY 2")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert!(steps.len() >= 2, "{steps:?}");
    let instants: Vec<(String, i64)> = events
        .iter()
        .filter(|e| e["ph"] == "i" && e["cat"] == "step")
        .map(|e| (e["name"].as_str().unwrap().to_owned(), ts_ns(e, origin)))
        .collect();
    let want: Vec<(String, i64)> = steps.iter().map(|(n, t)| (format!("step {n}"), *t)).collect();
    assert_eq!(instants, want);

    // At each step and between steps, every node of analyze's trees is the sum of the tracks
    // at and below its path.
    let mut instants: Vec<i64> = steps.iter().map(|(_, t)| *t).collect();
    instants.extend(steps.windows(2).map(|w| (w[0].1 + w[1].1) / 2));
    for at in instants {
        let analyze = Command::new(&env.bin)
            .args(["analyze", "--analysis", "decompose", "--json", "--no-write", "--at"])
            .arg(at.to_string())
            .arg(&db)
            .output()
            .unwrap();
        assert!(analyze.status.success(), "{}", String::from_utf8_lossy(&analyze.stderr));
        let reports: serde_json::Value = serde_json::from_slice(&analyze.stdout).unwrap();
        let tracks = counters_at(events, origin, at);
        let mut checked = 0;
        for report in reports.as_array().unwrap().iter().filter(|r| r["point"] == "at") {
            for node in report["nodes"].as_array().unwrap() {
                let path = node["path"].as_str().unwrap();
                let family = report["family"].as_str().unwrap();
                let sum: i64 = if path.is_empty() {
                    tracks.get(&format!("{family} allocated")).copied().unwrap_or(0)
                } else {
                    // Owner tracks are named by their path; the layer and pool tracks by a word.
                    tracks
                        .iter()
                        .filter(|(name, _)| !name.ends_with(" allocated") && !name.ends_with(" reserved"))
                        .filter(|(name, _)| *name == path || name.starts_with(&format!("{path}@")))
                        .map(|(_, v)| v)
                        .sum()
                };
                assert_eq!(Some(sum), node["bytes"].as_i64(), "{family} {path:?} at {at}; tracks {tracks:?}");
                checked += 1;
            }
        }
        assert!(checked > 3, "analyze gave trees at {at}: {reports}");
    }
}
