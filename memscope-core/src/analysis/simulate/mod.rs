//! Replaying a job's tensor requests through a model of the caching allocator under other
//! settings (`advise --simulate`): what reserved memory, segments and out-of-memory failures
//! each setting would have given, before anyone reruns the job.
//!
//! The replay is first made under the settings the job ran with, and its segments are compared
//! with the ones the allocator really took ([`Reproduction`]); predictions are shown with that
//! agreement stated. The model ([`allocator`]) follows the allocators' sources, cited in
//! docs/simulate.md; the requests come from the trace ([`trace`]).

use std::collections::BTreeMap;

use foldhash::HashMap;
use serde::Serialize;

pub mod allocator;
pub mod config;
pub mod synthetic;
#[cfg(test)]
mod tests;
pub mod trace;

use allocator::{Allocator, Held, SegmentStep};
use config::Config;
pub use config::Flavour;
pub use config::{SettingError, FRACTION_KEY};
use trace::{Step, Trace};

/// The first out-of-memory failure of a replay.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SimOom {
    pub ts_ns: i64,
    pub pid: i64,
    pub request_bytes: u64,
    /// The process's reserved and allocated bytes when it failed.
    pub reserved_bytes: u64,
    pub allocated_bytes: u64,
    /// The job's line that made the request, when the trace knows it (`file:line function`).
    pub site: Option<String>,
}

/// The figures of one replay (or of the run as recorded).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Figures {
    pub peak_reserved_bytes: u64,
    pub peak_allocated_bytes: u64,
    /// Segments taken; with expandable segments, mappings (the pages one allocation mapped count
    /// once, as PyTorch's trace counts its `segment_map`s).
    pub segments: u64,
    /// Reserved minus allocated, averaged over the trace's time.
    pub unused_reserve_avg_bytes: u64,
    /// The largest free piece of cached memory when reserved memory peaked.
    pub largest_free_at_peak_bytes: Option<u64>,
    pub oom: bool,
    pub ooms: u64,
    pub first_oom: Option<SimOom>,
    /// Reserved bytes over time (at most [`CURVE_POINTS`] points, the peak kept).
    #[serde(skip)]
    pub curve: Vec<(i64, u64)>,
}

/// A replay under one setting.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Simulation {
    /// The setting as given.
    pub setting: String,
    #[serde(flatten)]
    pub figures: Figures,
}

/// How the replay under the run's own settings compares with what the allocator did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Reproduction {
    /// Segments (mappings, with expandable segments) the allocator took, and how many of them,
    /// from the first, the replay took with the same sizes in the same order.
    pub recorded_segments: u64,
    pub matched_segments: u64,
    /// Whether every segment step (taken and given back) agreed, per process.
    pub agrees: bool,
    /// The first disagreement, in words.
    pub first_difference: Option<String>,
}

/// Everything `--simulate` found for one device.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Report {
    /// The run as the trace recorded it (segments from the rows).
    pub recorded: Figures,
    /// The replay under the run's own settings, and its agreement with the recorded run
    /// (`None`: those settings cannot be replayed, which `notes` says).
    pub baseline: Option<Simulation>,
    pub reproduction: Reproduction,
    pub simulations: Vec<Simulation>,
    /// What the replay could not know, in words.
    pub notes: Vec<String>,
}

pub const CURVE_POINTS: usize = 300;

/// What to simulate: the settings, over the run's own allocator configuration.
#[derive(Clone, Debug, Default)]
pub struct Options {
    pub settings: Vec<String>,
    /// The per-process fraction the job ran with (not visible to the trace).
    pub fraction: Option<f64>,
    pub capacity: Option<u64>,
    pub flavour: Flavour,
}

/// Checks every setting before any replay runs, so a typo fails at once.
pub fn check(base: &str, options: &Options) -> Result<(), SettingError> {
    let base = crate::analysis::advise::AllocConf::parse(base);
    Config::parse("", &base, options.fraction, options.capacity, options.flavour)?;
    for s in &options.settings {
        Config::parse(s, &base, options.fraction, options.capacity, options.flavour)?;
    }
    Ok(())
}

