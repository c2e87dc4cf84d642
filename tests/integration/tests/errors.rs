//! Bad input gets one clear line naming the problem and the fix, a non-zero exit, and leaves no
//! half-made output behind.

use std::path::Path;
use std::process::{Command, Stdio};

use memscope_integration::*;

/// Runs the tracer to completion; returns (exit code, stderr).
fn run(bin: &Path, args: &[&str]) -> (i32, String) {
    let out = Command::new(bin).args(args).stdin(Stdio::null()).output().unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn one_error_line(stderr: &str) -> &str {
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "expected one line, got:\n{stderr}");
    assert!(lines[0].starts_with("memscope-bpf: error: "), "{stderr}");
    lines[0]
}

#[test]
fn no_such_pid() {
    let env = env("err_pid");
    let out = env.scratch.join("out");
    // pid_max is at most 2^22.
    let (code, stderr) = run(&env.bin, &["trace", "--pid", "4999999", "--output", out.to_str().unwrap()]);
    assert_ne!(code, 0);
    let line = one_error_line(&stderr);
    assert!(line.contains("no process with pid 4999999") && line.contains("ps -p"), "{line}");
    assert!(!out.exists(), "a wrong pid must leave nothing behind, not even the output folder");
}

#[test]
fn target_without_an_ascend_library() {
    let env = env("err_nolib");
    let mut sleeper = Command::new("sleep").arg("30").spawn().unwrap();
    let pid = sleeper.id().to_string();
    let out = env.scratch.join("out");
    let (code, stderr) = run(&env.bin, &["trace", "--pid", &pid, "--output", out.to_str().unwrap()]);
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    assert_ne!(code, 0);
    let line = one_error_line(&stderr);
    assert!(line.contains("no Ascend runtime library") && line.contains("--lib"), "{line}");
}

#[test]
fn output_folder_not_writable() {
    let env = env("err_output");
    let file = env.scratch.join("a-file");
    std::fs::write(&file, b"").unwrap();
    let (code, stderr) = run(&env.bin, &["trace", "--output", file.to_str().unwrap(), "--", "true"]);
    assert_ne!(code, 0);
    let line = one_error_line(&stderr);
    assert!(line.contains("not writable") && line.contains("--output"), "{line}");
}

#[test]
fn not_root() {
    let env = env("err_not_root");
    // Drop to nobody with no capabilities; setpriv is util-linux (installed by xtask setup).
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all"])
        .arg(&env.bin)
        .args(["trace", "--output", "/tmp", "--", "true"])
        .output()
        .expect("setpriv");
    assert_ne!(out.status.code(), Some(0));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let line = one_error_line(&stderr);
    assert!(line.contains("needs root") && line.contains("sudo"), "{line}");
}

#[test]
fn launch_of_a_missing_program() {
    let env = env("err_launch");
    let out = env.scratch.join("out");
    let (code, stderr) = Command::new(&env.bin)
        .args(["trace", "--output", out.to_str().unwrap(), "--", "memscope-no-such-program"])
        .env("ASCEND_HOME_PATH", &env.ascend_home)
        .output()
        .map(|o| (o.status.code().unwrap_or(-1), String::from_utf8_lossy(&o.stderr).into_owned()))
        .unwrap();
    assert_ne!(code, 0);
    let line = one_error_line(&stderr);
    assert!(line.contains("cannot find `memscope-no-such-program`"), "{line}");
}

#[test]
fn launch_without_any_library_to_probe() {
    let env = env("err_launch_nolib");
    let out = env.scratch.join("out");
    let output = Command::new(&env.bin)
        .args(["trace", "--output", out.to_str().unwrap(), "--", "true"])
        .env_remove("ASCEND_HOME_PATH")
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .unwrap();
    assert_ne!(output.status.code(), Some(0));
    let stderr = String::from_utf8_lossy(&output.stderr);
    let line = one_error_line(&stderr);
    assert!(line.contains("no Ascend runtime library") && line.contains("ASCEND_HOME_PATH"), "{line}");
}

#[test]
fn probes_lists_what_the_stand_in_exports() {
    let env = env("probes_verb");
    let out = Command::new(&env.bin).args(["probes", "--lib"]).arg(&env.libascendcl).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    // Checked against `nm -D` of the same file: every exported Impl symbol is listed as attached.
    let nm = Command::new("nm").args(["-D", "--defined-only"]).arg(&env.libascendcl).output().unwrap();
    let exported = String::from_utf8_lossy(&nm.stdout);
    for api in ["aclrtMalloc", "aclrtFree", "aclrtMapMem", "aclrtSetDevice"] {
        let implementation = format!("{api}Impl");
        assert!(exported.lines().any(|l| l.ends_with(&format!(" {implementation}"))), "nm lacks {implementation}");
        assert!(listed(&text, "attach", api, &implementation, "dynsym"), "{text}");
        assert!(listed(&text, "skip", api, api, "dynsym"), "{text}");
    }
    assert!(!text.contains("missing"), "{text}");
}

