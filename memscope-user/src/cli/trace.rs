//! `memscope-bpf trace`: record a running job (`--pid`) or a program launched under the tracer
//! (`-- COMMAND`). Privileged.
//!
//! This module turns arguments into a checked plan (target, libraries, output) and hands it to
//! `session`; everything that can be checked before loading BPF is checked here, so a mistake
//! costs one clear line and no half-made output.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _};
use memscope_core::stacks::spec::{CallStacks, StackOptions, Unwind, DEFAULT_WINDOW};
use memscope_core::store::Format;

use super::capture::CaptureArgs;
use crate::attach::libs::{self, Library};
use crate::attach::loader::bpf_log::BpfLogLevel;
use crate::session::launch;
use crate::session::preflight::{self, PreflightError};
use crate::session::{self, Plan, Target};
use crate::terminal::say::say;
use crate::terminal::status::Mode;

/// Record accelerator memory events of a running job or of a program launched under the tracer.
///
/// Attach:  memscope-bpf trace --pid 4242 --output ./msout
/// Launch:  memscope-bpf trace --output ./msout -- python train.py
///
/// Stops on Ctrl-C, SIGTERM, SIGHUP, --duration, or when the target and the children it forked
/// have all exited (--no-follow: the target alone is traced and awaited); then finishes one DB
/// per device under OUTPUT/memscope_<pid>_<time>_ascend/ and prints a summary while the probes
/// detach (Ctrl-C again: exit without waiting for that). Needs root.
#[derive(Debug, clap::Args)]
#[command(verbatim_doc_comment)]
pub struct Args {
    /// Attach to this running process. Only calls made after the probes are live are recorded.
    #[arg(short, long, value_name = "PID", conflicts_with = "command")]
    pub pid: Option<u32>,

    /// Folder for the results; each run gets its own folder inside it. Folders are made 0700 and
    /// files 0600; under sudo they belong to the user who ran sudo (SUDO_UID/SUDO_GID).
    #[arg(short, long, value_name = "DIR", default_value = "memscopeDumpResults")]
    pub output: PathBuf,

    #[command(flatten)]
    pub capture: CaptureArgs,

    /// Also probe this library: a file of any name (e.g. a copy of libascendcl.so) or a folder.
    /// Repeatable. By default libraries come from the target's maps and ASCEND_HOME_PATH. A file
    /// that cannot be probed (not a 64-bit ELF of this machine, over 2 GiB) is a warning, and an
    /// error only when no library is left to probe.
    #[arg(long = "lib", value_name = "PATH")]
    pub libs: Vec<PathBuf>,

    /// Also look for separate debug files here (torch_npu's hidden allocator symbols live in
    /// them): a folder with `<name>.debug` files or a `.build-id/` tree. Repeatable.
    #[arg(long = "debug-dir", value_name = "DIR")]
    pub debug_dirs: Vec<PathBuf>,

    /// Trace only the target process, not the children it forks. By default every process the
    /// target forks (after the attach, with --pid) is traced too, and the trace goes on until
    /// the last of them exits; in attach mode that puts the probes on the libraries for every
    /// process (others that map them trap and are filtered out in the kernel, at about 0.8 µs of
    /// their CPU per runtime memory call, most of what a traced call costs), --no-follow keeps
    /// them on the target alone. With --pid on a node whose other jobs use the same CANN
    /// install, prefer --no-follow unless the target forks workers after the attach.
    #[arg(long)]
    pub no_follow: bool,

    /// Analyses to run on the trace when it stops, by msMemScope's names (decompose,
    /// inefficient, leaks, oom; and sites, ours), comma-separated: exactly what `memscope-bpf analyze RUN_DIR
    /// --analysis LIST` prints and stores, run on the DBs just written (so online and offline
    /// results are the same by construction). Default: none.
    #[arg(long, value_name = "LIST")]
    pub analysis: Option<String>,

