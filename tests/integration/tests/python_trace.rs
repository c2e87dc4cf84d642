//! `trace --python-trace`: each traced thread's Python stack sampled on a timer, turned into
//! msMemScope's `python_trace_<pid>` tables, driven by tests/workloads/py_trace_job.py.
//!
//! Ground truth: the job's own ledger (`time.time_ns()` on entry and return of each function,
//! with its native thread id). What is checked:
//! - every call the job made is one interval of its thread, `FuncInfo` as msMemScope writes it
//!   (`file(first line): name`), whose ends are within one sampling period of the ledger's;
//! - the table obeys what MindStudio Insight's reader needs (its name's pid is its `Process
//!   Id`, thread ids non-zero, ends after starts, times of one width) and its nesting rule (a
//!   thread's intervals by start, the stack popped while its top ends before the next starts:
//!   `MemScopeParser`'s depth) gives each interval a parent that contains it, and a function
//!   called from another the depth below it;
//! - where `INSIGHT_SRC` names a MindStudio Insight checkout, Insight's own server code (its
//!   memscope module, built unmodified by tests/insight-cpp) imports the DB and draws the same
//!   slices at the same depths.

use std::path::Path;
use std::time::Duration;

use memscope_integration::*;

const HZ: u64 = 200;
/// One sampling period, and the scheduling slack of a busy 2-core machine.
const PERIOD_NS: u64 = 1_000_000_000 / HZ;
const SLACK_NS: u64 = 3_000_000;

#[derive(Debug, Clone)]
struct Slice {
    info: String,
    start: u64,
    end: u64,
    tid: u64,
}

fn slices(db: &Path, pid: u64) -> Vec<Slice> {
    let conn = rusqlite::Connection::open(db).unwrap();
    let table = format!("python_trace_{pid}");
    let sql = format!(
        "SELECT \"FuncInfo\", \"StartTime(ns)\", \"EndTime(ns)\", \"Thread Id\", \"Process Id\", \
         typeof(\"StartTime(ns)\") FROM {table}"
    );
    let mut stmt = conn.prepare(&sql).unwrap_or_else(|e| panic!("{}: no {table}: {e}", db.display()));
    let rows = stmt
        .query_map([], |r| {
            let (start, end): (String, String) = (r.get(1)?, r.get(2)?);
            let (tid, table_pid, ty): (i64, i64, String) = (r.get(3)?, r.get(4)?, r.get(5)?);
            assert_eq!(ty, "text", "msMemScope's times are TEXT");
            assert_eq!(table_pid as u64, pid, "Insight keys the depths by the table's pid");
            assert!(tid > 0, "Insight skips thread 0");
            assert_eq!((start.len(), end.len()), (19, 19), "times of one width sort as text");
            Ok(Slice { info: r.get(0)?, start: start.parse().unwrap(), end: end.parse().unwrap(), tid: tid as u64 })
        })
        .unwrap();
    rows.map(Result::unwrap).collect()
}

/// Insight's depths (`MemScopeParser`): per thread by start, pop while the top ends before the
/// slice starts; the stack's size is the depth. Checks each slice's parent contains it.
fn insight_depths(all: &[Slice]) -> Vec<(Slice, usize)> {
    let mut out = Vec::new();
    let mut tids: Vec<u64> = all.iter().map(|s| s.tid).collect();
    tids.sort_unstable();
    tids.dedup();
    for tid in tids {
        let mut mine: Vec<&Slice> = all.iter().filter(|s| s.tid == tid).collect();
        mine.sort_by_key(|s| s.start);
        let mut stack: Vec<&Slice> = Vec::new();
        for s in mine {
            while stack.last().is_some_and(|top| top.end < s.start) {
                stack.pop();
            }
            if let Some(parent) = stack.last() {
                assert!(parent.start < s.start && s.end < parent.end, "{s:?} is not inside {parent:?}");
            }
            out.push((s.clone(), stack.len()));
            stack.push(s);
        }
    }
    out
}

