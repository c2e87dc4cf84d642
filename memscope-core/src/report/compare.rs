//! `report A B`: what grew from A to B, per device both runs have. Owners are matched by
//! (family, owner path) at the traces' ends and at the last step both reached; the page draws
//! both runs' per-step curves from their own [`super::StepEnd`]s and lists these differences.

use serde::Serialize;

use super::{DeviceReport, StepEnd};
use crate::analysis::blocks::Family;
use crate::analysis::compare::{self, At, OwnerDiff, Point, Side};

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

/// A step end of the page's as the comparison's point, owners by name.
fn point(d: &DeviceReport, end: &StepEnd) -> Point {
    let owners = end
        .owners
        .iter()
        .filter_map(|&(i, bytes)| {
            let (family, owner) = &d.owners[i as usize];
            let family = Family::ALL.into_iter().find(|f| f.as_str() == *family)?;
            Some(((family, owner.clone()), bytes))
        })
        .collect();
    Point { ts: end.t, totals: end.totals, owners }
}

/// The end of the trace as a point: each curve's last instant.
fn trace_end(d: &DeviceReport) -> Point {
    let mut end = StepEnd { step: 0, t: d.end, totals: [0; 3], owners: Vec::new() };
    for c in &d.curves {
        let f = ["HAL", "PTA", "HOST"].iter().position(|f| *f == c.family).unwrap_or(0);
        end.totals[f] = c.total.last().copied().unwrap_or(0);
        end.owners.extend(c.owners.last().cloned().unwrap_or_default());
    }
    point(d, &end)
}

/// The page's instants of one device as the comparison's side.
fn side(d: &DeviceReport) -> Side {
    Side { steps: d.steps.iter().map(|s| (s.step, point(d, s))).collect(), end: Some(trace_end(d)) }
}

/// Pairs the devices of A and B by name (two runs of one device each: those two, whatever
/// their names) and compares each pair where [`compare::judged_at`] says.
pub fn pairs(a: &[DeviceReport], b: &[DeviceReport]) -> Vec<Pair> {
    let mut out = Vec::new();
    let single = a.len() == 1 && b.len() == 1;
    for (ia, da) in a.iter().enumerate() {
        let Some(ib) = b.iter().position(|db| single || db.device == da.device) else { continue };
        let (sa, sb) = (side(da), side(&b[ib]));
        let Some(at) = compare::judged_at(&sa, &sb) else { continue };
        let (Some(pa), Some(pb)) = (sa.at(at), sb.at(at)) else { continue };
        out.push(Pair {
            device: da.device.clone(),
            a: ia,
            b: ib,
            step: match at {
                At::Step(step) => Some(step),
                At::End => None,
            },
            owners: compare::changed(compare::owner_diffs(pa, pb)),
            totals_a: pa.totals,
            totals_b: pb.totals,
        });
    }
    out
}
