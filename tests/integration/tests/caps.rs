//! Privileged test of the capabilities `memscope-bpf daemon` needs (docs/deploy/README.md):
//! run as an unprivileged user (nobody) holding only those, it traces another user's job; with
//! any one of them missing it stops at once with an error naming it; and with that check
//! skipped, each missing one breaks the daemon, which is how the set was found: none is spare.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use memscope_integration::*;

/// What the daemon needs, as setpriv spells them.
const NEEDED: [&str; 4] = ["bpf", "perfmon", "sys_ptrace", "dac_read_search"];
const NOBODY: u32 = 65534;

/// Starts the daemon as nobody with exactly `caps`; it finds libraries only through the jobs
/// (no --lib, no ASCEND_HOME_PATH of its own), as on a node where each job brings its own.
fn daemon_with(env: &TestEnv, caps: &[&str], skip_check: bool, out: &Path) -> Tracer {
    let list = std::iter::once("-all".to_owned()).chain(caps.iter().map(|c| format!("+{c}"))).collect::<Vec<_>>();
    let list = list.join(",");
    let (inh, amb, bnd) =
        (format!("--inh-caps={list}"), format!("--ambient-caps={list}"), format!("--bounding-set={list}"));
    let wrapper = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", &inh, &amb, &bnd, "--"];
    let out = out.display().to_string();
    let args = ["daemon", "--output", &out, "--listen", "127.0.0.1:0"];
    let skip = std::ffi::OsStr::new("1");
    let vars = [("ASCEND_HOME_PATH", None), ("MEMSCOPE_SKIP_CAP_CHECK", skip_check.then_some(skip))];
    Tracer::spawn_wrapped(env, &wrapper, &args, &vars)
}

/// A job of root's that waits a moment before its first call (the daemon finds its libraries
/// in its environment at its first scan, within a second of its start).
fn start_job(env: &TestEnv, name: &str) -> (Killed, PathBuf, PathBuf) {
    let (ledger, ready) = (env.scratch.join(format!("{name}.jsonl")), env.scratch.join(format!("{name}.ready")));
    let child = Command::new("python3")
        .arg(env.workload.with_file_name("standin_hold.py"))
        .args(["--ledger", &ledger.display().to_string(), "--ready-file", &ready.display().to_string()])
        .args(["--blocks", "50", "--delay", "3", "--hold", "60"])
        .env("ASCEND_HOME_PATH", &env.ascend_home)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    (Killed(child), ledger, ready)
}

/// The job's allocations on /metrics once it is ready and the daemon has drained them.
fn allocations_seen(daemon: &Tracer, env: &TestEnv, name: &str) -> (Option<u64>, usize) {
    let (mut job, ledger, ready) = start_job(env, name);
    let pid: u32 = wait_for_file(&ready, &mut job.0, Duration::from_secs(60)).trim().parse().unwrap();
    let mallocs = read_ledger(&ledger).iter().filter(|e| e.api == "aclrtMalloc" && e.rc == 0).count();
    let metrics = metrics_address(&daemon.stderr());
    let series = format!("memscope_allocations_total{{pid=\"{pid}\",");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (_, body) = get(metrics, "/metrics").unwrap();
        let seen = body.lines().find(|l| l.starts_with(&series)).and_then(|l| l.rsplit(' ').next()?.parse().ok());
        if seen == Some(mallocs as u64) || Instant::now() > deadline {
            return (seen, mallocs);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn the_daemon_runs_with_exactly_its_documented_capabilities_and_names_a_missing_one() {
    let env = env("caps");
    if Command::new("setpriv").arg("--version").output().is_err() {
        eprintln!("SKIPPED: setpriv (util-linux) is not installed");
        return;
    }
    let out = env.scratch.join("out");
    std::fs::create_dir_all(&out).unwrap();
    // nobody writes the jobs' folders and reaches the binary and the scratch folder.
    std::os::unix::fs::chown(&out, Some(NOBODY), Some(NOBODY)).unwrap();
    // For the tier's Insight sweep (tests/insight.rs): these DBs are nobody's, not root's.
    std::fs::write(env.scratch.join("expected_owner"), format!("{NOBODY}:{NOBODY}")).unwrap();
    for dir in [env.scratch.as_path(), env.scratch.parent().unwrap()] {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    // All of them: another user's job is found and traced.
    let mut daemon = daemon_with(&env, &NEEDED, false, &out);
    daemon.wait_live(Duration::from_secs(60));
    let (seen, mallocs) = allocations_seen(&daemon, &env, "all");
    assert_eq!(seen, Some(mallocs as u64), "the job's allocations, as nobody with {NEEDED:?}:\n{}", daemon.stderr());
    daemon.signal(libc::SIGTERM);
    let (code, stderr) = daemon.finish(Duration::from_secs(30));
    assert_eq!(code, Some(0), "{stderr}");

    for missing in NEEDED {
        let caps: Vec<&str> = NEEDED.iter().copied().filter(|c| *c != missing).collect();
        let name = format!("CAP_{}", missing.to_uppercase());
        // Checked: one error naming it, before anything is loaded.
        let (code, stderr) = daemon_with(&env, &caps, false, &out).finish(Duration::from_secs(30));
        assert!(code.is_some_and(|c| c != 0), "without {name}: exit {code:?}\n{stderr}");
        assert!(stderr.contains(&format!("{name} (")) && !stderr.contains(": live:"), "without {name}:\n{stderr}");
        // Not checked: what the missing one breaks.
        let mut daemon = daemon_with(&env, &caps, true, &out);
        if missing == "sys_ptrace" {
            // It loads, but cannot read another user's process: the job is never found.
            daemon.wait_live(Duration::from_secs(60));
            let (seen, _) = allocations_seen(&daemon, &env, "no_ptrace");
            assert_eq!(seen, None, "without {name} the job was traced: the capability is not needed");
            daemon.signal(libc::SIGTERM);
            let _ = daemon.finish(Duration::from_secs(30));
        } else {
            let (code, stderr) = daemon.finish(Duration::from_secs(30));
            assert!(
                code.is_some_and(|c| c != 0) && !stderr.contains(": live:"),
                "without {name} the daemon still ran (exit {code:?}): the capability is not needed\n{stderr}"
            );
        }
    }
}
