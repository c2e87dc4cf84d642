//! Native call stacks (`trace --call-stack c`): the stack-chain stand-in
//! (tests/standin/stacks/stack_chain.c) allocates through a chain of functions known by
//! construction, and writes to its ledger what glibc's own unwinder (`backtrace()`, from
//! `.eh_frame`, no frame pointers needed) saw just before each `aclrtMalloc`, with the
//! `__LINE__` of the call and of the inlined step. The ground truth is that ledger, never the
//! tracer.
//!
//! - Built with frame pointers, each MALLOC row's `Call Stack(C)` is the runtime's entry, then
//!   exactly the ledger's functions in its order, with the inlined `chain_step` between
//!   `chain_inner` and `chain_middle` at the ledger's lines; `ms_stacks` calls the stack whole.
//! - Built without (`stack_chain_nofp`), the frame-pointer walk cannot pass the library: the
//!   stack holds the runtime's entry and `chain_inner` (the caller's frame, from the return
//!   address) and is marked truncated, in the column and in `ms_stacks`; with `--unwind dwarf`
//!   (the stack copied and unwound from `.eh_frame`) the same program's stacks are whole again,
//!   equal to the ledger's as with frame pointers.

use std::path::{Path, PathBuf};
use std::time::Duration;

use memscope_integration::*;

/// Keeps the program alive after its allocations: its mappings are read while it lives.
const HOLD_MS: &str = "400";

fn program(env: &TestEnv, name: &str) -> PathBuf {
    env.ascend_home.parent().expect("target/standin").join("bin").join(name)
}

/// Traces `program COUNT LEDGER HOLD_MS` with `--call-stack c` (plus `extra`); returns the DB.
fn trace(env: &TestEnv, name: &str, count: &str, extra: &[&str]) -> (PathBuf, PathBuf) {
    let out = env.scratch.join("out");
    let ledger = env.scratch.join("ledger.txt");
    let exe = program(env, name);
    let (out_s, exe_s, ledger_s) = (out.display().to_string(), exe.display().to_string(), ledger.display().to_string());
    let mut args = vec!["trace", "--output", &out_s, "--call-stack", "c"];
    args.extend_from_slice(extra);
    args.extend(["--", &exe_s, count, &ledger_s, HOLD_MS]);
    let vars = [("ASCEND_HOME_PATH", Some(env.ascend_home.as_os_str()))];
    let (code, stderr) = Tracer::spawn_with(env, &args, &vars).finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");
    let output = read_output(&out);
    (output.db("device_0").to_owned(), ledger)
}

/// One allocation as the ledger saw it.
#[derive(Debug, Default)]
struct Alloc {
    ptr: u64,
    /// Function names of glibc's frames that have one, innermost first.
    functions: Vec<String>,
    inner_line: String,
    step_line: String,
}

fn ledger(path: &Path) -> Vec<Alloc> {
    let text = std::fs::read_to_string(path).unwrap();
    let mut all = Vec::new();
    let mut cur = Alloc::default();
    for line in text.lines() {
        let (tag, rest) = line.split_once(' ').unwrap_or((line, ""));
        match tag {
            // `path(function+0xoff) [0xaddr]`: named frames only.
            "frame" => {
                if let Some(name) = rest.split_once('(').and_then(|(_, r)| r.split(['+', ')']).next()) {
                    if !name.is_empty() {
                        cur.functions.push(name.to_owned());
                    }
                }
            }
            "alloc" => {
                cur.ptr = u64::from_str_radix(rest.split(' ').next().unwrap().trim_start_matches("0x"), 16).unwrap()
            }
            "line" if rest.starts_with("chain_inner ") => cur.inner_line = rest["chain_inner ".len()..].to_owned(),
            "line" if rest.starts_with("chain_step ") => cur.step_line = rest["chain_step ".len()..].to_owned(),
            "end" => all.push(std::mem::take(&mut cur)),
            _ => {}
        }
    }
    all
}

