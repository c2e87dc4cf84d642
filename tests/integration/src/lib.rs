//! Helpers for the privileged test tier: run the stand-in workload and the tracer, read the
//! workload's ledger (ground truth) and the tracer's output, and compare them.
//!
//! These tests load BPF, so they run only through `cargo xtask test` (as root), which builds the
//! stand-ins and the release binary and sets `MEMSCOPE_PRIVILEGED_TIER=1` plus the paths below.
//! Run any other way they fail with that instruction instead of passing silently.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Deserialize;

/// Paths handed over by `cargo xtask test`.
pub struct TestEnv {
    pub bin: PathBuf,
    pub ascend_home: PathBuf,
    pub libascendcl: PathBuf,
    pub late_lib: PathBuf,
    pub workload: PathBuf,
    pub scratch: PathBuf,
}

/// A path `cargo xtask test` handed over.
pub fn var(name: &str) -> PathBuf {
    PathBuf::from(
        std::env::var(name)
            .unwrap_or_else(|_| panic!("{name} is not set; run the privileged tier with `cargo xtask test`")),
    )
}

/// The environment, or a panic that says how to run these tests.
pub fn env(test: &str) -> TestEnv {
    assert_eq!(
        std::env::var("MEMSCOPE_PRIVILEGED_TIER").as_deref(),
        Ok("1"),
        "privileged tests load BPF and need the stand-ins: run them with `cargo xtask test`"
    );
    // SAFETY: no arguments.
    assert_eq!(unsafe { libc::geteuid() }, 0, "the privileged tier must run as root");
    let scratch = var("MEMSCOPE_SCRATCH").join(test);
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).unwrap();
    TestEnv {
        bin: var("MEMSCOPE_BIN"),
        ascend_home: var("MEMSCOPE_ASCEND_HOME"),
        libascendcl: var("MEMSCOPE_ASCEND_HOME").join("lib64/libascendcl.so"),
        late_lib: var("MEMSCOPE_LATE_LIB"),
        workload: var("MEMSCOPE_WORKLOAD"),
        scratch,
    }
}

pub fn wall_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64
}

// ---------------------------------------------------------------- ledger

/// One call the workload made, as it logged it.
#[derive(Clone, Debug, Deserialize)]
pub struct Entry {
    pub api: String,
    pub rc: i64,
    pub tid: u32,
    pub t0: u64,
    pub t1: u64,
    #[serde(default)]
    pub device: Option<serde_json::Value>,
    #[serde(default)]
    pub size: Option<u64>,
    #[serde(default)]
    pub ptr: Option<u64>,
    #[serde(default)]
    pub handle: Option<u64>,
    #[serde(default)]
    pub via: Option<String>,
    #[serde(default)]
    pub lib: Option<String>,
    #[serde(default)]
    pub flag: Option<u64>,
}

impl Entry {
    /// The device as the DB's `Device Id` column writes it.
    pub fn device_id(&self) -> Option<String> {
        match &self.device {
            Some(serde_json::Value::Number(n)) => Some(n.to_string()),
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            _ => None,
        }
    }
}

pub fn read_ledger(path: &Path) -> Vec<Entry> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("ledger {}: {e}", path.display()));
    text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad ledger line {l}: {e}"))).collect()
}

// ---------------------------------------------------------------- output

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
    let run_dir = run_dir(output);
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
        }
        let rows = read_dump_file(&file, &name, &mut untracked);
        files.insert(name, (file, rows));
    }
    Output { run_dir, files, untracked }
}

// ---------------------------------------------------------------- processes

/// A running tracer with its stderr collected line by line (with arrival times).
pub struct Tracer {
    pub child: Child,
    lines: Arc<Mutex<Vec<(u64, String)>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Tracer {
    pub fn spawn(env: &TestEnv, args: &[&str], extra_env: &[(&str, &Path)]) -> Self {
        let vars: Vec<(&str, Option<&std::ffi::OsStr>)> =
            extra_env.iter().map(|(k, v)| (*k, Some(v.as_os_str()))).collect();
        Self::spawn_with(env, args, &vars)
    }

    /// As [`Self::spawn`], with variables to set (`Some`) or to remove (`None`) so that a launched
    /// job does not inherit them from whoever runs the tests.
    pub fn spawn_with(env: &TestEnv, args: &[&str], vars: &[(&str, Option<&std::ffi::OsStr>)]) -> Self {
        let mut cmd = Command::new(&env.bin);
        cmd.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        for (k, v) in vars {
            match v {
                Some(v) => cmd.env(k, v),
                None => cmd.env_remove(k),
            };
        }
        let mut child = cmd.spawn().expect("start memscope-bpf");
        let stderr = child.stderr.take().unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&lines);
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                sink.lock().unwrap().push((wall_ns(), line));
            }
        });
        Self { child, lines, reader: Some(reader) }
    }

    /// Waits for the "live:" line; returns when it arrived (wall ns).
    pub fn wait_live(&mut self, timeout: Duration) -> u64 {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some((at, _)) = self.lines.lock().unwrap().iter().find(|(_, l)| l.contains(": live:")) {
                return *at;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                std::thread::sleep(Duration::from_millis(100));
                panic!("tracer exited ({status}) before going live:\n{}", self.stderr());
            }
            assert!(Instant::now() < deadline, "tracer not live after {timeout:?}:\n{}", self.stderr());
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn stderr(&self) -> String {
        self.lines.lock().unwrap().iter().map(|(_, l)| l.as_str()).collect::<Vec<_>>().join("\n")
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: plain kill(2) on our child.
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }

    /// Waits for exit (with a deadline) and returns (exit code, stderr).
    pub fn finish(mut self, timeout: Duration) -> (Option<i32>, String) {
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("tracer did not exit within {timeout:?}:\n{}", self.stderr());
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        (status.code(), self.stderr())
    }
}

/// The workload command line (for launch mode or a plain spawn).
pub fn workload_args(env: &TestEnv, ledger: &Path, extra: &[&str]) -> Vec<String> {
    let mut v =
        vec!["python3".to_owned(), env.workload.display().to_string(), "--ledger".into(), ledger.display().to_string()];
    v.extend(extra.iter().map(|s| (*s).to_owned()));
    v
}

/// Where the stand-in driver logs, next to a workload ledger.
pub fn driver_ledger_path(ledger: &Path) -> PathBuf {
    ledger.with_extension("driver.jsonl")
}

