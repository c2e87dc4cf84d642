//! A distributed job's ranks side by side: per rank its peak and the owners then, its growth
//! per step, its live bytes at each step's end (the rank × step view), and the ranks that stand
//! out, with why: a peak above the others' by which owners, or an owner that grew at every step
//! on that rank only (a leak there).
//!
//! Ranks of one launch are expected to look alike (data parallelism) or to differ by stage, so a
//! rank is judged against the median of the *other* ranks of its job: with four ranks of which
//! one leaks, the other three set the norm, and with two ranks the higher one is the outlier.
//! Thresholds are ratios with a floor in bytes, so that a few kilobytes of noise on a small job
//! name no one. Jobs are told apart by the `job_id` each trace recorded (`cluster::identity`);
//! traces without one are one job.
//!
//! `compare` builds each rank's [`Profile`] with [`profile`]; `report` from the replays its page
//! already made ([`Profile::of`]). Both judge with [`compare_ranks`].

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use super::blocks::Family;
use super::compare::{Point, Side};
use super::db::DumpDb;
use super::decompose;
use super::pass;
use super::steps::{self, StepDb, StepError};
use crate::cluster::identity::Identity;

/// A peak is an outlier above this multiple of the other ranks' median peak...
pub const PEAK_RATIO: f64 = 1.10;
/// ...and at least this many bytes above it.
pub const MIN_EXCESS: i64 = 1 << 20;
/// An owner's growth over the compared steps is a leak from this many bytes on...
pub const MIN_LEAK: i64 = 1 << 20;
/// ...when the other ranks' median growth of that owner is at most this share of it.
const LEAK_SHARE: i64 = 4;
/// An owner explains a higher peak when it holds at least 1/this of the excess above the others'.
const EXCESS_SHARE: i64 = 20;
/// Owners listed per rank at its peak, and per reason.
const OWNERS_SHOWN: usize = 5;

/// One rank's memory: its step ends, its end, and the peak of each family.
#[derive(Clone, Debug, Default)]
pub struct Profile {
    pub side: Side,
    /// Indexed by `Family as usize`: the first instant of the family's highest live bytes, with
    /// every owner's bytes (all families) then.
    pub peaks: [Option<Point>; 3],
}

impl Profile {
    /// From a step replay and the decomposition's changes of the same DB.
    pub fn of(changes: &decompose::Timeline, steps: &steps::Timeline) -> Self {
        let mut peaks: [Option<Point>; 3] = Default::default();
        for family in Family::ALL {
            if changes.owners.iter().any(|(f, _)| *f == family) {
                peaks[family as usize] = peak(changes, family);
            }
        }
        Self { side: Side::of(steps), peaks }
    }

    fn families(&self) -> impl Iterator<Item = Family> + '_ {
        Family::ALL.into_iter().filter(|f| self.peaks[*f as usize].is_some())
    }
}

/// The first instant of `family`'s highest live bytes. Two replays of the changes: keeping every
/// owner at each new high would cost owners × instants on a trace that only grows.
fn peak(changes: &decompose::Timeline, family: Family) -> Option<Point> {
    let mut best: Option<(i64, i64)> = None;
    changes.instants(|ts, totals, _| {
        let bytes = totals[family as usize];
        if best.is_none_or(|(high, _)| bytes > high) {
            best = Some((bytes, ts));
        }
    });
    let (_, at) = best?;
    let mut point = None;
    changes.instants(|ts, totals, bytes| {
        if ts == at {
            let owners = bytes
                .iter()
                .enumerate()
                .filter(|(_, b)| **b != 0)
                .map(|(i, b)| (changes.owners[i].clone(), *b))
                .collect();
            point = Some(Point { ts, totals: *totals, owners });
        }
    });
    point
}

