//! The `compare --level` report: two traces' call sequences aligned by their shortest edit script
//! ([`super::opdiff`]), each call with its memory delta ([`super::calls`]), as rows (in both,
//! only in A, only in B), a summary, and the matched calls whose deltas differ most; text for
//! people and JSON for scripts.
//!
//! Readability: training runs repeat the same calls thousands of times. Consecutive rows with the
//! same kind, name and deltas are merged into one row with a count (in JSON too, losslessly), and
//! the text further elides long stretches of matched calls with equal deltas, keeping a little
//! context around each difference, and stops after `--rows` rows.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;

use super::calls::{Calls, Level};
use super::opdiff::{self, Edit};
use crate::printable::printable;
use crate::units::signed_bytes;

/// Matched rows with equal deltas kept on each side of a difference in the text.
const CONTEXT: usize = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    Same,
    OnlyA,
    OnlyB,
}

/// A run of `count` consecutive identical edits.
#[derive(Debug, PartialEq, Eq, Serialize)]
pub struct Row {
    pub kind: Kind,
    /// 1-based position of the run's first call in A, and in B (absent on the side without it).
    pub a: Option<usize>,
    pub b: Option<usize>,
    pub name: String,
    pub delta_a: Option<i64>,
    pub delta_b: Option<i64>,
    pub count: usize,
}

impl Row {
    /// A matched row whose deltas differ.
    fn differs(&self) -> bool {
        self.kind == Kind::Same && self.delta_a != self.delta_b
    }
}

#[derive(Debug, Serialize)]
pub struct Side {
    pub db: String,
    pub calls: usize,
    pub unpaired_ends: u64,
    /// Caching-pool events that followed no call.
    pub unattributed_events: u64,
}

#[derive(Debug, Default, PartialEq, Eq, Serialize)]
pub struct Summary {
    pub calls_a: usize,
    pub calls_b: usize,
    pub matched: usize,
    /// Deleted: only in A.
    pub only_a: usize,
    /// Inserted: only in B.
    pub only_b: usize,
    /// Sums of every call's delta.
    pub delta_a: i64,
    pub delta_b: i64,
    pub only_a_delta: i64,
    pub only_b_delta: i64,
    /// Matched calls whose deltas differ.
    pub matched_delta_differs: usize,
}

#[derive(Debug, Serialize)]
pub struct CallDiff {
    pub device: String,
    pub level: Level,
    pub a: Side,
    pub b: Side,
    pub summary: Summary,
    /// Matched rows whose deltas differ, largest |B − A| first, at most `--top`.
    pub largest_delta_diffs: Vec<Row>,
    pub rows: Vec<Row>,
}

fn side(path: &Path, calls: &Calls) -> Side {
    Side {
        db: path.display().to_string(),
        calls: calls.calls.len(),
        unpaired_ends: calls.unpaired_ends,
        unattributed_events: calls.unattributed,
    }
}

/// Name ids of both sides in one numbering, so that equal names compare equal.
fn joint_ids(a: &Calls, b: &Calls) -> (Vec<u32>, Vec<u32>) {
    fn renumber<'n>(ids: &mut HashMap<&'n str, u32>, names: &'n [Box<str>]) -> Vec<u32> {
        names
            .iter()
            .map(|n| {
                let next = ids.len() as u32;
                *ids.entry(n).or_insert(next)
            })
            .collect()
    }
    let mut ids = HashMap::new();
    let (map_a, map_b) = (renumber(&mut ids, &a.names), renumber(&mut ids, &b.names));
    (a.calls.iter().map(|c| map_a[c.name as usize]).collect(), b.calls.iter().map(|c| map_b[c.name as usize]).collect())
}

