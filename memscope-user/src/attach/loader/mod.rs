//! Loading the eBPF object and attaching it.
//!
//! Order matters for correctness, not just tidiness:
//! - the probe specs are written before anything is attached, so no probe fires with an empty
//!   spec;
//! - per library, every return probe is attached before any entry probe: a return probe is armed
//!   at function entry, so an entry we record always has its return, and a call already running
//!   when we attach is skipped whole instead of producing half a record.
//! - USDT sites (the markers) get their argument spec written before their probe, and are
//!   attached through our own perf-event path so the kernel raises (and, when the tracer goes,
//!   however it goes, lowers) the markers' semaphores.
//! - where the kernel has multi-uprobe links, a library's return probes are one link and its
//!   entry probes another, and a module's marker sites one more (`uprobe_multi`: detaching
//!   waits for the kernel once per link instead of once per probe); elsewhere each probe is an
//!   aya perf-event link and each marker site a perf event of our own.
//!
//! The daemon's rules in the kernel's maps are in [`admission`], the dynamic linker's hook in
//! [`linker_hook`].

use std::collections::{HashMap, HashSet};
use std::num::NonZeroU32;
use std::os::fd::{AsFd as _, OwnedFd};
use std::path::{Path, PathBuf};

use aya::maps::{Array, HashMap as BpfHashMap, MapData, MapError, PerCpuArray};
use aya::programs::uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeLinkId, UProbeScope};
use aya::programs::{ProgramError, TracePoint, UProbe};
use aya::{Ebpf, EbpfError, EbpfLoader};
use memscope_common::filter::MAX_CGROUP_RULES;
use memscope_common::python::PyProcess;
use memscope_common::sampling::{CounterKey, Counters};
use memscope_common::spec::ProbeSpec;
use memscope_common::usdt::{UsdtSpec, MAX_USDT_SPECS};
use memscope_core::apis::Api;
use thiserror::Error;

use super::elf::ElfError;
use super::libs::Library;
use super::perf_uprobe::{self, PerfUprobeError, RefCtrProbe};
use super::plan::{plan, AttachedProbe, ProbeSet};
use super::uprobe_multi::{self, MultiPrograms};
use super::usdt::{self, UsdtSite};
use super::usdt_notes::UsdtNoteError;
use bpf_log::{BpfLog, BpfLogLevel};

/// Entries of the `TRACED` map (memscope-ebpf/src/maps.rs).
const TRACED_CAPACITY: usize = 8192;

mod admission;
pub mod bpf_log;
pub mod kernel_gap;
mod linker_hook;
mod windows;

pub use admission::Admission;

/// The compiled eBPF object, built by build.rs with aya-build (empty when built with its stub switch).
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/memscope"));

/// Messages leave the cause out: it is the error's `source`, printed after it (`{:#}`).
#[derive(Debug, Error)]
pub enum LoadError {
    #[error("the kernel refused the eBPF object")]
    Load(#[from] EbpfError),
    #[error("the eBPF object has no program or map named `{0}` (build mismatch; rebuild with `cargo xtask build`)")]
    Missing(&'static str),
    #[error("cannot load or attach `{name}`")]
    Program { name: &'static str, source: ProgramError },
    #[error("cannot read the probes' log ring (`--bpf-log`)")]
    BpfLog(#[source] aya_log::Error),
    #[error("cannot use map `{name}`")]
    Map { name: &'static str, source: MapError },
    #[error(
        "this memscope-bpf was built with MEMSCOPE_EBPF_STUB=1, without its eBPF programs; rebuild it without that \
         variable (`cargo xtask build`, after `cargo xtask setup` installs nightly and bpf-linker)"
    )]
    Stub,
    #[error("{0} --cgroup rules: the kernel checks {MAX_CGROUP_RULES} at most (name a common parent instead)")]
    TooManyCgroups(u32),
    #[error("tracefs is not available ({0}); mount it with `mount -t tracefs nodev /sys/kernel/tracing`")]
    Tracefs(String),
    /// A tracepoint's format lacks a field this kernel does not have (an older kernel).
    #[error("this kernel's tracepoint lacks a field the probes read ({0})")]
    NoField(String),
    #[error(
        "this kernel ({kernel}) lacks {what} (Linux {since}), which the probes use: memscope-bpf needs Linux \
         {oldest} or later, or a vendor kernel that has backported it",
        what = gap.what,
        since = gap.since,
        oldest = kernel_gap::OLDEST
    )]
    OldKernel { kernel: String, gap: kernel_gap::Gap },
    #[error("cannot list the online CPUs for the Python sampler's timers ({0})")]
    Cpus(std::io::Error),
}

/// A program the kernel refused: [`LoadError::OldKernel`] where its verifier says this kernel
/// lacks something the probes use.
fn refused(name: &'static str, source: ProgramError) -> LoadError {
    match kernel_gap::missing(&source.to_string()) {
        Some(gap) => LoadError::OldKernel { kernel: kernel_gap::kernel_release(), gap },
        None => LoadError::Program { name, source },
    }
}

#[derive(Debug, Error)]
pub enum AttachError {
    #[error(transparent)]
    Elf(#[from] ElfError),
    #[error("cannot attach {kind} to `{symbol}` in {library}")]
    Probe { kind: &'static str, symbol: String, library: String, source: Box<ProgramError> },
    #[error("cannot write a probe spec: {0}")]
    Spec(Box<MapError>),
    #[error("cannot read the USDT notes of {library}")]
    Notes { library: String, source: UsdtNoteError },
    #[error("cannot attach the marker probe {probe} in {library}")]
    Usdt { probe: String, library: String, source: Box<PerfUprobeError> },
    #[error(
        "{library} needs {needed} more USDT argument layouts, and only {left} of the {MAX_USDT_SPECS} are left; \
         the markers package has one per probe (is a modified copy loaded?)"
    )]
    TooManyUsdtSpecs { library: String, needed: usize, left: usize },
    #[error("the dynamic linker {library} defines no `{}`: the libraries its processes load are found by the scan of /proc only", super::linker::HOOK_SYMBOL)]
    NoLinkerHook { library: String },
}

/// How many of `specs` (a library's sites) need a layout slot that `known` does not have yet.
fn new_layouts<'a>(known: &HashMap<UsdtSpec, u32>, specs: impl Iterator<Item = &'a UsdtSpec>) -> usize {
    specs.filter(|s| !known.contains_key(*s)).collect::<HashSet<_>>().len()
}

