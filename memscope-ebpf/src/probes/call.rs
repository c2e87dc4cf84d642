//! The generic call probes: `call_enter` (uprobe) and `call_exit` (uretprobe), attached to every
//! traced API symbol with a cookie naming the API's spec and layer.
//!
//! Entry saves the argument registers in the thread's state; return reads the return register,
//! whatever the spec says to read through pointers (the out-pointer is only filled when the call
//! returns, which is why allocations need both probes), updates the thread's device, and emits one
//! [`CallRecord`]. Nested calls of the same layer on one thread (a public forwarder calling its
//! `...Impl`, an allocation API calling another) only deepen the saved call, so one logical call
//! gives one record, named after the outermost function.
//!
//! Under the daemon's sampling (`sample`) a pool allocation or free is decided at entry: one left
//! out is counted at return but sends no record, and captures no stack, unless the daemon's
//! flight recorder wants every call (`sample::window_all`): then its record is sent marked
//! `WINDOW_ONLY`, for the recorder's window alone, still without a stack, and the kernel counts
//! nothing (userspace sees every block); a free is then sent unjudged, without a stack. A sampled free that
//! needs nothing from its return (`SampleRule::at_entry_only`) has no return probe at all: it
//! is counted, and its record sent, at entry, and it opens no slot.
//!
//! Cost matters here (every allocation pays it twice), so each probe does one hash lookup: all
//! per-thread state — the device and one open-call slot per layer — lives in one map value that
//! is created on the thread's first call, updated in place, and removed at thread exit.

use aya_ebpf::{
    bindings::{BPF_F_NO_PREALLOC, BPF_NOEXIST},
    helpers::{
        bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_probe_read_user, bpf_probe_read_user_buf,
        bpf_probe_read_user_str_bytes, generated::bpf_get_attach_cookie,
    },
    macros::{map, uprobe, uretprobe},
    maps::{HashMap, PerCpuArray},
    programs::{ProbeContext, RetProbeContext},
    EbpfContext,
};
use memscope_common::{
    record::{BlobRecord, CallRecord, CallTextRecord, RecordHeader, RecordKind, BLOB_LEN, MAX_ARGS, NO_MODULE},
    sampling::{SKIP, WINDOW_ONLY},
    spec::{
        acl_layout, cfg_kind, device_effect, field_source, layer, ret_kind, split_cookie, FieldRead, ProbeSpec,
        MAX_FIELDS,
    },
};

use super::sample::{self, Values};
use super::{nonzero_arg, python, stack};
use crate::filter::admits;
use crate::maps::{reserve, submit, SPECS};

/// A call in flight on one thread and layer.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Pending {
    spec_id: u32,
    /// Traced calls of this layer open on the thread (0: slot free; 1: only the outermost).
    depth: u32,
    entry_ns: u64,
    /// Stack pointer at the outermost entry. A nested call runs at or below it (at it for a tail
    /// call, which forwarders compile to); an entry above it means the saved call never returned
    /// through our probe (longjmp, exception), so it is replaced.
    entry_sp: u64,
    args: [u64; MAX_ARGS],
    /// Values of the spec's entry-time field reads.
    fields: [u64; MAX_FIELDS],
    fields_ok: u32,
    /// Sampling's verdict at entry ([`sample::at_entry`]): 0 or the sample points, recorded;
    /// [`SKIP`], not (but counted).
    verdict: u32,
    /// The spec's window at entry (`SampleRule::window`).
    window: u32,
}

/// Everything the probes keep per thread.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ThreadState {
    /// Device set by the thread's last successful set/get-device call, or -1.
    device: i32,
    _pad: u32,
    /// One open-call slot per layer (layer ids 1..SLOTS).
    open: [Pending; layer::SLOTS],
}

/// tid -> state. Removed at thread exit by `process::sched_process_exit`. Allocated on insert
/// (once per thread) rather than preallocated: a full table of eight-slot states would pin tens
/// of MiB of kernel memory on every node for threads that mostly never exist.
#[map]
pub static THREADS: HashMap<u32, ThreadState> = HashMap::with_max_entries(65536, BPF_F_NO_PREALLOC);

/// A zeroed template for new entries: the state is too large for the BPF stack.
#[map]
static BLANK: PerCpuArray<ThreadState> = PerCpuArray::with_max_entries(1, 0);

