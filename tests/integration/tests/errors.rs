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
    assert!(line.contains("no accelerator library") && line.contains("--lib"), "{line}");
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
    // Nothing names a runtime: the trace starts all the same (the job may load one by path), says
    // so, and says at the end that none came; the command's status is passed on.
    let env = env("err_launch_nolib");
    let out = env.scratch.join("out");
    let output = Command::new(&env.bin)
        .args(["trace", "--output", out.to_str().unwrap(), "--", "true"])
        .env_remove("ASCEND_HOME_PATH")
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("no accelerator library is known before the launch") && stderr.contains("--lib"),
        "{stderr}"
    );
    assert!(stderr.contains("the job loaded no accelerator library"), "{stderr}");
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

/// The part of a message that says again what an earlier part of it said (`a: b: b`, or
/// `a (…: b): b`), as when an error's text includes its cause and the cause is printed again after
/// it. Parts are split at ": "; short ones (a word, a short file name) are not counted.
fn repeated_cause(line: &str) -> Option<String> {
    let said = ["memscope-bpf: error: ", "memscope-bpf: warning: ", "memscope-bpf: "]
        .iter()
        .find_map(|prefix| line.strip_prefix(prefix))
        .unwrap_or(line);
    let parts: Vec<String> = said.split(": ").map(|p| p.trim().to_lowercase()).collect();
    for (j, later) in parts.iter().enumerate().filter(|(_, p)| p.len() >= 8) {
        if let Some(earlier) = parts[..j].iter().find(|e| e.len() >= 8 && (e.contains(later) || later.contains(*e))) {
            return Some(format!("{earlier:?} then {later:?}"));
        }
    }
    None
}

fn repeats_a_cause(line: &str) -> bool {
    repeated_cause(line).is_some()
}

/// A tmpfs mounted for one test, unmounted when dropped (also when the test fails).
struct Mount(std::path::PathBuf);