/// Aligns `a` and `b` and sums them up; `top` bounds the list of largest delta differences.
pub fn compare(device: &str, level: Level, a: (&Path, &Calls), b: (&Path, &Calls), top: usize) -> CallDiff {
    let ((path_a, a), (path_b, b)) = (a, b);
    let (seq_a, seq_b) = joint_ids(a, b);
    let mut summary = Summary {
        calls_a: a.calls.len(),
        calls_b: b.calls.len(),
        delta_a: a.calls.iter().map(|c| c.delta).sum(),
        delta_b: b.calls.iter().map(|c| c.delta).sum(),
        ..Summary::default()
    };
    let mut rows: Vec<Row> = Vec::new();
    for edit in opdiff::diff(&seq_a, &seq_b) {
        let (kind, ia, ib) = match edit {
            Edit::Same { a, b } => (Kind::Same, Some(a), Some(b)),
            Edit::OnlyA(i) => (Kind::OnlyA, Some(i), None),
            Edit::OnlyB(j) => (Kind::OnlyB, None, Some(j)),
        };
        let (ca, cb) = (ia.map(|i| &a.calls[i]), ib.map(|j| &b.calls[j]));
        let name = ca.map_or_else(|| b.name(cb.expect("one side")), |c| a.name(c));
        let (delta_a, delta_b) = (ca.map(|c| c.delta), cb.map(|c| c.delta));
        match kind {
            Kind::Same => {
                summary.matched += 1;
                summary.matched_delta_differs += usize::from(delta_a != delta_b);
            }
            Kind::OnlyA => {
                summary.only_a += 1;
                summary.only_a_delta += delta_a.unwrap_or(0);
            }
            Kind::OnlyB => {
                summary.only_b += 1;
                summary.only_b_delta += delta_b.unwrap_or(0);
            }
        }
        match rows.last_mut() {
            Some(r) if r.kind == kind && r.name == name && r.delta_a == delta_a && r.delta_b == delta_b => r.count += 1,
            _ => rows.push(Row {
                kind,
                a: ia.map(|i| i + 1),
                b: ib.map(|j| j + 1),
                name: name.to_owned(),
                delta_a,
                delta_b,
                count: 1,
            }),
        }
    }
    let gap = |r: &Row| (r.delta_b.unwrap_or(0) - r.delta_a.unwrap_or(0)).unsigned_abs();
    let mut largest: Vec<&Row> = rows.iter().filter(|r| r.differs()).collect();
    largest.sort_by(|x, y| gap(y).cmp(&gap(x)).then(x.a.cmp(&y.a)));
    let largest_delta_diffs = largest.into_iter().take(top).map(|r| Row { name: r.name.clone(), ..*r }).collect();
    CallDiff {
        device: device.to_owned(),
        level,
        a: side(path_a, a),
        b: side(path_b, b),
        summary,
        largest_delta_diffs,
        rows,
    }
}

/// What a text line of the script shows.
enum Line<'a> {
    Row(&'a Row),
    /// Matched calls with equal deltas, elided: how many.
    Elided(usize),
}

/// The rows worth reading: every difference, with [`CONTEXT`] quiet rows around it.
fn script_lines(rows: &[Row]) -> Vec<Line<'_>> {
    let loud = |r: &Row| r.kind != Kind::Same || r.differs();
    let near: Vec<bool> = (0..rows.len())
        .map(|i| rows[i.saturating_sub(CONTEXT)..(i + CONTEXT + 1).min(rows.len())].iter().any(loud))
        .collect();
    let mut lines = Vec::new();
    for (row, shown) in rows.iter().zip(near) {
        match (shown, lines.last_mut()) {
            (true, _) => lines.push(Line::Row(row)),
            (false, Some(Line::Elided(n))) => *n += row.count,
            (false, _) => lines.push(Line::Elided(row.count)),
        }
    }
    lines
}

fn delta(d: Option<i64>) -> String {
    d.map_or_else(|| "-".to_owned(), signed_bytes)
}

fn position(p: Option<usize>) -> String {
    p.map_or_else(|| "-".to_owned(), |p| p.to_string())
}