/// Starts the workload directly (for attach mode).
pub fn spawn_workload(env: &TestEnv, ledger: &Path, extra: &[&str]) -> Child {
    let args = workload_args(env, ledger, extra);
    Command::new(&args[0])
        .args(&args[1..])
        .env("ASCEND_HOME_PATH", &env.ascend_home)
        .env("STANDIN_HAL_LEDGER", driver_ledger_path(ledger))
        .env("STANDIN_TORCH_LEDGER", pool_ledger_path(ledger))
        .spawn()
        .expect("start workload")
}

/// A trace attached by pid to a workload already running.
pub struct AttachedRun {
    /// Wall-clock ns just before the tracer was started.
    pub start: u64,
    /// Wall-clock ns when the tracer said its probes were live.
    pub live: u64,
    pub stderr: String,
    pub out: Output,
}

/// Starts the workload with `extra`, lets it run 1.5 s, attaches `trace --pid` (no other
/// flags: the tracer must find everything itself), waits for the workload and the tracer to
/// exit successfully, and reads the output.
pub fn trace_attached_mid_run(env: &TestEnv, ledger: &Path, extra: &[&str]) -> AttachedRun {
    let out = env.scratch.join("out");
    let mut workload = spawn_workload(env, ledger, extra);
    std::thread::sleep(Duration::from_millis(1500));
    let start = wall_ns();
    let pid = workload.id().to_string();
    let out_s = out.display().to_string();
    let mut tracer = Tracer::spawn(env, &["trace", "--pid", &pid, "--output", &out_s], &[]);
    let live = tracer.wait_live(Duration::from_secs(30));
    assert_eq!(wait_child(&mut workload, Duration::from_secs(60)), 0);
    let (code, stderr) = tracer.finish(Duration::from_secs(30));
    assert_eq!(code, Some(0), "{stderr}");
    AttachedRun { start, live, stderr, out: read_output(&out) }
}

pub fn wait_child(child: &mut Child, timeout: Duration) -> i32 {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s.code().unwrap_or(-1);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("workload did not finish within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

// ---------------------------------------------------------------- comparison

/// How a ledger entry must appear in the output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Expect {
    pub event: &'static str,
    pub event_type: &'static str,
    /// `None`: any device folder (address reservations are not device memory).
    pub device: Option<String>,
    /// The `Ptr` column for MALLOC/FREE rows.
    pub ptr: Option<u64>,
    /// An Attr key that must hold this value (addresses and handles of VMM rows, sizes).
    pub attrs: Vec<(&'static str, u64)>,
}

const OOM: i64 = 207_001;

/// The row a ledger entry must produce, or `None` for calls the tracer does not record.
pub fn expect(e: &Entry) -> Option<Expect> {
    let device = e.device_id();
    let malloc_api = matches!(
        e.api.as_str(),
        "aclrtMalloc"
            | "aclrtMallocAlign32"
            | "aclrtMallocCached"
            | "aclrtMallocWithCfg"
            | "aclrtMallocHost"
            | "halMemAlloc"
    );
    if e.rc != 0 {
        if malloc_api && e.rc == OOM {
            return Some(Expect {
                event: "OOM_DETAIL",
                event_type: "OOM_TRIGGER",
                device,
                ptr: None,
                attrs: vec![("req_size", e.size?)],
            });
        }
        let recorded = !matches!(e.api.as_str(), "aclrtSetDevice" | "aclrtGetDevice" | "aclrtMemcpy" | "aclrtMemset");
        return recorded.then(|| Expect {
            event: "API_ERROR",
            event_type: if e.api.ends_with("Host") { "HOST" } else { "HAL" },
            device,
            ptr: None,
            attrs: vec![],
        });
    }
    let size = |v: &mut Vec<(&'static str, u64)>| {
        if let Some(s) = e.size {
            v.push(("size", s));
        }
    };
    Some(match e.api.as_str() {
        // Pinned host memory, named as msMemScope names it (Insight's decomposition accepts it).
        "aclrtMallocHost" => Expect {
            event: "MALLOC",
            event_type: "HOST_PINNED",
            device: Some("cpu".into()),
            ptr: e.ptr,
            attrs: vec![("size", e.size?)],
        },
        "aclrtFreeHost" => Expect {
            event: "FREE",
            event_type: "HOST_PINNED",
            device: Some("cpu".into()),
            ptr: e.ptr,
            attrs: vec![("size", e.size?)],
        },
        // Device memory is taken by the driver: the row's size is the driver's (checked against
        // the driver's ledger by `assert_driver_truth`), the request is `req_size`.
        _ if malloc_api => {
            Expect { event: "MALLOC", event_type: "HAL", device, ptr: e.ptr, attrs: vec![("req_size", e.size?)] }
        }
        "aclrtFree" | "halMemFree" => Expect { event: "FREE", event_type: "HAL", device, ptr: e.ptr, attrs: vec![] },
        "aclrtMapMem" => Expect {
            event: "MALLOC",
            event_type: "HAL",
            device,
            ptr: e.ptr,
            attrs: vec![("size", e.size?), ("handle", e.handle?)],
        },
        "aclrtUnmapMem" => {
            let mut attrs = vec![];
            size(&mut attrs);
            Expect { event: "FREE", event_type: "HAL", device, ptr: e.ptr, attrs }
        }
        "aclrtReserveMemAddress" => Expect {
            event: "VMM",
            event_type: "RESERVE",
            device: None,
            ptr: None,
            attrs: vec![("addr", e.ptr?), ("size", e.size?)],
        },
        "aclrtReleaseMemAddress" => {
            Expect { event: "VMM", event_type: "RELEASE", device: None, ptr: None, attrs: vec![("addr", e.ptr?)] }
        }
        "aclrtMallocPhysical" => Expect {
            event: "VMM",
            event_type: "PHYSICAL_MALLOC",
            device,
            ptr: None,
            attrs: vec![("handle", e.handle?), ("size", e.size?)],
        },
        "aclrtFreePhysical" => {
            Expect { event: "VMM", event_type: "PHYSICAL_FREE", device, ptr: None, attrs: vec![("handle", e.handle?)] }
        }
        _ => return None,
    })
}

/// Wall-clock tolerance between the workload's clock reads and the tracer's converted timestamps.
pub const CLOCK_TOLERANCE_NS: u64 = 3_000_000;

/// Why a row does not match an entry, or `None` if it does. `unknown_device_ok` lets the row sit
/// in the unknown-device output; `size_zero_ok` accepts the "unmatched free" form (size 0).
pub fn mismatch(e: &Entry, x: &Expect, r: &DbRow, unknown_device_ok: bool, size_zero_ok: bool) -> Option<String> {
    let mut why = Vec::new();
    if r.event != x.event || r.event_type != x.event_type {
        why.push(format!("event {}/{} != {}/{}", r.event, r.event_type, x.event, x.event_type));
    }
    if r.name != e.api {
        why.push(format!("name {} != {}", r.name, e.api));
    }
    if r.tid != e.tid {
        why.push(format!("tid {} != {}", r.tid, e.tid));
    }
    if let Some(d) = &x.device {
        // The free of a block the trace never saw allocated names no device: it is placed on
        // the thread's device, marked unmatched, and may be wrong for peer-device memory.
        let unmatched_free = size_zero_ok && r.attr.contains_key("unmatched");
        if &r.device != d && !(unknown_device_ok && r.device == "N/A") && !unmatched_free {
            why.push(format!("device {} != {d}", r.device));
        }
    }
    if x.event == "MALLOC" || x.event == "FREE" {
        if r.ptr_value() != x.ptr {
            why.push(format!("ptr {} != {:?}", r.ptr, x.ptr.map(|p| format!("{p:#x}"))));
        }
    } else if r.ptr != "N/A" {
        why.push(format!("Ptr {} should be N/A", r.ptr));
    }
    for (k, v) in &x.attrs {
        let got = r.attr_u64(k);
        if got != Some(*v) && !(size_zero_ok && *k == "size" && got == Some(0)) {
            why.push(format!("attr {k} {got:?} != {v}"));
        }
    }
    if r.ts + CLOCK_TOLERANCE_NS < e.t0 || r.ts > e.t1 + CLOCK_TOLERANCE_NS {
        why.push(format!("timestamp {} outside the call [{}, {}]", r.ts, e.t0, e.t1));
    }
    (!why.is_empty()).then(|| why.join("; "))
}

fn per_tid<'a>(rows: &[&'a DbRow]) -> HashMap<u32, Vec<&'a DbRow>> {
    let mut by: HashMap<u32, Vec<&DbRow>> = HashMap::new();
    for r in rows {
        by.entry(r.tid).or_default().push(r);
    }
    for v in by.values_mut() {
        v.sort_by_key(|r| (r.ts, r.id));
    }
    by
}

