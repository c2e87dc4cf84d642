//! The offline verbs on msMemScope's own captures (CSV in both Attr forms, DBs under both table
//! names, folders laid out as msMemScope lays them), run as a user runs them: the binary, its
//! JSON on stdout, its notes on stderr. Expected results come from the corpus's ledger
//! (`corpus/mod.rs`), computed from the events it wrote, never from our reader.

mod corpus;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use corpus::{Style, Trace, LEAK_BYTES, LEAK_OP, MIB};
use serde_json::Value;

const STEPS: u64 = 6;

/// A fresh folder for one test, also the verbs' TMPDIR (so their temporary DBs can be counted).
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memscope-msmemscope-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("tmp")).unwrap();
    dir
}

fn bpf(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memscope-bpf"))
        .args(args)
        .current_dir(dir)
        .env("TMPDIR", dir.join("tmp"))
        .output()
        .expect("the binary runs")
}

/// Runs a verb that must succeed; returns stdout (and checks no temporary DB is left behind).
fn ok(dir: &Path, args: &[&str]) -> (String, String) {
    let out = bpf(dir, args);
    let (stdout, stderr) =
        (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned());
    assert!(out.status.success(), "memscope-bpf {args:?} failed: {stderr}");
    let left: Vec<_> = std::fs::read_dir(dir.join("tmp")).unwrap().flatten().map(|e| e.path()).collect();
    assert!(left.is_empty(), "temporary DBs left behind by {args:?}: {left:?}");
    (stdout, stderr)
}

fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// The PTA bytes by owner at `point` in `analyze --json` output (owners below the family only).
fn pta_owners(report: &Value, point: &str, device: &str) -> BTreeMap<String, u64> {
    let tree = report
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["family"] == "PTA" && t["point"] == point && t["device"] == device)
        .unwrap_or_else(|| panic!("no PTA tree at {point}: {report}"));
    tree["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|n| n["path"].as_str().unwrap().contains('@') && n["bytes"].as_u64().unwrap() > 0)
        .filter(|n| {
            !tree["nodes"]
                .as_array()
                .unwrap()
                .iter()
                .any(|m| m["path"].as_str().unwrap().starts_with(&format!("{}@", n["path"].as_str().unwrap())))
        })
        .map(|n| (n["path"].as_str().unwrap().to_owned(), n["bytes"].as_u64().unwrap()))
        .collect()
}

/// The leak candidates' addresses in `analyze --analysis leaks --json` output.
fn candidates(report: &Value) -> Vec<u64> {
    let leaks = report.as_array().unwrap().iter().find(|r| r["analysis"] == "leaks").expect("a leaks report");
    leaks["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let ptr = c["ptr"].as_str().unwrap();
            ptr.strip_prefix("0x").map_or_else(|| ptr.parse().unwrap(), |h| u64::from_str_radix(h, 16).unwrap())
        })
        .collect()
}

/// The ledger's leak candidates by msMemScope's rule (born after the warm-up step, still live a
/// whole step later): certainly those born up to two steps before the end; none outside the leak.
fn check_candidates(found: &[u64], trace: &Trace) {
    let leaked: BTreeMap<u64, u64> = trace.leaked.iter().copied().collect();
    for ptr in found {
        let step = leaked.get(ptr).unwrap_or_else(|| panic!("0x{ptr:x} is no leaked block: {found:x?}"));
        assert!(*step > 1, "a block of the warm-up step 1 is a candidate: 0x{ptr:x}");
    }
    for (ptr, step) in &leaked {
        if *step > 1 && *step + 2 <= trace.steps {
            assert!(found.contains(ptr), "the block leaked in step {step} (0x{ptr:x}) was not found: {found:x?}");
        }
    }
}

