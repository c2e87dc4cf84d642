//! The allocator-settings advisor: from the target's allocator settings at the start (ms_meta
//! `env.*`) and the behaviour the fragmentation replay measured, which settings to change, each
//! with the numbers that triggered it. Stored as `ms_advice` (docs/db-schema.md).
//!
//! Each rule fires on one specific behaviour, the one its setting changes, so that following the
//! advice is tested by re-running the job with it (tests/integration/tests/advise.rs):
//! - expandable_segments:True: the pool grew while the free memory pinned inside segments in use
//!   covered the request but no piece of it did (or an OOM failed that way): only one growable
//!   range lets neighbouring free pieces join and be reused;
//! - max_split_size_mb: a request above 20 MiB needed a new segment while big segments were held
//!   by small blocks carved from them: oversize blocks must not be split for small ones;
//! - garbage_collection_threshold: the pool hit its ceiling and emptied its cache inside an
//!   allocation, repeatedly (or the runtime refused it and it recovered by flushing): releasing
//!   cached segments earlier avoids the stalls and the ceiling;
//! - torch_npu.npu.set_per_process_memory_fraction: several processes share the device;
//! - gc.collect() at epoch ends: at the peak, a share of the live tensors were garbage from
//!   earlier steps that only Python's cyclic garbage collector freed, later ([`super::gc_held`]);
//! - MULTI_STREAM_MEMORY_REUSE: blocks freed while still marked on another stream (a
//!   collective's tensors) waited for that stream, and the pool took new segments meanwhile
//!   ([`super::stream_reuse`]): 1 when it was off, 3 when it was on (the default) and the blocks
//!   were freed before the collective was waited for;
//! - ATB_WORKSPACE_MEM_ALLOC_ALG_TYPE=3: an ATB operation's intermediate tensors, which that
//!   variable's layout algorithm places inside the operation's workspace, were a large share of
//!   the device's peak while the job ran with ATB's default algorithm ([`super::atb_workspace`]).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use rusqlite::params;
use serde::Serialize;

use super::atb_workspace::{self, AtbWorkspace};
use super::db::DumpDb;
use super::fragmentation::{self, ProcessPeak, Report, LARGE_SEGMENT, MIB};
use super::gc_held::{self, GcHeld};
use super::oom::Verdict;
use super::pass::{self, Consumer};
use super::render::{human_bytes, relative};
use super::stream_reuse::{self, StreamReuse};
use super::AnalysisError;

/// The id of the one recommendation that is not an allocator setting but a code change.
pub const GC_AT_EPOCH_END: &str = "gc_at_epoch_end";

/// torch_npu's multi-stream reuse switch (0 off, 1 erase marks at wait, the default, 2 never
/// mark, 3 also erase the marks of tensors freed before the wait), and its recommendation's id.
pub const MULTI_STREAM: &str = "MULTI_STREAM_MEMORY_REUSE";
pub const MULTI_STREAM_REUSE_ID: &str = "multi_stream_memory_reuse";

/// The allocator's configuration variable (torch_npu reads it once, at its first allocation).
pub const ALLOC_CONF: &str = "PYTORCH_NPU_ALLOC_CONF";

/// ATB's choice of algorithm for laying out a graph operation's intermediate tensors inside its
/// workspace, and its switch for planning that layout globally; the rule's id.
pub const ATB_ALG_TYPE: &str = "ATB_WORKSPACE_MEM_ALLOC_ALG_TYPE";
pub const ATB_ALLOC_GLOBAL: &str = "ATB_WORKSPACE_MEM_ALLOC_GLOBAL";
pub const ATB_ALG_RULE: &str = "atb_workspace_mem_alloc_alg_type";
/// What the rule recommends: the value deployment scripts that tune ATB memory set (with
/// ATB_WORKSPACE_MEM_ALLOC_GLOBAL=1), against the default 1 of ATB's set_env.
const ATB_ALG_ADVISED: &str = "3";

/// Fragmentation must have forced the pool to grow at least `FORCED_MIN` times, and the holes
/// (free memory pinned inside segments in use) must be at least this share of the peak reserved
/// bytes: below it, the waste is the tails of 20 MiB segments, not worth a restart.
const HOLES_SHARE: f64 = 0.20;
const FORCED_MIN: usize = 2;
/// A cache flush counts as hitting the ceiling when the reserved bytes before it plus the segment
/// taken after it reach this share of the trace's peak reserved bytes.
const CEILING_SHARE: f64 = 0.9;
/// Flushes at the ceiling (or recovered refusals) before garbage collection is advised.
const FLUSH_MIN: usize = 2;

/// `key:value,key:value`, as torch_npu parses PYTORCH_NPU_ALLOC_CONF.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AllocConf(Vec<(String, String)>);

impl AllocConf {
    pub fn parse(text: &str) -> Self {
        Self(
            text.split(',')
                .filter_map(|item| item.split_once(':'))
                .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
                .filter(|(k, _)| !k.is_empty())
                .collect(),
        )
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.0.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    fn expandable(&self) -> bool {
        self.get("expandable_segments").is_some_and(|v| v.eq_ignore_ascii_case("true"))
    }

    /// This configuration with `key` set to `value` and `drop` removed.
    fn with(&self, key: &str, value: &str, drop: &[&str]) -> Self {
        let mut items: Vec<(String, String)> =
            self.0.iter().filter(|(k, _)| k != key && !drop.contains(&k.as_str())).cloned().collect();
        items.push((key.to_owned(), value.to_owned()));
        Self(items)
    }
}

impl std::fmt::Display for AllocConf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let items: Vec<String> = self.0.iter().map(|(k, v)| format!("{k}:{v}")).collect();
        f.write_str(&items.join(","))
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Recommendation {
    /// `expandable_segments`, `max_split_size_mb`, `garbage_collection_threshold`,
    /// `per_process_memory_fraction`.
    pub id: &'static str,
    /// The environment variable to set, or `None` for an API call.
    pub variable: Option<&'static str>,
    /// What to set or call: `expandable_segments:True`, `torch_npu.npu.set_per_process_memory_fraction(0.47)`.
    pub setting: String,
    /// The variable's whole new value (the current one with this setting applied).
    pub value: Option<String>,
    /// The variable's value the job ran with (`None`: unset, or not visible to the trace).
    pub current: Option<String>,
    /// The evidence in plain words, with its numbers.
    pub why: String,
    pub evidence: BTreeMap<String, serde_json::Value>,
    /// Recommendations of this list that torch_npu refuses together with this one.
    pub conflicts_with: Vec<&'static str>,
}

/// The behaviour the rules read, as measured.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Measured {
    pub peak_reserved: u64,
    pub peak_ts_ns: Option<i64>,
    pub allocated_at_peak: u64,
    pub unused_at_peak: u64,
    pub largest_free_at_peak: Option<u64>,
    pub holes_at_peak: u64,
    pub max_allocated: u64,
    pub splits: u64,
    pub growths: u64,
    pub forced_growths: usize,
    pub forced_growth_bytes: u64,
    pub pinned_big_growths: usize,
    pub flushes_at_ceiling: usize,
    pub ooms: usize,
    pub fragmentation_ooms: usize,
    pub recovered_refusals: usize,
    pub processes: Vec<ProcessPeak>,
    /// Tensors freed by Python's garbage collector, and those it held at the peak.
    pub gc: GcHeld,
    /// Blocks freed while marked on another stream, and what the pool took meanwhile.
    pub streams: StreamReuse,
    /// ATB operations' workspaces against the device's peak.
    pub atb: AtbWorkspace,
}

