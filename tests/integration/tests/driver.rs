//! The driver's own figures (`trace --driver-every`), read through the stand-in DCMI (Ascend)
//! and NVML (NVIDIA), which answer from what the stand-in drivers charged each live process,
//! driven by tests/workloads/standin_driver.py. The stand-in drivers also charge a context when
//! a device is first used, through no call the tracer probes: memory nobody else sees.
//!
//! Ground truth: the stand-in driver's ledger (every charge, the context included, with its
//! time) and the workload's (when it held its memory steady). What is checked, per stack:
//! - every reading taken while the job held its memory has, for the job, exactly what the
//!   driver charged it then (`ms_driver.process_used`), and the device's total;
//! - `START_TRACE` carries the device's total and free memory as the driver said (set at the
//!   output's creation after an attach, and after the fact for a launched job);
//! - `analyze --analysis unexplained` finds, at each of those readings, exactly the context's
//!   bytes unexplained, also once everything traced is freed;
//! - device memory rows after the first reading carry msMemScope's `process_used`;
//! - memory the communication library took itself (the stand-in HCCL's or NCCL's buffers, logged
//!   by the library) is that library's (`CANN@HCCL`, `CUDA@NCCL`, `HOST@...`), known from where
//!   its calls came from, while the job's own calls to the same APIs keep the allocator's owner.

use std::path::{Path, PathBuf};
use std::time::Duration;

use memscope_integration::*;
use serde::Deserialize;

const MIB: u64 = 1 << 20;
/// The stand-in driver's context per device.
const CONTEXT: u64 = 48 * MIB;
/// The stand-in devices' memory: a whole number of MB, as DCMI reports it.
const DEVICE_MEM: u64 = 2048 * MIB;

