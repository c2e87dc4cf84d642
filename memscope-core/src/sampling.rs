//! The daemon's sampling by bytes, userspace side: the table of gaps the BPF program draws from
//! ([`gap_table`]), and how far a sampled total can be from the truth ([`standard_error`]).
//! The rule itself, shared with the BPF program, is [`memscope_common::sampling::weigh`].
//!
//! The table holds the exponential distribution's quantiles at evenly spaced probabilities
//! rather than random draws: the kernel's random index makes the draws random, and a table of
//! quantiles has no unlucky fill. Its mean is set to the interval exactly, since the estimate's
//! bias is the ratio of the two (points fall once per mean gap, whatever the gaps' shape).

use memscope_common::sampling::GAP_TABLE_LEN;

/// The gaps for a mean of `interval` bytes, [`GAP_TABLE_LEN`] of them, each at least 1.
pub fn gap_table(interval: u64) -> Vec<u64> {
    let n = f64::from(GAP_TABLE_LEN);
    let quantiles: Vec<f64> = (0..GAP_TABLE_LEN).map(|i| -(1.0 - (f64::from(i) + 0.5) / n).ln()).collect();
    // The quantiles' mean falls short of 1 by the tail they leave out: scaled up to the interval.
    let mean = quantiles.iter().sum::<f64>() / n;
    let scale = interval as f64 / mean;
    let mut gaps: Vec<u64> = quantiles.iter().map(|q| ((q * scale).round() as u64).max(1)).collect();
    // Rounding moved the sum by at most half a byte per entry: put it back on the largest gap.
    let target = interval * u64::from(GAP_TABLE_LEN);
    let sum: u64 = gaps.iter().sum();
    let last = gaps.last_mut().expect("the table is not empty");
    *last = (*last + target).saturating_sub(sum).max(1);
    gaps
}

/// The standard error of a sampled total (live or allocated bytes) whose blocks smaller than the
/// interval sum to `small_bytes`: each such block's weight has variance `interval × size`, and
/// blocks of the interval or more are exact.
pub fn standard_error(interval: u64, small_bytes: u64) -> f64 {
    (interval as f64 * small_bytes as f64).sqrt()
}

#[cfg(test)]
mod tests {
    use memscope_common::sampling::{weigh, GAP_TABLE_LEN};

    use super::*;

    /// The tests' random numbers (SplitMix64): the kernel's `bpf_get_prandom_u32` in the daemon.
    struct Random(u64);

    impl Random {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }

