//! Leaks across steps (`analyze --analysis leaks`): msMemScope's step-based leak candidates, the
//! device memory never freed, the live bytes at each step boundary, and their degradation
//! verdict ([`super::degradation`]), printed and stored as `ms_leaks`, `ms_steps` and
//! `ms_degradation`.
//!
//! **Candidates**, as msMemScope's leak analyzer defines them (reference §4.3): a block born
//! after the warm-up (its step > `--warmup-steps`, msMemScope's `skipSteps_` = 1) that was still
//! live at the end of the step `--min-steps` after its birth step (msMemScope's
//! `durationThreshold_` = 1: it lived through one whole step after the one it was born in).
//! A candidate stays one once freed later, as msMemScope's table keeps it. Blocks: `PTA` tensor
//! blocks, `HAL` allocations made outside torch_npu's allocator, and host blocks (a CPU job's
//! tensors, from libc10's allocator; pinned buffers), which msMemScope does not trace. A pool's segments (`HAL`
//! rows with `segment`) are its cache, reused by later tensors: their growth is what the pool's
//! blocks show, so they are not candidates; nor are workspace blocks (operator scratch, kept on
//! purpose; msMemScope leaves that pool out too).
//!
//! **Never freed**: `HAL` blocks with a `MALLOC` and no real `FREE` (shadow frees excepted), as
//! msMemScope warns about at exit; pool segments included and marked, since a pool that holds
//! them at the stop is holding live tensors or cache that was never emptied.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use rusqlite::params;
use serde::Serialize;

use super::db::DumpDb;
use super::decompose::Family;
use super::degradation::{self, FamilyTrend, Verdict};
use super::render::relative;
use super::steps::{BlockEnd, BlockKind, BlockSink, Boundary, StepDb, StepError, StepPoint, StepSummary, Timeline};
use super::AnalysisError;
use crate::printable::printable;
use crate::units::human_bytes;

/// The analysis' knobs (`analyze` flags; `compare` shares `--step-marker`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, clap::Args)]
#[group(id = "leaks_options")]
#[command(next_help_heading = "Leaks and steps (--analysis leaks)")]
pub struct Options {
    /// Blocks born in steps up to N are the warm-up, never leak candidates (msMemScope's
    /// default, 1: model set-up and the first iteration, whose caches and lazily created state
    /// legitimately outlive it). Degradation is judged from the end of step N on.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub warmup_steps: u64,

    /// A block is a candidate when still live N whole steps after the step it was born in
    /// (msMemScope's default, 1: a tensor that survives into the next step's end was not a
    /// temporary of its step).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub min_steps: u64,

    /// Take step boundaries from MSTX marks (or ranges) with this message instead of
    /// memscope.step() / mstx `step start` ranges; each mark starts the next step.
    #[arg(long, value_name = "NAME")]
    pub step_marker: Option<String>,
}

impl Default for Options {
    fn default() -> Self {
        Self { warmup_steps: 1, min_steps: 1, step_marker: None }
    }
}

/// A reported block.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Leak {
    pub family: &'static str,
    /// `block`, `segment` (a pool's reserve) or `workspace`.
    pub block: &'static str,
    pub pid: i64,
    pub ptr: String,
    pub size: i64,
    pub owner: String,
    /// `None`: the trace has no step boundary.
    pub birth_step: Option<u64>,
    /// Whole steps it lived through after its birth step.
    pub steps_alive: Option<u64>,
    pub alloc_ts: i64,
    /// `None`: never freed.
    pub free_ts: Option<i64>,
    pub allocation_id: Option<String>,
    pub python_stack: String,
    pub c_stack: String,
    /// The job's own line that made it (Attr `site`), when the trace read its Python stack.
    pub site: Option<String>,
}

/// The live bytes of one family at one boundary, for reports.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StepBytes {
    pub step: u64,
    pub ts_ns: i64,
    /// (family, live bytes), for the families in the trace.
    pub bytes: Vec<(&'static str, i64)>,
}

pub struct LeakReport {
    pub options: Options,
    pub summary: StepSummary,
    pub start_ns: Option<i64>,
    pub boundaries: Vec<Boundary>,
    pub points: Vec<StepPoint>,
    /// Owner names by slot.
    pub owners: Vec<(Family, String)>,
    pub candidates: Vec<Leak>,
    pub never_freed: Vec<Leak>,
    pub degradation: Vec<FamilyTrend>,
}

fn block_name(kind: BlockKind) -> &'static str {
    match kind {
        BlockKind::Block => "block",
        BlockKind::Segment => "segment",
        BlockKind::Workspace => "workspace",
    }
}

/// Keeps the blocks to report as the replay ends them, so memory stays O(reported).
struct Collect<'o> {
    options: &'o Options,
    candidates: Vec<BlockEnd>,
    never_freed: Vec<BlockEnd>,
}

