//! An event's way into the core, in the order it travels: the ring's bytes decoded and joined
//! to their stacks and made wall-clock ([`decoder`], with [`thread_stacks`] and [`clock`]),
//! then through the model into the store's rows ([`recorder`]), which also feeds the online
//! view of a running job ([`live`]: the daemon's metrics, the trace's status).
//!
//! The binary maps the kernel's ring and hands each sample's bytes to [`decoder::Decoder`];
//! nothing past that point needs aya, so the consumer benchmark and the tests run the same
//! path on records they make themselves.

pub mod callers;
pub mod clock;
pub mod decoder;
pub mod flight;
pub mod live;
pub mod py_trace;
pub mod recorder;
pub mod thread_stacks;