/// The advice for one DB.
#[derive(Clone, Debug, Serialize)]
pub struct Advice {
    pub db: String,
    pub device: String,
    /// The target's allocator settings at the start (ms_meta `env.*`; absent: unset).
    pub settings: BTreeMap<String, String>,
    pub measured: Measured,
    pub recommendations: Vec<Recommendation>,
}

/// The `env.*` keys of `ms_meta`, without the prefix; empty when the DB has no `ms_meta`
/// (msMemScope's DBs), which the advice then says.
pub fn read_settings(db: &DumpDb) -> Result<BTreeMap<String, String>, AnalysisError> {
    let read = |source| AnalysisError::Read { path: db.path().to_owned(), source };
    let conn = db.conn();
    let has: i64 = conn
        .query_row("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'ms_meta'", [], |r| r.get(0))
        .map_err(read)?;
    if has == 0 {
        return Ok(BTreeMap::new());
    }
    let mut stmt = conn.prepare("SELECT key, value FROM ms_meta WHERE key LIKE 'env.%'").map_err(read)?;
    let rows = stmt
        .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))
        .map_err(read)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(read)?;
    Ok(rows.into_iter().filter_map(|(k, v)| k.strip_prefix("env.").map(|k| (k.to_owned(), v))).collect())
}

/// Whether a flush happened at the pool's ceiling: the segment it freed room for would have taken
/// the pool (nearly) to its highest reserved bytes.
fn at_ceiling(f: &fragmentation::Flush, m: &Measured) -> bool {
    (f.reserved_before + f.segment_bytes) as f64 >= CEILING_SHARE * m.peak_reserved as f64
}

fn measure(report: &Report) -> Measured {
    let peak = report.peak.unwrap_or_default();
    let failures = report.incidents.iter().filter(|i| i.verdict != Verdict::Recovered);
    let mut m = Measured {
        peak_reserved: peak.reserved,
        peak_ts_ns: report.peak.map(|p| p.ts_ns),
        allocated_at_peak: peak.allocated,
        unused_at_peak: peak.unused,
        largest_free_at_peak: peak.largest_free,
        holes_at_peak: peak.holes,
        max_allocated: report.max_allocated,
        splits: report.samples.last().map_or(0, |s| s.splits),
        growths: report.growths,
        forced_growths: report.forced.len(),
        forced_growth_bytes: report.forced.iter().map(|g| g.segment_bytes).sum(),
        pinned_big_growths: report.pinned_big.len(),
        flushes_at_ceiling: 0,
        ooms: failures.clone().count(),
        fragmentation_ooms: failures.filter(|i| i.verdict == Verdict::Fragmentation).count(),
        recovered_refusals: report.incidents.iter().filter(|i| i.verdict == Verdict::Recovered).count(),
        processes: report.processes.clone(),
        gc: GcHeld::default(),
        streams: StreamReuse::default(),
        atb: AtbWorkspace::default(),
    };
    m.flushes_at_ceiling = report.flushes.iter().filter(|f| at_ceiling(f, &m)).count();
    m
}

fn b(v: u64) -> String {
    human_bytes(v as i64)
}

fn ev(pairs: &[(&'static str, serde_json::Value)]) -> BTreeMap<String, serde_json::Value> {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), v.clone())).collect()
}

/// Every field of a measurement, as its evidence.
fn ev_of(measured: &impl Serialize) -> BTreeMap<String, serde_json::Value> {
    match serde_json::to_value(measured) {
        Ok(serde_json::Value::Object(fields)) => fields.into_iter().collect(),
        _ => BTreeMap::new(),
    }
}

/// The largest power of two not above `mib`, but above torch_npu's 20 MiB floor for the setting.
fn split_limit_mib(mib: u64) -> u64 {
    let pow2 = if mib == 0 { 0 } else { 1u64 << (63 - mib.leading_zeros()) };
    pow2.max(LARGE_SEGMENT / MIB + 1)
}

/// What every rule reads: the replay's report, the settings at the start, and the measurements.
struct Facts<'a> {
    report: &'a Report,
    settings: &'a BTreeMap<String, String>,
    m: Measured,
    /// PYTORCH_NPU_ALLOC_CONF at the start, as set and parsed.
    current: Option<String>,
    conf: AllocConf,
}

impl Facts<'_> {
    /// A recommendation of one PYTORCH_NPU_ALLOC_CONF `key:value` (dropping the keys `drop`).
    fn env_rec(
        &self,
        id: &'static str,
        key: &str,
        value: &str,
        drop: &[&str],
        why: String,
        evidence: BTreeMap<String, serde_json::Value>,
    ) -> Recommendation {
        Recommendation {
            id,
            variable: Some(ALLOC_CONF),
            setting: format!("{key}:{value}"),
            value: Some(self.conf.with(key, value, drop).to_string()),
            current: self.current.clone(),
            why,
            evidence,
            conflicts_with: Vec::new(),
        }
    }
}