impl Collect<'_> {
    fn is_candidate(&self, e: &BlockEnd) -> bool {
        // Host blocks are the job's CPU tensors (libc10) or pinned buffers: a CPU training job's
        // leak is one of them.
        let kind_ok = match e.family {
            Family::Pta => e.kind != BlockKind::Workspace,
            Family::Hal => e.kind != BlockKind::Segment,
            Family::Host => true,
        };
        let Some((birth, end)) = e.steps else { return false };
        // Alive at the boundary that ended step birth + min_steps, i.e. the step running when it
        // ended is past that one.
        kind_ok && birth > self.options.warmup_steps && end > birth.saturating_add(self.options.min_steps)
    }
}

impl BlockSink for Collect<'_> {
    fn block_end(&mut self, e: &BlockEnd) {
        if self.is_candidate(e) {
            self.candidates.push(*e);
        }
        if e.family == Family::Hal && e.free_ts.is_none() {
            self.never_freed.push(*e);
        }
    }

    fn restart(&mut self) {
        self.candidates.clear();
        self.never_freed.clear();
    }
}

/// Runs the leak, step and degradation analyses over one DB.
pub fn analyse(dump: &DumpDb, options: &Options) -> Result<LeakReport, StepError> {
    let db = StepDb::new(dump)?;
    let mut collect = Collect { options, candidates: Vec::new(), never_freed: Vec::new() };
    let timeline = Timeline::replay(&db, options.step_marker.as_deref(), &mut collect)?;
    let summary = timeline.summary();
    let owners: Vec<(Family, String)> = (0..timeline.slot_count() as u32)
        .map(|slot| {
            let (family, owner) = timeline.owner(slot);
            (family, owner.to_owned())
        })
        .collect();
    let leak = |e: &BlockEnd| -> Result<Leak, AnalysisError> {
        let details = db.details(e.rowid)?;
        Ok(Leak {
            family: e.family.as_str(),
            block: block_name(e.kind),
            pid: e.pid,
            ptr: format!("0x{:016x}", e.ptr),
            size: e.size,
            owner: owners[e.slot as usize].1.clone(),
            birth_step: e.steps.map(|(birth, _)| birth),
            steps_alive: e.steps.map(|(birth, end)| end.saturating_sub(birth + 1)),
            alloc_ts: e.alloc_ts,
            free_ts: e.free_ts,
            allocation_id: details.allocation_id,
            python_stack: details.python_stack,
            c_stack: details.c_stack,
            site: details.site,
        })
    };
    let mut candidates = collect.candidates.iter().map(leak).collect::<Result<Vec<_>, _>>()?;
    candidates.sort_by(|a, b| (a.family, &a.owner, a.alloc_ts).cmp(&(b.family, &b.owner, b.alloc_ts)));
    let never_freed = collect.never_freed.iter().map(leak).collect::<Result<Vec<_>, _>>()?;
    let degradation = degradation::analyse(&timeline.points, &summary.families, options.warmup_steps, |slot| {
        let (family, owner) = &owners[slot as usize];
        (*family, owner.as_str())
    });
    Ok(LeakReport {
        options: options.clone(),
        start_ns: timeline.start_ns(),
        boundaries: timeline.boundaries.clone(),
        points: timeline.points,
        summary,
        owners,
        candidates,
        never_freed,
        degradation,
    })
}

impl LeakReport {
    pub fn step_bytes(&self) -> Vec<StepBytes> {
        self.points
            .iter()
            .filter_map(|p| {
                let bytes = self.summary.families.iter().map(|f| (f.as_str(), p.total(*f))).collect();
                Some(StepBytes { step: p.step?, ts_ns: p.ts, bytes })
            })
            .collect()
    }
}

// ---------------------------------------------------------------- stored results

pub const STEPS_TABLE: &str = "ms_steps";
pub const LEAKS_TABLE: &str = "ms_leaks";
pub const DEGRADATION_TABLE: &str = "ms_degradation";

