//! The decomposition reports: an indented owner tree per instant for people, and a flat JSON
//! array for scripts. Both show the same nodes; `--depth` trims both (the DB always gets the
//! whole tree, so a shallow look never loses data).

use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;

use super::decompose::{Family, Node, Point, PointKind, Report, Tree};
use crate::printable::printable;
use crate::units::human_bytes;

/// A time after the trace start, in the largest unit that keeps it readable.
pub fn relative(ns: i64) -> String {
    let sign = if ns < 0 { "-" } else { "+" };
    let abs = ns.unsigned_abs();
    match abs {
        1_000_000_000.. => format!("{sign}{:.3} s", abs as f64 / 1e9),
        1_000_000.. => format!("{sign}{:.3} ms", abs as f64 / 1e6),
        1_000.. => format!("{sign}{:.3} us", abs as f64 / 1e3),
        _ => format!("{sign}{abs} ns"),
    }
}

fn shown(tree: &Tree, depth: Option<usize>) -> impl Iterator<Item = &Node> {
    tree.nodes.iter().filter(move |n| depth.is_none_or(|d| n.depth <= d))
}

fn plural(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// The text report of one DB.
pub fn text(report: &Report, path: &Path, device: &str, depth: Option<usize>) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "device {device}: {}", path.display());
    let from = if report.start_is_trace { "START_TRACE" } else { "the first row" };
    match (report.start_ns, report.end_ns) {
        (Some(start), Some(end)) => {
            let _ = writeln!(
                out,
                "  trace: {} long, from {from} at ts {start}",
                relative(end - start).trim_start_matches('+')
            );
        }
        _ => {
            let _ = writeln!(out, "  trace: no rows");
        }
    }
    let s = &report.stats;
    if report.families.is_empty() {
        let _ = writeln!(out, "  no memory blocks (no MALLOC row with a size)");
    } else {
        let blocks: Vec<String> =
            report.families.iter().map(|f| format!("{} {}", f.as_str(), s.mallocs[*f as usize])).collect();
        let _ = writeln!(out, "  blocks allocated: {}", blocks.join(", "));
    }
    let mut skipped = Vec::new();
    if s.unmatched_frees > 0 {
        skipped.push(
            plural(s.unmatched_frees, "unmatched free", "unmatched frees") + " (of blocks from before the trace)",
        );
    }
    if s.shadow_frees > 0 {
        skipped.push(plural(s.shadow_frees, "shadow free", "shadow frees") + " (blocks still live at the end)");
    }
    if s.orphan_frees > 0 {
        skipped.push(plural(s.orphan_frees, "free", "frees") + " of no live block");
    }
    if s.reallocs > 0 {
        skipped.push(plural(s.reallocs, "MALLOC", "MALLOCs") + " over a live block (taken as freeing it)");
    }
    if s.no_size > 0 {
        skipped.push(plural(s.no_size, "MALLOC", "MALLOCs") + " without a size");
    }
    if s.unreadable > 0 {
        skipped.push(plural(s.unreadable, "row", "rows") + " with an unreadable Attr or Ptr");
    }
    if !skipped.is_empty() {
        let _ = writeln!(out, "  not counted: {}", skipped.join("; "));
    }
    for note in &report.notes {
        let _ = writeln!(out, "  {note}");
    }
    for point in &report.points {
        out.push('\n');
        point_text(&mut out, report, point, depth);
    }
    out
}

/// A node's name on its line: the family's total for the root (so it is not read as the owner
/// level of the same name, `PTA` under `PTA total`), else its last `@` level.
fn label<'a>(tree: &Tree, node: &'a Node) -> &'a str {
    if node.depth > 0 {
        return node.name();
    }
    match tree.family {
        Family::Hal => "HAL total",
        Family::Pta => "PTA total",
        Family::Host => "HOST total",
    }
}

/// The widest the owner column grows (in characters, with its indent).
const NAME_COLUMN_MAX: usize = 80;

fn point_text(out: &mut String, report: &Report, point: &Point, depth: Option<usize>) {
    let when = match report.start_ns {
        Some(start) => format!("{} (ts {})", relative(point.ts_ns - start), point.ts_ns),
        None => format!("ts {}", point.ts_ns),
    };
    let _ = match point.kind {
        PointKind::Peak => {
            let family = report.peak_family.map_or("", Family::as_str);
            writeln!(out, "  peak of live {family} bytes, at {when}")
        }
        PointKind::End => writeln!(out, "  end of the trace, at {when}"),
        PointKind::At => {
            let outside = match (report.start_ns, report.end_ns) {
                (Some(start), _) if point.ts_ns < start => " (before the trace started)",
                (_, Some(end)) if point.ts_ns > end => " (after the trace ended: the state at its end)",
                _ => "",
            };
            writeln!(out, "  at {when}{outside}")
        }
    };
    let hal = point.tree(Family::Hal).map(Tree::total).filter(|&b| b > 0);
    // One name column for all trees of the instant, so their numbers line up; a name longer than
    // the column's cap runs past it rather than widening every line.
    let width = point
        .trees
        .iter()
        .flat_map(|tree| shown(tree, depth).map(move |n| 2 * n.depth + printable(label(tree, n)).chars().count()))
        .max()
        .unwrap_or(0)
        .clamp(12, NAME_COLUMN_MAX);
    for tree in &point.trees {
        let total = tree.total();
        for node in shown(tree, depth) {
            let indent = "  ".repeat(2 + node.depth);
            let name = printable(label(tree, node));
            let pad = " ".repeat((width - 2 * node.depth).saturating_sub(name.chars().count()));
            let pct =
                if total > 0 { format!("{:5.1}%", node.bytes as f64 * 100.0 / total as f64) } else { "     -".into() };
            let _ = write!(
                out,
                "{indent}{name}{pad}  {:>10}  {:>15} B  {pct}  {}",
                human_bytes(node.bytes),
                node.bytes,
                plural(node.blocks, "block", "blocks")
            );
            // Pool blocks are carved out of HAL segments: their share says how full those are.
            if node.depth == 0 && tree.family == Family::Pta && node.bytes > 0 {
                if let Some(hal) = hal {
                    let _ = write!(out, "  ({:.1}% of live HAL)", node.bytes as f64 * 100.0 / hal as f64);
                }
            }
            out.push('\n');
        }
    }
}

