//! Two runs of one program, owner by owner: the live bytes per family and per (family, owner)
//! at instants both runs reached, B − A, and where "what grew" is judged: at the last step both
//! ended, else at their ends (a trace's end includes its teardown, so a common step is the fairer
//! instant). `compare` prints every common step this way; `report A B` draws the judged instant.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use super::blocks::Family;
use super::steps::{StepPoint, Timeline};

/// Live bytes at one instant, per family and per (family, owner).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Point {
    pub ts: i64,
    /// Indexed by `Family as usize`.
    pub totals: [i64; 3],
    pub owners: BTreeMap<(Family, String), i64>,
}

impl Point {
    /// A step replay's point, its owners named.
    pub fn of(p: &StepPoint, timeline: &Timeline) -> Self {
        let owners = p
            .owners
            .iter()
            .map(|o| {
                let (family, owner) = timeline.owner(o.slot);
                ((family, owner.to_owned()), o.bytes)
            })
            .collect();
        Self { ts: p.ts, totals: p.totals, owners }
    }
}

/// One run's instants: its step ends by step number, and its end.
#[derive(Clone, Debug, Default)]
pub struct Side {
    pub steps: BTreeMap<u64, Point>,
    pub end: Option<Point>,
}

impl Side {
    /// Every step end and the end of a replayed trace.
    pub fn of(timeline: &Timeline) -> Self {
        let steps = timeline.points.iter().filter_map(|p| Some((p.step?, Point::of(p, timeline)))).collect();
        Self { steps, end: timeline.end_point().map(|p| Point::of(&p, timeline)) }
    }
}

/// Where two runs are set side by side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum At {
    /// The end of a step both runs ended.
    Step(u64),
    /// The ends of the traces.
    End,
}

/// One owner at one instant of both runs.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct OwnerDiff {
    #[serde(serialize_with = "family_name")]
    pub family: Family,
    pub owner: String,
    pub a: i64,
    pub b: i64,
    pub diff: i64,
}

fn family_name<S: serde::Serializer>(f: &Family, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(f.as_str())
}

/// The steps both runs ended, in order.
pub fn common_steps(a: &Side, b: &Side) -> Vec<u64> {
    a.steps.keys().filter(|s| b.steps.contains_key(s)).copied().collect()
}

/// Where what grew is judged: the last step both ended, else their ends; `None` when neither
/// (a run without a memory row).
pub fn judged_at(a: &Side, b: &Side) -> Option<At> {
    match common_steps(a, b).last() {
        Some(&step) => Some(At::Step(step)),
        None if a.end.is_some() && b.end.is_some() => Some(At::End),
        None => None,
    }
}

impl Side {
    /// The run's point at `at`, if it reached it.
    pub fn at(&self, at: At) -> Option<&Point> {
        match at {
            At::Step(step) => self.steps.get(&step),
            At::End => self.end.as_ref(),
        }
    }
}

/// Every owner either point has, in (family, owner) order, with its bytes in A and in B (0
/// where it had none) and B − A.
pub fn owner_diffs(a: &Point, b: &Point) -> Vec<OwnerDiff> {
    let keys: BTreeSet<&(Family, String)> = a.owners.keys().chain(b.owners.keys()).collect();
    keys.into_iter()
        .map(|k| {
            let (x, y) = (a.owners.get(k).copied().unwrap_or(0), b.owners.get(k).copied().unwrap_or(0));
            OwnerDiff { family: k.0, owner: k.1.clone(), a: x, b: y, diff: y - x }
        })
        .collect()
}

/// The owners that changed, most grown first and most shrunk last (ties by owner).
pub fn changed(diffs: Vec<OwnerDiff>) -> Vec<OwnerDiff> {
    let mut changed: Vec<OwnerDiff> = diffs.into_iter().filter(|d| d.diff != 0).collect();
    changed.sort_by(|x, y| y.diff.cmp(&x.diff).then_with(|| x.owner.cmp(&y.owner)));
    changed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(ts: i64, owners: &[(Family, &str, i64)]) -> Point {
        let mut p = Point { ts, ..Point::default() };
        for &(f, o, bytes) in owners {
            p.totals[f as usize] += bytes;
            p.owners.insert((f, o.to_owned()), bytes);
        }
        p
    }

    #[test]
    fn growth_is_judged_at_the_last_common_step_else_at_the_ends() {
        let mut a = Side::default();
        let mut b = Side::default();
        assert_eq!(judged_at(&a, &b), None);
        a.end = Some(point(9, &[]));
        b.end = Some(point(9, &[]));
        assert_eq!(judged_at(&a, &b), Some(At::End));
        for s in [1, 2, 3] {
            a.steps.insert(s, point(s as i64, &[]));
        }
        b.steps.insert(2, point(2, &[]));
        b.steps.insert(4, point(4, &[]));
        assert_eq!(common_steps(&a, &b), [2]);
        assert_eq!(judged_at(&a, &b), Some(At::Step(2)));
    }

    #[test]
    fn owners_of_either_side_are_diffed_and_the_changed_ones_ordered_by_change() {
        let a = point(1, &[(Family::Pta, "PTA@kv", 100), (Family::Pta, "PTA@w", 50), (Family::Hal, "HAL@x", 7)]);
        let b = point(1, &[(Family::Pta, "PTA@kv", 400), (Family::Pta, "PTA@w", 10), (Family::Host, "HOST@y", 5)]);
        let all = owner_diffs(&a, &b);
        let named: Vec<(&str, i64, i64, i64)> = all.iter().map(|d| (d.owner.as_str(), d.a, d.b, d.diff)).collect();
        assert_eq!(
            named,
            [("HAL@x", 7, 0, -7), ("PTA@kv", 100, 400, 300), ("PTA@w", 50, 10, -40), ("HOST@y", 0, 5, 5)],
            "family order, then owner; a missing side is 0"
        );
        let order: Vec<i64> = changed(all).iter().map(|d| d.diff).collect();
        assert_eq!(order, [300, 5, -7, -40]);
        let json = serde_json::to_string(&owner_diffs(&a, &a)[0]).unwrap();
        assert!(json.contains(r#""family":"HAL""#), "{json}");
    }
}
