//! Memory held by Python reference cycles: tensors the program had dropped but that only the
//! cyclic garbage collector could free, still live at the memory peak. The evidence behind the
//! advisor's "collect garbage at epoch ends" (`gc_at_epoch_end`).
//!
//! The trace marks each FREE made inside a collector pass (`freed_by: gc`, from the probe on
//! CPython's `gc_collect_main`). A block the collector freed in a later step than the one it was
//! born in outlived its step only because it sat in a cycle: activations, losses, closures
//! captured in hooks. At the peak, the bytes of such blocks born before the peak's step began are
//! garbage from earlier steps that a `gc.collect()` at each step or epoch end would have freed
//! before the peak.
//!
//! Blocks the collector frees only after the last step boundary (interpreter shutdown, the end of
//! training) are left out: nothing says they were garbage before then, and a model's parameters
//! in a cycle are freed exactly that way. Tensor blocks only: `PTA` blocks that are not workspace
//! or segments, and `HOST` blocks (CPU tensors on the cpu output).

use serde::Serialize;

use super::db::{DumpDb, DumpRow, Selection};
use super::decompose::Family;
use super::pass::{self, Consumer};
use super::steps::{self, BlockEnd, BlockKind, BlockSink, Timeline};
use super::AnalysisError;

/// Garbage held at the peak must be at least this share of the peak's live bytes...
pub const HELD_SHARE: f64 = 0.10;
/// ...and at least this many bytes (below it, a restart to change code is not worth it).
pub const HELD_MIN: u64 = 1 << 20;

/// What the collector freed, and what it held at the peak.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct GcHeld {
    /// Blocks (and bytes) freed inside collector passes.
    pub freed_blocks: u64,
    pub freed_bytes: u64,
    /// Of those, freed in a later step than their birth, before the last boundary.
    pub late_blocks: u64,
    pub late_bytes: u64,
    /// Mean steps from birth to the collector's free, over the late blocks.
    pub mean_steps_late: f64,
    /// The peak of live tensor bytes and when it was (first time reached).
    pub peak_bytes: u64,
    pub peak_ts: Option<i64>,
    /// Live at the peak: late blocks born before the latest boundary at or before the peak.
    pub held_at_peak: u64,
    pub held_blocks_at_peak: u64,
    /// Step boundaries seen.
    pub boundaries: usize,
}

impl GcHeld {
    /// Whether the held garbage is worth the advice.
    pub fn significant(&self) -> bool {
        self.held_at_peak >= HELD_MIN && self.held_at_peak as f64 >= HELD_SHARE * self.peak_bytes as f64
    }
}

/// A block the collector freed: its life and how many steps it outlived its birth step by.
#[derive(Clone, Copy)]
struct Freed {
    alloc_ts: i64,
    free_ts: i64,
    size: u64,
    steps_late: u64,
}

/// Follows the live tensor bytes (for the peak) and keeps only the blocks the collector freed
/// in a later step than their birth: memory stays proportional to those, not to the trace.
#[derive(Default)]
struct Collect {
    late: Vec<Freed>,
    /// Blocks and bytes the collector freed, late or not.
    freed: (u64, u64),
    live: i64,
    peak: i64,
    peak_ts: Option<i64>,
}

fn is_tensor(family: Family, kind: BlockKind) -> bool {
    match family {
        Family::Pta => kind == BlockKind::Block,
        Family::Host => true,
        Family::Hal => false,
    }
}

impl BlockSink for Collect {
    fn block_start(&mut self, family: Family, kind: BlockKind, size: i64, ts: i64) {
        if !is_tensor(family, kind) || size <= 0 {
            return;
        }
        self.live += size;
        if self.live > self.peak {
            self.peak = self.live;
            self.peak_ts = Some(ts);
        }
    }