#[test]
fn probes_by_pid_lists_the_library_the_process_mapped() {
    let env = env("probes_pid");
    let ledger = env.scratch.join("ledger.jsonl");
    let mut workload = spawn_workload(&env, &ledger, &["--start-delay", "3", "--steps", "1"]);
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let out = Command::new(&env.bin).args(["probes", "--pid", &workload.id().to_string()]).output().unwrap();
    let _ = wait_child(&mut workload, std::time::Duration::from_secs(30));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let lib = env.libascendcl.canonicalize().unwrap();
    assert!(text.contains(&format!("{} (mapped by pid", lib.display())), "{text}");
    assert!(listed(&text, "attach", "aclrtMalloc", "aclrtMallocImpl", "dynsym"), "{text}");
    assert!(!text.contains("/proc/"), "paths are shown as the process sees them: {text}");
}

/// Whether a message says one thing twice in a row (`a: b: b`), as when an error's text
/// includes its cause and the cause is printed again after it.
fn repeats_a_cause(line: &str) -> bool {
    let parts: Vec<&str> = line.split(": ").collect();
    parts.windows(2).any(|w| w[0] == w[1])
}

#[test]
fn a_duration_too_long_for_the_clock_is_an_error_not_a_panic() {
    let env = env("err_duration");
    let (code, stderr) = run(&env.bin, &["trace", "--duration", "99999999999999999999", "--", "true"]);
    assert_eq!(code, 2, "a usage error, not a panic (101):\n{stderr}");
    assert!(stderr.contains("too long") && !stderr.contains("panicked"), "{stderr}");
}

#[test]
fn a_lib_that_is_a_device_is_named_so_by_trace_and_probes_alike() {
    let env = env("err_lib_device");
    let out = env.scratch.join("out");
    let (code, stderr) =
        run(&env.bin, &["trace", "--lib", "/dev/zero", "--output", out.to_str().unwrap(), "--", "true"]);
    assert_ne!(code, 0);
    let traced = one_error_line(&stderr).to_owned();
    let (code, stderr) = run(&env.bin, &["probes", "--lib", "/dev/zero"]);
    assert_ne!(code, 0);
    let probed = one_error_line(&stderr).to_owned();
    assert!(traced.contains("/dev/zero is not a regular file (it is a character device)"), "{traced}");
    assert_eq!(traced, probed, "one message for one problem");
}

#[test]
fn an_error_prints_each_cause_once() {
    let env = env("err_causes_once");
    let lib = env.scratch.join("libascendcl.so");
    std::fs::write(&lib, b"not an ELF file\n").unwrap();
    let out = env.scratch.join("out");
    let (code, stderr) =
        run(&env.bin, &["trace", "--lib", lib.to_str().unwrap(), "--output", out.to_str().unwrap(), "--", "true"]);
    assert_ne!(code, 0);
    let last = stderr.lines().last().unwrap_or_default();
    assert!(last.starts_with("memscope-bpf: error: ") && last.contains("is not an ELF file"), "{stderr}");
    assert!(!stderr.lines().any(repeats_a_cause), "a cause printed twice:\n{stderr}");
    let probes = Command::new(&env.bin).args(["probes", "--lib", lib.to_str().unwrap()]).output().unwrap();
    let text = String::from_utf8_lossy(&probes.stdout);
    assert!(text.contains("unreadable:") && !text.lines().any(repeats_a_cause), "{text}");
}

#[test]
fn trace_of_a_pid_whose_maps_cannot_be_read_gives_the_real_cause_as_probes_does() {
    let env = env("err_pid_maps");
    // Reproduced with a process this root cannot inspect (here pid 1, an init whose maps are
    // closed even to root); the OS's own error is the ground truth.
    let Err(cause) = std::fs::read_to_string("/proc/1/maps") else {
        println!("SKIPPED: /proc/1/maps is readable here, so no process hides its maps from this root");
        return;
    };
    let cause = cause.to_string();
    let out = env.scratch.join("out");
    let (code, stderr) = run(&env.bin, &["trace", "--pid", "1", "--output", out.to_str().unwrap()]);
    assert_ne!(code, 0);
    let traced = one_error_line(&stderr).to_owned();
    let (_, stderr) = run(&env.bin, &["probes", "--pid", "1"]);
    let probed = one_error_line(&stderr).to_owned();
    assert!(traced.contains("/proc/1/maps") && traced.contains(&cause), "{traced} (cause: {cause})");
    assert_eq!(traced, probed);
    assert!(!out.exists(), "no output folder for a trace that cannot start");
}

