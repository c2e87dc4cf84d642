//! Privileged test of the daemon's sampling (`--sample-bytes`): a stand-in job makes thousands of
//! small tensors on the stand-in caching allocator, and the allocator's own ledger is the truth.
//! The metrics' pool totals (bytes handed out, peak, live blocks) must equal it exactly, since
//! the kernel counts every block; the DB's sampled rows, summed by their weights, must be within
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

/// `memlock` of the daemon's LRU hash map with 1 Mi entries, from its fdinfo.
fn blocks_memlock(pid: u32) -> Option<u64> {
    std::fs::read_dir(format!("/proc/{pid}/fdinfo")).ok()?.filter_map(Result::ok).find_map(|e| {
        let text = std::fs::read_to_string(e.path()).ok()?;
        let field = |key: &str| text.lines().find_map(|l| l.strip_prefix(key)?.trim().parse::<u64>().ok());
        (field("map_type:") == Some(9) && field("max_entries:") == Some(1 << 20)).then(|| field("memlock:"))?
    })
}

/// After the exact counters match: the owner series' sum (the same weights the DB's rows carry;
/// one owner here: the job tags nothing), checking the block map's exported kernel memory
/// against the daemon's fdinfo on the way.
fn owners_and_block_map(metrics: std::net::SocketAddr, pid: u32, daemon_pid: u32) -> u64 {
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
    // The block map's kernel memory, as exported, is what the kernel says of the daemon's own
    // descriptor: the LRU hash (type 9) of --max-blocks' default 1 Mi entries.
    let exported = body
        .lines()
        .find_map(|l| l.strip_prefix("memscope_bpf_map_memory_bytes{map=\"BLOCKS\"} ")?.parse::<u64>().ok());
    let fdinfo = blocks_memlock(daemon_pid);
    assert!(fdinfo.is_some_and(|b| b >= 64 << 20), "BLOCKS in the daemon's fdinfo: {fdinfo:?}");
    assert_eq!(exported, fdinfo, "memscope_bpf_map_memory_bytes against /proc/PID/fdinfo");
    online
}

#[test]
fn sampled_pool_blocks_have_exact_counters_and_weights_within_the_stated_error_of_the_ledger() {
    let env = env("daemon_sampling");
    let out = env.scratch.join("out");
    let s = |p: &Path| p.display().to_string();
    let args = ["daemon", "--output", &s(&out), "--listen", "127.0.0.1:0", "--sample-bytes", "16KiB"];
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

    // Exact: the kernel counted every block, recorded or not.
    let metrics = metrics_address(&daemon.stderr());
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
            break;
        }
        assert!(
            Instant::now() < deadline,
            "scraped {got:?}, the allocator's ledger {want:?}:\n{body}\n{}",
            daemon.stderr()
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    let online = owners_and_block_map(metrics, pid, daemon.child.id());
    daemon.signal(libc::SIGTERM);
    let (code, stderr) = daemon.finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");

    // Sampled: the DB's PTA rows of blocks live at the end (their FREE is the stop's shadow).
    let folder = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| !p.ends_with("flight"))
        .expect("the job's run folder");
    let run = read_run(&folder);
    let db = rusqlite::Connection::open(run.db("device_0")).unwrap();
    assert_eq!(meta(run.db("device_0"), "sample_bytes").as_deref(), Some("16384"));
    let mut rows =
        db.prepare("SELECT Event, Ptr, Attr FROM memscope_dump WHERE \"Event Type\" = 'PTA' ORDER BY ID").unwrap();
    let rows: Vec<(String, String, String)> =
        rows.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?))).unwrap().map(Result::unwrap).collect();
    let mut live: HashMap<String, f64> = HashMap::new();
    let mut recorded = 0;
    for (event, ptr, attr) in &rows {
        let attr: serde_json::Value = serde_json::from_str(attr).unwrap();
        let number = |key: &str| attr[key].as_str().and_then(|v| v.parse::<f64>().ok());
        if event == "MALLOC" {
            recorded += 1;
            live.insert(ptr.clone(), number("weight").or(number("size")).unwrap());
        } else if attr["shadow"] != "true" {
            live.remove(ptr);
        }
    }
    let estimate: f64 = live.values().sum();
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