/// The rules, in the order their advice is listed; each gives its advice when its evidence is there.
const RULES: [fn(&Facts<'_>) -> Option<Recommendation>; 7] = [
    expandable_segments,
    max_split_size_mb,
    garbage_collection_threshold,
    per_process_memory_fraction,
    multi_stream_memory_reuse,
    gc_at_epoch_end,
    atb_workspace_alg_type,
];

/// Runs the rules on the measurements.
pub fn advise(
    report: &Report,
    settings: &BTreeMap<String, String>,
    gc: &GcHeld,
    streams: &StreamReuse,
    atb: &AtbWorkspace,
) -> (Measured, Vec<Recommendation>) {
    let mut m = measure(report);
    m.gc = gc.clone();
    m.streams = streams.clone();
    m.atb = atb.clone();
    let current = settings.get(ALLOC_CONF).cloned();
    let conf = AllocConf::parse(current.as_deref().unwrap_or(""));
    let facts = Facts { report, settings, m, current, conf };
    let mut recs: Vec<Recommendation> = RULES.iter().filter_map(|rule| rule(&facts)).collect();
    // torch_npu refuses expandable segments together with either of the other two.
    let ids: Vec<&'static str> = recs.iter().map(|r| r.id).collect();
    for r in &mut recs {
        r.conflicts_with = match r.id {
            "expandable_segments" => ids
                .iter()
                .copied()
                .filter(|i| matches!(*i, "max_split_size_mb" | "garbage_collection_threshold"))
                .collect(),
            "max_split_size_mb" | "garbage_collection_threshold" => {
                ids.iter().copied().filter(|i| *i == "expandable_segments").collect()
            }
            _ => Vec::new(),
        };
    }
    (facts.m, recs)
}

/// expandable_segments: holes between live blocks that no request could use.
fn expandable_segments(f: &Facts<'_>) -> Option<Recommendation> {
    let (m, conf, report) = (&f.m, &f.conf, f.report);
    let holes_share = m.holes_at_peak as f64 / m.peak_reserved.max(1) as f64;
    let forced = m.forced_growths >= FORCED_MIN && holes_share >= HOLES_SHARE;
    if !conf.expandable() && (forced || m.fragmentation_ooms > 0) {
        let mut why = Vec::new();
        if forced {
            let g = report.forced.iter().max_by_key(|g| (g.holes_before, std::cmp::Reverse(g.ts_ns))).unwrap();
            why.push(format!(
                "the pool took {} new segment(s) ({}) while the free memory inside segments in use covered the \
                 request but no free piece did (e.g. {} requested with {} free in holes, the largest piece {}); at \
                 its peak of {} reserved, {} ({:.0}%) were such holes",
                m.forced_growths,
                b(m.forced_growth_bytes),
                b(g.request),
                b(g.holes_before),
                b(g.largest_before),
                b(m.peak_reserved),
                b(m.holes_at_peak),
                holes_share * 100.0
            ));
        }
        if m.fragmentation_ooms > 0 {
            why.push(format!(
                "{} allocation(s) failed with enough reserved but unused memory and no piece big enough",
                m.fragmentation_ooms
            ));
        }
        let dropped: Vec<&str> = ["max_split_size_mb", "garbage_collection_threshold"]
            .into_iter()
            .filter(|k| conf.get(k).is_some())
            .collect();
        if !dropped.is_empty() {
            why.push(format!(
                "{} removed: torch_npu refuses it together with expandable segments",
                dropped.join(" and ")
            ));
        }
        let evidence = ev(&[
            ("forced_growths", m.forced_growths.into()),
            ("forced_growth_bytes", m.forced_growth_bytes.into()),
            ("fragmentation_ooms", m.fragmentation_ooms.into()),
            ("peak_reserved", m.peak_reserved.into()),
            ("unused_at_peak", m.unused_at_peak.into()),
            ("holes_at_peak", m.holes_at_peak.into()),
        ]);
        return Some(f.env_rec(
            "expandable_segments",
            "expandable_segments",
            "True",
            &dropped,
            why.join("; "),
            evidence,
        ));
    }
    None
}

/// max_split_size_mb: big segments pinned by small blocks while a big request needed memory.
fn max_split_size_mb(f: &Facts<'_>) -> Option<Recommendation> {
    let (conf, report) = (&f.conf, f.report);
    if !conf.expandable() && conf.get("max_split_size_mb").is_none() && !report.pinned_big.is_empty() {
        let smallest_segment = report.pinned_big.iter().map(|g| g.pinned_big_min).min().unwrap_or(0);
        let smallest_request = report.pinned_big.iter().map(|g| g.request).min().unwrap_or(0);
        let limit = split_limit_mib(smallest_segment.min(smallest_request) / MIB);
        let why = format!(
            "{} request(s) above 20 MiB (the smallest {}) needed a new segment while {} big segment(s) (the smallest \
             {}) were held by blocks under 10 MiB carved from them; blocks of {limit} MiB or more would then be kept \
             whole for big requests",
            report.pinned_big.len(),
            b(smallest_request),
            report.pinned_big.iter().map(|g| g.pinned_big).max().unwrap_or(0),
            b(smallest_segment)
        );
        let evidence = ev(&[
            ("pinned_big_growths", report.pinned_big.len().into()),
            ("smallest_pinned_segment", smallest_segment.into()),
            ("smallest_big_request", smallest_request.into()),
        ]);
        return Some(f.env_rec("max_split_size_mb", "max_split_size_mb", &limit.to_string(), &[], why, evidence));
    }
    None
}

/// garbage_collection_threshold: the cache emptied at a ceiling, again and again.
fn garbage_collection_threshold(f: &Facts<'_>) -> Option<Recommendation> {
    let (m, conf, report) = (&f.m, &f.conf, f.report);
    let pressure = m.flushes_at_ceiling.max(m.recovered_refusals);
    if !conf.expandable() && conf.get("garbage_collection_threshold").is_none() && pressure >= FLUSH_MIN {
        let at_ceiling: Vec<&fragmentation::Flush> = report.flushes.iter().filter(|f| at_ceiling(f, m)).collect();
        let ceiling = at_ceiling.iter().map(|f| f.reserved_before).max().unwrap_or(m.peak_reserved).max(1);
        let working = m.max_allocated as f64 / ceiling as f64;
        // Above the live working set (else every allocation would collect), at most 0.9.
        let threshold = ((working + 0.2) * 10.0).ceil().clamp(6.0, 9.0) / 10.0;
        let value = format!("{threshold:.1}");
        let why = format!(
            "the pool reached its ceiling of about {} and freed {} of cached segments inside allocations {} time(s) \
             ({} runtime refusal(s) it recovered from); at most {} ({:.0}% of the ceiling) was allocated at once, so \
             releasing cached segments above {value} of the allowed memory keeps the working set; torch_npu applies \
             it against set_per_process_memory_fraction x device memory",
            b(ceiling),
            b(at_ceiling.iter().map(|f| f.freed).sum()),
            m.flushes_at_ceiling,
            m.recovered_refusals,
            b(m.max_allocated),
            working * 100.0
        );
        let evidence = ev(&[
            ("flushes_at_ceiling", m.flushes_at_ceiling.into()),
            ("recovered_refusals", m.recovered_refusals.into()),
            ("ceiling", ceiling.into()),
            ("max_allocated", m.max_allocated.into()),
        ]);
        return Some(f.env_rec(
            "garbage_collection_threshold",
            "garbage_collection_threshold",
            &value,
            &[],
            why,
            evidence,
        ));
    }
    None
}

/// set_per_process_memory_fraction: processes sharing the device.
fn per_process_memory_fraction(f: &Facts<'_>) -> Option<Recommendation> {
    let m = &f.m;
    let sharing: Vec<&ProcessPeak> = m.processes.iter().filter(|p| p.peak_device.max(p.peak_reserved) > 0).collect();
    if sharing.len() >= 2 {
        let total: u64 = sharing.iter().map(|p| p.peak_device.max(p.peak_reserved)).sum();
        let shares: Vec<(i64, u64, f64)> = sharing
            .iter()
            .map(|p| {
                let peak = p.peak_device.max(p.peak_reserved);
                (p.pid, peak, (0.95 * peak as f64 / total as f64 * 100.0).floor() / 100.0)
            })
            .collect();
        let list: Vec<String> =
            shares.iter().map(|(pid, peak, f)| format!("pid {pid}: peak {}, fraction {f:.2}", b(*peak))).collect();
        let why = format!(
            "{} processes used this device ({}); without a fraction each process's allocator takes what it can and \
             the first to cache memory starves the others (the trace cannot see whether they set one)",
            shares.len(),
            list.join("; ")
        );
        let calls: Vec<String> =
            shares.iter().map(|(pid, _, f)| format!("set_per_process_memory_fraction({f:.2}) in pid {pid}")).collect();
        let evidence = ev(&[(
            "processes",
            serde_json::json!(shares
                .iter()
                .map(|(pid, peak, f)| serde_json::json!({"pid": pid, "peak": peak, "fraction": f}))
                .collect::<Vec<_>>()),
        )]);
        return Some(Recommendation {
            id: "per_process_memory_fraction",
            variable: None,
            setting: format!("torch_npu.npu.{}", calls.join(", ")),
            value: None,
            current: None,
            why,
            evidence,
            conflicts_with: Vec::new(),
        });
    }
    None
}

/// MULTI_STREAM_MEMORY_REUSE: blocks waiting for another stream while the pool grew.
fn multi_stream_memory_reuse(f: &Facts<'_>) -> Option<Recommendation> {
    let (settings, streams) = (f.settings, &f.m.streams);
    let reuse = settings.get(MULTI_STREAM).map(|v| v.trim().to_owned());
    let next = match reuse.as_deref() {
        Some("0") => Some(("1", "with reuse off nothing erases the marks once the collective was waited for")),
        None | Some("" | "1") => Some((
            "3",
            "they were freed before the collective that marked them was waited for, which reuse mode 1 (the default) does not cover",
        )),
        _ => None,
    };
    if let (true, Some((value, because))) = (streams.costly(), next) {
        let why = format!(
            "{} block(s) ({}) were freed while still marked as used by another stream (recordStream, as a \
             collective's tensors are); torch_npu keeps such blocks until that stream's work completes, and {because}. \
             Meanwhile the pool took {} of new segments, in {} step(s) (up to {} freed while marked in one step)",
            streams.deferred_blocks,
            b(streams.deferred_bytes),
            b(streams.grown_while_deferred),
            streams.steps_grown,
            b(streams.max_step_deferred_bytes)
        );
        return Some(Recommendation {
            id: MULTI_STREAM_REUSE_ID,
            variable: Some(MULTI_STREAM),
            setting: value.to_owned(),
            value: Some(value.to_owned()),
            current: reuse.clone(),
            why,
            evidence: ev_of(streams),
            conflicts_with: Vec::new(),
        });
    }
    None
}

/// gc at epoch ends: garbage from earlier steps, held by reference cycles, live at the peak.
fn gc_at_epoch_end(f: &Facts<'_>) -> Option<Recommendation> {
    let gc = &f.m.gc;
    if gc.significant() {
        let why = format!(
            "at the peak of {} live tensor memory, {} ({:.0}%, {} block(s)) were tensors from earlier steps that only \
             Python's garbage collector freed, later: they sat in reference cycles after the program dropped them. \
             In all the collector freed {} block(s) ({}) past the step they were born in, {:.1} step(s) later on \
             average; collecting at the end of each epoch (or every few steps when epochs are long) frees them \
             before the next peak",
            b(gc.peak_bytes),
            b(gc.held_at_peak),
            gc.held_at_peak as f64 * 100.0 / gc.peak_bytes.max(1) as f64,
            gc.held_blocks_at_peak,
            gc.late_blocks,
            b(gc.late_bytes),
            gc.mean_steps_late
        );
        return Some(Recommendation {
            id: GC_AT_EPOCH_END,
            variable: None,
            setting: "import gc; gc.collect() at the end of each epoch".to_owned(),
            value: None,
            current: None,
            why,
            evidence: ev_of(gc),
            conflicts_with: Vec::new(),
        });
    }
    None
}

/// ATB_WORKSPACE_MEM_ALLOC_ALG_TYPE: intermediates laid out by ATB's default are a large part
/// of the peak. Only unset or the default 1 are replaced: any other value is a choice.
fn atb_workspace_alg_type(f: &Facts<'_>) -> Option<Recommendation> {
    let (settings, atb) = (f.settings, &f.m.atb);
    let atb_current = settings.get(ATB_ALG_TYPE).cloned();
    if atb.significant() && atb_current.as_deref().is_none_or(|v| v.trim() == "1") {
        return Some(atb_recommendation(atb, atb_current, settings.get(ATB_ALLOC_GLOBAL).map(String::as_str)));
    }
    None
}

fn atb_recommendation(atb: &AtbWorkspace, current: Option<String>, global: Option<&str>) -> Recommendation {
    let top = atb.ops.first().cloned().unwrap_or_default();
    let mut why = format!(
        "ATB operations ran {} time(s) ({} operation(s)); the largest, {} (pid {}, {} execution(s)), asked its caller for \
         a workspace of {}: {} of kernel scratch and {} of intermediate tensors. Those intermediates are {:.0}% of the \
         peak of {} {}, and ATB_WORKSPACE_MEM_ALLOC_ALG_TYPE, the algorithm that lays them out inside the workspace, was \
         {}. Another algorithm can place intermediates that are never live together in the same memory: {} is what \
         deployment scripts tuned for memory set (2 is also worth a try); re-run with it and compare the peak",
        atb.executions,
        atb.op_count,
        top.op,
        top.pid,
        top.executions,
        b(top.total()),
        b(top.workspace_size),
        b(top.intermediate_size),
        atb.intermediate_share() * 100.0,
        b(atb.peak_bytes),
        atb.peak_basis,
        match &current {
            Some(v) => format!("{} (ATB's default)", v.trim()),
            None => "unset (ATB's default, 1)".to_owned(),
        },
        ATB_ALG_ADVISED,
    );
    if global.is_none() {
        why.push_str(&format!(
            "; {ATB_ALLOC_GLOBAL} is unset: set it to 1 as well, which those scripts pair with it so that intermediate \
             memory is sized and laid out over the whole graph"
        ));
    }
    let ops: Vec<serde_json::Value> = atb
        .ops
        .iter()
        .map(|o| {
            serde_json::json!({"op": o.op, "pid": o.pid, "executions": o.executions,
                               "workspace_size": o.workspace_size, "intermediate_size": o.intermediate_size})
        })
        .collect();
    let evidence = ev(&[
        ("executions", atb.executions.into()),
        ("operations", atb.op_count.into()),
        ("largest_workspace", atb.largest_workspace.into()),
        ("largest_intermediate", atb.largest_intermediate.into()),
        ("largest_total", atb.largest_total.into()),
        ("peak_bytes", atb.peak_bytes.into()),
        ("peak_basis", atb.peak_basis.into()),
        ("intermediate_share", ((atb.intermediate_share() * 1000.0).round() / 1000.0).into()),
        ("workspace_share", ((atb.total_share() * 1000.0).round() / 1000.0).into()),
        ("ops", ops.into()),
    ]);
    Recommendation {
        id: ATB_ALG_RULE,
        variable: Some(ATB_ALG_TYPE),
        setting: format!("{ATB_ALG_TYPE}={ATB_ALG_ADVISED}"),
        value: Some(ATB_ALG_ADVISED.to_owned()),
        current,
        why,
        evidence,
        conflicts_with: Vec::new(),
    }
}

/// Runs the replays and the rules on one DB, reading its rows once for all the replays.
pub fn analyse(db: &DumpDb, device: &str) -> Result<(Advice, Report), AnalysisError> {
    let path = db.path();
    // The step replays read `Name`, and refuse a table without it.
    db.require_columns(&["Name"])?;
    let mut pool = fragmentation::Shared::new(fragmentation::Options::default());
    let mut gc = gc_held::Replay::default();
    let mut streams = stream_reuse::Scan::default();
    let mut atb = atb_workspace::Replay::for_db(db)?;
    let mut consumers: Vec<&mut dyn Consumer> = vec![&mut pool, &mut gc, &mut streams];
    consumers.extend(atb.as_mut().map(|a| a as &mut dyn Consumer));
    pass::run(db, &mut consumers)?;
    let report = pool.finish();
    let settings = read_settings(db)?;
    let (gc, streams) = (gc.finish(), streams.finish());
    let atb = atb.map(atb_workspace::Replay::finish).unwrap_or_default();
    let (measured, recommendations) = advise(&report, &settings, &gc, &streams, &atb);
    let advice =
        Advice { db: path.display().to_string(), device: device.to_owned(), settings, measured, recommendations };
    Ok((advice, report))
}

pub fn text(advice: &Advice, report: &Report) -> String {
    let mut out = String::new();
    let m = &advice.measured;
    let _ = writeln!(out, "device {}: {}", advice.device, advice.db);
    let conf = advice.settings.get(ALLOC_CONF).map_or_else(|| "unset".to_owned(), |v| format!("`{v}`"));
    let others: Vec<String> =
        advice.settings.iter().filter(|(k, _)| *k != ALLOC_CONF).map(|(k, v)| format!("{k}={v}")).collect();
    let _ = writeln!(
        out,
        "  settings at the start: {ALLOC_CONF} {conf}{}",
        if others.is_empty() { String::new() } else { format!("; {}", others.join(", ")) }
    );
    if m.atb.executions > 0 {
        let _ = writeln!(
            out,
            "  ATB: {} execution(s) of {} operation(s); workspaces up to {} (scratch up to {}, intermediates up to {}), \
             the intermediates {:.0}% of the peak of {} {}",
            m.atb.executions,
            m.atb.op_count,
            b(m.atb.largest_total),
            b(m.atb.largest_workspace),
            b(m.atb.largest_intermediate),
            m.atb.intermediate_share() * 100.0,
            b(m.atb.peak_bytes),
            m.atb.peak_basis
        );
    }
    if m.peak_reserved == 0 {
        let _ = writeln!(out, "  no caching-pool memory in this trace (no PTA blocks or pool segments)");
        if advice.recommendations.is_empty() {
            let _ = writeln!(out, "  advice: nothing to change");
        }
        recommendations(&mut out, advice);
        return out;
    }
    let at = match (m.peak_ts_ns, report.start_ns) {
        (Some(ts), Some(start)) => format!(" at {}", relative(ts - start)),
        _ => String::new(),
    };
    let piece = m.largest_free_at_peak.map_or_else(|| "unknown (no segment rows)".to_owned(), b);
    let _ = writeln!(
        out,
        "  peak reserved {}{at}: allocated {}, unused {} ({:.0}%), {} of it in holes of segments in use; largest free piece {piece}",
        b(m.peak_reserved),
        b(m.allocated_at_peak),
        b(m.unused_at_peak),
        m.unused_at_peak as f64 * 100.0 / m.peak_reserved as f64,
        b(m.holes_at_peak)
    );
    let _ = writeln!(
        out,
        "  {} segment(s) taken, {} forced by fragmentation ({}); {} split(s); {} cache flush(es) at the ceiling; {} OOM(s) \
         ({} from fragmentation), {} recovered refusal(s)",
        m.growths,
        m.forced_growths,
        b(m.forced_growth_bytes),
        m.splits,
        m.flushes_at_ceiling,
        m.ooms,
        m.fragmentation_ooms,
        m.recovered_refusals
    );
    if advice.recommendations.is_empty() {
        let _ = writeln!(out, "  advice: nothing to change (no rule's evidence was found)");
    }
    recommendations(&mut out, advice);
    out
}

fn recommendations(out: &mut String, advice: &Advice) {
    for (i, r) in advice.recommendations.iter().enumerate() {
        let what = match (r.variable, &r.value) {
            (Some(var), Some(value)) => format!("{var}={value}"),
            _ => r.setting.clone(),
        };
        let _ = writeln!(out, "  {}. {what}", i + 1);
        let _ = writeln!(out, "     why: {}", r.why);
        if !r.conflicts_with.is_empty() {
            let _ =
                writeln!(out, "     either this or {} (torch_npu refuses them together)", r.conflicts_with.join(", "));
        }
    }
}

pub const ADVICE_TABLE: &str = "ms_advice";
const CREATE_ADVICE: &str = "CREATE TABLE ms_advice (
    device TEXT NOT NULL, rank INTEGER NOT NULL, id TEXT NOT NULL, variable TEXT, setting TEXT NOT NULL,
    value TEXT, current TEXT, why TEXT NOT NULL, evidence TEXT NOT NULL, conflicts_with TEXT NOT NULL)";