/// Owned, so trees of several DBs can be gathered into one array; fields in the documented order.
#[derive(Debug, Serialize)]
pub struct JsonNode {
    pub path: String,
    pub depth: usize,
    pub bytes: i64,
    pub blocks: u64,
}

/// One (DB, instant, family) tree.
#[derive(Debug, Serialize)]
pub struct JsonTree {
    pub db: String,
    pub device: String,
    pub point: &'static str,
    pub ts_ns: i64,
    pub family: &'static str,
    pub nodes: Vec<JsonNode>,
}

pub fn json(report: &Report, path: &Path, device: &str, depth: Option<usize>) -> Vec<JsonTree> {
    let mut trees = Vec::new();
    for point in &report.points {
        for tree in &point.trees {
            trees.push(JsonTree {
                db: path.display().to_string(),
                device: device.to_owned(),
                point: point.kind.as_str(),
                ts_ns: point.ts_ns,
                family: tree.family.as_str(),
                nodes: shown(tree, depth)
                    .map(|n| JsonNode { path: n.path.clone(), depth: n.depth, bytes: n.bytes, blocks: n.blocks })
                    .collect(),
            });
        }
    }
    trees
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::db::DumpDb;
    use crate::analysis::decompose::{analyse, TimeSpec};
    use crate::analysis::testdb::{dir, TestDb};

    fn report(name: &str) -> (Report, std::path::PathBuf) {
        let mut db = TestDb::create(&dir(name).join("memscope_dump_1.db"));
        db.system("START_TRACE", 1_000_000_000);
        db.malloc("HAL", 1_000_000_100, 0x1, 4 << 20, Some("CANN@APP"));
        db.malloc("PTA", 1_000_000_200, 0x1, 3 << 20, Some("PTA@vllm@kv_cache"));
        db.malloc("PTA", 1_000_000_300, 0x2, 1 << 20, Some("PTA@weight"));
        db.system("STOP_TRACE", 3_500_000_000);
        let path = db.path.clone();
        drop(db);
        (analyse(&DumpDb::open(&path, false).unwrap(), &[TimeSpec::End]).unwrap(), path)
    }

    #[test]
    fn text_is_an_indented_tree_with_sizes_and_shares() {
        let (report, path) = report("render-text");
        let text = text(&report, &path, "0", None);
        assert!(text.starts_with(&format!("device 0: {}\n", path.display())), "{text}");
        assert!(text.contains("trace: 2.500 s long, from START_TRACE"), "{text}");
        assert!(text.contains("end of the trace, at +2.500 s (ts 3500000000)"), "{text}");
        let lines: Vec<&str> = text.lines().filter(|l| l.contains(" B ")).collect();
        let names: Vec<&str> = lines.iter().map(|l| l.split("  ").find(|s| !s.is_empty()).unwrap().trim()).collect();
        assert_eq!(names, ["HAL total", "CANN", "APP", "PTA total", "PTA", "vllm", "kv_cache", "weight"]);
        assert!(
            lines[3].contains("4.0 MiB") && lines[3].contains("4194304 B") && lines[3].contains("(100.0% of live HAL)")
        );
        assert!(lines[5].contains("3.0 MiB") && lines[5].contains(" 75.0%") && lines[5].contains("1 block"));
        assert!(lines[6].starts_with("          kv_cache"), "nested levels are indented: {:?}", lines[6]);
        // Numbers line up across trees.
        let col = |l: &str| l.find(" B ").unwrap();
        assert!(lines.iter().all(|l| col(l) == col(lines[0])), "{text}");
        // --depth 1: totals and the first level only.
        let shallow = super::text(&report, &path, "0", Some(1));
        assert_eq!(shallow.lines().filter(|l| l.contains(" B ")).count(), 4, "{shallow}");
    }

    #[test]
    fn json_is_flat_trees_in_the_documented_shape() {
        let (report, path) = report("render-json");
        let value = serde_json::to_value(json(&report, &path, "0", Some(1))).unwrap();
        let trees = value.as_array().unwrap();
        assert_eq!(trees.len(), 2);
        assert_eq!(trees[1]["point"], "end");
        assert_eq!(trees[1]["family"], "PTA");
        assert_eq!(trees[1]["device"], "0");
        assert_eq!(trees[1]["ts_ns"], 3_500_000_000i64);
        assert_eq!(trees[1]["db"], path.display().to_string());
        assert_eq!(
            trees[1]["nodes"],
            serde_json::json!([
                {"path": "", "depth": 0, "bytes": 4 << 20, "blocks": 2},
                {"path": "PTA", "depth": 1, "bytes": 4 << 20, "blocks": 2},
            ])
        );
        let text = serde_json::to_string(&json(&report, &path, "0", None)).unwrap();
        assert!(text.starts_with("[{\"db\":"), "fields in the documented order: {text}");
        assert!(text.contains("\"path\":\"PTA@vllm@kv_cache\",\"depth\":3"));
    }

    #[test]
    fn units() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(3 << 29), "1.5 GiB");
        assert_eq!(relative(2_500_000_000), "+2.500 s");
        assert_eq!(relative(300_000_000), "+300.000 ms");
        assert_eq!(relative(-5), "-5 ns");
    }
}
