//! msMemScope-shaped captures written from msMemScope's documented formats
//! (../shared/reference/msmemscope-and-insight.md §2-3), with the ledger of what each holds.
//!
//! A scenario is a list of events in time order: a caching pool's driver segment, weights, and
//! steps of operators whose outputs are freed at the step's end, and optionally an inserted
//! operator whose 4 MiB output is never freed (the leak). The ledger (what is live at the end,
//! by owner; which blocks leaked and in which step they were born; each trace's operator
//! sequence with its memory deltas) is computed here from the events, never by the code under
//! test. The writers lay the events out as msMemScope does: rows of a block written when it is
//! freed (so out of time order), shadow frees for blocks live at the stop, the bare `{k:v}` Attr
//! or JSON, `0x` or decimal pointers, quoted multi-line stacks, `N/A` ids.

#![allow(dead_code, reason = "each test binary uses a part of the corpus")]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

pub const MIB: u64 = 1 << 20;
pub const PID: i64 = 4242;
pub const LEAK_OP: &str = "aten.randn.default";
pub const LEAK_BYTES: u64 = 4 * MIB;
const POOL_BASE: u64 = 0x12c0_0000_0000;
const SEGMENT: u64 = 256 * MIB;

#[derive(Clone, Debug)]
pub struct Event {
    pub id: u64,
    pub event: &'static str,
    pub kind: &'static str,
    pub name: String,
    pub ts: i64,
    pub device: &'static str,
    pub ptr: Option<u64>,
    /// Attr pairs in order (values as text).
    pub attr: Vec<(&'static str, String)>,
    /// The block a MALLOC/ACCESS/FREE belongs to (its allocation id).
    pub block: Option<u64>,
    pub py_stack: String,
}

/// A trace's events and its ledger.
#[derive(Clone, Debug, Default)]
pub struct Trace {
    pub events: Vec<Event>,
    /// PTA bytes live at the end, by owner.
    pub end_by_owner: BTreeMap<String, u64>,
    /// The leaked blocks: (address, step born in).
    pub leaked: Vec<(u64, u64)>,
    /// The operator calls in order, with the size of the PTA block each one's output took.
    pub ops: Vec<(String, u64)>,
    /// The kernels launched, in order.
    pub kernels: Vec<String>,
    /// The bytes each failed allocation (OOM_TRIGGER) asked for.
    pub oom_requests: Vec<u64>,
    pub steps: u64,
}

struct Builder {
    t: Trace,
    next_id: u64,
    ts: i64,
    next_addr: u64,
    used: u64,
    /// Live blocks: allocation id -> (address, size, owner, event type, device).
    live: BTreeMap<u64, (u64, u64, String, &'static str, &'static str)>,
    next_alloc: u64,
}

impl Builder {
    fn push(
        &mut self,
        event: &'static str,
        kind: &'static str,
        name: &str,
        device: &'static str,
        attr: Vec<(&'static str, String)>,
        // The address and allocation id of a block's row.
        mem: Option<(u64, u64)>,
    ) {
        let (ptr, block) = (mem.map(|m| m.0), mem.map(|m| m.1));
        self.ts += 1000;
        self.next_id += 1;
        let py_stack = if event == "MALLOC" {
            format!("\"train.py({}): step\nmodel.py(7): forward\"", 10 + self.next_id % 5)
        } else {
            "NA".to_owned()
        };
        self.t.events.push(Event {
            id: self.next_id,
            event,
            kind,
            name: name.to_owned(),
            ts: self.ts,
            device,
            ptr,
            attr,
            block,
            py_stack,
        });
    }

    fn malloc(&mut self, kind: &'static str, device: &'static str, size: u64, owner: &str) -> u64 {
        let addr = if kind == "HAL" { POOL_BASE } else { self.next_addr };
        if kind != "HAL" {
            self.next_addr += size.next_multiple_of(512);
        }
        self.next_alloc += 1;
        let alloc = self.next_alloc;
        let mut attr =
            vec![("allocation_id", alloc.to_string()), ("addr", format!("0x{addr:016x}")), ("size", size.to_string())];
        if kind == "PTA" {
            self.used += size;
            attr.push(("total", SEGMENT.to_string()));
            attr.push(("used", self.used.to_string()));
        }
        if !owner.is_empty() {
            attr.push(("owner", owner.to_owned()));
        }
        if kind == "HAL" {
            attr.push(("page_type", "huge".into()));
            attr.push(("alloc_type", "alloc".into()));
        }
        self.push("MALLOC", kind, "N/A", device, attr, Some((addr, alloc)));
        self.live.insert(alloc, (addr, size, owner.to_owned(), kind, device));
        alloc
    }

    fn free(&mut self, alloc: u64, shadow: bool) {
        let (addr, size, _, kind, device) = self.live.remove(&alloc).expect("a live block");
        let mut attr =
            vec![("allocation_id", alloc.to_string()), ("addr", format!("0x{addr:016x}")), ("size", size.to_string())];
        if shadow {
            attr.push(("shadow", "true".into()));
        } else if kind == "PTA" {
            self.used -= size;
            attr.push(("total", SEGMENT.to_string()));
            attr.push(("used", self.used.to_string()));
        }
        self.push("FREE", kind, "N/A", device, attr, Some((addr, alloc)));
    }

    fn access(&mut self, alloc: u64) {
        let (addr, size, ..) = self.live[&alloc].clone();
        let attr = vec![
            ("allocation_id", alloc.to_string()),
            ("addr", format!("0x{addr:016x}")),
            ("size", size.to_string()),
            ("type", "PTA".into()),
            ("dtype", "torch.float16".into()),
            ("shape", "torch.Size([512, 1024])".into()),
        ];
        self.push("ACCESS", "READ", "aten.linear.default", "0", attr, Some((addr, alloc)));
    }

    fn op(&mut self, name: &str, size: u64) -> u64 {
        self.push("OP_LAUNCH", "ATEN_START", name, "0", Vec::new(), None);
        let kernel = format!("{}_kernel", name.split('.').nth(1).unwrap_or(name));
        let task = (self.t.kernels.len() + 1).to_string();
        self.push(
            "KERNEL_LAUNCH",
            "KERNEL_LAUNCH",
            &kernel,
            "0",
            vec![("streamId", "2".into()), ("taskId", task)],
            None,
        );
        self.t.kernels.push(kernel);
        self.push("OP_LAUNCH", "ATEN_END", name, "0", Vec::new(), None);
        self.t.ops.push((name.to_owned(), size));
        self.malloc("PTA", "0", size, "PTA@ops@aten")
    }
}

/// A training job of `steps` steps; with `leak`, each step also runs [`LEAK_OP`], whose output
/// is never freed.
pub fn training(steps: u64, leak: bool) -> Trace {
    let mut b = Builder {
        t: Trace { steps, ..Trace::default() },
        next_id: 0,
        ts: 1_700_000_000_000_000_000,
        next_addr: POOL_BASE,
        used: 0,
        live: BTreeMap::new(),
        next_alloc: 0,
    };
    b.push("SYSTEM", "ACL_INIT", "N/A", "N/A", Vec::new(), None);
    b.push(
        "SYSTEM",
        "START_TRACE",
        "N/A",
        "0",
        vec![("free", (60 * 1024 * MIB).to_string()), ("total", (64 * 1024 * MIB).to_string())],
        None,
    );
    b.malloc("HAL", "0", SEGMENT, "CANN@APP");
    for _ in 0..2 {
        b.malloc("PTA", "0", 8 * MIB, "PTA@model@weight");
    }
    let host = b.malloc("HOST", "cpu", MIB, "");
    for step in 1..=steps {
        b.push("MSTX", "Range_start", "\"step start\"", "0", Vec::new(), None);
        let linear = b.op("aten.linear.default", MIB);
        b.access(linear);
        if leak {
            let leaked = b.op(LEAK_OP, LEAK_BYTES);
            b.t.leaked.push((b.live[&leaked].0, step));
        }
        let relu = b.op("aten.relu.default", 2 * MIB);
        b.free(linear, false);
        b.free(relu, false);
        let range_end = format!("Range end from id {step}");
        b.push("MSTX", "Range_end", &range_end, "0", Vec::new(), None);
    }
    b.free(host, false);
    if leak {
        // The job then asks for more than the device has left: the driver refuses.
        let ask = 30 * 1024 * MIB;
        let attr = vec![
            ("func", "halMemAlloc".into()),
            ("req_size", ask.to_string()),
            ("flag", "0".into()),
            ("ret", "207001".into()),
        ];
        b.push("OOM_DETAIL", "OOM_TRIGGER", "N/A", "0", attr, None);
        b.t.oom_requests.push(ask);
    }
    for (owner, size) in b.live.values().filter(|v| v.3 == "PTA").map(|v| (v.2.clone(), v.1)).collect::<Vec<_>>() {
        *b.t.end_by_owner.entry(owner).or_default() += size;
    }
    // msMemScope's stop: a shadow FREE for every live block, then STOP_TRACE.
    for alloc in b.live.keys().copied().collect::<Vec<_>>() {
        b.free(alloc, true);
    }
    b.push("SYSTEM", "STOP_TRACE", "N/A", "N/A", Vec::new(), None);
    b.t
}

/// How a capture's Attr and pointers are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Style {
    /// msMemScope's CSV: bare `{k:v}` Attr in quotes, `0x` pointers, both stack columns, rows of a
    /// block written at its free.
    Bare,
    /// JSON Attr (CSV-quoted), decimal pointers, no stack columns, time order, a BOM, CRLF.
    Json,
}

/// The events of one device (`0` or `cpu`; events with no device go to every file) in the
/// order msMemScope writes them: a block's rows when it is freed, the rest as they happen.
pub fn written_order<'e>(trace: &'e Trace, device: &str, as_msmemscope: bool) -> Vec<&'e Event> {
    let mine: Vec<&Event> = trace.events.iter().filter(|e| e.device == device || e.device == "N/A").collect();
    if !as_msmemscope {
        return mine;
    }
    let mut out = Vec::new();
    let mut held: BTreeMap<u64, Vec<&Event>> = BTreeMap::new();
    for e in mine {
        match (e.event, e.block) {
            ("MALLOC" | "ACCESS", Some(b)) => held.entry(b).or_default().push(e),
            ("FREE", Some(b)) => {
                out.extend(held.remove(&b).unwrap_or_default());
                out.push(e);
            }
            _ => out.push(e),
        }
    }
    out
}