/// Replaces `ms_advice` and `ms_fragmentation` in one transaction; returns the rows written.
pub fn store(db: &DumpDb, advice: &Advice, report: &Report, run_wall_ns: u64) -> Result<usize, AnalysisError> {
    let tables = [fragmentation::create_fragmentation(), (ADVICE_TABLE, CREATE_ADVICE)];
    db.replace_tables(&tables, &[("advise_at", run_wall_ns.to_string())], |tx| {
        let mut rows = fragmentation::fill_samples(tx, &advice.device, &report.samples)?;
        let mut insert = tx.prepare("INSERT INTO ms_advice VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)")?;
        for (i, r) in advice.recommendations.iter().enumerate() {
            insert.execute(params![
                advice.device,
                i as i64 + 1,
                r.id,
                r.variable,
                r.setting,
                r.value,
                r.current,
                r.why,
                serde_json::to_string(&r.evidence).unwrap_or_default(),
                r.conflicts_with.join(",")
            ])?;
            rows += 1;
        }
        Ok(rows)
    })
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::analysis::fragmentation::fx::Fx;

    const M: u64 = MIB;

    /// The DB at `path`, opened as `advise` opens it to write its results.
    fn open(path: &Path) -> DumpDb {
        DumpDb::open(path, true).unwrap()
    }

    fn advice(path: &Path) -> (Measured, Vec<Recommendation>) {
        let (a, _) = analyse(&open(path), "0").unwrap();
        (a.measured, a.recommendations)
    }

    fn ids(recs: &[Recommendation]) -> Vec<&'static str> {
        recs.iter().map(|r| r.id).collect()
    }

    /// Three 20 MiB segments of 6 MiB blocks with 6 and 8 MiB holes (36 MiB), then two 11 MiB
    /// requests that fit none: two fragmentation-forced segments.
    fn holes_rows(fx: &mut Fx) {
        let bases = [0x1000_0000u64, 0x2000_0000, 0x3000_0000];
        for base in bases {
            fx.segment(1, base, 20 * M, false);
            for i in 0..3 {
                fx.block(1, base + i * 6 * M, 6 * M, "PTA");
            }
        }
        for (i, base) in bases.iter().enumerate() {
            fx.free(1, base + 12 * M, 6 * M);
            if i > 0 {
                fx.free(1, *base, 6 * M);
            }
        }
        for base in [0x4000_0000u64, 0x5000_0000] {
            fx.segment(1, base, 12 * M, false);
            fx.block(1, base, 12 * M, "PTA");
        }
    }

    fn holes(name: &str, conf: Option<&str>) -> std::path::PathBuf {
        let mut fx = Fx::new(name);
        if let Some(conf) = conf {
            fx.meta("env.PYTORCH_NPU_ALLOC_CONF", conf);
        }
        fx.meta("env.HCCL_BUFFSIZE", "200");
        holes_rows(&mut fx);
        fx.stop()
    }

    #[test]
    fn holes_that_force_growth_recommend_expandable_segments() {
        let (m, recs) = advice(&holes("advise-holes", None));
        assert_eq!((m.forced_growths, m.forced_growth_bytes, m.peak_reserved), (2, 24 * M, 84 * M));
        assert_eq!(m.holes_at_peak, 36 * M);
        assert_eq!(ids(&recs), ["expandable_segments"]);
        let r = &recs[0];
        assert_eq!(
            (r.variable, r.setting.as_str(), r.value.as_deref(), r.current.as_deref()),
            (Some(ALLOC_CONF), "expandable_segments:True", Some("expandable_segments:True"), None)
        );
        assert!(r.why.contains("took 2 new segment(s) (24.0 MiB)"), "{}", r.why);
        assert!(r.why.contains("36.0 MiB (43%) were such holes"), "{}", r.why);
        assert_eq!(r.evidence["forced_growths"], 2);
    }

    #[test]
    fn the_current_setting_is_respected() {
        // Already on: nothing to say.
        let (_, recs) = advice(&holes("advise-on", Some("expandable_segments:True")));
        assert!(recs.is_empty(), "{recs:?}");
        // Other keys are kept; the ones torch_npu refuses with expandable segments are dropped.
        let (_, recs) = advice(&holes("advise-merge", Some("max_split_size_mb:128,roundup_power2_divisions:4")));
        assert_eq!(ids(&recs), ["expandable_segments"]);
        assert_eq!(recs[0].value.as_deref(), Some("roundup_power2_divisions:4,expandable_segments:True"));
        assert_eq!(recs[0].current.as_deref(), Some("max_split_size_mb:128,roundup_power2_divisions:4"));
        assert!(recs[0].why.contains("max_split_size_mb removed"), "{}", recs[0].why);
    }

    fn bigsplit(name: &str, conf: Option<&str>) -> std::path::PathBuf {
        let mut fx = Fx::new(name);
        if let Some(conf) = conf {
            fx.meta("env.PYTORCH_NPU_ALLOC_CONF", conf);
        }
        fx.segment(1, 0x1000_0000, 96 * M, false);
        fx.block(1, 0x1000_0000, 96 * M, "PTA");
        fx.free(1, 0x1000_0000, 96 * M);
        for i in 0..8 {
            fx.block(1, 0x1000_0000 + i * 4 * M, 4 * M, "PTA");
        }
        fx.segment(1, 0x2000_0000, 96 * M, false);
        fx.block(1, 0x2000_0000, 96 * M, "PTA");
        fx.stop()
    }

    #[test]
    fn big_segments_held_by_small_blocks_recommend_max_split_size() {
        let (m, recs) = advice(&bigsplit("advise-bigsplit", None));
        assert_eq!(m.pinned_big_growths, 1);
        assert_eq!(ids(&recs), ["max_split_size_mb"]);
        assert_eq!(recs[0].value.as_deref(), Some("max_split_size_mb:64"));
        assert!(recs[0].why.contains("the smallest 96.0 MiB"), "{}", recs[0].why);
        // Not with expandable segments (refused together), nor when already set.
        assert!(advice(&bigsplit("advise-bigsplit-exp", Some("expandable_segments:True"))).1.is_empty());
        assert!(advice(&bigsplit("advise-bigsplit-set", Some("max_split_size_mb:200"))).1.is_empty());
    }

    /// Per step, two blocks bigger than the last step's; from step 2 on, each step's first
    /// allocation frees the cached (too small) segments at the ceiling and takes a new one.
    fn pressure(name: &str, steps: u64, empty_cache_fits: bool) -> std::path::PathBuf {
        let mut fx = Fx::new(name);
        let mut live: Vec<(u64, u64)> = Vec::new();
        for s in 0..steps {
            let size = if empty_cache_fits { 40 * M } else { (40 + 8 * s) * M };
            for (ptr, sz) in live.drain(..) {
                fx.hal_free(1, ptr, sz);
            }
            for i in 0..2 {
                let ptr = 0x1000_0000 * (s + 1) + i * 0x100_0000;
                fx.segment(1, ptr, size, false);
                fx.block(1, ptr, size, "PTA");
                live.push((ptr, size));
            }
            fx.step(s as i64 + 1);
            for &(ptr, sz) in &live {
                fx.free(1, ptr, sz);
            }
        }
        fx.stop()
    }

    #[test]
    fn repeated_flushes_at_the_ceiling_recommend_garbage_collection() {
        let (m, recs) = advice(&pressure("advise-gc", 4, false));
        assert_eq!(m.flushes_at_ceiling, 3, "{m:?}");
        assert_eq!(ids(&recs), ["garbage_collection_threshold"]);
        // At most 2 x 64 MiB allocated against a ceiling of 2 x 56 MiB reserved.
        assert_eq!(recs[0].setting, "garbage_collection_threshold:0.9");
        assert!(recs[0].why.contains("3 time(s)"), "{}", recs[0].why);
        // Once is not a pattern; and emptying a cache that could have served the next request is
        // the program's own empty_cache(), not a ceiling.
        assert!(advice(&pressure("advise-gc-once", 2, false)).1.is_empty());
        let (m, recs) = advice(&pressure("advise-gc-fits", 4, true));
        assert_eq!((m.flushes_at_ceiling, recs.len()), (0, 0));
    }

    #[test]
    fn processes_sharing_a_device_get_fractions() {
        let mut fx = Fx::new("advise-shared");
        for (pid, base, size) in [(10, 0x1000_0000u64, 60 * M), (11, 0x2000_0000, 20 * M)] {
            fx.segment(pid, base, size, false);
            fx.block(pid, base, size, "PTA");
        }
        let (_, recs) = advice(&fx.stop());
        assert_eq!(ids(&recs), ["per_process_memory_fraction"]);
        let r = &recs[0];
        assert_eq!(r.variable, None);
        assert_eq!(
            r.setting,
            "torch_npu.npu.set_per_process_memory_fraction(0.71) in pid 10, set_per_process_memory_fraction(0.23) in pid 11"
        );
    }

    #[test]
    fn a_clean_pool_and_an_empty_trace_get_no_advice() {
        let mut fx = Fx::new("advise-clean");
        for step in 0..3 {
            for i in 0..5u64 {
                if step == 0 && i == 0 {
                    fx.segment(1, 0x1000_0000, 20 * M, false);
                }
                fx.block(1, 0x1000_0000 + i * 4 * M, 4 * M, "PTA");
            }
            fx.step(step + 1);
            for i in 0..5u64 {
                fx.free(1, 0x1000_0000 + i * 4 * M, 4 * M);
            }
        }
        let path = fx.stop();
        let (advice, report) = analyse(&open(&path), "0").unwrap();
        assert!(advice.recommendations.is_empty());
        assert!(text(&advice, &report).contains("advice: nothing to change"));
        let (advice, report) = analyse(&open(&Fx::new("advise-empty").stop()), "0").unwrap();
        assert!(advice.recommendations.is_empty());
        assert!(text(&advice, &report).contains("no caching-pool memory"));
    }

    #[test]
    fn an_oom_from_fragmentation_recommends_expandable_segments() {
        let mut fx = Fx::new("advise-oom");
        fx.segment(1, 0x1000_0000, 20 * M, false);
        for i in 0..4 {
            fx.block(1, 0x1000_0000 + i * 5 * M, 5 * M, "PTA");
        }
        fx.free(1, 0x1000_0000, 5 * M);
        fx.free(1, 0x1000_0000 + 10 * M, 5 * M);
        fx.oom(1, "aclrtMallocAlign32", 20 * M);
        fx.oom(1, "DeviceCachingAllocator::malloc", 8 * M);
        let (m, recs) = advice(&fx.stop());
        assert_eq!((m.ooms, m.fragmentation_ooms), (1, 1));
        assert_eq!(ids(&recs), ["expandable_segments"]);
        assert!(recs[0].why.contains("1 allocation(s) failed with enough reserved but unused memory"));
    }

    #[test]
    fn conflicting_recommendations_say_so() {
        // Holes and a pinned big segment in one trace: both fire, and torch_npu takes only one.
        let mut fx = Fx::new("advise-both");
        holes_rows(&mut fx);
        fx.segment(1, 0x6000_0000, 64 * M, false);
        fx.block(1, 0x6000_0000, 4 * M, "PTA");
        fx.segment(1, 0x7000_0000, 64 * M, false);
        fx.block(1, 0x7000_0000, 64 * M, "PTA");
        let (_, recs) = advice(&fx.stop());
        assert_eq!(ids(&recs), ["expandable_segments", "max_split_size_mb"]);
        assert_eq!(recs[0].conflicts_with, ["max_split_size_mb"]);
        assert_eq!(recs[1].conflicts_with, ["expandable_segments"]);
    }

    /// A job whose ATB graph asks for `intermediate` bytes of intermediates next to 32 MiB of
    /// weights and a 20 MiB activation segment, with ATB_WORKSPACE_MEM_ALLOC_ALG_TYPE and
    /// ATB_WORKSPACE_MEM_ALLOC_GLOBAL as given.
    fn atb_job(name: &str, intermediate: u64, alg: Option<&str>, global: Option<&str>) -> std::path::PathBuf {
        let mut fx = Fx::new(name);
        if let Some(v) = alg {
            fx.meta("env.ATB_WORKSPACE_MEM_ALLOC_ALG_TYPE", v);
        }
        if let Some(v) = global {
            fx.meta("env.ATB_WORKSPACE_MEM_ALLOC_GLOBAL", v);
        }
        fx.hal(1, 0x1000_0000, 32 * M, "CANN@APP");
        let block = (intermediate + M + 32).div_ceil(2 * M) * 2 * M;
        fx.hal(1, 0x2000_0000, block, "CANN@APP");
        for _ in 0..3 {
            fx.segment(1, 0x3000_0000, 20 * M, false);
            fx.block(1, 0x3000_0000, 4 * M, "PTA");
            fx.atb(1, 0x55, M, intermediate);
            fx.atb(1, 0x66, M / 2, intermediate / 4);
            fx.free(1, 0x3000_0000, 4 * M);
            fx.hal_free(1, 0x3000_0000, 20 * M);
        }
        fx.stop()
    }

    #[test]
    fn large_atb_intermediates_under_the_default_algorithm_recommend_alg_type_3() {
        let path = atb_job("advise-atb", 44 * M, None, None);
        let (advised, report) = analyse(&open(&path), "0").unwrap();
        let recs = &advised.recommendations;
        assert_eq!(ids(recs), [ATB_ALG_RULE]);
        let r = &recs[0];
        assert_eq!(
            (r.variable, r.setting.as_str(), r.value.as_deref(), r.current.as_deref()),
            (Some(ATB_ALG_TYPE), "ATB_WORKSPACE_MEM_ALLOC_ALG_TYPE=3", Some("3"), None)
        );
        // Peak: 32 MiB weights + a 46 MiB workspace block + the 20 MiB segment.
        assert_eq!(
            (r.evidence["peak_bytes"].as_u64(), r.evidence["largest_intermediate"].as_u64()),
            (Some(98 * M), Some(44 * M))
        );
        assert_eq!((r.evidence["executions"].as_u64(), r.evidence["operations"].as_u64()), (Some(6), Some(2)));
        assert_eq!(r.evidence["ops"][0]["op"], "Runner@0x55");
        assert!(r.why.contains("44.0 MiB of intermediate tensors"), "{}", r.why);
        assert!(r.why.contains("45% of the peak of 98.0 MiB device memory (HAL blocks)"), "{}", r.why);
        assert!(r.why.contains("was unset (ATB's default, 1)"), "{}", r.why);
        assert!(r.why.contains("ATB_WORKSPACE_MEM_ALLOC_GLOBAL is unset: set it to 1"), "{}", r.why);
        let shown = text(&advised, &report);
        assert!(shown.contains("ATB_WORKSPACE_MEM_ALLOC_ALG_TYPE=3"), "{shown}");
        assert!(shown.contains("ATB: 6 execution(s) of 2 operation(s)"), "{shown}");

        // The default written out is replaced too; GLOBAL already on is not mentioned.
        let (_, recs) = advice(&atb_job("advise-atb-1", 44 * M, Some("1"), Some("1")));
        assert_eq!(ids(&recs), [ATB_ALG_RULE]);
        assert_eq!(recs[0].current.as_deref(), Some("1"));
        assert!(recs[0].why.contains("was 1 (ATB's default)"), "{}", recs[0].why);
        assert!(!recs[0].why.contains("GLOBAL"), "{}", recs[0].why);
    }

    #[test]
    fn atb_alg_type_is_never_recommended_when_chosen_or_when_intermediates_are_small() {
        for set in ["3", "2", "0"] {
            let (m, recs) = advice(&atb_job(&format!("advise-atb-set{set}"), 44 * M, Some(set), None));
            assert!(m.atb.significant(), "the evidence is there");
            assert!(recs.is_empty(), "{set} is a choice: {recs:?}");
        }
        // 2.75 MiB of intermediates next to 56 MiB: under the 10% share.
        let (m, recs) = advice(&atb_job("advise-atb-small", 2816 << 10, None, None));
        assert_eq!(m.atb.executions, 6);
        assert!(!m.atb.significant() && recs.is_empty(), "{recs:?}");
        // No ATB at all: nothing measured, nothing said.
        let (advised, report) = analyse(&open(&holes("advise-no-atb", None)), "0").unwrap();
        assert_eq!(advised.measured.atb.executions, 0);
        assert!(!text(&advised, &report).contains("ATB:"));
    }

    #[test]
    fn alloc_conf_round_trips() {
        let c = AllocConf::parse("expandable_segments:True, max_split_size_mb:64,bogus");
        assert_eq!(c.get("max_split_size_mb"), Some("64"));
        assert!(c.expandable());
        assert_eq!(c.with("max_split_size_mb", "32", &["expandable_segments"]).to_string(), "max_split_size_mb:32");
        assert_eq!(AllocConf::parse("").to_string(), "");
        assert_eq!(split_limit_mib(96), 64);
        assert_eq!(split_limit_mib(24), 21);
        assert_eq!(split_limit_mib(4096), 4096);
    }

    #[test]
    fn settings_come_from_ms_meta_and_the_advice_is_stored() {
        let path = holes("advise-store", Some("garbage_collection_threshold:0.7"));
        let (advice, report) = analyse(&open(&path), "0").unwrap();
        assert_eq!(advice.settings.get("HCCL_BUFFSIZE").map(String::as_str), Some("200"));
        for run in 0..2 {
            store(&open(&path), &advice, &report, 5 + run).unwrap();
        }
        let conn = rusqlite::Connection::open(&path).unwrap();
        let count = |sql: &str| -> i64 { conn.query_row(sql, [], |r| r.get(0)).unwrap() };
        assert_eq!(count("SELECT count(*) FROM ms_advice"), 1);
        assert_eq!(count("SELECT count(*) FROM ms_fragmentation"), report.samples.len() as i64);
        assert_eq!(
            count("SELECT count(*) FROM ms_fragmentation WHERE reason = 'peak_reserved' AND reserved = 88080384"),
            1
        );
        let value: String = conn.query_row("SELECT value FROM ms_advice", [], |r| r.get(0)).unwrap();
        assert_eq!(value, "expandable_segments:True");
        assert_eq!(count("SELECT count(*) FROM ms_meta WHERE key = 'advise_at' AND value = '6'"), 1);
        // No ms_meta (msMemScope's DBs): settings unknown, nothing stamped.
        conn.execute_batch("DROP TABLE ms_meta").unwrap();
        assert!(read_settings(&open(&path)).unwrap().is_empty());
        store(&open(&path), &advice, &report, 9).unwrap();
    }
}
