//! Privileged test of the daemon's windows (`--windows`): the pool's probes are attached for a
//! window only, and a stand-in job (standin_pool_windows.py) makes blocks before the window,
//! in it, in the drain after it and after that, paced by the test. The allocator's ledger is
//! the truth:
//! - the device series stay exact throughout (the runtime's probes never go);
//! - a block born in the window and freed in the drain is seen freed, and one that outlives
//!   the drain is forgotten: counted, and its row ended by a FREE marked implied;
//! - frees of blocks born outside the window leave no row in the job's DB (they are counted
//!   among the untracked frees), and the pool series hold nothing once the window is over.
//!
//! Then: a call in flight as its window's probes go hides nothing of the next window, and a
//! device nearly full by the driver's figure opens a window before its time.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use memscope_integration::*;

const COUNT: usize = 400;

/// A series' value in a scrape: the line of `name` whose labels hold every one of `labels`
/// (none: the bare series).
fn scraped(body: &str, name: &str, labels: &[String]) -> Option<u64> {
    body.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .find(|l| labels.iter().all(|want| l.contains(want.as_str())))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// Scrapes until `done` holds of the body (or 30 s), and returns that body.
fn scrape_until(metrics: SocketAddr, daemon: &Tracer, what: &str, done: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, body) = get(metrics, "/metrics").unwrap();
        if done(&body) {
            return body;
        }
        assert!(Instant::now() < deadline, "never {what}:\n{body}\n{}", daemon.stderr());
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The ledger's caching-pool blocks by phase (the lines up to each `readyK`), device 0's
/// reserved bytes at each phase's end, and which blocks born in phase 2 were still live at the
/// end of phase 3.
struct Ledger {
    born: Vec<Vec<u64>>,
    reserved: Vec<u64>,
    outlived: HashSet<u64>,
}

fn ledger(path: &Path, ends: &[usize]) -> Ledger {
    let text = std::fs::read_to_string(path).unwrap();
    let mut l = Ledger { born: vec![Vec::new(); ends.len()], reserved: vec![0; ends.len()], outlived: HashSet::new() };
    let mut live: HashMap<u64, usize> = HashMap::new();
    let mut reserved = 0;
    for (i, line) in text.lines().enumerate() {
        let phase = ends.iter().position(|end| i < *end).expect("no line after the last phase's end is read");
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        if v["device"] != 0 {
            continue;
        }
        reserved = v["reserved"].as_u64().unwrap_or(reserved);
        let ptr = v["ptr"].as_u64().unwrap_or(0);
        match (v["ev"].as_str(), v["pool"].as_str()) {
            (Some("block_malloc"), Some("caching")) => {
                l.born[phase].push(ptr);
                live.insert(ptr, phase);
            }
            (Some("block_free"), Some("caching")) => {
                live.remove(&ptr);
            }
            _ => {}
        }
        l.reserved[phase] = reserved;
    }
    l.outlived = live.into_iter().filter(|(_, phase)| *phase == 1).map(|(ptr, _)| ptr).collect();
    l
}

/// standin_pool_windows.py with `args`, pacing files in `dir` and the variable `set` (its
/// ledger or its pause file), once it has written `ready1`: (the job, its pid).
fn pool_job(env: &TestEnv, dir: &Path, args: &[&str], set: (&str, &Path)) -> (Killed, u32) {
    let torch = var("MEMSCOPE_TORCH_WITH_DEBUG");
    let mut job = Killed(
        Command::new("python3")
            .arg(env.workload.with_file_name("standin_pool_windows.py"))
            .arg("--torch-lib")
            .arg(&torch)
            .arg("--dir")
            .arg(dir)
            .args(args)
            .env("ASCEND_HOME_PATH", &env.ascend_home)
            .env(set.0, set.1)
            .stdin(Stdio::null())
            .spawn()
            .expect("start the stand-in pool job"),
    );
    let pid = wait_for_file(&dir.join("ready1"), &mut job.0, Duration::from_secs(120)).trim().parse().unwrap();
    (job, pid)
}

fn lines(path: &Path) -> usize {
    std::fs::read_to_string(path).unwrap().lines().count()
}

/// The job's DB: its PTA rows, each block's MALLOC with one FREE, and the addresses of the FREEs
/// marked implied.
fn pta_rows(out: &Path) -> (usize, HashSet<u64>) {
    let run = read_daemon_job(out);
    let db = rusqlite::Connection::open(run.db("device_0")).unwrap();
    let mut rows =
        db.prepare("SELECT Event, Ptr, Attr FROM memscope_dump WHERE \"Event Type\" = 'PTA' ORDER BY ID").unwrap();
    let rows: Vec<(String, String, String)> =
        rows.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?))).unwrap().map(Result::unwrap).collect();
    let (mut live, mut mallocs, mut implied) = (HashSet::new(), 0, HashSet::new());
    for (event, ptr, attr) in &rows {
        let attr: serde_json::Value = serde_json::from_str(attr).unwrap();
        let ptr = u64::from_str_radix(ptr.trim_start_matches("0x"), 16).unwrap();
        if event == "MALLOC" {
            mallocs += 1;
            assert!(live.insert(ptr), "{ptr:#x} handed out twice");
        } else {
            assert!(live.remove(&ptr), "a FREE of {ptr:#x}, which the DB never saw handed out: {attr}");
            assert_ne!(attr["shadow"], "true", "{ptr:#x} was still live at the stop");
            if attr["implied"] == "true" {
                implied.insert(ptr);
            }
        }
    }
    assert!(live.is_empty(), "blocks with no FREE: {live:?}");
    let untracked: u32 =
        db.query_row("SELECT COUNT(*) FROM ms_untracked_frees WHERE \"Event Type\" = 'PTA'", [], |r| r.get(0)).unwrap();
    assert_eq!(untracked, 0, "frees of blocks born outside the window, in the job's DB");
    (mallocs, implied)
}

