//! The binary contract between the eBPF programs (`memscope-ebpf`) and the userspace tracer
//! (`memscope-user`).
//!
//! Everything here is `#[repr(C)]` with fixed-width fields and no implicit padding, because the
//! same bytes are written by BPF code and read back by userspace: a field moved on one side only
//! would silently corrupt every event. The `const` assertions below pin each size so such a change
//! fails to compile instead.
//!
//! - [`record`]: what travels through the ring buffer (one header, then a payload per kind).
//! - [`spec`]: what one attach point means to the generic call probes (which argument is an
//!   out-pointer, which carries a config struct, what it does to the thread's device).
//! - [`usdt`]: how the USDT program reads one call site's arguments.
//! - [`python`]: how the Python-stack probe walks an interpreter, and what it sends.
//! - [`filter`]: which processes the daemon admits, decided in the kernel.
//! - [`sampling`]: which allocations the daemon's sampling records, and with what weight.
#![no_std]

pub mod filter;
pub mod python;
pub mod record;
pub mod sampling;
pub mod spec;
pub mod usdt;

#[cfg(feature = "user")]
mod user;