/// An attached marker site.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttachedUsdt {
    pub library: String,
    /// `provider:name`.
    pub probe: String,
    pub file_offset: u64,
    pub semaphore_offset: Option<u64>,
}

/// What [`Tracer::hook_linker`] made of a dynamic linker file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkerHook {
    /// Hooked now.
    Added,
    /// Hooked before.
    Known,
    /// Could not be hooked (said when it was tried).
    Refused,
}

pub struct LoadOptions {
    pub ring_bytes: u32,
    pub wakeup_bytes: u64,
    pub follow_forks: bool,
    /// Extra folders to look for separate debug files in (`--debug-dir`).
    pub debug_dirs: Vec<PathBuf>,
    /// Native frames to capture per call (`--call-stack c:N`; 0: none), at most
    /// [`memscope_common::record::MAX_STACK_DEPTH`].
    pub stack_depth: u32,
    /// Bytes of stack to copy per call for `--unwind dwarf` (0: frame-pointer walks).
    pub stack_window: u32,
    /// Python frames to read per call (`--call-stack python:N`, or the owner rules'; 0: none).
    pub python_depth: u32,
    /// Whether pool frees get Python stacks too (`--call-stack python` stores them; the owner
    /// rules need allocations only).
    pub python_frees: bool,
    /// Python frames the sampler reads (`--python-trace`; 0: no sampler).
    pub python_sample_depth: u32,
    /// What the probes tell through aya-log (`--bpf-log`; `None`: nothing).
    pub bpf_log: Option<BpfLogLevel>,
    /// The daemon's rules: `Some` traces every process that calls a probed function unless
    /// they deny it (`memscope_common::filter`).
    pub admission: Option<Admission>,
    /// The daemon's sampling of pool blocks (`None`: every call recorded).
    pub sampling: Option<Sampling>,
    /// The daemon's flight recorder wants the calls sampling leaves out too (sent marked
    /// `WINDOW_ONLY`, for its window alone).
    pub window_all: bool,
    /// The sampled APIs' probes are attached only in the daemon's windows ([`Tracer::open_window`]),
    /// where the kernel can link them as one (else they stay attached: [`Tracer::windowed`]).
    pub windowed: bool,
}

/// `--sample-bytes` and the kernel's bound on the blocks it counts (`--max-blocks`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sampling {
    pub interval: u64,
    pub max_blocks: u32,
    /// Sampled frees that need nothing from their return get no return probe: counted and
    /// recorded at entry ([`ProbeSpec::complete_at_entry`]). Only where no two probed frees nest
    /// on one layer (the default probe set attaches one of the caching allocator's two), since
    /// a call without a return cannot open its layer's slot for a nested one to join.
    pub frees_at_entry: bool,
}

/// `spec` as the kernel gets it: marked to be completed at entry where `sampling` says so.
fn kernel_spec(mut spec: ProbeSpec, sampling: Option<Sampling>) -> ProbeSpec {
    if sampling.is_some_and(|s| s.frees_at_entry) && spec.complete_at_entry() {
        spec.sample.at_entry_only = 1;
    }
    spec
}

