//! Memory over time, cut down to what a page can draw: a 10 M-row trace changes its live bytes
//! millions of times, a chart is a thousand pixels wide. The trace's time is cut into `buckets`
//! equal intervals and each keeps its highest and its lowest instant (every peak and every
//! trough survives, so the chart's envelope is exact); an instant kept has the live bytes of
//! every owner of its family then, so the stack of owners and the tree drawn at it add up to the
//! family's total exactly. Traces with no more instants than twice the buckets keep them all.
//!
//! An instant is the state after every change at its timestamp (as `decompose --at` has it).

use serde::Serialize;

use crate::analysis::decompose::{Family, Timeline};

/// One family's curve.
#[derive(Clone, Debug, Serialize)]
pub struct Curve {
    pub family: &'static str,
    /// Instants, ns after the report's origin.
    pub t: Vec<i64>,
    /// The family's live bytes at each instant.
    pub total: Vec<i64>,
    /// At each instant, the owners with live bytes: (owner index, bytes).
    pub owners: Vec<Vec<(u32, i64)>>,
    /// Distinct instants the trace has for the family (more than `t.len()` when summarised).
    pub instants: usize,
    /// The highest live bytes and the first instant of it (ns after the origin).
    pub peak: i64,
    pub peak_t: i64,
}

/// A curve's bucket: its lowest and highest instants so far, (bytes, ts).
#[derive(Clone, Copy)]
struct Extremes {
    low: (i64, i64),
    high: (i64, i64),
}

/// The curves of every family with blocks, `origin` the report's time zero, the trace spanning
/// `start..=end` (absolute ns).
pub fn curves(timeline: &Timeline, origin: i64, (start, end): (i64, i64), buckets: usize) -> Vec<Curve> {
    let buckets = buckets.max(1);
    let span = (end - start).max(1) as i128 + 1;
    let bucket = |ts: i64| (((ts - start).max(0) as i128 * buckets as i128 / span) as usize).min(buckets - 1);
    let mut count = [0usize; 3];
    let mut extremes: [Vec<Option<Extremes>>; 3] = std::array::from_fn(|_| vec![None; buckets]);
    timeline.instants(|ts, totals, _| {
        for f in 0..3 {
            count[f] += 1;
            let e = extremes[f][bucket(ts)].get_or_insert(Extremes { low: (totals[f], ts), high: (totals[f], ts) });
            if totals[f] < e.low.0 {
                e.low = (totals[f], ts);
            }
            if totals[f] > e.high.0 {
                e.high = (totals[f], ts);
            }
        }
    });
    let families: Vec<Family> =
        Family::ALL.into_iter().filter(|f| timeline.owners.iter().any(|(of, _)| of == f)).collect();
    // The instants each family keeps, in time order.
    let kept: Vec<Vec<i64>> = families
        .iter()
        .map(|&f| {
            let mut ts: Vec<i64> = extremes[f as usize].iter().flatten().flat_map(|e| [e.low.1, e.high.1]).collect();
            ts.sort_unstable();
            ts.dedup();
            ts
        })
        .collect();
    let all = |f: Family| count[f as usize] <= 2 * buckets;
    let mut out: Vec<Curve> = families
        .iter()
        .map(|&f| Curve {
            family: f.as_str(),
            t: Vec::new(),
            total: Vec::new(),
            owners: Vec::new(),
            instants: count[f as usize],
            peak: 0,
            peak_t: 0,
        })
        .collect();
    let mut next = vec![0usize; families.len()];
    timeline.instants(|ts, totals, bytes| {
        for (k, &f) in families.iter().enumerate() {
            let keep = if all(f) {
                true
            } else if kept[k].get(next[k]) == Some(&ts) {
                next[k] += 1;
                true
            } else {
                false
            };
            if keep {
                let c = &mut out[k];
                c.t.push(ts - origin);
                c.total.push(totals[f as usize]);
                c.owners.push(
                    (0..bytes.len())
                        .filter(|&i| timeline.owners[i].0 == f && bytes[i] != 0)
                        .map(|i| (i as u32, bytes[i]))
                        .collect(),
                );
            }
        }
    });
    for c in &mut out {
        if let Some((i, _)) = c.total.iter().enumerate().fold(None, |best: Option<(usize, i64)>, (i, &v)| match best {
            Some((_, b)) if b >= v => best,
            _ => Some((i, v)),
        }) {
            c.peak = c.total[i];
            c.peak_t = c.t[i];
        }
    }
    out
}

