//! `report A B`: what grew from A to B, per device both runs have. Owners are matched by
//! (family, owner path) at the traces' ends and at the last step both reached; the page draws
//! both runs' per-step curves from their own [`super::StepEnd`]s and lists these differences.

use std::collections::BTreeMap;

use serde::Serialize;

use super::{DeviceReport, StepEnd};

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct OwnerDiff {
    pub family: String,
    pub owner: String,
    pub a: i64,
    pub b: i64,
    pub diff: i64,
}

/// One device of both runs.
#[derive(Clone, Debug, Serialize)]
pub struct Pair {
    pub device: String,
    /// Index of the device in each run's `devices`.
    pub a: usize,
    pub b: usize,
    /// The step compared (the last one both runs ended); `None` without common steps.
    pub step: Option<u64>,
    /// Owners at that step (else at the ends), B − A, most grown first; unchanged ones left out.
    pub owners: Vec<OwnerDiff>,
    /// Live bytes per family (HAL, PTA, HOST) at that instant, A and B.
    pub totals_a: [i64; 3],
    pub totals_b: [i64; 3],
}

/// Owner bytes at a step end, by (family, owner).
fn by_owner(d: &DeviceReport, end: &StepEnd) -> BTreeMap<(String, String), i64> {
    end.owners
        .iter()
        .map(|&(i, bytes)| {
            let (f, o) = &d.owners[i as usize];
            ((f.to_string(), o.clone()), bytes)
        })
        .collect()
}

/// The end of the trace as a step end: each curve's last instant.
fn trace_end(d: &DeviceReport) -> StepEnd {
    let mut end = StepEnd { step: 0, t: d.end, totals: [0; 3], owners: Vec::new() };
    for c in &d.curves {
        let f = ["HAL", "PTA", "HOST"].iter().position(|f| *f == c.family).unwrap_or(0);
        end.totals[f] = c.total.last().copied().unwrap_or(0);
        end.owners.extend(c.owners.last().cloned().unwrap_or_default());
    }
    end
}

/// Pairs the devices of A and B by name (two runs of one device each: those two, whatever
/// their names) and compares each pair.
pub fn pairs(a: &[DeviceReport], b: &[DeviceReport]) -> Vec<Pair> {
    let mut out = Vec::new();
    let single = a.len() == 1 && b.len() == 1;
    for (ia, da) in a.iter().enumerate() {
        let Some(ib) = b.iter().position(|db| single || db.device == da.device) else { continue };
        let db = &b[ib];
        let common = da.steps.iter().rev().find_map(|s| db.steps.iter().find(|t| t.step == s.step).map(|t| (s, t)));
        let (ea, eb) = match common {
            Some((sa, sb)) => (sa.clone(), sb.clone()),
            None => (trace_end(da), trace_end(db)),
        };
        let (oa, ob) = (by_owner(da, &ea), by_owner(db, &eb));
        let mut keys: Vec<&(String, String)> = oa.keys().chain(ob.keys()).collect();
        keys.sort();
        keys.dedup();
        let mut owners: Vec<OwnerDiff> = keys
            .into_iter()
            .map(|k| {
                let (va, vb) = (oa.get(k).copied().unwrap_or(0), ob.get(k).copied().unwrap_or(0));
                OwnerDiff { family: k.0.clone(), owner: k.1.clone(), a: va, b: vb, diff: vb - va }
            })
            .filter(|d| d.diff != 0)
            .collect();
        owners.sort_by_key(|d| (std::cmp::Reverse(d.diff), d.owner.clone()));
        out.push(Pair {
            device: da.device.clone(),
            a: ia,
            b: ib,
            step: common.map(|(s, _)| s.step),
            owners,
            totals_a: ea.totals,
            totals_b: eb.totals,
        });
    }
    out
}
