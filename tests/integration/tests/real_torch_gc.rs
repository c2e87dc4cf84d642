//! Privileged check of the garbage-collector probe on REAL PyTorch and the real interpreter:
//! CPU tensors (`c10::free_cpu` in libc10.so) freed by a collection pass of CPython
//! (`gc_collect_main` in libpython) are marked `freed_by: gc`, and no other free is.
//!
//! Ground truth is tests/workloads/torch_gc.py's ledger: for each tensor, its storage pointer and
//! bytes, and whether a collection was running when its storage was released, from a finalizer
//! and `gc.callbacks` (the interpreter's own account, not the tracer's).

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::Duration;

use memscope_integration::*;
use serde_json::Value;

#[test]
fn cpu_tensor_frees_made_by_the_collector_are_marked() {
    let env = env("real_torch_gc");
    let Some((python, markers)) = real_torch() else { return };
    let ledger = env.scratch.join("ledger.json");
    let ready = env.scratch.join("ready");
    let out = env.scratch.join("out");
    let mut job = Command::new(&python)
        .arg(env.workload.with_file_name("torch_gc.py"))
        .args(["--ledger", &ledger.display().to_string(), "--ready", &ready.display().to_string()])
        .env("PYTHONPATH", &markers)
        .stdin(Stdio::null())
        .spawn()
        .expect("start the torch workload");
    let pid = wait_for_file(&ready, &mut job, Duration::from_secs(120)).trim().to_owned();
    let out_s = out.display().to_string();
    let tracer = Tracer::spawn(&env, &["trace", "--pid", &pid, "--output", &out_s], &[]);
    assert_eq!(wait_child(&mut job, Duration::from_secs(120)), 0, "the torch workload failed");
    let (code, stderr) = tracer.finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");

    let ledger: Value = serde_json::from_str(&std::fs::read_to_string(&ledger).unwrap()).unwrap();
    let mut want: BTreeMap<(u64, u64, bool), usize> = BTreeMap::new();
    for t in ledger["tensors"].as_array().unwrap() {
        let in_gc = t["freed_in_gc"].as_bool().expect("every tensor was released before the ledger was written");
        assert_eq!(in_gc, t["cyclic"].as_bool().unwrap(), "the workload's own account: {t}");
        *want.entry((t["ptr"].as_u64().unwrap(), t["bytes"].as_u64().unwrap(), in_gc)).or_default() += 1;
    }
    assert!(want.keys().any(|k| k.2) && want.keys().any(|k| !k.2), "both kinds of free expected: {want:?}");
    let sizes: Vec<u64> = want.keys().map(|k| k.1).collect();
    let output = read_output(&out);
    let mut got: BTreeMap<(u64, u64, bool), usize> = BTreeMap::new();
    for r in &output.files["device_cpu"].1 {
        let size = r.attr_u64("size").unwrap_or(0);
        if r.event == "FREE" && r.event_type == "HOST" && !r.is_shadow() && sizes.contains(&size) {
            let in_gc = r.attr.get("freed_by").map(String::as_str) == Some("gc");
            *got.entry((r.ptr_value().unwrap(), size, in_gc)).or_default() += 1;
        }
    }
    assert_eq!(got, want, "HOST frees of the workload's tensors, by (storage, bytes, freed by the collector)");
}