/// (Ptr, `Call Stack(C)`) of every HAL MALLOC row, and `ms_stacks`' cut of the stack with that
/// text.
fn malloc_stacks(db: &Path) -> Vec<(u64, String, String)> {
    let conn = rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
    let mut stmt = conn
        .prepare(
            "SELECT d.Ptr, d.\"Call Stack(C)\", s.cut FROM memscope_dump d LEFT JOIN ms_stacks s ON s.text = d.\"Call Stack(C)\" \
             WHERE d.Event = 'MALLOC' AND d.\"Event Type\" = 'HAL' ORDER BY d.ID",
        )
        .unwrap();
    stmt.query_map([], |r| {
        let ptr: String = r.get(0)?;
        Ok((
            u64::from_str_radix(ptr.trim_start_matches("0x"), 16).unwrap(),
            r.get(1)?,
            r.get::<_, Option<String>>(2)?.unwrap_or_default(),
        ))
    })
    .unwrap()
    .map(Result::unwrap)
    .collect()
}

/// A column line's function (`path(function+0xoff) [0xaddr] ...`) and what follows the address.
fn function_of(line: &str) -> Option<(&str, &str)> {
    let (_, rest) = line.split_once('(')?;
    let name = rest.split(['+', ')']).next()?;
    let after = rest.split_once("] ").map_or("", |(_, a)| a);
    Some((name, after))
}

/// Insight's reading of the stack columns (reference §3.3): it finds them through
/// `pragma_table_info` by the `Call Stack` prefix, Python then C, and reads `select *` rows by
/// position. Each MALLOC row's C text read that way is the one read by name.
fn assert_insight_reads_the_stacks(db: &Path) {
    let conn = rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
    let found: Vec<(i64, String)> = conn
        .prepare("SELECT cid, name FROM pragma_table_info('memscope_dump') WHERE name LIKE 'Call Stack%' ORDER BY cid")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(found, [(10, "Call Stack(Python)".to_owned()), (11, "Call Stack(C)".to_owned())]);
    let mut stmt = conn.prepare("SELECT * FROM memscope_dump WHERE Event = 'MALLOC'").unwrap();
    let by_position: Vec<String> = stmt.query_map([], |r| r.get(11)).unwrap().map(Result::unwrap).collect();
    assert!(!by_position.is_empty() && by_position.iter().all(|t| t.contains("aclrtMalloc")), "{by_position:?}");
}

/// Every allocation's row holds the runtime's entry, then exactly the ledger's chain with the
/// inlined step at its lines, and the stack is whole.
fn assert_whole_chains(db: &Path, ledger_path: &Path) {
    assert_insight_reads_the_stacks(db);
    let allocs = ledger(ledger_path);
    assert!(!allocs.is_empty(), "the workload's ledger");
    let rows = malloc_stacks(db);
    for alloc in &allocs {
        let (_, text, cut) = rows
            .iter()
            .find(|(ptr, ..)| *ptr == alloc.ptr)
            .unwrap_or_else(|| panic!("no MALLOC row for {:#x}", alloc.ptr));
        let lines: Vec<(&str, &str)> = text.lines().filter_map(function_of).collect();
        assert!(lines[0].0.starts_with("aclrtMalloc"), "innermost is the traced runtime call:\n{text}");
        let expected_inline = ["chain_inner", "chain_step", "chain_middle"];
        let names: Vec<&str> = lines.iter().map(|(n, _)| *n).collect();
        assert_eq!(&names[1..4], expected_inline, "the chain, with its inlined step:\n{text}");
        // glibc's frames (no inlined ones), each in order, named as the DB names them.
        let outer: Vec<&str> = names[1..].iter().copied().filter(|n| *n != "chain_step").collect();
        let named_by_glibc: Vec<&str> =
            alloc.functions.iter().map(String::as_str).take_while(|f| *f != "__libc_start_main").collect();
        assert!(outer.starts_with(&named_by_glibc), "DB {outer:?}\nledger {named_by_glibc:?}\n{text}");
        assert!(
            lines[1].1.ends_with(&alloc.inner_line),
            "chain_inner at the aclrtMalloc call ({}):\n{text}",
            alloc.inner_line
        );
        let step = lines[2].1.strip_suffix(" (inlined)").unwrap_or_else(|| panic!("chain_step is inlined:\n{text}"));
        assert!(
            step.ends_with(&alloc.step_line),
            "chain_step at its call of chain_inner ({}):\n{text}",
            alloc.step_line
        );
        assert_eq!(cut, "whole", "the walk reaches the process's entry:\n{text}");
    }
}

#[test]
fn frame_pointer_stacks_hold_the_ledgers_chain_with_its_lines_and_inlined_step() {
    let env = env("stacks_fp");
    let (db, ledger_path) = trace(&env, "stack_chain", "3", &[]);
    assert_whole_chains(&db, &ledger_path);
}