/// Every offline verb on `input`, checked against `trace`'s ledger.
fn every_verb(dir: &Path, input: &str, trace: &Trace, label: &str) {
    let (out, err) = ok(dir, &["analyze", input, "--analysis", "decompose", "--at", "end", "--json"]);
    assert_eq!(pta_owners(&json(&out), "end", "0"), trace.end_by_owner, "{label}: the PTA owners at the end");
    assert!(err.contains("is msMemScope's capture"), "{label}: what the capture lacks is said: {err}");
    let (out, _) = ok(dir, &["analyze", input, "--analysis", "leaks", "--json", "--device", "0"]);
    check_candidates(&candidates(&json(&out)), trace);
    let (out, _) = ok(dir, &["analyze", input, "--analysis", "inefficient", "--json", "--device", "0"]);
    let inefficient = json(&out);
    let report =
        inefficient.as_array().unwrap().iter().find(|r| r["analysis"] == "inefficient").expect("an inefficient report");
    assert!(report["stats"].is_object(), "{label}: {report}");
    let (out, _) = ok(dir, &["analyze", input, "--analysis", "oom", "--device", "0", "--json"]);
    let oom = json(&out);
    let incidents =
        oom.as_array().unwrap().iter().find(|r| r["incidents"].is_array()).expect("an oom report")["incidents"].clone();
    let asked: Vec<u64> = incidents.as_array().unwrap().iter().map(|i| i["req_size"].as_u64().unwrap()).collect();
    assert_eq!(asked, trace.oom_requests, "{label}: the failed allocations");
    // Nothing was freed after the last step: the pool's allocated bytes then are the end's.
    let live: u64 = trace.end_by_owner.values().sum();
    assert!(
        incidents.as_array().unwrap().iter().all(|i| i["state"]["allocated"].as_u64() == Some(live)),
        "{label}: {incidents}"
    );
    // Both levels of compare, the capture against itself: every call matched.
    for (level, calls) in [("op", trace.ops.len()), ("kernel", trace.kernels.len())] {
        let (out, _) = ok(dir, &["compare", input, input, "--level", level, "--device", "0", "--json"]);
        let summary = json(&out)[0]["summary"].clone();
        assert_eq!(summary["matched"].as_u64(), Some(calls as u64), "{label} --level {level}: {summary}");
        assert_eq!((summary["only_a"].as_u64(), summary["only_b"].as_u64()), (Some(0), Some(0)), "{label}: {summary}");
    }
    let (out, _) = ok(dir, &["advise", input, "--device", "0"]);
    assert!(out.contains("not in this capture"), "{label}: advise says the settings are unknown: {out}");
    let html = dir.join(format!("{label}.html"));
    ok(dir, &["report", input, "-o", html.to_str().unwrap()]);
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(page.contains("</html>") && page.contains("msMemScope's capture, without"), "{label}: the report page");
    let viz = dir.join(format!("{label}.pickle"));
    ok(dir, &["export", input, "--format", "memory-viz", "--device", "0", "-o", viz.to_str().unwrap()]);
    assert!(std::fs::metadata(&viz).unwrap().len() > 0);
    let perfetto = dir.join(format!("{label}.json"));
    ok(dir, &["export", input, "--format", "perfetto", "-o", perfetto.to_str().unwrap()]);
    let events = json(&std::fs::read_to_string(&perfetto).unwrap());
    assert!(events["traceEvents"].as_array().is_some_and(|e| !e.is_empty()), "{label}: perfetto events");
}

#[test]
fn every_offline_verb_reads_each_form_of_msmemscope_capture() {
    let dir = scratch("forms");
    let trace = corpus::training(STEPS, true);
    assert_eq!(trace.end_by_owner.get("PTA@ops@aten"), Some(&(STEPS * LEAK_BYTES)));
    assert_eq!(trace.end_by_owner.get("PTA@model@weight"), Some(&(16 * MIB)));

    let bare = dir.join("leaks.csv");
    std::fs::write(&bare, corpus::csv(&trace, "0", Style::Bare)).unwrap();
    let json_csv = dir.join("memscope_dump_20250101000000.csv");
    std::fs::write(&json_csv, corpus::csv(&trace, "0", Style::Json)).unwrap();
    let run = corpus::layout(&dir.join("memscopeDumpResults"), &trace, "20250101000001");
    let db = run
        .parent()
        .unwrap()
        .join("msmemscope_4242_20250101000002_ascend/device_0/dump/memscope_dump_20250101000002.db");
    corpus::db(&trace, "0", &db, "memscope_dump", false, true);
    let legacy = dir.join("leaksDumpResults/dump/leaks_dump_1746006014.db");
    corpus::db(&trace, "0", &legacy, "leaks_dump", true, false);

    for (input, label) in [
        (bare.clone(), "bare-csv"),
        (json_csv.clone(), "json-csv"),
        (run.clone(), "layout"),
        (db.clone(), "db"),
        (legacy.parent().unwrap().parent().unwrap().to_owned(), "leaks-dump"),
    ] {
        every_verb(&dir, input.to_str().unwrap(), &trace, label);
    }
    // A device with no calls on either side (host memory) is said and skipped, not fatal.
    let run_s = run.to_str().unwrap();
    let (out, err) = ok(&dir, &["compare", run_s, run_s, "--level", "kernel", "--json"]);
    assert!(err.contains("device cpu: no kernel calls in either trace; not compared"), "{err}");
    let pairs = json(&out);
    assert_eq!(pairs.as_array().unwrap().len(), 1, "{pairs}");
    assert_eq!(pairs[0]["summary"]["matched"].as_u64(), Some(trace.kernels.len() as u64));
    // One device's folder, as a user points at the level they are looking at.
    let (out, _) = ok(&dir, &["analyze", run.join("device_0").to_str().unwrap(), "--at", "end", "--json"]);
    assert_eq!(pta_owners(&json(&out), "end", "0"), trace.end_by_owner);
    // The folder holding both runs: one report per run and device, the Python trace skipped.
    let (out, _) = ok(&dir, &["analyze", dir.join("memscopeDumpResults").to_str().unwrap(), "--at", "end", "--json"]);
    let dbs: std::collections::BTreeSet<String> =
        json(&out).as_array().unwrap().iter().map(|t| t["db"].as_str().unwrap().to_owned()).collect();
    assert_eq!(dbs.len(), 3, "device 0 and cpu of the CSV run, device 0 of the DB run: {dbs:?}");
    assert!(dbs.iter().all(|d| !d.contains("python_trace")), "{dbs:?}");
}

