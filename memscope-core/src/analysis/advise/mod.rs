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
use super::render::relative;
use super::simulate;
use super::stream_reuse::{self, StreamReuse};
use super::AnalysisError;
use crate::apis::Backend;
use crate::units::human_bytes;

mod out;
mod rules;
#[cfg(test)]
mod tests;

pub use out::{store, text, ADVICE_TABLE, SIMULATION_TABLE};
use rules::*;

/// The id of the one recommendation that is not an allocator setting but a code change.
pub const GC_AT_EPOCH_END: &str = "gc_at_epoch_end";

/// torch_npu's multi-stream reuse switch (0 off, 1 erase marks at wait, the default, 2 never
/// mark, 3 also erase the marks of tensors freed before the wait), and its recommendation's id.
pub const MULTI_STREAM: &str = "MULTI_STREAM_MEMORY_REUSE";
pub const MULTI_STREAM_REUSE_ID: &str = "multi_stream_memory_reuse";

/// The allocator's configuration variable on Ascend (torch_npu reads it once, at its first
/// allocation); a CUDA trace's is PyTorch's `PYTORCH_CUDA_ALLOC_CONF`, with the same keys
/// (`Backend::alloc_conf`).
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

    /// The items in the order given (a key given twice: the last wins, as in the allocators).
    pub fn items(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v.as_str()))
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
    /// What the setting would have given, replayed through the allocator model
    /// ([`crate::analysis::simulate`]); `None` for advice that is not an allocator setting.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted: Option<simulate::Figures>,
    /// Its place among the predicted settings (1: the lowest peak reserved without OOM).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted_rank: Option<usize>,
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
    /// Whether the capture recorded the settings: only a DB `trace` wrote does (msMemScope's
    /// captures and CSV traces do not), elsewhere no setting is known and the advice takes none
    /// as set.
    pub settings_known: bool,
    /// The variable that configures the traced stack's caching allocator
    /// (`PYTORCH_NPU_ALLOC_CONF`, or `PYTORCH_CUDA_ALLOC_CONF` for a CUDA trace).
    pub alloc_conf: &'static str,
    pub measured: Measured,
    pub recommendations: Vec<Recommendation>,
    /// The replay of the caching allocator's requests: the run as recorded, as replayed under
    /// its own settings (and their agreement), and under each setting asked for (`None`: no
    /// caching-pool requests in the trace).
    #[serde(flatten)]
    pub simulation: Option<simulate::Report>,
}

/// Whether the DB has our `ms_meta` table (msMemScope's DBs do not).
fn has_meta(db: &DumpDb) -> Result<bool, AnalysisError> {
    let has: i64 = db
        .conn()
        .query_row("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'ms_meta'", [], |r| r.get(0))
        .map_err(|source| AnalysisError::Read { path: db.path().to_owned(), source })?;
    Ok(has > 0)
}

