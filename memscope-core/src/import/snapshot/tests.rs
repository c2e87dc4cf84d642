//! Snapshots laid out as PyTorch's `_snapshot()` returns them, pickled by Python's own `pickle`
//! (the interpreter is the independent writer): their rows, the state before a ring's first
//! entry, owners from frames, and the refusals.

use std::path::{Path, PathBuf};
use std::process::Command;

use rusqlite::Connection;

use super::*;

/// Pickles the Python expression `expr` (with `M`, `fr` and `base` defined) into `name`; `None`
/// when no python3 runs here (the test then skips, saying so).
fn pickled(name: &str, expr: &str) -> Option<PathBuf> {
    let dir = std::env::temp_dir().join(format!("memscope-snapshot-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{name}.pickle"));
    let script = format!(
        "import pickle, sys\nM = 1 << 20\nbase = 0x7f0000000000\n\
         def fr(f, l, n): return {{'filename': f, 'line': l, 'name': n}}\n\
         value = {expr}\nwith open(sys.argv[1], 'wb') as f: pickle.dump(value, f)\n"
    );
    let Ok(out) = Command::new("python3").args(["-c", &script]).arg(&path).output() else {
        eprintln!("skipped: no python3 to write the snapshot with");
        return None;
    };
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    Some(path)
}

/// A ring that starts mid-run, PyTorch's layout, frames shared between entries and blocks (the
/// pickle's memo references): a 20 MiB segment with a live 3 MiB block at its start existed
/// before the first entry.
const RING: &str = r#"(lambda model, opt: {
  'segments': [
    {'device': 0, 'address': base, 'total_size': 20 * M, 'allocated_size': 5 * M, 'active_size': 5 * M,
     'requested_size': 5 * M, 'stream': 0, 'segment_type': 'large', 'segment_pool_id': (0, 0),
     'is_expandable': False, 'frames': [], 'blocks': [
        {'address': base, 'size': 3 * M, 'requested_size': 3 * M, 'state': 'active_allocated', 'frames': model},
        {'address': base + 3 * M, 'size': 2 * M, 'requested_size': 2 * M, 'state': 'active_allocated', 'frames': model},
        {'address': base + 5 * M, 'size': 15 * M, 'requested_size': 0, 'state': 'inactive', 'frames': []}]},
    {'device': 0, 'address': base + 64 * M, 'total_size': 30 * M, 'allocated_size': 30 * M, 'active_size': 30 * M,
     'requested_size': 30 * M, 'stream': 0, 'segment_type': 'large', 'segment_pool_id': (0, 0),
     'is_expandable': False, 'frames': [], 'blocks': [
        {'address': base + 64 * M, 'size': 30 * M, 'requested_size': 30 * M, 'state': 'active_allocated', 'frames': opt}]}],
  'device_traces': [[
    {'action': 'alloc', 'addr': base + 3 * M, 'size': 3 * M, 'stream': 0, 'time_us': 1010, 'frames': model},
    {'action': 'segment_alloc', 'addr': base + 64 * M, 'size': 30 * M, 'stream': 0, 'time_us': 1020, 'frames': opt},
    {'action': 'alloc', 'addr': base + 64 * M, 'size': 30 * M, 'stream': 0, 'time_us': 1030, 'frames': opt},
    {'action': 'free_requested', 'addr': base + 3 * M, 'size': 3 * M, 'stream': 0, 'time_us': 1040, 'frames': model},
    {'action': 'free_completed', 'addr': base + 3 * M, 'size': 3 * M, 'stream': 0, 'time_us': 1050, 'frames': model},
    {'action': 'alloc', 'addr': base + 3 * M, 'size': 2 * M - 100, 'stream': 7, 'time_us': 1060, 'frames': model}]],
  'allocator_settings': {'PYTORCH_CUDA_ALLOC_CONF': 'max_split_size_mb:64', 'max_split_size': 64 * M},
  'external_annotations': []})(
    [fr('/site-packages/torch/nn/modules/module.py', 1750, 'Module._call_impl'), fr('/app/train.py', 10, 'main')],
    [fr('/site-packages/torch/optim/adam.py', 90, 'Adam.step'), fr('/app/train.py', 50, 'main')])"#;

type Rows = Vec<(String, String, i64, String, serde_json::Value, String)>;

fn rows(db: &Path) -> Rows {
    let conn = Connection::open(db).unwrap();
    let mut stmt = conn
        .prepare("SELECT Event, \"Event Type\", \"Timestamp(ns)\", Ptr, Attr, \"Call Stack(Python)\" FROM memscope_dump ORDER BY ID")
        .unwrap();
    stmt.query_map([], |r| {
        let attr: String = r.get(4)?;
        Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, serde_json::from_str(&attr).unwrap(), r.get(5)?))
    })
    .unwrap()
    .collect::<Result<_, _>>()
    .unwrap()
}

fn import(path: &Path) -> Vec<SnapshotDevice> {
    let dir = path.parent().unwrap().to_owned();
    import_snapshot(path, |d| dir.join(format!("dev-{d}.db"))).unwrap()
}