/// Our three tables (docs/db-schema.md), replaced together on every run.
const TABLES: [(&str, &str); 3] = [
    (
        STEPS_TABLE,
        "CREATE TABLE ms_steps (step INTEGER NOT NULL, ts_ns INTEGER NOT NULL, family TEXT NOT NULL,
        owner TEXT NOT NULL, bytes INTEGER NOT NULL, blocks INTEGER NOT NULL)",
    ),
    (
        LEAKS_TABLE,
        "CREATE TABLE ms_leaks (kind TEXT NOT NULL, family TEXT NOT NULL, block TEXT NOT NULL,
        pid INTEGER NOT NULL, ptr TEXT NOT NULL, size INTEGER NOT NULL, owner TEXT NOT NULL,
        birth_step INTEGER, steps_alive INTEGER, alloc_ts INTEGER NOT NULL, free_ts INTEGER,
        allocation_id TEXT, python_stack TEXT NOT NULL, c_stack TEXT NOT NULL)",
    ),
    (
        DEGRADATION_TABLE,
        "CREATE TABLE ms_degradation (family TEXT NOT NULL, owner TEXT NOT NULL, first_step INTEGER,
        last_step INTEGER, first_bytes INTEGER NOT NULL, last_bytes INTEGER NOT NULL,
        delta_bytes INTEGER NOT NULL, points INTEGER, slope_per_step REAL, rise_bytes REAL,
        noise_floor_bytes REAL, mk_s INTEGER, mk_z REAL, p_value REAL, verdict TEXT)",
    ),
];

/// Replaces our three tables with `report` and stamps `ms_meta.leaks_at` (when the file has our
/// `ms_meta`). One transaction: all of it lands or the file is unchanged. Returns rows written.
pub fn store(db: &DumpDb, report: &LeakReport, run_wall_ns: u64) -> Result<usize, AnalysisError> {
    db.replace_tables(&TABLES, &[("leaks_at", run_wall_ns.to_string())], |tx| fill(tx, report))
}

fn fill(tx: &rusqlite::Transaction<'_>, report: &LeakReport) -> rusqlite::Result<usize> {
    let mut written = 0;
    {
        let mut insert = tx.prepare("INSERT INTO ms_steps VALUES (?1, ?2, ?3, ?4, ?5, ?6)")?;
        for p in &report.points {
            let Some(step) = p.step else { continue };
            for family in &report.summary.families {
                let blocks: u64 =
                    p.owners.iter().filter(|o| report.owners[o.slot as usize].0 == *family).map(|o| o.blocks).sum();
                insert.execute(params![step, p.ts, family.as_str(), "", p.total(*family), blocks])?;
                written += 1;
            }
            for o in &p.owners {
                let (family, owner) = &report.owners[o.slot as usize];
                insert.execute(params![step, p.ts, family.as_str(), owner, o.bytes, o.blocks])?;
                written += 1;
            }
        }
        let mut insert =
            tx.prepare("INSERT INTO ms_leaks VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)")?;
        for (kind, list) in [("candidate", &report.candidates), ("never_freed", &report.never_freed)] {
            for l in list {
                insert.execute(params![
                    kind,
                    l.family,
                    l.block,
                    l.pid,
                    l.ptr,
                    l.size,
                    l.owner,
                    l.birth_step,
                    l.steps_alive,
                    l.alloc_ts,
                    l.free_ts,
                    l.allocation_id,
                    l.python_stack,
                    l.c_stack
                ])?;
                written += 1;
            }
        }
        let mut insert = tx.prepare(
            "INSERT INTO ms_degradation VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15)",
        )?;
        for d in &report.degradation {
            let t = &d.trend;
            insert.execute(params![
                d.family,
                "",
                d.first_step,
                d.last_step,
                d.first_bytes,
                d.last_bytes,
                d.last_bytes - d.first_bytes,
                t.points as i64,
                t.slope,
                t.rise,
                t.noise_floor,
                t.mk_s,
                t.mk_z,
                t.p_value,
                t.verdict.as_str()
            ])?;
            written += 1;
            for o in &d.owners {
                let none: Option<f64> = None;
                insert.execute(params![
                    d.family,
                    o.owner,
                    d.first_step,
                    d.last_step,
                    o.first_bytes,
                    o.last_bytes,
                    o.delta,
                    none,
                    none,
                    none,
                    none,
                    none,
                    none,
                    none,
                    none
                ])?;
                written += 1;
            }
        }
    }
    Ok(written)
}

// ---------------------------------------------------------------- reports

/// Blocks printed per owner; the rest are counted (all are in the table and the JSON).
const BLOCKS_SHOWN: usize = 8;
/// Boundaries printed; longer runs are sampled evenly, first and last always shown.
const STEPS_SHOWN: usize = 24;

/// The leak candidates of one site (the job's line that made them).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SiteLeaks {
    pub site: String,
    pub bytes: i64,
    pub blocks: usize,
    /// The steps they were born in, each once, in order.
    pub birth_steps: Vec<u64>,
}

/// Candidates grouped by site, most bytes first; blocks without a site are left out.
pub fn by_site(leaks: &[Leak]) -> Vec<SiteLeaks> {
    let mut groups: BTreeMap<&str, SiteLeaks> = BTreeMap::new();
    for l in leaks {
        let Some(site) = l.site.as_deref() else { continue };
        let g = groups.entry(site).or_insert_with(|| SiteLeaks {
            site: site.to_owned(),
            bytes: 0,
            blocks: 0,
            birth_steps: Vec::new(),
        });
        g.bytes += l.size;
        g.blocks += 1;
        g.birth_steps.extend(l.birth_step);
    }
    let mut out: Vec<SiteLeaks> = groups.into_values().collect();
    for g in &mut out {
        g.birth_steps.sort_unstable();
        g.birth_steps.dedup();
    }
    out.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.site.cmp(&b.site)));
    out
}