    /// Record nothing until the traced program starts collection itself with the markers
    /// (`memscope.start()`, or msMemScope's `start()` from `memscope.msmemscope`), as
    /// msMemScope's API mode does. Its `stop()` pauses again. Without this flag recording starts
    /// at once and `stop()`/`start()` only pause and resume it.
    #[arg(long)]
    pub wait_for_start: bool,

    /// Call stacks to record with each row, in msMemScope's spelling: `c` (native frames),
    /// `python`, or both as `c,python`, each with an optional depth (`c:16`, default 50).
    /// Native stacks are taken at the entry of the thread's outermost traced call (a driver row
    /// shares its runtime call's), walked through frame pointers (at most 127 frames), and
    /// symbolized from the files (functions, file:line, inlined calls) into the `Call Stack(C)`
    /// column and the `ms_stacks`/`ms_frames` tables. A stack that ends before the thread's
    /// entry is marked truncated (a library on the way was built without frame pointers).
    /// Python stacks (CPython 3.9-3.13) are the calling thread's own, read at the same entry,
    /// `file(line): function` innermost first, into `Call Stack(Python)` (at most 64 frames);
    /// threads that run no Python get none.
    #[arg(long, value_name = "KINDS", value_parser = parse_call_stack)]
    pub call_stack: Option<CallStacks>,

    /// Owners, steps and sites without markers are read from the Python stack of each
    /// allocation (one walk of the interpreter's frames per traced allocation call; frees need
    /// none), whenever the target runs CPython: the built-in rules (`probes --owner-rules` lists
    /// them; docs/owners.md) name weights, gradients, optimizer state, activations, FSDP's
    /// shards, vLLM's KV cache and more. --no-infer turns that off (no walk unless
    /// --call-stack python asks for the column). Markers always win over an inferred owner.
    #[arg(long)]
    pub no_infer: bool,

    /// Sample each traced thread's Python stack HZ times a second (default 99) and write what
    /// ran when as msMemScope's `python_trace_<pid>` tables, which MindStudio Insight draws as a
    /// flame graph per thread: a function runs from the first sample that finds it on the stack
    /// to the last before one that does not, each end put half way to the neighbouring sample
    /// (so within half a period of the true call or return for a thread on a CPU; a function
    /// that starts and ends between two samples is not seen). A timer on every CPU; the cost is
    /// in docs/benchmarks.md.
    #[arg(long, value_name = "HZ", num_args = 0..=1, default_missing_value = "99",
          value_parser = clap::value_parser!(u32).range(1..=10000))]
    pub python_trace: Option<u32>,

    /// More owner rules, tried before the built-in ones: one per line, `FILE:FUNCTION OWNER
    /// [temporary=OWNER] [phase=NAME] [lines=FIRST-LAST]`, in the built-in table's format
    /// (`probes --owner-rules` prints it to copy from; `lines=` names one branch of a function,
    /// as vLLM's KV cache kinds need); a bad line is an error naming it.
    #[arg(long, value_name = "FILE", conflicts_with = "no_infer")]
    pub owner_rules: Option<PathBuf>,

    /// Find steps without markers from this frame: a step starts at each allocation under
    /// FILE:FUNCTION (e.g. `train.py:train_step`) that follows one not under it. Default: a
    /// step starts at the first forward allocation after an optimizer step. Markers' steps,
    /// when the job has any, win.
    #[arg(long, value_name = "FILE:FUNCTION", value_parser = super::owner_rules::parse_step_frame, conflicts_with = "no_infer")]
    pub step_frame: Option<memscope_core::infer::rules::Pattern>,

    /// How native stacks are walked: fp (frame pointers, in the kernel; the default) or dwarf
    /// (a window of the stack is copied at each call and unwound here from the libraries'
    /// `.eh_frame`, as `perf --call-graph dwarf`): whole stacks through libraries built without
    /// frame pointers (`probes --pid` says which), at the cost of copying the window.
    #[arg(long, value_enum, default_value_t = Unwind::Fp, requires = "call_stack")]
    pub unwind: Unwind,

    /// Bytes of stack copied per call with --unwind dwarf, 512 to 16384: frames deeper than the
    /// window are not reached (the stack is then marked truncated).
    #[arg(long, value_name = "BYTES", default_value_t = DEFAULT_WINDOW,
          value_parser = clap::value_parser!(u32).range(512..=16384))]
    pub stack_window: u32,

    /// Print what the probes report about their own trouble, as it happens: a user stack the
    /// kernel could not walk, a stack window it could not copy, a Python walk whose reads of
    /// the interpreter failed or that ran past its bound of thread states (with the thread and
    /// the error). `warn` (the default when the flag is given bare) is only that; `debug` adds
    /// the expected cases (threads running no Python, window reads retried smaller). The
    /// summary counts the messages; the counts of the trouble itself are always in it.
    #[arg(long, value_enum, value_name = "LEVEL", num_args = 0..=1, default_missing_value = "warn")]
    pub bpf_log: Option<BpfLogLevel>,

    /// Serve the trace's totals for Prometheus on this address while it runs: `GET /metrics`
    /// (per device: live, peak and failed allocations; per framework pool: used and reserved;
    /// the tracer's recorded and lost records) and `GET /healthz`. Use a loopback address unless
    /// the network is trusted; port 0 picks a free one (the address is printed at the start).
    #[arg(long, value_name = "ADDR:PORT")]
    pub listen: Option<std::net::SocketAddr>,

    /// The program to launch, after `--`. Its probes are live before its first instruction.
    #[arg(last = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