fn ptr_text(e: &Event, style: Style) -> String {
    match (e.ptr, style) {
        (None, _) => "N/A".to_owned(),
        (Some(p), Style::Bare) => format!("0x{p:016x}"),
        (Some(p), Style::Json) => p.to_string(),
    }
}

fn csv_quote(text: &str) -> String {
    format!("\"{}\"", text.replace('"', "\"\""))
}

/// The Attr as JSON with string values (msMemScope's DB form).
pub fn attr_json(e: &Event) -> String {
    if e.attr.is_empty() {
        return String::new();
    }
    let pairs: Vec<String> = e
        .attr
        .iter()
        .map(|(k, v)| format!("{}:{}", serde_json::Value::from(*k), serde_json::Value::from(v.as_str())))
        .collect();
    format!("{{{}}}", pairs.join(","))
}

/// One device's dump CSV in `style`.
pub fn csv(trace: &Trace, device: &str, style: Style) -> String {
    let mut out = String::new();
    let nl = if style == Style::Json { "\r\n" } else { "\n" };
    if style == Style::Json {
        out.push('\u{feff}');
        out.push_str("ID,Event,Event Type,Name,Timestamp(ns),Process Id,Thread Id,Device Id,Ptr,Attr");
    } else {
        out.push_str("ID,Event,Event Type,Name,Timestamp(ns),Process Id,Thread Id,Device Id,Ptr,Attr,Call Stack(Python),Call Stack(C)");
    }
    out.push_str(nl);
    for e in written_order(trace, device, style == Style::Bare) {
        let (pid, tid) = if e.event == "SYSTEM" && e.kind == "ACL_INIT" {
            ("N/A".to_owned(), "N/A".to_owned())
        } else {
            (PID.to_string(), (PID + 1).to_string())
        };
        let attr = match style {
            // msMemScope puts the quotes into the text itself.
            Style::Bare if !e.attr.is_empty() => {
                format!("\"{{{}}}\"", e.attr.iter().map(|(k, v)| format!("{k}:{v}")).collect::<Vec<_>>().join(","))
            }
            Style::Bare => String::new(),
            Style::Json => {
                let json = attr_json(e);
                if json.is_empty() {
                    json
                } else {
                    csv_quote(&json)
                }
            }
        };
        let _ = write!(
            out,
            "{},{},{},{},{},{pid},{tid},{},{},{attr}",
            e.id,
            e.event,
            e.kind,
            e.name,
            e.ts,
            e.device,
            ptr_text(e, style)
        );
        if style == Style::Bare {
            let c = if e.event == "MALLOC" {
                "\"libtorch_npu.so(_ZN3c10malloc+0x1c) [0x7f00]\nlibc.so.6(__libc_start_main+0x80) [0x7f10]\""
            } else {
                ""
            };
            let _ = write!(out, ",{},{c}", e.py_stack);
        }
        out.push_str(nl);
    }
    out
}

