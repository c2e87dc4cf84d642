//! `memscope-bpf probes`: what a trace would attach to, layer by layer, without attaching
//! anything. With `--lib` only it reads files and needs no privileges. With `--pid` it also
//! says, per mapped file, whether native stacks through it will be whole.

use std::collections::HashSet;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _};
use memscope_core::apis::{Api, Attach, Family};
use memscope_core::printable::printable;
use memscope_core::stacks::{frame_pointers, python, unwind};

use crate::attach::libs::{self, Library, Origin};
use crate::attach::plan::{describe_debug, plan, DebugStatus};
use crate::attach::usdt_args::Arch;
use crate::attach::ProbeSet;
use crate::session::preflight::{self, PreflightError};

/// List the traced API symbols found in a process's libraries or in given files, per layer:
/// where each one is (dynsym, symtab, debug file), which would be attached, which are missing and
/// why, and how each layer will be seen. Attaches nothing.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Look at the libraries this process has mapped (and its ASCEND_HOME_PATH).
    #[arg(short, long, value_name = "PID")]
    pub pid: Option<u32>,

    /// A library file (any name) or folder to inspect. Repeatable.
    #[arg(long = "lib", value_name = "PATH")]
    pub libs: Vec<PathBuf>,

    /// Also look for separate debug files (hidden symbols of stripped libraries) here: a folder
    /// with `<name>.debug` files or a `.build-id/` tree. Repeatable.
    #[arg(long = "debug-dir", value_name = "DIR")]
    pub debug_dirs: Vec<PathBuf>,

    /// Print the owner rules `trace` applies to Python stacks (the built-in table, or with
    /// FILE, that file's rules first, checked as `trace --owner-rules FILE` checks them) and
    /// exit. The output is itself a valid rules file, to copy lines from.
    #[arg(long, value_name = "FILE", num_args = 0..=1, default_missing_value = "")]
    pub owner_rules: Option<std::ffi::OsString>,

    /// As for `trace`: probe the Impl symbols only (default) or both public and Impl.
    #[arg(long, value_enum, value_name = "SET", default_value_t = ProbeSet::Default)]
    pub probe_set: ProbeSet,

    /// Read the --lib files as another architecture's, to check from this machine the
    /// libraries of another kind of machine (an aarch64 wheel's on an x86-64 workstation): which
    /// symbols would be attached, at which file offsets, and the USDT sites' arguments in that
    /// architecture's registers. Default: this machine's. Nothing is attached, so not with --pid.
    #[arg(long, value_enum, value_name = "ARCH", requires = "libs", conflicts_with = "pid")]
    pub arch: Option<FilesArch>,
}

/// `--arch`: the architectures whose files the tracer reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum FilesArch {
    #[value(name = "x86-64", alias = "x86_64", alias = "amd64")]
    X86_64,
    #[value(name = "aarch64", alias = "arm64")]
    Aarch64,
}

impl From<FilesArch> for Arch {
    fn from(arch: FilesArch) -> Self {
        match arch {
            FilesArch::X86_64 => Self::X86_64,
            FilesArch::Aarch64 => Self::Aarch64,
        }
    }
}

fn origin(o: &Origin) -> String {
    match o {
        Origin::UserPath => "--lib".into(),
        Origin::Mapped { pid } => format!("mapped by pid {pid}"),
        Origin::AscendHome => "ASCEND_HOME_PATH".into(),
        Origin::AtbHome => "ATB_HOME_PATH".into(),
        Origin::LibraryPath => "LD_LIBRARY_PATH".into(),
        Origin::Dependency => "needed by a traced library".into(),
        Origin::Executable => "the program, with the CUDA runtime linked in".into(),
        Origin::PythonPackage => "a framework package of the launched Python".into(),
    }
}

/// The known libraries a process maps, or why its maps cannot be read (`trace` says the same).
pub fn mapped_libraries(pid: u32) -> anyhow::Result<Vec<Library>> {
    libs::from_maps(pid).with_context(|| {
        format!("cannot read /proc/{pid}/maps (are you allowed to inspect this process? another user's needs root or CAP_SYS_PTRACE)")
    })
}

pub fn check_debug_dirs(dirs: &[PathBuf]) -> anyhow::Result<()> {
    for dir in dirs {
        if !dir.is_dir() {
            bail!(
                "--debug-dir {}: not a folder; pass the folder that holds the .debug files (or their .build-id/ tree)",
                dir.display()
            );
        }
    }
    Ok(())
}

