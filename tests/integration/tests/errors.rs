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
    assert!(!out.exists() || std::fs::read_dir(&out).unwrap().next().is_none(), "no run folder for a failed start");
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
