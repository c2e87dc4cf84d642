//! How much of a device's peak memory ATB operations' workspaces are: the evidence behind the
//! advisor's ATB_WORKSPACE_MEM_ALLOC_ALG_TYPE rule (`atb_workspace_mem_alloc_alg_type`).
//!
//! Each ATB operation runs in one buffer its caller allocates (torch_npu's workspace allocator,
//! which keeps a grow-only block per stream): the kernels' scratch (`workspace_size`) followed by
//! the graph's intermediate tensors (`intermediate_size`), both from the `OP_LAUNCH` `ATB_START` /
//! `ATB_END` rows. The layout algorithm ATB_WORKSPACE_MEM_ALLOC_ALG_TYPE chooses changes only the
//! intermediate part, so that part's size against the peak is what says whether trying another
//! algorithm can lower the peak.
//!
//! The peak is the device memory taken at once: the live `HAL` blocks (pool segments and
//! workspace blocks included), or, for a trace that saw no runtime allocations, the sum of the
//! pools' reserved bytes (`total` of the `PTA` rows). Operations are told apart by their runner
//! (`runner`, our rows), else msMemScope's `path`, else the row's `Name`. Rows without
//! `intermediate_size` (msMemScope's) give no intermediate bytes, so they never trigger the rule.

use std::borrow::Cow;
use std::collections::HashMap;

use serde::Serialize;

use super::attr::attr_fields;
use super::db::{DumpDb, DumpRow, Selection};
use super::pass::{self, Consumer};
use super::AnalysisError;
use crate::vocab::{Event, EventType};

/// The largest operation's intermediate bytes must be at least this share of the peak...
pub const INTERMEDIATE_SHARE: f64 = 0.10;
/// ...and at least this many bytes. Below either, a better layout saves too little to be worth a
/// restart: torch_npu rounds workspace blocks to 2 MiB and pool segments to 2 or 20 MiB, so
/// smaller gains mostly vanish in the rounding.
pub const INTERMEDIATE_MIN: u64 = 1 << 20;

/// Operations listed in reports and evidence, largest first.
pub const LISTED_OPS: usize = 5;

/// One ATB operation (a runner) over the trace.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct AtbOp {
    /// The runner's address (`Runner@0x...`), msMemScope's `path`, or the row's name.
    pub op: String,
    pub pid: i64,
    pub executions: u64,
    /// The largest kernel scratch and intermediate bytes it ran with.
    pub workspace_size: u64,
    pub intermediate_size: u64,
}

impl AtbOp {
    /// What the operation asked its caller for: scratch and intermediates in one buffer.
    pub fn total(&self) -> u64 {
        self.workspace_size + self.intermediate_size
    }
}

/// ATB workspaces against the device's peak.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct AtbWorkspace {
    /// ATB operations executed (`ATB_START` rows).
    pub executions: u64,
    /// The largest operations first (by intermediates, then by scratch plus intermediates), at
    /// most [`LISTED_OPS`].
    pub ops: Vec<AtbOp>,
    /// Distinct operations seen.
    pub op_count: usize,
    /// Over all executions: the largest scratch, intermediates, and their sum in one operation.
    pub largest_workspace: u64,
    pub largest_intermediate: u64,
    pub largest_total: u64,
    /// The device memory peak the shares are of, and what it counts.
    pub peak_bytes: u64,
    pub peak_basis: &'static str,
}

impl AtbWorkspace {
    pub fn intermediate_share(&self) -> f64 {
        self.largest_intermediate as f64 / self.peak_bytes.max(1) as f64
    }

    pub fn total_share(&self) -> f64 {
        self.largest_total as f64 / self.peak_bytes.max(1) as f64
    }

    /// Whether the intermediates are a large enough part of the peak for the advice.
    pub fn significant(&self) -> bool {
        self.peak_bytes > 0
            && self.largest_intermediate >= INTERMEDIATE_MIN
            && self.intermediate_share() >= INTERMEDIATE_SHARE
    }
}