/// The USDT sites of ours in a library (the markers', PyTorch's allocator's), per provider;
/// returns whether it had any.
fn describe_markers(lib: &Library, text: &mut String) -> bool {
    let Ok(data) = crate::attach::file::map_library(&lib.path) else { return false };
    let plan = match crate::attach::usdt::plan(&data) {
        Ok(plan) => plan,
        Err(e) => {
            if libs::is_markers_module(&lib.path) {
                let _ = writeln!(text, "  [markers (USDT)]\n    unreadable notes: {}", printable(&e.to_string()));
            }
            return false;
        }
    };
    if plan.sites.is_empty() && plan.skipped.is_empty() {
        return false;
    }
    let semaphores = crate::attach::perf_uprobe::ref_ctr_supported();
    for (provider, title, seen) in [
        (
            memscope_core::apis::markers::PROVIDER,
            "markers",
            "tag spans, address tags, steps, marks and ranges; semaphores raised by the kernel while traced",
        ),
        (
            "pytorch",
            "PyTorch CUDA caching allocator",
            "tensor blocks of the caching pool (PTA rows); semaphores raised by the kernel while traced; each site is a 1-byte nop, a little dearer per hit than our markers' 5-byte ones",
        ),
    ] {
        let ours = |name: &str| name.split(':').next() == Some(provider);
        let sites: Vec<_> = plan.sites.iter().filter(|s| ours(&s.name)).collect();
        let skipped: Vec<_> = plan.skipped.iter().filter(|s| ours(s)).collect();
        if sites.is_empty() && skipped.is_empty() {
            continue;
        }
        let _ = writeln!(text, "  [{title} (USDT, provider {provider})]");
        for site in sites {
            let semaphore =
                site.semaphore_offset.map_or_else(|| "no semaphore".to_owned(), |s| format!("semaphore {s:#x}"));
            let _ = writeln!(
                text,
                "    attach  {:<34} offset {:#x}, {semaphore}, args `{}`",
                site.name,
                site.file_offset,
                printable(&site.args)
            );
        }
        for why in skipped {
            let _ = writeln!(text, "    skip    {}", printable(why));
        }
        let _ = if semaphores {
            writeln!(text, "    => {seen}")
        } else {
            writeln!(text, "    => this kernel cannot raise USDT semaphores (Linux >= 4.20 needed): these probes will not fire")
        };
    }
    true
}

/// Per file the process has mapped as code: whether frame-pointer stacks (`trace --call-stack
/// c`) through it will be whole, and what to use where they will not.
fn describe_native_stacks(pid: u32, text: &mut String) {
    let mut files: Vec<PathBuf> = unwind::executable_mappings(pid).into_iter().map(|(_, _, path)| path).collect();
    files.sort();
    files.dedup();
    let _ = writeln!(text, "native stacks (trace --call-stack c), per mapped file:");
    let mut without = 0;
    for path in &files {
        let verdict = match frame_pointers::survey(path) {
            Ok(s) if s.functions == 0 => "no functions to look at (no symbols)".to_owned(),
            Ok(s) if s.keeps_frame_pointers() => {
                format!(
                    "frame pointers ({} of {} functions): frame-pointer stacks through it are whole",
                    s.with_frame_pointer, s.functions
                )
            }
            Ok(s) => {
                without += 1;
                format!(
                    "no frame pointers ({} of {} functions): frame-pointer stacks through it are cut or skip frames",
                    s.with_frame_pointer, s.functions
                )
            }
            Err(e) => format!("not surveyed: {e}"),
        };
        let _ = writeln!(text, "  {}: {}", printable(&path.to_string_lossy()), printable(&verdict));
    }
    if without > 0 {
        let _ = writeln!(
            text,
            "  => {without} without frame pointers: use `trace --call-stack c --unwind dwarf` for whole stacks"
        );
    }
}

/// The process's Python interpreter, and whether `trace --call-stack python` can read its stacks.
fn describe_python(pid: u32, text: &mut String) {
    let line = match python::find(pid) {
        Ok(None) => "no CPython in this process".to_owned(),
        Ok(Some(py)) => format!(
            "CPython 3.{} ({}): `_PyRuntime` at {:#x}, offsets from this build's 3.{} table{}",
            py.minor,
            py.path.display(),
            py.runtime,
            py.minor,
            if py.minor >= 13 { ", its `_Py_DebugOffsets` cookie checked" } else { "" }
        ),
        Err(e) => format!("no Python stacks: {e}"),
    };
    let _ = writeln!(text, "python stacks (owners, steps and sites; trace --call-stack python): {}", printable(&line));
    let count = memscope_core::infer::rules::parse(memscope_core::infer::rules::BUILTIN).map_or(0, |r| r.len());
    let _ = writeln!(text, "owner rules: {count} built-in (probes --owner-rules lists them; trace --owner-rules adds)");
}

