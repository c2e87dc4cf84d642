//! The third-party check: a REAL PyTorch (the torch venv `cargo xtask test` prepares) training
//! an MLP with Adam on the CPU (tests/workloads/torch_cpu_train.py), already running when
//! `memscope-bpf trace --pid` attaches with no other flag, so the tracer has to find libc10.so
//! (`c10::alloc_cpu` / `c10::free_cpu`) and the markers module in /proc/PID/maps by itself.
//! Skips, saying why, when there is no torch venv.
//!
//! What is checked, and why each ground truth does not come from the tracer:
//!
//! 1. Owner decomposition at a checkpoint. After the optimizer step of step 3 the workload sits
//!    still for 0.1 s on each side of an instant T (no CPU tensor allocated or freed) holding
//!    only parameters, gradients and Adam's state, and logs what torch itself says it holds: the
//!    distinct storages (`untyped_storage().data_ptr()` / `nbytes()`) of `model.parameters()`,
//!    of their `.grad`, and of every tensor in `opt.state`. From the DB alone, the blocks live at
//!    T are the `c10::alloc_cpu` MALLOC rows at or before T whose FREE (the next non-shadow
//!    FREE at the same Ptr) is after T or absent. The bytes of the live blocks whose owner
//!    carries the `weight` / `gradient` / `optimizer_state` label must equal torch's byte sums
//!    exactly; each storage torch names must be a live block at exactly its address with
//!    exactly its size and the owner the tags give it (`HOST@weight`, `HOST@optimizer_state`,
//!    and `HOST@backward@gradient`: gradients are born inside the backward span); and the live
//!    blocks born after the workload's first mark are exactly those storages (nothing else the
//!    job made is alive at T, so anything more is a made-up or unclosed block). The sizes are
//!    torch's storage sizes, which is what `alloc_cpu` was asked for; the tags only say which
//!    block is which, the sizes and liveness come from the probes.
//!
//! 2. Call counts against bpftrace (when `bpftrace` is installed; skipped with a reason
//!    otherwise). bpftrace attaches its own uprobes to the same two functions of the same
//!    libc10.so plus the markers' USDT `memscope:mark`, and counts calls only between the
//!    workload's marks `ms-count-begin` and `ms-count-end` (the mark probe sets and clears a
//!    flag the uprobes test). The workload emits the first mark only after the test has seen
//!    both tools live (a gate file), and it allocates from one thread, so both tools see the
//!    same ordered stream of calls between the same two events. The tracer's count is its rows
//!    between its own rows of those two marks (by timestamp): every `alloc_cpu` call with a
//!    non-zero size must be exactly one MALLOC row, every `free_cpu` of a non-null pointer
//!    exactly one FREE row, no other row, with no record lost. The job's empty tensors are
//!    zero-size `alloc_cpu` calls that return NULL: bpftrace counts as many as the job's ledger
//!    says it made, and the tracer records no row and no failure for them.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use memscope_integration::*;
use serde::Deserialize;

const ALLOC: &str = "c10::alloc_cpu";
const FREE: &str = "c10::free_cpu";
const ALLOC_SYMBOL: &str = "_ZN3c109alloc_cpuEm";
const FREE_SYMBOL: &str = "_ZN3c108free_cpuEPv";
const COUNT_BEGIN: &str = "ms-count-begin";
const COUNT_END: &str = "ms-count-end";
/// The workload keeps this quiet on each side of the checkpoint (it sleeps 100 ms).
const QUIET_NS: u64 = 50_000_000;

/// `bpftrace` on PATH, if any (MEMSCOPE_BPFTRACE overrides the search; a path that is not a
/// file there means none).
fn bpftrace() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("MEMSCOPE_BPFTRACE") {
        return Some(PathBuf::from(p)).filter(|p| p.is_file());
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).map(|d| d.join("bpftrace")).find(|p| p.is_file())
}

/// A storage torch reported: [data_ptr, nbytes].
type Storage = (u64, u64);

#[derive(Debug, Deserialize)]
struct Checkpoint {
    t: u64,
    step: u32,
    tid: u32,
    weight: Vec<Storage>,
    gradient: Vec<Storage>,
    optimizer_state: Vec<Storage>,
    weight_bytes: u64,
    gradient_bytes: u64,
    optimizer_state_bytes: u64,
    storage_bytes_weight: u64,
}