#[test]
fn python_trace_each_call_is_an_interval_within_a_sampling_period_and_nests_as_insight_draws_it() {
    let env = env("python_trace");
    let (ledger, out) = (env.scratch.join("ledger.jsonl"), env.scratch.join("out"));
    let job = env.workload.with_file_name("py_trace_job.py");
    let s = |p: &Path| p.display().to_string();
    let hz = HZ.to_string();
    let python_trace = format!("--python-trace={hz}");
    let args = [
        "trace",
        "--output",
        &s(&out),
        &python_trace,
        "--",
        "python3",
        &s(&job),
        "--ledger",
        &s(&ledger),
        "--wait",
        "2",
    ];
    let vars: Vec<(&str, Option<&std::ffi::OsStr>)> = vec![("ASCEND_HOME_PATH", Some(env.ascend_home.as_os_str()))];
    let (code, stderr) = Tracer::spawn_with(&env, &args, &vars).finish(Duration::from_secs(120));
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("python trace:"), "{stderr}");
    let lines: Vec<serde_json::Value> =
        std::fs::read_to_string(&ledger).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let pid = lines[0]["pid"].as_u64().unwrap();
    let output = read_output(&out);
    let all = slices(output.db("device_0"), pid);
    assert!(!all.is_empty());
    let mut matched: Vec<&Slice> = Vec::new();
    for call in &lines[1..] {
        let (func, tid) = (call["func"].as_str().unwrap(), call["tid"].as_u64().unwrap());
        let (t0, t1) = (call["t0"].as_u64().unwrap(), call["t1"].as_u64().unwrap());
        let near = |a: u64, b: u64| a.abs_diff(b) <= PERIOD_NS + SLACK_NS;
        let found: Vec<&Slice> = all
            .iter()
            .filter(|sl| sl.info == func && sl.tid == tid && near(sl.start, t0) && near(sl.end, t1))
            .collect();
        let same_name: Vec<&Slice> = all.iter().filter(|s| s.info == func).collect();
        assert_eq!(found.len(), 1, "{func} on {tid} [{t0}, {t1}]: {same_name:#?}");
        matched.push(found[0]);
    }
    let depths = insight_depths(&all);
    // The depths of the job's own calls (a sample during the interpreter's start-up can name a
    // short-lived code object by what took its memory since: docs/db-schema.md).
    let depth_of = |name: &str| -> Vec<usize> {
        depths
            .iter()
            .filter(|(s, _)| s.info.ends_with(&format!(": {name}")))
            .filter(|(s, _)| matched.iter().any(|m| m.start == s.start && m.tid == s.tid))
            .map(|(_, d)| *d)
            .collect()
    };
    let (steps, forwards) = (depth_of("step"), depth_of("forward"));
    assert!(!steps.is_empty() && steps.iter().all(|d| *d == steps[0]), "{steps:?}");
    // step -> the recording wrapper -> forward.
    assert!(
        forwards.len() == steps.len() && forwards.iter().all(|d| *d == steps[0] + 2),
        "step at {steps:?}, forward at {forwards:?}"
    );
    insight_draws(output.db("device_0"), &depths);
    let db = rusqlite::Connection::open(output.db("device_0")).unwrap();
    let samples: String =
        db.query_row("SELECT value FROM ms_meta WHERE key = 'python_trace_samples'", [], |r| r.get(0)).unwrap();
    assert!(samples.parse::<u64>().unwrap() > HZ / 2, "{samples} samples in over a second of CPU");
}

/// Insight's own server code on the DB: tests/insight-cpp builds its memscope module from the
/// checkout `INSIGHT_SRC` names (its sources are not where CI reaches, so CI skips this) and
/// prints each slice Insight would send its flame graph, with the depth Insight gave it. They
/// must be the table's slices, each at the depth its nesting rule gives ([`insight_depths`]).
fn insight_draws(db: &Path, depths: &[(Slice, usize)]) {
    let Some(src) = std::env::var_os("INSIGHT_SRC") else {
        eprintln!("SKIPPED: Insight's own code on python_trace: set INSIGHT_SRC to a MindStudio Insight checkout");
        return;
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let harness = root.join("target/insight-cpp/insight-harness");
    let build = std::process::Command::new(root.join("tests/insight-cpp/build.sh"))
        .arg(&harness)
        .env("INSIGHT_SRC", &src)
        .output()
        .expect("run tests/insight-cpp/build.sh");
    assert!(build.status.success(), "building Insight's code: {}", String::from_utf8_lossy(&build.stderr));
    let run = std::process::Command::new(&harness).arg(db).env("INSIGHT_HARNESS_QUIET", "1").output().unwrap();
    assert!(run.status.success(), "Insight's import of {}: {}", db.display(), String::from_utf8_lossy(&run.stderr));
    let mut drawn: Vec<(u64, u64, u64, String, usize)> = String::from_utf8_lossy(&run.stdout)
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["kind"] == "slice")
        .map(|v| {
            let n = |k: &str| v[k].as_u64().unwrap_or_else(|| panic!("{k} in {v}"));
            (n("tid"), n("start"), n("end"), v["func"].as_str().unwrap().to_owned(), n("depth") as usize)
        })
        .collect();
    let mut ours: Vec<(u64, u64, u64, String, usize)> =
        depths.iter().map(|(s, d)| (s.tid, s.start, s.end, s.info.clone(), *d)).collect();
    drawn.sort();
    ours.sort();
    assert_eq!(drawn.len(), ours.len(), "Insight drew {} slices of the table's {}", drawn.len(), ours.len());
    for (d, o) in drawn.iter().zip(&ours) {
        assert_eq!(d, o, "Insight's slice, then the table's with its nesting depth");
    }
}
