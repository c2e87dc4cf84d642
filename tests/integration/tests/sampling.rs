//! Privileged test of the daemon's sampling (`--sample-bytes`): a stand-in job makes thousands of
//! small tensors on the stand-in caching allocator, and the allocator's own ledger is the truth.
//! The metrics' pool totals (bytes handed out, peak, live blocks) must equal it exactly, since
//! every block is counted: by the job's flight-recorder feed, which gets every call (the default),
//! or by the kernel (`--flight-rows 0`); the DB's sampled rows, summed by their weights, must be within
//! the error the sampling math states (`memscope_core::sampling::standard_error`, here computed
//! per block from the ledger), and about as many rows must be recorded as the math expects.

use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use memscope_integration::*;

const INTERVAL: u64 = 16 << 10;

/// What the allocator's ledger says of device 0's caching pool: its allocated bytes now and at
/// most, the live blocks (address -> (request, size)), and every block's request.
struct Truth {
    allocated: u64,
    peak: u64,
    live: HashMap<u64, (u64, u64)>,
    requests: Vec<u64>,
}

fn truth(ledger: &Path) -> Truth {
    let text = std::fs::read_to_string(ledger).unwrap();
    let mut t = Truth { allocated: 0, peak: 0, live: HashMap::new(), requests: Vec::new() };
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        if v["pool"] != "caching" || v["device"] != 0 {
            continue;
        }
        let (ptr, size) = (v["ptr"].as_u64().unwrap_or(0), v["size"].as_u64().unwrap_or(0));
        match v["ev"].as_str() {
            Some("block_malloc") => {
                let req = v["req"].as_u64().unwrap();
                t.requests.push(req);
                t.live.insert(ptr, (req, size));
            }
            Some("block_free") => {
                t.live.remove(&ptr);
            }
            _ => continue,
        }
        t.allocated = v["allocated"].as_u64().unwrap();
        t.peak = t.peak.max(t.allocated);
    }
    t
}

