//! Candidate libraries come from paths the target controls: one that cannot be probed (not an
//! ELF file, another machine's, too large, gone before the attach, a FIFO) is a warning naming
//! the file and why, counted in `ms_meta`, and the trace goes on recording the workload's calls
//! (checked against its ledger).

use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use memscope_integration::*;

const LIVE_TIMEOUT: Duration = Duration::from_secs(30);

fn badlibs_workload(env: &TestEnv) -> PathBuf {
    env.workload.parent().unwrap().join("standin_badlibs.py")
}

/// `trace [tracer_args] -- python standin_badlibs.py --ledger LEDGER [workload]`.
fn launch(env: &TestEnv, out: &Path, ledger: &Path, tracer_args: &[&str], workload: &[&str]) -> Tracer {
    let script = badlibs_workload(env).display().to_string();
    let (out_s, ledger_s) = (out.display().to_string(), ledger.display().to_string());
    let mut args = vec!["trace", "--output", out_s.as_str()];
    args.extend_from_slice(tracer_args);
    args.extend(["--", "python3", script.as_str(), "--ledger", ledger_s.as_str()]);
    args.extend_from_slice(workload);
    Tracer::spawn(env, &args, &[("ASCEND_HOME_PATH", &env.ascend_home)])
}

/// Every device DB's `ms_meta` value of `key` (one value, the same in all).
fn run_meta(out: &Output, key: &str) -> Option<String> {
    let values: Vec<Option<String>> = out.files.values().map(|(p, _)| meta(p, key)).collect();
    assert!(values.windows(2).all(|w| w[0] == w[1]), "{key} differs between DBs: {values:?}");
    values.into_iter().next().flatten()
}

/// The libraries `ms_meta.skipped_libraries` names.
fn skipped(out: &Output) -> Vec<(String, String)> {
    let text = run_meta(out, "skipped_libraries").unwrap_or_else(|| "[]".into());
    let list: Vec<serde_json::Value> = serde_json::from_str(&text).expect("skipped_libraries is a JSON array");
    list.iter().map(|s| (s["library"].as_str().unwrap().to_owned(), s["reason"].as_str().unwrap().to_owned())).collect()
}

#[test]
fn a_non_elf_file_mapped_as_a_runtime_library_is_a_warning_and_the_trace_goes_on() {
    let env = env("libs_non_elf");
    let (out, ledger) = (env.scratch.join("out"), env.scratch.join("ledger.jsonl"));
    let bad = env.scratch.join("bad");
    let bad_s = bad.display().to_string();
    let mut tracer = launch(&env, &out, &ledger, &[], &["--non-elf", &bad_s]);
    tracer.wait_live(LIVE_TIMEOUT);
    let (code, stderr) = tracer.finish(Duration::from_secs(120));
    assert_eq!(code, Some(0), "the trace must not end on a bad library:\n{stderr}");
    let file = bad.join("libascendcl.so.9").display().to_string();
    assert!(stderr.contains(&format!("warning: {file} is not traced")), "{stderr}");
    assert!(stderr.contains("is not an ELF file"), "{stderr}");
    assert!(stderr.contains("1 library not traced"), "the summary counts it:\n{stderr}");
    let out = read_output(&out);
    assert_eq!(run_meta(&out, "libraries_skipped").as_deref(), Some("1"));
    let skipped = skipped(&out);
    assert_eq!(skipped.len(), 1, "{skipped:?}");
    assert!(skipped[0].0 == file && skipped[0].1.contains("not an ELF file"), "{skipped:?}");
    // Every call, including those after the bad file was mapped, is in the DB.
    assert_exact(&read_ledger(&ledger), &out);
}

