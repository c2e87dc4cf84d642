//! The USDT probe: `usdt_hit`, attached to every USDT call site of the markers (tags, steps,
//! ranges) with a cookie naming the site's [`UsdtSpec`].
//!
//! A site is a `nop`, not a function: its arguments are wherever the compiler left them
//! (registers, stack slots, constants), which is why each site has its own decoded spec. The probe
//! reads each argument per its spec, copies the string argument if the probe has one (bounded to
//! [`USDT_TEXT_LEN`] bytes), and emits one [`UsdtRecord`]. There is no return probe: a marker is
//! an instant.

use aya_ebpf::{
    helpers::{
        bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_probe_read_kernel, bpf_probe_read_user,
        bpf_probe_read_user_str_bytes, generated::bpf_get_attach_cookie,
    },
    macros::{map, uprobe},
    maps::Array,
    programs::ProbeContext,
    EbpfContext,
};
use memscope_common::{
    record::{RecordHeader, RecordKind, UsdtRecord},
    usdt::{arg_kind, UsdtArg, UsdtSpec, MAX_USDT_SPECS, USDT_MAX_ARGS},
};

use super::nonzero_arg;
use crate::filter::admits;
use crate::maps::{reserve, submit};

/// Per-site argument specs, written by userspace before the site is attached.
#[map]
pub static USDT_SPECS: Array<UsdtSpec> = Array::with_max_entries(MAX_USDT_SPECS, 0);

/// Largest register offset userspace may name: `struct pt_regs` is 168 bytes on x86-64 and
/// `user_pt_regs` 272 on arm64. The mask keeps the verifier's view of the read bounded.
const REG_OFF_MASK: u64 = 0x1ff;

#[uprobe]
pub fn usdt_hit(ctx: ProbeContext) -> u32 {
    let _ = try_hit(&ctx);
    0
}

fn try_hit(ctx: &ProbeContext) -> Option<()> {
    let pid_tgid = bpf_get_current_pid_tgid();
    if !admits((pid_tgid >> 32) as u32) {
        return None;
    }
    // SAFETY: helper on our own context.
    let spec_id = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) } as u32;
    let spec: &UsdtSpec = USDT_SPECS.get(spec_id)?;
    let mut entry = reserve::<UsdtRecord>()?;
    // SAFETY: `entry` is a reserved, exclusively owned slot; every field is written before submit.
    let record = unsafe { &mut *entry.as_mut_ptr() };
    // SAFETY: helper without arguments.
    record.hdr = RecordHeader::of_task(RecordKind::Usdt, unsafe { bpf_ktime_get_ns() }, pid_tgid);
    record.spec_id = spec_id;
    record.probe = spec.probe;
    // Indexes, not iterators: constant bounds keep each access verifiable.
    for i in 0..USDT_MAX_ARGS {
        record.args[i] = if (i as u32) < spec.arg_count { read_arg(ctx, &spec.args[i]) } else { 0 };
    }
    record.text[0] = 0;
    if let Some(at) = nonzero_arg(&record.args, i64::from(spec.text_arg)) {
        // SAFETY: bounded, checked user read; on failure the buffer stays an empty string.
        if unsafe { bpf_probe_read_user_str_bytes(at as *const u8, &mut record.text) }.is_err() {
            record.text[0] = 0;
        }
    }
    submit(entry);
    Some(())
}

/// A register of the probed task, by its byte offset in `pt_regs`. Read through the helper: the
/// verifier rejects context reads at an offset it cannot prove constant.
fn register(ctx: &ProbeContext, offset: u16) -> u64 {
    let at = (ctx.regs as *const u8).wrapping_add((u64::from(offset) & REG_OFF_MASK) as usize);
    // SAFETY: a checked kernel read inside the probed task's register frame.
    unsafe { bpf_probe_read_kernel(at as *const u64) }.unwrap_or(0)
}

fn read_arg(ctx: &ProbeContext, arg: &UsdtArg) -> u64 {
    let raw = match arg.kind {
        arg_kind::CONST => arg.val_off as u64,
        arg_kind::REG => register(ctx, arg.reg_off),
        arg_kind::REG_DEREF => {
            let at = register(ctx, arg.reg_off).wrapping_add(arg.val_off as u64);
            // SAFETY: bpf_probe_read_user checks the user address.
            unsafe { bpf_probe_read_user(at as *const u64) }.unwrap_or(0)
        }
        arg_kind::SIB => {
            let index = register(ctx, arg.idx_reg_off) << (arg.scale_shift & 3);
            let at = register(ctx, arg.reg_off).wrapping_add(index).wrapping_add(arg.val_off as u64);
            // SAFETY: as above.
            unsafe { bpf_probe_read_user(at as *const u64) }.unwrap_or(0)
        }
        _ => 0,
    };
    // Keep the low `size` bytes, extended as the spec says: little-endian 8-byte reads put a
    // narrower value in the low bytes, and sub-registers are the low bytes of their register.
    let shift = u32::from(arg.bitshift & 63);
    if arg.signed == 1 {
        (((raw << shift) as i64) >> shift) as u64
    } else {
        (raw << shift) >> shift
    }
}