fn row_text(out: &mut String, r: &Row) {
    let mark = match r.kind {
        Kind::Same if r.differs() => '~',
        Kind::Same => '=',
        Kind::OnlyA => '-',
        Kind::OnlyB => '+',
    };
    let count = if r.count > 1 { format!(" (x{})", r.count) } else { String::new() };
    let _ = writeln!(
        out,
        "    {mark} {:>7} {:>7}  {:>11} {:>11}  {}{count}",
        position(r.a),
        position(r.b),
        delta(r.delta_a),
        delta(r.delta_b),
        printable(&r.name)
    );
}

/// The text report; `max_rows` bounds the script's lines (0: all).
pub fn text(d: &CallDiff, max_rows: usize) -> String {
    let noun = d.level.noun();
    let s = &d.summary;
    let mut out = String::new();
    let what = match d.level {
        Level::Op => "operators (OP_LAUNCH ends) in order",
        Level::Kernel => "kernel launches in order",
    };
    let _ = writeln!(out, "device {}: {what}", d.device);
    for (which, side) in [("A", &d.a), ("B", &d.b)] {
        let mut notes = Vec::new();
        if side.unpaired_ends > 0 {
            notes.push(format!("{} ends without a start, named N/A", side.unpaired_ends));
        }
        let notes = if notes.is_empty() { String::new() } else { format!(" ({})", notes.join("; ")) };
        let _ = writeln!(out, "  {which}: {}: {} {noun}s{notes}", side.db, side.calls);
    }
    let _ = writeln!(
        out,
        "  {} matched ({} with different deltas), {} only in A, {} only in B",
        s.matched, s.matched_delta_differs, s.only_a, s.only_b
    );
    let _ = writeln!(
        out,
        "  memory delta (the next caching-pool event after each {noun}), summed: A: {}; B: {} (B-A: {}); {noun}s only in A: {}, only in B: {}",
        signed_bytes(s.delta_a),
        signed_bytes(s.delta_b),
        signed_bytes(s.delta_b - s.delta_a),
        signed_bytes(s.only_a_delta),
        signed_bytes(s.only_b_delta)
    );
    if s.only_a + s.only_b + s.matched_delta_differs == 0 {
        let _ = writeln!(out, "  the sequences and their deltas are the same");
        return out;
    }
    let _ = writeln!(out, "  edit script (= same, ~ same {noun} with another delta, - only in A, + only in B):");
    let _ = writeln!(out, "    {:>9} {:>7}  {:>11} {:>11}  {noun}", "A#", "B#", "delta A", "delta B");
    let lines = script_lines(&d.rows);
    let shown = if max_rows == 0 { lines.len() } else { lines.len().min(max_rows) };
    for line in &lines[..shown] {
        match line {
            Line::Row(r) => row_text(&mut out, r),
            Line::Elided(n) => {
                let _ = writeln!(out, "    ... {n} matched {noun}s with equal deltas");
            }
        }
    }
    if shown < lines.len() {
        let _ =
            writeln!(out, "    ... {} more lines (--rows 0 shows them all; --json has every row)", lines.len() - shown);
    }
    if !d.largest_delta_diffs.is_empty() {
        let _ = writeln!(out, "  largest delta differences among matched {noun}s:");
        for r in &d.largest_delta_diffs {
            let count = if r.count > 1 { format!(" (x{})", r.count) } else { String::new() };
            let _ = writeln!(
                out,
                "    A#{} B#{}  A {}  B {}  B-A {}  {}{count}",
                position(r.a),
                position(r.b),
                delta(r.delta_a),
                delta(r.delta_b),
                signed_bytes(r.delta_b.unwrap_or(0) - r.delta_a.unwrap_or(0)),
                printable(&r.name)
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::calls::Call;

    /// Calls from (name, delta) pairs.
    fn calls(list: &[(&str, i64)]) -> Calls {
        let mut c = Calls::default();
        for (i, (name, delta)) in list.iter().enumerate() {
            let id = match c.names.iter().position(|n| &**n == *name) {
                Some(id) => id,
                None => {
                    c.names.push((*name).into());
                    c.names.len() - 1
                }
            };
            c.calls.push(Call { name: id as u32, ts: i as i64, delta: *delta });
        }
        c
    }

    fn diff(a: &[(&str, i64)], b: &[(&str, i64)], top: usize) -> CallDiff {
        let p = Path::new("x.db");
        compare("0", Level::Op, (p, &calls(a)), (p, &calls(b)), top)
    }

    #[test]
    fn rows_are_merged_and_summed_per_kind() {
        let mut a = vec![("mm", 100)];
        a.extend([("add", 0); 5]);
        a.extend([("relu", 8), ("sum", -4)]);
        let mut b = vec![("mm", 100)];
        b.extend([("add", 0); 5]);
        b.extend([("cat", 64), ("cat", 64), ("relu", 16)]);
        let d = diff(&a, &b, 10);
        let kinds: Vec<(Kind, &str, usize)> = d.rows.iter().map(|r| (r.kind, r.name.as_str(), r.count)).collect();
        assert_eq!(
            kinds,
            [
                (Kind::Same, "mm", 1),
                (Kind::Same, "add", 5),
                (Kind::OnlyB, "cat", 2),
                (Kind::Same, "relu", 1),
                (Kind::OnlyA, "sum", 1)
            ]
        );
        assert_eq!((d.rows[2].a, d.rows[2].b, d.rows[3].a, d.rows[3].b), (None, Some(7), Some(7), Some(9)));
        let want = Summary {
            calls_a: 8,
            calls_b: 9,
            matched: 7,
            only_a: 1,
            only_b: 2,
            delta_a: 104,
            delta_b: 244,
            only_a_delta: -4,
            only_b_delta: 128,
            matched_delta_differs: 1,
        };
        assert_eq!(d.summary, want);
        assert_eq!(d.largest_delta_diffs.len(), 1);
        assert_eq!((d.largest_delta_diffs[0].name.as_str(), d.largest_delta_diffs[0].delta_b), ("relu", Some(16)));
    }

    #[test]
    fn largest_delta_differences_come_first_and_top_bounds_them() {
        let a = [("a", 0), ("b", 0), ("c", 0)];
        let b = [("a", 5), ("b", -50), ("c", 20)];
        let d = diff(&a, &b, 2);
        let names: Vec<&str> = d.largest_delta_diffs.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["b", "c"]);
        assert_eq!(d.summary.matched_delta_differs, 3);
    }

    #[test]
    fn text_elides_quiet_stretches_and_stops_at_max_rows() {
        let names: Vec<String> = (0..40).map(|i| format!("op{i}")).collect();
        let a: Vec<(&str, i64)> = names.iter().map(|n| (n.as_str(), 0)).collect();
        let mut b = a.clone();
        b.insert(20, ("aten.cat.default", 1 << 20));
        let d = diff(&a, &b, 10);
        let t = text(&d, 0);
        assert!(t.contains("40 matched (0 with different deltas), 0 only in A, 1 only in B"), "{t}");
        assert!(t.contains("... 18 matched ops with equal deltas"), "{t}");
        assert!(t.contains("    +       -      21            -    +1.0 MiB  aten.cat.default\n"), "{t}");
        assert_eq!(t.lines().filter(|l| l.starts_with("    = ")).count(), 2 * CONTEXT, "{t}");
        let cut = text(&d, 2);
        assert!(cut.contains("... 5 more lines"), "{cut}");
        // The same sequences say so in one line.
        let same = text(&diff(&a, &a, 10), 0);
        assert!(same.contains("the sequences and their deltas are the same") && !same.contains("edit script"));
    }

    #[test]
    fn op_names_reach_the_text_escaped_and_the_rows_exact() {
        let evil = "op\u{1b}]0;pwned\u{7}\nmemscope-bpf: forged";
        let d = diff(&[("mm", 0), (evil, 8)], &[("mm", 0), (evil, 16)], 10);
        let t = text(&d, 0);
        assert!(!t.contains('\u{1b}') && !t.contains("\nmemscope-bpf: forged"), "{t}");
        assert!(t.contains("op\\u{1b}]0;pwned\\u{7}\\nmemscope-bpf: forged"), "{t}");
        assert_eq!(d.rows[1].name, evil, "--json keeps the exact name");
    }
}