/// One device's msMemScope DB: `table` (`memscope_dump` or msLeaks' `leaks_dump`) with the Attr
/// as its `FixJson` writes it, and, with `insight`, the tables Insight adds when it opens one.
pub fn db(trace: &Trace, device: &str, path: &Path, table: &str, decimal: bool, insight: bool) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let _ = std::fs::remove_file(path);
    let conn = rusqlite::Connection::open(path).unwrap();
    conn.execute_batch(&format!(
        "CREATE TABLE {table} (\"ID\" INTEGER, \"Event\" TEXT, \"Event Type\" TEXT, \"Name\" TEXT, \"Timestamp(ns)\" INTEGER, \
         \"Process Id\" INTEGER, \"Thread Id\" INTEGER, \"Device Id\" TEXT, \"Ptr\" TEXT, \"Attr\" TEXT, \"Call Stack(Python)\" TEXT, \"Call Stack(C)\" TEXT);"
    ))
    .unwrap();
    if insight {
        conn.execute_batch(
            "CREATE TABLE memory_allocation (id INTEGER PRIMARY KEY AUTOINCREMENT, timestamp INTEGER, totalSize INTEGER, optimized INTEGER, deviceId TEXT, eventType TEXT);
             CREATE TABLE memory_block (id INTEGER, deviceId TEXT, addr TEXT, size INTEGER, startTimestamp INTEGER, endTimestamp INTEGER, eventType TEXT, owner TEXT, attr TEXT, processId INTEGER, threadId INTEGER, firstAccessTimestamp INTEGER, lastAccessTimestamp INTEGER, maxAccessInterval INTEGER);
             CREATE TABLE status_info (key TEXT, value TEXT);
             INSERT INTO status_info VALUES ('MEM_SCOPE_PARSE_STATUS', 'done');",
        )
        .unwrap();
    }
    let sql = format!("INSERT INTO {table} VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)");
    for e in written_order(trace, device, true) {
        let ptr = match (e.ptr, decimal) {
            (None, _) => "N/A".to_owned(),
            (Some(p), true) => p.to_string(),
            (Some(p), false) => format!("0x{p:016x}"),
        };
        conn.execute(
            &sql,
            rusqlite::params![
                e.id as i64,
                e.event,
                e.kind,
                e.name,
                e.ts,
                PID,
                PID + 1,
                e.device,
                ptr,
                attr_json(e),
                e.py_stack,
                ""
            ],
        )
        .unwrap();
    }
}

