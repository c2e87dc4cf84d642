//! `export --format perfetto`: trace DBs as a Chrome JSON trace, which Perfetto's UI (and
//! `chrome://tracing`) opens: one process per device, a counter track per owner (its live bytes,
//! named by the decomposition's owner path, `PTA@vllm@kv_cache`), one per layer (`PTA
//! allocated`, `HAL allocated`, `HOST allocated`), the caching pools' reserved bytes (`PTA
//! reserved`), and instant events for step boundaries, marks and OOMs. Times count
//! from the earliest event, whose `Timestamp(ns)` is `otherData.memscope_origin_ns`.
//!
//! The owner counters are the decomposition's own changes ([`decompose::timeline`]): at any
//! instant an owner's track reads what `analyze --analysis decompose --at` puts at that owner
//! (a node of the tree is the sum of the tracks at and below its path). Timestamps are
//! microseconds with the nanoseconds kept as decimals, so no two changes share an instant that
//! the DB tells apart.

use std::collections::BTreeMap;
use std::io::Write;

use serde_json::{json, Value};

use crate::analysis::db::DumpDb;
use crate::analysis::decompose::{self, Family};
use crate::analysis::instants::{self, Kind};
use crate::analysis::AnalysisError;

#[derive(Debug, thiserror::Error)]
pub enum PerfettoError {
    #[error(transparent)]
    Db(#[from] AnalysisError),
    #[error("cannot write the trace")]
    Write(#[from] std::io::Error),
}

/// One device's DB and the process id its tracks get (devices in order, from 1).
pub struct Device<'a> {
    pub db: &'a DumpDb,
    pub name: String,
    pub pid: u32,
}

/// What the trace holds, for the verb's summary line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    pub counters: usize,
    pub instants: usize,
    pub tracks: usize,
}

/// An instant while events are built: nanoseconds since the epoch, made relative at the end
/// ([`relative`]), since a double holds microseconds since the epoch only to a quarter of one.
fn us(ts_ns: i64) -> Value {
    json!(ts_ns)
}

/// Every event's `ts` as microseconds since the earliest one (`origin`, in `otherData`), the
/// nanoseconds as decimals: exact for traces shorter than about a hundred days.
fn relative(events: &mut [Value]) -> i64 {
    let origin = events.iter().filter_map(|e| e["ts"].as_i64()).min().unwrap_or(0);
    for e in events.iter_mut() {
        if let Some(ts) = e["ts"].as_i64() {
            e["ts"] = json!((ts - origin) as f64 / 1000.0);
        }
    }
    origin
}

fn counter(name: &str, pid: u32, ts_ns: i64, key: &str, value: i64) -> Value {
    json!({"ph": "C", "name": name, "pid": pid, "tid": 0, "ts": us(ts_ns), "args": {key: value}})
}

/// The owner and layer tracks of one device: one event per track and instant (the last value).
fn owner_counters(device: &Device<'_>, events: &mut Vec<Value>, tracks: &mut usize) -> Result<usize, AnalysisError> {
    let timeline = decompose::timeline(device.db)?;
    let mut owner_bytes = vec![0i64; timeline.owners.len()];
    let mut layer_bytes: BTreeMap<Family, i64> = BTreeMap::new();
    // Per track, the value at the latest instant, written when the instant changes.
    let mut pending: BTreeMap<String, (i64, i64)> = BTreeMap::new();
    let mut written = 0;
    let mut flush = |pending: &mut BTreeMap<String, (i64, i64)>, events: &mut Vec<Value>| {
        for (name, (ts, value)) in std::mem::take(pending) {
            let key = if name.ends_with(" allocated") { "allocated" } else { "bytes" };
            events.push(counter(&name, device.pid, ts, key, value));
            written += 1;
        }
    };
    let mut last_ts = None;
    for &(ts, owner, delta) in &timeline.changes {
        if last_ts.is_some_and(|t| t != ts) {
            flush(&mut pending, events);
        }
        last_ts = Some(ts);
        let (family, path) = &timeline.owners[owner as usize];
        owner_bytes[owner as usize] += delta;
        let layer = layer_bytes.entry(*family).or_default();
        *layer += delta;
        pending.insert(path.clone(), (ts, owner_bytes[owner as usize]));
        pending.insert(format!("{} allocated", family.as_str()), (ts, *layer));
    }
    flush(&mut pending, events);
    *tracks += timeline.owners.len() + layer_bytes.len();
    Ok(written)
}