/// Runs a verb as `nobody` (no capabilities): a folder mode 0555 stops only non-root users.
fn run_as_nobody(bin: &Path, args: &[&str]) -> (i32, String, String) {
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all"])
        .arg(bin)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("setpriv");
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code().unwrap_or(-1), text(&out.stdout), text(&out.stderr))
}

#[test]
fn a_wal_db_without_its_shm_in_a_read_only_folder_is_read_or_the_fix_is_named() {
    let env = env("err_wal_readonly");
    // A real trace DB, from a short launch of the stand-in job.
    let out = env.scratch.join("out");
    let workload = env.workload.parent().unwrap().join("standin_badlibs.py");
    let ledger = env.scratch.join("ledger.jsonl");
    let status = Command::new(&env.bin)
        .args(["trace", "--quiet", "--output", out.to_str().unwrap(), "--", "python3"])
        .arg(&workload)
        .args(["--ledger", ledger.to_str().unwrap(), "--rounds", "3"])
        .env("ASCEND_HOME_PATH", &env.ascend_home)
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    let db = read_output(&out).db("device_0").to_owned();
    // Outside the scratch tree, whose parents `nobody` may not enter.
    let base = std::env::temp_dir().join(format!("memscope-wal-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let (whole, pending) = (base.join("whole"), base.join("pending"));
    for d in [&base, &whole, &pending] {
        std::fs::create_dir_all(d).unwrap();
    }
    let name = "memscope_dump_1.db";
    // WAL mode with everything in the main file (a killed trace after its last checkpoint).
    std::fs::copy(&db, whole.join(name)).unwrap();
    let conn = rusqlite::Connection::open(whole.join(name)).unwrap();
    conn.pragma_update(None, "journal_mode", "WAL").unwrap();
    drop(conn);
    assert!(!whole.join(format!("{name}-shm")).exists() && !whole.join(format!("{name}-wal")).exists());
    // WAL mode with rows still in the -wal (a killed trace before it): copied without the -shm.
    let work = base.join("work");
    std::fs::create_dir_all(&work).unwrap();
    std::fs::copy(whole.join(name), work.join(name)).unwrap();
    let conn = rusqlite::Connection::open(work.join(name)).unwrap();
    conn.pragma_update(None, "wal_autocheckpoint", 0).unwrap();
    conn.execute_batch("INSERT INTO memscope_dump SELECT * FROM memscope_dump LIMIT 1").unwrap();
    std::fs::copy(work.join(name), pending.join(name)).unwrap();
    std::fs::copy(work.join(format!("{name}-wal")), pending.join(format!("{name}-wal"))).unwrap();
    drop(conn);
    let mode = |p: &Path, m: u32| std::fs::set_permissions(p, std::os::unix::fs::PermissionsExt::from_mode(m)).unwrap();
    for d in [&whole, &pending] {
        for f in std::fs::read_dir(d).unwrap() {
            mode(&f.unwrap().path(), 0o644);
        }
        mode(d, 0o555);
    }
    mode(&base, 0o755);

    // Ground truth: the same analysis of the same file where SQLite can make its index.
    let writable = Command::new(&env.bin).args(["analyze", "--no-write"]).arg(&db).output().unwrap();
    assert!(writable.status.success());
    let whole_db = whole.join(name).display().to_string();
    let (code, stdout, stderr) = run_as_nobody(&env.bin, &["analyze", "--no-write", &whole_db]);
    assert_eq!(code, 0, "{stderr}");
    let same = |text: &str| text.replace(&whole_db, "DB");
    assert_eq!(same(&stdout), String::from_utf8_lossy(&writable.stdout).replace(&db.display().to_string(), "DB"));
    // Writing the results there cannot work: said as such, not as "not an SQLite database".
    let (code, _, stderr) = run_as_nobody(&env.bin, &["analyze", &whole_db]);
    assert_ne!(code, 0);
    assert!(
        stderr.contains("read-only") && stderr.contains("--no-write") && !stderr.contains("not an SQLite"),
        "{stderr}"
    );
    let pending_db = pending.join(name).display().to_string();
    let (code, _, stderr) = run_as_nobody(&env.bin, &["analyze", "--no-write", &pending_db]);
    assert_ne!(code, 0);
    let line = one_error_line(&stderr);
    assert!(line.contains("-wal") && line.contains("copy the trace folder somewhere writable"), "{line}");
    assert!(!line.contains("not an SQLite"), "{line}");
    mode(&whole, 0o755);
    mode(&pending, 0o755);
    std::fs::remove_dir_all(&base).unwrap();
}