#[test]
fn a_library_removed_between_the_maps_read_and_its_attach_is_a_warning_and_later_calls_are_traced() {
    let env = env("libs_race");
    let (out, ledger) = (env.scratch.join("out"), env.scratch.join("ledger.jsonl"));
    let race = env.scratch.join("race");
    let race_s = race.display().to_string();
    let go = env.scratch.join("go");
    let go_s = go.display().to_string();
    let mut tracer = launch(&env, &out, &ledger, &[], &["--race", &race_s, "--go-file", &go_s]);
    tracer.wait_live(LIVE_TIMEOUT);
    // The workload calls through the copy X once the tracer says all of X's probes are live.
    let deadline = Instant::now() + Duration::from_secs(90);
    while !tracer.stderr().lines().any(|l| l.contains("more probes in") && l.contains("/x/libascendcl.so")) {
        assert!(Instant::now() < deadline, "the copy X was never attached:\n{}", tracer.stderr());
        assert!(tracer.child.try_wait().unwrap().is_none(), "the tracer ended:\n{}", tracer.stderr());
        std::thread::sleep(Duration::from_millis(20));
    }
    std::fs::write(&go, b"").unwrap();
    let (code, stderr) = tracer.finish(Duration::from_secs(180));
    assert_eq!(code, Some(0), "the trace must not end on a vanished library:\n{stderr}");
    let warning = stderr
        .lines()
        .find(|l| l.contains("/y/libascend_hal.so is not traced"))
        .unwrap_or_else(|| panic!("no warning for the removed copy:\n{stderr}"));
    assert!(warning.contains("No such file or directory"), "{warning}");
    assert!(stderr.contains("(loaded after the trace started)"), "the other copy is attached:\n{stderr}");
    let out = read_output(&out);
    let skipped = skipped(&out);
    assert_eq!(run_meta(&out, "libraries_skipped"), Some(skipped.len().to_string()));
    assert!(skipped.iter().any(|(lib, _)| lib.ends_with("/y/libascend_hal.so")), "{skipped:?}");
    let ledger = read_ledger(&ledger);
    assert!(ledger.iter().filter(|e| e.lib.is_some()).count() > 20, "calls went through the later copy");
    // The calls through the copy attached in that rescan, and all the others, are in the DB.
    assert_exact(&ledger, &out);
}

#[test]
fn a_library_skipped_mid_trace_is_in_ms_meta_before_the_finish() {
    let env = env("libs_skip_killed");
    let (out, ledger) = (env.scratch.join("out"), env.scratch.join("ledger.jsonl"));
    let bad = env.scratch.join("bad");
    let bad_s = bad.display().to_string();
    // Enough calls after the bad file is mapped (20 ms a round) for commits to follow the skip.
    let mut tracer = launch(&env, &out, &ledger, &[], &["--non-elf", &bad_s, "--rounds", "300"]);
    tracer.wait_live(LIVE_TIMEOUT);
    let file = bad.join("libascendcl.so.9").display().to_string();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !tracer.stderr().contains(&format!("warning: {file} is not traced")) {
        assert!(Instant::now() < deadline, "the bad file was never skipped:\n{}", tracer.stderr());
        assert!(tracer.child.try_wait().unwrap().is_none(), "the tracer ended:\n{}", tracer.stderr());
        std::thread::sleep(Duration::from_millis(20));
    }
    // Two commit periods (1 s each) while the job goes on calling, then no chance to finish.
    std::thread::sleep(Duration::from_millis(2500));
    assert!(tracer.child.try_wait().unwrap().is_none(), "the tracer ended early:\n{}", tracer.stderr());
    tracer.signal(libc::SIGKILL);
    let (code, stderr) = tracer.finish(Duration::from_secs(10));
    assert_eq!(code, None, "killed:\n{stderr}");
    let run = run_dir(&out);
    // The launched job outlives its tracer: end it (its pid is in the run folder's name).
    let name = run.file_name().unwrap().to_string_lossy().into_owned();
    if let Some(pid) = name.split('_').nth(1).and_then(|p| p.parse::<i32>().ok()) {
        // SAFETY: plain kill(2) of the job this test launched.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let out = read_output(&out);
    assert!(!out.files.is_empty(), "the killed trace left its DB");
    assert_eq!(run_meta(&out, "libraries_skipped").as_deref(), Some("1"), "the skip is durable before the finish");
    let skipped = skipped(&out);
    assert!(skipped.len() == 1 && skipped[0].0 == file && skipped[0].1.contains("not an ELF file"), "{skipped:?}");
}

/// A copy of the stand-in runtime with its ELF header changed: `class` (1: 32-bit) and machine.
fn foreign_elf(source: &Path, to: &Path, class: u8, machine: u16) {
    let mut data = std::fs::read(source).unwrap();
    data[4] = class;
    data[18..20].copy_from_slice(&machine.to_le_bytes());
    std::fs::write(to, data).unwrap();
}

fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo {}", path.display());
}

/// Peak resident memory of a running process (`VmHWM`, bytes).
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/PID/status");
    kb * 1024
}