attr_fields! {
    struct Fields { addr, size, total, pool, shadow, runner, path, workspace_size, intermediate_size }
}

/// A number as Attr writes it: decimal, or `0x` hex for addresses.
fn number(v: Option<&Cow<'_, str>>) -> Option<u64> {
    let v = v?;
    match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => v.parse().ok(),
    }
}

/// ATB operations and the device memory peak, from one pass.
#[derive(Default)]
pub struct Replay {
    hal_live: HashMap<(i64, u64), u64>,
    hal_bytes: u64,
    hal_peak: u64,
    /// Reserved bytes per (process, row type, pool), as the pool last reported them.
    reserved: HashMap<(i64, String, String), u64>,
    reserved_sum: u64,
    reserved_peak: u64,
    ops: HashMap<(i64, String), AtbOp>,
    order: Vec<(i64, String)>,
    report: AtbWorkspace,
}

impl Replay {
    fn memory(&mut self, row: &DumpRow<'_>) {
        let f = Fields::parse(row.attr).unwrap_or_default();
        let addr = || number(Some(&Cow::Borrowed(row.ptr))).or_else(|| number(f.addr.as_ref()));
        use EventType::{Hal, Pta, PtaWorkspace};
        match (Event::parse(row.event), EventType::parse(row.event_type)) {
            (Some(Event::Malloc), Some(Hal)) => {
                if let (Some(addr), Some(size)) = (addr(), number(f.size.as_ref())) {
                    if let Some(old) = self.hal_live.insert((row.pid, addr), size) {
                        self.hal_bytes -= old;
                    }
                    self.hal_bytes += size;
                    self.hal_peak = self.hal_peak.max(self.hal_bytes);
                }
            }
            (Some(Event::Free), Some(Hal)) => {
                if let Some(size) = addr().and_then(|a| self.hal_live.remove(&(row.pid, a))) {
                    self.hal_bytes -= size;
                }
            }
            (Some(Event::Malloc | Event::Free), Some(Pta | PtaWorkspace)) if f.shadow.as_deref() != Some("true") => {
                if let Some(total) = number(f.total.as_ref()) {
                    let pool = f.pool.as_deref().unwrap_or("").to_owned();
                    let key = (row.pid, row.event_type.to_owned(), pool);
                    let old = self.reserved.insert(key, total).unwrap_or(0);
                    self.reserved_sum = self.reserved_sum - old + total;
                    self.reserved_peak = self.reserved_peak.max(self.reserved_sum);
                }
            }
            _ => {}
        }
    }

    fn op(&mut self, row: &DumpRow<'_>) {
        let Some(ty @ (EventType::AtbStart | EventType::AtbEnd)) = EventType::parse(row.event_type) else { return };
        let f = Fields::parse(row.attr).unwrap_or_default();
        let name = match (number(f.runner.as_ref()), f.path.as_deref()) {
            (Some(runner), _) => format!("Runner@{runner:#x}"),
            (None, Some(path)) if !path.is_empty() => path.to_owned(),
            _ => row.name.to_owned(),
        };
        let key = (row.pid, name);
        let op = self.ops.entry(key.clone()).or_insert_with(|| {
            self.order.push(key.clone());
            AtbOp { op: key.1.clone(), pid: row.pid, ..AtbOp::default() }
        });
        let workspace = number(f.workspace_size.as_ref()).unwrap_or(0);
        let intermediate = number(f.intermediate_size.as_ref()).unwrap_or(0);
        op.workspace_size = op.workspace_size.max(workspace);
        op.intermediate_size = op.intermediate_size.max(intermediate);
        let r = &mut self.report;
        r.largest_workspace = r.largest_workspace.max(workspace);
        r.largest_intermediate = r.largest_intermediate.max(intermediate);
        r.largest_total = r.largest_total.max(workspace + intermediate);
        if ty == EventType::AtbStart {
            op.executions += 1;
            r.executions += 1;
        }
    }