/// One DB's profile, in one pass over its rows.
pub fn profile(db: &DumpDb, step_marker: Option<&str>) -> Result<Profile, StepError> {
    let step_db = StepDb::new(db)?;
    let mut changes = decompose::TimelineReplay::default();
    let mut steps = steps::Replay::new(&step_db, step_marker, ())?;
    pass::run(db, &mut [&mut changes, &mut steps])?;
    let (timeline, ()) = steps.finish(&step_db)?;
    Ok(Profile::of(&changes.finish(), &timeline))
}

/// The rank and job a trace recorded in its `ms_meta` (none for msMemScope's captures).
pub fn identity_of(db: &DumpDb) -> Result<Identity, crate::analysis::AnalysisError> {
    let mut failed = None;
    let identity = Identity::from_meta(|key| {
        db.meta(key).unwrap_or_else(|e| {
            failed.get_or_insert(e);
            None
        })
    });
    failed.map_or(Ok(identity), Err)
}

/// One trace of one device: a rank.
#[derive(Clone, Debug)]
pub struct Member {
    /// What the views call it (its DB's path).
    pub label: String,
    pub device: String,
    pub identity: Identity,
    pub profile: Profile,
}

/// Every job of the members, each with its ranks compared.
#[derive(Clone, Debug, Serialize)]
pub struct Comparison {
    pub jobs: Vec<JobView>,
}

#[derive(Clone, Debug, Serialize)]
pub struct JobView {
    /// The launch's `job_id`; `None` for traces that recorded none.
    pub job: Option<String>,
    pub world_size: Option<u32>,
    /// Ranks below the world size that no trace given holds.
    pub missing: Vec<u32>,
    /// The family whose live bytes are compared: HAL where any rank has HAL blocks, else PTA,
    /// else HOST.
    pub family: Option<&'static str>,
    /// Every step any rank ended: the rank × step view's columns.
    pub steps: Vec<u64>,
    /// The first and last step every rank ended: growth is measured between them.
    pub compared: Option<(u64, u64)>,
    pub ranks: Vec<RankView>,
    pub outliers: Vec<Outlier>,
}

#[derive(Clone, Debug, Serialize)]
pub struct RankView {
    pub label: String,
    pub rank: Option<u32>,
    pub device: String,
    pub peak: i64,
    /// `Timestamp(ns)` of the peak.
    pub peak_ts: i64,
    /// Owners at the peak, largest first.
    pub owners: Vec<Held>,
    /// The family's growth over the compared steps, per step.
    pub growth_per_step: Option<i64>,
    /// Owners that grew over the compared steps, most first.
    pub grew: Vec<Held>,
    /// The family's live bytes at the end of each of the job's `steps` (`None`: not ended here).
    pub at_steps: Vec<Option<i64>>,
}