    fn block_end(&mut self, e: &BlockEnd) {
        if !is_tensor(e.family, e.kind) || e.size <= 0 {
            return;
        }
        let Some(free_ts) = e.free_ts else { return };
        self.live -= e.size;
        if !e.by_gc {
            return;
        }
        self.freed.0 += 1;
        self.freed.1 += e.size as u64;
        if let Some((born, ended)) = e.steps.filter(|(born, ended)| ended > born) {
            self.late.push(Freed { alloc_ts: e.alloc_ts, free_ts, size: e.size as u64, steps_late: ended - born });
        }
    }

    fn restart(&mut self) {
        *self = Self::default();
    }
}

impl Collect {
    fn report(&self, boundaries: &[i64]) -> GcHeld {
        let mut r = GcHeld { boundaries: boundaries.len(), ..GcHeld::default() };
        (r.freed_blocks, r.freed_bytes) = self.freed;
        r.peak_bytes = self.peak.max(0) as u64;
        r.peak_ts = self.peak_ts;
        // Late frees after the last boundary do not count (see the module comment).
        let Some(&last) = boundaries.last() else { return r };
        let late: Vec<&Freed> = self.late.iter().filter(|b| b.free_ts < last).collect();
        r.late_blocks = late.len() as u64;
        r.late_bytes = late.iter().map(|b| b.size).sum();
        if r.late_blocks > 0 {
            r.mean_steps_late = late.iter().map(|b| b.steps_late).sum::<u64>() as f64 / r.late_blocks as f64;
        }
        let Some(at) = r.peak_ts else { return r };
        // The step running at the peak began at the latest boundary at or before it.
        let Some(step_start) = boundaries.iter().rev().find(|&&ts| ts <= at).copied() else { return r };
        for b in late.iter().filter(|b| b.alloc_ts < step_start && b.alloc_ts <= at && at < b.free_ts) {
            r.held_at_peak += b.size;
            r.held_blocks_at_peak += 1;
        }
        r
    }
}

/// Replays one DB's blocks and steps (from memscope.step() and mstx `step start` ranges).
pub fn analyse(db: &DumpDb) -> Result<GcHeld, AnalysisError> {
    db.require_columns(&["Name"])?;
    let mut replay = Replay::default();
    pass::run(db, &mut [&mut replay])?;
    Ok(replay.finish())
}

/// The replay behind [`analyse`], for a pass other replays share.
pub struct Replay {
    timeline: Timeline,
    collect: Collect,
}

impl Default for Replay {
    fn default() -> Self {
        Self { timeline: Timeline::new(None), collect: Collect::default() }
    }
}

impl Replay {
    pub fn finish(mut self) -> GcHeld {
        self.timeline.finish(&mut self.collect);
        let boundaries: Vec<i64> = self.timeline.boundaries.iter().map(|b| b.ts).collect();
        self.collect.report(&boundaries)
    }
}