/// The thread's state, created on first use.
fn thread_state(tid: u32) -> Option<&'static mut ThreadState> {
    if let Some(state) = THREADS.get_ptr_mut(tid) {
        // SAFETY: map value pointer from a successful lookup; only this thread touches it.
        return Some(unsafe { &mut *state });
    }
    let blank = BLANK.get_ptr_mut(0)?;
    // SAFETY: per-CPU scratch slot, reset before use.
    unsafe {
        (*blank).device = -1;
        for open in (*blank).open.iter_mut() {
            open.depth = 0;
        }
    }
    // SAFETY: the pointer is a valid map value of the right type.
    #[expect(
        clippy::needless_borrows_for_generic_args,
        reason = "by value would copy the whole state onto the 512-byte BPF stack"
    )]
    THREADS.insert(tid, unsafe { &*blank }, BPF_NOEXIST.into()).ok()?;
    // SAFETY: as above.
    THREADS.get_ptr_mut(tid).map(|s| unsafe { &mut *s })
}

/// The open-call slot of a layer (layer ids 1..SLOTS map to slots `id % SLOTS`). The index is
/// a mask of the cookie's bits: a range check gets folded by LLVM into arithmetic whose bound the
/// verifier cannot follow, a mask it can.
fn slot(state: &mut ThreadState, layer: u32) -> Option<&mut Pending> {
    const _: () = assert!(layer::SLOTS.is_power_of_two());
    if layer == 0 {
        return None;
    }
    let index = (layer as usize) & (layer::SLOTS - 1);
    state.open.get_mut(index)
}

/// Whether the thread has no traced call open in a layer other than `layer`, but for calls
/// sampling leaves out: the call starting now is the outermost recorded one, so its stack is the
/// one every nested call shares.
fn no_other_call_open(state: &ThreadState, layer: u32) -> bool {
    let own = (layer as usize) & (layer::SLOTS - 1);
    let mut i = 0;
    while i < layer::SLOTS {
        if i != own && state.open[i].depth > 0 && state.open[i].verdict != SKIP {
            return false;
        }
        i += 1;
    }
    true
}

#[cfg(bpf_target_arch = "x86_64")]
fn stack_pointer(ctx: &ProbeContext) -> u64 {
    // SAFETY: `regs` is the context pointer; reading a fixed field of it is allowed.
    unsafe { (*ctx.regs).rsp }
}

#[cfg(bpf_target_arch = "aarch64")]
fn stack_pointer(ctx: &ProbeContext) -> u64 {
    // SAFETY: as above.
    unsafe { (*ctx.regs).sp }
}

#[cfg(not(any(bpf_target_arch = "x86_64", bpf_target_arch = "aarch64")))]
fn stack_pointer(_ctx: &ProbeContext) -> u64 {
    // Unknown layout: treat every open call as the outer one.
    0
}

#[uprobe]
pub fn call_enter(ctx: ProbeContext) -> u32 {
    let _ = try_enter(&ctx);
    0
}

