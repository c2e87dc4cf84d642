//! Finding what to probe and attaching to it.
//!
//! - [`libs`]: which library files hold the traced APIs for a process (its maps, its
//!   `ASCEND_HOME_PATH`, `--lib`), identified by inode so no file is probed twice.
//! - [`elf`]: symbol names to file offsets, the unit uprobes attach by.
//! - [`loader`]: loading the eBPF object, writing the probe specs, attaching.

pub mod elf;
pub mod libs;
pub mod loader;

pub use loader::{AttachedProbe, ProbeSet, Tracer};