/// `probes --owner-rules [FILE]`: the rules in force, as a rules file.
fn print_owner_rules(file: &Path) -> anyhow::Result<()> {
    let mut text = String::new();
    if !file.as_os_str().is_empty() {
        super::owner_rules::read(Some(file), None)?;
        let user = memscope_core::files::read_text(file, 1 << 20).context("cannot read the owner rules")?;
        let _ = writeln!(text, "# {} (tried first)\n{}", printable(&file.display().to_string()), user.trim_end());
        text.push('\n');
    }
    text.push_str(memscope_core::infer::rules::BUILTIN);
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e).context("cannot write to stdout"),
        _ => Ok(()),
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if let Some(file) = &args.owner_rules {
        return print_owner_rules(Path::new(file));
    }
    if args.pid.is_none() && args.libs.is_empty() {
        bail!("nothing to inspect: give --pid PID or --lib PATH");
    }
    check_debug_dirs(&args.debug_dirs)?;
    // Before any file is read: each is checked against, and decoded for, this architecture.
    if let Some(arch) = args.arch {
        Arch::read_files_as(arch.into());
    }
    let mut found: Vec<Library> = Vec::new();
    for path in &args.libs {
        found.extend(libs::from_user_path(path).context("--lib")?);
    }
    if let Some(pid) = args.pid {
        preflight::check_pid(pid)?;
        found.extend(mapped_libraries(pid)?);
        if let Ok(env) = libs::process_env(pid) {
            found.extend(libs::from_env(&env, Path::new(&format!("/proc/{pid}/root")), false));
        }
    }
    let found = libs::with_dependencies(found);
    if found.is_empty() {
        let where_ = args.pid.map_or_else(|| "in the given paths".to_owned(), |p| format!("in process {p}"));
        return Err(PreflightError::NoLibrary { where_ }.into());
    }
    // Built whole, then written once: a reader that stops early (`| head`) is not an error.
    let mut text = String::new();
    if let Some(arch) = args.arch.map(Arch::from).filter(|a| Some(*a) != Arch::host()) {
        let host = Arch::host().map_or(std::env::consts::ARCH, Arch::name);
        let name = arch.name();
        let _ = writeln!(text, "read as {name} files (--arch {name}): what memscope-bpf on an {name} machine would attach; this machine is {host}");
    }
    let mut unreadable = 0;
    for lib in &found {
        // Paths, notes and debug links below are the libraries' (and the process's) own text.
        let _ = writeln!(text, "{} ({})", printable(&lib.shown), origin(&lib.origin));
        let plan = match plan(lib, args.probe_set, &args.debug_dirs) {
            Ok(p) => p,
            Err(e) => {
                let _ = writeln!(text, "  unreadable: {}", printable(&crate::attach::with_causes(&e)));
                unreadable += 1;
                continue;
            }
        };
        if plan.debug != DebugStatus::NotNeeded {
            let _ = writeln!(text, "  debug file: {}", printable(&describe_debug(&plan.debug)));
        }
        let markers = describe_markers(lib, &mut text);
        if plan.families.is_empty() && !markers {
            let _ = writeln!(text, "  none of the traced symbols is defined here");
        }
        let chosen: HashSet<&str> = plan.probes.iter().map(|p| p.symbol.as_str()).collect();
        for family in &plan.families {
            let _ = writeln!(text, "  [{}]", family.describe());
            // USDT rows are listed with the library's notes above.
            for def in Api::all().filter(|d| d.family == *family && d.attach != Attach::Usdt) {
                let mut shown = false;
                for symbol in def.api.lookup_names() {
                    if let Some(sym) = plan.symbols.get(&symbol) {
                        shown = true;
                        let mark = if chosen.contains(sym.name.as_str()) { "attach " } else { "skip   " };
                        let _ = writeln!(
                            text,
                            "    {mark} {:<34} {} ({}, offset {:#x})",
                            def.name,
                            sym.name,
                            sym.source.as_str(),
                            sym.file_offset
                        );
                    }
                }
                if !shown {
                    let why = if *family == Family::TorchNpu && matches!(plan.debug, DebugStatus::Missing { .. }) {
                        "hidden: not exported, and no debug file"
                    } else {
                        "not defined in this library"
                    };
                    let _ = writeln!(text, "    missing {:<34} {} ({why})", def.name, def.symbol);
                }
            }
            for note in plan.notes.iter().filter(|n| n.family == *family) {
                let _ = writeln!(text, "    => {}", printable(&note.text));
            }
        }
    }
    if let Some(pid) = args.pid {
        describe_native_stacks(pid, &mut text);
        describe_python(pid, &mut text);
    }
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => return Err(e).context("cannot write to stdout"),
        _ => {}
    }
    // Nothing could be inspected: a failed command, though each file's reason is listed.
    if unreadable == found.len() {
        let what = if unreadable == 1 {
            "the library found cannot".to_owned()
        } else {
            format!("none of the {unreadable} libraries found can")
        };
        bail!("{what} be read (listed as unreadable, with why); pass --lib a readable runtime library");
    }
    Ok(())
}