/// Every API's spec as the kernel gets it ([`kernel_spec`]), the windowed ones numbered.
fn write_specs(
    ebpf: &mut Ebpf,
    sampling: Option<Sampling>,
    mut windows: Option<&mut windows::Windows>,
) -> Result<(), LoadError> {
    let map = ebpf.map_mut("SPECS").ok_or(LoadError::Missing("SPECS"))?;
    let mut specs: Array<_, ProbeSpec> =
        Array::try_from(map).map_err(|source| LoadError::Map { name: "SPECS", source })?;
    for def in Api::all() {
        let mut spec = kernel_spec(def.spec, sampling);
        if let Some(w) = windows.as_deref_mut().filter(|_| def.api.sampled()) {
            spec = w.spec(def.api.spec_id(), spec);
        }
        specs.set(def.api.spec_id(), spec, 0).map_err(|source| LoadError::Map { name: "SPECS", source })?;
    }
    Ok(())
}

pub struct Tracer {
    ebpf: Ebpf,
    attached_files: HashSet<(u64, u64)>,
    usdt_files: HashSet<(u64, u64)>,
    /// USDT spec -> index in `USDT_SPECS` (sites with the same layout share one).
    usdt_specs: HashMap<UsdtSpec, u32>,
    /// Held for the trace's life: dropping one detaches it and lowers its semaphore.
    usdt_links: Vec<RefCtrProbe>,
    /// Dynamic linker files tried ([`Self::hook_linker`]), and whether the hook is on.
    linker_files: HashMap<(u64, u64), bool>,
    /// Files that could not be probed, by (file id, path tried).
    refused: HashSet<((u64, u64), PathBuf)>,
    scope_pid: Option<u32>,
    scope: UProbeScope,
    debug_dirs: Vec<PathBuf>,
    /// `call_enter`/`call_exit`/`usdt_hit` loaded for multi-uprobe links, or why the kernel
    /// refused them.
    multi: Result<MultiPrograms, String>,
    /// The multi-uprobe links, two per probed library and one per markers module; dropping one
    /// detaches all its probes.
    multi_links: Vec<OwnedFd>,
    sampling: Option<Sampling>,
    /// The sampled APIs' probes and the open window's links, when windowed.
    windows: Option<windows::Windows>,
    /// The ring buffer's kernel memory, measured before [`Self::take_ring`] took it.
    ring_memory: Option<(String, u64)>,
}

fn tracefs_root() -> Result<&'static Path, LoadError> {
    for root in ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"] {
        if Path::new(root).join("events").is_dir() {
            return Ok(Path::new(root));
        }
    }
    // A fresh machine may not have tracefs mounted; as root we can.
    let target = c"/sys/kernel/tracing";
    // SAFETY: constant, NUL-terminated arguments.
    let rc = unsafe { libc::mount(c"nodev".as_ptr(), target.as_ptr(), c"tracefs".as_ptr(), 0, std::ptr::null()) };
    if rc == 0 && Path::new("/sys/kernel/tracing/events").is_dir() {
        return Ok(Path::new("/sys/kernel/tracing"));
    }
    Err(LoadError::Tracefs(std::io::Error::last_os_error().to_string()))
}

/// Offset of a field in a tracepoint's format file.
fn field_offset(root: &Path, event: &str, field: &str) -> Result<u32, LoadError> {
    let path = root.join("events").join(event).join("format");
    let text = std::fs::read_to_string(&path).map_err(|e| LoadError::Tracefs(format!("{}: {e}", path.display())))?;
    text.lines()
        .find(|l| l.contains(&format!(" {field};")))
        .and_then(|l| l.split("offset:").nth(1))
        .and_then(|rest| rest.split(';').next())
        .and_then(|n| n.trim().parse().ok())
        .ok_or_else(|| LoadError::NoField(format!("no field `{field}` in {}", path.display())))
}

/// Fails when this binary holds the stub instead of the eBPF object (built with `MEMSCOPE_EBPF_STUB`),
/// so `trace` says so before it launches or touches anything.
pub fn check_object() -> Result<(), LoadError> {
    if EBPF_OBJECT.is_empty() {
        return Err(LoadError::Stub);
    }
    Ok(())
}