fn sites_text(out: &mut String, leaks: &[Leak]) {
    let sites = by_site(leaks);
    if sites.is_empty() {
        return;
    }
    let _ = writeln!(out, "  leak candidates by the job's line that made them:");
    for s in &sites {
        let steps: Vec<String> = s.birth_steps.iter().map(u64::to_string).collect();
        let _ = writeln!(
            out,
            "    {:>10}  {} block{}, born in step{} {}  {}",
            human_bytes(s.bytes),
            s.blocks,
            if s.blocks == 1 { "" } else { "s" },
            if steps.len() == 1 { "" } else { "s" },
            steps.join(","),
            printable(&s.site)
        );
    }
}

fn group(leaks: &[Leak]) -> BTreeMap<(&'static str, &str), Vec<&Leak>> {
    let mut groups: BTreeMap<(&'static str, &str), Vec<&Leak>> = BTreeMap::new();
    for l in leaks {
        groups.entry((l.family, l.owner.as_str())).or_default().push(l);
    }
    groups
}

fn blocks_text(out: &mut String, leaks: &[Leak]) {
    let mut groups: Vec<_> = group(leaks).into_iter().collect();
    groups.sort_by_key(|(_, v)| std::cmp::Reverse(v.iter().map(|l| l.size).sum::<i64>()));
    for ((family, owner), blocks) in groups {
        let bytes: i64 = blocks.iter().map(|l| l.size).sum();
        let live = blocks.iter().filter(|l| l.free_ts.is_none()).count();
        // Owners name their family (`PTA@...`, `CANN@...` or `CUDA@...` for HAL); say it when
        // they do not.
        let device_owner = owner.starts_with("CANN") || owner.starts_with("CUDA");
        let owner = if owner.starts_with(family) || family == Family::Hal.as_str() && device_owner {
            owner.to_owned()
        } else {
            format!("{owner} ({family})")
        };
        let owner = printable(&owner);
        let _ = writeln!(
            out,
            "    {owner}: {} block{}, {} ({bytes} B), {live} still live at the end",
            blocks.len(),
            if blocks.len() == 1 { "" } else { "s" },
            human_bytes(bytes)
        );
        for l in blocks.iter().take(BLOCKS_SHOWN) {
            let born = l.birth_step.map_or("before any step".to_owned(), |s| format!("born in step {s}"));
            let alive = l
                .steps_alive
                .map_or(String::new(), |n| format!(", alive {n} more step{}", if n == 1 { "" } else { "s" }));
            let end = if l.free_ts.is_some() { "freed later" } else { "never freed" };
            let kind = if l.block == "block" { String::new() } else { format!(" [{}]", l.block) };
            let id =
                l.allocation_id.as_deref().map_or(String::new(), |id| format!(", allocation_id {}", printable(id)));
            let _ = writeln!(out, "      {} {:>10}  {born}{alive}, {end}{kind}{id}", l.ptr, human_bytes(l.size));
            // The job's own line when known, else the innermost Python frame.
            let frame = l.site.as_deref().or_else(|| l.python_stack.lines().next().filter(|f| !f.is_empty()));
            if let Some(frame) = frame {
                let _ = writeln!(out, "        at {}", printable(frame));
            }
        }
        if blocks.len() > BLOCKS_SHOWN {
            let _ =
                writeln!(out, "      ... and {} more (table {LEAKS_TABLE}, or --json)", blocks.len() - BLOCKS_SHOWN);
        }
    }
}

fn steps_line(report: &LeakReport) -> String {
    let s = &report.summary;
    if report.boundaries.is_empty() {
        return "no step boundaries: leak candidates and degradation need steps (memscope.step(), mstx `step start` ranges, --step-marker NAME, the job's Python stacks, or allocations that repeat)".into();
    }
    let sources: Vec<String> = s.sources.iter().map(|(src, n)| format!("{n} from {}", src.describe())).collect();
    let (first, last) = (report.boundaries[0].step, report.boundaries[report.boundaries.len() - 1].step);
    let mut line =
        format!("steps: {} boundaries ({}), ending steps {first}..{last}", report.boundaries.len(), sources.join(", "));
    if s.duplicates > 0 {
        let _ = write!(
            line,
            "; {} step row{} for a step already begun ignored (two markers per step)",
            s.duplicates,
            if s.duplicates == 1 { "" } else { "s" }
        );
    }
    line
}

/// The text report of one DB.
pub fn text(report: &LeakReport, path: &Path, device: &str) -> String {
    let mut out = String::new();
    let o = &report.options;
    let _ = writeln!(out, "device {device}: {}", path.display());
    let _ = writeln!(out, "  {}", steps_line(report));
    let total: i64 = report.candidates.iter().map(|l| l.size).sum();
    let _ = writeln!(
        out,
        "  leak candidates (born after step {}, still live {} whole step{} after their birth step): {} block{}, {}",
        o.warmup_steps,
        o.min_steps,
        if o.min_steps == 1 { "" } else { "s" },
        report.candidates.len(),
        if report.candidates.len() == 1 { "" } else { "s" },
        human_bytes(total)
    );
    blocks_text(&mut out, &report.candidates);
    sites_text(&mut out, &report.candidates);
    let never: i64 = report.never_freed.iter().map(|l| l.size).sum();
    let segments: Vec<&Leak> = report.never_freed.iter().filter(|l| l.block == "segment").collect();
    let _ = write!(
        out,
        "  HAL memory never freed: {} block{}, {}",
        report.never_freed.len(),
        if report.never_freed.len() == 1 { "" } else { "s" },
        human_bytes(never)
    );
    if !segments.is_empty() {
        let _ = write!(
            out,
            " ({} of them pool segments, {})",
            segments.len(),
            human_bytes(segments.iter().map(|l| l.size).sum::<i64>())
        );
    }
    out.push('\n');
    blocks_text(&mut out, &report.never_freed);
    step_table(&mut out, report);
    degradation_text(&mut out, report);
    out
}

fn step_table(out: &mut String, report: &LeakReport) {
    let rows = report.step_bytes();
    if rows.is_empty() {
        return;
    }
    let _ = writeln!(out, "  live bytes at the end of each step:");
    let mut header = format!("    {:>8}  {:>12}", "step", "time");
    for f in &report.summary.families {
        let _ = write!(header, "  {:>12}", f.as_str());
    }
    let _ = writeln!(out, "{header}");
    let shown: Vec<usize> = if rows.len() <= STEPS_SHOWN {
        (0..rows.len()).collect()
    } else {
        (0..STEPS_SHOWN).map(|i| i * (rows.len() - 1) / (STEPS_SHOWN - 1)).collect()
    };
    for i in &shown {
        let r = &rows[*i];
        let when = report.start_ns.map_or(String::new(), |s| relative(r.ts_ns - s));
        let mut line = format!("    {:>8}  {when:>12}", r.step);
        for (_, bytes) in &r.bytes {
            let _ = write!(line, "  {:>12}", human_bytes(*bytes));
        }
        let _ = writeln!(out, "{line}");
    }
    if shown.len() < rows.len() {
        let _ = writeln!(
            out,
            "    ({} of {} boundaries shown; all in table {STEPS_TABLE}, or --json)",
            shown.len(),
            rows.len()
        );
    }
}

fn degradation_text(out: &mut String, report: &LeakReport) {
    if report.boundaries.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "  degradation (live bytes at the step ends from step {} on; Mann-Kendall trend, Theil-Sen slope):",
        report.options.warmup_steps
    );
    for d in &report.degradation {
        let t = &d.trend;
        let what = match t.verdict {
            Verdict::TooFewSteps => format!(
                "no verdict: {} step end{} after the warm-up, {} needed",
                t.points,
                if t.points == 1 { "" } else { "s" },
                degradation::MIN_POINTS
            ),
            Verdict::NoTrend => format!("no rising trend (p = {:.3})", t.p_value),
            Verdict::BelowNoise => format!(
                "rising (p = {:.3}), but the Theil-Sen rise over the window, {}, is within the noise floor {}",
                t.p_value,
                human_bytes(t.rise as i64),
                human_bytes(t.noise_floor as i64)
            ),
            Verdict::SingleJump => format!(
                "one jump, not a sustained rise ({} -> {}; flat once the largest step is taken out)",
                human_bytes(d.first_bytes),
                human_bytes(d.last_bytes)
            ),
            Verdict::SustainedRise => format!(
                "SUSTAINED RISE: {} a step, {} over steps {}..{} ({} -> {}; p {}, noise floor {})",
                human_bytes(t.slope as i64),
                human_bytes(t.rise as i64),
                d.first_step.unwrap_or(0),
                d.last_step.unwrap_or(0),
                human_bytes(d.first_bytes),
                human_bytes(d.last_bytes),
                // The normal approximation's tail underflows long before it matters.
                if t.p_value < 1e-12 { "< 1e-12".to_owned() } else { format!("= {:.2e}", t.p_value) },
                human_bytes(t.noise_floor as i64)
            ),
        };
        let _ = writeln!(out, "    {}: {what}", d.family);
        if t.verdict == Verdict::SustainedRise {
            let rise = (d.last_bytes - d.first_bytes).max(1);
            let grew: Vec<String> = d
                .owners
                .iter()
                .filter(|o| o.delta > 0)
                .take(5)
                .map(|o| {
                    let owner = printable(&o.owner);
                    format!("{owner} +{} ({:.0}%)", human_bytes(o.delta), o.delta as f64 * 100.0 / rise as f64)
                })
                .collect();
            if !grew.is_empty() {
                let _ = writeln!(out, "      grew: {}", grew.join(", "));
            }
        }
    }
}

