//! The one analysis contract: every analysis a verb runs is [`Analysis::analyse`] over an open
//! [`DumpDb`] with its options, then [`Analysis::text`] or [`Analysis::json`] to print, and
//! [`Analysis::store`] to replace its result tables (through [`DumpDb::replace_tables`]). The
//! verbs hold no per-analysis code: they pick an implementation by name and call [`run`].
//!
//! The implementations here are thin on purpose: each analysis's metrics, report and tables stay
//! in its own module; this file only says which of its functions fill which part of the contract,
//! plus the decomposition's table (kept out of `db`, which must not depend on any analysis).

use std::path::Path;

use rusqlite::params;
use serde_json::Value;

use super::db::DumpDb;
use super::decompose::{self, TimeSpec};
use super::fragmentation;
use super::steps::StepError;
use super::AnalysisError;
use super::{advise, inefficient, inefficient_out, leaks, oom, render, sites, unexplained};

/// An analysis: how it reads a DB, prints its report, and stores its results.
pub trait Analysis {
    /// The name verbs and msMemScope call it by (`analyze --analysis NAME`).
    const NAME: &'static str;
    type Options;
    type Report;
    /// [`AnalysisError`], or an error of its own that wraps it (leaks: a missing step marker).
    type Error: From<AnalysisError>;

    fn analyse(db: &DumpDb, options: &Self::Options) -> Result<Self::Report, Self::Error>;

    /// The text report of one DB.
    fn text(report: &Self::Report, path: &Path, device: &str, options: &Self::Options) -> String;

    /// The JSON report of one DB: the elements it adds to the verb's output array.
    fn json(report: &Self::Report, path: &Path, device: &str, options: &Self::Options) -> Vec<Value>;

    /// Replaces the analysis's result tables in the DB (opened for writing) with `report`, and
    /// stamps its `ms_meta` key with `run_wall_ns`; returns the line saying what was written.
    fn store(db: &DumpDb, report: &Self::Report, run_wall_ns: u64) -> Result<String, AnalysisError>;
}

/// What one analysis of one DB produced, for the verb to print.
#[derive(Debug, Default)]
pub struct Outcome {
    /// The text report, unless JSON was asked for.
    pub text: Option<String>,
    /// The JSON report's elements, when JSON was asked for.
    pub json: Vec<Value>,
    /// What [`Analysis::store`] wrote, when it was asked to.
    pub stored: Option<String>,
}

/// Analyses `db`, stores the results when `store_at` (the run's wall-clock time) is given, and
/// builds the one report asked for (a trace can have a million flagged blocks: building both
/// would double the cost).
pub fn run<A: Analysis>(
    db: &DumpDb,
    device: &str,
    options: &A::Options,
    as_json: bool,
    store_at: Option<u64>,
) -> Result<Outcome, A::Error> {
    let report = A::analyse(db, options)?;
    let stored = match store_at {
        Some(at) => Some(A::store(db, &report, at)?),
        None => None,
    };
    let mut out = Outcome { stored, ..Outcome::default() };
    if as_json {
        out.json = A::json(&report, db.path(), device, options);
    } else {
        out.text = Some(A::text(&report, db.path(), device, options));
    }
    Ok(out)
}

/// A value as a JSON report element; the reports are plain data, which always serialise.
fn value(v: impl serde::Serialize) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}

// ---------------------------------------------------------------- decompose

/// Our decomposition table (docs/db-schema.md, "ms_decompose").
pub const DECOMPOSE_TABLE: &str = "ms_decompose";
const CREATE_DECOMPOSE: &str = "CREATE TABLE ms_decompose (
    point TEXT NOT NULL, ts_ns INTEGER NOT NULL, family TEXT NOT NULL, owner TEXT NOT NULL,
    depth INTEGER NOT NULL, bytes INTEGER NOT NULL, blocks INTEGER NOT NULL)";

/// Where the memory was at instants, as owner trees.
pub struct Decompose;

#[derive(Clone, Debug)]
pub struct DecomposeOptions {
    /// The instants to decompose.
    pub points: Vec<TimeSpec>,
    /// Owner levels printed (the table always gets the whole tree).
    pub depth: Option<usize>,
}

impl Analysis for Decompose {
    const NAME: &'static str = "decompose";
    type Options = DecomposeOptions;
    type Report = decompose::Report;
    type Error = AnalysisError;

    fn analyse(db: &DumpDb, options: &DecomposeOptions) -> Result<decompose::Report, AnalysisError> {
        decompose::analyse(db, &options.points)
    }