fn read_checkpoint(ledger: &Path) -> Checkpoint {
    let text = std::fs::read_to_string(ledger).unwrap_or_else(|e| panic!("ledger {}: {e}", ledger.display()));
    let mut found = text.lines().filter(|l| l.contains("\"kind\": \"checkpoint\""));
    let line = found.next().unwrap_or_else(|| panic!("no checkpoint in the ledger:\n{text}"));
    assert!(found.next().is_none(), "one checkpoint:\n{text}");
    let c: Checkpoint = serde_json::from_str(line).unwrap_or_else(|e| panic!("bad checkpoint {line}: {e}"));
    for (class, list, bytes) in [
        ("weight", &c.weight, c.weight_bytes),
        ("gradient", &c.gradient, c.gradient_bytes),
        ("optimizer_state", &c.optimizer_state, c.optimizer_state_bytes),
    ] {
        assert_eq!(list.iter().map(|s| s.1).sum::<u64>(), bytes, "the ledger's {class} list and sum disagree");
    }
    assert_eq!(c.storage_bytes_weight, c.weight_bytes, "memscope.torch.storage_bytes and torch disagree");
    c
}

/// How many empty tensors the job made in the counted phase (its ledger's `empty_tensors`).
fn read_empty_tensors(ledger: &Path) -> u64 {
    let text = std::fs::read_to_string(ledger).unwrap_or_else(|e| panic!("ledger {}: {e}", ledger.display()));
    let line = text.lines().find(|l| l.contains("\"kind\": \"empty_tensors\"")).expect("empty_tensors in the ledger");
    let v: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("bad ledger line {line}: {e}"));
    v["count"].as_u64().expect("a count")
}

/// The first file mapped into `pid` whose name matches `pred`.
fn mapped(pid: u32, pred: impl Fn(&str) -> bool) -> Option<PathBuf> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| pred(p.rsplit('/').next().unwrap()))
        .map(PathBuf::from)
}

/// bpftrace counting the two c10 functions between the count marks.
struct Counter {
    child: Child,
    stdout: PathBuf,
    stderr: PathBuf,
}

impl Counter {
    fn spawn(bin: &Path, scratch: &Path, pid: u32, libc10: &Path, native: &Path) -> Self {
        let (lib, so) = (libc10.display(), native.display());
        // Strings are compared on the BPF stack: `str(arg0, 16)` keeps the verifier's work small
        // (a full-size str compare made 0.17's program too large to load).
        let script = format!(
            "BEGIN {{ printf(\"bpftrace-live\\n\"); }}\n\
             usdt:{so}:memscope:mark /pid == {pid}/ {{ $m = str(arg0, 16); \
               if ($m == \"{COUNT_BEGIN}\") {{ @on = 1; }} if ($m == \"{COUNT_END}\") {{ @on = 0; }} @marks = count(); }}\n\
             uprobe:{lib}:{ALLOC_SYMBOL} /pid == {pid} && @on == 1/ {{ \
               if (arg0 != 0) {{ @alloc = count(); }} else {{ @alloc_zero = count(); }} }}\n\
             uprobe:{lib}:{FREE_SYMBOL} /pid == {pid} && @on == 1/ {{ \
               if (arg0 != 0) {{ @free = count(); }} else {{ @free_null = count(); }} }}\n"
        );
        let script_path = scratch.join("count.bt");
        std::fs::write(&script_path, script).unwrap();
        let stdout = scratch.join("bpftrace.out");
        let stderr = scratch.join("bpftrace.err");
        let child = Command::new(bin)
            .args(["-B", "line", "-p", &pid.to_string()])
            .arg(&script_path)
            .stdin(Stdio::null())
            .stdout(File::create(&stdout).unwrap())
            .stderr(File::create(&stderr).unwrap())
            .spawn()
            .expect("start bpftrace");
        Self { child, stdout, stderr }
    }

    fn output(&self) -> String {
        let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
        format!("stdout:\n{}\nstderr:\n{}", read(&self.stdout), read(&self.stderr))
    }