/// The JSON report of one DB.
pub fn json(report: &LeakReport, path: &Path, device: &str) -> serde_json::Value {
    let sources: serde_json::Map<String, serde_json::Value> =
        report.summary.sources.iter().map(|(s, n)| (s.describe().to_owned(), (*n).into())).collect();
    let steps: Vec<serde_json::Value> = report
        .step_bytes()
        .into_iter()
        .map(|s| {
            let mut v = serde_json::json!({"step": s.step, "ts_ns": s.ts_ns});
            for (family, bytes) in s.bytes {
                v[family] = bytes.into();
            }
            v
        })
        .collect();
    serde_json::json!({
        "analysis": "leaks",
        "db": path.display().to_string(),
        "device": device,
        "options": report.options,
        "boundaries": report.boundaries.len(),
        "step_sources": sources,
        "duplicate_step_rows": report.summary.duplicates,
        "candidates": report.candidates,
        "candidates_by_site": by_site(&report.candidates),
        "never_freed": report.never_freed,
        "steps": steps,
        "degradation": report.degradation,
    })
}

#[cfg(test)]
mod tests {
    use rusqlite::Connection;

    use super::*;
    use crate::analysis::steps::testrows::{mstx, noisy_run, step, training};
    use crate::analysis::testdb::{dir, TestDb};
    use crate::store::Attr;

