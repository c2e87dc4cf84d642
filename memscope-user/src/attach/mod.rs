//! Finding what to probe and attaching to it.
//!
//! - [`libs`]: which library files hold the traced APIs for a process (its maps, its
//!   `ASCEND_HOME_PATH`, `--lib`), identified by inode so no file is probed twice.
//! - [`file`]: opening the files the target names: regular files only, bounded, this machine's ELF.
//! - [`elf`]: symbol names to file offsets, the unit uprobes attach by.
//! - [`debug`]: a stripped library's separate debug file (hidden symbols live there).
//! - [`dwarf`]: struct layouts from debug info, for probes that read object fields.
//! - [`loader`]: loading the eBPF object, writing the probe specs, attaching.
//! - [`usdt_notes`]: USDT probe sites from `.note.stapsdt`, with file offsets for site and semaphore.
//! - [`usdt_args`]: a USDT site's argument text decoded into the spec the BPF side follows.
//! - [`perf_uprobe`]: uprobe attach with a USDT semaphore and a cookie, which aya lacks.
//! - [`usdt`]: which sites of a library are our markers, ready to attach.
//! - [`uprobe_multi`]: a library's probes of one program as one link, detached in one wait.

pub mod debug;
pub mod dwarf;
pub mod elf;
pub mod file;
pub mod libs;
pub mod loader;
pub mod perf_uprobe;
pub mod plan;
pub mod uprobe_multi;
pub mod usdt;
pub mod usdt_args;
pub mod usdt_notes;

pub use loader::{AttachedProbe, AttachedUsdt, ProbeSet, Tracer};

/// An error followed by its causes (`what: why: why`), for warnings that are printed where
/// anyhow's `{:#}` is not at hand. Error messages in this module leave their cause to this.
pub fn with_causes(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut cause = err.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}