#[test]
fn a_window_sees_its_blocks_freed_in_the_drain_forgets_the_rest_and_keeps_the_device_exact() {
    let env = env("daemon_windows");
    let out = env.scratch.join("out");
    let dir = env.scratch.join("phases");
    std::fs::create_dir_all(&dir).unwrap();
    let s = |p: &Path| p.display().to_string();
    let ledger_path = env.scratch.join("pool.torch.jsonl");
    // Phase 1 runs before the daemon: its blocks and segments are born unseen.
    let count = COUNT.to_string();
    let (mut job, pid) = pool_job(&env, &dir, &["--count", &count], ("STANDIN_TORCH_LEDGER", &ledger_path));
    let mut ends = vec![lines(&ledger_path)];

    // One window, from the daemon's start, of 6 s (every block here is over the interval:
    // every one is recorded).
    let output = s(&out);
    let args =
        ["daemon", "--output", &output, "--listen", "127.0.0.1:0", "--sample-bytes", "16KiB", "--windows", "6s/1h"];
    let mut daemon = Tracer::spawn(&env, &args, &[("ASCEND_HOME_PATH", &env.ascend_home)]);
    daemon.wait_live(Duration::from_secs(60));
    let metrics = metrics_address(&daemon.stderr());
    let open = |body: &str| scraped(body, "memscope_window_open", &[]);
    scrape_until(metrics, &daemon, "a window open", |b| open(b) == Some(1));
    std::fs::write(dir.join("go1"), "").unwrap();
    wait_for_file(&dir.join("ready2"), &mut job.0, Duration::from_secs(30));
    ends.push(lines(&ledger_path));
    let (_, body) = get(metrics, "/metrics").unwrap();
    assert_eq!(open(&body), Some(1), "phase 2 outlasted the window: the test is too slow for it");

    // Closed: the allocations' probes are gone, the frees' drain the window's blocks.
    scrape_until(metrics, &daemon, "the window closed", |b| open(b) == Some(0));
    std::fs::write(dir.join("go2"), "").unwrap();
    wait_for_file(&dir.join("ready3"), &mut job.0, Duration::from_secs(30));
    ends.push(lines(&ledger_path));
    let forgotten = |body: &str| scraped(body, "memscope_window_forgotten_blocks_total", &[]);
    let (_, body) = get(metrics, "/metrics").unwrap();
    assert_eq!(forgotten(&body), Some(0), "phase 3 outlasted the drain: the test is too slow for it");

    // The drain ends 6 s after the close (blocks of the window stay live); the rest are forgotten.
    let body = scrape_until(metrics, &daemon, "the window's blocks forgotten", |b| forgotten(b).unwrap_or(0) > 0);
    let l = ledger(&ledger_path, &ends);
    assert_eq!(l.born.iter().map(Vec::len).collect::<Vec<_>>(), [COUNT; 3]);
    assert_eq!(forgotten(&body), Some(l.outlived.len() as u64), "B's second half outlived the drain");
    assert_eq!(l.outlived.len(), COUNT / 2);
    let labels = |more: &[&str]| {
        let mut labels = vec![format!("pid=\"{pid}\""), "device=\"0\"".to_owned()];
        labels.extend(more.iter().map(|m| (*m).to_owned()));
        labels
    };
    let caching = labels(&["pool=\"caching\""]);
    let series = |name| scraped(&body, name, &labels(&[]));
    // The segments taken since the daemon started, to the byte: the runtime's probes stayed.
    assert_eq!(series("memscope_live_bytes"), Some(l.reserved[2] - l.reserved[0]), "{body}");
    assert_eq!(scraped(&body, "memscope_pool_used_bytes", &caching), Some(0), "{body}");
    assert_eq!(scraped(&body, "memscope_pool_live_blocks", &caching), Some(0), "{body}");
    // A's half freed in the window, C's half in the drain: blocks the window never saw born.
    assert_eq!(series("memscope_untracked_frees_total"), Some(COUNT as u64), "{body}");
    assert_eq!(scraped(&body, "memscope_windows_total", &[]), Some(1));

    std::fs::write(dir.join("go3"), "").unwrap();
    assert_eq!(wait_child(&mut job.0, Duration::from_secs(30)), 0);
    daemon.signal(libc::SIGTERM);
    let (code, stderr) = daemon.finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");
    let (mallocs, implied) = pta_rows(&out);
    assert_eq!(mallocs, COUNT, "every block born in the window, and none other");
    assert_eq!(implied, l.outlived, "the implied FREEs are the blocks that outlived the drain");
}