/// The caching pools' reserved bytes (Attr `total` of the `PTA` rows), summed over processes
/// and pools, and the instants: steps, marks, OOMs.
fn pools_and_instants(device: &Device<'_>, events: &mut Vec<Value>) -> Result<(usize, usize), AnalysisError> {
    let read = instants::read(device.db)?;
    let mut reserved: BTreeMap<(i64, &str), i64> = BTreeMap::new();
    let mut counters = 0;
    for r in &read.reserved {
        if reserved.insert((r.pid, &r.pool), r.total) != Some(r.total) {
            events.push(counter("PTA reserved", device.pid, r.ts, "reserved", reserved.values().sum()));
            counters += 1;
        }
    }
    for i in &read.instants {
        let (name, cat) = match i.kind {
            Kind::Step => (format!("step {}", i.name), "step"),
            Kind::Mark => (i.name.clone(), "mark"),
            Kind::Oom => (format!("OOM: {} bytes requested", i.name), "oom"),
        };
        events
            .push(json!({"ph": "i", "s": "p", "name": name, "cat": cat, "pid": device.pid, "tid": 0, "ts": us(i.ts)}));
    }
    Ok((counters, read.instants.len()))
}

/// Writes the devices' DBs to `out` as one Chrome JSON trace.
pub fn export(devices: &[Device<'_>], out: &mut impl Write) -> Result<Summary, PerfettoError> {
    let mut events = Vec::new();
    let mut summary = Summary::default();
    for device in devices {
        events.push(
            json!({"ph": "M", "name": "process_name", "pid": device.pid, "tid": 0, "args": {"name": device.name}}),
        );
        events.push(json!({"ph": "M", "name": "thread_name", "pid": device.pid, "tid": 0, "args": {"name": "memory"}}));
        summary.counters += owner_counters(device, &mut events, &mut summary.tracks)?;
        let (counters, instants) = pools_and_instants(device, &mut events)?;
        summary.counters += counters;
        summary.instants += instants;
    }
    let origin = relative(&mut events);
    let other = json!({"memscope_origin_ns": origin.to_string(), "tool": "memscope-bpf"});
    serde_json::to_writer(&mut *out, &json!({"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}))
        .map_err(std::io::Error::from)?;
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::testdb::{dir, TestDb};
    use crate::store::Attr;

    #[test]
    fn steps_marks_and_ooms_are_instants_and_owners_are_tracks_from_the_earliest_event() {
        let mut db = TestDb::create(&dir("perfetto").join("d.db"));
        let t0 = 1_767_225_600_123_456_789;
        db.malloc("PTA", t0, 0x1000, 4096, Some("PTA@vllm@kv_cache"));
        db.named("SYSTEM", "STEP", "1", t0 + 1_500, 1);
        db.named("MSTX", "Mark", "\"checkpoint\"", t0 + 2_001, 1);
        db.row("OOM_DETAIL", "OOM_TRIGGER", t0 + 3_000, 1, None, Attr::new().with("req_size", 1u64 << 30));
        db.free("PTA", t0 + 4_000, 0x1000);
        let open = DumpDb::open_read(&db.path).unwrap();
        let mut bytes = Vec::new();
        let summary = export(&[Device { db: &open, name: "NPU 0".into(), pid: 1 }], &mut bytes).unwrap();
        assert_eq!(summary.instants, 3);
        let trace: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(trace["otherData"]["memscope_origin_ns"], t0.to_string());
        let events = trace["traceEvents"].as_array().unwrap();
        let instants: Vec<(&str, f64)> = events
            .iter()
            .filter(|e| e["ph"] == "i")
            .map(|e| (e["name"].as_str().unwrap(), e["ts"].as_f64().unwrap()))
            .collect();
        assert_eq!(instants, [("step 1", 1.5), ("checkpoint", 2.001), ("OOM: 1073741824 bytes requested", 3.0)]);
        let kv: Vec<(f64, i64)> = events
            .iter()
            .filter(|e| e["ph"] == "C" && e["name"] == "PTA@vllm@kv_cache")
            .map(|e| (e["ts"].as_f64().unwrap(), e["args"]["bytes"].as_i64().unwrap()))
            .collect();
        assert_eq!(kv, [(0.0, 4096), (4.0, 0)]);
        let layer = events.iter().filter(|e| e["name"] == "PTA allocated").count();
        assert_eq!(layer, 2);
    }
}
