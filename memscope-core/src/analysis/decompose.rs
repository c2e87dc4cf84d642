//! Memory decomposition: which owners held the live memory at an instant (the peak, the end of
//! the trace, or a given time), as the owner tree msMemScope's `decompose` analysis and
//! Insight's decomposition view build (shared/reference/msmemscope-and-insight.md §4.1).
//!
//! Blocks are replayed from `memscope_dump`: a MALLOC opens the block keyed by (Process Id, Event
//! Type, Ptr), the next FREE of that key closes it. Owners are `@`-paths (`PTA@vllm@kv_cache`), and
//! a node's bytes are those of the live blocks whose owner is the node or lies under it.
//!
//! One pass over the rows keeps live bytes per (family, owner) and per family, and records each
//! change as a compact step; the peak is found from the family totals as the pass goes, and the
//! trees are built afterwards only for the few instants asked for, by replaying the steps up to
//! each. The cost is the time-ordered read ([`super::db::TimeOrder`]) plus O(rows), whatever the
//! number of owners.

use std::collections::HashMap;
use std::str::FromStr;

use super::attr::attr_fields;
use super::blocks::{block_attr, BlockHooks, BlockKey, BlockReplay, Bounds, OwnerSlots};
use super::db::{DumpDb, DumpRow, Fed, Selection};
use super::pass::Consumer as _;
use super::py_stacks;
use super::AnalysisError;
use crate::vocab::Event;

pub use super::blocks::{Family, UNKNOWN_OWNER};

/// An instant asked for on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimeSpec {
    /// When the device's live bytes were highest.
    Peak,
    /// Just before the trace stopped.
    End,
    /// `Timestamp(ns)`, ns since the epoch.
    Absolute(i64),
    /// ns after the trace's START_TRACE row.
    SinceStart(i64),
}

impl FromStr for TimeSpec {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let t = text.trim();
        let bad = || {
            format!(
                "`{text}` is not a time: use peak, end, a Timestamp(ns) such as 1767225600123456789, \
                 or a time after the trace start such as +2.5s, +300ms, +1m"
            )
        };
        match t.to_ascii_lowercase().as_str() {
            "peak" => return Ok(Self::Peak),
            "end" => return Ok(Self::End),
            _ => {}
        }
        if let Some(rel) = t.strip_prefix('+') {
            let split = rel.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(rel.len());
            let (number, unit) = rel.split_at(split);
            let unit_ns: i128 = match unit.trim() {
                "ns" => 1,
                "us" | "µs" => 1_000,
                "ms" => 1_000_000,
                "" | "s" => 1_000_000_000,
                "m" | "min" => 60_000_000_000,
                "h" => 3_600_000_000_000,
                _ => return Err(bad()),
            };
            // Exact decimal arithmetic: `+2.000000001s` must be 2000000001 ns, not a float's guess.
            let (int, frac) = number.split_once('.').unwrap_or((number, ""));
            if (int.is_empty() && frac.is_empty()) || frac.contains('.') || frac.len() > 18 {
                return Err(bad());
            }
            let int: i128 = if int.is_empty() { 0 } else { int.parse().map_err(|_| bad())? };
            let frac_ns = if frac.is_empty() {
                0
            } else {
                frac.parse::<i128>().map_err(|_| bad())? * unit_ns / 10i128.pow(frac.len() as u32)
            };
            let ns = int.checked_mul(unit_ns).and_then(|v| v.checked_add(frac_ns)).ok_or_else(bad)?;
            return i64::try_from(ns).map(Self::SinceStart).map_err(|_| bad());
        }
        if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) {
            return t.parse().map(Self::Absolute).map_err(|_| bad());
        }
        Err(bad())
    }
}

/// What kind of instant a point is, as stored in `ms_decompose.point`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PointKind {
    Peak,
    End,
    At,
}

impl PointKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Peak => "peak",
            Self::End => "end",
            Self::At => "at",
        }
    }
}

/// One node of an owner tree. The root has the empty path and depth 0; `CANN@APP` has depth 2.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    pub path: String,
    pub depth: usize,
    pub bytes: i64,
    pub blocks: u64,
}

impl Node {
    /// The last `@` level (what a tree shows on the node's line).
    pub fn name(&self) -> &str {
        self.path.rsplit('@').next().unwrap_or("")
    }
}

/// One family's owner tree at one instant, depth-first, children by size (largest first).
#[derive(Clone, Debug)]
pub struct Tree {
    pub family: Family,
    pub nodes: Vec<Node>,
}

impl Tree {
    pub fn total(&self) -> i64 {
        self.nodes.first().map_or(0, |n| n.bytes)
    }
}

