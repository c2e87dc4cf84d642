//! Operators: a REAL PyTorch job (tests/workloads/torch_ops.py) runs explicit operators and a few
//! MLP training steps on the CPU inside `memscope.torch.trace_ops()`, with `memscope-bpf trace
//! --pid` attached; the trace's `OP_LAUNCH` and `ACCESS` rows must be exactly what the workload's
//! own, independent dispatch mode logged. Skips, saying why, when there is no torch venv.
//!
//! Why each ground truth does not come from the tracer or the markers package:
//!
//! 1. The operator sequence. The ledger's mode sits on top of the markers' mode, so it sees every
//!    operator the markers see, and names it from the schema (`aten::mm` + overload); the DB's
//!    `ATEN_START`/`ATEN_END` rows of each thread, in row order, must be start/end pairs of exactly
//!    the ledger's names, in its order (operators do not nest: a dispatch mode is off while its
//!    own handler runs).
//! 2. The accesses. For each operator the ledger lists the tensors it read and wrote as STORAGE
//!    pointers (`untyped_storage().data_ptr()`, the block `c10::alloc_cpu` returned), with the
//!    tensor's bytes, dtype and shape. The DB's ACCESS rows between that operator's start and end
//!    must be, as a multiset, exactly the ledger's entries whose storage is a block the DB knows
//!    (a `c10::alloc_cpu` MALLOC row, not freed, when the operator ended: the storages made
//!    after the tracer attached): kind, the row's resolved block (`Attr.block`, checked against
//!    the live HOST block that holds `Ptr`), `size`, `dtype` and `shape`. So no access is missed,
//!    none is made up, none lands in the wrong operator or block. The workload builds all its
//!    tensors after the attach, so nearly every ledger entry must count.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use memscope_integration::*;
use serde::Deserialize;

const ALLOC: &str = "c10::alloc_cpu";
const FREE: &str = "c10::free_cpu";

/// One access the ledger logged: kind, storage pointer, bytes, dtype, shape.
type LedgerAccess = (String, u64, u64, String, Vec<u64>);

#[derive(Debug, Deserialize)]
struct LedgerOp {
    tid: u32,
    name: String,
    accesses: Vec<LedgerAccess>,
}

#[derive(Debug, Deserialize)]
struct Ledger {
    pid: u32,
    ops: Vec<LedgerOp>,
}

/// An access as both sides can state it: (READ/WRITE, block, bytes, dtype, shape text).
type Access = (String, u64, u64, String, String);

fn shape_text(shape: &[u64]) -> String {
    format!("[{}]", shape.iter().map(u64::to_string).collect::<Vec<_>>().join(","))
}

fn counts<T: Ord + Clone>(items: &[T]) -> BTreeMap<T, usize> {
    let mut m = BTreeMap::new();
    for i in items {
        *m.entry(i.clone()).or_default() += 1;
    }
    m
}

/// Runs the torch job with the tracer attached from its start; returns the job's ledger, the
/// tracer's output and its stderr.
fn traced_ops_run(env: &TestEnv, python: &Path, markers: &Path) -> (Ledger, Output, String) {
    let workload = env.workload.with_file_name("torch_ops.py");
    let ledger_path = env.scratch.join("ledger.json");
    let ready = env.scratch.join("ready");
    let out = env.scratch.join("out");

    let mut job = Command::new(python)
        .arg(&workload)
        .args(["--ledger", &ledger_path.display().to_string()])
        .args(["--ready", &ready.display().to_string()])
        .args(["--steps", "3"])
        .env("PYTHONPATH", markers)
        .stdin(Stdio::null())
        .spawn()
        .expect("start the torch workload");
    let pid: u32 = wait_for_file(&ready, &mut job, Duration::from_secs(120)).trim().parse().unwrap();
    assert_eq!(pid, job.id());

    let (out_s, pid_s) = (out.display().to_string(), pid.to_string());
    let mut tracer = Tracer::spawn(env, &["trace", "--pid", &pid_s, "--output", &out_s], &[]);
    tracer.wait_live(Duration::from_secs(60));
    assert_eq!(wait_child(&mut job, Duration::from_secs(180)), 0, "the torch workload failed");
    let (code, stderr) = tracer.finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");
    eprintln!("tracer:\n{stderr}");
    assert!(
        stderr.lines().any(|l| l.contains("USDT:") && l.contains("11 sites in") && l.contains("memscope/_native")),
        "the operator probes were attached:\n{stderr}"
    );

    let text = std::fs::read_to_string(&ledger_path).unwrap();
    let ledger: Ledger = serde_json::from_str(&text).expect("the ledger is JSON");
    assert_eq!(ledger.pid, pid);
    assert!(ledger.ops.len() > 50, "a few training steps make many operators: {}", ledger.ops.len());

    (ledger, read_output(&out), stderr)
}