    /// Waits until BEGIN ran (bpftrace runs it once every probe is attached).
    fn wait_live(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while !std::fs::read_to_string(&self.stdout).unwrap_or_default().contains("bpftrace-live") {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("bpftrace exited ({status}) before attaching:\n{}", self.output());
            }
            assert!(Instant::now() < deadline, "bpftrace not live after {timeout:?}:\n{}", self.output());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for bpftrace to exit (it does when its -p target exits; SIGINT after a while in
    /// case it does not) and returns the maps it printed at exit.
    fn finish(mut self) -> (BTreeMap<String, u64>, String) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut interrupted = false;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success() || interrupted, "bpftrace failed ({status}):\n{}", self.output());
                break;
            }
            if Instant::now() > deadline && !interrupted {
                // SAFETY: plain kill(2) on our child.
                unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
                interrupted = true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let text = std::fs::read_to_string(&self.stdout).unwrap();
        let maps = text
            .lines()
            .filter_map(|l| {
                let (name, value) = l.strip_prefix('@')?.split_once(": ")?;
                Some((name.to_owned(), value.trim().parse().ok()?))
            })
            .collect();
        (maps, self.output())
    }
}

/// The class a block's owner path names (`HOST@backward@gradient` -> gradient), if any.
fn class_of(owner: &str) -> Option<&'static str> {
    let parts: Vec<&str> = owner.split('@').collect();
    ["weight", "gradient", "optimizer_state"].into_iter().find(|c| parts.contains(c))
}

struct Live<'a> {
    malloc: &'a DbRow,
    size: u64,
    owner: String,
}

/// Blocks live at `t` from the DB alone: c10 MALLOC rows at or before `t` whose FREE (the next
/// non-shadow FREE at the same Ptr) is after `t` or absent.
fn live_at<'a>(rows: &[&'a DbRow], t: u64) -> Vec<Live<'a>> {
    let mut frees: HashMap<&str, Vec<u64>> = HashMap::new();
    for r in rows.iter().filter(|r| r.name == FREE && r.event == "FREE" && !r.is_shadow()) {
        frees.entry(r.ptr.as_str()).or_default().push(r.ts);
    }
    for v in frees.values_mut() {
        v.sort_unstable();
    }
    let mut live = Vec::new();
    for m in rows.iter().filter(|r| r.name == ALLOC && r.event == "MALLOC" && r.ts <= t) {
        let freed = frees.get(m.ptr.as_str()).and_then(|v| v.iter().find(|&&f| f > m.ts));
        if freed.is_none_or(|&f| f > t) {
            let size = m.attr_u64("size").unwrap_or_else(|| panic!("MALLOC without a size: {m:?}"));
            let owner = m.attr.get("owner").cloned().unwrap_or_default();
            live.push(Live { malloc: m, size, owner });
        }
    }
    live
}

/// Live bytes by owner, for failure messages.
fn decomposition(live: &[Live]) -> String {
    let mut by: BTreeMap<&str, (u64, usize)> = BTreeMap::new();
    for b in live {
        let e = by.entry(b.owner.as_str()).or_default();
        e.0 += b.size;
        e.1 += 1;
    }
    by.iter().map(|(o, (bytes, n))| format!("  {o:<32} {bytes:>10} B in {n} blocks\n")).collect()
}

/// The single MSTX Mark row with `message`.
fn mark_row<'a>(rows: &[&'a DbRow], message: &str) -> &'a DbRow {
    let name = format!("\"{message}\"");
    let found: Vec<&&DbRow> =
        rows.iter().filter(|r| r.event == "MSTX" && r.event_type == "Mark" && r.name == name).collect();
    assert_eq!(found.len(), 1, "one Mark row {name}: {found:?}");
    found[0]
}

/// What a traced run of the torch job left: the tracer's output and stderr, the job's ledger,
/// and bpftrace's counts when bpftrace is installed.
struct TorchRun {
    output: Output,
    stderr: String,
    ledger: PathBuf,
    counts: Option<(BTreeMap<String, u64>, String)>,
}