#[derive(Clone, Debug)]
pub struct Point {
    pub kind: PointKind,
    pub ts_ns: i64,
    /// One tree per family present in the trace, HAL, PTA, HOST.
    pub trees: Vec<Tree>,
}

impl Point {
    pub fn tree(&self, family: Family) -> Option<&Tree> {
        self.trees.iter().find(|t| t.family == family)
    }
}

/// What the replay did with the rows, so a surprising tree can be explained.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// MALLOC rows that opened a block, per family.
    pub mallocs: [u64; 3],
    /// FREE rows that closed one.
    pub frees: u64,
    /// FREEs of blocks allocated before the trace (`unmatched`): nothing to close.
    pub unmatched_frees: u64,
    /// Synthetic FREEs written when the trace stopped (`shadow`): the blocks were still live.
    pub shadow_frees: u64,
    /// FREEs with no live block at that key (and not marked `unmatched`).
    pub orphan_frees: u64,
    /// MALLOCs at a key already live: the earlier block is taken as freed.
    pub reallocs: u64,
    /// MALLOCs without a positive `size` (Insight skips them too).
    pub no_size: u64,
    /// Memory rows whose Attr is not a JSON object, or whose Ptr is not an address.
    pub unreadable: u64,
}

#[derive(Clone, Debug)]
pub struct Report {
    /// START_TRACE's timestamp, else the first row's; `+TIME` counts from it.
    pub start_ns: Option<i64>,
    /// Whether `start_ns` is a START_TRACE row (rather than the first row).
    pub start_is_trace: bool,
    /// STOP_TRACE's timestamp, else the last row's.
    pub end_ns: Option<i64>,
    /// The family whose live bytes define the peak: HAL when the trace has HAL blocks, else PTA,
    /// else HOST.
    pub peak_family: Option<Family>,
    /// Families with at least one block in the trace.
    pub families: Vec<Family>,
    pub points: Vec<Point>,
    /// Why an asked-for point is missing (no memory rows, no peak, ...).
    pub notes: Vec<String>,
    pub stats: Stats,
}

/// Runs the decomposition over a DB.
pub fn analyse(db: &DumpDb, wanted: &[TimeSpec]) -> Result<Report, AnalysisError> {
    analyse_by(db, wanted, By::Owner)
}

/// What a tree's nodes are: owner paths, or the job's lines that made the blocks (`sites`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum By {
    #[default]
    Owner,
    /// Attr `site`; blocks without one are [`NO_SITE`].
    Site,
    /// Attr `py_stack`, as its frames from the outermost ([`py_stacks::path`]): the flame view.
    Stack,
}

/// The node of blocks whose MALLOC has no `site` (no Python stack was read for them).
pub const NO_SITE: &str = "(no site: no Python stack)";

/// As [`analyse`], with the nodes `by` owner, site or Python stack.
pub fn analyse_by(db: &DumpDb, wanted: &[TimeSpec], by: By) -> Result<Report, AnalysisError> {
    let mut replay = ByReplay::new(db, by)?;
    db.for_each_row(|fed| match fed {
        Fed::Row(row) => replay.row(row),
        Fed::Restart => replay.restart(),
    })?;
    Ok(replay.finish(wanted))
}

/// [`analyse_by`]'s replay, for a pass that feeds others too (the report's).
pub struct ByReplay(Replay);

impl ByReplay {
    pub fn new(db: &DumpDb, by: By) -> Result<Self, AnalysisError> {
        let stacks = if by == By::Stack { py_stacks::paths(db)? } else { HashMap::new() };
        Ok(Self(Replay { metrics: Metrics { by, stacks, ..Metrics::default() }, ..Replay::default() }))
    }

    pub fn finish(self, wanted: &[TimeSpec]) -> Report {
        self.0.finish(wanted)
    }
}

impl super::pass::Consumer for ByReplay {
    fn selection(&self) -> Selection<'static> {
        SELECTION
    }

    fn row(&mut self, row: DumpRow<'_>) {
        self.0.apply(row);
    }

    fn restart(&mut self) {
        let Metrics { by, stacks, .. } = std::mem::take(&mut self.0.metrics);
        self.0 = Replay { metrics: Metrics { by, stacks, ..Metrics::default() }, ..Replay::default() };
    }
}

/// The rows the decomposition reads.
const SELECTION: Selection<'static> = {
    const EVENTS: [&str; 3] = [Event::Malloc.as_str(), Event::Free.as_str(), Event::System.as_str()];
    Selection { events: &EVENTS, name: false, thread: false }
};