#[test]
fn a_ring_s_entries_become_rows_after_the_state_before_its_first_entry() {
    let Some(path) = pickled("ring", RING) else { return };
    let got = import(&path);
    assert_eq!(got.len(), 1);
    let d = &got[0];
    assert_eq!((d.device.as_str(), d.entries, d.segments_before, d.blocks_before, d.timed), ("0", 6, 1, 1, true));
    let rows = rows(&d.db);
    let kinds: Vec<(&str, &str, i64)> = rows.iter().map(|r| (r.0.as_str(), r.1.as_str(), r.2)).collect();
    assert_eq!(
        kinds,
        [
            // Before the first entry (1010 µs): the 20 MiB segment and the block at its start.
            ("MALLOC", "HAL", 1_009_000),
            ("MALLOC", "PTA", 1_009_000),
            ("MALLOC", "PTA", 1_010_000),
            ("MALLOC", "HAL", 1_020_000),
            ("MALLOC", "PTA", 1_030_000),
            ("FREE", "PTA", 1_050_000),
            ("MALLOC", "PTA", 1_060_000),
        ]
    );
    let base = 0x7f00_0000_0000_u64;
    let m = 1u64 << 20;
    assert_eq!(rows[0].3, format!("0x{base:016x}"));
    assert_eq!((rows[0].4["segment"].as_str(), rows[0].4["size"].as_str()), (Some("caching"), Some("20971520")));
    assert_eq!(rows[1].4["size"], (3 * m).to_string());
    // A block's size is the allocator's rounding of the request; its stream is kept.
    assert_eq!(rows[6].4["req_size"], (2 * m - 100).to_string());
    assert_eq!(rows[6].4["size"], (2 * m).to_string());
    assert_eq!(rows[6].4["stream"], "0x0000000000000007");
    // The FREE closes the block the first entry made.
    assert_eq!((rows[5].3.as_str(), &rows[5].4["allocation_id"]), (rows[2].3.as_str(), &rows[2].4["allocation_id"]));
    // Frames: Python ones as the column's lines, and the owner rules read them.
    assert_eq!(rows[4].5, "/site-packages/torch/optim/adam.py(90): Adam.step\n/app/train.py(50): main");
    assert_eq!(rows[4].4["owner"], "PTA@optimizer_state");
    assert_eq!(rows[2].4["owner"], "PTA@activation");
    // PyTorch's snapshot: its allocator settings are the run's.
    let conn = Connection::open(&d.db).unwrap();
    let conf: String = conn
        .query_row("SELECT value FROM ms_meta WHERE key = 'env.PYTORCH_CUDA_ALLOC_CONF'", [], |r| r.get(0))
        .unwrap();
    assert_eq!(conf, "max_split_size_mb:64");
}

#[test]
fn torch_npu_s_snapshots_have_no_times_and_pad_their_requests() {
    let npu = "{'segments': [], 'device_traces': [[], [\
        {'action': 'segment_alloc', 'addr': base, 'size': 2 * M, 'stream': 0},\
        {'action': 'alloc', 'addr': base, 'size': 512, 'stream': 0},\
        {'action': 'oom', 'device_free': 0, 'size': 64 * M, 'stream': 0}]]}";
    let Some(path) = pickled("npu", npu) else { return };
    let got = import(&path);
    assert_eq!(got.iter().map(|d| d.device.as_str()).collect::<Vec<_>>(), ["1"], "device 0 traced nothing");
    assert!(!got[0].timed);
    let rows = rows(&got[0].db);
    assert_eq!(rows.iter().map(|r| r.2).collect::<Vec<_>>(), [1000, 2000, 3000], "1 µs apart");
    // torch_npu adds 32 bytes before rounding: 512 bytes take 1 KiB.
    assert_eq!(rows[1].4["size"], "1024");
    assert_eq!(
        (rows[2].0.as_str(), rows[2].1.as_str(), &rows[2].4["req_size"]),
        ("OOM_DETAIL", "OOM_TRIGGER", &serde_json::json!("67108864"))
    );
}

#[test]
fn anything_but_a_snapshot_of_plain_values_is_refused_without_running_it() {
    let cases = [
        (
            "class",
            "__import__('collections').OrderedDict(segments=[], device_traces=[])",
            "names a class or calls a function",
        ),
        ("list", "[1, 2]", "not of a dict"),
        ("dict", "{'a': 1}", "without `segments` and `device_traces`"),
        ("entry", "{'segments': [], 'device_traces': [[{'addr': 1, 'size': 2}]]}", "a trace entry without `action`"),
    ];
    for (name, expr, says) in cases {
        let Some(path) = pickled(name, expr) else { return };
        let dir = path.parent().unwrap().to_owned();
        let err = import_snapshot(&path, |d| dir.join(format!("{d}.db"))).unwrap_err().to_string();
        assert!(err.contains(says), "{name}: {err}");
        assert!(!dir.join("0.db").exists(), "{name}: no DB left behind");
    }
}

#[test]
fn shared_values_are_read_each_time_they_are_referenced() {
    // Two lists holding one dict, referenced from two places: memo references within memo
    // references, which serde-pickle 1.2 takes for recursion.
    let bytes = Command::new("python3")
        .args(["-c", "import pickle, sys; d = {'k': 1}; l = [d, d]; sys.stdout.buffer.write(pickle.dumps({'a': l, 'b': l, 'c': (l, 2**70 // 2**10, -5, 1.5, True, None, b'x')}))"])
        .output();
    let Ok(out) = bytes else {
        eprintln!("skipped: no python3 to pickle with");
        return;
    };
    let v = pickle::read(&out.stdout).unwrap();
    for key in ["a", "b"] {
        let items = v.get(key).unwrap().items().unwrap();
        assert_eq!(items.len(), 2);
        assert!(items.iter().all(|d| d.get("k").and_then(|k| k.int()) == Some(1)));
    }
    let c = v.get("c").unwrap().items().unwrap();
    assert_eq!((c[1].int(), c[2].int()), (Some(1 << 60), Some(-5)));
    assert!(pickle::read(&out.stdout[..out.stdout.len() - 1]).is_err(), "a truncated pickle is refused");
}
