//! Degradation across steps: whether the live bytes at the step boundaries rise in a sustained
//! way, and which owners the rise belongs to.
//!
//! A training or serving loop returns to the same memory at every step boundary, so live bytes
//! that keep climbing there are a leak or a cache without a bound. The series is noisy (batch
//! shapes, tensors carried over one step, allocator rounding), so the test is a rank test, not a
//! fit: Mann–Kendall (is there a monotonic trend at all?) with the Theil–Sen slope (how much per
//! step?), both insensitive to outliers. A series is a **sustained rise** when all of:
//!
//! 1. it has at least [`MIN_POINTS`] boundaries after the warm-up;
//! 2. Mann–Kendall finds an increasing trend, one-sided p < [`ALPHA`];
//! 3. the Theil–Sen rise over the window (slope × steps) exceeds the noise floor: three robust
//!    standard deviations of the residuals around the Theil–Sen line (1.4826 × MAD), and at least
//!    [`MIN_RISE_BYTES`] (a few hundred bytes over many steps is rounding, not a leak);
//! 4. it is still a rise once its largest single increase is taken out. A one-time jump (an
//!    optimizer state created at step 3, a cache sized once) followed by a flat series passes 2
//!    and often 3, since a rank test only sees that later values are higher; removing that jump
//!    leaves a flat series and the verdict `single_jump`.
//!
//! Attribution: each owner's live bytes at the first and the last boundary of the window, and
//! the difference; the owners that grew most are what the rise is made of.

use serde::Serialize;

use super::decompose::Family;
use super::steps::StepPoint;

/// Fewest boundaries after the warm-up for a verdict (K): with 5 strictly rising values
/// Mann–Kendall's one-sided p is 0.014, with 4 it cannot go below 0.04.
pub const MIN_POINTS: usize = 5;
/// One-sided significance of the Mann–Kendall test.
pub const ALPHA: f64 = 0.05;
/// The smallest total rise reported, whatever the noise.
pub const MIN_RISE_BYTES: f64 = (1 << 20) as f64;
/// Longer series are sampled evenly down to this many boundaries: the tests are O(n²) and a
/// trend over 2000 points is not lost by skipping some.
const MAX_POINTS: usize = 2000;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    TooFewSteps,
    NoTrend,
    BelowNoise,
    SingleJump,
    SustainedRise,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::TooFewSteps => "too_few_steps",
            Self::NoTrend => "no_trend",
            Self::BelowNoise => "below_noise",
            Self::SingleJump => "single_jump",
            Self::SustainedRise => "sustained_rise",
        }
    }
}

/// The statistics of one series.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Trend {
    /// Boundaries tested.
    pub points: usize,
    /// Mann–Kendall's S (concordant minus discordant pairs), its z and one-sided p.
    pub mk_s: i64,
    pub mk_z: f64,
    pub p_value: f64,
    /// Theil–Sen slope, bytes per step.
    pub slope: f64,
    /// slope × the steps the window spans.
    pub rise: f64,
    /// What the rise had to exceed.
    pub noise_floor: f64,
    pub verdict: Verdict,
}

struct Stats {
    s: i64,
    z: f64,
    p: f64,
    slope: f64,
    rise: f64,
    floor: f64,
}

impl Stats {
    fn rising(&self) -> bool {
        self.s > 0 && self.p < ALPHA
    }
}

/// The complementary error function (Numerical Recipes' `erfcc`; relative error < 1.2e-7).
fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98 + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let r = t * poly.exp();
    if x >= 0.0 {
        r
    } else {
        2.0 - r
    }
}

fn median(values: &mut [f64]) -> f64 {
    let n = values.len();
    if n == 0 {
        return 0.0;
    }
    let cmp = |a: &f64, b: &f64| a.total_cmp(b);
    let (_, &mut hi, _) = values.select_nth_unstable_by(n / 2, cmp);
    if n % 2 == 1 {
        return hi;
    }
    let lo = values[..n / 2].iter().copied().max_by(cmp).unwrap_or(hi);
    (lo + hi) / 2.0
}

