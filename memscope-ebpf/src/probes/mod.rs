//! Probe families; one file each.
pub mod call;
pub mod loader;
pub mod process;
pub mod python;
pub mod sample;
pub mod stack;
pub mod usdt;

/// The argument at `index` (out of six) if it is non-zero; `None` past the end, for a negative
/// index ("none") or a null value. Spelled as a match so each access is at a constant stack
/// offset, which the verifier accepts without bounds tracking.
#[inline(always)]
pub fn nonzero_arg(args: &[u64; 6], index: i64) -> Option<u64> {
    let value = match index {
        0 => args[0],
        1 => args[1],
        2 => args[2],
        3 => args[3],
        4 => args[4],
        5 => args[5],
        _ => return None,
    };
    (value != 0).then_some(value)
}