/// Every change of live bytes per owner, in time order: the steps the trees are built from,
/// for exports that draw the decomposition over time (`export --format perfetto`). The bytes of
/// an owner at an instant are the sum of its changes at or before it, as [`analyse`]'s trees at
/// that instant have them.
#[derive(Clone, Debug, Default)]
pub struct Timeline {
    /// (family, owner path) by owner index.
    pub owners: Vec<(Family, String)>,
    /// (Timestamp(ns), owner index, bytes opened (> 0) or closed (< 0)), in time order.
    pub changes: Vec<(i64, u32, i64)>,
}

impl Timeline {
    /// Calls `f(ts, totals, bytes)` once per distinct timestamp, after all its changes: the live
    /// bytes per family (indexed by `Family as usize`) and per owner index then.
    pub fn instants(&self, mut f: impl FnMut(i64, &[i64; 3], &[i64])) {
        let mut totals = [0i64; 3];
        let mut bytes = vec![0i64; self.owners.len()];
        let mut i = 0;
        let changes = &self.changes;
        while i < changes.len() {
            let ts = changes[i].0;
            while i < changes.len() && changes[i].0 == ts {
                let (_, slot, delta) = changes[i];
                totals[self.owners[slot as usize].0 as usize] += delta;
                bytes[slot as usize] += delta;
                i += 1;
            }
            f(ts, &totals, &bytes);
        }
    }
}

/// The decomposition's changes over a DB (see [`Timeline`]).
pub fn timeline(db: &DumpDb) -> Result<Timeline, AnalysisError> {
    let mut replay = TimelineReplay::default();
    db.for_each_row(|fed| match fed {
        Fed::Row(row) => replay.row(row),
        Fed::Restart => replay.restart(),
    })?;
    Ok(replay.finish())
}

/// The replay behind [`timeline`], for a pass other replays share ([`super::pass`]).
#[derive(Default)]
pub struct TimelineReplay(Replay);

impl TimelineReplay {
    pub fn finish(self) -> Timeline {
        let m = self.0.metrics;
        let owners = (0..m.slots.len() as u32).map(|i| (m.slots.get(i).0, m.slots.get(i).1.to_owned())).collect();
        Timeline { owners, changes: m.steps.iter().map(|s| (s.ts, s.slot, s.delta)).collect() }
    }
}

impl super::pass::Consumer for TimelineReplay {
    fn selection(&self) -> Selection<'static> {
        SELECTION
    }

    fn row(&mut self, row: DumpRow<'_>) {
        self.0.apply(row);
    }

    fn restart(&mut self) {
        self.0 = Replay::default();
    }
}

attr_fields! {
    /// The Attr keys decompose reads. Non-string values read as absent, exactly as Insight's getter
    /// treats them, so both tools see the same blocks.
    struct AttrFields { addr, size, weight, owner, site, py_stack, unmatched, shadow }
}
block_attr!(AttrFields);

#[derive(Clone, Copy, Debug)]
struct LiveBlock {
    slot: u32,
    size: i64,
}

/// One change of live bytes, in time order; `delta > 0` opens a block, `< 0` closes one.
#[derive(Clone, Copy, Debug)]
struct Step {
    ts: i64,
    slot: u32,
    delta: i64,
}

#[derive(Clone, Copy, Debug)]
struct Peak {
    bytes: i64,
    /// Steps applied at that instant.
    steps: usize,
    ts: i64,
}

#[derive(Default)]
struct Replay {
    blocks: BlockReplay<LiveBlock>,
    metrics: Metrics,
}

/// Decompose's own metrics on the paired blocks: live bytes per (family, owner) slot as steps,
/// the family totals and their peaks.
#[derive(Default)]
struct Metrics {
    by: By,
    /// With [`By::Stack`]: each Python stack's path, by the id its rows write.
    stacks: HashMap<String, String>,
    slots: OwnerSlots,
    steps: Vec<Step>,
    totals: [i64; 3],
    peaks: [Option<Peak>; 3],
    /// Timestamp of the rows being applied; the state is only a candidate peak once all rows of
    /// one timestamp are in, so an alloc and a free at the same instant never make a false peak.
    group_ts: Option<i64>,
    bounds: Bounds,
    stats: Stats,
}

impl Metrics {
    fn step(&mut self, ts: i64, slot: u32, delta: i64) {
        let family = self.slots.family(slot);
        self.totals[family.index()] += delta;
        self.steps.push(Step { ts, slot, delta });
    }

    fn close_group(&mut self) {
        let Some(ts) = self.group_ts else { return };
        for family in Family::ALL {
            let bytes = self.totals[family.index()];
            let peak = &mut self.peaks[family.index()];
            if bytes > 0 && peak.is_none_or(|p| bytes > p.bytes) {
                *peak = Some(Peak { bytes, steps: self.steps.len(), ts });
            }
        }
    }
}