/// A stepped series (a pool's reserved bytes) cut down the same way: per bucket its lowest and
/// highest values, `points` being (ts, value) in time order, the value holding until the next.
pub fn thin(points: &[(i64, i64)], origin: i64, (start, end): (i64, i64), buckets: usize) -> Vec<(i64, i64)> {
    if points.len() <= 2 * buckets {
        return points.iter().map(|&(t, v)| (t - origin, v)).collect();
    }
    let span = (end - start).max(1) as i128 + 1;
    let bucket = |ts: i64| (((ts - start).max(0) as i128 * buckets as i128 / span) as usize).min(buckets - 1);
    let mut out: Vec<(i64, i64)> = Vec::new();
    let mut i = 0;
    while i < points.len() {
        let b = bucket(points[i].0);
        let (mut low, mut high) = (points[i], points[i]);
        while i < points.len() && bucket(points[i].0) == b {
            if points[i].1 < low.1 {
                low = points[i];
            }
            if points[i].1 > high.1 {
                high = points[i];
            }
            i += 1;
        }
        let (a, z) = if low.0 <= high.0 { (low, high) } else { (high, low) };
        out.push((a.0 - origin, a.1));
        if z != a {
            out.push((z.0 - origin, z.1));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timeline(changes: Vec<(i64, u32, i64)>) -> Timeline {
        let owners = vec![(Family::Pta, "PTA@a".to_owned()), (Family::Pta, "PTA@b".to_owned())];
        Timeline { owners, changes }
    }

    #[test]
    fn few_instants_are_all_kept_and_owners_add_up_to_the_total() {
        let t = timeline(vec![(10, 0, 100), (10, 1, 50), (20, 1, -50), (30, 0, -100)]);
        let c = &curves(&t, 10, (10, 30), 100)[0];
        assert_eq!(c.t, [0, 10, 20]);
        assert_eq!(c.total, [150, 100, 0]);
        assert_eq!(c.owners[0], [(0, 100), (1, 50)]);
        assert_eq!(c.owners[2], []);
        assert_eq!((c.peak, c.peak_t), (150, 0));
    }

    #[test]
    fn many_instants_keep_each_buckets_highest_and_lowest_and_the_peak_exactly() {
        // A saw-tooth with one spike: 1000 instants into 10 buckets.
        let mut changes = Vec::new();
        let mut live = 0i64;
        for ts in 0..1000i64 {
            let want = if ts == 637 { 10_000 } else { (ts % 7) * 10 };
            changes.push((ts, (ts % 2) as u32, want - live));
            live = want;
        }
        let c = &curves(&timeline(changes), 0, (0, 999), 10)[0];
        assert!(c.t.len() <= 20, "{}", c.t.len());
        assert_eq!(c.instants, 1000);
        assert_eq!((c.peak, c.peak_t), (10_000, 637));
        for (i, owners) in c.owners.iter().enumerate() {
            assert_eq!(owners.iter().map(|o| o.1).sum::<i64>(), c.total[i]);
        }
        assert!(c.total.contains(&0) && c.total.contains(&60));
    }

    #[test]
    fn a_thinned_series_keeps_its_extremes_in_time_order() {
        let points: Vec<(i64, i64)> = (0..100).map(|i| (i, if i == 42 { 999 } else { i % 5 })).collect();
        let out = thin(&points, 0, (0, 99), 4);
        assert!(out.len() <= 8);
        assert!(out.contains(&(42, 999)));
        assert!(out.windows(2).all(|w| w[0].0 < w[1].0));
    }
}
