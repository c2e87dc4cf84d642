//! The calling thread's Python stack, read at the entry of its outermost traced call
//! (`--call-stack python[:N]`), synchronously: a stack read later from userspace would have
//! moved on.
//!
//! From the process's `_PyRuntime` (its address and the version's offsets are in [`PY_PROCS`],
//! written by userspace) the probe walks the interpreter's thread states to the one whose
//! `native_thread_id` is the calling thread (never "whoever holds the GIL", which is a race),
//! then that thread's frames, sending (code object, instruction pointer) for each. A thread that
//! runs no Python then (a C++ worker, the autograd engine's device threads) gets the main
//! thread's frames instead, flagged [`PY_MAIN_THREAD`]: the owner rules then see what the job
//! was doing (the caller waits in `backward` while the engine's threads make the gradients).
//! Every read is a checked user read; every loop is bounded.
//!
//! A failed read or a thread list longer than the bound is flagged in the record (counted in
//! the summary) and, with `trace --bpf-log`, told through aya-log once per walk: logging from
//! the `bpf_loop` callbacks would be verified in each of them, and say the same thing per frame.
//!
//! The same walk samples (`trace --python-trace`): [`py_sample`] runs on a per-CPU timer and,
//! when the thread on that CPU belongs to a traced interpreter and runs Python, sends its
//! frames as a [`RecordKind::PySample`]; userspace turns consecutive samples of a thread into
//! the intervals of the functions on its stack.

use aya_ebpf::{
    cty::c_void,
    helpers::{bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_probe_read_user, generated::bpf_loop},
    macros::{map, perf_event},
    maps::{HashMap, PerCpuArray},
    programs::{PerfEventContext, ProbeContext},
    EbpfContext, Global,
};
use memscope_common::{
    python::{
        PyOffsets, PyProcess, PyStackRecord, MAX_PY_FRAMES, MAX_PY_THREADS, NO_OFFSET, PY_AT_DEPTH, PY_MAIN_THREAD,
        PY_NO_THREAD, PY_READ_FAILED, PY_STACK_HEADER_LEN, PY_THREADS_BOUND,
    },
    record::{RecordHeader, RecordKind},
};

use aya_log_ebpf::{debug, warn};

use crate::maps::output_bytes;

/// Python frames to read per call (0: Python stacks are off).
#[no_mangle]
static PY_DEPTH: Global<u32> = Global::new(0);

/// Python frames to read per sample (0: the sampler is off; its timer is not even attached).
#[no_mangle]
static PY_SAMPLE_DEPTH: Global<u32> = Global::new(0);

/// tgid -> its interpreter. A process absent here has no Python stacks.
#[map]
pub static PY_PROCS: HashMap<u32, PyProcess> = HashMap::with_max_entries(1024, 0);

#[map]
static PY_SCRATCH: PerCpuArray<PyStackRecord> = PerCpuArray::with_max_entries(1, 0);

/// 1: frees get Python stacks too (`--call-stack python`, whose column every row has); 0: only
/// the calls that are not pool frees (the owner rules and sites need allocations only, and a
/// training loop frees as often as it allocates).
#[no_mangle]
static PY_FREES: Global<u32> = Global::new(1);

pub fn enabled() -> bool {
    PY_DEPTH.load() != 0
}

/// Whether a call of this sampling kind gets a Python stack.
pub fn wanted(sample_kind: u8) -> bool {
    sample_kind != memscope_common::spec::sample_kind::FREE || PY_FREES.load() != 0
}

/// A word of the target's memory; `None` when it cannot be read.
fn read_u64(at: u64) -> Option<u64> {
    // SAFETY: checked user read.
    unsafe { bpf_probe_read_user(at as *const u64) }.ok()
}

/// A pointer of the target's memory, 0 for NULL; a failed read counts in `failed` and reads as
/// NULL, which ends whatever walk it was part of.
fn read_ptr_or_null(at: u64, failed: &mut u64) -> u64 {
    read_u64(at).unwrap_or_else(|| {
        *failed += 1;
        0
    })
}

fn read_ptr(at: u64) -> Option<u64> {
    read_u64(at).filter(|p| *p != 0)
}

/// The thread-list walk's state, shared with its `bpf_loop` callback.
#[repr(C)]
struct ThreadWalk {
    tstate: u64,
    tid: u64,
    next: u64,
    native_tid: u64,
    /// `PyOffsets::pthread_tid`, or `u64::MAX`.
    pthread_tid: u64,
    found: u64,
    /// Reads that failed.
    failed: u64,
}