/// The `env.*` keys of `ms_meta`, without the prefix; empty when the DB has no `ms_meta`
/// (msMemScope's DBs), which the advice then says.
pub fn read_settings(db: &DumpDb) -> Result<BTreeMap<String, String>, AnalysisError> {
    let read = |source| AnalysisError::Read { path: db.path().to_owned(), source };
    let conn = db.conn();
    if !has_meta(db)? {
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

/// The accelerator stack a DB was traced on (ms_meta `backend`): CUDA when it says so, Ascend
/// otherwise (msMemScope's DBs, and ours from before the key).
pub fn read_backend(db: &DumpDb) -> Result<Backend, AnalysisError> {
    let read = |source| AnalysisError::Read { path: db.path().to_owned(), source };
    let conn = db.conn();
    if !has_meta(db)? {
        return Ok(Backend::Ascend);
    }
    let value: Option<String> = conn
        .query_row("SELECT value FROM ms_meta WHERE key = 'backend'", [], |r| r.get(0))
        .map(Some)
        .or_else(|e| if e == rusqlite::Error::QueryReturnedNoRows { Ok(None) } else { Err(e) })
        .map_err(read)?;
    Ok(if value.as_deref() == Some(Backend::Cuda.as_str()) { Backend::Cuda } else { Backend::Ascend })
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
    /// Whose allocator: the variable and the Python module the advice names.
    backend: Backend,
    /// The allocator's configuration variable at the start, as set and parsed.
    current: Option<String>,
    conf: AllocConf,
}

impl Facts<'_> {
    /// A recommendation of one allocator-configuration `key:value` (dropping the keys `drop`).
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
            variable: Some(self.backend.alloc_conf()),
            setting: format!("{key}:{value}"),
            value: Some(self.conf.with(key, value, drop).to_string()),
            current: self.current.clone(),
            why,
            evidence,
            conflicts_with: Vec::new(),
            predicted: None,
            predicted_rank: None,
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
    backend: Backend,
    gc: &GcHeld,
    streams: &StreamReuse,
    atb: &AtbWorkspace,
) -> (Measured, Vec<Recommendation>) {
    let mut m = measure(report);
    m.gc = gc.clone();
    m.streams = streams.clone();
    m.atb = atb.clone();
    let current = settings.get(backend.alloc_conf()).cloned();
    let conf = AllocConf::parse(current.as_deref().unwrap_or(""));
    let facts = Facts { report, settings, m, backend, current, conf };
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

/// Runs the replays and the rules on one DB, reading its rows once for all the replays, then the
/// allocator model under the run's settings, each recommended one and each of `simulate`'s.
pub fn analyse(db: &DumpDb, device: &str, sim: &simulate::Options) -> Result<(Advice, Report), AnalysisError> {
    let path = db.path();
    // The step replays read `Name`, and refuse a table without it.
    db.require_columns(&["Name"])?;
    let mut pool = fragmentation::Shared::new(fragmentation::Options::default());
    let mut gc = gc_held::Replay::default();
    let mut streams = stream_reuse::Scan::default();
    let mut atb = atb_workspace::Replay::for_db(db)?;
    let mut requests = simulate::trace::Reader::new(sim.fraction.is_some());
    let mut consumers: Vec<&mut dyn Consumer> = vec![&mut pool, &mut gc, &mut streams, &mut requests];
    consumers.extend(atb.as_mut().map(|a| a as &mut dyn Consumer));
    pass::run(db, &mut consumers)?;
    let report = pool.finish();
    let settings = read_settings(db)?;
    let settings_known = db.origin()?.has_settings();
    let backend = read_backend(db)?;
    let (gc, streams) = (gc.finish(), streams.finish());
    let atb = atb.map(atb_workspace::Replay::finish).unwrap_or_default();
    let (measured, mut recommendations) = advise(&report, &settings, backend, &gc, &streams, &atb);
    // Host memory (`cpu`; msLeaks' early captures call it `host` and write it as HAL rows) has no
    // device allocator to configure: only the collector's rule is about it.
    if matches!(device, "cpu" | "host") {
        recommendations.retain(|r| r.id == GC_AT_EPOCH_END);
    }
    let alloc_conf = backend.alloc_conf();
    let sim = simulate::Options { flavour: simulate::Flavour::of(backend), ..sim.clone() };
    let base = settings.get(alloc_conf).cloned().unwrap_or_default();
    let simulation = predict(&requests.finish(), &base, &sim, &mut recommendations)
        .map_err(|source| AnalysisError::Setting { path: path.to_owned(), source })?;
    let (db, device) = (path.display().to_string(), device.to_owned());
    let advice = Advice { db, device, settings, settings_known, alloc_conf, measured, recommendations, simulation };
    Ok((advice, report))
}

/// Replays the requests (when the trace has any) under the run's settings, those asked for and
/// each recommended allocator setting, which it ranks by the peak reserved memory it would give
/// (a setting that runs out of memory last).
fn predict(
    trace: &simulate::trace::Trace,
    base: &str,
    sim: &simulate::Options,
    recs: &mut [Recommendation],
) -> Result<Option<simulate::Report>, simulate::SettingError> {
    if !trace.has_requests() {
        return Ok(None);
    }
    // The job's own settings may hold what the model does not know: the advice stands, the
    // replay is left out and says why.
    let only_base = simulate::Options { settings: Vec::new(), ..sim.clone() };
    if let Err(e) = simulate::check(base, &only_base) {
        let note = format!("the job's own allocator settings cannot be replayed, so nothing is: {e}");
        return Ok(Some(simulate::Report { notes: vec![note], ..simulate::Report::default() }));
    }
    let report = simulate::run(trace, base, sim)?;
    for r in recs.iter_mut() {
        if let (Some(_), Some(whole)) = (r.variable.filter(|v| v.ends_with("_ALLOC_CONF")), &r.value) {
            r.predicted = simulate::predict(trace, whole, sim).ok();
        }
    }
    let mut ranked: Vec<(bool, u64, usize)> = recs
        .iter()
        .enumerate()
        .filter_map(|(i, r)| r.predicted.as_ref().map(|p| (p.oom, p.peak_reserved_bytes, i)))
        .collect();
    ranked.sort_unstable();
    for (rank, (_, _, i)) in ranked.into_iter().enumerate() {
        recs[i].predicted_rank = Some(rank + 1);
    }
    Ok(Some(report))
}