impl BlockHooks for Metrics {
    type Block = LiveBlock;
    type Attr<'a> = AttrFields<'a>;

    fn unreadable(&mut self) {
        self.stats.unreadable += 1;
    }
    fn shadow_free(&mut self) {
        // Written at the end for blocks still live: counting it would empty the END state.
        self.stats.shadow_frees += 1;
    }
    fn unmatched_free(&mut self, _: &DumpRow<'_>, _: &AttrFields<'_>) {
        self.stats.unmatched_frees += 1;
    }
    fn orphan_free(&mut self, _: &DumpRow<'_>, _: &AttrFields<'_>) {
        self.stats.orphan_frees += 1;
    }
    fn no_size(&mut self) {
        self.stats.no_size += 1;
    }
    fn seen(&mut self, ts: i64) {
        self.bounds.seen(ts);
    }
    fn open(
        &mut self,
        _: &DumpRow<'_>,
        _: BlockKey,
        family: Family,
        owner: &str,
        size: i64,
        attr: &AttrFields<'_>,
    ) -> LiveBlock {
        let name = match self.by {
            By::Owner => owner,
            By::Site => attr.site.as_deref().unwrap_or(NO_SITE),
            By::Stack => attr.py_stack.as_deref().and_then(|id| self.stacks.get(id)).map_or(py_stacks::NO_STACK, |p| p),
        };
        let (slot, _) = self.slots.slot(family, name);
        self.stats.mallocs[family.index()] += 1;
        LiveBlock { slot, size }
    }
    fn opened(&mut self, row: &DumpRow<'_>, block: &LiveBlock) {
        self.step(row.ts, block.slot, block.size);
    }
    fn realloc(&mut self, row: &DumpRow<'_>, _: BlockKey, old: LiveBlock) {
        self.stats.reallocs += 1;
        self.step(row.ts, old.slot, -old.size);
    }
    fn free(&mut self, row: &DumpRow<'_>, _: BlockKey, block: LiveBlock, _: &AttrFields<'_>) {
        self.stats.frees += 1;
        self.step(row.ts, block.slot, -block.size);
    }
}

impl Replay {
    fn apply(&mut self, row: DumpRow<'_>) {
        let m = &mut self.metrics;
        if m.group_ts != Some(row.ts) {
            m.close_group();
            m.group_ts = Some(row.ts);
        }
        if row.event == Event::System.as_str() {
            m.bounds.system(row.event_type, row.ts);
            m.bounds.seen(row.ts);
            return;
        }
        self.blocks.apply(m, &row);
    }

    fn finish(self, wanted: &[TimeSpec]) -> Report {
        self.metrics.finish(wanted)
    }
}

impl Metrics {
    fn finish(mut self, wanted: &[TimeSpec]) -> Report {
        self.close_group();
        let families: Vec<Family> = Family::ALL.into_iter().filter(|f| self.stats.mallocs[f.index()] > 0).collect();
        let peak_family = families.first().copied();
        let start_ns = self.bounds.start_ns();
        let end_ns = self.bounds.end_ns();
        let mut notes = Vec::new();
        // (kind, ts, steps to apply)
        let mut wanted_points: Vec<(PointKind, i64, usize)> = Vec::new();
        for &asked in wanted {
            let at = |ts: i64| (PointKind::At, ts, self.steps.partition_point(|s| s.ts <= ts));
            let point = match asked {
                TimeSpec::Peak => match peak_family.and_then(|f| self.peaks[f.index()]) {
                    Some(p) => Some((PointKind::Peak, p.ts, p.steps)),
                    None => {
                        notes.push("no peak: no memory was live at any time".to_owned());
                        None
                    }
                },
                TimeSpec::End => match end_ns {
                    Some(ts) => Some((PointKind::End, ts, self.steps.len())),
                    None => {
                        notes.push("no end: the trace has no rows".to_owned());
                        None
                    }
                },
                TimeSpec::Absolute(ts) => Some(at(ts)),
                TimeSpec::SinceStart(d) => match start_ns {
                    Some(start) => Some(at(start.saturating_add(d))),
                    None => {
                        notes.push("no relative time: the trace has no rows to count from".to_owned());
                        None
                    }
                },
            };
            if let Some(p) = point {
                if !wanted_points.iter().any(|q| q.0 == p.0 && q.1 == p.1) {
                    wanted_points.push(p);
                }
            }
        }
        let points = self.snapshots(&families, &wanted_points);
        Report {
            start_ns,
            start_is_trace: self.bounds.start.is_some(),
            end_ns,
            peak_family,
            families,
            points,
            notes,
            stats: self.stats,
        }
    }