#[test]
fn dwarf_unwinding_walks_the_whole_chain_through_a_library_without_frame_pointers() {
    let env = env("stacks_dwarf");
    let (db, ledger_path) = trace(&env, "stack_chain_nofp", "3", &["--unwind", "dwarf"]);
    assert_whole_chains(&db, &ledger_path);
    assert_eq!(meta(&db, "unwind").as_deref(), Some("dwarf (window 8192 bytes)"));
}

#[test]
fn a_library_without_frame_pointers_gives_a_stack_marked_truncated() {
    let env = env("stacks_nofp");
    let (db, ledger_path) = trace(&env, "stack_chain_nofp", "1", &[]);
    let allocs = ledger(&ledger_path);
    let rows = malloc_stacks(&db);
    let (_, text, cut) = rows.iter().find(|(ptr, ..)| *ptr == allocs[0].ptr).expect("the MALLOC row");
    let names: Vec<&str> = text.lines().filter_map(function_of).map(|(n, _)| n).collect();
    assert!(names[0].starts_with("aclrtMalloc") && names.get(1) == Some(&"chain_inner"), "{text}");
    assert!(!names.contains(&"chain_outer"), "a frame-pointer walk cannot pass the library:\n{text}");
    assert!(allocs[0].functions.iter().any(|f| f == "chain_outer"), "glibc's unwinder does");
    assert_eq!(cut, "truncated");
    assert!(text.lines().last().unwrap().contains("frame pointers"), "the column says why it ends:\n{text}");
}

#[test]
fn csv_rows_carry_the_same_stacks() {
    let env = env("stacks_csv");
    let out = env.scratch.join("out");
    let ledger = env.scratch.join("ledger.txt");
    let exe = program(&env, "stack_chain");
    let (out_s, exe_s, ledger_s) = (out.display().to_string(), exe.display().to_string(), ledger.display().to_string());
    let args =
        ["trace", "--output", &out_s, "--call-stack", "c:8", "--format", "csv", "--", &exe_s, "1", &ledger_s, HOLD_MS];
    let vars = [("ASCEND_HOME_PATH", Some(env.ascend_home.as_os_str()))];
    let (code, stderr) = Tracer::spawn_with(&env, &args, &vars).finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");
    let csv = std::fs::read_dir(run_dir(&out).join("device_0/dump"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "csv"))
        .expect("the CSV");
    let text = std::fs::read_to_string(&csv).unwrap();
    let malloc = text.split(",MALLOC,").nth(1).expect("a MALLOC row");
    for f in ["aclrtMalloc", "chain_inner", "chain_step", "chain_middle"] {
        assert!(malloc.contains(&format!("({f}")), "{f} in the CSV's last column:\n{malloc}");
    }
}

/// `probes --pid` says, per mapped file, whether frame-pointer stacks through it hold: the
/// stack chain's library is built with frame pointers in one program and without in the other,
/// by construction (xtask's build).
#[test]
fn probes_tells_libraries_without_frame_pointers_and_suggests_dwarf() {
    let env = env("stacks_probes");
    for (name, lib_dir, keeps) in [("stack_chain", "stacks", true), ("stack_chain_nofp", "stacks_nofp", false)] {
        let ledger = env.scratch.join(format!("{name}.txt"));
        let mut child = std::process::Command::new(program(&env, name))
            .args(["1", ledger.to_str().unwrap(), "5000"])
            .env("ASCEND_HOME_PATH", &env.ascend_home)
            .spawn()
            .unwrap();
        let _ = wait_for_file(&ledger, &mut child, Duration::from_secs(20));
        let out =
            std::process::Command::new(&env.bin).args(["probes", "--pid", &child.id().to_string()]).output().unwrap();
        let _ = child.kill();
        let _ = child.wait();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
        let lib = format!("{lib_dir}/libstackchain.so: ");
        let line = text.lines().find(|l| l.contains(&lib)).unwrap_or_else(|| panic!("no line for {lib}:\n{text}"));
        assert!(
            text.contains(
                "python stacks (owners, steps and sites; trace --call-stack python): no CPython in this process"
            ),
            "{text}"
        );
        if keeps {
            assert!(line.contains(": frame pointers (") && line.contains("are whole"), "{line}");
        } else {
            assert!(line.contains(": no frame pointers (0 of "), "{line}");
            assert!(text.contains("--unwind dwarf"), "{text}");
        }
    }
}