/// Mann–Kendall with the tie correction, and the Theil–Sen line, of (step, bytes) points.
fn stats(t: &[f64], x: &[f64]) -> Stats {
    let n = x.len();
    let mut s: i64 = 0;
    let mut slopes = Vec::with_capacity(n * n.saturating_sub(1) / 2);
    for i in 0..n {
        for j in i + 1..n {
            let d = x[j] - x[i];
            s += (d > 0.0) as i64 - (d < 0.0) as i64;
            if t[j] != t[i] {
                slopes.push(d / (t[j] - t[i]));
            }
        }
    }
    let mut sorted = x.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mut ties = 0.0;
    let mut i = 0;
    while i < n {
        let j = sorted[i..].iter().position(|v| *v != sorted[i]).map_or(n, |k| i + k);
        let g = (j - i) as f64;
        ties += g * (g - 1.0) * (2.0 * g + 5.0);
        i = j;
    }
    let nf = n as f64;
    let var = (nf * (nf - 1.0) * (2.0 * nf + 5.0) - ties) / 18.0;
    let z = if var <= 0.0 {
        0.0
    } else if s > 0 {
        (s - 1) as f64 / var.sqrt()
    } else if s < 0 {
        (s + 1) as f64 / var.sqrt()
    } else {
        0.0
    };
    let p = 0.5 * erfc(z / std::f64::consts::SQRT_2);
    let slope = median(&mut slopes);
    let mut offsets: Vec<f64> = t.iter().zip(x).map(|(t, x)| x - slope * t).collect();
    let intercept = median(&mut offsets);
    let mut residuals: Vec<f64> = t.iter().zip(x).map(|(t, x)| (x - intercept - slope * t).abs()).collect();
    let noise = 1.4826 * median(&mut residuals);
    let span = t.last().zip(t.first()).map_or(0.0, |(l, f)| l - f);
    Stats { s, z, p, slope, rise: slope * span, floor: (3.0 * noise).max(MIN_RISE_BYTES) }
}

/// Tests a series of (step, live bytes) in step order.
pub fn trend(series: &[(u64, i64)]) -> Trend {
    let sampled: Vec<(u64, i64)> = if series.len() > MAX_POINTS {
        (0..MAX_POINTS).map(|i| series[i * (series.len() - 1) / (MAX_POINTS - 1)]).collect()
    } else {
        series.to_vec()
    };
    let t: Vec<f64> = sampled.iter().map(|p| p.0 as f64).collect();
    let x: Vec<f64> = sampled.iter().map(|p| p.1 as f64).collect();
    let st = stats(&t, &x);
    let verdict = if x.len() < MIN_POINTS {
        Verdict::TooFewSteps
    } else if !st.rising() {
        Verdict::NoTrend
    } else if st.rise <= st.floor {
        Verdict::BelowNoise
    } else {
        // Take out the largest single increase and test again.
        let (k, jump) = x.windows(2).map(|w| w[1] - w[0]).enumerate().max_by(|a, b| a.1.total_cmp(&b.1)).unwrap();
        let flattened: Vec<f64> = x.iter().enumerate().map(|(i, v)| if i > k { v - jump } else { *v }).collect();
        let again = stats(&t, &flattened);
        if again.rising() && again.rise > again.floor {
            Verdict::SustainedRise
        } else {
            Verdict::SingleJump
        }
    };
    Trend {
        points: x.len(),
        mk_s: st.s,
        mk_z: st.z,
        p_value: st.p,
        slope: st.slope,
        rise: st.rise,
        noise_floor: st.floor,
        verdict,
    }
}

/// One owner's change over the window.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct OwnerDelta {
    pub owner: String,
    pub first_bytes: i64,
    pub last_bytes: i64,
    pub delta: i64,
}

/// One family's verdict and attribution.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FamilyTrend {
    pub family: &'static str,
    pub first_step: Option<u64>,
    pub last_step: Option<u64>,
    pub first_bytes: i64,
    pub last_bytes: i64,
    #[serde(flatten)]
    pub trend: Trend,
    /// Owners whose live bytes changed between the first and the last boundary, most grown first.
    pub owners: Vec<OwnerDelta>,
}