fn try_enter(ctx: &ProbeContext) -> Option<()> {
    let pid_tgid = bpf_get_current_pid_tgid();
    if !admits((pid_tgid >> 32) as u32) {
        return None;
    }
    // SAFETY: helper on our own context.
    let (spec_id, layer) = split_cookie(unsafe { bpf_get_attach_cookie(ctx.as_ptr()) });
    let spec: &ProbeSpec = SPECS.get(spec_id)?;
    // A call with no return probe must not open the slot: nothing would close it.
    let entry_only = spec.sample.at_entry_only == 1 && sample::enabled();
    let state = thread_state(pid_tgid as u32)?;
    let open = slot(state, layer)?;
    let sp = stack_pointer(ctx);
    let window = u32::from(spec.sample.window);
    if open.depth > 0 && open.window == window && (sp == 0 || sp <= open.entry_sp) {
        if !entry_only {
            open.depth += 1;
        }
        return Some(());
    }
    open.spec_id = spec_id;
    open.depth = u32::from(!entry_only);
    open.window = window;
    // SAFETY: helper without arguments.
    let entry_ns = unsafe { bpf_ktime_get_ns() };
    open.entry_ns = entry_ns;
    open.entry_sp = sp;
    for (i, arg) in open.args.iter_mut().enumerate() {
        *arg = ctx.arg::<u64>(i).unwrap_or(0);
    }
    open.fields_ok = 0;
    open.verdict = 0;
    if spec.reads_at_entry() {
        let args = open.args;
        let caller = stack::return_address(ctx, sp);
        read_fields(spec, &args, Phase::Entry { caller }, &mut open.fields, &mut open.fields_ok);
    }
    open.verdict = sample::at_entry(&spec.sample, (pid_tgid >> 32) as u32, &open.args, &open.fields, open.fields_ok);
    let verdict = open.verdict;
    let args = open.args;
    let stacks = stack::enabled() || stack::windowed() || python::enabled();
    // The stack check reads the whole state: `open` is not used past here.
    if stacks && sample::wants_stacks(verdict) && no_other_call_open(state, layer) {
        if python::enabled() && python::wanted(spec.sample.kind) {
            let _ = python::capture(ctx, pid_tgid, entry_ns);
        }
        let _ = if stack::windowed() {
            stack::capture_window(ctx, pid_tgid, entry_ns)
        } else if stack::enabled() {
            stack::capture(ctx, pid_tgid, entry_ns, sp)
        } else {
            None
        };
    }
    if spec.blob_arg >= 0 && verdict != SKIP {
        copy_blob(spec, spec_id, &args, pid_tgid);
    }
    if entry_only && (verdict != SKIP || sample::window_all()) {
        // The slot was filled as scratch (its depth stays 0): the record is complete now.
        let state: *mut ThreadState = state;
        // SAFETY: the thread's state, alive in the map; only this thread touches it.
        let open = slot(unsafe { &mut *state }, layer)?;
        let mut entry = reserve::<CallRecord>()?;
        // SAFETY: a reserved, exclusively owned slot; every field is written before submit.
        let record = unsafe { &mut *entry.as_mut_ptr() };
        fill_call(record, RecordKind::Call, spec, open, 0, pid_tgid, state);
        if verdict == SKIP {
            record.points = WINDOW_ONLY;
        }
        submit(entry);
    }
    Some(())
}

/// Copies the spec's buffer argument into a [`BlobRecord`] now, at entry: once the call has
/// returned the caller may reuse the buffer.
fn copy_blob(spec: &ProbeSpec, spec_id: u32, args: &[u64; MAX_ARGS], pid_tgid: u64) -> Option<()> {
    let at = nonzero_arg(args, i64::from(spec.blob_arg))?;
    let full_len = nonzero_arg(args, i64::from(spec.blob_len_arg)).unwrap_or(0);
    let mut entry = reserve::<BlobRecord>()?;
    // SAFETY: a reserved, exclusively owned slot; every field is written before submit.
    let record = unsafe { &mut *entry.as_mut_ptr() };
    // SAFETY: helper without arguments.
    record.hdr = RecordHeader::of_task(RecordKind::Blob, unsafe { bpf_ktime_get_ns() }, pid_tgid);
    record.spec_id = spec_id;
    record.full_len = full_len;
    // A constant-size read keeps the verifier's job trivial; a buffer shorter than BLOB_LEN at
    // the end of a mapping fails it, so fall back to the 64-byte head.
    // SAFETY: checked user reads into the record's own buffer.
    record.len = if unsafe { bpf_probe_read_user_buf(at as *const u8, &mut record.data) }.is_ok() {
        BLOB_LEN as u32
    } else if unsafe { bpf_probe_read_user_buf(at as *const u8, &mut record.data[..64]) }.is_ok() {
        64
    } else {
        0
    };
    if full_len > 0 && u64::from(record.len) > full_len {
        record.len = full_len as u32;
    }
    submit(entry);
    Some(())
}

#[uretprobe]
pub fn call_exit(ctx: RetProbeContext) -> u32 {
    let _ = try_exit(&ctx);
    0
}