/// Each thread's ATEN_START/ATEN_END rows, in row order, are start/end pairs of exactly the
/// ledger's operators, in its order.
fn assert_op_sequence(rows: &[&DbRow], ledger: &Ledger) {
    let mut db_seq: BTreeMap<u32, Vec<(String, String)>> = BTreeMap::new();
    for r in rows.iter().filter(|r| r.event == "OP_LAUNCH") {
        assert_eq!((r.ptr.as_str(), r.device.as_str()), ("N/A", "cpu"), "{r:?}");
        db_seq.entry(r.tid).or_default().push((r.event_type.clone(), r.name.clone()));
    }
    let mut want_seq: BTreeMap<u32, Vec<(String, String)>> = BTreeMap::new();
    for op in &ledger.ops {
        let seq = want_seq.entry(op.tid).or_default();
        seq.push(("ATEN_START".into(), op.name.clone()));
        seq.push(("ATEN_END".into(), op.name.clone()));
    }
    for (tid, want) in &want_seq {
        let got = db_seq.get(tid).map(Vec::as_slice).unwrap_or_default();
        let first = got.iter().zip(want).position(|(g, w)| g != w).unwrap_or(got.len().min(want.len()));
        assert!(
            got == want.as_slice(),
            "thread {tid}: {} DB rows vs {} ledger rows, first difference at {first}: DB {:?} vs ledger {:?}",
            got.len(),
            want.len(),
            got.get(first),
            want.get(first)
        );
    }
    assert_eq!(db_seq.keys().collect::<Vec<_>>(), want_seq.keys().collect::<Vec<_>>(), "the same threads");
}

/// What replaying the cpu file's rows found: accesses matched, ledger entries on storages the
/// trace never saw allocated, READ and WRITE rows, and the operators whose accesses differ.
#[derive(Default)]
struct Replayed {
    matched: usize,
    excluded: usize,
    reads: usize,
    writes: usize,
    mismatches: Vec<String>,
}