/// Replays the trace under the run's settings (`base`, the allocator configuration it ran with)
/// and under each of `options.settings`.
pub fn run(trace: &Trace, base: &str, options: &Options) -> Result<Report, SettingError> {
    let base_conf = crate::analysis::advise::AllocConf::parse(base);
    let cfg = Config::parse("", &base_conf, options.fraction, options.capacity, options.flavour)?;
    let hints: HashMap<i64, Vec<(u64, u64)>> = trace
        .segments
        .iter()
        .map(|(&pid, r)| {
            let allocs = r.iter().filter(|s| matches!(s.step, SegmentStep::Alloc(_)));
            (pid, allocs.map(|s| (s.step.size(), s.ptr)).collect())
        })
        .collect();
    let (baseline, made) = replay(trace, cfg, &hints);
    let mut report = Report {
        recorded: recorded(trace),
        reproduction: reproduce(trace, &made),
        baseline: Some(Simulation { setting: base.to_owned(), figures: baseline }),
        ..Report::default()
    };
    for s in &options.settings {
        let cfg = Config::parse(s, &base_conf, options.fraction, options.capacity, options.flavour)?;
        let (figures, _) = replay(trace, cfg, &HashMap::default());
        report.simulations.push(Simulation { setting: s.clone(), figures });
    }
    report.notes = notes(trace);
    Ok(report)
}

/// The figures of one whole allocator configuration (not applied over the run's: a
/// recommendation's value, which drops the keys it conflicts with).
pub fn predict(trace: &Trace, whole: &str, options: &Options) -> Result<Figures, SettingError> {
    let conf = crate::analysis::advise::AllocConf::parse(whole);
    let cfg = Config::parse("", &conf, options.fraction, options.capacity, options.flavour)?;
    Ok(replay(trace, cfg, &HashMap::default()).0)
}

fn notes(trace: &Trace) -> Vec<String> {
    let mut notes = Vec::new();
    if trace.deferred_frees > 0 {
        notes.push(format!(
            "{} block(s) were freed while another stream still used them; the allocator gave them back later, when that stream's work completed, which the trace does not show: the replay gives them back at the free",
            trace.deferred_frees
        ));
    }
    if trace.sizes_only > 0 {
        notes.push(format!(
            "{} request(s) had no recorded requested size; their block size was replayed",
            trace.sizes_only
        ));
    }
    if trace.streams_unknown > 0 {
        notes.push(format!("{} request(s) had no recorded stream (a trace from before the `stream` key); they were replayed on one stream", trace.streams_unknown));
    }
    notes
}

/// The running totals of a replay over every process of the device.
#[derive(Default)]
struct Totals {
    figures: Figures,
    held: Held,
    last_ts: Option<i64>,
    start_ts: Option<i64>,
    unused_integral: u128,
}

impl Totals {
    fn advance(&mut self, ts: i64) {
        if let Some(last) = self.last_ts {
            let dt = (ts - last).max(0) as u128;
            self.unused_integral += dt * u128::from(self.held.reserved.saturating_sub(self.held.allocated));
        }
        self.last_ts = Some(ts);
        self.start_ts.get_or_insert(ts);
    }

    fn change(&mut self, ts: i64, before: Held, after: Held, largest_free: impl FnOnce() -> u64) {
        self.held.reserved = self.held.reserved + after.reserved - before.reserved;
        self.held.allocated = self.held.allocated + after.allocated - before.allocated;
        let f = &mut self.figures;
        f.peak_allocated_bytes = f.peak_allocated_bytes.max(self.held.allocated);
        if self.held.reserved > f.peak_reserved_bytes {
            f.peak_reserved_bytes = self.held.reserved;
            f.largest_free_at_peak_bytes = Some(largest_free());
        }
        if before.reserved != after.reserved {
            f.curve.push((ts, self.held.reserved));
        }
    }

    fn finish(mut self) -> Figures {
        let span = match (self.start_ts, self.last_ts) {
            (Some(a), Some(b)) if b > a => (b - a) as u128,
            _ => 0,
        };
        self.figures.unused_reserve_avg_bytes = self.unused_integral.checked_div(span).unwrap_or(0) as u64;
        self.figures.curve = thin(std::mem::take(&mut self.figures.curve));
        self.figures
    }
}