fn expected_per_tid(ledger: &[Entry]) -> HashMap<u32, Vec<(&Entry, Expect)>> {
    let mut by: HashMap<u32, Vec<(&Entry, Expect)>> = HashMap::new();
    for e in ledger {
        if let Some(x) = expect(e) {
            by.entry(e.tid).or_default().push((e, x));
        }
    }
    for v in by.values_mut() {
        v.sort_by_key(|(e, _)| e.t0);
    }
    by
}

/// Launch mode: every recordable call is in the output exactly once, in order per thread, with
/// the right values; nothing else is.
pub fn assert_exact(ledger: &[Entry], out: &Output) {
    let rows = out.call_rows();
    let got = per_tid(&rows);
    let want = expected_per_tid(ledger);
    let mut tids: Vec<u32> = got.keys().chain(want.keys()).copied().collect();
    tids.sort_unstable();
    tids.dedup();
    for tid in tids {
        let g = got.get(&tid).map_or(&[][..], Vec::as_slice);
        let w = want.get(&tid).map_or(&[][..], Vec::as_slice);
        for (i, ((e, x), r)) in w.iter().zip(g).enumerate() {
            if let Some(why) = mismatch(e, x, r, false, false) {
                panic!("thread {tid}, call {i}: {why}\n  ledger: {e:?}\n  row:    {r:?}");
            }
        }
        assert_eq!(g.len(), w.len(), "thread {tid}: {} rows for {} ledger calls", g.len(), w.len());
    }
}

/// Attach mode: rows are the ledger's calls in order (a subsequence per thread), every call that
/// started after `live_ns` and ended before `until_ns` is there, none that ended before
/// `start_ns`. A row may be in the unknown-device output only for calls before the thread
/// revealed its device after `live_ns`.
pub fn assert_attached(ledger: &[Entry], out: &Output, start_ns: u64, live_ns: u64, until_ns: u64) {
    // Before everything is live, a driver call can be seen while the runtime call that made it
    // is not (its library was not probed yet): such rows are real driver calls, checked against
    // the driver's own ledger by `assert_driver_truth`, not against the workload's.
    let rows: Vec<&DbRow> =
        out.call_rows().into_iter().filter(|r| !(r.name.starts_with("hal") && r.ts < live_ns)).collect();
    let got = per_tid(&rows);
    let want = expected_per_tid(ledger);
    // When each thread's device became known to the tracer.
    let mut known_from: HashMap<u32, u64> = HashMap::new();
    for e in ledger {
        if (e.api == "aclrtSetDevice" || e.api == "aclrtGetDevice") && e.rc == 0 && e.t0 > live_ns {
            known_from.entry(e.tid).and_modify(|t| *t = (*t).min(e.t1)).or_insert(e.t1);
        }
    }
    // Each free's allocation in the ledger (addresses are reused, so by time, not by address
    // alone). A free whose allocation may have been missed has no known size (the "unmatched"
    // form) and may sit in the unknown-device output.
    let mut allocs: HashMap<u64, Vec<&Entry>> = HashMap::new();
    for e in ledger {
        if let (Some(Expect { event: "MALLOC", ptr: Some(p), .. }), true) = (expect(e), e.rc == 0) {
            allocs.entry(p).or_default().push(e);
        }
    }
    for v in allocs.values_mut() {
        v.sort_by_key(|e| e.t0);
    }
    let origin_unseen = |free: &Entry, ptr: u64| -> bool {
        let origin = allocs.get(&ptr).and_then(|v| v.iter().rev().find(|a| a.t0 < free.t0));
        origin.is_none_or(|a| a.t1 < live_ns || a.t0 < known_from.get(&a.tid).copied().unwrap_or(u64::MAX))
    };
    let mut total = 0;
    for (tid, w) in &want {
        let g = got.get(tid).map_or(&[][..], Vec::as_slice);
        let mut gi = 0;
        for (e, x) in w {
            let must = e.t0 > live_ns && e.t1 < until_ns;
            let Some(r) = g.get(gi) else {
                assert!(!must, "thread {tid}: call after the probes were live is missing: {e:?}");
                continue;
            };
            let before_known = e.t0 < known_from.get(tid).copied().unwrap_or(u64::MAX);
            let free_of_unseen = x.event == "FREE" && x.ptr.is_some_and(|p| origin_unseen(e, p));
            let unknown_ok = before_known || free_of_unseen;
            let size_zero_ok = free_of_unseen;
            match mismatch(e, x, r, unknown_ok, size_zero_ok) {
                None => {
                    assert!(
                        e.t1 >= start_ns,
                        "thread {tid}: recorded a call that ended before the tracer started: {e:?}"
                    );
                    gi += 1;
                    total += 1;
                }
                Some(why) => {
                    assert!(!must, "thread {tid}: call after the probes were live does not match ({why})\n  ledger: {e:?}\n  row: {r:?}");
                }
            }
        }
        assert_eq!(gi, g.len(), "thread {tid}: rows that match no ledger call: {:?}", &g[gi.min(g.len())..]);
    }
    for tid in got.keys() {
        assert!(want.contains_key(tid), "rows for thread {tid}, which the ledger never mentions");
    }
    assert!(total > 0, "nothing was recorded");
}