/// An owner's bytes (or growth).
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Held {
    pub family: &'static str,
    pub owner: String,
    pub bytes: i64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Outlier {
    /// Index into the job's `ranks`.
    pub index: usize,
    pub rank: Option<u32>,
    pub label: String,
    pub why: Vec<Why>,
}

/// Why a rank stands out.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Why {
    /// Its peak of a family is above the other ranks' median peak of it, by these owners (each
    /// against the other ranks' median bytes of it at their peaks). Each family is judged: a
    /// leak inside the caching pool's reserved segments raises the pool's (PTA) peak and not
    /// the device's (HAL).
    Peak { family: &'static str, peak: i64, median: i64, by: Vec<Excess> },
    /// An owner grew at every compared step and was never given back, here and not on the
    /// other ranks (their median growth of it is at most a quarter of this).
    Leak { family: &'static str, owner: String, per_step: i64, total: i64, others_per_step: i64, from: u64, to: u64 },
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Excess {
    pub family: &'static str,
    pub owner: String,
    pub bytes: i64,
    pub others_median: i64,
}

/// Groups the members by job and compares each job's ranks.
pub fn compare_ranks(members: &[Member]) -> Comparison {
    let mut jobs: BTreeMap<Option<&str>, Vec<&Member>> = BTreeMap::new();
    for m in members {
        jobs.entry(m.identity.job.as_deref()).or_default().push(m);
    }
    Comparison { jobs: jobs.into_iter().map(|(job, ranks)| job_view(job, ranks)).collect() }
}

fn job_view(job: Option<&str>, mut members: Vec<&Member>) -> JobView {
    members.sort_by(|a, b| {
        (a.identity.rank.is_none(), a.identity.rank, &a.device, &a.label).cmp(&(
            b.identity.rank.is_none(),
            b.identity.rank,
            &b.device,
            &b.label,
        ))
    });
    let family = Family::ALL.into_iter().find(|f| members.iter().any(|m| m.profile.families().any(|g| g == *f)));
    let steps: BTreeSet<u64> = members.iter().flat_map(|m| m.profile.side.steps.keys().copied()).collect();
    let steps: Vec<u64> = steps.into_iter().collect();
    let common: Vec<u64> =
        steps.iter().copied().filter(|s| members.iter().all(|m| m.profile.side.steps.contains_key(s))).collect();
    let world_size = members.iter().filter_map(|m| m.identity.world_size).max();
    let held: BTreeSet<u32> = members.iter().filter_map(|m| m.identity.rank).collect();
    let missing = world_size.map_or(vec![], |w| (0..w).filter(|r| !held.contains(r)).collect());
    let ranks: Vec<RankView> = members.iter().map(|m| rank_view(m, family, &steps, &common)).collect();
    let outliers = outliers(&members, &ranks, &common);
    JobView {
        job: job.map(str::to_owned),
        world_size,
        missing,
        family: family.map(Family::as_str),
        compared: common.first().zip(common.last()).map(|(a, b)| (*a, *b)),
        steps,
        ranks,
        outliers,
    }
}

fn held(owners: &BTreeMap<(Family, String), i64>, top: usize) -> Vec<Held> {
    let mut v: Vec<Held> = owners
        .iter()
        .filter(|(_, b)| **b > 0)
        .map(|((f, o), b)| Held { family: f.as_str(), owner: o.clone(), bytes: *b })
        .collect();
    v.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.owner.cmp(&b.owner)));
    v.truncate(top);
    v
}

fn rank_view(m: &Member, family: Option<Family>, steps: &[u64], common: &[u64]) -> RankView {
    let side = &m.profile.side;
    let peak = family.and_then(|f| m.profile.peaks[f as usize].as_ref());
    let total = |p: &Point| family.map_or(0, |f| p.totals[f as usize]);
    let window = common.first().zip(common.last()).filter(|(a, b)| a < b);
    let (growth_per_step, grew) = match window {
        Some((first, last)) => {
            let (a, b) = (&side.steps[first], &side.steps[last]);
            let growth = growth(a, b).into_iter().filter(|(_, g)| *g > 0).collect();
            (Some((total(b) - total(a)) / (common.len() as i64 - 1)), held(&growth, OWNERS_SHOWN))
        }
        None => (None, vec![]),
    };
    RankView {
        label: m.label.clone(),
        rank: m.identity.rank,
        device: m.device.clone(),
        peak: peak.map_or(0, total),
        peak_ts: peak.map_or(0, |p| p.ts),
        owners: peak.map_or(vec![], |p| held(&p.owners, OWNERS_SHOWN)),
        growth_per_step,
        grew,
        at_steps: steps.iter().map(|s| side.steps.get(s).map(total)).collect(),
    }
}

/// Each owner's bytes at `b` less those at `a`.
fn growth(a: &Point, b: &Point) -> BTreeMap<(Family, String), i64> {
    let mut out: BTreeMap<(Family, String), i64> = b.owners.clone();
    for (k, v) in &a.owners {
        *out.entry(k.clone()).or_default() -= v;
    }
    out
}

/// The median, the lower of the two middle values for an even count (so that, of two, the
/// lower sets the norm); 0 for none.
fn median(mut values: Vec<i64>) -> i64 {
    values.sort_unstable();
    values.get(values.len().saturating_sub(1) / 2).copied().unwrap_or(0)
}

fn outliers(members: &[&Member], ranks: &[RankView], common: &[u64]) -> Vec<Outlier> {
    let mut out = Vec::new();
    for (i, m) in members.iter().enumerate() {
        let others: Vec<&Member> = members.iter().enumerate().filter(|(j, _)| *j != i).map(|(_, o)| *o).collect();
        if others.is_empty() {
            break;
        }
        let mut why: Vec<Why> = Family::ALL.into_iter().filter_map(|f| peak_reason(m, &others, f)).collect();
        why.extend(leak_reasons(m, &others, common));
        if !why.is_empty() {
            out.push(Outlier { index: i, rank: ranks[i].rank, label: ranks[i].label.clone(), why });
        }
    }
    out
}

fn peak_of(m: &Member, family: Family) -> Option<&Point> {
    m.profile.peaks[family as usize].as_ref()
}

fn peak_reason(m: &Member, others: &[&Member], family: Family) -> Option<Why> {
    let peak_of = |m| peak_of(m, family);
    let own = peak_of(m)?;
    let peak = own.totals[family as usize];
    let median_peak = median(others.iter().map(|o| peak_of(o).map_or(0, |p| p.totals[family as usize])).collect());
    if (peak as f64) <= median_peak as f64 * PEAK_RATIO || peak - median_peak < MIN_EXCESS {
        return None;
    }
    let mut by: Vec<Excess> = own
        .owners
        .iter()
        .map(|(key, &bytes)| {
            let theirs = median(
                others.iter().map(|o| peak_of(o).and_then(|p| p.owners.get(key)).copied().unwrap_or(0)).collect(),
            );
            Excess { family: key.0.as_str(), owner: key.1.clone(), bytes, others_median: theirs }
        })
        .filter(|e| e.bytes > e.others_median)
        .collect();
    by.sort_by(|a, b| {
        (b.bytes - b.others_median).cmp(&(a.bytes - a.others_median)).then_with(|| a.owner.cmp(&b.owner))
    });
    // The largest, and the others that explain a share of the excess (not noise beside it).
    let excess = peak - median_peak;
    let mut kept = 0;
    by.retain(|e| {
        kept += 1;
        kept == 1 || (e.bytes - e.others_median) * EXCESS_SHARE >= excess
    });
    by.truncate(OWNERS_SHOWN);
    Some(Why::Peak { family: family.as_str(), peak, median: median_peak, by })
}

/// The owners that grew at no compared step less than the one before (and by [`MIN_LEAK`] in
/// all) on this rank, and by far less on the others. Needs three compared steps: with two, any
/// difference is "steady".
fn leak_reasons(m: &Member, others: &[&Member], common: &[u64]) -> Vec<Why> {
    let (Some(&from), Some(&to)) = (common.first(), common.last()) else { return vec![] };
    if common.len() < 3 {
        return vec![];
    }
    let at =
        |m: &Member, s: &u64, key: &(Family, String)| m.profile.side.steps[s].owners.get(key).copied().unwrap_or(0);
    let intervals = common.len() as i64 - 1;
    let mut out = Vec::new();
    for key in m.profile.side.steps[&to].owners.keys() {
        let values: Vec<i64> = common.iter().map(|s| at(m, s, key)).collect();
        let total = values[values.len() - 1] - values[0];
        if total < MIN_LEAK || values.windows(2).any(|w| w[1] < w[0]) {
            continue;
        }
        let theirs = median(others.iter().map(|o| at(o, &to, key) - at(o, &from, key)).collect());
        if theirs * LEAK_SHARE > total {
            continue;
        }
        out.push(Why::Leak {
            family: key.0.as_str(),
            owner: key.1.clone(),
            per_step: total / intervals,
            total,
            others_per_step: theirs / intervals,
            from,
            to,
        });
    }
    out.sort_by(|a, b| match (a, b) {
        (Why::Leak { total: x, owner: p, .. }, Why::Leak { total: y, owner: q, .. }) => y.cmp(x).then_with(|| p.cmp(q)),
        _ => std::cmp::Ordering::Equal,
    });
    out
}

#[cfg(test)]
mod tests;