    /// The report; none at all when the trace ran no ATB operation.
    pub fn finish(mut self) -> AtbWorkspace {
        if self.report.executions == 0 && self.ops.is_empty() {
            return AtbWorkspace::default();
        }
        let mut ops: Vec<AtbOp> = self.order.iter().filter_map(|k| self.ops.remove(k)).collect();
        // Largest intermediates first (what the rule is about), then the largest buffer; among
        // equals, the first seen.
        ops.sort_by_key(|o| std::cmp::Reverse((o.intermediate_size, o.total())));
        let mut r = self.report;
        r.op_count = ops.len();
        ops.truncate(LISTED_OPS);
        r.ops = ops;
        (r.peak_bytes, r.peak_basis) = if self.hal_peak >= self.reserved_peak {
            (self.hal_peak, "device memory (HAL blocks)")
        } else {
            (self.reserved_peak, "pool reserved memory (PTA)")
        };
        r
    }
}

/// Reads one DB's ATB operations and its device memory peak. A DB without `Name` or `Thread Id`
/// columns has no operator rows to read and reports none.
pub fn analyse(db: &DumpDb) -> Result<AtbWorkspace, AnalysisError> {
    let Some(mut replay) = Replay::for_db(db)? else { return Ok(AtbWorkspace::default()) };
    pass::run(db, &mut [&mut replay])?;
    Ok(replay.finish())
}

/// The rows read: operators (with the names and threads that identify them) and memory.
const SELECTION: Selection<'static> = Selection {
    events: &[OP_LAUNCH, Event::Malloc.as_str(), Event::Free.as_str(), Event::System.as_str()],
    name: true,
    thread: true,
};
const OP_LAUNCH: &str = Event::OpLaunch.as_str();

impl Replay {
    /// The replay for `db`, or none when it cannot hold operator rows (no `Name`/`Thread Id`).
    pub fn for_db(db: &DumpDb) -> Result<Option<Self>, AnalysisError> {
        Ok(db.missing_columns(&["Name", "Thread Id"])?.is_empty().then(Self::default))
    }
}