/// Blocks the ledger says were never freed, as (device, ptr).
pub fn live_at_end(ledger: &[Entry]) -> Vec<(String, u64)> {
    let mut live: BTreeMap<u64, String> = BTreeMap::new();
    let mut sorted: Vec<&Entry> = ledger.iter().collect();
    sorted.sort_by_key(|e| e.t0);
    for e in sorted {
        let Some(x) = expect(e) else { continue };
        match (x.event, x.ptr) {
            ("MALLOC", Some(p)) => {
                live.insert(p, x.device.unwrap_or_default());
            }
            ("FREE", Some(p)) => {
                live.remove(&p);
            }
            _ => {}
        }
    }
    live.into_iter().map(|(p, d)| (d, p)).collect()
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

// ---------------------------------------------------------------- driver ledger

/// One call the stand-in driver logged (STANDIN_HAL_LEDGER): its own truth, below the runtime.
#[derive(Clone, Debug, Deserialize)]
pub struct DriverEntry {
    pub api: String,
    pub tid: u32,
    pub t0: u64,
    pub t1: u64,
    pub size: u64,
    pub flag: u64,
    pub ptr: u64,
    pub rc: i64,
    pub device: i64,
}

pub fn read_driver_ledger(path: &Path) -> Vec<DriverEntry> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("driver ledger {}: {e}", path.display()));
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad driver ledger line {l}: {e}")))
        .collect()
}

fn within(ts: u64, e: &DriverEntry) -> bool {
    ts + CLOCK_TOLERANCE_NS >= e.t0 && ts <= e.t1 + CLOCK_TOLERANCE_NS
}

/// Splits one thread's events at one address, in time order, into those before the trace went
/// live (no row) and those the `rows` rows stand for: a trace misses only what came before it,
/// and a thread's calls at one address happen in order, so the rows are the last events.
fn tail_pairs<'e, E: std::fmt::Debug>(events: &'e [E], rows: usize, what: &str) -> (&'e [E], &'e [E]) {
    assert!(rows <= events.len(), "{rows} rows for {} {what}: {events:#?}", events.len());
    events.split_at(events.len() - rows)
}

/// Rows of device memory against what the driver itself logged: every driver allocation made
/// after `live_ns` is exactly one MALLOC row (merged into its runtime call or on its own), with
/// the driver's size, flag and device; every driver-backed row is a real driver allocation; out-of-
/// memory rows carry the failing driver call's flag; physical memory rows carry the handle's
/// device.
pub fn assert_driver_truth(driver: &[DriverEntry], out: &Output, live_ns: u64) {
    let rows = out.call_rows();
    let backed: Vec<&&DbRow> = rows
        .iter()
        .filter(|r| r.event == "MALLOC" && r.attr.get("alloc_type").map(String::as_str) == Some("alloc"))
        .collect();
    // A thread that frees and reallocates the same address quickly has several driver calls
    // within the clock tolerance of one row, so times alone cannot pair them. A thread's calls at
    // one address happen in order, and a trace misses only those before it went live: the rows
    // of each (thread, address), in time order, are the last driver calls there, in order.
    let mut calls: HashMap<(u32, u64), Vec<&DriverEntry>> = HashMap::new();
    for e in driver.iter().filter(|e| e.api == "halMemAlloc" && e.rc == 0) {
        calls.entry((e.tid, e.ptr)).or_default().push(e);
    }
    let mut seen: HashMap<(u32, u64), Vec<&DbRow>> = HashMap::new();
    for r in &backed {
        let ptr = r.ptr_value().unwrap_or_else(|| panic!("driver-backed row without an address: {r:?}"));
        seen.entry((r.tid, ptr)).or_default().push(r);
    }
    for (key, rows_here) in &mut seen {
        rows_here.sort_by_key(|r| (r.ts, r.id));
        let here = calls
            .get_mut(key)
            .unwrap_or_else(|| panic!("driver-backed row matches no driver call: {:?}", rows_here[0]));
        here.sort_by_key(|e| e.t0);
        let (missed, paired) = tail_pairs(here, rows_here.len(), &format!("driver calls at {key:?}"));
        for (i, (r, e)) in rows_here.iter().zip(paired).enumerate() {
            // A merged row is stamped at the runtime call's return, which can be well after
            // the driver's (the runtime touches the memory it got); it cannot be before the
            // driver call started, nor after the next call at this address began.
            let next = paired.get(i + 1).map_or(u64::MAX, |n| n.t0 + CLOCK_TOLERANCE_NS);
            assert!(
                r.ts + CLOCK_TOLERANCE_NS >= e.t0 && r.ts <= next,
                "row and driver call at {key:?} are not in time order: {r:?} {e:?}"
            );
            assert_eq!(r.attr_u64("size"), Some(e.size), "size is the driver's: {r:?} {e:?}");
            assert_eq!(r.attr_u64("flag"), Some(e.flag), "flag: {r:?} {e:?}");
            assert_eq!(r.device, e.device.to_string(), "device from the flag: {r:?} {e:?}");
            assert_eq!(r.attr_u64("module_id"), Some(e.flag >> 56), "module: {r:?}");
        }
        for e in missed {
            assert!(e.t0 <= live_ns, "driver allocation has no row of its own: {e:?}");
        }
    }
    for (key, here) in &calls {
        if !seen.contains_key(key) {
            for e in here {
                assert!(e.t0 <= live_ns, "driver allocation has no row of its own: {e:?}");
            }
        }
    }
    for e in driver.iter().filter(|e| e.api == "halMemAlloc" && e.rc == 6 && e.t0 > live_ns) {
        let oom = rows.iter().find(|r| r.event_type == "OOM_TRIGGER" && r.tid == e.tid && within(r.ts, e));
        let oom = oom.unwrap_or_else(|| panic!("failed driver allocation without an OOM row: {e:?}"));
        assert_eq!(oom.attr_u64("flag"), Some(e.flag), "{oom:?}");
    }
    for e in driver.iter().filter(|e| e.api == "halMemCreate" && e.rc == 0 && e.t0 > live_ns) {
        let row = rows
            .iter()
            .filter(|r| {
                r.event_type == "PHYSICAL_MALLOC"
                    && r.tid == e.tid
                    && r.attr_u64("handle") == Some(e.ptr)
                    && within(r.ts, e)
            })
            .min_by_key(|r| r.ts.abs_diff(e.t0))
            .unwrap_or_else(|| panic!("physical allocation missing: {e:?}"));
        assert_eq!(row.attr.get("alloc_type").map(String::as_str), Some("create"));
        assert_eq!(row.device, e.device.to_string(), "{row:?}");
    }
}