/// A capture laid out as msMemScope lays it out, in CSV: `<root>/msmemscope_<pid>_<time>_ascend/`
/// with `device_0/` and `device_cpu/`, a Python trace CSV beside the dump (no trace of its own),
/// the config and the log folder. Returns the run folder.
pub fn layout(root: &Path, trace: &Trace, stamp: &str) -> PathBuf {
    let run = root.join(format!("msmemscope_{PID}_{stamp}_ascend"));
    for device in ["0", "cpu"] {
        let dump = run.join(format!("device_{device}/dump"));
        std::fs::create_dir_all(&dump).unwrap();
        std::fs::write(dump.join(format!("memscope_dump_{stamp}.csv")), csv(trace, device, Style::Bare)).unwrap();
    }
    let dump = run.join("device_0/dump");
    std::fs::write(
        dump.join(format!("python_trace_{PID}_{stamp}.csv")),
        "FuncInfo,StartTime(ns),EndTime(ns),Thread Id,Process Id\nmain,1,2,3,4\n",
    )
    .unwrap();
    std::fs::create_dir_all(run.join("msmemscope_logs")).unwrap();
    std::fs::write(run.join(format!("msmemscope_logs/msmemscope_{stamp}.log")), "info\n").unwrap();
    std::fs::write(run.join("config.json"), "{\"analysis\":\"leaks\"}\n").unwrap();
    run
}

/// msLeaks' early CSV (`leaks_dump_<secs>.csv`): every device in one file, timestamps in µs
/// (the header says ns), decimal pointers, no stack columns, `acl init` for the runtime's start.
/// `traces` are (device, trace) pairs; their rows are written one device after the other.
pub fn legacy_csv(traces: &[(&str, &Trace)]) -> String {
    let mut out = String::from("ID,Event,Event Type,Name,Timestamp(ns),Process Id,Thread Id,Device Id,Ptr,Attr\n");
    let mut id = 0;
    for (n, (device, trace)) in traces.iter().enumerate() {
        for e in written_order(trace, "0", true) {
            let system = e.event == "SYSTEM";
            if system && n > 0 {
                continue; // the process's rows of no device, once
            }
            id += 1;
            let kind = if e.kind == "ACL_INIT" { "acl init" } else { e.kind };
            let dev = if e.device == "N/A" { "N/A" } else { device };
            let ptr = e.ptr.map_or_else(|| "N/A".to_owned(), |p| p.to_string());
            let attr = if e.attr.is_empty() {
                String::new()
            } else {
                format!("\"{{{}}}\"", e.attr.iter().map(|(k, v)| format!("{k}:{v}")).collect::<Vec<_>>().join(","))
            };
            let _ = writeln!(out, "{id},{},{kind},{},{},{PID},{PID},{dev},{ptr},{attr}", e.event, e.name, e.ts / 1000);
        }
    }
    out
}