impl Tracer {
    /// Loads the programs, writes the specs and attaches the process tracepoints.
    /// `target` is the process traced first (also added to the traced set by
    /// [`Tracer::trace_process`]); `scope_pid` limits the uprobes to one process (attach mode).
    pub fn load(opts: &LoadOptions, target: u32, scope_pid: Option<u32>) -> Result<Self, LoadError> {
        check_object()?;
        let tracefs = tracefs_root()?;
        let child_pid_offset = field_offset(tracefs, "sched/sched_process_fork", "child_pid")?;
        let group_dead_offset = match field_offset(tracefs, "sched/sched_process_exit", "group_dead") {
            Err(LoadError::NoField(_)) => memscope_common::record::NO_GROUP_DEAD,
            other => other?,
        };
        let follow = u32::from(opts.follow_forks);
        let admission = opts.admission.clone();
        let admit_any = u32::from(admission.is_some());

        let interval = opts.sampling.map_or(0, |s| s.interval);
        // Unsampled, or sampled with every call sent to userspace (which then counts the blocks),
        // the block map is never touched: one entry rather than the daemon's million.
        let window_all = opts.window_all && interval > 0;
        let max_blocks = opts.sampling.filter(|_| !window_all).map_or(1, |s| s.max_blocks.max(1));
        let mut ebpf = EbpfLoader::new()
            .map_max_entries("EVENTS", opts.ring_bytes)
            .map_max_entries("BLOCKS", max_blocks)
            .override_global("SAMPLE_INTERVAL", &interval, true)
            .override_global("WINDOW_ALL", &u8::from(window_all), true)
            .override_global("WAKEUP_BYTES", &opts.wakeup_bytes, true)
            .override_global("FOLLOW_FORKS", &follow, true)
            .override_global("STACK_DEPTH", &opts.stack_depth, true)
            .override_global("STACK_WINDOW", &opts.stack_window, true)
            .override_global("PY_DEPTH", &opts.python_depth, true)
            .override_global("PY_FREES", &u32::from(opts.python_frees), true)
            .override_global("PY_SAMPLE_DEPTH", &opts.python_sample_depth, true)
            // aya-log's own default lets every message through; ours is none.
            .override_global("AYA_LOG_LEVEL", &BpfLogLevel::kernel_value(opts.bpf_log), true)
            .override_global("TARGET_TGID", &target, true)
            .override_global("ADMIT_ANY", &admit_any, true)
            .override_global("FORK_CHILD_PID_OFFSET", &child_pid_offset, true)
            .override_global("EXIT_GROUP_DEAD_OFFSET", &group_dead_offset, true)
            .load(EBPF_OBJECT)?;

        let multi = MultiPrograms::load(EBPF_OBJECT, &ebpf).map_err(|e| super::with_causes(&e));
        let mut windows = (opts.windowed && multi.is_ok()).then(windows::Windows::default);
        write_specs(&mut ebpf, opts.sampling, windows.as_mut())?;

        if let Some(admission) = &admission {
            admission::write_rules(&mut ebpf, admission, &admission.allow_pids)?;
        }
        if interval > 0 {
            let map = ebpf.map_mut("GAPS").ok_or(LoadError::Missing("GAPS"))?;
            let mut gaps: Array<_, u64> =
                Array::try_from(map).map_err(|source| LoadError::Map { name: "GAPS", source })?;
            for (i, gap) in memscope_core::sampling::gap_table(interval).into_iter().enumerate() {
                gaps.set(i as u32, gap, 0).map_err(|source| LoadError::Map { name: "GAPS", source })?;
            }
        }
        for (name, event) in [
            ("sched_process_fork", "sched_process_fork"),
            ("sched_process_exit", "sched_process_exit"),
            ("sched_process_exec", "sched_process_exec"),
        ] {
            let name: &'static str = name;
            let prog: &mut TracePoint = ebpf
                .program_mut(name)
                .ok_or(LoadError::Missing(name))?
                .try_into()
                .map_err(|source| LoadError::Program { name, source })?;
            prog.load().map_err(|source| refused(name, source))?;
            prog.attach("sched", event).map_err(|source| LoadError::Program { name, source })?;
        }
        for name in ["call_enter", "call_exit", "usdt_hit", "objects_changed"] {
            let prog: &mut UProbe = ebpf
                .program_mut(name)
                .ok_or(LoadError::Missing(name))?
                .try_into()
                .map_err(|source| LoadError::Program { name, source })?;
            prog.load().map_err(|source| refused(name, source))?;
        }
        let scope = scope_pid.and_then(NonZeroU32::new).map_or(UProbeScope::AllProcesses, UProbeScope::OneProcess);
        Ok(Self {
            ebpf,
            attached_files: HashSet::new(),
            usdt_files: HashSet::new(),
            usdt_specs: HashMap::new(),
            usdt_links: Vec::new(),
            linker_files: HashMap::new(),
            refused: HashSet::new(),
            scope_pid: scope_pid.filter(|p| *p != 0),
            scope,
            debug_dirs: opts.debug_dirs.clone(),
            multi,
            multi_links: Vec::new(),
            sampling: opts.sampling,
            windows,
            ring_memory: None,
        })
    }

    /// Starts the Python sampler (`--python-trace`): its program on a `hz` timer on every online
    /// CPU, where it samples the traced interpreters' threads that run there. Returns the CPUs.
    pub fn start_python_sampler(&mut self, hz: u32) -> Result<usize, LoadError> {
        use aya::programs::perf_event::{PerfEventConfig, PerfEventScope, SamplePolicy, SoftwareEvent};
        let name = "py_sample";
        let prog: &mut aya::programs::PerfEvent = self
            .ebpf
            .program_mut(name)
            .ok_or(LoadError::Missing(name))?
            .try_into()
            .map_err(|source| LoadError::Program { name, source })?;
        prog.load().map_err(|source| refused(name, source))?;
        let cpus = aya::util::online_cpus().map_err(|(_, e)| LoadError::Cpus(e))?;
        for &cpu in &cpus {
            prog.attach(
                PerfEventConfig::Software(SoftwareEvent::CpuClock),
                PerfEventScope::AllProcessesOneCpu { cpu },
                SamplePolicy::Frequency(u64::from(hz)),
                false,
            )
            .map_err(|source| LoadError::Program { name, source })?;
        }
        Ok(cpus.len())
    }