    fn text(report: &decompose::Report, path: &Path, device: &str, options: &DecomposeOptions) -> String {
        render::text(report, path, device, options.depth)
    }

    fn json(report: &decompose::Report, path: &Path, device: &str, options: &DecomposeOptions) -> Vec<Value> {
        render::json(report, path, device, options.depth).into_iter().map(value).collect()
    }

    /// Replaces `ms_decompose` and stamps `ms_meta.decompose_at`.
    fn store(db: &DumpDb, report: &decompose::Report, run_wall_ns: u64) -> Result<String, AnalysisError> {
        let meta = [("decompose_at", run_wall_ns.to_string())];
        let rows = db.replace_tables(&[(DECOMPOSE_TABLE, CREATE_DECOMPOSE)], &meta, |tx| {
            let mut insert = tx.prepare(&format!(
                "INSERT INTO {DECOMPOSE_TABLE} (point, ts_ns, family, owner, depth, bytes, blocks) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)"
            ))?;
            let mut written = 0;
            for point in &report.points {
                for tree in &point.trees {
                    for node in &tree.nodes {
                        let (depth, blocks) = (node.depth as i64, node.blocks as i64);
                        let family = tree.family.as_str();
                        insert.execute(params![
                            point.kind.as_str(),
                            point.ts_ns,
                            family,
                            node.path,
                            depth,
                            node.bytes,
                            blocks
                        ])?;
                        written += 1;
                    }
                }
            }
            Ok(written)
        })?;
        Ok(format!("wrote {rows} rows into table {DECOMPOSE_TABLE} of {}", db.path().display()))
    }
}

// ---------------------------------------------------------------- inefficient

/// Memory held while unused, by msMemScope's and Insight's definitions.
pub struct Inefficient;

impl Analysis for Inefficient {
    const NAME: &'static str = "inefficient";
    type Options = inefficient::Options;
    type Report = inefficient::Report;
    type Error = AnalysisError;

    fn analyse(db: &DumpDb, options: &inefficient::Options) -> Result<inefficient::Report, AnalysisError> {
        inefficient::analyse(db, options)
    }

    fn text(report: &inefficient::Report, path: &Path, device: &str, _: &inefficient::Options) -> String {
        inefficient_out::text(report, path, device)
    }

    fn json(report: &inefficient::Report, path: &Path, device: &str, _: &inefficient::Options) -> Vec<Value> {
        vec![inefficient_out::json(report, path, device)]
    }

    fn store(db: &DumpDb, report: &inefficient::Report, run_wall_ns: u64) -> Result<String, AnalysisError> {
        let w = inefficient_out::store(db, report, run_wall_ns)?;
        Ok(format!(
            "inefficient: set inefficient_type on {} MALLOC rows, removed it from {}, wrote {} rows into table {} of {}",
            w.set,
            w.removed,
            w.table_rows,
            inefficient_out::INEFFICIENT_TABLE,
            db.path().display()
        ))
    }
}

// ---------------------------------------------------------------- leaks

/// Leak candidates per step, HAL memory never freed, and degradation across steps.
pub struct Leaks;

impl Analysis for Leaks {
    const NAME: &'static str = "leaks";
    type Options = leaks::Options;
    type Report = leaks::LeakReport;
    type Error = StepError;

    fn analyse(db: &DumpDb, options: &leaks::Options) -> Result<leaks::LeakReport, StepError> {
        leaks::analyse(db, options)
    }

    fn text(report: &leaks::LeakReport, path: &Path, device: &str, _: &leaks::Options) -> String {
        leaks::text(report, path, device)
    }

    fn json(report: &leaks::LeakReport, path: &Path, device: &str, _: &leaks::Options) -> Vec<Value> {
        vec![leaks::json(report, path, device)]
    }

    fn store(db: &DumpDb, report: &leaks::LeakReport, run_wall_ns: u64) -> Result<String, AnalysisError> {
        let rows = leaks::store(db, report, run_wall_ns)?;
        Ok(format!(
            "wrote {rows} rows into tables {}, {}, {} of {}",
            leaks::STEPS_TABLE,
            leaks::LEAKS_TABLE,
            leaks::DEGRADATION_TABLE,
            db.path().display()
        ))
    }
}

// ---------------------------------------------------------------- sites

/// The job's own lines holding memory at the peak and the end, and the leaks by line.
pub struct Sites;

impl Analysis for Sites {
    const NAME: &'static str = "sites";
    type Options = ();
    type Report = sites::Report;
    type Error = AnalysisError;

    fn analyse(db: &DumpDb, _: &()) -> Result<sites::Report, AnalysisError> {
        sites::analyse(db)
    }