    /// The DB at `path`, opened as `analyze` opens it to write its results.
    fn open(path: &Path) -> DumpDb {
        DumpDb::open(path, true).unwrap()
    }

    const MIB: u64 = 1 << 20;

    fn analyse_db(db: TestDb, options: &Options) -> LeakReport {
        let path = db.path.clone();
        drop(db);
        analyse(&open(&path), options).unwrap()
    }

    fn ptrs(leaks: &[Leak]) -> Vec<&str> {
        leaks.iter().map(|l| l.ptr.trim_start_matches("0x").trim_start_matches('0')).collect()
    }

    #[test]
    fn candidates_are_blocks_born_after_warmup_and_live_a_whole_step_later() {
        let mut db = training("leaks-candidates");
        db.malloc("PTA", 150, 0xa, 2 * MIB, Some("PTA@kv_cache")); // step 2, never freed: candidate
        db.malloc("PTA", 160, 0xb, MIB, Some("PTA@carry")); // step 2, freed in step 3: crossed one boundary only
        db.free("PTA", 250, 0xb);
        db.malloc("PTA", 350, 0xc, MIB, Some("PTA@cache")); // step 4, freed in step 6: candidate, freed later
        db.free("PTA", 550, 0xc);
        db.malloc("PTA", 650, 0xd, MIB, Some("PTA@kv_cache")); // step 7, the last: too young
        db.row("MALLOC", "PTA", 160, 1, Some(0xe), Attr::new().with("size", MIB).with("pool", "workspace"));
        db.malloc("HAL", 170, 0xf0, 4 * MIB, Some("CANN@APP")); // step 2, never freed: both lists
        let seg = Attr::new().with("size", 20 * MIB).with("owner", "CANN@APP").with("segment", "caching");
        db.row("MALLOC", "HAL", 180, 1, Some(0xf1), seg); // a pool segment: never freed only
        db.system("STOP_TRACE", 700);
        for p in [0x100, 0x110, 0xa, 0xd, 0xe] {
            db.free_marked("PTA", 701, p, "shadow");
        }
        db.free_marked("HAL", 701, 0xf0, "shadow");
        let path = db.path.clone();
        let r = analyse_db(db, &Options::default());
        assert_eq!(ptrs(&r.candidates), ["f0", "c", "a"], "HAL first, then PTA by owner");
        let kv = r.candidates.iter().find(|l| l.ptr.ends_with("0a")).unwrap();
        assert_eq!(
            (kv.owner.as_str(), kv.birth_step, kv.steps_alive, kv.free_ts),
            ("PTA@kv_cache", Some(2), Some(4), None)
        );
        let cache = r.candidates.iter().find(|l| l.ptr.ends_with("0c")).unwrap();
        assert_eq!((cache.birth_step, cache.steps_alive, cache.free_ts), (Some(4), Some(1), Some(550)));
        assert_eq!(ptrs(&r.never_freed), ["f0", "f1"]);
        assert_eq!(r.never_freed[1].block, "segment");
        // Longer lives asked for: only the kv block (4 whole steps) and the HAL one qualify for 3.
        let r3 = analyse(&open(&path), &Options { min_steps: 3, ..Options::default() }).unwrap();
        assert_eq!(ptrs(&r3.candidates), ["f0", "a"]);
        // No warm-up: the weights and the warm-up kv block become candidates too.
        let r0 = analyse(&open(&path), &Options { warmup_steps: 0, ..Options::default() }).unwrap();
        assert_eq!(ptrs(&r0.candidates), ["f0", "c", "110", "a", "100"]);
    }