#[test]
fn bad_files_in_a_lib_folder_are_refused_one_by_one_and_none_is_read_whole() {
    let env = env("libs_folder");
    let (out, ledger) = (env.scratch.join("out"), env.scratch.join("ledger.jsonl"));
    let dir = env.scratch.join("lib");
    std::fs::create_dir_all(&dir).unwrap();
    // The good one, and beside it what a target's folder may hold under runtime names.
    std::os::unix::fs::symlink(&env.libascendcl, dir.join("libascendcl.so")).unwrap();
    let sparse = dir.join("libascendcl.so.9");
    std::fs::File::create(&sparse).unwrap().set_len(3 << 30).unwrap();
    foreign_elf(&env.libascendcl, &dir.join("libacl_rt.so"), 2, 183); // aarch64
    foreign_elf(&env.libascendcl, &dir.join("libacl_rt_impl.so"), 1, 3); // i386
    std::fs::write(dir.join("libascendcl.so.2"), b"not an ELF file\n").unwrap();
    mkfifo(&dir.join("libascend_hal.so.9"));
    // A good copy that someone holds open for writing (it may change under a parse).
    std::fs::copy(&env.libascendcl, dir.join("libascendcl.so.8")).unwrap();
    let writer = std::fs::OpenOptions::new().append(true).open(dir.join("libascendcl.so.8")).unwrap();
    let dir_s = dir.display().to_string();
    let mut tracer = launch(&env, &out, &ledger, &["--lib", &dir_s, "--ring-mb", "4"], &["--rounds", "20"]);
    tracer.wait_live(LIVE_TIMEOUT);
    // Read before the tracer exits: the peak covers the start-up, where candidates are opened.
    let rss = peak_rss(tracer.child.id());
    let (code, stderr) = tracer.finish(Duration::from_secs(120));
    drop(writer);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(rss < 256 << 20, "the tracer's peak RSS is {} MiB: a candidate was read whole", rss >> 20);
    let warned = |name: &str, why: &str| {
        let file = dir.join(name).display().to_string();
        stderr.lines().any(|l| l.contains(&format!("warning: {file} is not traced")) && l.contains(why))
    };
    assert!(warned("libascendcl.so.9", "over the 2147483648-byte limit"), "{stderr}");
    assert!(warned("libacl_rt.so", "64-bit aarch64 ELF file, not a 64-bit x86-64"), "{stderr}");
    assert!(warned("libacl_rt_impl.so", "32-bit i386 ELF file"), "{stderr}");
    assert!(warned("libascendcl.so.2", "is not an ELF file"), "{stderr}");
    assert!(warned("libascendcl.so.8", "is open for writing by another process"), "{stderr}");
    assert!(!stderr.contains("libascend_hal.so.9"), "a FIFO is not a candidate:\n{stderr}");
    let out = read_output(&out);
    assert_eq!(run_meta(&out, "libraries_skipped").as_deref(), Some("5"));
    // Nothing was attached in the refused files (the aarch64 copy has the symbols at x86 offsets).
    let (db, _) = out.files.values().next().unwrap();
    let conn = rusqlite::Connection::open(db).unwrap();
    let probed: Vec<String> = conn
        .prepare("SELECT DISTINCT library FROM ms_probes")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert!(probed.iter().all(|l| !l.starts_with(&dir_s) || l.ends_with("/libascendcl.so")), "{probed:?}");
    assert_exact(&read_ledger(&ledger), &out);
}

