//! Byte-based Poisson sampling of allocations (the daemon's `--sample-bytes`), in one place for
//! the BPF program and for userspace, so that the tests drive the arithmetic the kernel runs.
//!
//! The model is heapprofd's, tcmalloc's and memray's: sample points fall on the stream of
//! allocated bytes as a Poisson process whose mean gap is the interval. An allocation is recorded
//! when points fall inside its bytes, with weight `interval × points`; since the points inside
//! `size` bytes are Poisson with mean `size / interval`, the weight is an unbiased estimate of the
//! size, with variance `interval × size`. An allocation of the interval or more is always recorded
//! at its real size: the large blocks, which decide OOMs, carry no error.
//!
//! BPF has no floating point, so the gaps are exponential draws that userspace puts in a table
//! (`memscope_core::sampling`), picked by a random index; the countdown to the next point is per
//! CPU, as the stream of bytes is.

/// Entries of the gap table (a power of two, so an index is a mask of a random word).
pub const GAP_TABLE_LEN: u32 = 4096;

/// Points counted in one allocation at most: the BPF verifier wants the loop bounded. Smaller
/// than the interval, an allocation crosses more than 32 gaps with a probability below 1e-35.
pub const MAX_POINTS: u32 = 32;

/// The weight sampling gives an allocation of `size` bytes (0: not recorded), advancing the
/// CPU's `countdown` (bytes to the next point; 0 before the first draw). `gap` draws the next
/// gap from the table; `interval` 0 records every allocation at its size.
#[inline(always)]
pub fn weigh(countdown: &mut u64, size: u64, interval: u64, mut gap: impl FnMut() -> u64) -> u64 {
    if interval == 0 || size >= interval {
        return size;
    }
    if *countdown == 0 {
        *countdown = gap().max(1);
    }
    if size < *countdown {
        *countdown -= size;
        return 0;
    }
    // The first point falls inside; each further gap that fits in the rest is another.
    let mut rest = size - *countdown;
    let mut points = 1;
    *countdown = gap().max(1);
    for _ in 1..MAX_POINTS {
        if rest < *countdown {
            break;
        }
        rest -= *countdown;
        points += 1;
        *countdown = gap().max(1);
    }
    // The loop's bound is statistically unreachable; past it, the countdown stays positive.
    *countdown = countdown.saturating_sub(rest).max(1);
    interval * points
}