    fn text(report: &sites::Report, path: &Path, device: &str, _: &()) -> String {
        sites::text(report, path, device)
    }

    fn json(report: &sites::Report, path: &Path, device: &str, _: &()) -> Vec<Value> {
        vec![sites::json(report, path, device)]
    }

    /// Replaces `ms_sites` and stamps `ms_meta.sites_at`.
    fn store(db: &DumpDb, report: &sites::Report, run_wall_ns: u64) -> Result<String, AnalysisError> {
        let meta = [("sites_at", run_wall_ns.to_string())];
        let rows = db.replace_tables(&[(sites::TABLE, sites::CREATE)], &meta, |tx| {
            let mut insert = tx.prepare(&format!(
                "INSERT INTO {} (point, ts_ns, family, site, bytes, blocks, birth_steps) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
                sites::TABLE
            ))?;
            let rows = sites::rows(report);
            for r in &rows {
                insert.execute(params![r.0, r.1, r.2, r.3, r.4, r.5, r.6])?;
            }
            Ok(rows.len())
        })?;
        Ok(format!("wrote {rows} rows into table {} of {}", sites::TABLE, db.path().display()))
    }
}

// ---------------------------------------------------------------- unexplained

/// The driver's figure for each process against its traced device memory, at each reading.
pub struct Unexplained;

impl Analysis for Unexplained {
    const NAME: &'static str = "unexplained";
    type Options = ();
    type Report = unexplained::Report;
    type Error = AnalysisError;

    fn analyse(db: &DumpDb, _: &()) -> Result<unexplained::Report, AnalysisError> {
        unexplained::analyse(db)
    }

    fn text(report: &unexplained::Report, path: &Path, device: &str, _: &()) -> String {
        unexplained::text(report, path, device)
    }

    fn json(report: &unexplained::Report, path: &Path, device: &str, _: &()) -> Vec<Value> {
        vec![unexplained::json(report, path, device)]
    }

    /// Replaces `ms_unexplained` and stamps `ms_meta.unexplained_at`.
    fn store(db: &DumpDb, report: &unexplained::Report, run_wall_ns: u64) -> Result<String, AnalysisError> {
        let meta = [("unexplained_at", run_wall_ns.to_string())];
        let rows = db.replace_tables(&[(unexplained::TABLE, unexplained::CREATE)], &meta, |tx| {
            let mut insert = tx.prepare(&format!(
                "INSERT INTO {} (pid, ts_ns, process_used, traced, unexplained) VALUES (?1, ?2, ?3, ?4, ?5)",
                unexplained::TABLE
            ))?;
            let rows = unexplained::rows(report);
            for r in &rows {
                insert.execute(params![r[0], r[1], r[2], r[3], r[4]])?;
            }
            Ok(rows.len())
        })?;
        Ok(format!("wrote {rows} rows into table {} of {}", unexplained::TABLE, db.path().display()))
    }
}

// ---------------------------------------------------------------- oom

/// Forensics of each failed allocation; the options are msMemScope's `oom:K` K.
pub struct Oom;

impl Analysis for Oom {
    const NAME: &'static str = "oom";
    type Options = usize;
    type Report = fragmentation::Report;
    type Error = AnalysisError;

    fn analyse(db: &DumpDb, top_k: &usize) -> Result<fragmentation::Report, AnalysisError> {
        // The forensics read no periodic sample, and leaving them out spares counting the rows first.
        fragmentation::analyse(db, fragmentation::Options { top_k: *top_k, sample_every: Some(0) })
    }

    fn text(report: &fragmentation::Report, path: &Path, device: &str, _: &usize) -> String {
        oom::text(report, path, device)
    }

    fn json(report: &fragmentation::Report, path: &Path, device: &str, _: &usize) -> Vec<Value> {
        vec![serde_json::json!({
            "db": path.display().to_string(),
            "device": device,
            "incidents": report.incidents,
        })]
    }

    fn store(db: &DumpDb, report: &fragmentation::Report, run_wall_ns: u64) -> Result<String, AnalysisError> {
        let rows = oom::store(db, &report.incidents, run_wall_ns)?;
        let (main, blocks) = (oom::OOM_TABLE, oom::OOM_BLOCKS_TABLE);
        Ok(format!("wrote {rows} rows into tables {main} and {blocks} of {}", db.path().display()))
    }
}

// ---------------------------------------------------------------- advise

/// Allocator settings recommended from the pool's behaviour (the `advise` verb).
pub struct Advise;

