//! Reading back what the tracer wrote: a run folder's DBs and CSVs as rows ([`read_output`]),
//! `ms_meta` values, SQLite's health of a file, and the text the CLI printed (`probes` listings,
//! the summary, `advise --json`). [`read_output`] also applies Insight's import rules
//! ([`crate::insight_rules`]) to every DB it reads, so no DB a test looks at escapes them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::assertions::{assert_private, insight_file_name, insight_rules};
use crate::environment::expected_owner;

/// One `memscope_dump` row.
#[derive(Clone, Debug)]
pub struct DbRow {
    pub id: i64,
    pub event: String,
    pub event_type: String,
    pub name: String,
    pub ts: u64,
    pub pid: u32,
    pub tid: u32,
    pub device: String,
    pub ptr: String,
    pub attr: BTreeMap<String, String>,
    /// Folder the row was found in (`device_0`, `device_cpu`, ...).
    pub folder: String,
}
impl DbRow {
    pub fn ptr_value(&self) -> Option<u64> {
        self.ptr.strip_prefix("0x").and_then(|h| u64::from_str_radix(h, 16).ok())
    }
    pub fn attr_u64(&self, key: &str) -> Option<u64> {
        let v = self.attr.get(key)?;
        v.strip_prefix("0x").map_or_else(|| v.parse().ok(), |h| u64::from_str_radix(h, 16).ok())
    }
    pub fn is_shadow(&self) -> bool {
        self.attr.get("shadow").map(String::as_str) == Some("true")
    }
}
/// Everything one trace wrote.
pub struct Output {
    pub run_dir: PathBuf,
    /// Per device folder, its file and rows in ID order; the calls of threads whose device the
    /// trace never learnt (the run-level `unknown_device_*` file) under [`UNKNOWN_DEVICE`].
    pub files: BTreeMap<String, (PathBuf, Vec<DbRow>)>,
    /// Frees of blocks the trace never saw allocated (`ms_untracked_frees` of every file, or
    /// the `ms_untracked_frees_*.csv` files), in file then ID order.
    pub untracked: Vec<DbRow>,
}
/// The key of the run-level file of calls with no known device in [`Output::files`].
pub const UNKNOWN_DEVICE: &str = "unknown_device";
impl Output {
    pub fn rows(&self) -> impl Iterator<Item = &DbRow> {
        self.files.values().flat_map(|(_, rows)| rows.iter())
    }
    /// MALLOC/FREE/VMM/OOM/API_ERROR rows, without SYSTEM rows and shadow frees, and without the
    /// rows about uses of blocks (ACCESS, KERNEL_LAUNCH, OP_LAUNCH), markers (MSTX) and the
    /// blocks listed with an OOM trigger, which have tests of their own; with the untracked frees,
    /// which are calls too.
    pub fn call_rows(&self) -> Vec<&DbRow> {
        const NOT_CALLS: [&str; 5] = ["SYSTEM", "ACCESS", "KERNEL_LAUNCH", "OP_LAUNCH", "MSTX"];
        const LISTINGS: [&str; 2] = ["OOM_RECENT_ALLOC", "OOM_TOP_ALLOC"];
        self.rows()
            .chain(&self.untracked)
            .filter(|r| {
                !NOT_CALLS.contains(&r.event.as_str()) && !LISTINGS.contains(&r.event_type.as_str()) && !r.is_shadow()
            })
            .collect()
    }
    pub fn db(&self, folder: &str) -> &Path {
        &self.files.get(folder).unwrap_or_else(|| panic!("no {folder} in {:?}", self.files.keys())).0
    }
}
/// The single run folder under `output`.
pub fn run_dir(output: &Path) -> PathBuf {
    let dirs: Vec<PathBuf> = std::fs::read_dir(output)
        .unwrap_or_else(|e| panic!("{}: {e}", output.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    assert_eq!(dirs.len(), 1, "expected one run folder in {}: {dirs:?}", output.display());
    dirs[0].clone()
}
fn parse_attr_json(text: &str) -> BTreeMap<String, String> {
    let v: serde_json::Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("Attr is not JSON: {text}: {e}"));
    v.as_object()
        .unwrap_or_else(|| panic!("Attr is not an object: {text}"))
        .iter()
        .map(|(k, v)| {
            (k.clone(), v.as_str().unwrap_or_else(|| panic!("Attr value of {k} is not a string: {text}")).to_owned())
        })
        .collect()
}
pub fn read_db(path: &Path, folder: &str) -> Vec<DbRow> {
    read_table(path, "memscope_dump", folder)
}
/// The rows of a table with `memscope_dump`'s columns (`memscope_dump`, `ms_untracked_frees`).
pub fn read_table(path: &Path, table: &str, folder: &str) -> Vec<DbRow> {
    let conn = rusqlite::Connection::open_with_flags(path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
    let mut stmt = conn
        .prepare(&format!(
            "SELECT \"ID\", \"Event\", \"Event Type\", \"Name\", \"Timestamp(ns)\", \"Process Id\", \"Thread Id\", \"Device Id\", \"Ptr\", \"Attr\" \
             FROM {table} ORDER BY \"ID\""
        ))
        .unwrap();
    stmt.query_map([], |r| {
        Ok(DbRow {
            id: r.get(0)?,
            event: r.get(1)?,
            event_type: r.get(2)?,
            name: r.get(3)?,
            ts: r.get::<_, i64>(4)? as u64,
            pid: r.get(5)?,
            tid: r.get(6)?,
            device: r.get(7)?,
            ptr: r.get(8)?,
            attr: parse_attr_json(&r.get::<_, String>(9)?),
            folder: folder.to_owned(),
        })
    })
    .unwrap()
    .map(Result::unwrap)
    .collect()
}
/// msMemScope's CSV Attr form `{k:v,...}` to a map.
fn parse_attr_csv(text: &str) -> BTreeMap<String, String> {
    let inner =
        text.strip_prefix('{').and_then(|t| t.strip_suffix('}')).unwrap_or_else(|| panic!("bad CSV Attr {text}"));
    inner
        .split(',')
        .filter(|kv| !kv.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once(':').unwrap_or_else(|| panic!("bad CSV Attr pair {kv}"));
            (k.to_owned(), v.to_owned())
        })
        .collect()
}
/// RFC 4180 fields of one line.
fn csv_fields(line: &str) -> Vec<String> {
    let mut fields = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' if quoted && chars.peek() == Some(&'"') => {
                cur.push('"');
                chars.next();
            }
            '"' => quoted = !quoted,
            ',' if !quoted => fields.push(std::mem::take(&mut cur)),
            c => cur.push(c),
        }
    }
    fields.push(cur);
    fields
}
pub const CSV_HEADER: &str =
    "ID,Event,Event Type,Name,Timestamp(ns),Process Id,Thread Id,Device Id,Ptr,Attr,Call Stack(Python),Call Stack(C)";