/// Runs the torch job to its gate, attaches the tracer (and the bpftrace counter) to it, lets it
/// finish and stops the tracer.
fn traced_torch_run(env: &TestEnv, python: &Path, markers: &Path) -> TorchRun {
    let workload = env.workload.with_file_name("torch_cpu_train.py");
    let ledger = env.scratch.join("ledger.jsonl");
    let ready = env.scratch.join("ready");
    let gate = env.scratch.join("gate");
    let out = env.scratch.join("out");

    let mut job = Command::new(python)
        .arg(&workload)
        .args(["--ledger", &ledger.display().to_string()])
        .args(["--ready", &ready.display().to_string()])
        .args(["--gate", &gate.display().to_string()])
        .args(["--steps", "6", "--checkpoint-step", "3"])
        .env("PYTHONPATH", markers)
        .stdin(Stdio::null())
        .spawn()
        .expect("start the torch workload");
    let pid: u32 = wait_for_file(&ready, &mut job, Duration::from_secs(120)).trim().parse().unwrap();
    assert_eq!(pid, job.id());

    let out_s = out.display().to_string();
    let pid_s = pid.to_string();
    let mut tracer = Tracer::spawn(env, &["trace", "--pid", &pid_s, "--output", &out_s], &[]);
    let counter = match bpftrace() {
        Some(bin) => {
            let libc10 = mapped(pid, |n| n == "libc10.so").expect("torch's libc10.so is mapped");
            let native = mapped(pid, |n| n.starts_with("_native") && n.ends_with(".so")).expect("memscope._native");
            let mut c = Counter::spawn(&bin, &env.scratch, pid, &libc10, &native);
            c.wait_live(Duration::from_secs(60));
            Some(c)
        }
        None => {
            eprintln!("SKIPPED (call counts against bpftrace): bpftrace is not installed");
            None
        }
    };
    tracer.wait_live(Duration::from_secs(60));
    std::thread::sleep(Duration::from_millis(200));
    std::fs::write(&gate, "go").unwrap();

    assert_eq!(wait_child(&mut job, Duration::from_secs(180)), 0, "the torch workload failed");
    let (code, stderr) = tracer.finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");
    let counts = counter.map(Counter::finish);
    eprintln!("tracer:\n{stderr}");
    TorchRun { output: read_output(&out), stderr, ledger, counts }
}

/// The c10 rows: MALLOC of alloc_cpu and FREE of free_cpu only, all HOST rows on cpu.
fn c10_rows<'a>(rows: &[&'a DbRow]) -> Vec<&'a DbRow> {
    let c10: Vec<&DbRow> = rows.iter().copied().filter(|r| r.name == ALLOC || r.name == FREE).collect();
    let odd: Vec<&&DbRow> = c10
        .iter()
        .filter(|r| !((r.name == ALLOC && r.event == "MALLOC") || (r.name == FREE && r.event == "FREE")))
        .collect();
    assert!(
        odd.is_empty(),
        "{} c10 rows are neither MALLOC of alloc_cpu nor FREE of free_cpu (alloc_cpu returns a pointer, \
         free_cpu nothing: neither has a status to fail with), e.g. {:?}",
        odd.len(),
        &odd[..odd.len().min(3)]
    );
    assert!(c10.iter().all(|r| r.event_type == "HOST" && r.device == "cpu"), "c10 rows are HOST rows on cpu");
    c10
}

/// The live blocks at the checkpoint are exactly torch's weights, gradients and optimizer
/// state, each with its owner.
fn assert_checkpoint_decomposition(c10: &[&DbRow], begin: &DbRow, cp: &Checkpoint) {
    let near: Vec<&&DbRow> = c10.iter().filter(|r| !r.is_shadow() && r.ts.abs_diff(cp.t) < QUIET_NS).collect();
    assert!(near.is_empty(), "the workload was to be quiet around the checkpoint {}: {near:?}", cp.t);
    let live = live_at(c10, cp.t);
    let decomp = decomposition(&live);
    eprintln!("live at the checkpoint (step {}, t {}):\n{decomp}", cp.step, cp.t);
    let mut by_class: BTreeMap<&str, u64> = BTreeMap::new();
    for b in &live {
        if let Some(class) = class_of(&b.owner) {
            *by_class.entry(class).or_default() += b.size;
        }
    }
    let by_ptr: HashMap<u64, &Live> = live.iter().map(|b| (b.malloc.ptr_value().unwrap(), b)).collect();
    for (class, want_owner, list, bytes) in [
        ("weight", "HOST@weight", &cp.weight, cp.weight_bytes),
        ("gradient", "HOST@backward@gradient", &cp.gradient, cp.gradient_bytes),
        ("optimizer_state", "HOST@optimizer_state", &cp.optimizer_state, cp.optimizer_state_bytes),
    ] {
        let got = by_class.get(class).copied().unwrap_or(0);
        assert_eq!(got, bytes, "{class}: live bytes the tracer attributes vs torch's storage bytes\n{decomp}");
        for &(ptr, nbytes) in list {
            let b = by_ptr
                .get(&ptr)
                .unwrap_or_else(|| panic!("{class} storage {ptr:#x} ({nbytes} B) is no live block at T\n{decomp}"));
            assert_eq!(b.size, nbytes, "{class} storage {ptr:#x}: block size vs storage nbytes: {:?}", b.malloc);
            assert_eq!(b.owner, want_owner, "{class} storage {ptr:#x}: owner: {:?}", b.malloc);
        }
    }
    // Everything the job made after its first mark and still holds at T is one of those
    // storages: parameters, gradients and state are all it keeps across a step.
    let torch_ptrs: HashMap<u64, u64> =
        cp.weight.iter().chain(&cp.gradient).chain(&cp.optimizer_state).copied().collect();
    let born: Vec<&Live> = live.iter().filter(|b| b.malloc.ts > begin.ts).collect();
    let extra: Vec<&DbRow> =
        born.iter().filter(|b| !torch_ptrs.contains_key(&b.malloc.ptr_value().unwrap())).map(|b| b.malloc).collect();
    assert!(extra.is_empty(), "blocks live at T that torch does not hold: {extra:#?}\n{decomp}");
    assert_eq!(born.len(), torch_ptrs.len(), "live blocks born in the job vs torch's storages\n{decomp}");
}