/// A call in flight when its window's probes go never returns through them, so its thread's
/// slot stays open in the kernel; the next window's calls on that thread must be recorded, not
/// taken for calls nested in it (the spec's window number tells them apart).
#[test]
fn a_call_in_flight_when_its_window_closed_hides_nothing_of_the_next_window() {
    let env = env("daemon_windows_in_flight");
    let out = env.scratch.join("out");
    let dir = env.scratch.join("phases");
    std::fs::create_dir_all(&dir).unwrap();
    let s = |p: &Path| p.display().to_string();
    let output = s(&out);
    let args =
        ["daemon", "--output", &output, "--listen", "127.0.0.1:0", "--sample-bytes", "16KiB", "--windows", "4s/12s"];
    let mut daemon = Tracer::spawn(&env, &args, &[("ASCEND_HOME_PATH", &env.ascend_home)]);
    daemon.wait_live(Duration::from_secs(60));
    let metrics = metrics_address(&daemon.stderr());
    let pause = dir.join("pause");
    let (mut job, pid) = pool_job(&env, &dir, &["--count", "50", "--paused"], ("STANDIN_TORCH_PAUSE", &pause));
    let total = |body: &str| scraped(body, "memscope_windows_total", &[]).unwrap_or(0);
    let open = |body: &str| scraped(body, "memscope_window_open", &[]);
    // The allocation enters in a window opened since (the whole of it ahead) and waits there
    // until that window's probes are gone.
    let (_, before) = get(metrics, "/metrics").unwrap();
    let first = scrape_until(metrics, &daemon, "a window open", |b| open(b) == Some(1) && total(b) > total(&before));
    std::fs::write(&pause, "").unwrap();
    std::fs::write(dir.join("go1"), "").unwrap();
    scrape_until(metrics, &daemon, "the window closed", |b| open(b) == Some(0) && total(b) == total(&first));
    // Closing a link takes ~0.1 s; nothing of the window is live, so its frees go at once too.
    std::thread::sleep(Duration::from_secs(1));
    std::fs::remove_file(&pause).unwrap();
    wait_for_file(&dir.join("ready2"), &mut job.0, Duration::from_secs(30));

    let next = scrape_until(metrics, &daemon, "the next window open", |b| total(b) > total(&first));
    assert_eq!(open(&next), Some(1));
    std::fs::write(dir.join("go2"), "").unwrap();
    wait_for_file(&dir.join("ready3"), &mut job.0, Duration::from_secs(30));
    let labels = [format!("pid=\"{pid}\""), "device=\"0\"".to_owned(), "pool=\"caching\"".to_owned()];
    let body = scrape_until(metrics, &daemon, "the next window's 50 blocks counted", |b| {
        scraped(b, "memscope_pool_live_blocks", &labels) == Some(50)
    });
    assert_eq!(open(&body), Some(1), "the next window closed before its blocks were counted: too slow a test");
    std::fs::write(dir.join("go3"), "").unwrap();
    assert_eq!(wait_child(&mut job.0, Duration::from_secs(30)), 0);
    daemon.signal(libc::SIGTERM);
    let (code, stderr) = daemon.finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");
}