fn try_exit(ctx: &RetProbeContext) -> Option<()> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tid = pid_tgid as u32;
    // SAFETY: helper on our own context.
    let (_, layer) = split_cookie(unsafe { bpf_get_attach_cookie(ctx.as_ptr()) });
    let state: *mut ThreadState = THREADS.get_ptr_mut(tid)?;
    // SAFETY: map value pointer from a successful lookup; only this thread touches it, and the
    // references below never overlap (different slots, or the device field).
    let open = slot(unsafe { &mut *state }, layer)?;
    if open.depth == 0 {
        return None;
    }
    open.depth -= 1;
    if open.depth > 0 {
        return Some(());
    }

    // The outermost call's spec decides what to read: an inner `...Impl` shares its arguments.
    let spec: &ProbeSpec = SPECS.get(open.spec_id)?;
    let ret: u64 = ctx.ret();
    let args = open.args;
    read_fields(spec, &args, Phase::Return { ret }, &mut open.fields, &mut open.fields_ok);
    let mut window_only = false;
    if spec.sample.kind != 0 {
        let values = Values { args: &open.args, fields: &open.fields, ok: open.fields_ok, ret };
        // SAFETY: the device field of the thread's state; `open` is another part of it.
        let device = unsafe { (*state).device };
        if !sample::at_exit(&spec.sample, open.verdict, pid_tgid, values, device) {
            if !sample::window_all() {
                return Some(());
            }
            window_only = true;
        }
    }
    // The record is built in place in the ring buffer: it and the open call together would not
    // fit the 512-byte BPF stack. Two reserve sites because a reservation's size must be a
    // constant: only the few APIs with a text argument pay for its bytes.
    if spec.text_arg >= 0 {
        let mut entry = reserve::<CallTextRecord>()?;
        // SAFETY: a reserved, exclusively owned slot; every field is written before submit.
        let record = unsafe { &mut *entry.as_mut_ptr() };
        fill_call(&mut record.call, RecordKind::CallText, spec, open, ret, pid_tgid, state);
        if window_only {
            record.call.points = WINDOW_ONLY;
        }
        // Only the terminator: the string read writes the rest.
        record.text[0] = 0;
        if let Some(text) = nonzero_arg(&record.call.args, i64::from(spec.text_arg)) {
            // SAFETY: bounded, checked user read; the buffer stays NUL-terminated on failure.
            let _ = unsafe { bpf_probe_read_user_str_bytes(text as *const u8, &mut record.text) };
        }
        submit(entry);
    } else {
        let mut entry = reserve::<CallRecord>()?;
        // SAFETY: as above.
        let record = unsafe { &mut *entry.as_mut_ptr() };
        fill_call(record, RecordKind::Call, spec, open, ret, pid_tgid, state);
        if window_only {
            record.points = WINDOW_ONLY;
        }
        submit(entry);
    }
    Some(())
}

/// Writes every field of a call's record, and what a successful set-device call does to the
/// thread's device. Inlined: it has more arguments than a BPF call may take, and each of the two
/// reserve sites gets its own copy with the record's type known.
#[inline(always)]
fn fill_call(
    record: &mut CallRecord,
    kind: RecordKind,
    spec: &ProbeSpec,
    open: &Pending,
    ret: u64,
    pid_tgid: u64,
    state: *mut ThreadState,
) {
    // SAFETY: helper without arguments.
    record.hdr = RecordHeader::of_task(kind, unsafe { bpf_ktime_get_ns() }, pid_tgid);
    // Below MAX_SPECS: the spec was found in the array.
    record.spec_id = open.spec_id as u16;
    record.entry_ns = open.entry_ns;
    record.args = open.args;
    record.ret = ret;
    // Both phases' reads are in: the return's were made before the record was reserved.
    record.fields = open.fields;
    record.fields_ok = open.fields_ok as u8;
    record.outer_spec = 0;
    record.points = if sample::wants_stacks(open.verdict) { open.verdict as u8 } else { 0 };
    record.cfg_device = -1;
    record.cfg_module = NO_MODULE;
    if spec.cfg_kind == cfg_kind::MALLOC_CONFIG {
        if let Some(cfg) = nonzero_arg(&record.args, i64::from(spec.cfg_arg)) {
            read_malloc_config(cfg, record);
        }
    }
    // SAFETY: the thread's state from a successful lookup; only this thread touches it, and
    // `open` is another slot of it, only read.
    let state = unsafe { &mut *state };
    if spec.outer_layer != 0 {
        if let Some(outer) = slot(state, spec.outer_layer) {
            if outer.depth > 0 {
                record.outer_spec = outer.spec_id as u16;
            }
        }
    }
    let succeeded = spec.ret_kind == ret_kind::NONE || ret as u32 == 0;
    if succeeded {
        match spec.device_effect {
            device_effect::SET_FROM_ARG0 => state.device = record.args[0] as i32,
            device_effect::SET_FROM_FIELD0 if record.fields_ok & 1 == 1 => state.device = record.fields[0] as i32,
            _ => {}
        }
    }
    record.thread_device = state.device;
}