    /// Starts reading the probes' messages (`--bpf-log`). Called after [`Self::load`], which
    /// needs the log ring among the maps the multi-uprobe copies are relocated against.
    pub fn bpf_logger(&mut self, log: BpfLog) -> Result<aya_log::EbpfLogger<BpfLog>, LoadError> {
        aya_log::EbpfLogger::init_with_logger(&mut self.ebpf, log).map_err(LoadError::BpfLog)
    }

    /// How the probes are linked, for `ms_meta`: `uprobe_multi`, or `perf_event` and why.
    pub fn link_kind(&self) -> String {
        match &self.multi {
            Ok(_) => "uprobe_multi".into(),
            Err(why) => format!("perf_event ({why})"),
        }
    }

    /// Takes the multi-uprobe links out, so that they can be closed in parallel (each close
    /// waits for the kernel on its own).
    pub fn take_multi_links(&mut self) -> Vec<OwnedFd> {
        let mut links = std::mem::take(&mut self.multi_links);
        links.extend(self.windows.as_mut().map(windows::Windows::take_links).unwrap_or_default());
        links
    }

    /// Takes the marker sites' links out, for the same reason (their closes overlap less: each
    /// is a perf event, which the kernel unregisters under one lock).
    pub fn take_usdt_links(&mut self) -> Vec<RefCtrProbe> {
        std::mem::take(&mut self.usdt_links)
    }

    /// Starts recording calls of process `pid`.
    pub fn trace_process(&mut self, pid: u32) -> Result<(), LoadError> {
        let map = self.ebpf.map_mut("TRACED").ok_or(LoadError::Missing("TRACED"))?;
        let mut traced: BpfHashMap<_, u32, u32> =
            BpfHashMap::try_from(map).map_err(|source| LoadError::Map { name: "TRACED", source })?;
        traced.insert(pid, 1, 0).map_err(|source| LoadError::Map { name: "TRACED", source })
    }

    /// The kernel's exact counters of sampled blocks (`--sample-bytes`), by process, device
    /// and class.
    pub fn exact_counters(&self) -> Result<Vec<(CounterKey, Counters)>, LoadError> {
        let map = self.ebpf.map("COUNTERS").ok_or(LoadError::Missing("COUNTERS"))?;
        let counters: BpfHashMap<_, CounterKey, Counters> =
            BpfHashMap::try_from(map).map_err(|source| LoadError::Map { name: "COUNTERS", source })?;
        // An entry removed between the key walk and its lookup is skipped, not an error.
        Ok(counters.iter().filter_map(Result::ok).collect())
    }

    /// Drops the counters of processes that exited (the kernel never does).
    pub fn forget_counters(&mut self, pids: &HashSet<u32>) -> Result<(), LoadError> {
        let map = self.ebpf.map_mut("COUNTERS").ok_or(LoadError::Missing("COUNTERS"))?;
        let mut counters: BpfHashMap<_, CounterKey, Counters> =
            BpfHashMap::try_from(map).map_err(|source| LoadError::Map { name: "COUNTERS", source })?;
        let gone: Vec<CounterKey> = counters.keys().filter_map(Result::ok).filter(|k| pids.contains(&k.tgid)).collect();
        for key in gone {
            let _ = counters.remove(&key);
        }
        Ok(())
    }

    /// Lets the Python-stack probe walk `pid`'s interpreter (`--call-stack python`).
    pub fn set_python(&mut self, pid: u32, py: PyProcess) -> Result<(), LoadError> {
        let map = self.ebpf.map_mut("PY_PROCS").ok_or(LoadError::Missing("PY_PROCS"))?;
        let mut procs: BpfHashMap<_, u32, PyProcess> =
            BpfHashMap::try_from(map).map_err(|source| LoadError::Map { name: "PY_PROCS", source })?;
        procs.insert(pid, py, 0).map_err(|source| LoadError::Map { name: "PY_PROCS", source })
    }

    /// The ids in the kernel's traced set: traced processes and, while they run, the threads
    /// they created (the fork tracepoint sees both alike).
    pub fn traced_ids(&self) -> Result<Vec<u32>, LoadError> {
        let map = self.ebpf.map("TRACED").ok_or(LoadError::Missing("TRACED"))?;
        let traced: BpfHashMap<_, u32, u32> =
            BpfHashMap::try_from(map).map_err(|source| LoadError::Map { name: "TRACED", source })?;
        // A key deleted under the walk restarts it from the first key: bound the walk so that
        // constant churn cannot hold it, and let duplicates fall out in the caller's set.
        traced
            .keys()
            .take(2 * TRACED_CAPACITY)
            .collect::<Result<_, _>>()
            .map_err(|source| LoadError::Map { name: "TRACED", source })
    }