/// Every FREE of a known block has its MALLOC's size (Insight pairs them and needs both).
pub fn assert_frees_carry_block_sizes(out: &Output) {
    for (folder, (_, rows)) in &out.files {
        // A segment and its first block share an address, so the layer is part of the key.
        let mut mallocs: HashMap<(String, String, String), &DbRow> = HashMap::new();
        for r in rows.iter().filter(|r| r.event == "MALLOC") {
            mallocs.insert(
                (r.event_type.clone(), r.ptr.clone(), r.attr.get("allocation_id").cloned().unwrap_or_default()),
                r,
            );
        }
        for f in rows.iter().filter(|r| r.event == "FREE" && !r.attr.contains_key("unmatched")) {
            let key = (f.event_type.clone(), f.ptr.clone(), f.attr.get("allocation_id").cloned().unwrap_or_default());
            let m = mallocs.get(&key).unwrap_or_else(|| panic!("{folder}: FREE without its MALLOC: {f:?}"));
            assert_eq!(f.attr.get("size"), m.attr.get("size"), "{folder}: {f:?} vs {m:?}");
            assert_eq!(f.event_type, m.event_type);
        }
    }
}

// ---------------------------------------------------------------- allocator ledger

/// One event the stand-in torch_npu allocator logged (STANDIN_TORCH_LEDGER), with its own
/// allocated/reserved counters right after it.
#[derive(Clone, Debug, Deserialize)]
pub struct PoolEntry {
    pub ev: String,
    #[serde(default)]
    pub pool: Option<String>,
    pub tid: u32,
    #[serde(default)]
    pub t0: Option<u64>,
    #[serde(default)]
    pub t1: Option<u64>,
    #[serde(default)]
    pub t: Option<u64>,
    pub device: i64,
    #[serde(default)]
    pub size: Option<u64>,
    #[serde(default)]
    pub ptr: u64,
    /// The allocator's counters at the event, taken under its lock.
    pub allocated: u64,
    pub reserved: u64,
    /// The same counters read after the call returned (block events only).
    #[serde(default)]
    pub allocated_after: Option<u64>,
    #[serde(default)]
    pub reserved_after: Option<u64>,
}

impl PoolEntry {
    /// The (allocated, reserved) pairs a row may carry for this event. A probe fires at the
    /// call's return, after the allocator let go of its lock, so another thread's change in
    /// between (an empty_cache, a segment of its own) can be in the row, as it is in the
    /// counters read after the return. Without contention both pairs are equal.
    pub fn counter_pairs(&self) -> Vec<(u64, u64)> {
        let mut pairs = vec![(self.allocated, self.reserved)];
        if let (Some(a), Some(r)) = (self.allocated_after, self.reserved_after) {
            pairs.push((a, r));
        }
        pairs
    }
}

pub fn read_pool_ledger(path: &Path) -> Vec<PoolEntry> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("allocator ledger {}: {e}", path.display()));
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad allocator ledger line {l}: {e}")))
        .collect()
}

/// Where the stand-in allocator logs, next to a workload ledger.
pub fn pool_ledger_path(ledger: &Path) -> PathBuf {
    ledger.with_extension("torch.jsonl")
}

/// What a PTA check compares.
#[derive(Clone, Copy, Debug)]
pub struct PtaCheck {
    /// Row sizes must be the allocator's block sizes (not just the request).
    pub sizes: bool,
    /// `used` and `total` must equal the allocator's counters after each event.
    pub counters: bool,
    /// Which pools the trace can see: caching (tensors), external (MallocBlock), workspace.
    pub caching: bool,
    pub external: bool,
    pub workspace: bool,
    /// When the trace went live (0 for launch mode): earlier events may be missing, and the
    /// counters, which cannot know older blocks and segments, may only be lower.
    pub after_ns: u64,
}

