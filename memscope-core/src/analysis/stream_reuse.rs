//! Blocks the caching allocator could not reuse because another stream still used them: the
//! evidence behind the advisor's MULTI_STREAM_MEMORY_REUSE recommendation.
//!
//! torch_npu keeps a block freed while marked on another stream (`recordStream`, done for a
//! collective's tensors on the communication stream) until that stream's work completes; the
//! trace writes such FREEs with `stream_uses` (the marks still on the block). That costs memory
//! only when the pool takes new segments in the meantime, so the measure is the segments taken
//! after a marked free and before the next step boundary (or the end, without steps): the
//! memory the deferred blocks could have served.

use serde::Serialize;

use super::attr::attr_fields;
use super::db::{DumpDb, DumpRow, Selection};
use super::pass::{self, Consumer};
use super::steps::{self, StepDetector};
use super::AnalysisError;
use crate::store::insight::STREAM_USES;
use crate::vocab::{Event, EventType};

/// What the marked frees cost.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StreamReuse {
    /// PTA frees of blocks still marked on another stream, and their bytes.
    pub deferred_blocks: u64,
    pub deferred_bytes: u64,
    /// The most bytes freed while marked within one step.
    pub max_step_deferred_bytes: u64,
    /// Segment bytes the pool took after a marked free, before the step ended.
    pub grown_while_deferred: u64,
    /// Steps (windows between boundaries) where that happened.
    pub steps_grown: u64,
}

impl StreamReuse {
    /// Whether the deferral made the pool grow.
    pub fn costly(&self) -> bool {
        self.deferred_blocks > 0 && self.grown_while_deferred > 0
    }
}

attr_fields! {
    struct Fields { size, segment }
}

fn size_of(row: &DumpRow<'_>) -> u64 {
    Fields::parse(row.attr).and_then(|f| f.size?.trim().parse().ok()).unwrap_or(0)
}

fn is_segment(row: &DumpRow<'_>) -> bool {
    row.attr.contains("\"segment\"")
        && Fields::parse(row.attr).is_some_and(|f| f.segment.is_some_and(|s| !s.is_empty()))
}

/// The running window: one step.
#[derive(Default)]
struct Window {
    deferred: u64,
    grown: u64,
}

/// The scan: stream-marked frees and the pool growth meanwhile, step by step.
#[derive(Default)]
pub struct Scan {
    report: StreamReuse,
    window: Window,
    detector: StepDetector,
    boundaries: Vec<super::steps::Boundary>,
}

impl Scan {
    fn close_window(&mut self) {
        let w = std::mem::take(&mut self.window);
        self.report.max_step_deferred_bytes = self.report.max_step_deferred_bytes.max(w.deferred);
        if w.grown > 0 {
            self.report.grown_while_deferred += w.grown;
            self.report.steps_grown += 1;
        }
    }

    fn row(&mut self, row: &DumpRow<'_>) {
        self.boundaries.clear();
        let consumed = self.detector.feed(row, &mut self.boundaries);
        if !self.boundaries.is_empty() {
            self.close_window();
        }
        if consumed {
            return;
        }
        match (Event::parse(row.event), EventType::parse(row.event_type)) {
            (Some(Event::Free), Some(EventType::Pta)) if row.attr.contains(STREAM_USES) => {
                let size = size_of(row);
                self.report.deferred_blocks += 1;
                self.report.deferred_bytes += size;
                self.window.deferred += size;
            }
            (Some(Event::Malloc), Some(EventType::Hal)) if self.window.deferred > 0 && is_segment(row) => {
                self.window.grown += size_of(row);
            }
            _ => {}
        }
    }
}

/// Scans one DB (steps from memscope.step() and mstx `step start` ranges).
pub fn analyse(db: &DumpDb) -> Result<StreamReuse, AnalysisError> {
    db.require_columns(&["Name"])?;
    let mut scan = Scan::default();
    pass::run(db, &mut [&mut scan])?;
    Ok(scan.finish())
}

impl Scan {
    pub fn finish(mut self) -> StreamReuse {
        self.boundaries.clear();
        self.detector.finish(&mut self.boundaries);
        self.close_window();
        self.report
    }
}

/// The scan behind [`analyse`], for a pass other replays share.
impl Consumer for Scan {
    fn selection(&self) -> Selection<'static> {
        steps::SELECTION
    }

    fn row(&mut self, row: DumpRow<'_>) {
        Scan::row(self, &row);
    }

    fn restart(&mut self) {
        *self = Self::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::steps::testrows::step;
    use crate::analysis::testdb::{dir, TestDb};
    use crate::store::Attr;

    const MIB: u64 = 1 << 20;

    fn marked_free(db: &mut TestDb, ts: i64, ptr: u64, size: u64) {
        let attr = Attr::new().addr("addr", ptr).with("size", size).with(STREAM_USES, 1u64);
        db.row("FREE", "PTA", ts, 1, Some(ptr), attr);
    }

    fn segment(db: &mut TestDb, ts: i64, ptr: u64, size: u64) {
        let attr = Attr::new().addr("addr", ptr).with("size", size).with("segment", "caching");
        db.row("MALLOC", "HAL", ts, 1, Some(ptr), attr);
    }

    #[test]
    fn segments_taken_after_a_marked_free_in_the_same_step_count() {
        let d = dir("streams-grown");
        let mut db = TestDb::create(&d.join("memscope_dump_1.db"));
        // Step 1: a segment before any marked free (not counted), two marked frees, a segment.
        segment(&mut db, 5, 0x1000, 20 * MIB);
        db.malloc("PTA", 6, 0x1000, 8 * MIB, None);
        db.malloc("PTA", 7, 0x1800, 8 * MIB, None);
        marked_free(&mut db, 10, 0x1000, 8 * MIB);
        marked_free(&mut db, 11, 0x1800, 8 * MIB);
        segment(&mut db, 12, 0x9000, 20 * MIB);
        step(&mut db, 50, 1);
        // Step 2: a segment with no marked free before it; then a marked free and nothing after.
        segment(&mut db, 60, 0xa000, 20 * MIB);
        db.malloc("PTA", 61, 0xa000, 4 * MIB, None);
        marked_free(&mut db, 70, 0xa000, 4 * MIB);
        step(&mut db, 99, 2);
        let r = analyse(&DumpDb::open_read(&db.path).unwrap()).unwrap();
        assert_eq!((r.deferred_blocks, r.deferred_bytes), (3, 20 * MIB));
        assert_eq!(r.max_step_deferred_bytes, 16 * MIB);
        assert_eq!((r.grown_while_deferred, r.steps_grown), (20 * MIB, 1));
        assert!(r.costly());
    }

    #[test]
    fn plain_frees_and_growth_without_marks_cost_nothing() {
        let d = dir("streams-none");
        let mut db = TestDb::create(&d.join("memscope_dump_1.db"));
        segment(&mut db, 5, 0x1000, 20 * MIB);
        db.malloc("PTA", 6, 0x1000, 8 * MIB, None);
        db.free("PTA", 10, 0x1000);
        segment(&mut db, 12, 0x9000, 20 * MIB);
        let r = analyse(&DumpDb::open_read(&db.path).unwrap()).unwrap();
        assert_eq!(r, StreamReuse::default());
        assert!(!r.costly());
    }
}