pub fn read_csv(path: &Path, folder: &str) -> Vec<DbRow> {
    let text = std::fs::read_to_string(path).unwrap();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some(CSV_HEADER), "CSV header of {}", path.display());
    lines
        .map(|l| {
            let f = csv_fields(l);
            assert_eq!(f.len(), 12, "CSV line has {} fields: {l}", f.len());
            DbRow {
                id: f[0].parse().unwrap(),
                event: f[1].clone(),
                event_type: f[2].clone(),
                name: f[3].clone(),
                ts: f[4].parse().unwrap(),
                pid: f[5].parse().unwrap(),
                tid: f[6].parse().unwrap(),
                device: f[7].clone(),
                ptr: f[8].clone(),
                attr: parse_attr_csv(&f[9]),
                folder: folder.to_owned(),
            }
        })
        .collect()
}
/// A file's rows and its untracked frees.
fn read_dump_file(file: &Path, folder: &str, untracked: &mut Vec<DbRow>) -> Vec<DbRow> {
    if file.extension().is_some_and(|x| x == "db") {
        untracked.extend(read_table(file, "ms_untracked_frees", folder));
        return read_db(file, folder);
    }
    let name = file.file_name().unwrap().to_string_lossy();
    let digits = name.rsplit('_').next().unwrap();
    let beside = file.with_file_name(format!("ms_untracked_frees_{digits}"));
    if beside.is_file() {
        untracked.extend(read_csv(&beside, folder));
    }
    read_csv(file, folder)
}
/// Reads every device file of the run under `output` (DB or CSV), and the run-level file of
/// calls with no known device. Every DB named for Insight must pass its import rules
/// ([`insight_rules`]): this is where the tests read what the tracer wrote, so no DB escapes.
pub fn read_output(output: &Path) -> Output {
    read_run(&run_dir(output))
}
/// The run of a daemon's one job under `output` (its flight recordings' folder aside).
pub fn read_daemon_job(output: &Path) -> Output {
    let folder = std::fs::read_dir(output)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| !p.ends_with("flight"))
        .expect("the job's run folder");
    read_run(&folder)
}
/// As [`read_output`], for one run folder among several (the daemon writes one per job).
pub fn read_run(run_dir: &Path) -> Output {
    let run_dir = run_dir.to_owned();
    let mut files = BTreeMap::new();
    let mut untracked = Vec::new();
    for entry in std::fs::read_dir(&run_dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_file() {
            assert!(name.starts_with("unknown_device_"), "unexpected file in the run folder: {}", path.display());
            assert_private(&path, expected_owner());
            let rows = read_dump_file(&path, UNKNOWN_DEVICE, &mut untracked);
            files.insert(UNKNOWN_DEVICE.to_owned(), (path, rows));
            continue;
        }
        let dump = path.join("dump");
        let mut found: Vec<PathBuf> = std::fs::read_dir(&dump)
            .unwrap_or_else(|e| panic!("{}: {e}", dump.display()))
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "db" || x == "csv"))
            .filter(|p| !p.file_name().unwrap().to_string_lossy().starts_with("ms_untracked_frees_"))
            .collect();
        assert_eq!(found.len(), 1, "one dump file per device folder: {found:?}");
        let file = found.pop().unwrap();
        let file_name = file.file_name().unwrap().to_string_lossy().into_owned();
        let digits = file_name.trim_start_matches("memscope_dump_").trim_end_matches(".db").trim_end_matches(".csv");
        assert!(
            file_name.starts_with("memscope_dump_") && digits.bytes().all(|b| b.is_ascii_digit()),
            "Insight needs memscope_dump_<digits>: {file_name}"
        );
        if file_name.ends_with(".db") {
            insight_rules(&file);
            assert_multi_links(&file);
        }
        let rows = read_dump_file(&file, &name, &mut untracked);
        files.insert(name, (file, rows));
    }
    Output { run_dir, files, untracked }
}
/// Where the kernel has multi-uprobe links (Linux 6.6), a trace's probes use them: a trace
/// that fell back to one perf event per probe still works, but detaches slowly, so the fallback
/// must not happen unnoticed (a map kind the loader did not know, and copies loaded without
/// BTF, which the Python walk's `bpf_loop` callbacks need, once caused it).
fn assert_multi_links(db: &Path) {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut parts = release.trim().split(['.', '-']).map(|p| p.parse::<u32>().unwrap_or(0));
    let version = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    if version < (6, 6) {
        return;
    }
    let links = meta(db, "probe_links").unwrap_or_default();
    assert_eq!(links, "uprobe_multi", "{}: Linux {version:?} has multi-uprobe links", db.display());
}
/// Shadow frees in the output, as (device, ptr). Their sizes are their blocks' (see
/// `assert_frees_carry_block_sizes`).
pub fn shadow_frees(out: &Output) -> Vec<(String, u64)> {
    let mut v: Vec<_> = out
        .rows()
        .filter(|r| r.event == "FREE" && r.is_shadow())
        .map(|r| (r.device.clone(), r.ptr_value().unwrap()))
        .collect();
    v.sort_by_key(|(_, p)| *p);
    v
}
/// `PRAGMA integrity_check` and the row count of a DB file.
pub fn db_health(path: &Path) -> (String, i64) {
    let conn = rusqlite::Connection::open(path).unwrap();
    let check: String = conn.query_row("PRAGMA integrity_check", [], |r| r.get(0)).unwrap();
    let n: i64 = conn.query_row("SELECT count(*) FROM memscope_dump", [], |r| r.get(0)).unwrap();
    (check, n)
}
/// A value from `ms_meta`.
pub fn meta(path: &Path, key: &str) -> Option<String> {
    let conn = rusqlite::Connection::open(path).unwrap();
    conn.query_row("SELECT value FROM ms_meta WHERE key = ?1", [key], |r| r.get(0)).ok()
}
/// Whether `probes` printed a line `ACTION API SYMBOL (SOURCE...`, e.g. `attach aclrtMalloc
/// aclrtMallocImpl (dynsym, offset 0x24f0)`; columns are padded, so words are compared.
pub fn listed(text: &str, action: &str, api: &str, symbol: &str, source: &str) -> bool {
    text.lines().any(|l| {
        let words: Vec<&str> = l.split_whitespace().collect();
        words.len() >= 4
            && words[0] == action
            && words[1] == api
            && words[2] == symbol
            && words[3].trim_start_matches('(').trim_end_matches([',', ':']) == source
    })
}
/// The frees of blocks from before the trace that the tracer's summary counts, all devices.
pub fn summary_untracked_frees(stderr: &str) -> u64 {
    stderr
        .lines()
        .filter_map(|l| l.trim().split_once(" of the frees were of blocks allocated before the trace"))
        .map(|(n, _)| n.parse::<u64>().unwrap())
        .sum()
}
/// The recommendation `id` of an advice, if given.
pub fn recommendation<'a>(advice: &'a serde_json::Value, id: &str) -> Option<&'a serde_json::Value> {
    advice["recommendations"].as_array()?.iter().find(|r| r["id"] == id)
}
/// Every DB named like Insight's files under `root`, at any depth.
pub fn insight_dbs_under(root: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![root.to_owned()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for entry in entries.flatten() {
            let path = entry.path();
            let kind = entry.file_type().unwrap();
            if kind.is_dir() {
                stack.push(path);
            } else if kind.is_file() && path.file_name().and_then(|n| n.to_str()).is_some_and(insight_file_name) {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// What PyTorch's own `_memory_viz.py` (of the real torch wheel, run by `python`) says of the
/// snapshot on device 0 (tests/workloads/memory_viz_check.py).
pub fn pytorch_reads(env: &crate::environment::TestEnv, python: &Path, snapshot: &Path) -> serde_json::Value {
    let site = std::process::Command::new(python)
        .args(["-c", "import torch, os; print(os.path.dirname(torch.__file__))"])
        .output();
    let viz = Path::new(String::from_utf8_lossy(&site.unwrap().stdout).trim()).join("cuda/_memory_viz.py");
    assert!(viz.is_file(), "no {}", viz.display());
    let check = std::process::Command::new(python)
        .arg(env.workload.with_file_name("memory_viz_check.py"))
        .arg(&viz)
        .arg(snapshot)
        .arg("0")
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "PyTorch's _memory_viz.py refused the export:\n{}",
        String::from_utf8_lossy(&check.stderr)
    );
    serde_json::from_slice(&check.stdout).unwrap()
}