/// Libraries for a launched program: `--lib`, the program itself when it links the CUDA runtime
/// statically, the libraries of the `torch`/`torch_npu` packages a Python interpreter would
/// import, then the `ASCEND_HOME_PATH` and `LD_LIBRARY_PATH` folders of the environment it
/// inherits from us.
fn launch_libraries(user: &[Library], program: &std::ffi::OsStr) -> Vec<Library> {
    let env: HashMap<String, String> = std::env::vars().collect();
    let mut all = user.to_vec();
    if let Ok(path) = launch::resolve(program) {
        if libs::is_python(&path) {
            all.extend(libs::python_packages(&path));
        }
        let shown = path.display().to_string();
        all.extend(libs::static_runtime(path, shown, libs::Origin::Executable));
    }
    all.extend(libs::from_env(&env, Path::new("/"), true));
    libs::with_dependencies(all)
}

/// Libraries for a running process: `--lib`, what it has mapped, and its `ASCEND_HOME_PATH`.
/// Maps that cannot be read are the error `probes` gives, not "no library".
fn attach_libraries(pid: u32, user: &[Library]) -> anyhow::Result<Vec<Library>> {
    let mut all = user.to_vec();
    all.extend(super::probes::mapped_libraries(pid)?);
    if let Ok(env) = libs::process_env(pid) {
        all.extend(libs::from_env(&env, Path::new(&format!("/proc/{pid}/root")), false));
    }
    Ok(libs::with_dependencies(all))
}

pub(crate) fn user_libraries(paths: &[PathBuf]) -> anyhow::Result<Vec<Library>> {
    let mut found = Vec::new();
    for path in paths {
        let libs = libs::from_user_path(path).context("--lib")?;
        if libs.is_empty() {
            bail!("--lib {}: no traced library in this folder (looked for the Ascend runtime's libascendcl.so, libacl_rt.so, libacl_rt_impl.so, NVIDIA's libcudart.so, libcuda.so, libc10_cuda.so and the others `probes --lib` lists); give the library file itself", path.display());
        }
        found.extend(libs);
    }
    Ok(found)
}

fn parse_call_stack(text: &str) -> Result<CallStacks, String> {
    CallStacks::parse(text).map_err(|e| e.to_string())
}

