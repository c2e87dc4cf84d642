//! Privileged tests of `memscope-bpf daemon`: stand-in jobs start and stop while the daemon
//! runs; the ones its filters admit get a run folder each, whose DB holds exactly the calls of
//! the job's own ledger, and series that a real Prometheus scrapes with the ledger's values and
//! that go away when the job ends; the ones the filters deny (outside the `--cgroup`, or named
//! by `--exclude-comm`) get neither.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use memscope_integration::*;

/// A cgroup v2 folder of the test's own, removed at the end.
struct Cgroup {
    dir: PathBuf,
    /// As `--cgroup` takes it: the path inside the hierarchy.
    inside: String,
}

impl Cgroup {
    fn make() -> Result<Self, String> {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| e.to_string())?;
        let mount = mountinfo
            .lines()
            .find_map(|l| {
                let (left, right) = l.split_once(" - ")?;
                right.starts_with("cgroup2 ").then(|| left.split(' ').nth(4).map(PathBuf::from))?
            })
            .ok_or("no cgroup2 mount")?;
        let inside = format!("memscope-test-{}", std::process::id());
        let dir = mount.join(&inside);
        std::fs::create_dir(&dir).map_err(|e| format!("cannot make {}: {e}", dir.display()))?;
        Ok(Self { dir, inside: format!("/{inside}") })
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        // Its processes were killed by then; the kernel needs a moment to take them out.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// A pod's cgroup as the kubelet's systemd driver lays it out, under a test cgroup, and the
/// record containerd keeps of its container under a node root: `ml/llama-0`, container `trainer`.
struct PodCgroup {
    /// The container's cgroup (the leaf), then the folders above it up to the test cgroup.
    dirs: Vec<PathBuf>,
    dir: PathBuf,
}

impl PodCgroup {
    fn make(under: &Path, node_root: &Path) -> Self {
        let (uid, id) = ("0f1e2d3c-4b5a-6978-8a9b-0c1d2e3f4a5b", "9a8b7c6d5e4f3021".repeat(4));
        let parts = [
            "kubepods.slice".to_owned(),
            "kubepods-besteffort.slice".to_owned(),
            format!("kubepods-besteffort-pod{}.slice", uid.replace('-', "_")),
            format!("cri-containerd-{id}.scope"),
        ];
        let mut dirs = Vec::new();
        let mut at = under.to_owned();
        for p in &parts {
            at = at.join(p);
            std::fs::create_dir(&at).unwrap_or_else(|e| panic!("{}: {e}", at.display()));
            dirs.push(at.clone());
        }
        dirs.reverse();
        let config = node_root.join(format!("run/containerd/io.containerd.runtime.v2.task/k8s.io/{id}"));
        std::fs::create_dir_all(&config).unwrap();
        let annotations = serde_json::json!({"annotations": {
            "io.kubernetes.cri.sandbox-namespace": "ml",
            "io.kubernetes.cri.sandbox-name": "llama-0",
            "io.kubernetes.cri.container-name": "trainer",
        }});
        std::fs::write(config.join("config.json"), annotations.to_string()).unwrap();
        Self { dir: at, dirs }
    }
}

impl Drop for PodCgroup {
    fn drop(&mut self) {
        for dir in &self.dirs {
            for _ in 0..50 {
                if std::fs::remove_dir(dir).is_ok() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// A command that moves itself into `cgroup` (if given) and then execs its arguments, so the
/// program's first call is made inside.
fn in_cgroup(cgroup: Option<&Path>) -> Command {
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(r#"if [ -n "$1" ]; then echo $$ > "$1/cgroup.procs" || exit 9; fi; shift; exec "$@""#)
        .arg("sh")
        .arg(cgroup.map(Path::as_os_str).unwrap_or_default());
    cmd
}

/// One stand-in job holding its blocks, and its ledger.
struct Job {
    process: Killed,
    ledger: PathBuf,
    ready: PathBuf,
}

impl Job {
    /// Starts `standin_hold.py` with `python` on `device`, inside `cgroup` if given (it moves
    /// itself there before it execs Python, so its first call is made inside).
    fn start(env: &TestEnv, name: &str, python: &Path, device: u32, blocks: u32, cgroup: Option<&Path>) -> Self {
        Self::start_with(env, name, python, device, blocks, cgroup, (&[], &[]))
    }

    fn start_with(
        env: &TestEnv,
        name: &str,
        python: &Path,
        device: u32,
        blocks: u32,
        cgroup: Option<&Path>,
        (extra, vars): (&[&str], &[(&str, &str)]),
    ) -> Self {
        let (ledger, ready) = (env.scratch.join(format!("{name}.jsonl")), env.scratch.join(format!("{name}.ready")));
        let hold = env.workload.with_file_name("standin_hold.py");
        let mut cmd = in_cgroup(cgroup);
        cmd.arg(python)
            .arg(&hold)
            .args(["--ledger", &ledger.display().to_string(), "--ready-file", &ready.display().to_string()])
            .args(["--device", &device.to_string(), "--blocks", &blocks.to_string(), "--size", "5000", "--hold", "300"])
            .args(extra)
            .envs(vars.iter().copied())
            .env("ASCEND_HOME_PATH", &env.ascend_home)
            // The stand-in driver has 2 devices unless told otherwise.
            .env("STANDIN_ACL_DEVICE_COUNT", "4")
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        Self { process: Killed(cmd.spawn().expect("start a stand-in job")), ledger, ready }
    }

    /// Waits until every block is allocated and logged; the job's pid.
    fn wait_ready(&mut self) -> u32 {
        let pid = wait_for_file(&self.ready, &mut self.process.0, Duration::from_secs(60));
        pid.trim().parse().unwrap()
    }
}

/// A daemon writing run folders to `out`, with the stand-in runtime's folder in its environment
/// (probed at the start) and `extra` flags; returned once its probes are live.
fn live_daemon(env: &TestEnv, out: &Path, extra: &[&str]) -> Tracer {
    let mut args = vec!["daemon", "--output", out.to_str().unwrap(), "--listen", "127.0.0.1:0"];
    args.extend(ALWAYS_PROBED);
    args.extend_from_slice(extra);
    let mut daemon = Tracer::spawn(env, &args, &[("ASCEND_HOME_PATH", &env.ascend_home)]);
    daemon.wait_live(Duration::from_secs(60));
    daemon
}

/// The real interpreter behind `python3` (not a launcher script), so that a link to it execs
/// Python under the link's name.
fn real_python() -> PathBuf {
    let out = Command::new("python3").args(["-c", "import sys; print(sys.executable)"]).output().unwrap();
    std::fs::canonicalize(String::from_utf8(out.stdout).unwrap().trim()).unwrap()
}

/// Live bytes as the driver hands them out for a job's ledger: the stand-in runtime asks its
/// driver for each aclrtMalloc's size + 32, rounded up to 32 (standin_ascendcl.c's header).
fn ledger_live_bytes(ledger: &[Entry]) -> u64 {
    ledger
        .iter()
        .filter(|e| e.api == "aclrtMalloc" && e.rc == 0)
        .filter_map(|e| e.size)
        .map(|n| (n + 32).div_ceil(32) * 32)
        .sum()
}

/// The run folders the daemon made, by the pid in their names.
fn run_folders(out: &Path) -> Vec<(u32, PathBuf)> {
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir(out)
        .map(|d| d.filter_map(Result::ok).map(|e| e.path()).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .filter_map(|p| Some((p.file_name()?.to_str()?.split('_').nth(1)?.parse().ok()?, p)))
        .collect();
    found.sort();
    found
}

#[test]
fn the_daemon_traces_each_admitted_job_in_its_own_folder_and_prometheus_sees_its_ledger() {
    let env = env("daemon_jobs");
    if let Some(why) = prometheus_missing() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let cgroup = match Cgroup::make() {
        Ok(c) => c,
        Err(why) => {
            eprintln!("SKIPPED: no cgroup v2 folder can be made here ({why})");
            return;
        }
    };
    let out = env.scratch.join("out");
    let s = |p: &Path| p.display().to_string();
    // Job b runs in a pod-shaped cgroup, its pod named by containerd's record under the node root.
    let pod = PodCgroup::make(&cgroup.dir, &env.scratch.join("node"));
    let args = [
        "daemon",
        ALWAYS_PROBED[0],
        ALWAYS_PROBED[1],
        "--output",
        &s(&out),
        "--listen",
        "127.0.0.1:0",
        "--cgroup",
        &cgroup.inside,
        "--exclude-comm",
        "denied_job",
        "--node-root",
        &s(&env.scratch.join("node")),
    ];
    let mut daemon = Tracer::spawn(&env, &args, &[("ASCEND_HOME_PATH", &env.ascend_home)]);
    daemon.wait_live(Duration::from_secs(60));

    let python = real_python();
    let denied_name = env.scratch.join("denied_job");
    std::os::unix::fs::symlink(&python, &denied_name).unwrap();
    let inside = Some(cgroup.dir.as_path());
    let mut jobs = [
        Job::start(&env, "a", &python, 0, 200, inside),
        // A torchrun worker: its rank and its launch's rendezvous label its series and DB.
        Job::start_with(&env, "b", &python, 1, 300, Some(&pod.dir), (&[], RANK_VARS)),
        // Inside the cgroup, but its name is denied.
        Job::start(&env, "denied", &denied_name, 2, 100, inside),
        // Not denied by name, but outside the cgroup.
        Job::start(&env, "outside", &python, 3, 100, None),
    ];
    let pids: Vec<u32> = jobs.iter_mut().map(Job::wait_ready).collect();
    let ledgers: Vec<Vec<Entry>> = jobs.iter().map(|j| read_ledger(&j.ledger)).collect();

    let metrics = metrics_address(&daemon.stderr());
    let (_prometheus, prometheus) = start_prometheus(&env.scratch, metrics);
    // The admitted jobs' series, scraped, against their ledgers.
    let series = |pid: u32, device: u32| {
        let labels = format!(r#"job="memscope",pid="{pid}",device="{device}""#);
        (
            query(prometheus, &format!("memscope_live_bytes{{{labels}}}")),
            query(prometheus, &format!("memscope_allocations_total{{{labels}}}")),
        )
    };
    let want = |i: usize| {
        let mallocs = ledgers[i].iter().filter(|e| e.api == "aclrtMalloc" && e.rc == 0).count() as u64;
        (Some(ledger_live_bytes(&ledgers[i])), Some(mallocs))
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let got =
            [series(pids[0], 0), series(pids[1], 1), (query(prometheus, r#"memscope_jobs{job="memscope"}"#), None)];
        let wanted = [want(0), want(1), (Some(2), None)];
        if got == wanted {
            break;
        }
        assert!(Instant::now() < deadline, "Prometheus {got:?} against the ledgers {wanted:?}:\n{}", daemon.stderr());
        std::thread::sleep(Duration::from_millis(500));
    }
    let ranked = format!(
        r#"memscope_live_bytes{{job="memscope",pid="{}",rank="1",job_id="127.0.0.1:29500",namespace="ml",pod="llama-0",container="trainer"}}"#,
        pids[1]
    );
    assert_eq!(query(prometheus, &ranked), want(1).0, "job b's series by its rank, job and pod");
    let (_, body) = get(metrics, "/metrics").unwrap();
    assert!(!body.contains(&format!(r#"pid="{}",comm="python3",rank"#, pids[0])), "job a has no rank:\n{body}");
    for denied in &pids[2..] {
        assert!(!body.contains(&format!("pid=\"{denied}\"")), "denied job {denied} has series:\n{body}");
    }

    // A job that ends has its series gone at the next renewal, and its DBs finished.
    jobs[0].process.0.kill().unwrap();
    jobs[0].process.0.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, body) = get(metrics, "/metrics").unwrap();
        if !body.contains(&format!("pid=\"{}\"", pids[0])) {
            assert!(body.contains(&format!("pid=\"{}\"", pids[1])), "job b's series went too:\n{body}");
            break;
        }
        assert!(Instant::now() < deadline, "job a's series outlived it:\n{body}");
        std::thread::sleep(Duration::from_millis(200));
    }
    daemon.signal(libc::SIGTERM);
    let (code, stderr) = daemon.finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");

    check_job_folders(&out, &pids, &ledgers, &stderr);
}

/// One folder per admitted job (jobs 0 and 1), none for the denied ones; each DB holds its
/// ledger's calls, its stop's reason, and job 1's rank.
fn check_job_folders(out: &Path, pids: &[u32], ledgers: &[Vec<Entry>], stderr: &str) {
    let folders = run_folders(out);
    let mut admitted = pids[..2].to_vec();
    admitted.sort();
    assert_eq!(folders.iter().map(|(p, _)| *p).collect::<Vec<_>>(), admitted, "{stderr}");
    for (i, reason) in [(0, "process exited"), (1, "daemon stopped: terminated (SIGTERM)")] {
        let folder = &folders.iter().find(|(p, _)| *p == pids[i]).unwrap().1;
        let run = read_run(folder);
        assert_exact(&ledgers[i], &run);
        let db = run.db(&format!("device_{i}"));
        assert_eq!(meta(db, "stop_reason").as_deref(), Some(reason), "job {i}");
        assert_eq!(meta(db, "mode").as_deref(), Some("daemon"));
        assert_eq!(meta(db, "target_pid"), Some(pids[i].to_string()));
        let rank = (i == 1).then(|| "1".to_owned());
        let pod = (i == 1).then(|| "llama-0".to_owned());
        assert_eq!((meta(db, "k8s_pod"), meta(db, "k8s_pod_uid").is_some()), (pod.clone(), pod.is_some()), "job {i}");
        assert_eq!((meta(db, "rank"), meta(db, "world_size")), (rank.clone(), rank.map(|_| "2".to_owned())), "job {i}");
    }
}

/// The variables torchrun gives its worker of rank 1 of 2.
const RANK_VARS: &[(&str, &str)] =
    &[("RANK", "1"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")];

/// The one DB file under a run folder's device folder (the daemon's DB need not be finished).
fn device_db(run: &Path, device: u32) -> PathBuf {
    let dump = run.join(format!("device_{device}")).join("dump");
    let dbs: Vec<PathBuf> = std::fs::read_dir(&dump)
        .unwrap_or_else(|e| panic!("{}: {e}", dump.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "db"))
        .collect();
    assert_eq!(dbs.len(), 1, "{dbs:?}");
    dbs[0].clone()
}

#[test]
fn a_killed_daemon_leaves_its_jobs_running_without_probes_and_dbs_that_open_with_the_ooms_rows() {
    let env = env("daemon_killed");
    let out = env.scratch.join("out");
    let daemon = live_daemon(&env, &out, &[]);
    assert!(bpf_program_names().iter().any(|n| n == "call_exit"), "the daemon's probes are not loaded");
    let oom_size = 1u64 << 40;
    let mut job =
        Job::start_with(&env, "oom", &real_python(), 0, 100, None, (&["--oom-size", &oom_size.to_string()], &[]));
    let pid = job.wait_ready();
    // The OOM is committed as it is seen, not at the next second's commit, which this kill
    // comes before (the job wrote its ready file after the failure, and the daemon drains every
    // 20 ms).
    std::thread::sleep(Duration::from_millis(200));
    daemon.signal(libc::SIGKILL);
    let (code, stderr) = daemon.finish(Duration::from_secs(10));
    assert_eq!(code, None, "killed by a signal:\n{stderr}");

    // The job runs on, and nothing of the daemon stays in the kernel.
    let deadline = Instant::now() + Duration::from_secs(10);
    while bpf_program_names().iter().any(|n| n == "call_enter" || n == "call_exit") {
        assert!(Instant::now() < deadline, "the probes outlived the daemon: {:?}", bpf_program_names());
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(500));
    assert!(job.process.0.try_wait().unwrap().is_none(), "the job died with the daemon");

    let run = &run_folders(&out).into_iter().find(|(p, _)| *p == pid).expect("the job's run folder").1;
    let db = device_db(run, 0);
    let (health, _) = db_health(&db);
    assert_eq!(health, "ok");
    let rows = read_db(&db, "device_0");
    let ledger = read_ledger(&job.ledger);
    let failed = ledger.iter().find(|e| e.rc != 0).expect("the ledger's failed allocation");
    let trigger = rows
        .iter()
        .find(|r| r.event_type == "OOM_TRIGGER")
        .unwrap_or_else(|| panic!("no OOM_TRIGGER row in the killed daemon's DB:\n{stderr}"));
    assert_eq!(trigger.attr_u64("req_size"), failed.size, "{trigger:?}");
    let mallocs = rows
        .iter()
        .filter(|r| r.event == "MALLOC" && r.event_type != "OOM_RECENT_ALLOC" && r.event_type != "OOM_TOP_ALLOC");
    assert!(mallocs.count() >= 100, "the job's allocations before the OOM are committed");
}

/// A run folder of an earlier daemon, as the sweep sees one: `bytes` of DB, last written `age` ago.
fn seed_folder(out: &Path, name: &str, bytes: usize, age: Duration) -> PathBuf {
    let dump = out.join(name).join("device_0").join("dump");
    std::fs::create_dir_all(&dump).unwrap();
    let db = dump.join("memscope_dump_20260101000000.db");
    std::fs::write(&db, vec![7u8; bytes]).unwrap();
    let when = std::time::SystemTime::now() - age;
    for path in [db.as_path(), &dump, dump.parent().unwrap(), &out.join(name)] {
        std::fs::File::open(path).unwrap().set_modified(when).unwrap();
    }
    out.join(name)
}

/// Bytes on disk under `dir` (as `du` counts them).
fn disk_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        let meta = entry.metadata().unwrap();
        total += meta.blocks() * 512 + if meta.is_dir() { disk_bytes(&entry.path()) } else { 0 };
    }
    total
}

#[test]
fn the_daemon_keeps_its_folders_within_max_db_and_retention_and_never_touches_other_files() {
    let env = env("daemon_disk");
    let out = env.scratch.join("out");
    std::fs::create_dir_all(&out).unwrap();
    let minutes = |m: u64| Duration::from_secs(60 * m);
    let mib = 1 << 20;
    let expired = seed_folder(&out, "memscope_11_20260101000000_ascend", 4096, minutes(120));
    let oldest = seed_folder(&out, "memscope_12_20260101000000_ascend", 8 * mib, minutes(30));
    let older = seed_folder(&out, "memscope_13_20260101000000_ascend", 8 * mib, minutes(20));
    let newest = seed_folder(&out, "memscope_14_20260101000000_ascend", 8 * mib, minutes(10));
    // Not a run folder's name: never removed, never counted.
    let other = seed_folder(&out, "keep_me", 4 * mib, minutes(600));
    let daemon = live_daemon(&env, &out, &["--max-db", "17MiB", "--retention", "1h"]);
    // At the start: the expired folder goes by age, then the oldest by size (24 MiB > 17 MiB).
    assert!(!expired.exists() && !oldest.exists(), "{}", daemon.stderr());
    assert!(older.exists() && newest.exists() && other.exists());

    // A job's folder that takes the total over the cap (16 MiB and the job's 1-9 MiB) removes
    // the oldest finished one when the job ends, not the job's own, and no more than that.
    let mut job = Job::start(&env, "big", &real_python(), 0, 3000, None);
    let pid = job.wait_ready();
    job.process.0.kill().unwrap();
    job.process.0.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while older.exists() {
        assert!(Instant::now() < deadline, "the cap was not applied when the job ended:\n{}", daemon.stderr());
        std::thread::sleep(Duration::from_millis(100));
    }
    daemon.signal(libc::SIGTERM);
    let (code, stderr) = daemon.finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");
    let job_folder = run_folders(&out).into_iter().find(|(p, _)| *p == pid).expect("the job's folder is kept").1;
    let job_bytes = disk_bytes(&job_folder);
    assert!((mib as u64..9 * mib as u64).contains(&job_bytes), "the test assumes a 1-9 MiB job folder: {job_bytes}");
    assert!(newest.exists() && other.exists(), "{stderr}");
    assert_eq!(db_health(&device_db(&job_folder, 0)).0, "ok");
}

#[test]
fn on_sighup_a_job_that_took_an_excluded_name_is_no_longer_traced_and_its_db_is_finished() {
    let env = env("daemon_sighup");
    let out = env.scratch.join("out");
    let daemon = live_daemon(&env, &out, &["--exclude-comm", "renamed_job"]);
    let mut job = Job::start_with(&env, "renamed", &real_python(), 0, 100, None, (&["--rename", "renamed_job"], &[]));
    let pid = job.wait_ready();
    let metrics = metrics_address(&daemon.stderr());
    let label = format!("pid=\"{pid}\"");
    let has_series = || get(metrics, "/metrics").unwrap().1.contains(&label);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !has_series() {
        assert!(Instant::now() < deadline, "the job was never traced:\n{}", daemon.stderr());
        std::thread::sleep(Duration::from_millis(100));
    }
    // Its new name is excluded, but the kernel only checks names at exec: SIGHUP applies it.
    while comm_now(pid) != "renamed_job" {
        assert!(Instant::now() < deadline, "the job did not rename itself");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(has_series(), "the rename alone must not end the tracing");
    daemon.signal(libc::SIGHUP);
    let deadline = Instant::now() + Duration::from_secs(10);
    while has_series() {
        assert!(Instant::now() < deadline, "the excluded job's series stayed:\n{}", daemon.stderr());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(job.process.0.try_wait().unwrap().is_none(), "the job must run on");
    daemon.signal(libc::SIGTERM);
    let (code, stderr) = daemon.finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");
    let run = read_run(&run_folders(&out).into_iter().find(|(p, _)| *p == pid).expect("the job's folder").1);
    assert_exact(&read_ledger(&job.ledger), &run);
    assert_eq!(meta(run.db("device_0"), "stop_reason").as_deref(), Some("excluded by --exclude-comm (on SIGHUP)"));
}

fn comm_now(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm")).map(|c| c.trim().to_owned()).unwrap_or_default()
}

#[test]
fn a_library_a_job_loads_long_after_its_start_is_probed_before_its_first_call() {
    // Copies of the stand-in runtime: files no process has mapped and no environment names, so
    // only the job's dlopen can make them known (the original driver stays, through rpath).
    let env = env("daemon_dlopen");
    let copy = env.scratch.join("copy");
    std::fs::create_dir_all(&copy).unwrap();
    let lib = copy.join("libascendcl.so");
    std::fs::copy(&env.libascendcl, &lib).unwrap();
    let out = env.scratch.join("out");
    let s = |p: &Path| p.display().to_string();
    let args = ["daemon", "--output", &s(&out), "--listen", "127.0.0.1:0", ALWAYS_PROBED[0], ALWAYS_PROBED[1]];
    let mut daemon = Tracer::spawn_with(&env, &args, &[("ASCEND_HOME_PATH", None)]);
    daemon.wait_live(Duration::from_secs(60));

    // The job runs a second with nothing of the runtime mapped, loads the copy, and calls into
    // it 0.2 s later: sooner than a scan of /proc every second would find the file (the
    // daemon's discovery before the linker hook, which lost this job's first calls ~80 % of the
    // time), not so soon that a busy 2-CPU runner's attach could lag it.
    let settle = ["--lib", &s(&lib), "--delay", "1", "--settle", "0.2"];
    let mut job = Job::start_with(&env, "late", &real_python(), 0, 50, None, (&settle, &[]));
    let pid = job.wait_ready();
    let ledger = read_ledger(&job.ledger);
    daemon.signal(libc::SIGTERM);
    let (code, stderr) = daemon.finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains(&format!("in {}", lib.display())), "the copy was never probed:\n{stderr}");
    let folder = run_folders(&out).into_iter().find(|(p, _)| *p == pid).expect("the job's run folder").1;
    // Every call, the first ones included.
    assert_exact(&ledger, &read_run(&folder));
}

#[test]
fn only_processes_of_an_allowed_name_are_traced_and_a_denied_processs_children_are_not() {
    let env = env("daemon_names");
    // A name both allowed and excluded is refused before anything is loaded.
    let both = Command::new(&env.bin).args(["daemon", "--comm", "job", "--exclude-comm", "job"]).output().unwrap();
    assert!(!both.status.success(), "{both:?}");
    assert!(String::from_utf8_lossy(&both.stderr).contains("both name `job`"), "{both:?}");

    let out = env.scratch.join("out");
    let daemon = live_daemon(&env, &out, &["--comm", "allowed_job"]);
    let python = real_python();
    let allowed = env.scratch.join("allowed_job");
    std::os::unix::fs::symlink(&python, &allowed).unwrap();
    let mut jobs =
        [Job::start(&env, "allowed", &allowed, 0, 100, None), Job::start(&env, "other", &python, 1, 100, None)];
    let pids: Vec<u32> = jobs.iter_mut().map(Job::wait_ready).collect();
    // A process under a name not allowed forks a worker, and both allocate: the worker has its
    // parent's verdict, not a fresh admission at its first call.
    let (parent_ledger, child_ledger) = (env.scratch.join("parent.jsonl"), env.scratch.join("child.jsonl"));
    let forked = Command::new(&python)
        .arg(env.workload.with_file_name("standin_fork.py"))
        .args([&parent_ledger, &child_ledger])
        .args(["--pairs", "200"])
        .env("ASCEND_HOME_PATH", &env.ascend_home)
        .status()
        .unwrap();
    assert!(forked.success());
    let forked_pids: Vec<u32> = [&parent_ledger, &child_ledger].iter().map(|l| read_ledger(l)[0].tid).collect(); // main threads: tid = pid
    assert_ne!(forked_pids[0], forked_pids[1]);
    daemon.signal(libc::SIGTERM);
    let (code, stderr) = daemon.finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");
    let folders = run_folders(&out);
    assert_eq!(
        folders.iter().map(|(p, _)| *p).collect::<Vec<_>>(),
        vec![pids[0]],
        "only the allowed job is traced (not {}, nor the forked {forked_pids:?}):\n{stderr}",
        pids[1]
    );
    assert_exact(&read_ledger(&jobs[0].ledger), &read_run(&folders[0].1));
}

/// `standin_fork.py` waiting for its go file (its library loaded, no call made): a parent that
/// forks a worker once told, both making allocation pairs.
struct Forking {
    process: Killed,
    pid: u32,
    go: PathBuf,
    ledgers: [PathBuf; 2],
}

impl Forking {
    fn start(env: &TestEnv, name: &str, cgroup: Option<&Path>) -> Self {
        Self::start_as(env, name, &real_python(), cgroup)
    }

    /// As [`Self::start`], with `python` (a link to it takes the link's name).
    fn start_as(env: &TestEnv, name: &str, python: &Path, cgroup: Option<&Path>) -> Self {
        let file = |what: &str| env.scratch.join(format!("{name}.{what}"));
        let (ready, go, ledgers) = (file("ready"), file("go"), [file("parent.jsonl"), file("child.jsonl")]);
        let mut child = in_cgroup(cgroup)
            .arg(python)
            .arg(env.workload.with_file_name("standin_fork.py"))
            .args(&ledgers)
            .args([
                "--pairs",
                "200",
                "--ready-file",
                &ready.display().to_string(),
                "--go-file",
                &go.display().to_string(),
            ])
            .env("ASCEND_HOME_PATH", &env.ascend_home)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .expect("start standin_fork.py");
        let pid = wait_for_file(&ready, &mut child, Duration::from_secs(60)).trim().parse().unwrap();
        Self { process: Killed(child), pid, go, ledgers }
    }

    /// Lets it fork and allocate; waits for both to finish. The child's pid, from its ledger.
    fn run(&mut self) -> u32 {
        std::fs::write(&self.go, "").unwrap();
        assert!(self.process.0.wait().unwrap().success(), "standin_fork.py failed");
        read_ledger(&self.ledgers[1])[0].tid // its main thread: tid = pid
    }
}

#[test]
fn a_given_pid_and_the_workers_it_forks_are_traced_and_an_excluded_cgroup_is_not() {
    let env = env("daemon_pids");
    let cgroup = match Cgroup::make() {
        Ok(c) => c,
        Err(why) => {
            eprintln!("SKIPPED: no cgroup v2 folder can be made here ({why})");
            return;
        }
    };
    // Both have their pids before the daemon starts, and make no call until it is live.
    let mut given = Forking::start(&env, "given", None);
    let mut excluded = Forking::start(&env, "excluded", Some(&cgroup.dir));
    let out = env.scratch.join("out");
    let (a, b) = (given.pid.to_string(), excluded.pid.to_string());
    let daemon = live_daemon(&env, &out, &["--pid", &a, "--pid", &b, "--exclude-cgroup", &cgroup.inside]);
    // Not given.
    let mut other = Job::start(&env, "other", &real_python(), 2, 100, None);
    let other = other.wait_ready();
    let given_child = given.run();
    let excluded_child = excluded.run();
    daemon.signal(libc::SIGTERM);
    let (code, stderr) = daemon.finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");

    let folders = run_folders(&out);
    let mut want = vec![given.pid, given_child];
    want.sort();
    assert_eq!(
        folders.iter().map(|(p, _)| *p).collect::<Vec<_>>(),
        want,
        "only the given process and its worker (not {other}, nor the excluded cgroup's {} and {excluded_child}):\n{stderr}",
        excluded.pid
    );
    for (pid, ledger) in [(given.pid, &given.ledgers[0]), (given_child, &given.ledgers[1])] {
        let folder = &folders.iter().find(|(p, _)| *p == pid).unwrap().1;
        assert_exact(&read_ledger(ledger), &read_run(folder));
    }
}

#[test]
fn on_sighup_the_filter_file_is_read_again_and_applies_to_the_running_processes() {
    let env = env("daemon_reload");
    let filters = env.scratch.join("filters");
    std::fs::write(&filters, "# first rules\n--exclude-comm job_a\n").unwrap();
    let out = env.scratch.join("out");
    let s = |p: &Path| p.display().to_string();
    let mut daemon = live_daemon(&env, &out, &["--filters", &s(&filters)]);
    let link = |name: &str| {
        let path = env.scratch.join(name);
        std::os::unix::fs::symlink(real_python(), &path).unwrap();
        path
    };
    let (job_a, job_b) = (link("job_a"), link("job_b"));
    // a: excluded by the first rules, waiting to allocate; b: traced, allocated, holding.
    let mut a = Forking::start_as(&env, "a", &job_a, None);
    let mut b = Job::start(&env, "b", &job_b, 1, 100, None);
    let b_pid = b.wait_ready();
    let hup = |daemon: &mut Tracer, count: usize| {
        daemon.signal(libc::SIGHUP);
        let deadline = Instant::now() + Duration::from_secs(20);
        while daemon.stderr().matches("SIGHUP: filters applied again").count() < count {
            assert!(Instant::now() < deadline, "SIGHUP not handled:\n{}", daemon.stderr());
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    // The second rules exclude b instead: b's job ends at once, a is traced from its next call.
    std::fs::write(&filters, "--exclude-comm job_b\n").unwrap();
    hup(&mut daemon, 1);
    let a_child = a.run();
    // A file with an error leaves the rules as they were.
    std::fs::write(&filters, "--exclude-comm job_b\n--exclude-comm\n").unwrap();
    hup(&mut daemon, 2);
    daemon.signal(libc::SIGTERM);
    let (code, stderr) = daemon.finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("line 2") && stderr.contains("the rules stay as they were"), "{stderr}");

    let folders = run_folders(&out);
    let mut want = vec![a.pid, a_child, b_pid];
    want.sort();
    assert_eq!(folders.iter().map(|(p, _)| *p).collect::<Vec<_>>(), want, "{stderr}");
    let folder = |pid: u32| &folders.iter().find(|(p, _)| *p == pid).unwrap().1;
    for (pid, ledger) in [(a.pid, &a.ledgers[0]), (a_child, &a.ledgers[1]), (b_pid, &b.ledger)] {
        assert_exact(&read_ledger(ledger), &read_run(folder(pid)));
    }
    let b_run = read_run(folder(b_pid));
    let reason = meta(b_run.db("device_1"), "stop_reason");
    assert_eq!(reason.as_deref(), Some("excluded by --exclude-comm (on SIGHUP)"));
}

#[test]
fn an_out_of_memory_failure_raises_the_jobs_counters() {
    let env = env("daemon_oom_counter");
    let out = env.scratch.join("out");
    let daemon = live_daemon(&env, &out, &[]);
    let oom = ["--oom-size", "1099511627776"];
    let mut job = Job::start_with(&env, "oom", &real_python(), 0, 10, None, (&oom, &[]));
    let pid = job.wait_ready();
    let failed = read_ledger(&job.ledger).iter().filter(|e| e.rc != 0).count();
    assert_eq!(failed, 1, "the job's one failure, by its own ledger");
    let metrics = metrics_address(&daemon.stderr());
    let series = |name: &str| format!(r#"{name}{{pid="{pid}",comm="python3"#);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, body) = get(metrics, "/metrics").unwrap();
        let value = |name: &str| {
            body.lines()
                .find(|l| l.starts_with(&series(name)))
                .and_then(|l| l.rsplit(' ').next()?.parse::<usize>().ok())
        };
        let got = (value("memscope_out_of_memory_total"), value("memscope_failed_allocations_total"));
        if got == (Some(failed), Some(failed)) {
            break;
        }
        assert!(Instant::now() < deadline, "{got:?}, the ledger failed {failed}:\n{body}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `daemon --json`: a status line a second on stdout, with each running job's live and peak
/// bytes per device as its own ledger has them.
#[test]
fn the_daemons_json_status_has_each_running_jobs_ledger_bytes() {
    let env = env("daemon_status");
    let out = env.scratch.join("out");
    let mut daemon = live_daemon(&env, &out, &["--json"]);
    let stdout = daemon.child.stdout.take().unwrap();
    let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let sink = std::sync::Arc::clone(&lines);
    std::thread::spawn(move || {
        use std::io::BufRead as _;
        for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
            sink.lock().unwrap().push(line);
        }
    });
    let python = real_python();
    let (mut a, mut b) = (Job::start(&env, "a", &python, 0, 40, None), Job::start(&env, "b", &python, 1, 70, None));
    let (pa, pb) = (a.wait_ready(), b.wait_ready());
    let want =
        [(pa, "0", ledger_live_bytes(&read_ledger(&a.ledger))), (pb, "1", ledger_live_bytes(&read_ledger(&b.ledger)))];
    let seen = |line: &serde_json::Value| {
        want.iter().all(|(pid, device, bytes)| {
            line["devices"].as_array().into_iter().flatten().any(|d| {
                d["job"].as_str().is_some_and(|j| j.starts_with(&format!("{pid} (")))
                    && d["device"] == *device
                    && d["live_bytes"].as_u64() == Some(*bytes)
                    && d["peak_bytes"].as_u64() == Some(*bytes)
            })
        })
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let line = loop {
        let parsed: Vec<serde_json::Value> = lines
            .lock()
            .unwrap()
            .iter()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect();
        if let Some(line) = parsed.iter().rev().find(|l| seen(l)) {
            break line.clone();
        }
        assert!(Instant::now() < deadline, "no status line with the ledgers' bytes {want:?}: {:?}", parsed.last());
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(line["jobs"].as_u64(), Some(2), "{line}");
    assert_eq!(line["lost"].as_u64(), Some(0), "{line}");
    assert!(line["calls"].as_u64().unwrap() >= 110, "{line}");
    drop((a, b));
    daemon.signal(libc::SIGINT);
    let (code, stderr) = daemon.finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");
}