/// One thread state of the walk: stops (1) at the calling thread's, or at the list's end.
extern "C" fn thread_step(_index: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `ctx` is the `ThreadWalk` on the caller's stack that `bpf_loop` hands back.
    let w = unsafe { &mut *ctx.cast::<ThreadWalk>() };
    if w.tstate == 0 {
        return 1;
    }
    let tid = if w.pthread_tid == u64::MAX {
        // `native_thread_id` is an `unsigned long`.
        read_u64(w.tstate + w.native_tid)
    } else {
        // SAFETY: checked user reads: `thread_id` is the thread's `struct pthread`, which holds
        // its kernel thread id.
        read_ptr(w.tstate + w.native_tid)
            .and_then(|pthread| unsafe { bpf_probe_read_user((pthread + w.pthread_tid) as *const u32) }.ok())
            .map(u64::from)
    };
    if tid == Some(w.tid) {
        w.found = w.tstate;
        return 1;
    }
    w.failed += u64::from(tid.is_none());
    w.tstate = read_ptr_or_null(w.tstate + w.next, &mut w.failed);
    0
}

/// The frame walk's state, shared with its `bpf_loop` callback.
#[repr(C)]
struct FrameWalk {
    frame: u64,
    frames: u64,
    depth: u64,
    /// Reads that failed.
    failed: u64,
    offsets: PyOffsets,
}

/// One frame: its (code, instruction) into the scratch record unless the C stack owns it, then
/// on to the previous one; stops (1) at the last frame or the depth.
extern "C" fn frame_step(_index: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `ctx` is the `FrameWalk` on the caller's stack that `bpf_loop` hands back.
    let w = unsafe { &mut *ctx.cast::<FrameWalk>() };
    if w.frame == 0 || w.frames >= w.depth {
        return 1;
    }
    let o = &w.offsets;
    let owner = if o.owner_cstack == NO_OFFSET {
        0
    } else {
        // SAFETY: checked user read of one byte.
        unsafe { bpf_probe_read_user((w.frame + u64::from(o.frame_owner)) as *const u8) }.unwrap_or_else(|_| {
            w.failed += 1;
            0
        })
    };
    if o.owner_cstack == NO_OFFSET || u32::from(owner) != o.owner_cstack {
        let code = read_ptr_or_null(w.frame + u64::from(o.frame_code), &mut w.failed);
        let instr = read_ptr_or_null(w.frame + u64::from(o.frame_instr), &mut w.failed);
        let Some(record) = PY_SCRATCH.get_ptr_mut(0) else { return 1 };
        // SAFETY: per-CPU scratch slot, as in `capture`.
        let record = unsafe { &mut *record };
        if let Some(slot) = record.stack.get_mut(w.frames as usize) {
            slot.code = code;
            slot.instr = instr;
            w.frames += 1;
        }
    }
    w.frame = read_ptr_or_null(w.frame + u64::from(o.frame_previous), &mut w.failed);
    0
}

/// The thread state of kernel thread `tid`: (its address or 0, the walk's steps, where the walk
/// stopped).
fn find_thread(first: u64, tid: u32, o: &PyOffsets, failed: &mut u64) -> (u64, i64, u64) {
    let mut threads = ThreadWalk {
        tstate: first,
        tid: u64::from(tid),
        next: u64::from(o.tstate_next),
        native_tid: u64::from(o.tstate_native_thread_id),
        pthread_tid: if o.pthread_tid == NO_OFFSET { u64::MAX } else { u64::from(o.pthread_tid) },
        found: 0,
        failed: 0,
    };
    // SAFETY: the callback and its context are ours; the count is a constant.
    let steps =
        unsafe { bpf_loop(MAX_PY_THREADS, thread_step as *mut c_void, (&mut threads as *mut ThreadWalk).cast(), 0) };
    *failed += threads.failed;
    (threads.found, steps, threads.tstate)
}

/// Reads a thread state's frames (at most `depth`) into the scratch record; returns (frames,
/// whether the depth cut the walk short).
fn read_frames(tstate: u64, o: &PyOffsets, depth: u32, failed: &mut u64) -> (u64, bool) {
    let mut frame = read_ptr_or_null(tstate + u64::from(o.tstate_frame), failed);
    if o.cframe_current_frame != NO_OFFSET && frame != 0 {
        frame = read_ptr_or_null(frame + u64::from(o.cframe_current_frame), failed);
    }
    let depth = u64::from(depth).min(MAX_PY_FRAMES as u64);
    let mut walk = FrameWalk { frame, frames: 0, depth, failed: 0, offsets: *o };
    // SAFETY: as in `find_thread`.
    unsafe { bpf_loop(MAX_PY_FRAMES as u32, frame_step as *mut c_void, (&mut walk as *mut FrameWalk).cast(), 0) };
    *failed += walk.failed;
    (walk.frames.min(MAX_PY_FRAMES as u64), walk.frames >= walk.depth && walk.frame != 0)
}

