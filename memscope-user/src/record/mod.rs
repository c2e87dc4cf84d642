//! Getting records out of the kernel: mapping the ring buffer ([`ring_map`]), draining it
//! ([`ring`]) and turning its bytes into checked, typed records ([`decode`]), stacks joined to
//! their calls ([`stacks`]); the probes' own messages ([`bpf_log`]).

pub mod bpf_log;
pub mod ring;
pub mod ring_map;
pub mod stacks;

pub use memscope_core::raw as decode;
