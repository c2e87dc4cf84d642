//! The user stack of a traced call, captured at the entry of a thread's outermost traced call
//! (`--call-stack c[:N]`).
//!
//! `bpf_get_stack(BPF_F_USER_STACK)` walks the frame-pointer chain into a per-CPU scratch
//! [`StackRecord`]; only the frames it found go to the ring (`bpf_ringbuf_output` takes a
//! bounded length, where a reservation's size must be a constant), so a stack of 20 frames costs
//! 200 bytes of ring, not the 1 KiB of a full record. Userspace deduplicates, normalizes and
//! symbolizes; the kernel only copies. With `--unwind dwarf` it copies the registers and a window
//! of the stack instead ([`capture_window`]), for userspace to unwind from `.eh_frame`.
//!
//! A walk or copy that fails is flagged in its record (counted in the summary) and, with
//! `trace --bpf-log`, told through aya-log with the error and the thread.

use aya_ebpf::{
    bindings::BPF_F_USER_STACK,
    helpers::{bpf_probe_read_user_buf, generated::bpf_get_stack},
    macros::map,
    maps::PerCpuArray,
    programs::ProbeContext,
    EbpfContext, Global,
};
use aya_log_ebpf::{debug, warn};
use memscope_common::record::{
    RecordHeader, RecordKind, StackRecord, StackWindowRecord, MAX_STACK_DEPTH, MAX_STACK_WINDOW, STACK_AT_DEPTH,
    STACK_FAILED, STACK_HEADER_LEN, WINDOW_FAILED, WINDOW_HEADER_LEN,
};

use crate::maps::output_bytes;

/// Frames to capture (0: stacks are off). Userspace sets it at load time, at most
/// [`MAX_STACK_DEPTH`].
#[no_mangle]
static STACK_DEPTH: Global<u32> = Global::new(0);

/// The record being built: too large for the 512-byte BPF stack.
#[map]
static SCRATCH: PerCpuArray<StackRecord> = PerCpuArray::with_max_entries(1, 0);

pub fn enabled() -> bool {
    STACK_DEPTH.load() != 0
}

/// The traced function's return address at its entry: where its caller called it from.
#[cfg(bpf_target_arch = "x86_64")]
pub(super) fn return_address(ctx: &ProbeContext, sp: u64) -> u64 {
    let _ = ctx;
    // SAFETY: checked user read of the word the call instruction pushed.
    unsafe { aya_ebpf::helpers::bpf_probe_read_user(sp as *const u64) }.unwrap_or(0)
}

#[cfg(bpf_target_arch = "aarch64")]
pub(super) fn return_address(ctx: &ProbeContext, _sp: u64) -> u64 {
    // SAFETY: `regs` is the context pointer; reading a fixed field of it is allowed.
    unsafe { (*ctx.regs).regs[30] }
}

#[cfg(not(any(bpf_target_arch = "x86_64", bpf_target_arch = "aarch64")))]
pub(super) fn return_address(_ctx: &ProbeContext, _sp: u64) -> u64 {
    0
}

/// Captures the current thread's user stack and sends it, stamped with the call's `entry_ns`.
pub fn capture(ctx: &ProbeContext, pid_tgid: u64, entry_ns: u64, sp: u64) -> Option<()> {
    let record = SCRATCH.get_ptr_mut(0)?;
    // SAFETY: per-CPU scratch slot; nothing else runs on this CPU while the probe does.
    let record = unsafe { &mut *record };
    record.hdr = RecordHeader::of_task(RecordKind::Stack, entry_ns, pid_tgid);
    record.return_address = return_address(ctx, sp);
    let depth = (STACK_DEPTH.load() as usize).min(MAX_STACK_DEPTH);
    let want = (depth * 8) as u32;
    // SAFETY: the helper writes at most `want` bytes into the record's own array.
    let got = unsafe { bpf_get_stack(ctx.as_ptr(), record.ips.as_mut_ptr().cast(), want, u64::from(BPF_F_USER_STACK)) };
    let frames = if got > 0 { (got as usize / 8).min(MAX_STACK_DEPTH) } else { 0 };
    record.frames = frames as u32;
    record.flags = if got < 0 {
        warn!(ctx, "user stack of thread {} not walked: bpf_get_stack returned {}", pid_tgid as u32, got);
        STACK_FAILED
    } else if frames == depth {
        STACK_AT_DEPTH
    } else {
        0
    };
    let len = STACK_HEADER_LEN + frames * 8;
    // SAFETY: the record is plain integers; `len` is at most its size.
    let bytes = unsafe { core::slice::from_raw_parts((record as *const StackRecord).cast::<u8>(), len) };
    output_bytes(bytes);
    Some(())
}

