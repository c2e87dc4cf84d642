//! Process lifecycle: `sched_process_fork` grows the traced set with the children of traced
//! processes (unless the trace was started with `--no-follow`), `sched_process_exit` shrinks it
//! and forgets per-thread state, so a reused thread id never inherits a dead thread's device or
//! half a call. A forked child inherits its parent's interpreter (`--call-stack python`): the
//! same memory at the same addresses, so it has Python stacks from its first call, before
//! userspace has looked at it; `sched_process_exec` drops the interpreter of a process that
//! replaces its image, and tells userspace to look again (in the daemon, at any process its
//! rules would trace: a new program, whose libraries are looked for at once). Userspace reads the set to know when the last traced process has exited: an
//! entry leaves it in the exit tracepoint, before the process's pidfd says it exited.
//!
//! Field offsets come from the tracepoint's format file at load time (they moved between kernel
//! versions: `parent_comm` became a `__data_loc` string in 6.x).

use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_ktime_get_ns},
    macros::tracepoint,
    programs::TracePointContext,
    Global,
};
use memscope_common::record::{ExitRecord, ForkRecord, RecordHeader, RecordKind, NO_GROUP_DEAD};

use crate::filter::{self, admit_any, deny_by_comm, would_admit};
use crate::maps::{follow_forks, is_traced, output, TRACED};
use crate::probes::call::THREADS;
use crate::probes::python::PY_PROCS;

/// Offset of `child_pid` in `sched/sched_process_fork`.
#[no_mangle]
static FORK_CHILD_PID_OFFSET: Global<u32> = Global::new(20);

/// Offset of `group_dead` in `sched/sched_process_exit`, or [`NO_GROUP_DEAD`].
#[no_mangle]
static EXIT_GROUP_DEAD_OFFSET: Global<u32> = Global::new(32);

fn header(kind: RecordKind, pid_tgid: u64) -> RecordHeader {
    // SAFETY: helper without arguments.
    RecordHeader::of_task(kind, unsafe { bpf_ktime_get_ns() }, pid_tgid)
}

#[tracepoint]
pub fn sched_process_fork(ctx: TracePointContext) -> u32 {
    let _ = try_fork(&ctx);
    0
}

fn try_fork(ctx: &TracePointContext) -> Option<()> {
    let pid_tgid = bpf_get_current_pid_tgid();
    if admit_any() {
        // SAFETY: offset from the format file, read through the tracepoint helper.
        let child: i32 = unsafe { ctx.read_at(FORK_CHILD_PID_OFFSET.load() as usize) }.ok()?;
        filter::inherit((pid_tgid >> 32) as u32, child as u32);
    }
    if !follow_forks() {
        return None;
    }
    if !is_traced((pid_tgid >> 32) as u32) {
        return None;
    }
    // SAFETY: offset from the format file, read through the tracepoint helper.
    let child: i32 = unsafe { ctx.read_at(FORK_CHILD_PID_OFFSET.load() as usize) }.ok()?;
    let child = child as u32;
    // A new thread also lands here with its tid; as a key it is harmless (the filter looks up
    // tgids) and the exit probe removes it again.
    TRACED.insert(child, 1, 0).ok()?;
    // SAFETY: a value of our own map, copied out before the insert.
    if let Some(py) = unsafe { PY_PROCS.get((pid_tgid >> 32) as u32) }.copied() {
        // A thread lands here too; its key is removed at its exit, as in `TRACED`.
        let _ = PY_PROCS.insert(child, py, 0);
    }
    output(&ForkRecord { hdr: header(RecordKind::Fork, pid_tgid), child, _reserved: 0 });
    Some(())
}

#[tracepoint]
pub fn sched_process_exit(ctx: TracePointContext) -> u32 {
    let _ = try_exit(&ctx);
    0
}

fn try_exit(ctx: &TracePointContext) -> Option<()> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    let tid = pid_tgid as u32;
    filter::forget(tid);
    if !is_traced(tgid) {
        return None;
    }
    // Its device and any call it died inside go with it.
    let _ = THREADS.remove(tid);
    if tid != tgid {
        let _ = TRACED.remove(tid);
        let _ = PY_PROCS.remove(tid);
    }
    let offset = EXIT_GROUP_DEAD_OFFSET.load();
    let group_dead = if offset == NO_GROUP_DEAD {
        tid == tgid
    } else {
        // SAFETY: offset from the format file.
        unsafe { ctx.read_at::<u8>(offset as usize) }.ok()? != 0
    };
    if !group_dead {
        return Some(());
    }
    let _ = TRACED.remove(tgid);
    let _ = PY_PROCS.remove(tgid);
    output(&ExitRecord { hdr: header(RecordKind::Exit, pid_tgid) });
    Some(())
}

#[tracepoint]
pub fn sched_process_exec(_ctx: TracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    deny_by_comm(tgid);
    if is_traced(tgid) {
        // The old image's interpreter is gone with it; userspace finds the new one's.
        let _ = PY_PROCS.remove(tgid);
    }
    // In the daemon also a process not traced yet: a new program, whose libraries (and dynamic
    // linker) userspace looks at now rather than at a scan of /proc.
    if would_admit(tgid) {
        output(&ExitRecord { hdr: header(RecordKind::Exec, pid_tgid) });
    }
    0
}
