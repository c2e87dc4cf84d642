//! Getting records out of the kernel: mapping the ring buffer ([`ring_map`]), draining it
//! ([`ring`]) and turning its bytes into checked, typed records ([`decode`]).

pub mod ring;
pub mod ring_map;

pub use memscope_core::raw as decode;