#[test]
fn compare_by_operator_finds_exactly_the_inserted_leaking_operator() {
    let dir = scratch("compare");
    let (base, leaky) = (corpus::training(STEPS, false), corpus::training(STEPS, true));
    std::fs::write(dir.join("baseline.csv"), corpus::csv(&base, "0", Style::Json)).unwrap();
    std::fs::write(dir.join("leaks.csv"), corpus::csv(&leaky, "0", Style::Bare)).unwrap();
    let (out, _) = ok(&dir, &["compare", "baseline.csv", "leaks.csv", "--level", "op", "--json"]);
    let diff = &json(&out)[0];
    let summary = &diff["summary"];
    let only_b: Vec<&(String, u64)> = leaky.ops.iter().filter(|(n, _)| n == LEAK_OP).collect();
    assert_eq!(summary["only_a"], 0, "{summary}");
    assert_eq!(summary["only_b"].as_u64(), Some(only_b.len() as u64), "{summary}");
    assert_eq!(summary["only_b_delta"].as_u64(), Some(only_b.iter().map(|(_, b)| b).sum::<u64>()), "{summary}");
    assert_eq!(summary["matched"].as_u64(), Some(base.ops.len() as u64), "{summary}");
    assert_eq!(summary["matched_delta_differs"], 0, "{summary}");
    for row in diff["rows"].as_array().unwrap().iter().filter(|r| r["kind"] == "only_b") {
        assert_eq!(row["name"], LEAK_OP, "{row}");
        assert_eq!(row["delta_b"].as_u64(), Some(LEAK_BYTES), "{row}");
    }
    // By kernel: exactly the leaking operator's kernel, once a step.
    let (out, _) = ok(&dir, &["compare", "baseline.csv", "leaks.csv", "--level", "kernel", "--json"]);
    let diff = &json(&out)[0];
    let kernel = leaky.kernels.iter().find(|k| !base.kernels.contains(k)).unwrap().clone();
    assert_eq!(diff["summary"]["only_b"].as_u64(), Some(STEPS), "{diff}");
    assert_eq!(diff["summary"]["only_a"], 0, "{diff}");
    assert!(diff["rows"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["kind"] == "only_b")
        .all(|r| r["name"] == kernel.as_str()));
    // By step: the leaking owner grew by the leaked bytes by the end; nothing else did.
    let (out, _) = ok(&dir, &["compare", "baseline.csv", "leaks.csv", "--json"]);
    let steps = json(&out)[0]["steps"].as_array().unwrap().clone();
    let end = steps.last().unwrap();
    assert_eq!(end["step"], "end", "{end}");
    let grew: Vec<(String, i64)> = end["owners"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|o| o["diff"].as_i64().unwrap() != 0)
        .map(|o| (o["owner"].as_str().unwrap().to_owned(), o["diff"].as_i64().unwrap()))
        .collect();
    let leaked = (STEPS * LEAK_BYTES) as i64;
    assert!(grew.iter().all(|(_, d)| *d == leaked), "{grew:?}");
    assert!(grew.iter().any(|(o, _)| o.ends_with("PTA@ops@aten")), "{grew:?}");
}