    #[test]
    fn hal_never_freed_needs_no_steps() {
        let mut db = TestDb::create(&dir("leaks-nosteps").join("memscope_dump_1.db"));
        db.malloc("HAL", 10, 0x1, MIB, Some("CANN@HCCL"));
        db.malloc("HAL", 20, 0x2, MIB, Some("CANN@APP"));
        db.free("HAL", 30, 0x2);
        db.free_marked("HAL", 40, 0x3, "unmatched"); // a block from before the trace
        db.system("STOP_TRACE", 50);
        db.free_marked("HAL", 51, 0x1, "shadow");
        let path = db.path.clone();
        let r = analyse_db(db, &Options::default());
        assert!(r.candidates.is_empty() && r.boundaries.is_empty());
        assert_eq!(ptrs(&r.never_freed), ["1"]);
        assert_eq!((r.never_freed[0].birth_step, r.never_freed[0].owner.as_str()), (None, "CANN@HCCL"));
        let text = text(&r, &path, "0");
        assert!(
            text.contains("no step boundaries") && text.contains("HAL memory never freed: 1 block, 1.0 MiB"),
            "{text}"
        );
        assert!(text.contains("    CANN@HCCL: 1 block"), "{text}");
    }

    #[test]
    fn owners_reach_the_text_escaped_and_the_json_exact() {
        let evil = "CANN@x\u{1b}[2J\nmemscope-bpf: forged";
        let mut db = TestDb::create(&dir("leaks-escaped").join("memscope_dump_1.db"));
        db.malloc("HAL", 10, 0x1, MIB, Some(evil));
        db.system("STOP_TRACE", 50);
        db.free_marked("HAL", 51, 0x1, "shadow");
        let path = db.path.clone();
        let r = analyse_db(db, &Options::default());
        let text = text(&r, &path, "0");
        assert!(!text.contains('\u{1b}') && !text.contains("\nmemscope-bpf: forged"), "{text}");
        assert!(text.contains("    CANN@x\\u{1b}[2J\\nmemscope-bpf: forged: 1 block"), "{text}");
        assert!(json(&r, &path, "0").to_string().contains(&serde_json::to_string(evil).unwrap()));
    }

    #[test]
    fn a_step_marker_that_matches_nothing_is_refused_with_the_marks_there() {
        let mut db = training("leaks-marker");
        mstx(&mut db, 150, "Mark", "iteration");
        let path = db.path.clone();
        drop(db);
        let before = std::fs::read(&path).unwrap();
        let options = Options { step_marker: Some("iter".into()), ..Options::default() };
        let err = analyse(&open(&path), &options).err().unwrap().to_string();
        assert!(
            err.contains("no MSTX mark or range named \"iter\"")
                && err.contains("marks and ranges in this trace: iteration"),
            "{err}"
        );
        assert_eq!(std::fs::read(&path).unwrap(), before);
        let options = Options { step_marker: Some("iteration".into()), ..Options::default() };
        assert_eq!(analyse(&open(&path), &options).unwrap().boundaries.len(), 1);
    }

    #[test]
    fn degradation_fires_on_the_leaky_run_only_and_names_the_owner() {
        let leaky = analyse(&open(&noisy_run("leaks-degr-leaky", true)), &Options::default()).unwrap();
        let pta = leaky.degradation.iter().find(|d| d.family == "PTA").unwrap();
        assert_eq!(pta.trend.verdict, Verdict::SustainedRise, "{pta:?}");
        assert_eq!(pta.owners[0].owner, "PTA@kv_cache");
        assert_eq!(pta.owners[0].delta, 2 * MIB as i64 * 11, "steps 1..12: the kv blocks of steps 2..12");
        assert_eq!((pta.first_step, pta.last_step, pta.trend.points), (Some(1), Some(12), 12));
        // Candidates: the kv blocks of steps 2..11 (the one of step 12 is too young).
        let kv: Vec<u64> =
            leaky.candidates.iter().filter(|l| l.owner == "PTA@kv_cache").filter_map(|l| l.birth_step).collect();
        assert_eq!(kv, (2..=11).collect::<Vec<_>>());
        let clean = analyse(&open(&noisy_run("leaks-degr-clean", false)), &Options::default()).unwrap();
        assert!(clean.candidates.is_empty(), "{:?}", clean.candidates);
        for d in &clean.degradation {
            assert_ne!(d.trend.verdict, Verdict::SustainedRise, "{d:?}");
        }
        let text = text(&leaky, Path::new("x.db"), "0");
        assert!(text.contains("PTA: SUSTAINED RISE") && text.contains("grew: PTA@kv_cache +22.0 MiB"), "{text}");
    }