#[test]
fn a_fifo_where_a_debug_file_is_looked_for_is_never_opened() {
    let env = env("libs_fifo_debug");
    let dir = env.scratch.join("torch");
    std::fs::create_dir_all(&dir).unwrap();
    let lib = dir.join("libtorch_npu.so");
    std::fs::copy(var("MEMSCOPE_TORCH_WITHOUT_DEBUG"), &lib).unwrap();
    // The stripped stand-in's .gnu_debuglink names libtorch_npu.so.debug, looked for beside it.
    let fifo = dir.join("libtorch_npu.so.debug");
    mkfifo(&fifo);
    let mut child = Command::new(&env.bin)
        .args(["probes", "--lib", lib.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            // Unblock a reader stuck in open(2) on the FIFO, so the process can be reaped.
            let _ = child.kill();
            let _ = std::fs::OpenOptions::new().write(true).open(&fifo).map(|mut f| f.write_all(b"x"));
            let _ = child.wait();
            panic!("`probes` hung on the FIFO named like the debug file");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut text = String::new();
    child.stdout.take().unwrap().read_to_string(&mut text).unwrap();
    assert!(status.success(), "{text}");
    assert!(text.contains("debug file: not found"), "the FIFO is no debug file:\n{text}");
}

/// C source of a markers-like module with `sites` `memscope:step` USDT sites, each reading its
/// argument from another stack slot (so each needs its own argument layout), all sharing one
/// semaphore; `memscope_many_sema()` returns the semaphore's value.
fn many_layouts_c(sites: usize) -> String {
    let mut body = String::new();
    for i in 0..sites {
        body.push_str(&format!(
            "    __asm__ __volatile__(\"990: nop\\n.pushsection .note.stapsdt,\\\"\\\",@note\\n.balign 4\\n\
             .4byte 992f-991f, 994f-993f, 3\\n991: .asciz \\\"stapsdt\\\"\\n992: .balign 4\\n\
             993: .8byte 990b\\n.8byte _.stapsdt.base\\n.8byte memscope_many_semaphore\\n\
             .asciz \\\"memscope\\\"\\n.asciz \\\"step\\\"\\n.asciz \\\"8@{}(%rsp)\\\"\\n994: .balign 4\\n.popsection\\n\");\n",
            8 * i
        ));
    }
    format!(
        "__asm__(\".pushsection .stapsdt.base,\\\"a\\\",@progbits\\n_.stapsdt.base: .space 1\\n.popsection\\n\");\n\
         __attribute__((section(\".probes\"), used)) volatile unsigned short memscope_many_semaphore = 0;\n\
         unsigned memscope_many_sema(void) {{ return memscope_many_semaphore; }}\n\
         void memscope_many_fire(void) {{\n{body}}}\n"
    )
}

#[test]
fn markers_needing_more_layouts_than_there_are_attach_none_and_say_so_once() {
    let env = env("libs_many_layouts");
    let module = env.scratch.join("memscope/_native_many.so");
    std::fs::create_dir_all(module.parent().unwrap()).unwrap();
    let src = env.scratch.join("many.c");
    std::fs::write(&src, many_layouts_c(257)).unwrap();
    let cc = Command::new("cc").args(["-shared", "-fPIC", "-O0", "-o"]).arg(&module).arg(&src).output();
    match cc {
        Ok(out) if out.status.success() => {}
        Ok(out) => panic!("cc failed: {}", String::from_utf8_lossy(&out.stderr)),
        Err(e) => {
            println!("SKIPPED: cannot run cc: {e}");
            return;
        }
    }
    // The target maps the stand-in runtime and the module, and reports the semaphore's value.
    let sema = env.scratch.join("sema.txt");
    let script = format!(
        "import ctypes, os, time\n\
         ctypes.CDLL(os.path.join(os.environ['ASCEND_HOME_PATH'], 'lib64', 'libascendcl.so'))\n\
         m = ctypes.CDLL({module:?})\n\
         end = time.monotonic() + 30\n\
         while time.monotonic() < end:\n\
         \x20   open({sema:?} + '.tmp', 'w').write(str(m.memscope_many_sema()))\n\
         \x20   os.replace({sema:?} + '.tmp', {sema:?})\n\
         \x20   time.sleep(0.02)\n"
    );
    let mut target =
        Command::new("python3").args(["-c", &script]).env("ASCEND_HOME_PATH", &env.ascend_home).spawn().unwrap();
    let read_sema = || std::fs::read_to_string(&sema).ok().and_then(|s| s.trim().parse::<u32>().ok());
    let deadline = Instant::now() + Duration::from_secs(20);
    while read_sema().is_none() {
        assert!(Instant::now() < deadline, "the target never reported its semaphore");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (pid, out) = (target.id().to_string(), env.scratch.join("out").display().to_string());
    let mut tracer = Tracer::spawn(&env, &["trace", "--pid", &pid, "--output", &out, "--duration", "3"], &[]);
    tracer.wait_live(LIVE_TIMEOUT);
    std::thread::sleep(Duration::from_millis(500));
    // While traced: no site of the module is live, so the kernel raised its semaphore 0 times.
    let raised = read_sema();
    if raised != Some(0) {
        tracer.signal(libc::SIGKILL);
        let _ = target.kill();
        panic!(
            "sites stayed live ({raised:?} raises) though the module is said not to be traced:\n{}",
            tracer.stderr()
        );
    }
    let (code, stderr) = tracer.finish(Duration::from_secs(60));
    let _ = target.kill();
    let _ = target.wait();
    assert_eq!(code, Some(0), "{stderr}");
    let warning = stderr
        .lines()
        .find(|l| l.contains("markers in") && l.contains("_native_many.so are not traced"))
        .unwrap_or_else(|| panic!("no warning for the module:\n{stderr}"));
    assert!(warning.contains("257 more USDT argument layouts") && !warning.contains("  "), "{warning}");
}
