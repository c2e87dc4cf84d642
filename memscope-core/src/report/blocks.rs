//! The report's blocks table: the `top` largest blocks of the trace (ties: the earliest), with
//! their owner, lifetime, step of birth, msMemScope's inefficiency flags (`analyze --analysis
//! inefficient` writes them into the MALLOC rows) and call stacks when recorded; every other
//! block is only counted, in a line the page shows. A heap keeps the top while the replay hands
//! each block over as it ends, so memory stays O(top) however many blocks the trace has.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use serde::Serialize;

use crate::analysis::steps::{BlockEnd, BlockKind, BlockSink, StepDb, Timeline};
use crate::analysis::AnalysisError;

/// The largest blocks, as the replay ended them.
pub struct TopBlocks {
    top: usize,
    heap: BinaryHeap<Reverse<(i64, Reverse<i64>, Held)>>,
    pub blocks: u64,
    pub bytes: i128,
}

/// A block's facts kept in the heap (ordered only by size and rowid, outside it).
#[derive(Clone, Copy, Debug)]
struct Held(BlockEnd);

impl PartialEq for Held {
    fn eq(&self, other: &Self) -> bool {
        self.0.rowid == other.0.rowid
    }
}
impl Eq for Held {}
impl PartialOrd for Held {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Held {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.rowid.cmp(&other.0.rowid)
    }
}

impl TopBlocks {
    pub fn new(top: usize) -> Self {
        Self { top, heap: BinaryHeap::with_capacity(top + 1), blocks: 0, bytes: 0 }
    }
}

impl BlockSink for TopBlocks {
    fn block_end(&mut self, end: &BlockEnd) {
        self.blocks += 1;
        self.bytes += end.size as i128;
        if self.top == 0 {
            return;
        }
        // Smallest first in the heap: a bigger (or as big and earlier) block evicts it.
        self.heap.push(Reverse((end.size, Reverse(end.rowid), Held(*end))));
        if self.heap.len() > self.top {
            self.heap.pop();
        }
    }
    fn restart(&mut self) {
        *self = Self::new(self.top);
    }
}

/// One row of the table.
#[derive(Clone, Debug, Serialize)]
pub struct Block {
    pub family: &'static str,
    pub kind: &'static str,
    pub pid: i64,
    pub ptr: String,
    pub size: i64,
    pub owner: String,
    /// ns after the report's origin.
    pub alloc: i64,
    /// ns after the report's origin; `None`: live when the trace stopped.
    pub free: Option<i64>,
    pub birth_step: Option<u64>,
    /// msMemScope's inefficiency types, comma-joined; empty when not flagged (or not analysed).
    pub flags: String,
    /// The job's own line that made it (Attr `site`); empty when the trace read no Python stack.
    pub site: String,
    pub python_stack: String,
    pub c_stack: String,
}

/// The table: the largest blocks, largest first, and what the rest add up to.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Table {
    pub rows: Vec<Block>,
    /// Every block of the trace (freed or live at the end), and their bytes.
    pub blocks: u64,
    pub bytes: i64,
}

fn kind(kind: BlockKind) -> &'static str {
    match kind {
        BlockKind::Block => "block",
        BlockKind::Segment => "segment",
        BlockKind::Workspace => "workspace",
    }
}

impl TopBlocks {
    /// The table, each row's stacks and flags read back from its MALLOC row.
    pub fn table(self, db: &StepDb<'_>, timeline: &Timeline, origin: i64) -> Result<Table, AnalysisError> {
        let mut held: Vec<BlockEnd> = self.heap.into_iter().map(|Reverse((_, _, Held(b)))| b).collect();
        held.sort_by_key(|b| (Reverse(b.size), b.rowid));
        let mut rows = Vec::with_capacity(held.len());
        for b in held {
            let details = db.details(b.rowid)?;
            rows.push(Block {
                family: b.family.as_str(),
                kind: kind(b.kind),
                pid: b.pid,
                ptr: format!("0x{:x}", b.ptr),
                size: b.size,
                owner: timeline.owner(b.slot).1.to_owned(),
                alloc: b.alloc_ts - origin,
                free: b.free_ts.map(|t| t - origin),
                birth_step: b.steps.map(|s| s.0),
                flags: details.inefficient.unwrap_or_default(),
                site: details.site.unwrap_or_default(),
                python_stack: details.python_stack,
                c_stack: details.c_stack,
            });
        }
        Ok(Table { rows, blocks: self.blocks, bytes: self.bytes.clamp(0, i64::MAX as i128) as i64 })
    }
}
