//! Converts the kernel's CLOCK_MONOTONIC timestamps (`bpf_ktime_get_ns`) to wall-clock
//! nanoseconds since the epoch, which is what msMemScope writes and Insight shows.
//!
//! The offset is measured once at start. A wall-clock step during the trace (NTP, manual change)
//! is deliberately not followed: timestamps stay consistent with each other, which matters more
//! for ordering and durations than a few ms of absolute drift.

use std::time::Duration;

fn now(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid clock id and out pointer.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// CLOCK_MONOTONIC now, in ns (the kernel probes' time base).
pub fn monotonic_ns() -> u64 {
    now(libc::CLOCK_MONOTONIC)
}

/// Wall-clock now, in ns since the epoch.
pub fn wall_ns() -> u64 {
    now(libc::CLOCK_REALTIME)
}

#[derive(Clone, Copy, Debug)]
pub struct Clock {
    /// wall - monotonic, in ns.
    offset_ns: i128,
}

impl Clock {
    /// Measures the offset, keeping the tightest of a few bracketed samples.
    pub fn calibrate() -> Self {
        let mut best: Option<(u64, i128)> = None;
        for _ in 0..16 {
            let before = monotonic_ns();
            let wall = wall_ns();
            let after = monotonic_ns();
            let span = after - before;
            let offset = i128::from(wall) - i128::from(before + span / 2);
            if best.is_none_or(|(s, _)| span < s) {
                best = Some((span, offset));
            }
        }
        Self { offset_ns: best.map_or(0, |(_, o)| o) }
    }

    #[cfg(test)]
    pub fn with_offset(offset_ns: i128) -> Self {
        Self { offset_ns }
    }

    pub fn to_wall(self, monotonic_ns: u64) -> u64 {
        u64::try_from(i128::from(monotonic_ns) + self.offset_ns).unwrap_or(0)
    }

    pub fn offset(self) -> Duration {
        Duration::from_nanos(self.offset_ns.unsigned_abs() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn converted_monotonic_now_is_close_to_wall_now() {
        let clock = Clock::calibrate();
        let converted = clock.to_wall(monotonic_ns());
        let wall = wall_ns();
        assert!(converted.abs_diff(wall) < 5_000_000, "off by {} ns", converted.abs_diff(wall));
    }
}