impl Mount {
    fn tmpfs(dir: &Path, options: &str) -> Option<Self> {
        std::fs::create_dir_all(dir).unwrap();
        let ok = Command::new("mount").args(["-t", "tmpfs", "-o", options, "tmpfs"]).arg(dir).status().ok()?.success();
        ok.then(|| Self(dir.to_owned()))
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// Asserts a command failed with a non-zero exit and an error line, and that no line of its
/// stderr says a cause twice; returns the error line.
fn fails_saying_each_cause_once(what: &str, code: i32, stderr: &str) -> String {
    assert!(code != 0 && code != 101, "{what}: exit {code}, expected a clean failure:\n{stderr}");
    let line = stderr.lines().rfind(|l| l.starts_with("memscope-bpf: error: "));
    let line = line.unwrap_or_else(|| panic!("{what}: no error line:\n{stderr}")).to_owned();
    for l in stderr.lines() {
        assert!(repeated_cause(l).is_none(), "{what}: a cause said twice ({}):\n{l}", repeated_cause(l).unwrap());
    }
    line
}

#[test]
fn failing_commands_say_each_cause_once() {
    let env = env("err_each_cause_once");
    let dir = &env.scratch;
    let bin = |args: &[&str]| run(&env.bin, args);
    let traced = |output: &Path, program: &[&str]| {
        let out = Command::new(&env.bin)
            .args(["trace", "--quiet", "--output", output.to_str().unwrap(), "--"])
            .args(program)
            .env("ASCEND_HOME_PATH", &env.ascend_home)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let workload = env.workload.parent().unwrap().join("standin_badlibs.py").display().to_string();
    let ledger = dir.join("ledger.jsonl").display().to_string();
    let job = ["python3", workload.as_str(), "--ledger", ledger.as_str(), "--rounds", "3"];

    // A real trace DB to damage.
    let (code, stderr) = traced(&dir.join("good"), &job);
    assert_eq!(code, 0, "{stderr}");
    let db = read_output(&dir.join("good")).db("device_0").to_owned();

    // analyze: not SQLite; SQLite without the dump table; damaged pages; locked by a writer.
    let text = dir.join("notes.db");
    std::fs::write(&text, b"plain text, not a database\n").unwrap();
    let (code, stderr) = bin(&["analyze", text.to_str().unwrap()]);
    fails_saying_each_cause_once("analyze on a text file", code, &stderr);
    let other = dir.join("other.db");
    rusqlite::Connection::open(&other).unwrap().execute_batch("CREATE TABLE t (a)").unwrap();
    let (code, stderr) = bin(&["analyze", other.to_str().unwrap()]);
    fails_saying_each_cause_once("analyze on a DB without its table", code, &stderr);
    let damaged = dir.join("damaged.db");
    let mut bytes = std::fs::read(&db).unwrap();
    let page = 4096;
    assert!(bytes.len() > 4 * page, "the DB has pages past its schema");
    let end = bytes.len() - page;
    bytes[2 * page..end].fill(0xff);
    std::fs::write(&damaged, &bytes).unwrap();
    let (code, stderr) = bin(&["analyze", "--no-write", damaged.to_str().unwrap()]);
    let line = fails_saying_each_cause_once("analyze on a damaged DB", code, &stderr);
    assert!(line.contains("damaged.db"), "{line}");
    let locked = dir.join("locked.db");
    std::fs::copy(&db, &locked).unwrap();
    let holder = rusqlite::Connection::open(&locked).unwrap();
    holder.execute_batch("BEGIN EXCLUSIVE").unwrap();
    let (code, stderr) = bin(&["analyze", locked.to_str().unwrap()]);
    let line = fails_saying_each_cause_once("analyze on a locked DB", code, &stderr);
    assert!(line.contains("locked") && !line.contains("not an SQLite"), "{line}");
    drop(holder);

    // trace --output: a file, a read-only file system, one without inodes, one without space.
    let a_file = dir.join("a-file");
    std::fs::write(&a_file, b"").unwrap();
    let (code, stderr) = traced(&a_file.join("out"), &job);
    fails_saying_each_cause_once("trace --output under a file", code, &stderr);
    let (code, stderr) = traced(&a_file, &job);
    fails_saying_each_cause_once("trace --output onto a file", code, &stderr);
    match Mount::tmpfs(&dir.join("ro"), "ro,size=1m") {
        Some(m) => {
            let (code, stderr) = traced(&m.0, &job);
            fails_saying_each_cause_once("trace --output on a read-only file system", code, &stderr);
        }
        None => println!("SKIPPED (read-only output): cannot mount a tmpfs here"),
    }
    // Room for the folders but not the DB file: the trace starts, then cannot write.
    match Mount::tmpfs(&dir.join("inodes"), "size=1m,nr_inodes=4") {
        Some(m) => {
            let (code, stderr) = traced(&m.0, &job);
            fails_saying_each_cause_once("trace --output with no inode left for the DB", code, &stderr);
        }
        None => println!("SKIPPED (no inodes): cannot mount a tmpfs here"),
    }
    match Mount::tmpfs(&dir.join("full"), "size=40k") {
        Some(m) => {
            let (code, stderr) = traced(&m.0, &job);
            fails_saying_each_cause_once("trace --output on a full file system", code, &stderr);
        }
        None => println!("SKIPPED (full): cannot mount a tmpfs here"),
    }

    // trace of a program that is not executable.
    let script = dir.join("not-executable");
    std::fs::write(&script, b"#!/bin/sh\ntrue\n").unwrap();
    let (code, stderr) = traced(&dir.join("noexec"), &[script.to_str().unwrap()]);
    let line = fails_saying_each_cause_once("trace of a file that is not executable", code, &stderr);
    assert!(line.contains("not-executable"), "{line}");

    // A damaged library: an ELF header of this machine with a section table past the end.
    let lib = dir.join("libascendcl.so");
    let mut elf = vec![0u8; 64];
    elf[..4].copy_from_slice(b"\x7fELF");
    (elf[4], elf[5], elf[6]) = (2, 1, 1);
    elf[16..18].copy_from_slice(&3u16.to_le_bytes());
    let machine: u16 = if cfg!(target_arch = "aarch64") { 183 } else { 62 };
    elf[18..20].copy_from_slice(&machine.to_le_bytes());
    elf[0x28..0x30].copy_from_slice(&(1u64 << 30).to_le_bytes());
    elf[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
    elf[0x3c..0x3e].copy_from_slice(&5u16.to_le_bytes());
    elf.extend_from_slice(&[b'x'; 100]);
    std::fs::write(&lib, &elf).unwrap();
    let (code, stderr) =
        bin(&["trace", "--lib", lib.to_str().unwrap(), "--output", dir.join("badlib").to_str().unwrap(), "--", "true"]);
    fails_saying_each_cause_once("trace --lib of a damaged library", code, &stderr);
    let probes = Command::new(&env.bin).args(["probes", "--lib", lib.to_str().unwrap()]).output().unwrap();
    let listed = String::from_utf8_lossy(&probes.stdout);
    assert!(listed.contains("unreadable:") && !listed.lines().any(repeats_a_cause), "{listed}");
    let code = probes.status.code().unwrap_or(-1);
    fails_saying_each_cause_once("probes --lib of a damaged library", code, &String::from_utf8_lossy(&probes.stderr));
}

#[test]
fn a_repeated_cause_is_seen_by_the_check() {
    // The reported forms, as the check must see them (it is what the test above relies on).
    assert!(repeats_a_cause("memscope-bpf: error: x.so: Unknown file magic: Unknown file magic"));
    assert!(repeats_a_cause(
        "error: cannot write /o/x.db: No space left on device (os error 28): No space left on device (os error 28)"
    ));
    assert!(repeats_a_cause(
        "memscope-bpf: error: d.db: cannot write the results: database is locked; retry: database is locked"
    ));
    assert!(!repeats_a_cause(
        "memscope-bpf: error: cannot open /x/libascendcl.so: No such file or directory (os error 2)"
    ));
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

#[test]
fn a_launched_commands_exit_status_is_passed_on() {
    // As `time` and `strace` do: a script that runs its job under the tracer must see the job
    // fail. The trace itself is complete (its summary printed, its folder written).
    let env = env("exit_status");
    for (script, want) in [("exit 3", 3), ("kill -TERM $$", 128 + 15), ("exit 0", 0)] {
        let out = env.scratch.join(format!("out-{want}"));
        let output = Command::new(&env.bin)
            .args(["trace", "--quiet", "--output", out.to_str().unwrap(), "--", "sh", "-c", script])
            .env("ASCEND_HOME_PATH", &env.ascend_home)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(want), "`{script}`: {stderr}");
        assert!(!stderr.contains("error"), "the job's status is no error of the tracer's: {stderr}");
        assert!(stderr.contains(&format!("target exited with status {want}")), "{stderr}");
    }
}

#[test]
fn a_target_that_has_exited_is_said_to_have_exited_not_to_lack_libraries() {
    // A zombie: exited, not reaped by its parent (this test), with its /proc entry still there.
    let env = env("err_zombie");
    let mut child = Command::new("true").spawn().unwrap();
    let pid = child.id();
    std::thread::sleep(std::time::Duration::from_millis(300));
    let out = env.scratch.join("out");
    let (code, stderr) = run(&env.bin, &["trace", "--pid", &pid.to_string(), "--output", out.to_str().unwrap()]);
    let _ = child.wait();
    assert_ne!(code, 0);
    let line = one_error_line(&stderr);
    assert!(line.contains(&format!("process {pid} has exited")), "{line}");
    assert!(!line.contains("library"), "{line}");
}