#[test]
fn a_malformed_line_is_one_error_naming_its_line() {
    let dir = scratch("malformed");
    let trace = corpus::training(2, false);
    let good = corpus::csv(&trace, "0", Style::Bare);
    // Physical line numbers: the multi-line stacks before it count.
    let lines: Vec<&str> = good.lines().collect();
    let target = lines.iter().rposition(|l| l.contains(",FREE,PTA,")).unwrap();
    for (bad, what) in [
        (lines[target].replace("{allocation_id:", "{allocation_id:["), "closes the `[` at column 16"),
        (lines[target].replace(",FREE,PTA,", ",FREE,PTA,extra,"), "fields where the header has 12"),
        (lines[target].replacen(",N/A,", ",N/A,soon,", 1), "fields where the header has 12"),
    ] {
        let mut text: Vec<String> = lines.iter().map(|l| (*l).to_owned()).collect();
        text[target] = bad;
        let csv = dir.join("bad.csv");
        std::fs::write(&csv, text.join("\n") + "\n").unwrap();
        let out = bpf(&dir, &["analyze", "bad.csv"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        let line = format!("line {}", target + 1);
        assert!(
            err.contains(&line) && err.contains(what) && err.contains("bad.csv"),
            "want `{line}` and `{what}`: {err}"
        );
        assert_eq!(err.lines().filter(|l| l.contains("line ")).count(), 1, "one error: {err}");
    }
    // A timestamp that is not a number.
    let mut text: Vec<String> = lines.iter().map(|l| (*l).to_owned()).collect();
    let fields: Vec<&str> = lines[1].split(',').collect();
    text[1] = lines[1].replacen(fields[4], "soon", 1);
    std::fs::write(dir.join("bad.csv"), text.join("\n") + "\n").unwrap();
    let err = String::from_utf8_lossy(&bpf(&dir, &["analyze", "bad.csv"]).stderr).into_owned();
    assert!(err.contains("line 2, column Timestamp(ns): `soon` is not a time in ns"), "{err}");
    // Another of msMemScope's CSVs is named for what it is.
    std::fs::write(dir.join("python_trace_1_2.csv"), "FuncInfo,StartTime(ns),EndTime(ns),Thread Id,Process Id\n")
        .unwrap();
    let err = String::from_utf8_lossy(&bpf(&dir, &["analyze", "python_trace_1_2.csv"]).stderr).into_owned();
    assert!(err.contains("Python trace"), "{err}");
}

fn digest(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap()
}

#[test]
fn msmemscope_dbs_are_written_only_when_asked() {
    let dir = scratch("nowrite");
    let trace = corpus::training(STEPS, true);
    let db = dir.join("msmemscope_1_20250101000000_ascend/device_0/dump/memscope_dump_20250101000000.db");
    corpus::db(&trace, "0", &db, "memscope_dump", false, true);
    let before = digest(&db);
    let (_, err) = ok(&dir, &["analyze", db.to_str().unwrap(), "--analysis", "decompose,leaks,inefficient"]);
    assert!(err.contains("not stored in it"), "{err}");
    ok(&dir, &["advise", db.to_str().unwrap()]);
    assert_eq!(digest(&db), before, "msMemScope's DB changed without --write");
    ok(&dir, &["analyze", db.to_str().unwrap(), "--analysis", "leaks", "--write"]);
    let conn = rusqlite::Connection::open(&db).unwrap();
    let leaks: i64 = conn.query_row("SELECT count(*) FROM ms_leaks", [], |r| r.get(0)).unwrap();
    assert!(leaks > 0, "--write stores the results");
    // A CSV cannot hold them: one clear error.
    std::fs::write(dir.join("t.csv"), corpus::csv(&trace, "0", Style::Bare)).unwrap();
    let err = String::from_utf8_lossy(&bpf(&dir, &["analyze", "t.csv", "--write"]).stderr).into_owned();
    assert!(err.contains("memscope-bpf import"), "{err}");
}

#[test]
fn import_makes_dbs_insight_opens_and_the_verbs_prefer_them() {
    let dir = scratch("import");
    let trace = corpus::training(STEPS, true);
    let run = corpus::layout(&dir, &trace, "20250101000003");
    let (_, err) = ok(&dir, &["import", run.to_str().unwrap()]);
    assert_eq!(err.matches("imported ").count(), 2, "device_0 and device_cpu: {err}");
    let db = run.join("device_0/dump/memscope_dump_20250101000003.db");
    let csv = run.join("device_0/dump/memscope_dump_20250101000003.csv");
    // Insight's rules (reference §3.3): the name, the table, its columns in order, JSON strings.
    let name = db.file_name().unwrap().to_str().unwrap();
    assert!(name.starts_with("memscope_dump_") && name[14..name.len() - 3].chars().all(|c| c.is_ascii_digit()));
    let conn = rusqlite::Connection::open(&db).unwrap();
    let columns: Vec<String> = conn
        .prepare("SELECT name FROM pragma_table_info('memscope_dump')")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    // msMemScope's header, §3.4: Insight reads the columns by position.
    let header = "ID,Event,Event Type,Name,Timestamp(ns),Process Id,Thread Id,Device Id,Ptr,Attr,Call Stack(Python),Call Stack(C)";
    assert_eq!(columns.join(","), header);
    let rows: i64 = conn.query_row("SELECT count(*) FROM memscope_dump", [], |r| r.get(0)).unwrap();
    let events = corpus::written_order(&trace, "0", true);
    assert_eq!(rows as usize, events.len());
    for e in &events {
        let attr: String =
            conn.query_row("SELECT Attr FROM memscope_dump WHERE ID = ?1", [e.id as i64], |r| r.get(0)).unwrap();
        assert_eq!(attr, corpus::attr_json(e), "row {}", e.id);
    }
    let grouped: i64 = conn
        .query_row("SELECT count(*) FROM memscope_dump WHERE Attr LIKE '%\"allocation_id\":\"3\"%'", [], |r| r.get(0))
        .unwrap();
    assert_eq!(grouped, 2, "a block's rows group by allocation_id as Insight groups them");
    let stack: String = conn
        .query_row("SELECT \"Call Stack(Python)\" FROM memscope_dump WHERE Event = 'MALLOC' LIMIT 1", [], |r| r.get(0))
        .unwrap();
    assert!(stack.contains('\n') && stack.contains("model.py(7): forward"), "{stack:?}");
    // The verbs now read the DBs, not the CSVs beside them.
    let (out, err) = ok(&dir, &["analyze", run.to_str().unwrap(), "--at", "end", "--json", "--no-write"]);
    assert!(!err.contains("temporary DB"), "{err}");
    assert_eq!(pta_owners(&json(&out), "end", "0"), trace.end_by_owner);
    // Again: refused, nothing changed, until --force.
    let before = digest(&db);
    let out = bpf(&dir, &["import", csv.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--force"));
    assert_eq!(digest(&db), before);
    ok(&dir, &["import", csv.to_str().unwrap(), "--force", "-o", dir.join("copy/one.db").to_str().unwrap()]);
    assert!(dir.join("copy/one.db").exists());
    // A folder imported before: --force imports its CSVs again, hidden as they are by their DBs.
    let (_, err) = ok(&dir, &["import", run.to_str().unwrap(), "--force"]);
    assert_eq!(err.matches("imported ").count(), 2, "{err}");
}

#[test]
fn an_early_capture_with_every_device_in_one_file_is_read_per_device() {
    let dir = scratch("legacy");
    let (first, second) = (corpus::training(STEPS, true), corpus::training(3, false));
    let csv = dir.join("leaksDumpResults/dump/leaks_dump_1746006014.csv");
    std::fs::create_dir_all(csv.parent().unwrap()).unwrap();
    std::fs::write(&csv, corpus::legacy_csv(&[("0", &first), ("1", &second)])).unwrap();
    let (out, err) = ok(&dir, &["analyze", "leaksDumpResults", "--at", "end", "--json"]);
    assert!(err.contains("holds devices 0, 1 in one file") && err.contains("timestamps in µs"), "{err}");
    let trees = json(&out);
    assert_eq!(pta_owners(&trees, "end", "0"), first.end_by_owner);
    assert_eq!(pta_owners(&trees, "end", "1"), second.end_by_owner);
    // The µs became ns: the trace lasts as long as the ledger's.
    let at = |kind: &str| first.events.iter().find(|e| e.kind == kind).unwrap().ts;
    let span_us = (at("STOP_TRACE") - at("START_TRACE")) as f64 / 1e3;
    let (text, _) = ok(&dir, &["analyze", "leaksDumpResults", "--device", "0"]);
    let want = format!("trace: {span_us:.3} us long, from START_TRACE");
    assert!(text.contains(&want), "want `{want}`: {text}");
    // compare pairs the two devices of one file with those of another.
    let (out, _) = ok(&dir, &["compare", csv.to_str().unwrap(), csv.to_str().unwrap(), "--level", "op", "--json"]);
    let pairs = json(&out);
    let devices: Vec<&str> = pairs.as_array().unwrap().iter().map(|d| d["device"].as_str().unwrap()).collect();
    assert_eq!(devices, ["0", "1"]);
}