fn read_user(at: u64, width: u8) -> Option<u64> {
    // SAFETY: bpf_probe_read_user checks the user address.
    unsafe {
        match width {
            1 => bpf_probe_read_user(at as *const u8).ok().map(u64::from),
            2 => bpf_probe_read_user(at as *const u16).ok().map(u64::from),
            4 => bpf_probe_read_user(at as *const u32).ok().map(u64::from),
            _ => bpf_probe_read_user(at as *const u64).ok(),
        }
    }
}

/// When a spec's field reads happen, with what only that moment knows.
#[derive(Clone, Copy)]
enum Phase {
    /// At entry: the caller's address (0 where the architecture's is not known).
    Entry { caller: u64 },
    /// At return: the return value.
    Return { ret: u64 },
}

fn read_field(field: &FieldRead, args: &[u64; MAX_ARGS], phase: Phase) -> Option<u64> {
    let mut at = match (field.source, phase) {
        (field_source::ARG, _) => nonzero_arg(args, i64::from(field.arg))?,
        (field_source::RET, Phase::Return { ret }) => ret,
        // An address, not a pointer to read through.
        (field_source::CALLER, Phase::Entry { caller }) => return (caller != 0).then_some(caller),
        _ => return None,
    };
    if at == 0 {
        return None;
    }
    if field.hops >= 1 {
        at = read_user(at.wrapping_add(u64::from(field.hop_offset[0])), 8).filter(|p| *p != 0)?;
    }
    if field.hops >= 2 {
        at = read_user(at.wrapping_add(u64::from(field.hop_offset[1])), 8).filter(|p| *p != 0)?;
    }
    read_user(at.wrapping_add(u64::from(field.offset)), field.width)
}

/// Performs the spec's field reads of one phase (entry or return) into `values`. Inlined: BPF
/// calls take at most five arguments.
#[inline(always)]
fn read_fields(spec: &ProbeSpec, args: &[u64; MAX_ARGS], phase: Phase, values: &mut [u64; MAX_FIELDS], ok: &mut u32) {
    let at_entry = matches!(phase, Phase::Entry { .. });
    #[expect(clippy::needless_range_loop, reason = "the index is also the bit in `ok`")]
    for i in 0..MAX_FIELDS {
        let field = &spec.fields[i];
        if field.source == field_source::NONE || (field.at_entry == 1) != at_entry {
            continue;
        }
        if let Some(value) = read_field(field, args, phase) {
            values[i] = value;
            *ok |= 1 << i;
        }
    }
}

/// Scans `aclrtMallocConfig { aclrtMallocAttribute *attrs; size_t numAttrs; }` for the device and
/// module attributes.
fn read_malloc_config(cfg: u64, record: &mut CallRecord) {
    // SAFETY: checked user reads throughout.
    let Ok(attrs) = (unsafe { bpf_probe_read_user(cfg as *const u64) }) else {
        return;
    };
    let Ok(count) = (unsafe { bpf_probe_read_user((cfg + 8) as *const u64) }) else {
        return;
    };
    if attrs == 0 {
        return;
    }
    for i in 0..acl_layout::MALLOC_ATTR_MAX {
        if i >= count {
            break;
        }
        let at = attrs + i * acl_layout::MALLOC_ATTR_SIZE;
        let Ok(kind) = (unsafe { bpf_probe_read_user(at as *const u32) }) else {
            break;
        };
        let value_at = at + acl_layout::MALLOC_ATTR_VALUE_OFFSET;
        let Ok(value) = (unsafe { bpf_probe_read_user(value_at as *const u32) }) else {
            break;
        };
        match kind {
            acl_layout::ATTR_DEVICE_ID => record.cfg_device = value as i32,
            acl_layout::ATTR_MODULE_ID => record.cfg_module = value as u16,
            _ => {}
        }
    }
}
