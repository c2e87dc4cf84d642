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

/// [`crate::record::CallRecord::points`] kept in a call's open slot while its verdict is "not
/// recorded": the call still counts, and a failed allocation is still recorded.
pub const SKIP: u32 = 0xff;

/// The verdict kept for a sampled free while the daemon's flight recorder gets every call: the
/// kernel keeps no blocks then (userspace's window follows every block and tells a sampled
/// block's free from the others'), so the free is sent unjudged, at its plain size and without
/// a stack. Above any `points` value, so it never reaches a record.
pub const UNJUDGED: u32 = 0x100;

/// [`crate::record::CallRecord::points`] of a call sampling left out that is sent all the same,
/// for the daemon's flight recorder alone (its window holds every call; the job's DB does not).
pub const WINDOW_ONLY: u8 = 0xff;

/// The key of a counted block: the process and the block's address (or the pool's handle).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct BlockKey {
    pub tgid: u32,
    pub _pad: u32,
    pub ptr: u64,
}

/// What the kernel keeps of a counted block until its free: what to take off the counters,
/// and whether the free is to be recorded (its allocation was).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CountedBlock {
    pub size: u64,
    pub device: i32,
    /// A [`crate::spec::sample_class`] value.
    pub class: u8,
    /// 1: the allocation was recorded.
    pub recorded: u8,
    pub _pad: u16,
}

/// The key of the exact counters: process, device (-1: not known) and class.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CounterKey {
    pub tgid: u32,
    pub device: i32,
    pub class: u32,
    pub _pad: u32,
}

/// The exact counters of one [`CounterKey`], updated with atomic adds by every CPU: what a
/// sampled trace cannot estimate (peaks, counts) comes from here.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Bytes in blocks handed out and not taken back.
    pub live: u64,
    /// The most `live` was, counted at each allocation.
    pub peak: u64,
    pub allocs: u64,
    pub frees: u64,
    /// Frees whose block the kernel did not hold (allocated before the trace, or evicted from
    /// the full block map).
    pub untracked_frees: u64,
}

const _: () = assert!(core::mem::size_of::<BlockKey>() == 16);
const _: () = assert!(core::mem::size_of::<CountedBlock>() == 16);
const _: () = assert!(core::mem::size_of::<CounterKey>() == 16);
const _: () = assert!(core::mem::size_of::<Counters>() == 40);