/// Between the two count marks the tracer has one row per alloc_cpu and free_cpu call that
/// bpftrace counted.
fn assert_counts_match_bpftrace(
    c10: &[&DbRow],
    marks: (&DbRow, &DbRow),
    cp: &Checkpoint,
    counts: &(BTreeMap<String, u64>, String),
    empty_tensors: u64,
) {
    let (maps, bt_output) = counts;
    let (begin, end) = marks;
    assert!(begin.ts < end.ts);
    let window: Vec<&&DbRow> = c10.iter().filter(|r| !r.is_shadow() && r.ts > begin.ts && r.ts < end.ts).collect();
    assert!(
        window.iter().all(|r| r.tid == cp.tid),
        "the counted phase allocates from the main thread only (the premise of an exact count)"
    );
    let db_alloc = window.iter().filter(|r| r.name == ALLOC).count() as u64;
    let db_free = window.iter().filter(|r| r.name == FREE).count() as u64;
    let bt = |k: &str| maps.get(k).copied().unwrap_or(0);
    eprintln!(
        "counted phase: tracer {db_alloc} alloc_cpu / {db_free} free_cpu rows; bpftrace {} / {} calls \
         (zero-size allocs {}, null frees {}, marks {})",
        bt("alloc"),
        bt("free"),
        bt("alloc_zero"),
        bt("free_null"),
        bt("marks")
    );
    assert_eq!(bt("marks"), 2, "bpftrace saw both count marks:\n{bt_output}");
    assert!(bt("alloc") > 0, "bpftrace counted nothing:\n{bt_output}");
    assert_eq!(
        bt("alloc_zero"),
        empty_tensors,
        "the job's empty tensors are zero-size alloc_cpu calls (no block, no failure: no row)"
    );
    assert_eq!(bt("free_null"), 0, "torch never frees null through free_cpu");
    assert_eq!(db_alloc, bt("alloc"), "alloc_cpu: tracer rows vs bpftrace calls\n{bt_output}");
    assert_eq!(db_free, bt("free"), "free_cpu: tracer rows vs bpftrace calls\n{bt_output}");
}

#[test]
fn real_torch_owner_bytes_match_torch_and_calls_match_bpftrace() {
    // The tier first: run any other way this fails with how to run it, rather than skip.
    let env = env("real_torch");
    let Some((python, markers)) = real_torch() else { return };
    let started = Instant::now();
    let run = traced_torch_run(&env, &python, &markers);

    let db = run.output.db("device_cpu").to_owned();
    assert_eq!(meta(&db, "records_lost").as_deref(), Some("0"), "records were lost: {}", run.stderr);
    let rows: Vec<&DbRow> = run.output.files["device_cpu"].1.iter().collect();
    let c10 = c10_rows(&rows);
    // The job's empty tensors (`alloc_cpu(0)` returning NULL) are no failures.
    let errors: Vec<&&DbRow> = rows.iter().filter(|r| r.event == "API_ERROR").collect();
    assert!(errors.is_empty(), "{} API_ERROR rows, e.g. {:?}", errors.len(), &errors[..errors.len().min(3)]);
    assert!(run.stderr.contains(" 0 failed)"), "the summary counts no failed allocation:\n{}", run.stderr);

    // ---- 1. owner decomposition at the checkpoint
    let cp = read_checkpoint(&run.ledger);
    let begin = mark_row(&rows, COUNT_BEGIN);
    let end = mark_row(&rows, COUNT_END);
    assert_checkpoint_decomposition(&c10, begin, &cp);

    // ---- 2. call counts against bpftrace
    let Some(counts) = &run.counts else {
        eprintln!("real_torch: done in {:.1} s (bpftrace check skipped)", started.elapsed().as_secs_f64());
        return;
    };
    assert_counts_match_bpftrace(&c10, (begin, end), &cp, counts, read_empty_tensors(&run.ledger));
    eprintln!("real_torch: done in {:.1} s", started.elapsed().as_secs_f64());
}