/// At most [`CURVE_POINTS`] points, evenly picked, the highest kept.
fn thin(curve: Vec<(i64, u64)>) -> Vec<(i64, u64)> {
    if curve.len() <= CURVE_POINTS {
        return curve;
    }
    let peak = curve.iter().enumerate().max_by_key(|(_, p)| p.1).map_or(0, |(i, _)| i);
    let every = curve.len().div_ceil(CURVE_POINTS);
    curve
        .iter()
        .enumerate()
        .filter(|(i, _)| i % every == 0 || *i == peak || *i == curve.len() - 1)
        .map(|(_, p)| *p)
        .collect()
}

/// One replay: the figures, and the segment steps each process's model made.
fn replay(
    trace: &Trace,
    cfg: Config,
    hints: &HashMap<i64, Vec<(u64, u64)>>,
) -> (Figures, HashMap<i64, Vec<SegmentStep>>) {
    let mut models: BTreeMap<i64, Allocator> = BTreeMap::new();
    let mut made: HashMap<i64, Vec<(u64, SegmentStep)>> = HashMap::default();
    let mut addresses: HashMap<(i64, u64), u64> = HashMap::default();
    let mut totals = Totals::default();
    let mut other: u64 = 0;
    for (call, t) in trace.steps.iter().enumerate() {
        totals.advance(t.ts);
        let m =
            models.entry(t.pid).or_insert_with(|| Allocator::new(cfg, hints.get(&t.pid).cloned().unwrap_or_default()));
        let before = m.held();
        let others = other + totals.held.reserved - before.reserved;
        match t.step {
            Step::Alloc { req, stream, ptr, rounded, .. } => {
                match m.malloc(cfg.request(req, rounded), stream, others) {
                    Some((at, _)) => {
                        addresses.insert((t.pid, ptr), at);
                    }
                    None => oom(&mut totals.figures, t, req, before, &trace.sites),
                }
            }
            Step::Refused { req, stream } => match m.malloc(req, stream, others) {
                Some((at, _)) => {
                    m.free(at);
                }
                None => oom(&mut totals.figures, t, req, before, &trace.sites),
            },
            Step::Free { ptr } => {
                if let Some(at) = addresses.remove(&(t.pid, ptr)) {
                    m.free(at);
                }
            }
            Step::EmptyCache => m.empty_cache(),
            Step::Other(delta) => other = other.saturating_add_signed(delta),
            Step::Recorded(_) | Step::None => {}
        }
        let after = m.held();
        made.entry(t.pid).or_default().extend(m.steps.drain(..).map(|s| (call as u64, s)));
        let largest = || models.values().map(Allocator::largest_free).max().unwrap_or(0);
        totals.change(t.ts, before, after, largest);
    }
    let mut figures = totals.finish();
    let made: HashMap<i64, Vec<SegmentStep>> = made.into_iter().map(|(pid, steps)| (pid, canonical(steps))).collect();
    figures.segments = made.values().flatten().filter(|s| s.takes()).count() as u64;
    (figures, made)
}

fn oom(f: &mut Figures, t: &trace::Timed, req: u64, held: Held, sites: &[String]) {
    f.oom = true;
    f.ooms += 1;
    f.first_oom.get_or_insert(SimOom {
        ts_ns: t.ts,
        pid: t.pid,
        request_bytes: req,
        reserved_bytes: held.reserved,
        allocated_bytes: held.allocated,
        site: sites.get(t.site as usize).filter(|s| !s.is_empty()).cloned(),
    });
}

/// Segment steps as the allocator's trace of snapshots counts them: the pages one call mapped
/// (or unmapped) in a row are one mapping, whatever the page size or how the trace split them
/// (our rows: one per page; a snapshot: one per range).
pub(crate) fn canonical(steps: impl IntoIterator<Item = (u64, SegmentStep)>) -> Vec<SegmentStep> {
    let mut out: Vec<(u64, SegmentStep)> = Vec::new();
    for (call, step) in steps {
        match (out.last_mut(), step) {
            (Some((c, SegmentStep::Map(total))), SegmentStep::Map(more)) if *c == call => *total += more,
            (Some((c, SegmentStep::Unmap(total))), SegmentStep::Unmap(more)) if *c == call => *total += more,
            _ => out.push((call, step)),
        }
    }
    out.into_iter().map(|(_, s)| s).collect()
}

