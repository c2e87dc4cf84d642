//! The dynamic linker's hook: `_dl_debug_state`, the empty function ld.so calls whenever its
//! list of loaded objects changes (the program's libraries at its start, each `dlopen` and
//! `dlclose`) so that a debugger can look again. We look again too: attached in each dynamic
//! linker file the node's processes use, it tells userspace to read the calling process's
//! mappings now, so a runtime library a job dlopens is probed before its first call into it
//! and the daemon does not have to poll every process's maps.
//!
//! ld.so calls it twice per change (before and after); the record is a header alone, and
//! userspace reads a process once per drain however many arrive.

use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_ktime_get_ns},
    macros::uprobe,
    programs::ProbeContext,
};
use memscope_common::record::{ExitRecord, RecordHeader, RecordKind};

use crate::filter::would_admit;
use crate::maps::output;

#[uprobe]
pub fn objects_changed(_ctx: ProbeContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    // Only processes the probes would trace: a denied one's libraries are nobody's business,
    // and one outside every --cgroup is looked at when an admitted one maps the same files.
    if would_admit((pid_tgid >> 32) as u32) {
        // SAFETY: helper without arguments.
        let ts = unsafe { bpf_ktime_get_ns() };
        output(&ExitRecord { hdr: RecordHeader::of_task(RecordKind::Loaded, ts, pid_tgid) });
    }
    0
}