/// A series' value in a scrape: the line of `name` whose labels hold every one of `labels`.
fn scraped(body: &str, name: &str, labels: &[String]) -> Option<u64> {
    body.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .find(|l| labels.iter().all(|want| l.contains(want.as_str())))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// `memlock` of the daemon's block map, from its fdinfo: its LRU hash (type 9) of 1 Mi entries
/// (`--max-blocks`' default) where the kernel counts, else of one entry (which the kernel rounds
/// up to a multiple of the CPUs: the only LRU hash that small).
fn blocks_memlock(pid: u32, kernel_counts: bool) -> Option<u64> {
    std::fs::read_dir(format!("/proc/{pid}/fdinfo")).ok()?.filter_map(Result::ok).find_map(|e| {
        let text = std::fs::read_to_string(e.path()).ok()?;
        let field = |key: &str| text.lines().find_map(|l| l.strip_prefix(key)?.trim().parse::<u64>().ok());
        let entries = field("max_entries:")?;
        let blocks = if kernel_counts { entries == 1 << 20 } else { entries <= 1024 };
        (field("map_type:") == Some(9) && blocks).then(|| field("memlock:"))?
    })
}

/// After the exact counters match: the owner series' sum (the same weights the DB's rows carry;
/// one owner here: the job tags nothing), checking the block map's exported kernel memory
/// against the daemon's fdinfo on the way: --max-blocks' default 1 Mi entries where the kernel
/// counts, one where the feed does.
fn owners_and_block_map(metrics: std::net::SocketAddr, pid: u32, daemon_pid: u32, kernel_counts: bool) -> u64 {
    // The job holds its blocks: a scrape after the next renewal is final.
    std::thread::sleep(Duration::from_millis(1500));
    let (_, body) = get(metrics, "/metrics").unwrap();
    let owner_labels = [format!("pid=\"{pid}\""), "device=\"0\"".into(), "layer=\"PTA\"".into()];
    let online: u64 = body
        .lines()
        .filter(|l| l.starts_with("memscope_owner_live_bytes{"))
        .filter(|l| owner_labels.iter().all(|want| l.contains(want.as_str())))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum();
    let exported = body
        .lines()
        .find_map(|l| l.strip_prefix("memscope_bpf_map_memory_bytes{map=\"BLOCKS\"} ")?.parse::<u64>().ok());
    let fdinfo = blocks_memlock(daemon_pid, kernel_counts);
    if kernel_counts {
        assert!(fdinfo.is_some_and(|b| b >= 64 << 20), "BLOCKS in the daemon's fdinfo: {fdinfo:?}");
    } else {
        assert!(fdinfo.is_some_and(|b| b < 64 << 10), "BLOCKS in the daemon's fdinfo: {fdinfo:?}");
    }
    assert_eq!(exported, fdinfo, "memscope_bpf_map_memory_bytes against /proc/PID/fdinfo");
    online
}

/// The metrics' pool totals until they equal the ledger's (or 30 s).
fn wait_exact(metrics: std::net::SocketAddr, pid: u32, t: &Truth, daemon: &Tracer) {
    let labels = [format!("pid=\"{pid}\""), "device=\"0\"".into(), "pool=\"caching\"".into()];
    let want = (Some(t.allocated), Some(t.peak), Some(t.live.len() as u64));
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, body) = get(metrics, "/metrics").unwrap();
        let got = (
            scraped(&body, "memscope_pool_used_bytes", &labels),
            scraped(&body, "memscope_pool_peak_used_bytes", &labels),
            scraped(&body, "memscope_pool_live_blocks", &labels),
        );
        if got == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "scraped {got:?}, the allocator's ledger {want:?}:\n{body}\n{}",
            daemon.stderr()
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// The job's DB: its PTA rows' weighted live bytes at the end (their FREE is the stop's shadow)
/// and the blocks recorded. Every FREE it has is of a block it recorded, and it has no untracked
/// one: a free of a block sampling left out belongs to the flight recorder's window alone.
fn sampled_rows(out: &Path) -> (f64, u32) {
    let run = read_daemon_job(out);
    let db = rusqlite::Connection::open(run.db("device_0")).unwrap();
    assert_eq!(meta(run.db("device_0"), "sample_bytes").as_deref(), Some("16384"));
    let mut rows =
        db.prepare("SELECT Event, Ptr, Attr FROM memscope_dump WHERE \"Event Type\" = 'PTA' ORDER BY ID").unwrap();
    let rows: Vec<(String, String, String)> =
        rows.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?))).unwrap().map(Result::unwrap).collect();
    let mut live: HashMap<String, f64> = HashMap::new();
    let (mut recorded, mut strays) = (0, 0);
    for (event, ptr, attr) in &rows {
        let attr: serde_json::Value = serde_json::from_str(attr).unwrap();
        let number = |key: &str| attr[key].as_str().and_then(|v| v.parse::<f64>().ok());
        if event == "MALLOC" {
            recorded += 1;
            live.insert(ptr.clone(), number("weight").or(number("size")).unwrap());
        } else if attr["shadow"] != "true" && live.remove(ptr).is_none() {
            strays += 1;
        }
    }
    assert_eq!(strays, 0, "FREE rows of blocks the DB never recorded");
    // Nor as frees of blocks from before the trace: the job's blocks all came after the attach.
    let untracked: u32 =
        db.query_row("SELECT COUNT(*) FROM ms_untracked_frees WHERE \"Event Type\" = 'PTA'", [], |r| r.get(0)).unwrap();
    assert_eq!(untracked, 0, "frees of blocks sampling left out, as untracked frees in the job's DB");
    (live.values().sum(), recorded)
}