/// Bytes of stack to copy per call for `--unwind dwarf` (0: frame-pointer walks). Userspace
/// sets it at load time, at most [`MAX_STACK_WINDOW`].
#[no_mangle]
static STACK_WINDOW: Global<u32> = Global::new(0);

/// The window record being built (16 KiB: far too large for the BPF stack).
#[map]
static WINDOW_SCRATCH: PerCpuArray<StackWindowRecord> = PerCpuArray::with_max_entries(1, 0);

pub fn windowed() -> bool {
    STACK_WINDOW.load() != 0
}

#[cfg(bpf_target_arch = "x86_64")]
fn registers(ctx: &ProbeContext) -> (u64, u64, u64, u64) {
    // SAFETY: `regs` is the context pointer; reading fixed fields of it is allowed.
    unsafe { ((*ctx.regs).rip, (*ctx.regs).rsp, (*ctx.regs).rbp, 0) }
}

#[cfg(bpf_target_arch = "aarch64")]
fn registers(ctx: &ProbeContext) -> (u64, u64, u64, u64) {
    // SAFETY: as above.
    unsafe { ((*ctx.regs).pc, (*ctx.regs).sp, (*ctx.regs).regs[29], (*ctx.regs).regs[30]) }
}

#[cfg(not(any(bpf_target_arch = "x86_64", bpf_target_arch = "aarch64")))]
fn registers(_ctx: &ProbeContext) -> (u64, u64, u64, u64) {
    (0, 0, 0, 0)
}

/// Copies the registers and the top of the user stack, for unwinding in userspace. Near the
/// stack's top a full window would run past the mapping and fail whole, so a failed read is
/// retried at half the size, down to 512 bytes.
pub fn capture_window(ctx: &ProbeContext, pid_tgid: u64, entry_ns: u64) -> Option<()> {
    let record = WINDOW_SCRATCH.get_ptr_mut(0)?;
    // SAFETY: per-CPU scratch slot; nothing else runs on this CPU while the probe does.
    let record = unsafe { &mut *record };
    record.hdr = RecordHeader::of_task(RecordKind::StackWindow, entry_ns, pid_tgid);
    let (ip, sp, fp, lr) = registers(ctx);
    (record.ip, record.sp, record.fp, record.lr) = (ip, sp, fp, lr);
    let mut want = (STACK_WINDOW.load() as usize).min(MAX_STACK_WINDOW);
    record.len = 0;
    record.flags = WINDOW_FAILED;
    for _ in 0..6 {
        if want < 512 {
            break;
        }
        let want_bounded = want.min(MAX_STACK_WINDOW);
        // SAFETY: a checked user read into the record's own buffer, at most its size.
        if unsafe { bpf_probe_read_user_buf(sp as *const u8, &mut record.data[..want_bounded]) }.is_ok() {
            record.len = want_bounded as u32;
            record.flags = 0;
            break;
        }
        debug!(ctx, "stack window of thread {} at sp {:x}: {} bytes unreadable", pid_tgid as u32, sp, want_bounded);
        want /= 2;
    }
    if record.flags == WINDOW_FAILED {
        warn!(ctx, "stack window of thread {} at sp {:x} not copied", pid_tgid as u32, sp);
    }
    let len = (WINDOW_HEADER_LEN + record.len as usize).min(core::mem::size_of::<StackWindowRecord>());
    // SAFETY: the record is plain integers; `len` is at most its size.
    let bytes = unsafe { core::slice::from_raw_parts((record as *const StackWindowRecord).cast::<u8>(), len) };
    output_bytes(bytes);
    Some(())
}