    /// Trees at each wanted point, from one sweep over the steps in order of point.
    fn snapshots(&self, families: &[Family], wanted: &[(PointKind, i64, usize)]) -> Vec<Point> {
        let mut order: Vec<usize> = (0..wanted.len()).collect();
        order.sort_by_key(|&i| wanted[i].2);
        let mut per_slot: Vec<(i64, u64)> = vec![(0, 0); self.slots.len()];
        let mut applied = 0;
        let mut points: Vec<Option<Point>> = vec![None; wanted.len()];
        for i in order {
            let (kind, ts_ns, upto) = wanted[i];
            for step in &self.steps[applied..upto] {
                let s = &mut per_slot[step.slot as usize];
                s.0 += step.delta;
                if step.delta > 0 {
                    s.1 += 1;
                } else {
                    s.1 -= 1;
                }
            }
            applied = upto;
            let trees = families.iter().map(|&f| self.tree(f, &per_slot)).collect();
            points[i] = Some(Point { kind, ts_ns, trees });
        }
        points.into_iter().map(|p| p.expect("every point is filled")).collect()
    }

    fn tree(&self, family: Family, per_slot: &[(i64, u64)]) -> Tree {
        let mut root = Building::default();
        for (slot, &(bytes, blocks)) in per_slot.iter().enumerate() {
            let (f, owner) = self.slots.get(slot as u32);
            if f == family && blocks > 0 {
                root.add(owner, bytes, blocks);
            }
        }
        let mut nodes = Vec::new();
        root.flatten(String::new(), 0, &mut nodes);
        Tree { family, nodes }
    }
}

#[derive(Default)]
struct Building {
    name: String,
    bytes: i64,
    blocks: u64,
    children: Vec<Building>,
}

impl Building {
    /// Adds an owner's bytes to the root and to every `@` prefix of it: splitting on `@` (not
    /// comparing string prefixes) keeps `PTA@w` out of `PTA@weight`.
    fn add(&mut self, owner: &str, bytes: i64, blocks: u64) {
        self.bytes += bytes;
        self.blocks += blocks;
        let mut node = self;
        for level in owner.split('@') {
            let i = match node.children.iter().position(|c| c.name == level) {
                Some(i) => i,
                None => {
                    node.children.push(Building { name: level.to_owned(), ..Building::default() });
                    node.children.len() - 1
                }
            };
            node = &mut node.children[i];
            node.bytes += bytes;
            node.blocks += blocks;
        }
    }

