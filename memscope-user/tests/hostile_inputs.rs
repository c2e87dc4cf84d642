//! What a demanding user or another user on the machine can hand the offline verbs: FIFOs and
//! device nodes as inputs, device nodes and planted symlinks as outputs. Each must be one clear
//! error or a correct write, never a hang, and never a file replaced that is not ours.

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
    // A filter file is a few lines: a 2 MiB one (a wrong path, a value pasted whole) is refused.
    let big = dir.join("filters");
    std::fs::write(&big, format!("--comm {}\n", "x".repeat(2 << 20))).unwrap();
    let (code, err) = bpf(&dir, &["daemon", "--filters", big.to_str().unwrap(), "--output", "out"]);
    assert_ne!(code, Some(0), "{err}");
    assert!(err.contains("over 1048576 bytes"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

#[test]
fn outputs_that_are_not_regular_files_are_written_to_never_replaced() {
    let dir = scratch("devices");
    let db = a_db(&dir);
    let db = db.to_str().unwrap();
    // A FIFO with a reader: the page arrives through it, and the FIFO stays a FIFO.
    let fifo = dir.join("page.fifo");
    mkfifo(&fifo);
    // A writer of the test's own keeps the reader from waiting forever should the verb never
    // open the FIFO (as when it was replaced by a file): the reader's EOF comes when it closes.
    let guard = std::fs::OpenOptions::new().read(true).write(true).open(&fifo).unwrap();
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || std::fs::read(&fifo).unwrap())
    };
    let (code, err) = bpf(&dir, &["report", db, "-o", fifo.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{err}");
    drop(guard);
    let page = reader.join().unwrap();
    assert!(String::from_utf8_lossy(&page).contains("<html"), "the page came through the FIFO");
    assert!(fifo.metadata().unwrap().file_type().is_fifo());
    // A character device of our own (the kernel's null device, made here, not /dev/null).
    if is_root() {
        let null = dir.join("null");
        assert!(Command::new("mknod").arg(&null).args(["c", "1", "3"]).status().unwrap().success());
        let (code, err) = bpf(&dir, &["export", "--format", "perfetto", db, "-o", null.to_str().unwrap()]);
        assert_eq!(code, Some(0), "{err}");
        assert!(null.metadata().unwrap().file_type().is_char_device(), "still a device, not a JSON file");
    } else {
        eprintln!("skipped the device node case: making one needs root");
    }
    let (code, err) = bpf(&dir, &["report", db, "-o", dir.to_str().unwrap()]);
    assert_eq!(code, Some(1), "a folder as output is an error: {err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_symlink_another_user_planted_in_a_shared_folder_is_not_followed() {
    if !is_root() {
        eprintln!("skipped: planting another user's symlink needs root (chown)");
        return;
    }
    let dir = scratch("planted");
    let db = a_db(&dir);
    let db = db.to_str().unwrap();
    let shared = dir.join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::os::unix::fs::PermissionsExt::from_mode(0o1777)).unwrap();
    let victim = dir.join("victim");
    std::fs::write(&victim, "precious").unwrap();
    let plant = |name: &str| {
        let link = shared.join(name);
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        let c = std::ffi::CString::new(link.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a NUL-terminated path; lchown changes the link itself.
        assert_eq!(unsafe { libc::lchown(c.as_ptr(), 65534, 65534) }, 0);
        link
    };
    // The output itself, and the temporary name the verbs used to write through.
    let out = plant("out.html");
    plant(".page.html.partial");
    let (code, err) = bpf(&dir, &["report", db, "-o", out.to_str().unwrap()]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("symlink"), "{err}");
    let (code, err) = bpf(&dir, &["report", db, "-o", shared.join("page.html").to_str().unwrap()]);
    assert_eq!(code, Some(0), "{err}");
    assert!(std::fs::read_to_string(shared.join("page.html")).unwrap().contains("<html"));
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious", "nothing written through a planted link");
    // trace's --output: the same rule, before anything is traced.
    let (code, err) = bpf(&dir, &["daemon", "--output", plant("runs").to_str().unwrap()]);
    assert_ne!(code, Some(0));
    assert!(err.contains("symlink"), "{err}");
    // One's own symlink is followed: the file it names is written, the link stays.
    let real = dir.join("real.html");
    let mine = dir.join("mine.html");
    std::os::unix::fs::symlink(&real, &mine).unwrap();
    std::fs::write(&real, "old").unwrap();
    let (code, err) = bpf(&dir, &["report", db, "-o", mine.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{err}");
    assert!(std::fs::symlink_metadata(&mine).unwrap().file_type().is_symlink());
    assert!(std::fs::read_to_string(&real).unwrap().contains("<html"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn owner_names_the_job_chose_are_printed_escaped_whatever_their_length() {
    // A 70,000-character owner (past Rust's 65,535 format width) and one carrying terminal
    // escapes and a newline, as a job's own labels can: analyze prints both, escaped.
    let dir = scratch("owners");
    let db = a_db(&dir);
    let long = format!("PTA@{}", "w".repeat(70_000));
    let evil = "PTA@x\u{1b}]0;pwned\u{7}\u{1b}[2J\nmemscope-bpf: forged";
    let conn = rusqlite::Connection::open(&db).unwrap();
    // Every tensor block gets one of the two, so whichever instant is shown has both.
    let n = conn
        .execute(
            "UPDATE memscope_dump SET Attr = json_set(Attr, '$.owner', CASE WHEN ID % 2 = 0 THEN ?1 ELSE ?2 END) \
             WHERE Event = 'MALLOC' AND \"Event Type\" = 'PTA'",
            rusqlite::params![long, evil],
        )
        .unwrap();
    assert!(n >= 2, "the corpus has PTA blocks");
    drop(conn);
    let out = Command::new(env!("CARGO_BIN_EXE_memscope-bpf"))
        .args(["analyze", db.to_str().unwrap(), "--analysis", "decompose", "--no-write"])
        .env("TMPDIR", dir.join("tmp"))
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    assert!(!stdout.contains('\u{1b}') && !stdout.contains('\u{7}'), "no raw escape reaches the terminal");
    assert!(!stdout.lines().any(|l| l.starts_with("memscope-bpf: forged")), "no forged line");
    assert!(stdout.contains("\\u{1b}]0;pwned"), "the label is shown, escaped: {stdout:.2000}");
    assert!(stdout.contains(&"w".repeat(70_000)), "the long owner is printed whole");
    let _ = std::fs::remove_dir_all(&dir);
}