/// pyenv's CPython 3.`minor`, when installed.
fn pyenv(minor: u32) -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir("/root/.pyenv/versions")
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(&format!("3.{minor}."))))
        .map(|p| p.join(format!("bin/python3.{minor}")))
        .filter(|p| p.is_file())
        .collect();
    found.sort();
    found.pop()
}

/// A frame as `traceback` gives it: file, line, function.
type PyFrame = (String, u32, String);

/// One allocation of the Python workload's ledger: its block, thread and this script's frames,
/// innermost first.
fn py_ledger(path: &Path) -> Vec<(u64, u32, Vec<PyFrame>)> {
    let text = std::fs::read_to_string(path).unwrap();
    let mut all = Vec::new();
    let mut cur: Option<(u64, u32, Vec<PyFrame>)> = None;
    for line in text.lines() {
        let (tag, rest) = line.split_once(' ').unwrap_or((line, ""));
        match tag {
            "alloc" => {
                let mut f = rest.split(' ');
                let ptr = u64::from_str_radix(f.next().unwrap().trim_start_matches("0x"), 16).unwrap();
                cur = Some((ptr, f.next().unwrap().parse().unwrap(), Vec::new()));
            }
            "frame" => {
                let mut f = rest.rsplitn(3, ':');
                let (name, line, file) = (f.next().unwrap(), f.next().unwrap(), f.next().unwrap());
                cur.as_mut().unwrap().2.push((file.to_owned(), line.parse().unwrap(), name.to_owned()));
            }
            "end" => all.push(cur.take().unwrap()),
            _ => {}
        }
    }
    all
}

/// The blocks the workload's C-only threads freed: (`cfree`'s, `cfree_crowded`'s).
fn c_thread_frees(path: &Path) -> (u64, u64) {
    let text = std::fs::read_to_string(path).unwrap();
    let ptr = |tag: &str| {
        let line = text.lines().find_map(|l| l.strip_prefix(tag)).unwrap_or_else(|| panic!("no {tag} in the ledger"));
        u64::from_str_radix(line.split_whitespace().next().unwrap().trim_start_matches("0x"), 16).unwrap()
    };
    (ptr("cfree "), ptr("cfree_crowded "))
}

/// The frees of the workload's C-only threads: their rows have another thread than any Python
/// one; `--bpf-log debug` names the first thread as running no Python, and its row carries the
/// main thread's stack instead, said so on its first line (the main thread waits in Python for
/// it); the second (freeing while 301 Python threads live, past the probe's bound of 256) is
/// not found, in a warning, which ms_meta counts with the records flagged so, and has no stack
/// (the main thread, the oldest, is past the bound too).
fn assert_c_threads_reported(conn: &rusqlite::Connection, ledger: &Path, stderr: &str, python_tids: &[u32]) {
    let (plain, crowded) = c_thread_frees(ledger);
    let mut stmt = conn
        .prepare(
            "SELECT Ptr, \"Thread Id\", \"Call Stack(Python)\" FROM memscope_dump WHERE Event = 'FREE' AND \"Event Type\" = 'HAL' \
             ORDER BY ID",
        )
        .unwrap();
    let frees: Vec<(String, u32, String)> =
        stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?))).unwrap().map(Result::unwrap).collect();
    // The last free of the address: the allocator may have handed it out before.
    let free_row = |ptr: u64| -> (u32, String) {
        frees
            .iter()
            .rev()
            .find(|(p, ..)| u64::from_str_radix(p.trim_start_matches("0x"), 16).ok() == Some(ptr))
            .map(|(_, tid, text)| (*tid, text.clone()))
            .unwrap_or_else(|| panic!("no FREE row for {ptr:#x}"))
    };
    // The probe's documented bound (docs/db-schema.md, `py_stacks_threads_bound`); the workload
    // starts 300 more threads than that needs.
    let bound = 256;
    let lent = "<the main thread's stack: the calling thread ran no Python>\n";
    for (ptr, message, lends) in [
        (plain, "bpf debug: Python stack of thread {}: no Python thread state".to_owned(), true),
        (crowded, format!("bpf warn: Python stack of thread {{}}: not among the first {bound} thread states"), false),
    ] {
        let (tid, text) = free_row(ptr);
        assert!(!python_tids.contains(&tid), "{ptr:#x} was freed by a C-only thread, not {tid}");
        if lends {
            let frames = text.strip_prefix(lent).unwrap_or_else(|| panic!("not the main thread's stack:\n{text}"));
            assert!(frames.lines().any(|l| l.contains("standin_pystacks.py(")), "{text}");
        } else {
            assert_eq!(text, "", "no stack: neither the thread nor the main thread was found");
        }
        let message = message.replace("{}", &tid.to_string());
        assert!(stderr.contains(&message), "{message}\n{stderr}");
    }
    let warnings = stderr.matches("bpf warn: ").count();
    let meta = |key: &str| -> usize {
        conn.query_row("SELECT value FROM ms_meta WHERE key = ?1", [key], |r| r.get::<_, String>(0))
            .unwrap_or_else(|e| panic!("ms_meta {key}: {e}"))
            .parse()
            .unwrap()
    };
    assert!(warnings >= 1, "{stderr}");
    assert_eq!(meta("py_stacks_threads_bound"), warnings, "one warning per record flagged past the bound");
    assert_eq!(meta("bpf_log_warnings"), warnings);
    assert_eq!(meta("py_stacks_read_failed"), 0);
}

