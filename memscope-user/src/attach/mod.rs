//! Finding what to probe and attaching to it.
//!
//! - [`libs`]: which library files hold the traced APIs for a process (its maps, its
//!   `ASCEND_HOME_PATH`, `--lib`), identified by inode so no file is probed twice.
//! - [`elf`]: symbol names to file offsets, the unit uprobes attach by.
//! - [`debug`]: a stripped library's separate debug file (hidden symbols live there).
//! - [`dwarf`]: struct layouts from debug info, for probes that read object fields.
//! - [`loader`]: loading the eBPF object, writing the probe specs, attaching.

pub mod debug;
pub mod dwarf;
pub mod elf;
pub mod libs;
pub mod loader;
pub mod plan;

pub use loader::{AttachedProbe, ProbeSet, Tracer};