    /// Kernel memory charged to each of the tracer's maps, by name, largest first.
    pub fn map_memory(&self) -> Vec<(String, u64)> {
        let mut maps = super::kmem::map_memory(&self.ebpf);
        // The ring is the consumer's once taken; its size is fixed.
        maps.extend(self.ring_memory.clone());
        maps.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        maps
    }

    /// Whether this file is already probed, or was refused under this path (a file that cannot be
    /// probed is not retried, nor warned about, at every rescan; reached through another path,
    /// e.g. another process's root, it is tried again).
    pub fn is_attached(&self, lib: &Library) -> bool {
        self.attached_files.contains(&lib.file_id) || self.refused.contains(&(lib.file_id, lib.path.clone()))
    }

    /// Probes the traced APIs in one library, as [`plan`] decides. Returns what was attached
    /// (empty if the file was already probed or holds none of the APIs). On an error nothing of
    /// this library stays attached: a library is traced whole or not at all.
    pub fn attach(&mut self, lib: &Library, set: ProbeSet) -> Result<Vec<AttachedProbe>, AttachError> {
        if self.is_attached(lib) {
            return Ok(Vec::new());
        }
        let mut links = Vec::new();
        match self.attach_planned(lib, set, &mut links) {
            Ok(probes) => {
                self.attached_files.insert(lib.file_id);
                Ok(probes)
            }
            Err(e) => {
                for (program, link) in links {
                    let prog: &mut UProbe =
                        self.ebpf.program_mut(program).expect("loaded").try_into().expect("a uprobe");
                    let _ = prog.detach(link);
                }
                self.refused.insert((lib.file_id, lib.path.clone()));
                Err(e)
            }
        }
    }