/// PTA rows against the allocator's own ledger: every block it handed out and took back is one
/// MALLOC and one FREE row on its device, at its time, with its address (and size and counters
/// when `check` says the trace can know them); no PTA row is made up.
pub fn assert_pta(pool: &[PoolEntry], out: &Output, check: PtaCheck) {
    let rows: Vec<&DbRow> = out.call_rows().into_iter().filter(|r| r.event_type == "PTA").collect();
    let visible = |e: &PoolEntry| match e.pool.as_deref() {
        Some("caching") => check.caching,
        Some("external") => check.external,
        Some("workspace") => check.workspace,
        _ => false,
    };
    // A block freed and handed out again at once has several events within the clock tolerance
    // of one row, so rows and events pair up in order per (thread, address, kind).
    let mut events: HashMap<(u32, u64, &str), Vec<&PoolEntry>> = HashMap::new();
    for (ev, event) in [("block_malloc", "MALLOC"), ("block_free", "FREE")] {
        for e in pool.iter().filter(|e| e.ev == ev && visible(e)) {
            events.entry((e.tid, e.ptr, event)).or_default().push(e);
        }
    }
    let mut seen: HashMap<(u32, u64, &str), Vec<&DbRow>> = HashMap::new();
    for r in rows.iter().filter(|r| !r.attr.contains_key("implied") && !r.is_shadow()) {
        let ptr = r.ptr_value().unwrap_or_else(|| panic!("PTA row without an address: {r:?}"));
        seen.entry((r.tid, ptr, r.event.as_str())).or_default().push(r);
    }
    for (key, here) in &mut events {
        here.sort_by_key(|e| e.t0);
        let mut got = seen.remove(key).unwrap_or_default();
        got.sort_by_key(|r| (r.ts, r.id));
        let (missed, paired) = tail_pairs(here, got.len(), &format!("allocator events at {key:?}"));
        for e in missed {
            assert!(e.t0.unwrap() <= check.after_ns, "allocator event without a row: {e:?}");
        }
        for (r, e) in got.iter().zip(paired.iter()) {
            let (t0, t1) = (e.t0.unwrap(), e.t1.unwrap());
            assert!(
                r.ts + CLOCK_TOLERANCE_NS >= t0 && r.ts <= t1 + CLOCK_TOLERANCE_NS,
                "row and event apart in time: {r:?} {e:?}"
            );
            assert_eq!(r.device, e.device.to_string(), "{r:?} {e:?}");
            let want_pool = if e.pool.as_deref() == Some("workspace") { "workspace" } else { "caching" };
            assert_eq!(r.attr.get("pool").map(String::as_str), Some(want_pool), "{r:?}");
            if r.event == "MALLOC" {
                let owner = if want_pool == "workspace" { "PTA_WORKSPACE" } else { "PTA" };
                assert_eq!(r.attr.get("owner").map(String::as_str), Some(owner), "decomposition owner: {r:?}");
            }
            if check.sizes && !r.attr.contains_key("unmatched") {
                if let Some(size) = e.size {
                    assert_eq!(r.attr_u64("size"), Some(size), "block size: {r:?} {e:?}");
                }
            }
            let (used, total) = (r.attr_u64("used").unwrap(), r.attr_u64("total").unwrap());
            let pairs = e.counter_pairs();
            if check.counters && check.after_ns == 0 {
                assert!(
                    pairs.contains(&(used, total)),
                    "used/total = the allocator's allocated/reserved bytes {pairs:?}: {r:?} {e:?}"
                );
            } else if check.counters {
                assert!(
                    pairs.iter().any(|(a, t)| used <= *a && total <= *t),
                    "used/total above the allocator's allocated/reserved bytes {pairs:?}: {r:?} {e:?}"
                );
            }
        }
    }
    assert!(seen.is_empty(), "PTA rows with no allocator event: {:#?}", seen.values().collect::<Vec<_>>());
}

/// Every segment step the allocator logged is one HAL row of the runtime call it made, at the
/// segment's address, on its device and thread: `segment_alloc` an `aclrtMallocAlign32` MALLOC
/// of the segment's size, `segment_free` an `aclrtFree`, and with expandable segments each
/// page `segment_map` an `aclrtMapMem` MALLOC of the page's size and `segment_unmap` an
/// `aclrtUnmapMem` FREE.
pub fn assert_segments(pool: &[PoolEntry], out: &Output) {
    let rows = out.call_rows();
    let kinds = [
        ("segment_alloc", "MALLOC", "aclrtMallocAlign32", "req_size"),
        ("segment_free", "FREE", "aclrtFree", "size"),
        ("segment_map", "MALLOC", "aclrtMapMem", "size"),
        ("segment_unmap", "FREE", "aclrtUnmapMem", "size"),
    ];
    for (ev, event, name, size_key) in kinds {
        let mut events: HashMap<(u32, u64), Vec<&PoolEntry>> = HashMap::new();
        for e in pool.iter().filter(|e| e.ev == ev) {
            events.entry((e.tid, e.ptr)).or_default().push(e);
        }
        let mut seen: HashMap<(u32, u64), Vec<&DbRow>> = HashMap::new();
        for r in rows.iter().filter(|r| r.event_type == "HAL" && r.event == event && r.name == name && !r.is_shadow()) {
            seen.entry((r.tid, r.ptr_value().unwrap())).or_default().push(r);
        }
        for (key, here) in &mut events {
            here.sort_by_key(|e| e.t);
            let got = seen.remove(key).unwrap_or_default();
            // The tracer may see more calls at an address than the allocator's segments (the
            // workload's own runtime calls); each segment step takes the nearest unused row.
            let mut used = vec![false; got.len()];
            for e in here.iter() {
                // The runtime call ran between the allocator's `t0` and `t`: a slow one (20 MiB
                // of fresh pages on a loaded machine) starts well before the step is logged.
                let t = e.t.unwrap();
                let t0 = e.t0.unwrap_or(t);
                let off = |ts: u64| if ts < t0 { t0 - ts } else { ts.saturating_sub(t) };
                let (i, r) = got
                    .iter()
                    .enumerate()
                    .filter(|(i, r)| !used[*i] && off(r.ts) <= CLOCK_TOLERANCE_NS)
                    .min_by_key(|(_, r)| off(r.ts))
                    .unwrap_or_else(|| panic!("no {name} {event} row for segment event {e:?}"));
                used[i] = true;
                assert_eq!(r.device, e.device.to_string(), "{r:?} {e:?}");
                assert_eq!(r.attr_u64(size_key), e.size, "segment size ({size_key}): {r:?} {e:?}");
            }
        }
    }
}

