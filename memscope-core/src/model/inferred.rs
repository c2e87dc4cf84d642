//! Owners, phases and steps of a job without markers, from the Python stack of each allocation
//! (the rules are [`crate::infer`]'s).
//!
//! - **Owner.** A block born under no marker span takes the owner its stack's reading names,
//!   under the allocator's label (`HOST@weight`, `PTA@fsdp2@sharded_weight`).
//! - **Phase and lifetime.** Each process is in the phase of its latest allocation that had a
//!   Python stack; each change of phase starts a new epoch, at that allocation's time. A block
//!   born at or after its process's epoch began did not outlive its phase when it is freed: it
//!   takes its rule's `temporary=` owner (a backward temporary rather than a gradient), written
//!   over its MALLOC row's owner at the free, so the owner in the row is final when the DB is.
//!   A block freed later, or never, keeps the owner it was born with. Frees need no stack.
//! - **Nothing per block.** A block keeps only its labels, as before: an inferred block's are
//!   its stack's one shared copy, so their address names the stack (and its temporary owner),
//!   and its birth time tells its epoch. A live block stays 48 bytes.
//! - **Steps.** A step starts at the first `forward` allocation after an `optimizer` one (and at
//!   the first `forward` of all), or with `--step-frame`, at each allocation under that frame
//!   that follows one not under it. A process whose markers gave a step gets none inferred.

use std::sync::Arc;

use super::keys::Map;
use super::tags::{BlockLabels, Labels};
use crate::infer::{Reader, StepRule};
use crate::stacks::StackId;

/// A stack's reading, with its owner as the labels a block keeps (one copy shared by every
/// block born under the stack).
#[derive(Debug)]
struct StackOwner {
    labels: BlockLabels,
    temporary: BlockLabels,
    phase: Option<Arc<str>>,
    site: Option<Arc<str>>,
    in_step_frame: bool,
    main_thread: bool,
}

#[derive(Debug, Default)]
struct ProcessPhase {
    phase: Option<Arc<str>>,
    /// When the phase began (the wall time of its first allocation).
    since_ns: u64,
    after_optimizer: bool,
    stepped: bool,
    in_step_frame: bool,
    /// Its markers gave a step: steps are theirs.
    marked: bool,
}

/// The readings of the stacks seen, and each process's phase.
#[derive(Debug, Default)]
pub(super) struct Inference {
    reader: Reader,
    stacks: Map<StackId, StackOwner>,
    /// The stack whose labels these are, by the address of the one copy blocks share.
    by_labels: Map<usize, StackId>,
    processes: Map<u32, ProcessPhase>,
}

fn address(labels: &BlockLabels) -> Option<usize> {
    labels.as_ref().map(|l| Arc::as_ptr(l) as usize)
}

/// An owner path's parts as labels, one level each from COMPONENT on (the levels' names do not
/// reach the DB: the owner path is the labels joined with `@`).
fn labels_of(parts: Option<&Arc<[Arc<str>]>>) -> BlockLabels {
    let parts = parts?;
    let mut labels = Labels::default();
    for (slot, part) in labels.iter_mut().skip(1).zip(parts.iter()) {
        *slot = Some(part.clone());
    }
    Some(Arc::new(labels))
}

impl Inference {
    pub(super) fn set_reader(&mut self, reader: Reader) {
        self.reader = reader;
    }

    /// Reads a new Python stack.
    pub(super) fn learn(&mut self, id: StackId, text: &str) {
        let r = self.reader.read(text);
        let owner = StackOwner {
            labels: labels_of(r.owner.as_ref()),
            temporary: labels_of(r.temporary.as_ref()),
            phase: r.phase,
            site: r.site,
            in_step_frame: r.in_step_frame,
            main_thread: r.main_thread,
        };
        if let Some(at) = address(&owner.labels) {
            self.by_labels.insert(at, id);
        }
        self.stacks.insert(id, owner);
    }

    /// An allocation under `stack`: its process's phase moves on. Returns whether a step starts.
    pub(super) fn observe(&mut self, pid: u32, stack: StackId, wall_ns: u64) -> bool {
        let Some(s) = self.stacks.get(&stack) else { return false };
        let p = self.processes.entry(pid).or_default();
        if p.phase != s.phase {
            p.phase = s.phase.clone();
            p.since_ns = wall_ns;
        }
        let starts = match &self.reader.step_rule {
            StepRule::ForwardAfterOptimizer => match s.phase.as_deref() {
                Some("optimizer") => {
                    p.after_optimizer = true;
                    false
                }
                Some("forward") => std::mem::take(&mut p.after_optimizer) || !p.stepped,
                _ => false,
            },
            StepRule::Frame(_) => !std::mem::replace(&mut p.in_step_frame, s.in_step_frame) && s.in_step_frame,
        };
        p.stepped |= starts;
        starts && !p.marked
    }

    /// A process's markers gave a step: no more are inferred for it.
    pub(super) fn marked_step(&mut self, pid: u32) {
        self.processes.entry(pid).or_default().marked = true;
    }

    /// Whether a block's labels are an inferred owner (not the markers').
    pub(super) fn is_inferred(&self, labels: &BlockLabels) -> bool {
        address(labels).is_some_and(|at| self.by_labels.contains_key(&at))
    }

    /// The owner of a block of `pid` born at `born_ns` and freed now, when its owner was inferred,
    /// its rule names a temporary one, and its phase has not ended.
    #[inline]
    pub(super) fn temporary(&self, pid: u32, labels: &BlockLabels, born_ns: u64) -> Option<&BlockLabels> {
        let stack = self.by_labels.get(&address(labels)?)?;
        let temporary = &self.stacks.get(stack)?.temporary;
        let since = self.processes.get(&pid)?.since_ns;
        (born_ns >= since && temporary.is_some()).then_some(temporary)
    }

    /// What a block born under `stack` takes from it, in one lookup: the labels a rule named
    /// (used when markers gave none), the site, and whether the stack is the main thread's lent
    /// to a thread that ran no Python.
    #[inline]
    pub(super) fn born(&self, stack: StackId) -> (BlockLabels, Option<Arc<str>>, bool) {
        self.stacks.get(&stack).map_or((None, None, false), |s| (s.labels.clone(), s.site.clone(), s.main_thread))
    }
}