/// A device filling up by the driver's own figure (the stand-in DCMI's, from what the stand-in
/// driver charged) opens a window before its time, so an OOM coming finds the pool's blocks;
/// once, while it stays full.
#[test]
fn a_nearly_full_device_opens_a_window_before_its_time() {
    let env = env("daemon_windows_near_full");
    let out = env.scratch.join("out");
    let s = |p: &Path| p.display().to_string();
    let output = s(&out);
    // The first window opens at the start; the next is an hour away.
    let args =
        ["daemon", "--output", &output, "--listen", "127.0.0.1:0", "--windows", "2s/1h", "--driver-every", "200ms"];
    let mem = std::ffi::OsStr::new("256M");
    let vars = [("ASCEND_HOME_PATH", Some(env.ascend_home.as_os_str())), ("STANDIN_ACL_DEVICE_MEM", Some(mem))];
    let mut daemon = Tracer::spawn_with(&env, &args, &vars);
    daemon.wait_live(Duration::from_secs(60));
    let metrics = metrics_address(&daemon.stderr());
    let total = |body: &str| scraped(body, "memscope_windows_total", &[]);
    let open = |body: &str| scraped(body, "memscope_window_open", &[]);
    scrape_until(metrics, &daemon, "the first window over", |b| total(b) == Some(1) && open(b) == Some(0));

    // 240 of the device's 256 MiB, held.
    let ready = env.scratch.join("ready");
    let mut job = Killed(
        Command::new("python3")
            .arg(env.workload.with_file_name("standin_hold.py"))
            .args(["--ledger", &s(&env.scratch.join("hold.jsonl")), "--blocks", "240", "--size", "1048576"])
            .args(["--ready-file", &s(&ready), "--hold", "60"])
            .env("ASCEND_HOME_PATH", &env.ascend_home)
            .env("STANDIN_ACL_DEVICE_MEM", mem)
            .stdin(Stdio::null())
            .spawn()
            .expect("start the stand-in job"),
    );
    wait_for_file(&ready, &mut job.0, Duration::from_secs(60));
    scrape_until(metrics, &daemon, "a window opened by the full device", |b| total(b) == Some(2));
    // Once per crossing: the device stays full, and no window follows this one at once.
    scrape_until(metrics, &daemon, "that window over", |b| open(b) == Some(0));
    std::thread::sleep(Duration::from_secs(3));
    let (_, body) = get(metrics, "/metrics").unwrap();
    assert_eq!(total(&body), Some(2), "a device that stays full opened window after window");
    drop(job);
    daemon.signal(libc::SIGTERM);
    let (code, stderr) = daemon.finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("a window opens early: device 0 holds"), "the log says why: {stderr}");
}