/// A pool's reserved bytes are device memory, so they never exceed the device's live driver
/// bytes at the same moment.
pub fn assert_pta_within_hal(out: &Output) {
    for (folder, (_, rows)) in &out.files {
        let mut hal_used = 0u64;
        let mut ordered: Vec<&DbRow> = rows.iter().collect();
        ordered.sort_by_key(|r| (r.ts, r.id));
        for r in ordered {
            if r.event_type == "HAL" && (r.event == "MALLOC" || r.event == "FREE") {
                hal_used = r.attr_u64("used").unwrap_or(hal_used);
            }
            if r.event_type == "PTA" && !r.is_shadow() {
                let total = r.attr_u64("total").unwrap();
                assert!(total <= hal_used, "{folder}: PTA total {total} > HAL bytes {hal_used} at {r:?}");
            }
        }
    }
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

/// Launches a workload script from tests/workloads (`script`) on the stand-in torch_npu under
/// `trace --lib <torch>`, with `--torch-lib` and `--ledger` (a file in the scratch folder named
/// `ledger`), the markers on PYTHONPATH and the allocator's ledger next to it; waits for both to
/// exit successfully. Returns the output and the ledger's path.
pub fn trace_standin_script(env: &TestEnv, script: &str, ledger: &str) -> (Output, PathBuf) {
    trace_standin_run(env, script, ledger, "out", &[], &[])
}

/// As [`trace_standin_script`], into `env.scratch/<out>`, with `extra` arguments for the script
/// and `vars` set in its environment.
pub fn trace_standin_run(
    env: &TestEnv,
    script: &str,
    ledger: &str,
    out: &str,
    extra: &[&str],
    vars: &[(&str, &str)],
) -> (Output, PathBuf) {
    let job_env: Vec<(&str, Option<&str>)> = vars.iter().map(|(k, v)| (*k, Some(*v))).collect();
    trace_standin_run_with(env, script, ledger, out, extra, &[], &job_env)
}

/// As [`trace_standin_run`], also probing `libs` from the start (`--lib`), and with the job's
/// environment changed: `Some` sets a variable, `None` removes it.
pub fn trace_standin_run_with(
    env: &TestEnv,
    script: &str,
    ledger: &str,
    out: &str,
    extra: &[&str],
    libs: &[&Path],
    job_env: &[(&str, Option<&str>)],
) -> (Output, PathBuf) {
    let torch = var("MEMSCOPE_TORCH_WITH_DEBUG");
    let markers = var("MEMSCOPE_MARKERS");
    let workload = var("MEMSCOPE_TAGS_WORKLOAD").with_file_name(script);
    let ledger = env.scratch.join(ledger);
    let pool = pool_ledger_path(&ledger);
    let out = env.scratch.join(out);
    let (out_s, torch_s, ledger_s, workload_s) = (
        out.display().to_string(),
        torch.display().to_string(),
        ledger.display().to_string(),
        workload.display().to_string(),
    );
    let lib_args: Vec<String> = libs.iter().map(|l| l.display().to_string()).collect();
    let mut args = vec!["trace", "--output", &out_s, "--lib", &torch_s];
    for lib in &lib_args {
        args.extend(["--lib", lib.as_str()]);
    }
    args.extend(["--", "python3", &workload_s, "--torch-lib", &torch_s, "--ledger", &ledger_s]);
    args.extend_from_slice(extra);
    let mut vars: Vec<(&str, Option<&std::ffi::OsStr>)> = vec![
        ("ASCEND_HOME_PATH", Some(env.ascend_home.as_os_str())),
        ("PYTHONPATH", Some(markers.as_os_str())),
        ("STANDIN_TORCH_LEDGER", Some(pool.as_os_str())),
    ];
    vars.extend(job_env.iter().map(|(k, v)| (*k, v.map(std::ffi::OsStr::new))));
    let (code, stderr) = Tracer::spawn_with(env, &args, &vars).finish(Duration::from_secs(120));
    assert_eq!(code, Some(0), "{stderr}");
    (read_output(&out), ledger)
}

/// The torch venv's python and the markers package built for it, or None after saying why.
pub fn real_torch() -> Option<(PathBuf, PathBuf)> {
    match (std::env::var_os("MEMSCOPE_REAL_TORCH_PYTHON"), std::env::var_os("MEMSCOPE_MARKERS_TORCH")) {
        (Some(python), Some(markers)) if Path::new(&python).is_file() => {
            Some((PathBuf::from(python), PathBuf::from(markers)))
        }
        _ => {
            let why = std::env::var("MEMSCOPE_REAL_TORCH_MISSING").unwrap_or_else(|_| "not set up".into());
            eprintln!("SKIPPED: no real PyTorch ({why}); `cargo xtask test` prepares target/torch-venv");
            None
        }
    }
}

/// Waits for a workload to write `path` (non-empty) and returns its text; fails if the workload
/// exits first or `timeout` passes.
pub fn wait_for_file(path: &Path, child: &mut Child, timeout: Duration) -> String {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(text) = std::fs::read_to_string(path) {
            if !text.is_empty() {
                return text;
            }
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("workload exited ({status}) before writing {}", path.display());
        }
        assert!(Instant::now() < deadline, "no {} after {timeout:?}", path.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `memscope-bpf advise OUT --json --device 0`, as a user runs it on a trace's folder: the advice
/// for device 0.
pub fn advise_device0(env: &TestEnv, out: &Output) -> serde_json::Value {
    let dir = out.run_dir.to_str().unwrap();
    let run = Command::new(&env.bin).args(["advise", dir, "--json", "--device", "0"]).output().unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let all: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    all.as_array().expect("one element per DB")[0].clone()
}

/// The recommendation `id` of an advice, if given.
pub fn recommendation<'a>(advice: &'a serde_json::Value, id: &str) -> Option<&'a serde_json::Value> {
    advice["recommendations"].as_array()?.iter().find(|r| r["id"] == id)
}

// ---------------------------------------------------------------- MindStudio Insight's import rules

/// Event Types Insight's decomposition request accepts (its `MemScopeDefs.h`), plus `HOST`
/// (CPU tensors, as msMemScope writes them): Insight imports `HOST` blocks into its curve but its
/// decomposition view rejects the type, so a file's `HOST` rows are shown there as nothing.
pub const INSIGHT_BLOCK_TYPES: [&str; 7] = ["PTA", "MINDSPORE", "ATB", "HAL", "PTA_WORKSPACE", "HOST_PINNED", "HOST"];

/// Block types whose MALLOC Insight's decomposition tree needs an `owner` for.
const OWNED_TYPES: [&str; 4] = ["HAL", "PTA", "PTA_WORKSPACE", "HOST_PINNED"];

/// The user and group that should own a run's files: `SUDO_UID`/`SUDO_GID` when the tests (and
/// so the tracers they start) run under sudo, else the tests' own.
pub fn expected_owner() -> (u32, u32) {
    let id = |name| std::env::var(name).ok().and_then(|v| v.parse::<u32>().ok());
    match (id("SUDO_UID"), id("SUDO_GID")) {
        (Some(uid), Some(gid)) => (uid, gid),
        // SAFETY: no arguments.
        _ => unsafe { (libc::geteuid(), libc::getegid()) },
    }
}

/// Whether `name` is what Insight's importer looks for: `^(memscope|leaks)_dump_\d+\.db$`.
pub fn insight_file_name(name: &str) -> bool {
    let digits = name.strip_prefix("memscope_dump_").or_else(|| name.strip_prefix("leaks_dump_"));
    digits.and_then(|d| d.strip_suffix(".db")).is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
}

/// Mode and owner of a file or folder of a run: 0600 files, 0700 folders, never world-writable,
/// owned by `owner`.
pub fn assert_private(path: &Path, owner: (u32, u32)) {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mode = m.mode() & 0o7777;
    let want = if m.is_dir() { 0o700 } else { 0o600 };
    assert_eq!(mode, want, "{} has mode {mode:o}, not {want:o}", path.display());
    assert_eq!(mode & 0o002, 0, "{} is world-writable", path.display());
    assert_eq!((m.uid(), m.gid()), owner, "{} is not owned by the expected user", path.display());
}

/// Applies MindStudio Insight's import rules (shared/reference/stacks-daemon-exports.md §6: its
/// MemScope parser and database code) to one DB the tracer wrote, expecting `owner` to own it.
pub fn insight_rules_for(db: &Path, owner: (u32, u32)) {
    let shown = db.display();
    let name = db.file_name().unwrap().to_string_lossy();
    assert!(insight_file_name(&name), "Insight does not import a file named {name}");
    // The file, every file beside it (-wal, -shm), its dump/ and device_<id>/ folders.
    let dir = db.parent().unwrap();
    for entry in std::fs::read_dir(dir).unwrap() {
        assert_private(&entry.unwrap().path(), owner);
    }
    for folder in db.ancestors().skip(1).take(3) {
        assert_private(folder, owner);
    }
    let conn = rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
    // The tracer writes memscope_dump's B-tree pages itself: SQLite's own check of the file's
    // structure (every page, key order, free space, freelist) must find nothing.
    let integrity: Vec<String> = conn
        .prepare("PRAGMA integrity_check")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(integrity, ["ok"], "{shown}: SQLite finds the file damaged");
    let columns: Vec<String> = conn
        .prepare("SELECT name FROM pragma_table_info('memscope_dump') ORDER BY cid")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(columns, CSV_HEADER.split(',').collect::<Vec<_>>(), "{shown}: Insight reads the columns by position");
    let rows = read_db(db, "") /* every Attr value a string, or it panics */;
    // Insight reads only rows with a device.
    let placed: Vec<&DbRow> = rows.iter().filter(|r| !matches!(r.device.as_str(), "N/A" | "" | "host")).collect();
    assert!(
        placed.iter().any(|r| r.device.parse::<u32>().is_ok() || r.device == "cpu"),
        "{shown}: no row with a device (Insight: \"No memory events could be found\")"
    );
    let (min, max) = (placed.iter().map(|r| r.ts).min().unwrap(), placed.iter().map(|r| r.ts).max().unwrap());
    assert!(min > 0 && max > min, "{shown}: timestamps {min}..{max}");
    let mut mallocs: HashMap<&str, &DbRow> = HashMap::new();
    for r in rows.iter().filter(|r| r.event == "MALLOC" || r.event == "FREE") {
        assert!(INSIGHT_BLOCK_TYPES.contains(&r.event_type.as_str()), "{shown}: Event Type Insight rejects: {r:?}");
        assert!(r.attr_u64("size").is_some_and(|s| s > 0), "{shown}: Insight skips a block of no size: {r:?}");
        if r.event == "MALLOC" {
            let id = r.attr.get("allocation_id").unwrap_or_else(|| panic!("{shown}: MALLOC without id: {r:?}"));
            if let Some(other) = mallocs.insert(id, r) {
                panic!("{shown}: allocation_id {id} names two blocks (Insight merges them):\n  {other:?}\n  {r:?}");
            }
            if OWNED_TYPES.contains(&r.event_type.as_str()) {
                assert!(
                    r.attr.get("owner").is_some_and(|o| !o.is_empty()),
                    "{shown}: the decomposition tree leaves out a block without an owner: {r:?}"
                );
            }
        }
    }
    let named = |r: &DbRow, key: &str| -> Option<u64> { r.attr.get(key).map(|_| r.attr_u64(key).unwrap()) };
    for r in &rows {
        let listing = matches!(r.event_type.as_str(), "OOM_RECENT_ALLOC" | "OOM_TOP_ALLOC");
        if !(r.event == "FREE" || r.event == "ACCESS" || listing) {
            continue;
        }
        let id = r.attr.get("allocation_id").unwrap_or_else(|| panic!("{shown}: no allocation_id: {r:?}"));
        let m = mallocs.get(id.as_str()).unwrap_or_else(|| panic!("{shown}: allocation_id {id} has no MALLOC: {r:?}"));
        let block = match r.event.as_str() {
            "FREE" => {
                assert_eq!(r.event_type, m.event_type, "{shown}: FREE and MALLOC of another type: {r:?} {m:?}");
                r.ptr_value()
            }
            "ACCESS" => named(r, "block"),
            _ => named(r, "ptr"),
        };
        assert_eq!(block, m.ptr_value(), "{shown}: {r:?} names another block than its MALLOC {m:?}");
    }
}

/// The frees of blocks from before the trace that the tracer's summary counts, all devices.
pub fn summary_untracked_frees(stderr: &str) -> u64 {
    stderr
        .lines()
        .filter_map(|l| l.trim().split_once(" of the frees were of blocks allocated before the trace"))
        .map(|(n, _)| n.parse::<u64>().unwrap())
        .sum()
}

/// [`insight_rules_for`] with the owner the tests expect ([`expected_owner`]).
pub fn insight_rules(db: &Path) {
    insight_rules_for(db, expected_owner());
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
