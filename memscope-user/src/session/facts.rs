//! What a trace records about itself: the `ms_meta` entries read at the start (kernel, command
//! line, the allocators' environment) and at the end (stack counts), and the summary's lines
//! of the devices and caching pools.

use memscope_core::model::Tracker;
use memscope_core::stacks::capture::CaptureStats;
use memscope_core::store::Meta;

use crate::attach::libs;
use crate::session::summary::{DeviceLine, PoolLine};
use crate::terminal::say::note;

/// Environment variables that set the allocators' behaviour, stored as `env.<NAME>` in
/// `ms_meta` so the advisor can say what the job ran with (and what to change).
const ALLOCATOR_ENV: &[&str] = &[
    "PYTORCH_NPU_ALLOC_CONF",
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
    "MULTI_STREAM_MEMORY_REUSE",
    "ATB_WORKSPACE_MEM_ALLOC_ALG_TYPE",
    "ATB_WORKSPACE_MEM_ALLOC_GLOBAL",
    "TASK_QUEUE_ENABLE",
    "HCCL_BUFFSIZE",
];

/// The target's allocator settings, from its environment at attach (launch: the environment it
/// inherits from us). Absent variables are stored as absent, so "unset" stays distinguishable.
pub(crate) fn allocator_env(pid: u32) -> Vec<(String, String)> {
    let env = libs::process_env(pid).unwrap_or_default();
    ALLOCATOR_ENV.iter().filter_map(|k| env.get(*k).map(|v| (format!("env.{k}"), v.clone()))).collect()
}

/// The process's rank and job, from its launcher's variables (none when it has no environment
/// left to read).
pub(crate) fn identity(pid: u32) -> memscope_core::cluster::identity::Identity {
    libs::process_env(pid).map(|env| memscope_core::cluster::identity::Identity::from_env(&env)).unwrap_or_default()
}

pub(crate) use crate::attach::loader::kernel_gap::kernel_release;

pub(crate) fn command_line(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|raw| {
            raw.split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default()
}

/// `ms_meta`'s stack counts, and the summary's lines for them and for `--bpf-log`.
pub(crate) fn stack_meta(stacks: &CaptureStats, bpf_log: Option<(u64, u64)>, quiet: bool) -> Meta {
    let mut meta: Meta = Vec::new();
    if stacks.stacks > 0 {
        meta.extend([
            ("stacks_captured".into(), stacks.stacks.to_string()),
            ("stacks_unique".into(), stacks.unique.to_string()),
            ("stacks_failed".into(), stacks.failed.to_string()),
            ("stack_frames_unmapped".into(), stacks.unknown_frames.to_string()),
        ]);
        note(
            quiet,
            format!(
                "native stacks: {} taken, {} distinct, {} the kernel could not walk, {} frames in no mapped file",
                stacks.stacks, stacks.unique, stacks.failed, stacks.unknown_frames
            ),
        );
    }
    if stacks.py_stacks > 0 {
        meta.extend([
            ("py_stacks_captured".into(), stacks.py_stacks.to_string()),
            ("py_stacks_unique".into(), stacks.py_unique.to_string()),
            ("py_stacks_at_depth".into(), stacks.py_at_depth.to_string()),
            ("py_stacks_no_thread".into(), stacks.py_no_thread.to_string()),
            ("py_stacks_read_failed".into(), stacks.py_read_failed.to_string()),
            ("py_stacks_threads_bound".into(), stacks.py_threads_bound.to_string()),
            ("py_stacks_main_thread".into(), stacks.py_main_thread.to_string()),
        ]);
        note(
            quiet,
            format!(
                "Python stacks: {} taken, {} distinct, {} cut at the depth asked for, {} on threads running no Python, \
                 {} with failed reads, {} of threads past the {}-thread bound, {} given the main thread's",
                stacks.py_stacks,
                stacks.py_unique,
                stacks.py_at_depth,
                stacks.py_no_thread,
                stacks.py_read_failed,
                stacks.py_threads_bound,
                memscope_common::python::MAX_PY_THREADS,
                stacks.py_main_thread
            ),
        );
    }
    if let Some((warnings, other)) = bpf_log {
        meta.extend([("bpf_log_warnings".into(), warnings.to_string()), ("bpf_log_other".into(), other.to_string())]);
        note(quiet, format!("bpf log: {warnings} warnings, {other} other messages from the probes"));
    }
    meta
}

/// The summary's line of each device, its file still unknown.
pub(crate) fn device_lines(tracker: &Tracker) -> Vec<DeviceLine> {
    tracker
        .devices()
        .map(|(device, s)| DeviceLine {
            device,
            peak: s.peak,
            live_bytes: s.used,
            live_blocks: s.live_blocks,
            mallocs: s.mallocs,
            frees: s.frees,
            untracked_frees: s.untracked_frees,
            failures: s.failures,
            file: None,
        })
        .collect()
}

/// The summary's line of each caching pool.
pub(crate) fn pool_lines(tracker: &Tracker) -> Vec<PoolLine> {
    tracker
        .pools()
        .map(|((device, pool, pid), s)| PoolLine {
            device,
            pid,
            pool: pool.as_str(),
            peak_used: s.peak_used,
            peak_total: s.peak_total,
            used: s.used,
            total: s.total,
            live_blocks: s.live_blocks,
        })
        .collect()
}