impl Consumer for Replay {
    fn selection(&self) -> Selection<'static> {
        steps::SELECTION
    }

    fn row(&mut self, row: DumpRow<'_>) {
        self.timeline.apply(&row, &mut self.collect);
    }

    fn restart(&mut self) {
        self.timeline = Timeline::new(None);
        self.collect.restart();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::steps::testrows::step;
    use crate::analysis::testdb::{dir, TestDb};
    use crate::store::insight::GC;
    use crate::store::Attr;

    const MIB: u64 = 1 << 20;

    fn gc_free(db: &mut TestDb, ts: i64, ptr: u64) {
        let attr = Attr::new().addr("addr", ptr).with("size", 1u64).with("freed_by", GC);
        db.row("FREE", "PTA", ts, 1, Some(ptr), attr);
    }

    /// A weight, then per step two 8 MiB activations dropped at its end. In `cycles`, the
    /// collector frees step k's activations early in step k+2, so at the peak the previous
    /// step's garbage is live.
    fn training(name: &str, cycles: bool, steps: i64) -> GcHeld {
        let d = dir(name);
        let mut db = TestDb::create(&d.join("memscope_dump_1.db"));
        db.malloc("PTA", 1, 0x1000_0000, 16 * MIB, None);
        let mut pending: Vec<(i64, u64)> = Vec::new(); // (free at, ptr)
        for s in 0..steps {
            let t = s * 100;
            for (at, ptr) in pending.iter().filter(|(at, _)| *at > t && *at < t + 100) {
                gc_free(&mut db, *at, *ptr);
            }
            pending.retain(|(at, _)| *at >= t + 100);
            let ptrs = [0x2000_0000 + s as u64 * 0x100_0000, 0x2080_0000 + s as u64 * 0x100_0000];
            for (i, ptr) in ptrs.iter().enumerate() {
                db.malloc("PTA", t + 10 + i as i64, *ptr, 8 * MIB, None);
            }
            for (i, ptr) in ptrs.iter().enumerate() {
                if cycles {
                    pending.push((t + 205 + i as i64, *ptr));
                } else {
                    db.free("PTA", t + 90 + i as i64, *ptr);
                }
            }
            step(&mut db, t + 99, s as u64 + 1);
        }
        for (at, ptr) in pending {
            gc_free(&mut db, at, ptr);
        }
        analyse(&DumpDb::open_read(&db.path).unwrap()).unwrap()
    }

    #[test]
    fn garbage_from_earlier_steps_at_the_peak_is_measured() {
        let r = training("gc-cycles", true, 6);
        // Frees at 205+100k for steps 0..=5; the last boundary is at 599, so the frees of steps
        // 4 and 5 (at 605.. and 705..) come after it and are not counted as late.
        assert_eq!(r.freed_blocks, 12);
        assert_eq!((r.late_blocks, r.late_bytes), (8, 8 * 8 * MIB));
        assert_eq!(r.mean_steps_late, 2.0);
        // Peak: the weight, step s's two and step s-1's two (step s-2's go just before step s
        // allocates); first reached in step 1, at 111, with step 0's two as garbage.
        assert_eq!(r.peak_bytes, 16 * MIB + 4 * 8 * MIB);
        assert_eq!(r.peak_ts, Some(111));
        assert_eq!((r.held_at_peak, r.held_blocks_at_peak), (2 * 8 * MIB, 2));
        assert!(r.significant());
    }

    #[test]
    fn blocks_freed_when_dropped_are_not_garbage() {
        let r = training("gc-clean", false, 6);
        assert_eq!((r.freed_blocks, r.late_blocks, r.held_at_peak), (0, 0, 0));
        assert_eq!(r.peak_bytes, 16 * MIB + 2 * 8 * MIB);
        assert!(!r.significant());
    }

    #[test]
    fn collecting_at_each_step_start_leaves_nothing_at_the_peak() {
        let d = dir("gc-each-step");
        let mut db = TestDb::create(&d.join("memscope_dump_1.db"));
        for s in 0..4i64 {
            let t = s * 100;
            if s > 0 {
                // The previous step's activation, collected right after the boundary.
                gc_free(&mut db, t + 1, 0x100 * s as u64);
            }
            db.malloc("PTA", t + 10, 0x100 * (s as u64 + 1), 8 * MIB, None);
            step(&mut db, t + 99, s as u64 + 1);
        }
        let r = analyse(&DumpDb::open_read(&db.path).unwrap()).unwrap();
        assert_eq!(r.late_blocks, 3, "born in one step, freed by the collector in the next");
        assert_eq!(r.held_at_peak, 0);
        assert!(!r.significant());
    }

    #[test]
    fn without_steps_nothing_is_late() {
        let d = dir("gc-nosteps");
        let mut db = TestDb::create(&d.join("memscope_dump_1.db"));
        db.malloc("PTA", 10, 0x100, 8 * MIB, None);
        gc_free(&mut db, 20, 0x100);
        let r = analyse(&DumpDb::open_read(&db.path).unwrap()).unwrap();
        assert_eq!((r.freed_blocks, r.late_blocks, r.held_at_peak, r.boundaries), (1, 0, 0, 0));
    }
}