    fn flatten(mut self, path: String, depth: usize, out: &mut Vec<Node>) {
        self.children.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.name.cmp(&b.name)));
        out.push(Node { path: path.clone(), depth, bytes: self.bytes, blocks: self.blocks });
        for child in self.children {
            let child_path = if depth == 0 { child.name.clone() } else { format!("{path}@{}", child.name) };
            child.flatten(child_path, depth + 1, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::testdb::{dir, TestDb};

    const START: i64 = 1_000_000_000_000;

    fn run(db: TestDb, wanted: &[TimeSpec]) -> Report {
        let path = db.path.clone();
        drop(db);
        analyse(&DumpDb::open(&path, false).unwrap(), wanted).unwrap()
    }

    fn bytes(point: &Point, family: Family, path: &str) -> Option<(i64, u64)> {
        point.tree(family)?.nodes.iter().find(|n| n.path == path).map(|n| (n.bytes, n.blocks))
    }

    #[test]
    fn owners_nest_on_at_boundaries_only() {
        let mut db = TestDb::create(&dir("nest").join("memscope_dump_1.db"));
        db.system("START_TRACE", START);
        db.malloc("PTA", START + 1, 0x1, 100, Some("PTA@w"));
        db.malloc("PTA", START + 2, 0x2, 1000, Some("PTA@weight"));
        db.malloc("PTA", START + 3, 0x3, 10, Some("PTA@weight@layer1"));
        db.malloc("PTA", START + 4, 0x4, 5, Some("PTA"));
        db.malloc("PTA", START + 5, 0x5, 7, Some("PTA_WORKSPACE"));
        db.malloc("PTA", START + 6, 0x6, 3, None);
        db.malloc("HAL", START + 7, 0x100, 4096, Some("CANN@APP"));
        db.malloc("HOST", START + 8, 0x200, 64, Some("HOST@weight"));
        let report = run(db, &[TimeSpec::End]);
        let end = &report.points[0];
        assert_eq!(end.kind, PointKind::End);
        assert_eq!(bytes(end, Family::Pta, ""), Some((1125, 6)));
        assert_eq!(bytes(end, Family::Pta, "PTA"), Some((1115, 4)));
        assert_eq!(bytes(end, Family::Pta, "PTA@w"), Some((100, 1)));
        assert_eq!(bytes(end, Family::Pta, "PTA@weight"), Some((1010, 2)));
        assert_eq!(bytes(end, Family::Pta, "PTA@weight@layer1"), Some((10, 1)));
        assert_eq!(bytes(end, Family::Pta, "PTA_WORKSPACE"), Some((7, 1)));
        assert_eq!(bytes(end, Family::Pta, UNKNOWN_OWNER), Some((3, 1)));
        // PTA lives inside HAL: not added to it.
        assert_eq!(bytes(end, Family::Hal, ""), Some((4096, 1)));
        assert_eq!(bytes(end, Family::Hal, "CANN@APP"), Some((4096, 1)));
        assert_eq!(bytes(end, Family::Host, "HOST@weight"), Some((64, 1)));
        // Depth-first, largest first.
        let pta: Vec<(&str, usize)> =
            end.tree(Family::Pta).unwrap().nodes.iter().map(|n| (n.path.as_str(), n.depth)).collect();
        assert_eq!(
            pta,
            [
                ("", 0),
                ("PTA", 1),
                ("PTA@weight", 2),
                ("PTA@weight@layer1", 3),
                ("PTA@w", 2),
                ("PTA_WORKSPACE", 1),
                (UNKNOWN_OWNER, 1)
            ]
        );
        assert_eq!(report.families, [Family::Hal, Family::Pta, Family::Host]);
        assert_eq!(report.peak_family, Some(Family::Hal));
    }

    #[test]
    fn peak_is_taken_after_all_rows_of_an_instant() {
        let mut db = TestDb::create(&dir("peak").join("memscope_dump_1.db"));
        db.system("START_TRACE", START);
        db.malloc("HAL", START + 10, 0x1, 100, Some("CANN@APP"));
        // At +20 a block is freed and a bigger one taken in the same nanosecond: 100 -> 150, never
        // 250. Written free-last (higher ID) so that a row-by-row peak would see 250.
        db.malloc("HAL", START + 20, 0x2, 150, Some("CANN@HCCL"));
        db.free("HAL", START + 20, 0x1);
        db.malloc("HAL", START + 30, 0x3, 10, Some("CANN@APP"));
        db.free("HAL", START + 40, 0x3);
        db.malloc("HAL", START + 50, 0x4, 10, Some("CANN@APP")); // ties the +30 peak: first one wins
        db.free("HAL", START + 60, 0x4);
        db.system("STOP_TRACE", START + 100);
        let report = run(db, &[TimeSpec::Peak, TimeSpec::End]);
        let peak = &report.points[0];
        assert_eq!((peak.kind, peak.ts_ns), (PointKind::Peak, START + 30));
        assert_eq!(bytes(peak, Family::Hal, ""), Some((160, 2)));
        assert_eq!(bytes(peak, Family::Hal, "CANN@HCCL"), Some((150, 1)));
        assert_eq!(bytes(peak, Family::Hal, "CANN@APP"), Some((10, 1)));
        let end = &report.points[1];
        assert_eq!((end.kind, end.ts_ns), (PointKind::End, START + 100));
        assert_eq!(bytes(end, Family::Hal, ""), Some((150, 1)));
        assert_eq!(bytes(end, Family::Hal, "CANN@APP"), None);
    }

    #[test]
    fn peak_follows_pta_when_there_is_no_hal() {
        let mut db = TestDb::create(&dir("peak-pta").join("memscope_dump_1.db"));
        db.malloc("HOST", START + 1, 0x9, 1 << 30, Some("HOST@weight"));
        db.malloc("PTA", START + 2, 0x1, 300, Some("PTA@a"));
        db.free("PTA", START + 3, 0x1);
        db.malloc("PTA", START + 4, 0x2, 200, Some("PTA@b"));
        let report = run(db, &[TimeSpec::Peak]);
        assert_eq!(report.peak_family, Some(Family::Pta));
        assert_eq!(report.points[0].ts_ns, START + 2);
        assert_eq!(bytes(&report.points[0], Family::Pta, "PTA@a"), Some((300, 1)));
        // Other families are shown at that instant too.
        assert_eq!(bytes(&report.points[0], Family::Host, ""), Some((1 << 30, 1)));
    }

    #[test]
    fn unmatched_frees_close_nothing_and_shadow_frees_do_not_empty_the_end() {
        let mut db = TestDb::create(&dir("marks").join("memscope_dump_1.db"));
        db.system("START_TRACE", START);
        db.malloc("HAL", START + 1, 0x1, 100, Some("CANN@APP"));
        // An unmatched FREE at the same address as a live block (address reuse after a
        // pre-trace block was freed): it must not close the live one.
        db.free_marked("HAL", START + 2, 0x1, "unmatched");
        db.malloc("PTA", START + 3, 0x2, 40, Some("PTA@x"));
        db.free("PTA", START + 4, 0x777); // never allocated in the trace
        db.system("STOP_TRACE", START + 10);
        db.free_marked("HAL", START + 10, 0x1, "shadow");
        db.free_marked("PTA", START + 11, 0x2, "shadow");
        let report = run(db, &[TimeSpec::End]);
        let end = &report.points[0];
        assert_eq!(end.ts_ns, START + 10);
        assert_eq!(bytes(end, Family::Hal, "CANN@APP"), Some((100, 1)));
        assert_eq!(bytes(end, Family::Pta, "PTA@x"), Some((40, 1)));
        assert_eq!(report.stats.unmatched_frees, 1);
        assert_eq!(report.stats.shadow_frees, 2);
        assert_eq!(report.stats.orphan_frees, 1);
        assert_eq!(report.stats.frees, 0);
    }

    #[test]
    fn at_absolute_and_relative() {
        let mut db = TestDb::create(&dir("at").join("memscope_dump_1.db"));
        db.system("START_TRACE", START);
        db.malloc("HAL", START + 1_000_000_000, 0x1, 100, Some("CANN@APP"));
        db.malloc("HAL", START + 2_500_000_000, 0x2, 50, Some("CANN@HCCL"));
        db.free("HAL", START + 3_000_000_000, 0x1);
        db.system("STOP_TRACE", START + 4_000_000_000);
        let wanted = [
            "+2.5s".parse().unwrap(),
            TimeSpec::Absolute(START + 2_499_999_999),
            "+300ms".parse().unwrap(),
            "+3s".parse().unwrap(),
        ];
        let report = run(db, &wanted);
        assert!(report.start_is_trace);
        let totals: Vec<(PointKind, i64, i64)> =
            report.points.iter().map(|p| (p.kind, p.ts_ns - START, p.tree(Family::Hal).unwrap().total())).collect();
        assert_eq!(
            totals,
            [
                (PointKind::At, 2_500_000_000, 150), // rows at exactly that instant are in
                (PointKind::At, 2_499_999_999, 100),
                (PointKind::At, 300_000_000, 0), // before the first block: an empty tree
                (PointKind::At, 3_000_000_000, 50),
            ]
        );
        assert_eq!(report.points[2].tree(Family::Hal).unwrap().nodes.len(), 1);
    }

    #[test]
    fn duplicate_points_are_reported_once() {
        let mut db = TestDb::create(&dir("dups").join("memscope_dump_1.db"));
        db.malloc("HAL", START, 0x1, 1, None);
        let report = run(db, &[TimeSpec::End, TimeSpec::End, TimeSpec::Peak]);
        assert_eq!(report.points.len(), 2);
        assert!(!report.start_is_trace);
        assert_eq!(report.start_ns, Some(START));
    }

    #[test]
    fn empty_trace_has_no_points_but_says_why() {
        let mut db = TestDb::create(&dir("empty").join("memscope_dump_1.db"));
        db.system("START_TRACE", START);
        db.system("STOP_TRACE", START + 5);
        let report = run(db, &[TimeSpec::Peak, TimeSpec::End]);
        assert!(report.families.is_empty());
        assert_eq!(report.points.len(), 1, "the end exists, with no trees");
        assert!(report.points[0].trees.is_empty());
        assert_eq!(report.notes.len(), 1);
    }

    #[test]
    fn malformed_rows_are_counted_not_fatal() {
        let mut db = TestDb::create(&dir("malformed").join("memscope_dump_1.db"));
        db.malloc("HAL", START, 0x1, 10, None);
        db.conn()
            .execute_batch(
                "INSERT INTO memscope_dump VALUES (90, 'MALLOC', 'HAL', 'x', 1000000000001, 1, 1, '0', '0x2', 'not json', '', '');
                 INSERT INTO memscope_dump VALUES (91, 'MALLOC', 'HAL', 'x', 1000000000002, 1, 1, '0', '0x3', '{\"size\":77}', '', '');
                 INSERT INTO memscope_dump VALUES (92, 'MALLOC', 'HAL', 'x', 1000000000003, 1, 1, '0', 'N/A', '{\"size\":\"5\"}', '', '');
                 INSERT INTO memscope_dump VALUES (93, 'MALLOC', 'HAL', 'x', 1000000000004, 1, 1, '0', '4096', '{\"size\":\"5\",\"owner\":\"\"}', '', '');",
            )
            .unwrap();
        let report = run(db, &[TimeSpec::End]);
        assert_eq!(report.stats.unreadable, 2);
        assert_eq!(report.stats.no_size, 1, "numeric sizes are ignored, as Insight ignores them");
        assert_eq!(bytes(&report.points[0], Family::Hal, UNKNOWN_OWNER), Some((15, 2)));
    }

    #[test]
    fn blocks_are_keyed_by_process_type_and_address() {
        let mut db = TestDb::create(&dir("keys").join("memscope_dump_1.db"));
        db.malloc("PTA", START, 0x1, 10, Some("PTA"));
        db.malloc("PTA_WORKSPACE", START + 1, 0x1, 20, Some("PTA_WORKSPACE"));
        db.row(
            "MALLOC",
            "PTA",
            START + 2,
            2,
            Some(0x1),
            crate::store::Attr::new().with("size", 40u64).with("owner", "PTA"),
        );
        db.free("PTA", START + 3, 0x1); // pid 1's PTA block only
        db.malloc("PTA", START + 4, 0x5, 1, Some("PTA"));
        db.malloc("PTA", START + 5, 0x5, 2, Some("PTA")); // no FREE in between
        let report = run(db, &[TimeSpec::End]);
        assert_eq!(bytes(&report.points[0], Family::Pta, ""), Some((20 + 40 + 2, 3)));
        assert_eq!(report.stats.reallocs, 1);
    }

    #[test]
    fn times_parse() {
        assert_eq!("peak".parse::<TimeSpec>(), Ok(TimeSpec::Peak));
        assert_eq!("END".parse::<TimeSpec>(), Ok(TimeSpec::End));
        assert_eq!("1767225600123456789".parse::<TimeSpec>(), Ok(TimeSpec::Absolute(1_767_225_600_123_456_789)));
        assert_eq!("+2.5s".parse::<TimeSpec>(), Ok(TimeSpec::SinceStart(2_500_000_000)));
        assert_eq!("+2".parse::<TimeSpec>(), Ok(TimeSpec::SinceStart(2_000_000_000)));
        assert_eq!("+300ms".parse::<TimeSpec>(), Ok(TimeSpec::SinceStart(300_000_000)));
        assert_eq!("+1.5us".parse::<TimeSpec>(), Ok(TimeSpec::SinceStart(1_500)));
        assert_eq!("+7ns".parse::<TimeSpec>(), Ok(TimeSpec::SinceStart(7)));
        assert_eq!("+2m".parse::<TimeSpec>(), Ok(TimeSpec::SinceStart(120_000_000_000)));
        assert_eq!("+2.000000001s".parse::<TimeSpec>(), Ok(TimeSpec::SinceStart(2_000_000_001)));
        assert_eq!("+.5s".parse::<TimeSpec>(), Ok(TimeSpec::SinceStart(500_000_000)));
        for bad in ["", "+", "+s", "+1.2.3s", "+5 parsecs", "2.5s", "-1s", "yesterday", "+99999999999h"] {
            let err = bad.parse::<TimeSpec>().unwrap_err();
            assert!(err.contains("+2.5s"), "{bad}: {err}");
        }
    }

    /// 1M rows (500k blocks over 200 owners) in well under the "seconds" the brief allows; run
    /// with `--ignored` on a release build to see the time.
    #[test]
    #[ignore = "a timing benchmark, run by hand with --release (see docs/benchmarks.md)"]
    fn a_million_rows_in_seconds() {
        let path = dir("million").join("memscope_dump_1.db");
        let mut db = TestDb::create(&path);
        db.conn().execute_batch("BEGIN").unwrap();
        let owners: Vec<&'static str> =
            (0..200).map(|i| &*Box::leak(format!("PTA@model@layer{i}").into_boxed_str())).collect();
        for i in 0..500_000u64 {
            db.malloc("PTA", START + 2 * i as i64, 0x1000 + i, 4096, Some(owners[i as usize % 200]));
        }
        for i in 0..500_000u64 {
            db.free("PTA", START + 1_000_000 + 2 * i as i64 + 1, 0x1000 + i);
        }
        db.conn().execute_batch("COMMIT").unwrap();
        drop(db);
        let t = std::time::Instant::now();
        let report = analyse(&DumpDb::open(&path, false).unwrap(), &[TimeSpec::Peak, TimeSpec::End]).unwrap();
        let elapsed = t.elapsed();
        eprintln!("1M rows analysed in {elapsed:?}");
        assert_eq!(report.points[0].tree(Family::Pta).unwrap().total(), 500_000 * 4096);
        assert!(elapsed.as_secs() < 10, "{elapsed:?}");
    }
}