/// The degradation of every family in `families`, over the boundaries that ended a step after
/// the warm-up (`step >= warmup`: the end of the warm-up is the baseline). `owner` names a slot.
pub fn analyse<'a>(
    points: &[StepPoint],
    families: &[Family],
    warmup: u64,
    owner: impl Fn(u32) -> (Family, &'a str),
) -> Vec<FamilyTrend> {
    let window: Vec<&StepPoint> = points.iter().filter(|p| p.step.is_some_and(|s| s >= warmup)).collect();
    families
        .iter()
        .map(|&family| {
            let series: Vec<(u64, i64)> = window.iter().map(|p| (p.step.unwrap_or(0), p.total(family))).collect();
            let (first, last) = (window.first(), window.last());
            let mut owners = Vec::new();
            if let (Some(first), Some(last)) = (first, last) {
                let mut by_owner: std::collections::BTreeMap<&str, (i64, i64)> = Default::default();
                for (i, point) in [first, last].into_iter().enumerate() {
                    for o in &point.owners {
                        let (f, name) = owner(o.slot);
                        if f == family {
                            let e = by_owner.entry(name).or_default();
                            if i == 0 {
                                e.0 += o.bytes;
                            } else {
                                e.1 += o.bytes;
                            }
                        }
                    }
                }
                owners = by_owner
                    .into_iter()
                    .filter(|(_, (a, b))| a != b)
                    .map(|(o, (a, b))| OwnerDelta { owner: o.to_owned(), first_bytes: a, last_bytes: b, delta: b - a })
                    .collect();
                owners.sort_by(|a, b| b.delta.cmp(&a.delta).then_with(|| a.owner.cmp(&b.owner)));
            }
            FamilyTrend {
                family: family.as_str(),
                first_step: first.and_then(|p| p.step),
                last_step: last.and_then(|p| p.step),
                first_bytes: first.map_or(0, |p| p.total(family)),
                last_bytes: last.map_or(0, |p| p.total(family)),
                trend: trend(&series),
                owners,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::steps::OwnerBytes;

    const MIB: i64 = 1 << 20;

    /// Deterministic noise in [-amp, amp] (a fixed LCG: the tests must not depend on luck).
    fn noise(seed: &mut u64, amp: i64) -> i64 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 33) as i64 % (2 * amp + 1)) - amp
    }

    fn series(n: u64, f: impl Fn(u64) -> i64) -> Vec<(u64, i64)> {
        (1..=n).map(|s| (s, f(s))).collect()
    }

    #[test]
    fn a_noisy_rise_is_sustained() {
        let mut seed = 7;
        let values: Vec<i64> = (0..20).map(|_| noise(&mut seed, 3 * MIB)).collect();
        // 2 MiB a step under ±3 MiB of noise.
        let t = trend(&series(20, |s| 500 * MIB + 2 * MIB * s as i64 + values[s as usize - 1]));
        assert_eq!(t.verdict, Verdict::SustainedRise, "{t:?}");
        assert!(t.p_value < 0.001 && (t.slope - 2.0 * MIB as f64).abs() < 0.5 * MIB as f64, "{t:?}");
        // A clean ramp: no noise at all still has a floor.
        assert_eq!(trend(&series(6, |s| 4 * MIB * s as i64)).verdict, Verdict::SustainedRise);
    }

    #[test]
    fn a_noisy_flat_series_is_not() {
        for mut seed in [1u64, 2, 3, 4, 5, 6, 7, 8] {
            let values: Vec<i64> = (0..30).map(|_| noise(&mut seed, 3 * MIB)).collect();
            let t = trend(&series(30, |s| 500 * MIB + values[s as usize - 1]));
            assert_ne!(t.verdict, Verdict::SustainedRise, "seed {seed}: {t:?}");
        }
    }

    #[test]
    fn a_single_jump_then_flat_is_not() {
        for at in [3u64, 6, 10, 14] {
            let mut seed = at;
            let values: Vec<i64> = (0..16).map(|_| noise(&mut seed, MIB / 4)).collect();
            let t = trend(&series(16, |s| 100 * MIB + if s >= at { 64 * MIB } else { 0 } + values[s as usize - 1]));
            assert!(
                matches!(t.verdict, Verdict::SingleJump | Verdict::NoTrend | Verdict::BelowNoise),
                "jump at {at}: {t:?}"
            );
        }
        // The same jump without noise: a rank test alone would call it significant.
        let t = trend(&series(10, |s| if s > 5 { 200 * MIB } else { 100 * MIB }));
        assert!(t.p_value < ALPHA && t.verdict == Verdict::SingleJump, "{t:?}");
    }

    #[test]
    fn small_or_short_rises_are_not_flagged() {
        assert_eq!(trend(&series(4, |s| 10 * MIB * s as i64)).verdict, Verdict::TooFewSteps);
        // 512 B a step for 40 steps: a trend, but 20 KiB is not worth a report.
        assert_eq!(trend(&series(40, |s| 512 * s as i64)).verdict, Verdict::BelowNoise);
        assert_eq!(trend(&series(10, |s| 100 * MIB - MIB * s as i64)).verdict, Verdict::NoTrend);
    }

    #[test]
    fn statistics_match_hand_computed_values() {
        // 1..5 strictly rising: S = 10, var = 5*4*15/18, z = 9/sqrt(16.67) = 2.205, p = 0.0137.
        let t = trend(&series(5, |s| s as i64 * MIB));
        assert_eq!(t.mk_s, 10);
        assert!((t.mk_z - 2.2045).abs() < 1e-3 && (t.p_value - 0.01374).abs() < 1e-4, "{t:?}");
        assert!((erfc(0.0) - 1.0).abs() < 1e-7 && (erfc(1.0) - 0.157_299_2).abs() < 1e-6);
        let mut v = [4.0, 1.0, 3.0, 2.0];
        assert_eq!(median(&mut v), 2.5);
    }

    #[test]
    fn long_series_are_sampled() {
        let t = trend(&series(10_000, |s| s as i64 * 1024));
        assert_eq!((t.points, t.verdict), (MAX_POINTS, Verdict::SustainedRise));
    }

    #[test]
    fn the_rise_is_attributed_to_the_owners_that_grew() {
        let names = [
            (Family::Pta, "PTA@weight"),
            (Family::Pta, "PTA@kv_cache"),
            (Family::Pta, "PTA@act"),
            (Family::Hal, "CANN@APP"),
        ];
        let point = |step: u64, kv: i64, act: i64| StepPoint {
            step: Some(step),
            ts: step as i64,
            totals: [40 * MIB, 100 * MIB + kv + act, 0],
            owners: vec![
                OwnerBytes { slot: 0, bytes: 100 * MIB, blocks: 1 },
                OwnerBytes { slot: 1, bytes: kv, blocks: 1 },
                OwnerBytes { slot: 2, bytes: act, blocks: 1 },
                OwnerBytes { slot: 3, bytes: 40 * MIB, blocks: 1 },
            ],
        };
        let acts = [3, 1, 2, 3, 1, 2, 2, 3, 1];
        let points: Vec<StepPoint> = (0..9u64).map(|i| point(i, 2 * MIB * i as i64, acts[i as usize] * MIB)).collect();
        let trends = analyse(&points, &[Family::Hal, Family::Pta], 1, |slot| names[slot as usize]);
        assert_eq!(trends[0].trend.verdict, Verdict::NoTrend, "a flat HAL series");
        let pta = &trends[1];
        assert_eq!(pta.trend.verdict, Verdict::SustainedRise, "{pta:?}");
        assert_eq!((pta.first_step, pta.last_step), (Some(1), Some(8)));
        assert_eq!(
            pta.owners[0],
            OwnerDelta { owner: "PTA@kv_cache".into(), first_bytes: 2 * MIB, last_bytes: 16 * MIB, delta: 14 * MIB }
        );
        assert!(pta.owners.iter().all(|o| o.owner != "PTA@weight"), "unchanged owners are left out");
    }
}