/// The whole check, with the flight recorder on (its feed counts every block) or off (the
/// kernel counts them).
fn sampled_job(name: &str, flight: bool) {
    let env = env(name);
    let out = env.scratch.join("out");
    let s = |p: &Path| p.display().to_string();
    let output = s(&out);
    let mut args = vec!["daemon", "--output", &output, "--listen", "127.0.0.1:0", "--sample-bytes", "16KiB"];
    if flight {
        args.extend(ALWAYS_PROBED);
    } else {
        // The kernel counts: no windows (they need the flight recorder's count).
        args.extend(["--flight-rows", "0"]);
    }
    let mut daemon = Tracer::spawn(&env, &args, &[("ASCEND_HOME_PATH", &env.ascend_home)]);
    daemon.wait_live(Duration::from_secs(60));
    let torch = var("MEMSCOPE_TORCH_WITH_DEBUG");
    let (ledger, ready) = (env.scratch.join("pool.torch.jsonl"), env.scratch.join("pool.ready"));
    let mut job = Killed(
        Command::new("python3")
            .arg(env.workload.with_file_name("standin_pool_hold.py"))
            .args(["--torch-lib", &s(&torch), "--ready-file", &s(&ready), "--count", "20000"])
            // The daemon finds the allocator library in the job's mappings within a second.
            .args(["--delay", "3"])
            .env("ASCEND_HOME_PATH", &env.ascend_home)
            .env("STANDIN_TORCH_LEDGER", &ledger)
            .stdin(Stdio::null())
            .spawn()
            .expect("start the stand-in pool job"),
    );
    let pid: u32 = wait_for_file(&ready, &mut job.0, Duration::from_secs(120)).trim().parse().unwrap();
    let t = truth(&ledger);
    assert!(t.requests.len() == 20_000 && t.live.len() > 5_000, "{} blocks, {} live", t.requests.len(), t.live.len());

    let metrics = metrics_address(&daemon.stderr());
    wait_exact(metrics, pid, &t, &daemon);
    let online = owners_and_block_map(metrics, pid, daemon.child.id(), !flight);
    daemon.signal(libc::SIGTERM);
    let (code, stderr) = daemon.finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");

    let (estimate, recorded) = sampled_rows(&out);
    let exact: u64 = t.live.values().map(|(_, size)| size).sum();
    // Each small block's weight k × interval × size / req has variance interval × size² / req.
    let variance: f64 = t
        .live
        .values()
        .filter(|(req, _)| *req < INTERVAL)
        .map(|&(req, size)| INTERVAL as f64 * (size as f64).powi(2) / req as f64)
        .sum();
    let z = (estimate - exact as f64) / variance.sqrt();
    println!(
        "live {exact} B, estimated {estimate:.0} B: {z:.2} standard errors; {recorded} of {} blocks recorded",
        t.requests.len()
    );
    assert!(z.abs() < 4.5, "estimate {estimate} against the ledger's {exact}: {z:.1} standard errors");
    assert_eq!(online as f64, estimate, "memscope_owner_live_bytes against the DB's weighted rows");
    // A block is recorded with probability 1 - exp(-req / interval) (1 at the interval or more).
    let p: Vec<f64> = t
        .requests
        .iter()
        .map(|&r| if r >= INTERVAL { 1.0 } else { 1.0 - (-(r as f64) / INTERVAL as f64).exp() })
        .collect();
    let (mean, sd) = (p.iter().sum::<f64>(), p.iter().map(|p| p * (1.0 - p)).sum::<f64>().sqrt());
    assert!((f64::from(recorded) - mean).abs() < 5.0 * sd, "{recorded} blocks recorded, {mean:.0} ± {sd:.0} expected");
    assert!(f64::from(recorded) < 0.8 * t.requests.len() as f64, "sampling recorded {recorded} blocks");
}

#[test]
fn sampled_pool_blocks_have_exact_counters_and_weights_within_the_stated_error_of_the_ledger() {
    sampled_job("daemon_sampling", true);
}

#[test]
fn with_the_flight_recorder_off_the_kernel_counts_the_sampled_blocks_exactly() {
    sampled_job("daemon_sampling_kernel", false);
}