/// torch_unmarked_train.py's ledger: its checkpoint's sums and its end.
#[derive(Deserialize)]
struct UnmarkedCheckpoint {
    t: u64,
    weight_bytes: u64,
    gradient_bytes: u64,
    optimizer_state_bytes: u64,
}

#[derive(Deserialize)]
struct UnmarkedDone {
    steps: u64,
    leak_line: u64,
    leak_bytes: u64,
    file: String,
}

fn ledger_line<T: for<'de> Deserialize<'de>>(ledger: &Path, kind: &str) -> T {
    let text = std::fs::read_to_string(ledger).unwrap();
    let line = text.lines().find(|l| l.contains(&format!("\"kind\": \"{kind}\""))).expect("the ledger line");
    serde_json::from_str(line).unwrap()
}

/// Traces the job nobody edited (no markers package on its path), attached by pid with no flag.
/// torch_unmarked_train.py for `steps` steps, with `flags` for `trace --pid`.
fn traced_unmarked_run(env: &TestEnv, python: &Path, steps: u32, flags: &[&str]) -> (Output, String, PathBuf, PathBuf) {
    let workload = env.workload.with_file_name("torch_unmarked_train.py");
    let (ledger, ready, gate, out) = (
        env.scratch.join("ledger.jsonl"),
        env.scratch.join("ready"),
        env.scratch.join("gate"),
        env.scratch.join("out"),
    );
    let mut job = Command::new(python)
        .arg(&workload)
        .args(["--ledger", &ledger.display().to_string(), "--ready", &ready.display().to_string()])
        .args(["--gate", &gate.display().to_string(), "--steps", &steps.to_string(), "--checkpoint-step", "3"])
        .env_remove("PYTHONPATH")
        .stdin(Stdio::null())
        .spawn()
        .expect("start the torch workload");
    let pid: u32 = wait_for_file(&ready, &mut job, Duration::from_secs(120)).trim().parse().unwrap();
    let (out_s, pid_s) = (out.display().to_string(), pid.to_string());
    let mut args = vec!["trace", "--pid", &pid_s, "--output", &out_s];
    args.extend_from_slice(flags);
    let mut tracer = Tracer::spawn(env, &args, &[]);
    tracer.wait_live(Duration::from_secs(60));
    std::thread::sleep(Duration::from_millis(300));
    std::fs::write(&gate, "go").unwrap();
    assert_eq!(wait_child(&mut job, Duration::from_secs(180)), 0, "the torch workload failed");
    let (code, stderr) = tracer.finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");
    (read_output(&out), stderr, ledger, run_dir(&out))
}

fn hex(text: &str) -> u64 {
    u64::from_str_radix(text.trim_start_matches("0x"), 16).unwrap()
}

/// A leaks report's candidates: pointer -> size.
fn candidates(report: &serde_json::Value) -> BTreeMap<u64, u64> {
    let all = report["candidates"].as_array().unwrap_or_else(|| panic!("{report:#}"));
    all.iter().map(|c| (hex(c["ptr"].as_str().unwrap()), c["size"].as_u64().unwrap())).collect()
}