/// The replay behind [`analyse`], for a pass other replays share.
impl Consumer for Replay {
    fn selection(&self) -> Selection<'static> {
        SELECTION
    }

    fn row(&mut self, row: DumpRow<'_>) {
        match row.event {
            OP_LAUNCH => self.op(&row),
            _ => self.memory(&row),
        }
    }

    fn restart(&mut self) {
        *self = Self::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::testdb::{dir, TestDb};
    use crate::store::Attr;

    const MIB: u64 = 1 << 20;

    pub(crate) fn atb(db: &mut TestDb, ts: i64, runner: u64, workspace: u64, intermediate: u64) {
        for (t, ty) in [(ts, "ATB_START"), (ts + 1, "ATB_END")] {
            let attr = Attr::new()
                .addr("workspace_ptr", 0x9000)
                .with("workspace_size", workspace)
                .with("intermediate_size", intermediate)
                .addr("runner", runner);
            db.row("OP_LAUNCH", ty, t, 1, None, attr);
        }
    }

    fn hal(db: &mut TestDb, ts: i64, ptr: u64, size: u64) {
        db.malloc("HAL", ts, ptr, size, None);
    }

    #[test]
    fn workspaces_are_measured_per_operation_against_the_device_peak() {
        let d = dir("atb-ws");
        let mut db = TestDb::create(&d.join("memscope_dump_1.db"));
        hal(&mut db, 1, 0x1000_0000, 32 * MIB); // weights
        hal(&mut db, 2, 0x2000_0000, 46 * MIB); // the workspace block
        for step in 0..3 {
            let t = 10 + step * 10;
            hal(&mut db, t, 0x3000_0000, 20 * MIB); // activations
            atb(&mut db, t + 2, 0x55, MIB, 44 * MIB);
            atb(&mut db, t + 4, 0x66, MIB / 2, 22 * MIB);
            db.free("HAL", t + 8, 0x3000_0000);
        }
        let r = analyse(&DumpDb::open_read(&db.path).unwrap()).unwrap();
        assert_eq!((r.executions, r.op_count), (6, 2));
        assert_eq!((r.largest_workspace, r.largest_intermediate, r.largest_total), (MIB, 44 * MIB, 45 * MIB));
        assert_eq!((r.peak_bytes, r.peak_basis), (98 * MIB, "device memory (HAL blocks)"));
        assert_eq!(
            r.ops[0],
            AtbOp { op: "Runner@0x55".into(), pid: 1, executions: 3, workspace_size: MIB, intermediate_size: 44 * MIB }
        );
        assert_eq!(r.ops[1].op, "Runner@0x66");
        assert!((r.intermediate_share() - 44.0 / 98.0).abs() < 1e-9);
        assert!(r.significant());
    }

    #[test]
    fn small_or_unknown_intermediates_are_not_significant() {
        let d = dir("atb-small");
        let mut db = TestDb::create(&d.join("memscope_dump_1.db"));
        hal(&mut db, 1, 0x1000_0000, 512 * MIB);
        atb(&mut db, 5, 0x55, MIB, 40 * MIB); // 7.8%: under the share
        let r = analyse(&DumpDb::open_read(&db.path).unwrap()).unwrap();
        assert_eq!(r.largest_intermediate, 40 * MIB);
        assert!(!r.significant());

        let d = dir("atb-tiny");
        let mut db = TestDb::create(&d.join("memscope_dump_1.db"));
        hal(&mut db, 1, 0x1000_0000, 4 * MIB);
        atb(&mut db, 5, 0x55, 0, 768 << 10); // 19% but under 1 MiB
        assert!(!analyse(&DumpDb::open_read(&db.path).unwrap()).unwrap().significant());

        // msMemScope's rows: a path and a workspace size, no intermediate size.
        let d = dir("atb-msmemscope");
        let mut db = TestDb::create(&d.join("memscope_dump_1.db"));
        hal(&mut db, 1, 0x1000_0000, 4 * MIB);
        let attr = Attr::new().with("path", "0_Graph/1_Linear").with("workspace_size", 3 * MIB);
        db.row("OP_LAUNCH", "ATB_START", 5, 1, None, attr);
        let r = analyse(&DumpDb::open_read(&db.path).unwrap()).unwrap();
        assert_eq!(
            (r.ops[0].op.as_str(), r.largest_workspace, r.largest_intermediate),
            ("0_Graph/1_Linear", 3 * MIB, 0)
        );
        assert!(!r.significant());
    }

    #[test]
    fn without_runtime_rows_the_pools_reserved_bytes_are_the_peak() {
        let d = dir("atb-pta");
        let mut db = TestDb::create(&d.join("memscope_dump_1.db"));
        let pta = |db: &mut TestDb, ts, ptr: u64, pool: &'static str, total: u64| {
            let attr = Attr::new().addr("addr", ptr).with("size", MIB).with("total", total).with("pool", pool);
            db.row("MALLOC", "PTA", ts, 1, Some(ptr), attr);
        };
        pta(&mut db, 1, 0x100, "caching", 40 * MIB);
        pta(&mut db, 2, 0x200, "workspace", 26 * MIB);
        pta(&mut db, 3, 0x300, "caching", 20 * MIB);
        atb(&mut db, 4, 0x55, MIB, 24 * MIB);
        let r = analyse(&DumpDb::open_read(&db.path).unwrap()).unwrap();
        assert_eq!((r.peak_bytes, r.peak_basis), (66 * MIB, "pool reserved memory (PTA)"));
        assert!(r.significant());
        // A DB with no ATB rows at all.
        let d = dir("atb-none");
        let db = TestDb::create(&d.join("memscope_dump_1.db"));
        assert_eq!(analyse(&DumpDb::open_read(&db.path).unwrap()).unwrap().executions, 0);
    }
}
