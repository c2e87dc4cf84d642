//! The page's flame view: each family's bytes at its peak by the Python stack that allocated
//! them, the outermost frame on top (an icicle). The trees are the decomposition's, by stack
//! (`decompose::By::Stack`), fed by the report's one pass; this module only picks each family's
//! peak and keeps the nodes the page can draw.

use serde::Serialize;

use super::curves::Curve;
use crate::analysis::decompose::{ByReplay, Report, TimeSpec};
use crate::analysis::py_stacks;

/// Nodes under this share of the family's peak (per mille) are left out: too thin to see.
const MIN_PER_MILLE: i64 = 1;
/// Nodes kept per family, largest subtrees first (a depth-first list stays a tree: a kept
/// node's parent holds at least its bytes).
const MAX_NODES: usize = 3000;

/// One node: a frame under its parent's, depth-first, children largest first.
#[derive(Clone, Debug, Serialize)]
pub struct FlameNode {
    /// 0 is the family's root; 1 the outermost frames.
    pub depth: u32,
    /// `function (file:line)`, or [`py_stacks::NO_STACK`] for blocks allocated without one.
    pub name: String,
    pub bytes: i64,
    pub blocks: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Flame {
    pub family: &'static str,
    /// The family's peak, ns after the origin (the owner tree's "at the peak").
    pub t: i64,
    pub total: i64,
    pub nodes: Vec<FlameNode>,
}

/// The instants the replay must keep: each family's peak.
pub fn wanted(curves: &[Curve], origin: i64) -> Vec<TimeSpec> {
    curves.iter().map(|c| TimeSpec::Absolute(origin + c.peak_t)).collect()
}

/// One flame per family with bytes of a Python stack at its peak.
pub fn flames(replay: ByReplay, curves: &[Curve], origin: i64, notes: &mut Vec<String>) -> Vec<Flame> {
    let report: Report = replay.finish(&wanted(curves, origin));
    let mut out = Vec::new();
    for c in curves {
        let ts = origin + c.peak_t;
        let Some(tree) = report
            .points
            .iter()
            .find(|p| p.ts_ns == ts)
            .and_then(|p| p.trees.iter().find(|t| t.family.as_str() == c.family))
        else {
            continue;
        };
        let total = tree.total();
        let stacked = tree.nodes.iter().any(|n| n.depth == 1 && n.path != py_stacks::NO_STACK);
        if !stacked || total <= 0 {
            continue;
        }
        let visible = |bytes: i64| bytes.saturating_mul(1000) >= total.saturating_mul(MIN_PER_MILLE);
        let all = tree.nodes.len();
        let nodes: Vec<FlameNode> = tree
            .nodes
            .iter()
            .filter(|n| visible(n.bytes))
            .take(MAX_NODES)
            .map(|n| FlameNode {
                depth: n.depth as u32,
                name: if n.depth == 0 { c.family.to_owned() } else { n.name().replace("%40", "@") },
                bytes: n.bytes,
                blocks: n.blocks,
            })
            .collect();
        if nodes.len() < all {
            notes.push(format!(
                "{} Python stacks at the peak: {} of {all} frames drawn (those under {MIN_PER_MILLE} ‰ of the peak, or past \
                 {MAX_NODES}, are left out)",
                c.family,
                nodes.len()
            ));
        }
        out.push(Flame { family: c.family, t: c.peak_t, total, nodes });
    }
    out
}

#[cfg(test)]
mod tests {
    use crate::analysis::db::DumpDb;
    use crate::analysis::testdb::{dir, TestDb};
    use crate::report::{device, Options};
    use crate::store::attr::Attr;

    const T0: i64 = 1_767_225_600_000_000_000;

    fn malloc(db: &mut TestDb, ts: i64, ptr: u64, size: u64, stack: Option<u64>) {
        let attr = Attr::new().addr("addr", ptr).with("size", size).with_opt("py_stack", stack);
        db.row("MALLOC", "PTA", T0 + ts, 1, Some(ptr), attr);
    }

    /// At the peak: 300 bytes under main → train_step → forward (200 of them one frame deeper,
    /// in linear), 50 under main → load, 25 with no stack; a block freed before the peak is not
    /// in it, and the `@` in a path comes back whole.
    #[test]
    fn the_peak_by_stack_nests_frames_from_the_outermost() {
        let mut db = TestDb::create(&dir("report-flame").join("d.db"));
        db.system("START_TRACE", T0);
        let stacks = [
            (1, "/v/torch/nn/functional.py(10): linear\n/job/m.py(5): forward\n/job/t.py(7): train_step\n/j@b/t.py(1): main"),
            (2, "/job/m.py(6): forward\n/job/t.py(7): train_step\n/j@b/t.py(1): main"),
            (3, "/job/t.py(3): load\n/j@b/t.py(1): main"),
        ];
        db.conn().execute_batch("CREATE TABLE ms_py_stacks (id INTEGER PRIMARY KEY, text TEXT NOT NULL)").unwrap();
        for (id, text) in stacks {
            db.conn().execute("INSERT INTO ms_py_stacks VALUES (?1, ?2)", rusqlite::params![id, text]).unwrap();
        }
        malloc(&mut db, 1, 0x1000, 50, Some(3));
        malloc(&mut db, 2, 0x2000, 99, Some(2));
        db.free("PTA", T0 + 3, 0x2000);
        malloc(&mut db, 4, 0x3000, 200, Some(1));
        malloc(&mut db, 5, 0x4000, 100, Some(2));
        malloc(&mut db, 6, 0x5000, 25, None);
        db.free("PTA", T0 + 7, 0x3000);
        db.system("STOP_TRACE", T0 + 8);
        let open = DumpDb::open_read(&db.path).unwrap();
        let r = device(&open, "0", T0, &Options::default()).unwrap();
        let f = r.flames.iter().find(|f| f.family == "PTA").expect("a PTA flame");
        assert_eq!((f.t, f.total), (6, 375));
        let got: Vec<(u32, &str, i64)> = f.nodes.iter().map(|n| (n.depth, n.name.as_str(), n.bytes)).collect();
        assert_eq!(
            got,
            [
                (0, "PTA", 375),
                (1, "main (/j@b/t.py:1)", 350),
                (2, "train_step (/job/t.py:7)", 300),
                (3, "forward (/job/m.py:5)", 200),
                (4, "linear (/v/torch/nn/functional.py:10)", 200),
                (3, "forward (/job/m.py:6)", 100),
                (2, "load (/job/t.py:3)", 50),
                (1, "(no Python stack)", 25),
            ]
        );
        // A trace without the table has no flame.
        db.conn().execute_batch("DROP TABLE ms_py_stacks").unwrap();
        let r = device(&DumpDb::open_read(&db.path).unwrap(), "0", T0, &Options::default()).unwrap();
        assert!(r.flames.is_empty());
    }
}