    #[test]
    fn tables_are_written_and_replaced_in_one_transaction() {
        let path = noisy_run("leaks-write", true);
        let report = analyse(&open(&path), &Options::default()).unwrap();
        let n = store(&open(&path), &report, 7).unwrap();
        assert_eq!(store(&open(&path), &report, 8).unwrap(), n, "a rerun replaces the rows");
        let conn = Connection::open(&path).unwrap();
        let count = |sql: &str| -> i64 { conn.query_row(sql, [], |r| r.get(0)).unwrap() };
        assert_eq!(count("SELECT count(*) FROM ms_leaks WHERE kind = 'candidate'"), report.candidates.len() as i64);
        assert_eq!(count("SELECT count(*) FROM ms_steps WHERE owner = '' AND family = 'PTA'"), 12);
        let at5: i64 = conn
            .query_row(
                "SELECT bytes FROM ms_steps WHERE step = 5 AND family = 'PTA' AND owner = 'PTA@kv_cache'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(at5, (4 * 2 + 1) * MIB as i64, "the warm-up kv block and those of steps 2..5");
        let verdict: String = conn
            .query_row("SELECT verdict FROM ms_degradation WHERE family = 'PTA' AND owner = ''", [], |r| r.get(0))
            .unwrap();
        assert_eq!(verdict, "sustained_rise");
        assert_eq!(count("SELECT count(*) FROM ms_meta WHERE key = 'leaks_at' AND value = '8'"), 1);
        // A failing last statement leaves the previous results.
        conn.execute_batch("CREATE TRIGGER no_meta BEFORE INSERT ON ms_meta BEGIN SELECT RAISE(ABORT, 'no'); END")
            .unwrap();
        let err = store(&open(&path), &report, 9).unwrap_err();
        assert!(err.to_string().contains("nothing was changed"), "{err}");
        assert_eq!(count("SELECT count(*) FROM ms_meta WHERE key = 'leaks_at' AND value = '8'"), 1);
        assert_eq!(count("SELECT count(*) FROM ms_leaks"), (report.candidates.len() + report.never_freed.len()) as i64);
    }

    /// 1M rows: 500k blocks over 100 steps. Run with `--ignored` on a release build for the time;
    /// MEMSCOPE_BENCH_BLOCKS=5000000 makes it 10M rows.
    #[test]
    #[ignore = "a timing benchmark, run by hand with --release (see docs/benchmarks.md)"]
    fn a_million_rows_in_seconds() {
        let blocks: u64 = std::env::var("MEMSCOPE_BENCH_BLOCKS").ok().and_then(|v| v.parse().ok()).unwrap_or(499_900);
        let path = dir("leaks-million").join("memscope_dump_1.db");
        let mut db = TestDb::create(&path);
        db.conn().execute_batch("BEGIN").unwrap();
        let owners: Vec<&'static str> =
            (0..50).map(|i| &*Box::leak(format!("PTA@layer{i}").into_boxed_str())).collect();
        let mut ts = 0i64;
        for i in 0..blocks {
            ts += 2;
            if i % 5_000 == 0 {
                step(&mut db, ts, i / 5_000 + 1);
            }
            db.malloc("PTA", ts, 0x1000 + i, 4096, Some(owners[i as usize % 50]));
            if i % 1000 != 0 {
                db.free("PTA", ts + 1, 0x1000 + i); // every 1000th block leaks
            }
        }
        db.conn().execute_batch("COMMIT").unwrap();
        let rows: i64 = db.conn().query_row("SELECT count(*) FROM memscope_dump", [], |r| r.get(0)).unwrap();
        drop(db);
        let t = std::time::Instant::now();
        let report = analyse(&open(&path), &Options::default()).unwrap();
        let elapsed = t.elapsed();
        eprintln!("{rows} rows analysed in {elapsed:?}: {:.0} rows/s", rows as f64 / elapsed.as_secs_f64());
        assert!(report.candidates.len() > 400);
        assert_eq!(report.degradation[0].trend.verdict, Verdict::SustainedRise);
        assert!(elapsed.as_secs_f64() < 10.0 * rows as f64 / 10e6, "{elapsed:?}: slower than 10M rows in 10 s");
    }
}