#[test]
fn real_torch_without_markers_gets_owners_steps_and_the_leaks_line_from_its_python_stacks() {
    let env = env("real_torch_unmarked");
    let Some((python, _)) = real_torch() else { return };
    let (output, stderr, ledger, run) = traced_unmarked_run(&env, &python, 6, &[]);
    let cp: UnmarkedCheckpoint = ledger_line(&ledger, "checkpoint");
    let done: UnmarkedDone = ledger_line(&ledger, "done");
    let rows: Vec<&DbRow> = output.files["device_cpu"].1.iter().collect();
    let c10 = c10_rows(&rows);

    // Owners: each class's live bytes at the checkpoint are torch's own sums (within 1 %), and
    // they were inferred (the job has no markers).
    let live = live_at(&c10, cp.t);
    let bytes =
        |class: &str| -> u64 { live.iter().filter(|b| class_of(&b.owner) == Some(class)).map(|b| b.size).sum() };
    let tree = decomposition(&live);
    for (class, want) in
        [("weight", cp.weight_bytes), ("gradient", cp.gradient_bytes), ("optimizer_state", cp.optimizer_state_bytes)]
    {
        let got = bytes(class);
        assert!(want > 0 && got.abs_diff(want) * 100 <= want, "{class}: {got} B inferred vs torch's {want} B\n{tree}");
    }
    for b in live.iter().filter(|b| class_of(&b.owner).is_some()) {
        assert_eq!(b.malloc.attr.get("owner_source").map(String::as_str), Some("inferred"), "{:?}", b.malloc);
    }

    // Steps: one per loop iteration, found from the stacks.
    let steps: Vec<&&DbRow> = rows.iter().filter(|r| r.event == "SYSTEM" && r.event_type == "STEP").collect();
    assert_eq!(steps.len() as u64, done.steps, "{steps:?}\n{stderr}");
    assert!(steps.iter().all(|r| r.attr.get("source").map(String::as_str) == Some("inferred")), "{steps:?}");

    // The leak: every leaked tensor's site is the job's line that made it, and the leaks
    // analysis, which needs steps, finds them.
    let site = format!("{}:{} main", done.file, done.leak_line);
    let leaked: Vec<&&DbRow> =
        c10.iter().filter(|r| r.event == "MALLOC" && r.attr_u64("size") == Some(done.leak_bytes)).collect();
    assert_eq!(leaked.len() as u64, done.steps, "one leaked tensor per step: {leaked:?}");
    for r in &leaked {
        assert_eq!(r.attr.get("site"), Some(&site), "{r:?}");
    }
    let out = Command::new(&env.bin)
        .args([
            "analyze",
            run.to_str().unwrap(),
            "--analysis",
            "leaks,sites",
            "--device",
            "cpu",
            "--json",
            "--no-write",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let all: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let report = all.as_array().unwrap().iter().find(|r| r["analysis"] == "leaks").expect("a leaks report");
    // The analysis' defaults: born after the warm-up (the first step) and alive a whole step
    // after their birth step's end; the last step's end is the trace's, so the leaks of steps
    // 2..=N-2 are the candidates, and nothing else is (weights and Adam's state are born in
    // step 1; every other tensor is freed within a step).
    let mut by_birth = leaked.clone();
    by_birth.sort_by_key(|r| r.ts);
    let want: BTreeMap<u64, u64> =
        by_birth[1..done.steps as usize - 2].iter().map(|r| (hex(&r.ptr), done.leak_bytes)).collect();
    let got = candidates(report);
    assert_eq!(got, want, "{report:#}");
    // The sites analysis groups them under the job's line, and only there.
    let sites = all.as_array().unwrap().iter().find(|r| r["analysis"] == "sites").expect("a sites report");
    let by_site = sites["leaks_by_site"].as_array().unwrap_or_else(|| panic!("{sites:#}"));
    assert_eq!(by_site.len(), 1, "{sites:#}");
    assert_eq!(by_site[0]["site"], site.as_str(), "{sites:#}");
    assert_eq!(by_site[0]["blocks"].as_u64(), Some(want.len() as u64), "{sites:#}");
}

/// The same job traced with `--no-infer`: no Python stack is read, so no step is written, and
/// the leaks analysis finds the steps from the repeating pattern of the job's allocations. Its
/// candidates are the job's leaked tensors (the ledger's size, which nothing else has), one per
/// iteration past the warm-up but for the last ones, and nothing else.
#[test]
fn real_torch_traced_without_stacks_gets_its_steps_from_the_pattern_of_its_allocations() {
    let env = env("real_torch_pattern");
    let Some((python, _)) = real_torch() else { return };
    let steps = 10;
    let (output, _, ledger, run) = traced_unmarked_run(&env, &python, steps, &["--no-infer"]);
    let done: UnmarkedDone = ledger_line(&ledger, "done");
    let rows: Vec<&DbRow> = output.files["device_cpu"].1.iter().collect();
    assert!(!rows.iter().any(|r| r.event == "SYSTEM" && r.event_type == "STEP"), "no step rows without stacks");
    let leaked: BTreeMap<u64, u64> = c10_rows(&rows)
        .iter()
        .filter(|r| r.event == "MALLOC" && r.attr_u64("size") == Some(done.leak_bytes))
        .map(|r| (r.ptr_value().unwrap(), done.leak_bytes))
        .collect();
    assert_eq!(leaked.len() as u64, done.steps, "one leaked tensor per step");
    let out = Command::new(&env.bin)
        .args(["analyze", run.to_str().unwrap(), "--analysis", "leaks", "--device", "cpu", "--json", "--no-write"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let all: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let report = all.as_array().unwrap().iter().find(|r| r["analysis"] == "leaks").expect("a leaks report");
    let boundaries = report["boundaries"].as_u64().unwrap_or_else(|| panic!("{report:#}"));
    // Iteration 1 makes Adam's state and differs; from the second on each starts a step.
    assert!((u64::from(steps) - 2..=u64::from(steps)).contains(&boundaries), "{report:#}");
    let sources = report["step_sources"].as_object().unwrap();
    assert!(sources.len() == 1 && sources.keys().all(|k| k.starts_with("the repeating pattern")), "{report:#}");
    let got = candidates(report);
    assert!(got.iter().all(|(p, _)| leaked.contains_key(p)), "only leaked tensors: {report:#}");
    assert!(got.len() >= steps as usize - 5, "{} of {steps} leaked tensors: {report:#}", got.len());
}

#[derive(Deserialize)]
struct RankCheckpoint {
    rank: u32,
    pid: u32,
    t: u64,
    weight_bytes: u64,
    gradient_bytes: u64,
}

/// FSDP2 on the CPU (gloo), two ranks forked by the launched job, no markers: at each rank's
/// checkpoint, the live bytes the tracer inferred as that rank's `fsdp2@sharded_weight` and
/// `fsdp2@gradient` are its local shards' bytes as torch counts them (within 1 %).
#[test]
fn real_fsdp2_ranks_get_their_sharded_weights_and_gradients_from_their_stacks() {
    let env = env("real_torch_fsdp2");
    let Some((python, _)) = real_torch() else { return };
    let workload = env.workload.with_file_name("torch_fsdp2_train.py");
    let (ledger, out) = (env.scratch.join("ledger.jsonl"), env.scratch.join("out"));
    let _ = std::fs::remove_file(&ledger);
    let (out_s, py_s, workload_s, ledger_s) = (
        out.display().to_string(),
        python.display().to_string(),
        workload.display().to_string(),
        ledger.display().to_string(),
    );
    let args = ["trace", "--output", &out_s, "--", &py_s, &workload_s, "--ledger", &ledger_s];
    let (code, stderr) = Tracer::spawn_with(&env, &args, &[("PYTHONPATH", None)]).finish(Duration::from_secs(240));
    assert_eq!(code, Some(0), "{stderr}");
    let output = read_output(&out);
    let rows: Vec<&DbRow> = output.files["device_cpu"].1.iter().collect();
    let text = std::fs::read_to_string(&ledger).unwrap();
    let ranks: Vec<RankCheckpoint> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(ranks.len(), 2, "{text}");
    for cp in &ranks {
        // The ranks exit with blocks live: their shadow frees are there too (live_at skips them).
        let own: Vec<&DbRow> = rows.iter().copied().filter(|r| r.pid == cp.pid).collect();
        let live = live_at(&own, cp.t);
        let tree = decomposition(&live);
        let bytes = |label: &str| -> u64 {
            live.iter().filter(|b| b.owner.split('@').any(|p| p == label)).map(|b| b.size).sum()
        };
        for (label, want) in [("sharded_weight", cp.weight_bytes), ("gradient", cp.gradient_bytes)] {
            let got = bytes(label);
            assert!(
                want > 0 && got.abs_diff(want) * 100 <= want,
                "rank {}: fsdp2@{label}: {got} B inferred vs torch's {want} B\n{tree}",
                cp.rank
            );
        }
        assert!(live.iter().any(|b| b.owner.contains("fsdp2@sharded_weight")), "{tree}");
    }
}