    /// [`Tracer::attach`]'s work; `links` collects what was attached, for undoing it.
    fn attach_planned(
        &mut self,
        lib: &Library,
        set: ProbeSet,
        links: &mut Vec<(&'static str, UProbeLinkId)>,
    ) -> Result<Vec<AttachedProbe>, AttachError> {
        let plan = plan(lib, set, &self.debug_dirs)?;
        if !plan.specs.is_empty() {
            let map = self.ebpf.map_mut("SPECS").expect("loaded in Tracer::load");
            let mut specs: Array<_, ProbeSpec> =
                Array::try_from(map).map_err(|source| AttachError::Spec(Box::new(source)))?;
            for (api, spec) in &plan.specs {
                let mut spec = kernel_spec(*spec, self.sampling);
                if let Some(w) = self.windows.as_mut().filter(|_| api.sampled()) {
                    spec = w.spec(api.spec_id(), spec);
                }
                specs.set(api.spec_id(), spec, 0).map_err(|source| AttachError::Spec(Box::new(source)))?;
            }
        }
        let returns: Vec<AttachedProbe> = plan
            .probes
            .iter()
            .filter(|p| {
                let spec = plan.specs.iter().find(|(api, _)| *api == p.api).map_or(p.api.def().spec, |(_, s)| *s);
                kernel_spec(spec, self.sampling).sample.at_entry_only == 0
            })
            .cloned()
            .collect();
        if self.windowed() {
            let always = |probes: &[AttachedProbe]| -> Vec<AttachedProbe> {
                probes.iter().filter(|p| !p.api.sampled()).cloned().collect()
            };
            if self.attach_multi(lib, &always(&plan.probes), &always(&returns)) {
                self.add_windowed(&lib.path, &plan.probes, &returns);
                return Ok(plan.probes);
            }
        } else if self.attach_multi(lib, &plan.probes, &returns) {
            return Ok(plan.probes);
        }
        for (program, kind) in [("call_exit", "return probe"), ("call_enter", "entry probe")] {
            let prog: &mut UProbe =
                self.ebpf.program_mut(program).expect("loaded in Tracer::load").try_into().expect("a uprobe program");
            let probes = if program == "call_exit" { &returns } else { &plan.probes };
            for probe in probes {
                let point = UProbeAttachPoint {
                    location: UProbeAttachLocation::AbsoluteOffset(probe.file_offset),
                    cookie: Some(memscope_common::spec::cookie(probe.api.spec_id(), probe.api.def().spec.layer)),
                };
                let link = prog.attach(point, &lib.path, self.scope).map_err(|source| AttachError::Probe {
                    kind,
                    symbol: probe.symbol.clone(),
                    library: lib.shown.clone(),
                    source: Box::new(source),
                })?;
                links.push((program, link));
            }
        }
        Ok(plan.probes)
    }

    /// Attaches `probes` as two multi-uprobe links, returns first; false (nothing attached) where
    /// the kernel cannot, and the per-probe links are used instead.
    fn attach_multi(&mut self, lib: &Library, probes: &[AttachedProbe], returns: &[AttachedProbe]) -> bool {
        let Ok(multi) = &self.multi else { return false };
        if probes.is_empty() {
            return true;
        }
        let points = |probes: &[AttachedProbe]| -> (Vec<u64>, Vec<u64>) {
            let offsets = probes.iter().map(|p| p.file_offset).collect();
            let cookies =
                probes.iter().map(|p| memscope_common::spec::cookie(p.api.spec_id(), p.api.def().spec.layer)).collect();
            (offsets, cookies)
        };
        let mut links = Vec::with_capacity(2);
        for (prog, ret) in [(&multi.exit, true), (&multi.enter, false)] {
            let (offsets, cookies) = points(if ret { returns } else { probes });
            if offsets.is_empty() {
                continue;
            }
            match uprobe_multi::attach(prog.as_fd(), &lib.path, &offsets, &cookies, None, ret, self.scope_pid) {
                Ok(link) => links.push(link),
                // Dropping the return link (if made) detaches it again.
                Err(_) => return false,
            }
        }
        self.multi_links.extend(links);
        true
    }

    /// Attaches the markers' USDT sites in one library (none if it carries none of ours).
    /// Sites already attached are skipped; the notes of ours that cannot be used are returned
    /// as warnings. On an error none of this library's sites stays attached.
    pub fn attach_usdt(&mut self, lib: &super::libs::Library) -> Result<(Vec<AttachedUsdt>, Vec<String>), AttachError> {
        if !self.usdt_files.insert(lib.file_id) {
            return Ok((Vec::new(), Vec::new()));
        }
        let data = super::file::map_library(&lib.path).map_err(|e| AttachError::Elf(ElfError::File(e)))?;
        let plan = usdt::plan(&data).map_err(|source| AttachError::Notes { library: lib.shown.clone(), source })?;
        // Refused before anything is attached: a site without a layout slot cannot be read.
        let needed = new_layouts(&self.usdt_specs, plan.sites.iter().map(|s| &s.spec));
        let left = MAX_USDT_SPECS as usize - self.usdt_specs.len();
        if needed > left {
            return Err(AttachError::TooManyUsdtSpecs { library: lib.shown.clone(), needed, left });
        }
        if let Some(attached) = self.attach_usdt_multi(lib, &plan.sites)? {
            return Ok((attached, plan.skipped));
        }
        let before = self.usdt_links.len();
        let attached = self.attach_sites(lib, &plan.sites);
        if attached.is_err() {
            // Dropping a link detaches it and lowers its semaphore.
            self.usdt_links.truncate(before);
        }
        Ok((attached?, plan.skipped))
    }

    fn attach_sites(&mut self, lib: &Library, sites: &[UsdtSite]) -> Result<Vec<AttachedUsdt>, AttachError> {
        let mut attached = Vec::new();
        for site in sites {
            let index = self.usdt_spec_index(site)?;
            let prog: &mut UProbe = self
                .ebpf
                .program_mut("usdt_hit")
                .expect("loaded in Tracer::load")
                .try_into()
                .expect("a uprobe program");
            let probe_name = site.name.clone();
            let usdt_err = |source| AttachError::Usdt {
                probe: probe_name.clone(),
                library: lib.shown.clone(),
                source: Box::new(source),
            };
            let fd = prog.fd().map_err(|source| AttachError::Probe {
                kind: "marker probe",
                symbol: probe_name.clone(),
                library: lib.shown.clone(),
                source: Box::new(source),
            })?;
            let fd = std::os::fd::AsFd::as_fd(fd);
            let link = perf_uprobe::attach_uprobe(
                fd,
                &lib.path,
                site.file_offset,
                site.semaphore_offset,
                self.scope_pid,
                u64::from(index),
            )
            .map_err(usdt_err)?;
            self.usdt_links.push(link);
            attached.push(AttachedUsdt {
                library: lib.shown.clone(),
                probe: probe_name,
                file_offset: site.file_offset,
                semaphore_offset: site.semaphore_offset,
            });
        }
        Ok(attached)
    }

    /// The sites of one library as one multi-uprobe link with their semaphores; `None` (nothing
    /// attached) where the kernel cannot, and each site gets its own perf event instead.
    fn attach_usdt_multi(
        &mut self,
        lib: &Library,
        sites: &[UsdtSite],
    ) -> Result<Option<Vec<AttachedUsdt>>, AttachError> {
        if self.multi.is_err() || sites.is_empty() {
            return Ok(None);
        }
        let mut cookies = Vec::with_capacity(sites.len());
        for site in sites {
            cookies.push(u64::from(self.usdt_spec_index(site)?));
        }
        let offsets: Vec<u64> = sites.iter().map(|s| s.file_offset).collect();
        let semaphores: Vec<u64> = sites.iter().map(|s| s.semaphore_offset.unwrap_or(0)).collect();
        let Ok(multi) = &self.multi else { return Ok(None) };
        let Ok(link) = uprobe_multi::attach(
            multi.usdt.as_fd(),
            &lib.path,
            &offsets,
            &cookies,
            Some(&semaphores),
            false,
            self.scope_pid,
        ) else {
            return Ok(None);
        };
        self.multi_links.push(link);
        Ok(Some(
            sites
                .iter()
                .map(|site| AttachedUsdt {
                    library: lib.shown.clone(),
                    probe: site.name.clone(),
                    file_offset: site.file_offset,
                    semaphore_offset: site.semaphore_offset,
                })
                .collect(),
        ))
    }

    fn usdt_spec_index(&mut self, site: &UsdtSite) -> Result<u32, AttachError> {
        if let Some(index) = self.usdt_specs.get(&site.spec) {
            return Ok(*index);
        }
        // Checked for the whole library before its first site (`new_layouts`).
        let index = u32::try_from(self.usdt_specs.len()).expect("bounded by MAX_USDT_SPECS");
        assert!(index < MAX_USDT_SPECS, "layouts counted before attaching");
        let map = self.ebpf.map_mut("USDT_SPECS").expect("in the eBPF object");
        let mut specs: Array<_, UsdtSpec> =
            Array::try_from(map).map_err(|source| AttachError::Spec(Box::new(source)))?;
        specs.set(index, site.spec, 0).map_err(|source| AttachError::Spec(Box::new(source)))?;
        self.usdt_specs.insert(site.spec, index);
        Ok(index)
    }

    /// The ring buffer map, handed to the consumer once (which maps it: `capture::ring_map`).
    pub fn take_ring(&mut self) -> Result<MapData, LoadError> {
        // Measured while it is still among the maps: the consumer owns it from here on.
        self.ring_memory = super::kmem::map_memory(&self.ebpf).into_iter().find(|(name, _)| name == "EVENTS");
        match self.ebpf.take_map("EVENTS") {
            Some(aya::maps::Map::RingBuf(map)) => Ok(map),
            _ => Err(LoadError::Missing("EVENTS")),
        }
    }

    /// Records lost because the ring was full, per CPU.
    pub fn lost_per_cpu(&self) -> Result<Vec<u64>, LoadError> {
        let map = self.ebpf.map("DROPS").ok_or(LoadError::Missing("DROPS"))?;
        let drops: PerCpuArray<_, u64> =
            PerCpuArray::try_from(map).map_err(|source| LoadError::Map { name: "DROPS", source })?;
        let values = drops.get(&0, 0).map_err(|source| LoadError::Map { name: "DROPS", source })?;
        Ok(values.iter().copied().collect())
    }
}

/// Writes the daemon's cgroup rules and denied names into their maps, before anything is attached.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::attach::usdt_args::{build_spec, parse_args, Arch};

