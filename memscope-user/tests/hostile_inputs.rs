//! What a demanding user or another user on the machine can hand the offline verbs: FIFOs and
//! device nodes as inputs, device nodes and planted symlinks as outputs. Each must be one clear
//! error or a correct write, never a hang, and never a file replaced that is not ours.

#[allow(dead_code)]
mod corpus;

use std::os::unix::fs::FileTypeExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memscope-hostile-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("tmp")).unwrap();
    dir
}

/// Runs the binary, killed after 20 s: a verb that hangs fails the test, not the suite.
fn bpf(dir: &Path, args: &[&str]) -> (Option<i32>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_memscope-bpf"))
        .args(args)
        .current_dir(dir)
        .env("TMPDIR", dir.join("tmp"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > Duration::from_secs(20) {
            child.kill().unwrap();
            panic!("memscope-bpf {args:?} still ran after 20 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn mkfifo(path: &Path) {
    let status = Command::new("mkfifo").arg(path).status().unwrap();
    assert!(status.success());
}

/// A small trace as msMemScope writes it, imported into a DB.
fn a_db(dir: &Path) -> PathBuf {
    let csv = dir.join("memscope_dump_20250101000000.csv");
    std::fs::write(&csv, corpus::csv(&corpus::training(2, false), "0", corpus::Style::Bare)).unwrap();
    let (code, err) = bpf(dir, &["import", csv.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{err}");
    csv.with_extension("db")
}

#[test]
fn a_fifo_given_as_input_is_one_error_for_every_verb() {
    let dir = scratch("fifo");
    let fifo = dir.join("f.db");
    mkfifo(&fifo);
    let db = a_db(&dir);
    let f = fifo.to_str().unwrap();
    let cases: [&[&str]; 7] = [
        &["analyze", f],
        &["advise", f],
        &["report", f, "-o", "out.html"],
        &["export", "--format", "perfetto", f, "-o", "out.json"],
        &["compare", db.to_str().unwrap(), f],
        &["import", f],
        &["analyze", "/dev/zero"],
    ];
    for args in cases {
        let (code, err) = bpf(&dir, args);
        assert_eq!(code, Some(1), "{args:?}: {err}");
        assert!(err.contains("FIFO") || err.contains("character device"), "{args:?} says what the input is: {err}");
        assert!(err.trim().lines().count() <= 3, "{args:?}: one error, not a trace: {err}");
    }
    // The daemon's filter file: refused before anything is traced (and before its privileges
    // are checked, so this runs unprivileged too).
    let (code, err) = bpf(&dir, &["daemon", "--filters", f, "--output", "out"]);
    assert_ne!(code, Some(0), "{err}");
    assert!(err.contains("FIFO"), "{err}");
    assert!(fifo.metadata().unwrap().file_type().is_fifo(), "the FIFO is left as it was");
    let _ = std::fs::remove_dir_all(&dir);
}