/// Runs the Python stack workload under `trace` (`trace_args`, then `--` and the interpreter
/// with the script's `script_args`); returns stderr and the device 0 DB. `tag` names the run's
/// output folder and ledger in the test's scratch.
fn trace_pystacks(
    env: &TestEnv,
    tag: &str,
    python: &Path,
    trace_args: &[&str],
    script_args: &[&str],
) -> (String, PathBuf, PathBuf) {
    let script = env.workload.with_file_name("standin_pystacks.py");
    let (out, ledger) = (env.scratch.join(format!("out-{tag}")), env.scratch.join(format!("ledger-{tag}.txt")));
    let (out_s, py_s, script_s, ledger_s) = (
        out.display().to_string(),
        python.display().to_string(),
        script.display().to_string(),
        ledger.display().to_string(),
    );
    let mut args = vec!["trace", "--output", &out_s];
    args.extend_from_slice(trace_args);
    args.extend(["--", &py_s, &script_s, "--ledger", &ledger_s]);
    args.extend_from_slice(script_args);
    let vars = [("ASCEND_HOME_PATH", Some(env.ascend_home.as_os_str()))];
    let (code, stderr) = Tracer::spawn_with(env, &args, &vars).finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");
    let db = read_output(&out).db("device_0").to_owned();
    (stderr, db, ledger)
}

/// (Ptr, `id_column`, `Call Stack(Python)`) of every HAL MALLOC row.
fn py_malloc_rows(conn: &rusqlite::Connection, id_column: &str) -> Vec<(u64, u32, String)> {
    let sql = format!(
        "SELECT Ptr, \"{id_column}\", \"Call Stack(Python)\" FROM memscope_dump WHERE Event = 'MALLOC' AND \"Event Type\" = 'HAL'"
    );
    let mut stmt = conn.prepare(&sql).unwrap();
    stmt.query_map([], |r| {
        let ptr: String = r.get(0)?;
        Ok((u64::from_str_radix(ptr.trim_start_matches("0x"), 16).unwrap(), r.get(1)?, r.get(2)?))
    })
    .unwrap()
    .map(Result::unwrap)
    .collect()
}

/// The column's text begins with exactly the ledger's frames: `FILE(LINE): FUNCTION`, the
/// function qualified by its class where it has one.
fn assert_frames(text: &str, frames: &[PyFrame], what: &str) {
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines.len() >= frames.len(), "{what}:\n{text}");
    for (line, (file, no, name)) in lines.iter().zip(frames) {
        let (place, function) = line.split_once(": ").unwrap_or_else(|| panic!("{what}: {line}"));
        assert_eq!(place, format!("{file}({no})"), "{what}:\n{text}");
        assert!(function == name || function.ends_with(&format!(".{name}")), "{what}: {function} is {name}:\n{text}");
    }
}