/// The run as recorded: its segments' curve and count, its blocks' peak.
fn recorded(trace: &Trace) -> Figures {
    let mut totals = Totals::default();
    let mut live: HashMap<(i64, u64), u64> = HashMap::default();
    let mut f = Figures::default();
    for t in &trace.steps {
        totals.advance(t.ts);
        let before = totals.held;
        let mut after = before;
        match t.step {
            Step::Recorded(s) if s.takes() => after.reserved += s.size(),
            Step::Recorded(s) => after.reserved = after.reserved.saturating_sub(s.size()),
            // The block's size as the trace recorded it (the allocator's rounding), else the
            // request rounded to 512.
            Step::Alloc { req, ptr, block, .. } => {
                let size = if block > 0 {
                    block
                } else {
                    req.next_multiple_of(allocator::MIN_BLOCK).max(allocator::MIN_BLOCK)
                };
                live.insert((t.pid, ptr), size);
                after.allocated += size;
            }
            Step::Free { ptr } => after.allocated -= live.remove(&(t.pid, ptr)).unwrap_or(0),
            Step::Refused { .. } => {
                f.ooms += 1;
            }
            _ => {}
        }
        totals.change(t.ts, before, after, || 0);
    }
    let figures = totals.finish();
    let segments = trace
        .segments
        .values()
        .map(|v| canonical(v.iter().map(|r| (r.call, r.step))).iter().filter(|s| s.takes()).count() as u64)
        .sum();
    Figures { segments, ooms: f.ooms, oom: f.ooms > 0, largest_free_at_peak_bytes: None, ..figures }
}

/// Compares the replay's segment steps with the recorded ones, process by process.
fn reproduce(trace: &Trace, made: &HashMap<i64, Vec<SegmentStep>>) -> Reproduction {
    let mut r = Reproduction { agrees: true, ..Reproduction::default() };
    let mut pids: Vec<i64> = trace.segments.keys().chain(made.keys()).copied().collect();
    pids.sort_unstable();
    pids.dedup();
    for pid in pids {
        let rec = trace.segments.get(&pid).map(|v| canonical(v.iter().map(|s| (s.call, s.step)))).unwrap_or_default();
        let sim = made.get(&pid).cloned().unwrap_or_default();
        let (rt, st): (Vec<_>, Vec<_>) =
            (rec.iter().filter(|s| s.takes()).collect(), sim.iter().filter(|s| s.takes()).collect());
        r.recorded_segments += rt.len() as u64;
        r.matched_segments += rt.iter().zip(&st).take_while(|(a, b)| a == b).count() as u64;
        if rec != sim && r.agrees {
            r.agrees = false;
            let i = rec.iter().zip(&sim).take_while(|(a, b)| a == b).count();
            r.first_difference = Some(format!(
                "process {pid}, segment step {}: the allocator {}, the replay {}",
                i + 1,
                describe(rec.get(i)),
                describe(sim.get(i))
            ));
        }
    }
    r
}

fn describe(s: Option<&SegmentStep>) -> String {
    use crate::units::human_bytes;
    match s {
        None => "made no more".to_owned(),
        Some(SegmentStep::Alloc(b)) => format!("took a segment of {}", human_bytes(*b as i64)),
        Some(SegmentStep::Free(b)) => format!("freed a segment of {}", human_bytes(*b as i64)),
        Some(SegmentStep::Map(b)) => format!("mapped a page of {}", human_bytes(*b as i64)),
        Some(SegmentStep::Unmap(b)) => format!("unmapped a page of {}", human_bytes(*b as i64)),
    }
}

/// Reads a DB's trace for the replays.
pub fn read(db: &crate::analysis::db::DumpDb, fraction_set: bool) -> Result<Trace, crate::analysis::AnalysisError> {
    let mut reader = trace::Reader::new(fraction_set);
    crate::analysis::pass::run(db, &mut [&mut reader])?;
    Ok(reader.finish())
}