        /// Sizes spread evenly on a log scale from 64 B to 8 MiB, as a training job's are.
        fn size(&mut self) -> u64 {
            let bits = 6.0 + (self.next() % 1_000_000) as f64 / 1_000_000.0 * 17.0;
            bits.exp2() as u64
        }
    }

    #[test]
    fn the_table_is_exponential_with_the_intervals_mean() {
        let interval = 512 * 1024;
        let gaps = gap_table(interval);
        assert_eq!(gaps.len(), GAP_TABLE_LEN as usize);
        assert_eq!(gaps.iter().sum::<u64>(), interval * u64::from(GAP_TABLE_LEN), "mean exactly the interval");
        // An exponential's median is ln 2 of its mean, and 1/e of the draws exceed the mean.
        let mut sorted = gaps.clone();
        sorted.sort_unstable();
        let median = sorted[sorted.len() / 2] as f64 / interval as f64;
        assert!((median - std::f64::consts::LN_2).abs() < 0.01, "median {median}");
        let above = gaps.iter().filter(|&&g| g > interval).count() as f64 / gaps.len() as f64;
        assert!((above - (-1.0f64).exp()).abs() < 0.01, "share above the mean {above}");
        assert!(gap_table(1).iter().all(|&g| g >= 1));
    }

    /// One job's allocations and frees, adding to `recorded` the small ones recorded and the
    /// number expected to be; returns (live bytes by its ledger, live bytes estimated
    /// from the sampled blocks' weights, live bytes in blocks under the interval).
    fn one_job(seed: u64, interval: u64, gaps: &[u64], recorded: &mut (f64, f64)) -> (u64, f64, u64) {
        let mut rng = Random(seed);
        let mut countdown = 0;
        let mut live: Vec<(u64, u64)> = Vec::new();
        for _ in 0..20_000 {
            let size = rng.size();
            let weight =
                weigh(&mut countdown, size, interval, || gaps[(rng.next() % u64::from(GAP_TABLE_LEN)) as usize]);
            if size < interval {
                // Recorded when at least one point falls inside: 1 - exp(-size / interval).
                recorded.0 += f64::from(u8::from(weight > 0));
                recorded.1 += 1.0 - (-(size as f64) / interval as f64).exp();
            }
            live.push((size, weight));
            // About half of what was allocated is freed again, chosen at random.
            if rng.next().is_multiple_of(2) {
                let i = (rng.next() % live.len() as u64) as usize;
                live.swap_remove(i);
            }
        }
        let truth = live.iter().map(|(s, _)| s).sum();
        let estimate = live.iter().map(|(_, w)| *w as f64).sum();
        let small = live.iter().filter(|(s, _)| *s < interval).map(|(s, _)| s).sum();
        (truth, estimate, small)
    }

    #[test]
    fn sampled_live_bytes_are_within_the_stated_error_of_the_ledger_over_many_seeds() {
        let interval = 512 * 1024;
        let gaps = gap_table(interval);
        let seeds = 300;
        let mut z_sum = 0.0;
        let mut beyond_2 = 0;
        let mut recorded = (0.0, 0.0);
        for seed in 0..seeds {
            let (truth, estimate, small) = one_job(seed, interval, &gaps, &mut recorded);
            let z = (estimate - truth as f64) / standard_error(interval, small);
            assert!(z.abs() < 5.0, "seed {seed}: estimate {estimate} against {truth}, {z:.1} standard errors");
            z_sum += z;
            beyond_2 += usize::from(z.abs() > 2.0);
        }
        // Unbiased: the mean of 300 standard normals is within 0.3 of 0 but for 1 time in 10^7.
        let mean = z_sum / f64::from(seeds as u32);
        assert!(mean.abs() < 0.3, "mean error {mean:.2} standard errors: biased");
        // And the error is what the math says: 4.6 % of normal draws fall beyond 2 (at most 10 %
        // here but for 1 time in 10^5; an error larger than stated would put many more there).
        // (The seeds are fixed, so these bounds cannot flake; the odds say they are not tuned.)
        assert!(beyond_2 <= seeds as usize / 10, "{beyond_2} of {seeds} beyond 2 standard errors");
        assert!(beyond_2 >= 3, "only {beyond_2} of {seeds} beyond 2 standard errors: is anything sampled?");
        let (got, expected) = recorded;
        println!("{seeds} jobs: mean error {mean:.3} standard errors, {beyond_2} beyond 2; {got} small blocks recorded, {expected:.0} expected");
        assert!((got / expected - 1.0).abs() < 0.01, "{got} small blocks recorded, {expected:.0} expected");
    }

    #[test]
    fn large_blocks_are_exact_and_no_interval_records_everything() {
        let mut countdown = 0;
        let never = || unreachable!("no gap is drawn");
        assert_eq!(weigh(&mut countdown, 4 << 20, 512 * 1024, never), 4 << 20);
        assert_eq!(weigh(&mut countdown, 100, 0, never), 100);
        assert_eq!(countdown, 0, "neither touches the countdown");
    }

    #[test]
    fn one_allocation_counts_every_point_that_falls_inside_it() {
        let interval = 1000;
        // Gaps of 100: 950 bytes starting 30 before the next point hold points at 30, 130, ... 930.
        let mut countdown = 30;
        assert_eq!(weigh(&mut countdown, 950, interval, || 100), 10 * interval);
        assert_eq!(countdown, 80, "the next point is 80 bytes on");
        assert_eq!(weigh(&mut countdown, 79, interval, || 100), 0);
        assert_eq!(countdown, 1);
    }
}