/// The device the advice is for (it names it in its report and table rows), and the settings
/// to replay the allocator's requests under (`advise --simulate`).
#[derive(Clone, Debug, Default)]
pub struct AdviseOptions {
    pub device: String,
    pub simulate: crate::analysis::simulate::Options,
}

impl Analysis for Advise {
    const NAME: &'static str = "advise";
    type Options = AdviseOptions;
    type Report = (advise::Advice, fragmentation::Report);
    type Error = AnalysisError;

    fn analyse(db: &DumpDb, options: &AdviseOptions) -> Result<Self::Report, AnalysisError> {
        advise::analyse(db, &options.device, &options.simulate)
    }

    fn text((advice, report): &Self::Report, _: &Path, _: &str, _: &AdviseOptions) -> String {
        advise::text(advice, report)
    }

    fn json((advice, _): &Self::Report, _: &Path, _: &str, _: &AdviseOptions) -> Vec<Value> {
        vec![value(advice)]
    }

    fn store(db: &DumpDb, (advice, report): &Self::Report, run_wall_ns: u64) -> Result<String, AnalysisError> {
        let rows = advise::store(db, advice, report, run_wall_ns)?;
        Ok(format!(
            "wrote {rows} rows into tables ms_fragmentation, {} and {} of {}",
            advise::ADVICE_TABLE,
            advise::SIMULATION_TABLE,
            db.path().display()
        ))
    }
}

#[cfg(test)]
mod tests {
    use rusqlite::Connection;

    use super::*;
    use crate::analysis::testdb::{dir, TestDb};

    fn decompose(points: &[TimeSpec]) -> DecomposeOptions {
        DecomposeOptions { points: points.to_vec(), depth: None }
    }

    #[test]
    fn a_failed_write_changes_nothing() {
        let d = dir("rollback");
        let mut db = TestDb::create(&d.join("memscope_dump_1.db"));
        db.malloc("HAL", 10, 0x1, 100, Some("CANN@APP"));
        db.malloc("HAL", 20, 0x2, 50, Some("CANN@HCCL"));
        let path = db.path.clone();
        drop(db);
        let count = |sql: &str| -> i64 { Connection::open(&path).unwrap().query_row(sql, [], |r| r.get(0)).unwrap() };
        let dump = DumpDb::open(&path, true).unwrap();
        let first = Decompose::analyse(&dump, &decompose(&[TimeSpec::End])).unwrap();
        let note = Decompose::store(&dump, &first, 1).unwrap();
        assert!(note.starts_with("wrote 4 rows into table ms_decompose of "), "{note}");
        // Make the last statement of the next write fail, after ms_decompose was dropped and refilled.
        Connection::open(&path)
            .unwrap()
            .execute_batch("CREATE TRIGGER no_meta BEFORE INSERT ON ms_meta BEGIN SELECT RAISE(ABORT, 'no'); END")
            .unwrap();
        let second = Decompose::analyse(&dump, &decompose(&[TimeSpec::Peak, TimeSpec::End])).unwrap();
        let err = Decompose::store(&dump, &second, 2).unwrap_err();
        assert!(matches!(err, AnalysisError::Write { .. }), "{err}");
        assert!(err.to_string().contains("nothing was changed"));
        assert_eq!(count("SELECT count(*) FROM ms_decompose"), 4, "the first run's rows are still there");
        assert_eq!(count("SELECT count(*) FROM ms_meta WHERE key = 'decompose_at' AND value = '1'"), 1);
        assert_eq!(count("SELECT count(*) FROM memscope_dump"), 2);
    }

    #[test]
    fn run_builds_the_report_asked_for_and_stores_only_when_asked() {
        let d = dir("contract-run");
        let mut db = TestDb::create(&d.join("memscope_dump_1.db"));
        db.malloc("HAL", 10, 0x1, 100, Some("CANN@APP"));
        let path = db.path.clone();
        drop(db);
        let before = std::fs::read(&path).unwrap();
        let dump = DumpDb::open(&path, true).unwrap();
        let options = decompose(&[TimeSpec::End]);
        let out = run::<Decompose>(&dump, "0", &options, false, None).unwrap();
        assert!(out.text.unwrap().contains("device 0"));
        assert!(out.json.is_empty() && out.stored.is_none());
        assert_eq!(std::fs::read(&path).unwrap(), before, "nothing stored without store_at");
        let out = run::<Decompose>(&dump, "0", &options, true, Some(5)).unwrap();
        assert!(out.text.is_none());
        assert_eq!(out.json.len(), 1, "one element per family with memory: {:?}", out.json);
        assert_eq!(out.json[0]["family"], "HAL");
        assert!(out.stored.unwrap().contains("ms_decompose"));
    }
}
