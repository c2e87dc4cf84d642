//! Where the job's own code holds memory (`analyze --analysis sites`): the lines that made the
//! most bytes live at the peak and at the end of the trace, and the leak candidates grouped by
//! the line that made them. A block's site is its MALLOC's `site` (docs/owners.md), written when
//! the trace read the allocation's Python stack.
//!
//! The instants and their live blocks are the decomposition's own (`decompose::analyse_by` with
//! sites for nodes), and the candidates the leaks analysis's, so the three agree by construction.

use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;

use super::db::DumpDb;
use super::decompose::{self, By, PointKind, TimeSpec};
use super::leaks::{self, SiteLeaks};
use super::render::relative;
use super::AnalysisError;
use crate::printable::printable;
use crate::units::human_bytes;

/// Sites printed per instant (the table and the JSON have them all).
pub const SHOWN: usize = 10;

/// The bytes one site held at one instant.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SiteBytes {
    pub site: String,
    pub bytes: i64,
    pub blocks: u64,
}

/// One family's sites at one instant, most bytes first.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SitePoint {
    pub point: &'static str,
    pub ts_ns: i64,
    pub family: &'static str,
    pub total: i64,
    pub sites: Vec<SiteBytes>,
}

#[derive(Clone, Debug)]
pub struct Report {
    pub start_ns: Option<i64>,
    pub points: Vec<SitePoint>,
    /// The leak candidates by site; `Err` says why there are none to group (no steps).
    pub leaks: Result<Vec<SiteLeaks>, String>,
    /// Blocks live at the end without a site: the trace read no Python stack for them.
    pub notes: Vec<String>,
}

/// Sites at the peak and the end, and the leak candidates by site.
pub fn analyse(db: &DumpDb) -> Result<Report, AnalysisError> {
    let d = decompose::analyse_by(db, &[TimeSpec::Peak, TimeSpec::End], By::Site)?;
    let mut points = Vec::new();
    for point in &d.points {
        for tree in &point.trees {
            // The root is the family; its children (depth 1) are the sites.
            let mut sites: Vec<SiteBytes> = tree
                .nodes
                .iter()
                .filter(|n| n.depth == 1)
                .map(|n| SiteBytes { site: n.path.clone(), bytes: n.bytes, blocks: n.blocks })
                .collect();
            sites.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.site.cmp(&b.site)));
            let (point, family) = (point.kind.as_str(), tree.family.as_str());
            points.push(SitePoint { point, ts_ns: point_ts(point, &d.points), family, total: tree.total(), sites });
        }
    }
    let leaks = match leaks::analyse(db, &leaks::Options::default()) {
        Ok(r) if r.boundaries.is_empty() => Err("no step boundaries, so no leak candidates".to_owned()),
        Ok(r) => Ok(leaks::by_site(&r.candidates)),
        Err(e) => Err(e.to_string()),
    };
    Ok(Report { start_ns: d.start_ns, points, leaks, notes: d.notes })
}

fn point_ts(kind: &str, points: &[decompose::Point]) -> i64 {
    points.iter().find(|p| p.kind.as_str() == kind).map_or(0, |p| p.ts_ns)
}

fn describe(point: &str) -> &'static str {
    if point == PointKind::Peak.as_str() {
        "at the peak"
    } else {
        "at the end of the trace"
    }
}

pub fn text(report: &Report, path: &Path, device: &str) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "device {device}: {}", path.display());
    for note in &report.notes {
        let _ = writeln!(out, "  {note}");
    }
    for p in &report.points {
        let at = report.start_ns.map_or(String::new(), |s| format!(" ({})", relative(p.ts_ns - s)));
        let _ = writeln!(out, "  sites holding {} bytes {}{at}: {}", p.family, describe(p.point), human_bytes(p.total));
        for s in p.sites.iter().take(SHOWN) {
            let _ = writeln!(out, "    {:>10}  {:>6} blocks  {}", human_bytes(s.bytes), s.blocks, printable(&s.site));
        }
        if p.sites.len() > SHOWN {
            let _ = writeln!(out, "    ... and {} more sites (table {TABLE}, or --json)", p.sites.len() - SHOWN);
        }
    }
    match &report.leaks {
        Ok(sites) if sites.is_empty() => {
            let _ = writeln!(out, "  leak candidates by site: none");
        }
        Ok(sites) => {
            let _ = writeln!(out, "  leak candidates by site:");
            for s in sites {
                let steps: Vec<String> = s.birth_steps.iter().map(u64::to_string).collect();
                let (bytes, blocks) = (human_bytes(s.bytes), s.blocks);
                let site = printable(&s.site);
                let _ = writeln!(out, "    {bytes:>10}  {blocks:>6} blocks  born in steps {}  {site}", steps.join(","));
            }
        }
        Err(why) => {
            let _ = writeln!(out, "  leak candidates by site: {why}");
        }
    }
    out
}

pub fn json(report: &Report, path: &Path, device: &str) -> serde_json::Value {
    serde_json::json!({
        "analysis": "sites",
        "db": path.display().to_string(),
        "device": device,
        "points": report.points,
        "leaks_by_site": report.leaks.as_ref().ok(),
        "leaks_note": report.leaks.as_ref().err(),
    })
}

/// The sites table (docs/db-schema.md, `ms_sites`).
pub const TABLE: &str = "ms_sites";
pub const CREATE: &str = "CREATE TABLE ms_sites (point TEXT NOT NULL, ts_ns INTEGER NOT NULL, family TEXT NOT NULL,
    site TEXT NOT NULL, bytes INTEGER NOT NULL, blocks INTEGER NOT NULL, birth_steps TEXT)";

/// One row of the table: (point, ts_ns, family, site, bytes, blocks, birth steps of leak rows).
pub type Row<'a> = (&'static str, i64, &'static str, &'a str, i64, i64, Option<String>);

/// The table's rows.
pub fn rows(report: &Report) -> Vec<Row<'_>> {
    let mut rows = Vec::new();
    for p in &report.points {
        for s in &p.sites {
            rows.push((p.point, p.ts_ns, p.family, s.site.as_str(), s.bytes, s.blocks as i64, None));
        }
    }
    for s in report.leaks.iter().flatten() {
        let steps = s.birth_steps.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
        rows.push(("leak", 0, "", s.site.as_str(), s.bytes, s.blocks as i64, Some(steps)));
    }
    rows
}
