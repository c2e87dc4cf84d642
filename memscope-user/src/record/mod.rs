//! Getting records out of the kernel: draining the ring buffer ([`ring`]) and turning its bytes
//! into checked, typed records ([`decode`]).

pub mod decode;
pub mod ring;

pub use decode::{RawCall, RawUsdt};