/// `--call-stack python` on every pyenv CPython 3.9-3.13 and Debian's python3: each MALLOC row's `Call Stack(Python)`
/// begins with exactly the workload's own frames (file, line, function) as the interpreter's
/// `traceback` gave them at the call, on the main thread and on a second thread, whose rows carry
/// their own thread's stack (`worker_chain`), not the main thread's. The frees of C-only
/// threads: see [`assert_c_threads_reported`].
#[test]
fn python_stacks_are_the_calling_threads_own_on_every_cpython() {
    let env = env("stacks_python");
    let mut interpreters = Vec::new();
    for minor in [9, 10, 11, 12, 13] {
        match pyenv(minor) {
            Some(python) => interpreters.push((python, minor)),
            None => eprintln!("skipped 3.{minor}: no pyenv CPython 3.{minor} (xtask setup installs them)"),
        }
    }
    // Debian's own, a static executable (its `_PyRuntime` is exported for extension modules).
    let debian = std::fs::canonicalize("/usr/bin/python3").ok();
    let debian_minor = debian.as_ref().and_then(|p| p.file_name()?.to_str()?.strip_prefix("python3.")?.parse().ok());
    match (debian, debian_minor) {
        (Some(p), Some(minor)) => interpreters.push((p, minor)),
        _ => eprintln!("skipped Debian's python3: not installed"),
    }
    let mut checked = 0;
    for (i, (python, minor)) in interpreters.into_iter().enumerate() {
        let trace_args = ["--call-stack", "python", "--bpf-log", "debug"];
        let (stderr, db, ledger) = trace_pystacks(&env, &i.to_string(), &python, &trace_args, &[]);
        assert!(stderr.contains(&format!("python: CPython 3.{minor} in process")), "{stderr}");
        let conn = rusqlite::Connection::open_with_flags(&db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
        let rows = py_malloc_rows(&conn, "Thread Id");
        let allocs = py_ledger(&ledger);
        assert_eq!(allocs.len(), 4, "the workload's ledger");
        let threads: std::collections::BTreeSet<u32> = allocs.iter().map(|a| a.1).collect();
        assert_eq!(threads.len(), 2, "two threads allocated");
        for (ptr, tid, frames) in &allocs {
            let (_, row_tid, text) =
                rows.iter().find(|(p, ..)| p == ptr).unwrap_or_else(|| panic!("3.{minor}: no MALLOC row for {ptr:#x}"));
            assert_eq!(row_tid, tid);
            assert_frames(text, frames, &format!("3.{minor}"));
        }
        let python_tids: Vec<u32> = threads.iter().copied().collect();
        assert_c_threads_reported(&conn, &ledger, &stderr, &python_tids);
        checked += 1;
    }
    if checked == 0 {
        eprintln!("skipped: no pyenv CPython 3.11-3.13 here");
    }
}

/// A Python process the trace learns of mid-run (forked by the launched interpreter, which
/// itself allocates nothing), allocating at once after the fork: it inherits its parent's
/// interpreter in the kernel, so its first rows already carry its own frames as its ledger
/// gives them, under its own process id.
#[test]
fn a_forked_python_child_gets_its_own_python_stacks() {
    let env = env("stacks_python_fork");
    let Some(python) = pyenv(12).or_else(|| pyenv(11)) else {
        eprintln!("skipped: no pyenv CPython 3.11 or 3.12");
        return;
    };
    let (_, db, ledger) = trace_pystacks(&env, "fork", &python, &["--call-stack", "python"], &["--fork"]);
    let allocs = py_ledger(&ledger);
    assert_eq!(allocs.len(), 2, "the child's ledger");
    let conn = rusqlite::Connection::open_with_flags(&db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
    let rows = py_malloc_rows(&conn, "Process Id");
    for (ptr, tid, frames) in &allocs {
        let (_, pid, text) =
            rows.iter().find(|(p, ..)| p == ptr).unwrap_or_else(|| panic!("no MALLOC row for {ptr:#x}"));
        // The child is single-threaded: its thread id is its process id.
        assert_eq!(pid, tid, "the child's row");
        assert_frames(text, frames, "the forked child");
    }
}

/// A traced Python process that replaces itself with a fresh interpreter (`execve`, same pid):
/// the old image's interpreter is dropped at the exec and the new one found, so the rows made
/// after it carry the new image's frames, and no walk read the old image's addresses.
#[test]
fn a_python_that_execs_a_new_interpreter_gets_the_new_ones_stacks() {
    let env = env("stacks_python_exec");
    let Some(python) = pyenv(12).or_else(|| pyenv(11)) else {
        eprintln!("skipped: no pyenv CPython 3.11 or 3.12");
        return;
    };
    let (stderr, db, ledger) = trace_pystacks(&env, "exec", &python, &["--call-stack", "python"], &["--exec"]);
    let allocs = py_ledger(&ledger);
    assert_eq!(allocs.len(), 4, "the new image's ledger");
    // Found in the first image, then again after the exec (once more if a rescan looked while
    // the new image was still loading).
    assert!(stderr.matches("python: CPython 3.").count() >= 2, "found before and after the exec:\n{stderr}");
    let conn = rusqlite::Connection::open_with_flags(&db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
    let rows = py_malloc_rows(&conn, "Thread Id");
    for (ptr, _, frames) in &allocs {
        let (.., text) = rows.iter().find(|(p, ..)| p == ptr).unwrap_or_else(|| panic!("no MALLOC row for {ptr:#x}"));
        assert_frames(text, frames, "after the exec");
    }
    let failed: String =
        conn.query_row("SELECT value FROM ms_meta WHERE key = 'py_stacks_read_failed'", [], |r| r.get(0)).unwrap();
    assert_eq!(failed, "0", "no walk of the old image's interpreter");
}

/// A CPython this build has no layout for (3.8): the trace says so and leaves the column empty
/// rather than guessing.
#[test]
fn an_unsupported_cpython_is_named_and_gets_no_stacks() {
    let env = env("stacks_python_old");
    let Some(python) = pyenv(8) else {
        eprintln!("skipped: no pyenv CPython 3.8");
        return;
    };
    let (stderr, db, _) = trace_pystacks(&env, "old", &python, &["--call-stack", "c,python"], &["--wait", "0.6"]);
    assert!(
        stderr.contains("no Python stacks: CPython 3.8") && stderr.contains("3.9, 3.10, 3.11, 3.12, 3.13"),
        "{stderr}"
    );
    let conn = rusqlite::Connection::open_with_flags(&db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
    let (py, c): (String, String) = conn
        .query_row(
            "SELECT \"Call Stack(Python)\", \"Call Stack(C)\" FROM memscope_dump WHERE Event = 'MALLOC' LIMIT 1",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!(py, "", "no Python stack for a version without a layout");
    assert!(c.contains("aclrtMalloc"), "native stacks are unaffected:\n{c}");
}

/// A traced child exits long before the trace ends (its parent goes on): its rows keep whole
/// stacks. Its stacks were normalized while it lived; symbolizing reads only the files (no
/// `/proc/PID`), so nothing of the process is needed once it is gone.
#[test]
fn the_stacks_of_a_process_that_exited_are_still_symbolized() {
    let env = env("stacks_exited");
    let (out, ledger) = (env.scratch.join("out"), env.scratch.join("ledger.txt"));
    let exe = program(&env, "stack_chain");
    let shell = format!("{} 1 {} 200; sleep 1.5", exe.display(), ledger.display());
    let out_s = out.display().to_string();
    let args = ["trace", "--output", &out_s, "--call-stack", "c", "--", "sh", "-c", &shell];
    let vars = [("ASCEND_HOME_PATH", Some(env.ascend_home.as_os_str()))];
    let (code, stderr) = Tracer::spawn_with(&env, &args, &vars).finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");
    let output = read_output(&out);
    assert_whole_chains(output.db("device_0"), &ledger);
}

/// With REAL PyTorch (the torch venv): the `c10::alloc_cpu` row of a tensor the workload made
/// carries, in `Call Stack(Python)`, exactly the workload's frames the interpreter's
/// `traceback` named at the call, and `c10::alloc_cpu` in its native stack.
#[test]
fn a_real_torch_tensor_has_the_python_frames_that_made_it() {
    let env = env("stacks_torch");
    let Some((python, _)) = real_torch() else { return };
    let script = env.workload.with_file_name("torch_pystacks.py");
    let (out, ledger) = (env.scratch.join("out"), env.scratch.join("ledger.txt"));
    let (out_s, py_s, script_s, ledger_s, lib_s) = (
        out.display().to_string(),
        python.display().to_string(),
        script.display().to_string(),
        ledger.display().to_string(),
        env.libascendcl.display().to_string(),
    );
    let args = [
        "trace",
        "--output",
        &out_s,
        "--lib",
        &lib_s,
        "--call-stack",
        "c,python",
        "--",
        &py_s,
        &script_s,
        "--ledger",
        &ledger_s,
    ];
    let (code, stderr) = Tracer::spawn_with(&env, &args, &[]).finish(Duration::from_secs(120));
    assert_eq!(code, Some(0), "{stderr}");
    let allocs = py_ledger_torch(&ledger);
    let output = read_output(&out);
    let row = output
        .rows()
        .find(|r| r.event == "MALLOC" && r.ptr_value() == Some(allocs.0))
        .unwrap_or_else(|| panic!("no MALLOC row for the tensor {:#x}:\n{stderr}", allocs.0));
    let db = output.db(&row.folder).to_owned();
    let conn = rusqlite::Connection::open_with_flags(&db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
    let (py, c): (String, String) = conn
        .query_row("SELECT \"Call Stack(Python)\", \"Call Stack(C)\" FROM memscope_dump WHERE ID = ?1", [row.id], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .unwrap();
    let lines: Vec<&str> = py.lines().collect();
    assert!(lines.len() >= allocs.1.len(), "{py}");
    for (line, (file, no, name)) in lines.iter().zip(&allocs.1) {
        let (place, function) = line.split_once(": ").unwrap();
        assert_eq!(place, format!("{file}({no})"), "{py}");
        assert!(function == name || function.ends_with(&format!(".{name}")), "{py}");
    }
    assert!(c.contains("alloc_cpu"), "the native stack starts at c10::alloc_cpu:\n{c}");
}

/// The torch workload's one allocation: its storage and its frames.
fn py_ledger_torch(path: &Path) -> (u64, Vec<PyFrame>) {
    let text = std::fs::read_to_string(path).unwrap();
    let mut ptr = 0;
    let mut frames = Vec::new();
    for line in text.lines() {
        let (tag, rest) = line.split_once(' ').unwrap_or((line, ""));
        match tag {
            "alloc" => ptr = u64::from_str_radix(rest.split(' ').next().unwrap().trim_start_matches("0x"), 16).unwrap(),
            "frame" => {
                let mut f = rest.rsplitn(3, ':');
                let (name, no, file) = (f.next().unwrap(), f.next().unwrap(), f.next().unwrap());
                frames.push((file.to_owned(), no.parse().unwrap(), name.to_owned()));
            }
            _ => {}
        }
    }
    (ptr, frames)
}

/// A stripped library's hidden functions are named from its separate debug file (found through
/// its `.gnu_debuglink`, as the attach code finds it): the stand-in torch_npu is stripped and
/// builds with hidden visibility, so `DeviceCachingAllocator::malloc` is in neither its symbol
/// table (it has none) nor its dynamic one; a stack naming it read the debug file.
#[test]
fn hidden_functions_of_a_stripped_library_are_named_from_its_debug_file() {
    let env = env("stacks_debugfile");
    // The stripped library, with its debug file beside it.
    let torch = var("MEMSCOPE_TORCH_WITH_DEBUG");
    let dynsym = std::process::Command::new("nm").args(["-D", "--defined-only"]).arg(&torch).output().unwrap();
    assert!(dynsym.status.success(), "nm -D {}: {}", torch.display(), String::from_utf8_lossy(&dynsym.stderr));
    assert!(!String::from_utf8_lossy(&dynsym.stdout).contains("DeviceCachingAllocator"), "the function must be hidden");
    let out = env.scratch.join("out");
    let script = format!(
        "import ctypes, os, time\n\
         acl = ctypes.CDLL(os.path.join(os.environ['ASCEND_HOME_PATH'], 'lib64', 'libascendcl.so'))\n\
         assert acl.aclrtSetDevice(0) == 0\n\
         torch = ctypes.CDLL('{}')\n\
         torch.standin_tensor_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int]\n\
         torch.standin_tensor_alloc.restype = ctypes.c_void_p\n\
         time.sleep(0.5)\n\
         assert torch.standin_tensor_alloc(1 << 20, 0)\n\
         time.sleep(0.3)\n",
        torch.display()
    );
    let (out_s, torch_s) = (out.display().to_string(), torch.display().to_string());
    let args = ["trace", "--output", &out_s, "--lib", &torch_s, "--call-stack", "c", "--", "python3", "-c", &script];
    let vars = [("ASCEND_HOME_PATH", Some(env.ascend_home.as_os_str()))];
    let (code, stderr) = Tracer::spawn_with(&env, &args, &vars).finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");
    let db = read_output(&out).db("device_0").to_owned();
    let conn = rusqlite::Connection::open_with_flags(&db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
    let stacks: Vec<String> = conn
        .prepare("SELECT \"Call Stack(C)\" FROM memscope_dump WHERE Event = 'MALLOC' AND \"Event Type\" = 'PTA'")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert!(!stacks.is_empty(), "the pool's MALLOC row:\n{stderr}");
    let first = stacks[0].lines().next().unwrap_or("");
    assert!(first.contains("libtorch_npu.so(") && first.contains("DeviceCachingAllocator::malloc"), "{}", stacks[0]);
}
