//! `memscope-bpf daemon` (issue 13), being built: every accelerator process on the node traced
//! at once, one run folder per process ([`jobs`]), the kernel admitting processes by its rules
//! (`memscope_common::filter`, `attach::loader::Admission`). The verb itself, its discovery loop
//! and its tests come next; until then nothing calls this module.
#![allow(dead_code, reason = "the daemon verb that uses it is not wired yet (issue 13)")]

pub mod jobs;