pub fn run(args: Args) -> anyhow::Result<()> {
    // Checked before tracing: a typo must not cost a whole run.
    let analyses = args.analysis.as_deref().map(super::analyze::parse_list).transpose()?;
    let rules = super::owner_rules::read(args.owner_rules.as_deref(), args.step_frame.clone())?;
    let format = args.capture.format;
    let target_given = args.pid.is_some() || !args.command.is_empty();
    if !target_given {
        bail!("nothing to trace: give --pid PID to attach to a running job, or `-- COMMAND` to launch one");
    }
    args.capture.check()?;
    crate::attach::loader::check_object()?;
    preflight::check_privileges()?;
    preflight::check_uprobes()?;
    super::probes::check_debug_dirs(&args.debug_dirs)?;
    args.capture.say_writer();
    let user = user_libraries(&args.libs)?;

    let (target, libraries) = match args.pid {
        Some(pid) => {
            // Before the output folder is made: a wrong pid leaves nothing behind.
            preflight::check_pid(pid)?;
            let libraries = attach_libraries(pid, &user)?;
            if libraries.is_empty() {
                return Err(PreflightError::NoLibrary {
                    where_: format!("in process {pid} (its maps and ASCEND_HOME_PATH)"),
                }
                .into());
            }
            preflight::check_output(&args.output)?;
            (Target::Pid(pid), libraries)
        }
        None => {
            preflight::check_output(&args.output)?;
            let libraries = launch_libraries(&user, &args.command[0]);
            if libraries.is_empty() {
                // A program may load its runtime later, by a path no variable names (ctypes, a
                // plugin): the trace starts all the same and probes what the job loads.
                say!(
                    "memscope-bpf: warning: no accelerator library is known before the launch (ASCEND_HOME_PATH, \
                     LD_LIBRARY_PATH, --lib, the Python packages): probing the ones the job loads as it loads them \
                     (their first calls may be missed; --lib probes one from the start)"
                );
            }
            // Fork now, before any thread exists; the child waits for the probes.
            let launched = launch::spawn_held(&args.command)?;
            (Target::Launched(launched), libraries)
        }
    };

    let command = args.command.iter().map(|a| a.to_string_lossy()).collect::<Vec<_>>().join(" ");
    let plan = Plan {
        bpf_log: args.bpf_log,
        stacks: StackOptions {
            call: args.call_stack.unwrap_or_default(),
            unwind: args.unwind,
            window: args.stack_window,
            infer: !args.no_infer,
            python_trace: args.python_trace,
        },
        rules,
        command: (!command.is_empty()).then_some(command),
        target,
        libraries,
        debug_dirs: args.debug_dirs,
        capture: args.capture.plan(args.output, Mode::choose(args.capture.quiet, args.capture.json)),
        follow: !args.no_follow,
        wait_for_start: args.wait_for_start,
        listen: args.listen,
    };
    let runtime =
        tokio::runtime::Builder::new_current_thread().enable_all().build().context("cannot start the async runtime")?;
    let quiet = args.capture.quiet;
    let session::Finished { summary, detaching } = runtime.block_on(session::run(plan))?;
    crate::terminal::say::text(format_args!("{summary}"));
    if let Some(analyses) = analyses {
        if summary.run_dir.is_dir() {
            super::analyze::after_trace(&summary.run_dir, analyses)
                .context("the analyses of the finished trace failed")?;
        }
    }
    // The allocator-settings advice, when a framework pool was traced (it reads the DBs).
    if !summary.pools.is_empty() && format == Format::Db {
        let dbs: Vec<std::path::PathBuf> = summary.devices.iter().filter_map(|d| d.file.clone()).collect();
        match super::advise::advise_text(&dbs) {
            Ok(text) if !text.trim().is_empty() => say!("{}", text.trim_end()),
            Ok(_) => {}
            Err(e) => say!("memscope-bpf: warning: no allocator advice: {e:#}"),
        }
    }
    // Last: the DBs, the summary and the analyses did not wait for the probes to go.
    runtime.block_on(detaching.wait(quiet));
    match summary.target_status {
        Some(code) if code != 0 => Err(super::PassOn(u8::try_from(code).unwrap_or(1)).into()),
        _ => Ok(()),
    }
}
