//! memscope eBPF programs.
//!
//! - `probes::call`: the generic entry/return pair attached to every traced API symbol. What each
//!   symbol means comes from a [`memscope_common::spec::ProbeSpec`] chosen by the attach cookie.
//! - `probes::usdt`: the USDT probe attached to every marker call site; each site's argument
//!   locations come from a [`memscope_common::usdt::UsdtSpec`] chosen by the attach cookie.
//! - `probes::process`: fork/exit tracepoints that keep the set of traced processes current.
//! - `probes::loader`: the dynamic linker's `_dl_debug_state`, which says a process loaded
//!   objects, so userspace reads its mappings for library files to probe at once.
//! - `maps`: the maps shared between them and userspace, and the ring-buffer output path.
//! - `filter`: the daemon's rules, which processes the probes trace.
#![no_std]
#![no_main]
// The BPF target has no fetching atomics in `core::sync::atomic` (its baseline CPU lacks them),
// while the kernels we load on all take BPF_ATOMIC's fetch-add and cmpxchg: the sampling counters
// use the intrinsics, and memscope-user/build.rs builds for that CPU (`probes::sample`).
#![cfg_attr(target_arch = "bpf", feature(core_intrinsics))]
#![cfg_attr(target_arch = "bpf", allow(internal_features))]

mod filter;
mod maps;
mod probes;

// Only for the BPF target: a host build (clippy on the workspace) gets std's handler.
#[cfg(all(not(test), target_arch = "bpf"))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects any reachable panic path, so this is never executed.
    loop {}
}

#[link_section = "license"]
#[no_mangle]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