/// A charge or refund the stand-in driver logged (both stacks' ledgers have these keys).
#[derive(Debug, Deserialize)]
struct Charge {
    api: String,
    size: u64,
    rc: i64,
    device: i64,
    t1: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stack {
    Npu,
    Cuda,
}

struct Run {
    out: Output,
    /// The workload's own ledger.
    workload: Vec<serde_json::Value>,
    charges: Vec<Charge>,
    /// (hold name, t0, t1) on device 0.
    holds: Vec<(String, u64, u64)>,
    /// What the communication library logged of the memory it took and gave back.
    comm: Vec<serde_json::Value>,
    bin: PathBuf,
    stderr: String,
}

fn lines<T: for<'de> Deserialize<'de>>(path: &Path) -> Vec<T> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

/// Bytes the driver charged the job on device 0 up to `ts`.
fn charged_at(run: &Run, ts: u64, stack: Stack) -> u64 {
    let (takes, gives): (&[&str], &[&str]) = match stack {
        Stack::Npu => (&["halMemAlloc", "halMemCreate", "context"], &["halMemFree", "halMemRelease"]),
        Stack::Cuda => (&["cuMemAlloc_v2", "cuMemCreate", "context"], &["cuMemFree_v2", "cuMemRelease"]),
    };
    let mut bytes: i64 = 0;
    for c in run.charges.iter().filter(|c| c.rc == 0 && c.device == 0 && c.t1 <= ts) {
        if takes.contains(&c.api.as_str()) {
            bytes += c.size as i64;
        } else if gives.contains(&c.api.as_str()) {
            bytes -= c.size as i64;
        }
    }
    bytes as u64
}

/// The readings of device 0 for the job: (ts, process_used, device_total).
fn readings(run: &Run) -> Vec<(u64, u64, u64)> {
    let (path, _) = &run.out.files["device_0"];
    let db = rusqlite::Connection::open(path).unwrap();
    let mut stmt = db
        .prepare("SELECT ts_ns, process_used, device_total FROM ms_driver WHERE pid IS NOT NULL ORDER BY ts_ns")
        .unwrap();
    stmt.query_map([], |r| Ok((r.get::<_, i64>(0)? as u64, r.get::<_, i64>(1)? as u64, r.get::<_, i64>(2)? as u64)))
        .unwrap()
        .map(Result::unwrap)
        .collect()
}

/// The hold a reading fell in, well inside it (the driver's state is steady there).
fn hold_of(run: &Run, ts: u64) -> Option<&str> {
    run.holds
        .iter()
        .find(|(_, t0, t1)| ts > t0 + CLOCK_TOLERANCE_NS && ts + CLOCK_TOLERANCE_NS < *t1)
        .map(|h| h.0.as_str())
}

/// Starts the job, attaches to it once its libraries are loaded, then lets it go.
fn attached(env: &TestEnv, job: &[&str], vars: &[(&str, Option<&std::ffi::OsStr>)], out: &str) -> String {
    let (ready, go) = (env.scratch.join("ready"), env.scratch.join("go"));
    let mut cmd = std::process::Command::new(job[0]);
    cmd.args(&job[1..]).arg("--ready-file").arg(&ready).arg("--go-file").arg(&go);
    for (k, v) in vars {
        if let Some(v) = v {
            cmd.env(k, v);
        }
    }
    let mut child = cmd.spawn().expect("start the job");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !ready.exists() {
        assert!(std::time::Instant::now() < deadline, "the job never loaded its libraries");
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid = child.id().to_string();
    // The tracer's environment has the stand-in node's device size too, for the management
    // library's answers before the job has set its device.
    let args = ["trace", "--pid", &pid, "--output", out, "--driver-every", "100ms"];
    let mut tracer = Tracer::spawn_with(env, &args, vars);
    tracer.wait_live(Duration::from_secs(30));
    std::fs::write(&go, "").unwrap();
    assert_eq!(wait_child(&mut child, Duration::from_secs(60)), 0);
    let (code, stderr) = tracer.finish(Duration::from_secs(30));
    assert_eq!(code, Some(0), "{stderr}");
    stderr
}

fn trace(stack: Stack) -> Run {
    let env = env(match stack {
        Stack::Npu => "driver_npu",
        Stack::Cuda => "driver_cuda",
    });
    let s = |p: &Path| p.display().to_string();
    let workload = env.workload.with_file_name("standin_driver.py");
    let (out, ledger, driver) =
        (env.scratch.join("out"), env.scratch.join("workload.jsonl"), env.scratch.join("driver.jsonl"));
    let comm = env.scratch.join("comm.jsonl");
    let (out_s, ledger_s, workload_s) = (s(&out), s(&ledger), s(&workload));
    let context = CONTEXT.to_string();
    let mem = format!("{}M", DEVICE_MEM / MIB);
    let mut job = vec!["python3", &workload_s, "--ledger", &ledger_s, "--hold-ms", "1200", "--comm"];
    let cuda_lib = s(&var("MEMSCOPE_CUDA_LIB"));
    let (cudart, cuda) = (format!("{cuda_lib}/libcudart.so.12"), format!("{cuda_lib}/libcuda.so.1"));
    let (ledger_var, context_var, mem_var) = match stack {
        Stack::Npu => {
            job.extend(["--stack", "npu"]);
            ("STANDIN_HAL_LEDGER", "STANDIN_HAL_CONTEXT_MEM", "STANDIN_ACL_DEVICE_MEM")
        }
        Stack::Cuda => {
            job.extend(["--stack", "cuda", "--cuda-lib", &cuda_lib]);
            ("STANDIN_CUDA_LEDGER", "STANDIN_CUDA_CONTEXT_MEM", "STANDIN_CUDA_DEVICE_MEM")
        }
    };
    let vars: Vec<(&str, Option<&std::ffi::OsStr>)> = vec![
        (ledger_var, Some(driver.as_os_str())),
        (context_var, Some(context.as_ref())),
        (mem_var, Some(mem.as_ref())),
        ("ASCEND_HOME_PATH", Some(env.ascend_home.as_os_str())),
        ("STANDIN_COMM_LEDGER", Some(comm.as_os_str())),
        ("HCCL_BUFFSIZE", Some("2".as_ref())),
    ];
    let stderr = match stack {
        // Attached: the first reading comes before the DB exists.
        Stack::Npu => attached(&env, &job, &vars, &out_s),
        // Launched: the job maps its driver after the DB exists.
        Stack::Cuda => {
            // The runtime and driver probed from the start: the job sets its device at once.
            let mut args =
                vec!["trace", "--output", &out_s, "--driver-every", "100ms", "--lib", &cudart, "--lib", &cuda];
            args.push("--");
            args.extend(job);
            let (code, stderr) = Tracer::spawn_with(&env, &args, &vars).finish(Duration::from_secs(120));
            assert_eq!(code, Some(0), "{stderr}");
            stderr
        }
    };
    let workload: Vec<serde_json::Value> = lines(&ledger);
    let holds = workload
        .iter()
        .filter(|l| l["phase"] == "hold" && l["device"] == 0)
        .map(|l| (l["hold"].as_str().unwrap().to_owned(), l["t0"].as_u64().unwrap(), l["t1"].as_u64().unwrap()))
        .collect();
    Run { out: read_output(&out), workload, charges: lines(&driver), holds, comm: lines(&comm), bin: env.bin, stderr }
}

/// Every registration of host memory, and every pinned allocation the job made of the driver, is
/// one pinned host MALLOC row at its address and size, and its end one FREE row there.
fn check_pinned_host(run: &Run, stack: Stack) {
    let (takes, gives): (&[&str], &[&str]) = match stack {
        Stack::Npu => (&["aclrtHostRegisterV2", "aclrtHostRegister"], &["aclrtHostUnregister"]),
        Stack::Cuda => (&["cudaHostRegister", "cuMemHostAlloc"], &["cudaHostUnregister", "cuMemFreeHost"]),
    };
    let calls = |names: &[&str]| -> Vec<(String, u64, u64)> {
        run.workload
            .iter()
            .filter(|l| l["rc"] == 0 && names.contains(&l["api"].as_str().unwrap_or("")))
            .map(|l| (l["api"].as_str().unwrap().to_owned(), l["ptr"].as_u64().unwrap(), l["size"].as_u64().unwrap()))
            .collect()
    };
    let rows: Vec<&DbRow> = run.out.rows().filter(|r| r.event_type == "HOST_PINNED" && !r.is_shadow()).collect();
    let (made, ended) = (calls(takes), calls(gives));
    assert_eq!(made.len(), 2, "{stack:?}: the workload pins two ranges: {:?}", run.workload);
    for (api, ptr, size) in &made {
        let found: Vec<&&DbRow> = rows.iter().filter(|r| r.event == "MALLOC" && r.ptr_value() == Some(*ptr)).collect();
        assert_eq!(found.len(), 1, "{stack:?}: {api} at {ptr:#x}: {rows:#?}");
        assert_eq!((found[0].name.as_str(), found[0].attr_u64("size")), (api.as_str(), Some(*size)), "{:?}", found[0]);
        assert_eq!(found[0].attr.get("pinned").map(String::as_str), Some("true"), "{:?}", found[0]);
    }
    for (api, ptr, _) in &ended {
        let found = rows.iter().filter(|r| r.event == "FREE" && r.ptr_value() == Some(*ptr)).count();
        assert_eq!(found, 1, "{stack:?}: {api} at {ptr:#x}: {rows:#?}");
    }
}

/// The owner of the one MALLOC row at `ptr`.
fn owner_at(run: &Run, ptr: u64, what: &str) -> String {
    let found: Vec<&DbRow> =
        run.out.rows().filter(|r| r.event == "MALLOC" && !r.is_shadow() && r.ptr_value() == Some(ptr)).collect();
    assert_eq!(found.len(), 1, "{what} at {ptr:#x}: {found:#?}");
    found[0].attr.get("owner").cloned().unwrap_or_else(|| panic!("{what}: no owner: {:?}", found[0]))
}

/// Every buffer the communication library took is its own, device and host alike (its calls
/// come from its file); the job's own device buffers, from the same APIs, are not.
fn check_comm(run: &Run, stack: Stack) {
    let (lib, device_root, job_owner) = match stack {
        Stack::Npu => ("HCCL", "CANN", "CANN@APP"),
        Stack::Cuda => ("NCCL", "CUDA", "CUDA@RUNTIME"),
    };
    let takes = ["aclrtMalloc", "aclrtMallocHost", "cuMemAlloc_v2", "cuMemHostAlloc", "ncclMemAlloc"];
    let taken: Vec<&serde_json::Value> =
        run.comm.iter().filter(|l| l["rc"] == 0 && takes.contains(&l["api"].as_str().unwrap_or(""))).collect();
    // Two device buffers and host memory (HCCL); a buffer, host memory and a mapped range (NCCL).
    assert_eq!(taken.len(), 3, "{stack:?}: the library's buffers: {:?}", run.comm);
    for l in taken {
        let root = if l["space"] == "host" { "HOST" } else { device_root };
        let what = format!("{stack:?}: the library's {}", l["api"]);
        assert_eq!(owner_at(run, l["ptr"].as_u64().unwrap(), &what), format!("{root}@{lib}"), "{l}");
    }
    let own = if stack == Stack::Npu { "aclrtMalloc" } else { "cudaMalloc" };
    let mine: Vec<u64> =
        run.workload.iter().filter(|l| l["api"] == own && l["rc"] == 0).filter_map(|l| l["ptr"].as_u64()).collect();
    assert_eq!(mine.len(), 3, "{stack:?}: the job's buffers");
    for ptr in mine {
        assert_eq!(owner_at(run, ptr, &format!("{stack:?}: the job's {own}")), job_owner);
    }
}

fn check(stack: Stack) {
    let run = trace(stack);
    check_pinned_host(&run, stack);
    check_comm(&run, stack);
    assert!(run.stderr.contains("the driver's figures:"), "{}", run.stderr);
    // Every reading in a hold has exactly what the driver charged the job then.
    let readings = readings(&run);
    let mut seen = std::collections::BTreeSet::new();
    for &(ts, used, total) in &readings {
        assert_eq!(total, DEVICE_MEM, "{stack:?}: the device's memory");
        let Some(hold) = hold_of(&run, ts) else { continue };
        assert_eq!(used, charged_at(&run, ts, stack), "{stack:?}: the reading at {ts} (hold {hold})");
        seen.insert(hold.to_owned());
    }
    assert_eq!(seen.len(), 3, "{stack:?}: readings in every hold: {seen:?} of {:?}", run.holds);
    // START_TRACE: the device's memory as the driver said, free no more than total.
    let rows = &run.out.files["device_0"].1;
    let start = rows.iter().find(|r| r.event_type == "START_TRACE").expect("START_TRACE");
    assert_eq!(start.attr_u64("total"), Some(DEVICE_MEM), "{:?}", start.attr);
    // Free as at the driver's first reading: after an attach, before the job's first call.
    let free = start.attr_u64("free").expect("free on START_TRACE");
    let db = rusqlite::Connection::open(&run.out.files["device_0"].0).unwrap();
    let first_used: i64 =
        db.query_row("SELECT device_used FROM ms_driver ORDER BY ts_ns, rowid LIMIT 1", [], |r| r.get(0)).unwrap();
    assert_eq!(free, DEVICE_MEM - first_used as u64, "{stack:?}");
    if stack == Stack::Npu {
        assert_eq!(first_used, 0, "the attach's first reading came before the job's first call");
    }
    // Device memory rows after the first reading carry the driver's figure for the process (the
    // frees at the end are after it).
    let first = readings.first().expect("readings").0;
    let later: Vec<&DbRow> = rows
        .iter()
        .filter(|r| ["MALLOC", "FREE"].contains(&r.event.as_str()) && r.event_type == "HAL" && !r.is_shadow())
        .filter(|r| r.ts > first + 200_000_000)
        .collect();
    assert!(!later.is_empty() && later.iter().all(|r| r.attr.contains_key("process_used")), "{later:#?}");
    // The analysis: exactly the context, unexplained, at every reading in a hold.
    let dir = run.out.run_dir.display().to_string();
    let analyze = std::process::Command::new(&run.bin)
        .args(["analyze", &dir, "--analysis", "unexplained", "--device", "0", "--json"])
        .output()
        .unwrap();
    assert!(analyze.status.success(), "{}", String::from_utf8_lossy(&analyze.stderr));
    let report: serde_json::Value = serde_json::from_slice(&analyze.stdout).unwrap();
    let report = report.as_array().and_then(|a| a.first()).cloned().unwrap_or(report);
    assert_eq!(report["source"], "driver_table", "{report}");
    let points = report["processes"][0]["points"].as_array().expect("points");
    let mut checked = 0;
    for p in points {
        let ts = p["ts_ns"].as_u64().unwrap();
        if hold_of(&run, ts).is_some() {
            assert_eq!(p["unexplained"].as_u64(), Some(CONTEXT), "{stack:?}: {p}");
            checked += 1;
        }
    }
    assert!(checked >= 3, "{stack:?}: {checked} readings in holds: {report}");
    if stack == Stack::Npu {
        unexplained_chart(&run);
    }
}

/// The report draws what `analyze` stored: the driver's figure, the traced bytes and the rest.
fn unexplained_chart(run: &Run) {
    let Some(chromium) = memscope_integration::browser::chromium() else { return };
    let page = run.out.run_dir.with_extension("html");
    let out =
        std::process::Command::new(&run.bin).arg("report").arg(&run.out.run_dir).arg("-o").arg(&page).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let evals =
        vec!["series=[...document.querySelectorAll('#unexplained-legend li')].map(l => l.textContent)".to_owned()];
    let visit = memscope_integration::browser::Visit { evals, ..Default::default() };
    let seen = memscope_integration::browser::visit(&chromium, &page, &visit);
    let series: Vec<&str> = seen["dom"]["series"].as_array().unwrap().iter().filter_map(|v| v.as_str()).collect();
    for want in ["process_used", "traced", "unexplained"] {
        assert!(series.iter().any(|s| s.starts_with(want)), "no {want} among the chart's series {series:?}");
    }
}

#[test]
fn on_ascend_the_driver_counts_what_dcmi_says_and_the_context_is_the_unexplained_part() {
    check(Stack::Npu);
}

#[test]
fn on_nvidia_the_driver_counts_what_nvml_says_and_the_context_is_the_unexplained_part() {
    check(Stack::Cuda);
}

/// The management library is found through the job's own files (its maps, its root), which the
/// job's user may have planted: the helper that loads it runs as that user, never as root.
#[test]
fn the_driver_helper_runs_as_the_jobs_user() {
    let env = env("driver_user");
    let hal = env.ascend_home.join("lib64/libascend_hal.so");
    let script = format!("import ctypes, time; ctypes.CDLL({:?}); time.sleep(6)", hal.display().to_string());
    // `nobody`, with none of root's groups, on the system's Python (pyenv's lives under root's
    // home, which nobody may not enter).
    let python = Path::new("/usr/bin/python3");
    if !python.is_file() {
        eprintln!("SKIPPED: the helper's user: no /usr/bin/python3 for a job run as nobody");
        return;
    }
    let mut job = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(python)
        .args(["-c", &script])
        .spawn()
        .expect("setpriv");
    std::thread::sleep(Duration::from_millis(800));
    let pid = job.id().to_string();
    let out = env.scratch.join("out").display().to_string();
    let args = ["trace", "--pid", &pid, "--output", &out, "--duration", "3", "--driver-every", "100ms"];
    let tracer = Tracer::spawn(&env, &args, &[]);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let helper_uid = loop {
        let found = std::fs::read_dir("/proc").unwrap().filter_map(Result::ok).find_map(|e| {
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            let first = cmdline.split(|b| *b == 0).next()?;
            if !first.ends_with(b"memscope-driver-query") {
                return None;
            }
            let status = std::fs::read_to_string(e.path().join("status")).ok()?;
            status
                .lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|u| u.split_whitespace().nth(1)?.parse::<u32>().ok())
        });
        if let Some(uid) = found {
            break uid;
        }
        assert!(std::time::Instant::now() < deadline, "no helper started: {}", tracer.stderr());
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(helper_uid, 65534, "the helper's effective user");
    let (code, stderr) = tracer.finish(Duration::from_secs(30));
    let _ = job.kill();
    let _ = job.wait();
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("the driver's figures:"), "the helper, as nobody, read the stand-in DCMI: {stderr}");
}