/// Replays the rows in ID order: each operator's ACCESS rows against the ledger's accesses on
/// storages live when it ended; each access row's block must be the live block holding `Ptr`.
fn replay_accesses(rows: &[&DbRow], ledger: &Ledger) -> Replayed {
    let mut next_op: HashMap<u32, usize> = HashMap::new();
    let ops_of: HashMap<u32, Vec<&LedgerOp>> = ledger.ops.iter().fold(HashMap::new(), |mut m, op| {
        m.entry(op.tid).or_insert_with(Vec::new).push(op);
        m
    });
    // live c10 blocks: start -> (end, allocation_id)
    let mut live: BTreeMap<u64, (u64, String)> = BTreeMap::new();
    let mut open: HashMap<u32, (String, Vec<Access>)> = HashMap::new();
    let mut seen = Replayed::default();
    for r in rows {
        match (r.event.as_str(), r.name.as_str()) {
            ("MALLOC", ALLOC) => {
                let (ptr, size) = (r.ptr_value().unwrap(), r.attr_u64("size").unwrap());
                live.insert(ptr, (ptr + size, r.attr["allocation_id"].clone()));
            }
            ("FREE", FREE) => {
                live.remove(&r.ptr_value().unwrap());
            }
            ("OP_LAUNCH", name) if r.event_type == "ATEN_START" => {
                assert!(open.insert(r.tid, (name.to_owned(), Vec::new())).is_none(), "operators do not nest: {r:?}");
            }
            ("OP_LAUNCH", name) => {
                let (started, got) = open.remove(&r.tid).unwrap_or_else(|| panic!("an end without a start: {r:?}"));
                assert_eq!(started, name);
                let i = next_op.entry(r.tid).or_default();
                let op = ops_of[&r.tid][*i];
                *i += 1;
                let mut want = Vec::new();
                for (kind, ptr, nbytes, dtype, shape) in &op.accesses {
                    if live.contains_key(ptr) {
                        want.push((kind.to_uppercase(), *ptr, *nbytes, dtype.clone(), shape_text(shape)));
                    } else {
                        seen.excluded += 1;
                    }
                }
                let (got_c, want_c) = (counts(&got), counts(&want));
                if got_c != want_c {
                    seen.mismatches.push(format!("op #{} {}: DB {got_c:?}\n    ledger {want_c:?}", *i - 1, op.name));
                }
                seen.matched += want.len();
            }
            ("ACCESS", name) => {
                let (op_name, got) = open.get_mut(&r.tid).unwrap_or_else(|| panic!("an access outside an op: {r:?}"));
                assert_eq!(name, op_name, "an access row is named by its operator: {r:?}");
                let addr = r.ptr_value().unwrap();
                let block = r.attr_u64("block").unwrap();
                let (&start, (end, id)) = live.range(..=addr).next_back().expect("a live block holds the address");
                assert!(addr < *end && start == block, "Attr.block is the live block holding Ptr: {r:?}");
                assert_eq!((&r.attr["allocation_id"], r.attr["type"].as_str()), (id, "HOST"), "{r:?}");
                match r.event_type.as_str() {
                    "READ" => seen.reads += 1,
                    "WRITE" => seen.writes += 1,
                    other => panic!("an operator's access is READ or WRITE, not {other}"),
                }
                let a = |k: &str| r.attr.get(k).cloned().unwrap_or_else(|| panic!("no Attr {k}: {r:?}"));
                got.push((r.event_type.clone(), block, r.attr_u64("size").unwrap(), a("dtype"), a("shape")));
            }
            _ => {}
        }
    }
    assert!(open.is_empty(), "every operator ended: {open:?}");
    seen
}

#[test]
fn operator_rows_match_the_workloads_own_dispatch_ledger() {
    let env = env("ops");
    let Some((python, markers)) = real_torch() else { return };
    let started = Instant::now();
    let (ledger, output, stderr) = traced_ops_run(&env, &python, &markers);
    let pid = ledger.pid;
    assert_eq!(meta(output.db("device_cpu"), "records_lost").as_deref(), Some("0"), "records were lost: {stderr}");
    // Every device file carries the operator rows (broadcast); the host blocks are in the cpu one.
    for (folder, (_, rows)) in &output.files {
        let n = rows.iter().filter(|r| r.event == "OP_LAUNCH").count();
        assert_eq!(n, 2 * ledger.ops.len(), "{folder}: one ATEN_START and one ATEN_END per operator");
    }
    let rows: Vec<&DbRow> = output.files["device_cpu"].1.iter().filter(|r| r.pid == pid).collect();

    // ---- 1. the operator sequence, per thread
    assert_op_sequence(&rows, &ledger);

    // ---- 2. the accesses of each operator, replaying the cpu file's rows in ID order
    let Replayed { matched, excluded, reads, writes, mismatches } = replay_accesses(&rows, &ledger);
    assert!(mismatches.is_empty(), "{} operators differ:\n  {}", mismatches.len(), mismatches.join("\n  "));
    eprintln!(
        "ops: {} operators, {matched} accesses matched ({reads} READ / {writes} WRITE rows), {excluded} ledger \
         entries on storages the trace never saw allocated; {:.1} s",
        ledger.ops.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(reads > 100 && writes > 100, "both kinds are exercised");
    assert!(excluded * 20 <= matched, "nearly every storage was made after the attach ({excluded} excluded)");
}
