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
//! Cost matters here (every allocation pays it twice), so each probe does one hash lookup: all
//! per-thread state — the device and one open-call slot per layer — lives in one map value that
//! is created on the thread's first call, updated in place, and removed at thread exit.

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_probe_read_user, generated::bpf_get_attach_cookie},
    macros::{map, uprobe, uretprobe},
    maps::{HashMap, PerCpuArray},
    programs::{ProbeContext, RetProbeContext},
    EbpfContext,
};
use memscope_common::{
    record::{CallRecord, RecordHeader, RecordKind, MAX_ARGS},
    spec::{acl_layout, cfg_kind, device_effect, layer, ret_kind, split_cookie, ProbeSpec},
};

use crate::maps::{is_traced, output, SPECS};

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
}

/// Everything the probes keep per thread.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ThreadState {
    /// Device set by the thread's last successful set/get-device call, or -1.
    device: i32,
    _pad: u32,
    /// One open-call slot per layer (layer ids 1..=SLOTS).
    open: [Pending; layer::SLOTS],
}

/// tid -> state. Removed at thread exit by `process::sched_process_exit`.
#[map]
pub static THREADS: HashMap<u32, ThreadState> = HashMap::with_max_entries(65536, 0);

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
        (*blank).open[0].depth = 0;
        (*blank).open[1].depth = 0;
        (*blank).open[2].depth = 0;
        (*blank).open[3].depth = 0;
    }
    // SAFETY: the pointer is a valid map value of the right type.
    #[expect(
        clippy::needless_borrows_for_generic_args,
        reason = "by value would copy 296 bytes onto the 512-byte BPF stack"
    )]
    THREADS.insert(tid, unsafe { &*blank }, BPF_NOEXIST.into()).ok()?;
    // SAFETY: as above.
    THREADS.get_ptr_mut(tid).map(|s| unsafe { &mut *s })
}

/// The open-call slot of a layer (layer ids 1..=SLOTS map to slots `id % SLOTS`). The index is
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
    if !is_traced((pid_tgid >> 32) as u32) {
        return None;
    }
    // SAFETY: helper on our own context.
    let (spec_id, layer) = split_cookie(unsafe { bpf_get_attach_cookie(ctx.as_ptr()) });
    let state = thread_state(pid_tgid as u32)?;
    let open = slot(state, layer)?;
    let sp = stack_pointer(ctx);
    if open.depth > 0 && (sp == 0 || sp <= open.entry_sp) {
        open.depth += 1;
        return Some(());
    }
    open.spec_id = spec_id;
    open.depth = 1;
    // SAFETY: helper without arguments.
    open.entry_ns = unsafe { bpf_ktime_get_ns() };
    open.entry_sp = sp;
    for (i, arg) in open.args.iter_mut().enumerate() {
        *arg = ctx.arg::<u64>(i).unwrap_or(0);
    }
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
    let state = THREADS.get_ptr_mut(tid)?;
    // SAFETY: map value pointer from a successful lookup; only this thread touches it.
    let state = unsafe { &mut *state };
    let open = slot(state, layer)?;
    if open.depth == 0 {
        return None;
    }
    open.depth -= 1;
    if open.depth > 0 {
        return Some(());
    }
    let call = *open;

    // The outermost call's spec decides what to read: an inner `...Impl` shares its arguments.
    let spec: &ProbeSpec = SPECS.get(call.spec_id)?;
    let ret: u64 = ctx.ret();
    let succeeded = spec.ret_kind == ret_kind::NONE || ret as u32 == 0;

    let mut record = CallRecord {
        hdr: RecordHeader {
            kind: RecordKind::Call as u32,
            cpu: 0,
            // SAFETY: helper without arguments.
            ts_ns: unsafe { bpf_ktime_get_ns() },
            tgid: (pid_tgid >> 32) as u32,
            tid,
        },
        spec_id: call.spec_id,
        thread_device: -1,
        entry_ns: call.entry_ns,
        args: call.args,
        ret,
        out: 0,
        out_ok: 0,
        cfg_device: -1,
        cfg_module: -1,
        _reserved: 0,
    };

    if let Some(ptr) = arg_at(&call.args, spec.out_arg) {
        let value = if spec.out_width == 4 {
            // SAFETY: bpf_probe_read_user checks the user address.
            unsafe { bpf_probe_read_user(ptr as *const u32) }.map(u64::from)
        } else {
            // SAFETY: as above.
            unsafe { bpf_probe_read_user(ptr as *const u64) }
        };
        if let Ok(value) = value {
            record.out = value;
            record.out_ok = 1;
        }
    }

    match spec.cfg_kind {
        cfg_kind::MALLOC_CONFIG => {
            if let Some(cfg) = arg_at(&call.args, spec.cfg_arg as i32) {
                read_malloc_config(cfg, &mut record);
            }
        }
        cfg_kind::PHYSICAL_PROP => {
            if let Some(prop) = arg_at(&call.args, spec.cfg_arg as i32) {
                let at = prop.wrapping_add(acl_layout::PHYS_PROP_DEVICE_OFFSET);
                // SAFETY: checked user read.
                if let Ok(device) = unsafe { bpf_probe_read_user(at as *const u32) } {
                    record.cfg_device = device as i32;
                }
            }
        }
        _ => {}
    }

    if succeeded {
        match spec.device_effect {
            device_effect::SET_FROM_ARG0 => state.device = call.args[0] as i32,
            device_effect::SET_FROM_OUT if record.out_ok == 1 => state.device = record.out as i32,
            _ => {}
        }
    }
    record.thread_device = state.device;

    output(&record);
    Some(())
}

/// The argument at `index`, if the index names one and the value is a non-null pointer.
fn arg_at(args: &[u64; MAX_ARGS], index: i32) -> Option<u64> {
    let value = *args.get(usize::try_from(index).ok()?)?;
    (value != 0).then_some(value)
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
            acl_layout::ATTR_MODULE_ID => record.cfg_module = (value & 0xffff) as i32,
            _ => {}
        }
    }
}