    /// Only the sampled frees lose their return probe, and only when the daemon asks.
    #[test]
    fn only_sampled_frees_are_completed_at_entry_and_only_under_frees_at_entry() {
        let sampling = |frees_at_entry| Some(Sampling { interval: 1 << 19, max_blocks: 1, frees_at_entry });
        let at_entry: Vec<Api> = Api::all()
            .filter(|d| kernel_spec(d.spec, sampling(true)).sample.at_entry_only == 1)
            .map(|d| d.api)
            .collect();
        let frees =
            [Api::DeviceCachingAllocatorFree, Api::NpuCachingAllocatorFree, Api::WorkspaceFree, Api::C10FreeCpu];
        assert_eq!(at_entry, frees);
        for off in [sampling(false), None] {
            assert!(Api::all().all(|d| kernel_spec(d.spec, off).sample.at_entry_only == 0));
        }
    }

    fn spec(stack_offset: usize) -> UsdtSpec {
        let args = parse_args(&format!("8@{stack_offset}(%rsp)"), Arch::X86_64).unwrap();
        build_spec(&args, None, 0).unwrap()
    }

    #[test]
    fn layouts_are_counted_once_and_known_ones_are_free() {
        let sites: Vec<UsdtSpec> = (0..300).map(|i| spec(8 * (i % 257))).collect();
        let mut known = HashMap::new();
        assert_eq!(new_layouts(&known, sites.iter()), 257, "257 distinct layouts among 300 sites");
        known.insert(spec(0), 0);
        assert_eq!(new_layouts(&known, sites.iter()), 256);
        assert!(new_layouts(&HashMap::new(), sites.iter()) > MAX_USDT_SPECS as usize);
    }

    #[test]
    fn too_many_layouts_is_one_sentence_without_a_run_of_spaces() {
        let e = AttachError::TooManyUsdtSpecs { library: "/x/_native.so".into(), needed: 257, left: 256 }.to_string();
        assert!(!e.contains("  "), "{e}");
        assert!(e.contains("257") && e.contains("/x/_native.so"), "{e}");
    }
}
