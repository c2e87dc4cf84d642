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
//! - [`kmem`]: the kernel memory each of the tracer's maps holds.
//! - [`linker`]: a process's dynamic linker and its `_dl_debug_state`, where the daemon hears
//!   of each `dlopen`.

pub mod debug;
pub mod dwarf;
pub mod elf;
pub mod file;
pub mod kmem;
pub mod libs;
pub mod linker;
pub mod loader;
pub mod perf_uprobe;
pub mod plan;
pub mod uprobe_multi;
pub mod usdt;
pub mod usdt_args;
pub mod usdt_notes;

pub use loader::{AttachedUsdt, LinkerHook, Tracer};
pub use plan::{AttachedProbe, ProbeSet};

/// An error followed by its causes (`what: why: why`), each said once: the CLI's error line and
/// the warnings printed where anyhow's `{:#}` is not at hand. Error messages leave their cause to
/// this; a cause that only says again what the text before it says (rusqlite's "database disk
/// image is malformed: Error code 11: The database disk image is malformed") is left out.
pub fn with_causes(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut last = text.to_lowercase();
    let mut cause = err.source();
    while let Some(c) = cause {
        let said = c.to_string();
        let lower = said.to_lowercase();
        // Only a cause that says nothing new is left out: one that merely contains the text
        // before it still has more to say (a short context such as "A" is in most sentences).
        if !last.contains(&lower) {
            text.push_str(": ");
            text.push_str(&said);
        }
        last = lower;
        cause = c.source();
    }
    text
}

#[cfg(test)]
mod tests {
    #[derive(Debug, thiserror::Error)]
    #[error("cannot read the trace")]
    struct Outer {
        source: rusqlite::Error,
    }

    #[test]
    fn each_cause_is_said_once() {
        // A real rusqlite error, whose own source repeats its text with a code.
        let conn = rusqlite::Connection::open_in_memory().unwrap();
        let source = conn.execute_batch("SELECT * FROM no_such_table").unwrap_err();
        let plain = source.to_string();
        let text = super::with_causes(&Outer { source });
        assert_eq!(text.matches(plain.as_str()).count(), 1, "{text}");
        assert!(text.starts_with("cannot read the trace: "), "{text}");
        let io = std::io::Error::from_raw_os_error(libc::ENOSPC);
        let nested = anyhow::Error::new(io).context("cannot write x");
        assert_eq!(super::with_causes(nested.as_ref()), "cannot write x: No space left on device (os error 28)");
    }

    #[test]
    fn a_cause_that_merely_contains_a_short_context_is_kept() {
        let err = anyhow::anyhow!("the DB has no operator rows to compare").context("A");
        assert_eq!(super::with_causes(err.as_ref()), "A: the DB has no operator rows to compare");
    }
}
