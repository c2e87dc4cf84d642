//! Probe families; one file each.
pub mod call;
pub mod process;
pub mod usdt;