/// Reads and sends the calling thread's Python frames; a thread that runs no Python at that
/// instant gets the main thread's (flagged), as that thread is what drives the work (a GPU or
/// NPU backward runs on the autograd engine's threads while the caller waits in `backward`).
/// The walks are `bpf_loop`s: their callbacks are verified once, where bounded loops inlined
/// here were verified along every path (and exceeded the verifier's limit).
pub fn capture(ctx: &ProbeContext, pid_tgid: u64, entry_ns: u64) -> Option<()> {
    walk(ctx, Walk { kind: RecordKind::PyStack, pid_tgid, ts: entry_ns, depth: PY_DEPTH.load(), sampled: false })
}

/// The sampler's timer, on every CPU: the thread running there, if a traced interpreter's, has
/// its frames sent. Threads running no Python then send nothing.
#[perf_event]
pub fn py_sample(ctx: PerfEventContext) -> u32 {
    let depth = PY_SAMPLE_DEPTH.load();
    if depth == 0 {
        return 0;
    }
    let pid_tgid = bpf_get_current_pid_tgid();
    // SAFETY: a value of our own map, only read.
    if unsafe { PY_PROCS.get((pid_tgid >> 32) as u32) }.is_none() {
        return 0;
    }
    // SAFETY: plain helper call.
    let ts = unsafe { bpf_ktime_get_ns() };
    let _ = walk(&ctx, Walk { kind: RecordKind::PySample, pid_tgid, ts, depth, sampled: true });
    0
}

/// What one walk reads and sends.
struct Walk {
    kind: RecordKind,
    pid_tgid: u64,
    ts: u64,
    depth: u32,
    /// A sample: only the thread's own frames, and nothing sent without any.
    sampled: bool,
}

fn walk<C: EbpfContext>(ctx: &C, w: Walk) -> Option<()> {
    let Walk { kind, pid_tgid, ts, depth, sampled } = w;
    let tgid = (pid_tgid >> 32) as u32;
    // SAFETY: a value of our own map, only read.
    let py = unsafe { PY_PROCS.get(tgid) }?;
    let o = py.offsets;
    let record = PY_SCRATCH.get_ptr_mut(0)?;
    // SAFETY: per-CPU scratch slot; nothing else runs on this CPU while the probe does.
    let record = unsafe { &mut *record };
    record.hdr = RecordHeader::of_task(kind, ts, pid_tgid);
    record.flags = 0;
    record.frames = 0;
    let mut failed = 0;
    let interp = read_ptr_or_null(py.runtime + u64::from(o.runtime_interpreters_head), &mut failed);
    let first = if interp == 0 { 0 } else { read_ptr_or_null(interp + u64::from(o.interp_threads_head), &mut failed) };
    let tid = pid_tgid as u32;
    let (found, steps, left) = find_thread(first, tid, &o, &mut failed);
    let mut flags = 0;
    let mut frames = (0, false);
    if found == 0 {
        if sampled {
            // A thread of the process running no Python: nothing to sample, nothing to say.
            return None;
        }
        flags = PY_NO_THREAD;
        if steps == i64::from(MAX_PY_THREADS) && left != 0 {
            flags |= PY_THREADS_BOUND;
            warn!(ctx, "Python stack of thread {}: not among the first {} thread states", tid, MAX_PY_THREADS);
        } else {
            debug!(ctx, "Python stack of thread {}: no Python thread state (not a Python thread)", tid);
        }
    } else {
        frames = read_frames(found, &o, depth, &mut failed);
    }
    if sampled && frames.0 == 0 {
        return None;
    }
    if frames.0 == 0 && tid != tgid {
        let (main, _, _) = find_thread(first, tgid, &o, &mut failed);
        if main != 0 {
            frames = read_frames(main, &o, depth, &mut failed);
            flags |= if frames.0 > 0 { PY_MAIN_THREAD } else { 0 };
        }
    }
    let record = PY_SCRATCH.get_ptr_mut(0)?;
    // SAFETY: the callbacks wrote into this same slot; reborrowed after them.
    let record = unsafe { &mut *record };
    record.frames = frames.0 as u32;
    record.flags = flags | if frames.1 { PY_AT_DEPTH } else { 0 };
    if failed != 0 {
        let record = PY_SCRATCH.get_ptr_mut(0)?;
        // SAFETY: as above.
        unsafe { (*record).flags |= PY_READ_FAILED };
        warn!(ctx, "Python stack of thread {}: {} reads of the interpreter's memory failed", tid, failed);
    }
    let record = PY_SCRATCH.get_ptr_mut(0)?;
    // SAFETY: as above.
    let record = unsafe { &*record };
    let len = (PY_STACK_HEADER_LEN + record.frames as usize * 16).min(core::mem::size_of::<PyStackRecord>());
    // SAFETY: the record is plain integers; `len` is at most its size.
    let bytes = unsafe { core::slice::from_raw_parts((record as *const PyStackRecord).cast::<u8>(), len) };
    output_bytes(bytes);
    Some(())
}
