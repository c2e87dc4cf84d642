//! Owner paths of new blocks: the allocator's label (msMemScope's FRAMEWORK level) and the
//! allocating thread's open tag spans, joined with `@` (`tags::owner_path`).
//!
//! Every MALLOC row carries one, so a path is made once per (allocator label, set of open spans)
//! and shared ([`Owner`]) by the rows of every block born under them: the spans change rarely
//! next to the allocations made under them, and most blocks are born under none.

use std::sync::Arc;

use super::event::Pool;
use super::output::Owner;
use super::tags::{self, BlockLabels, Labels};
use crate::apis::hal;

/// The allocator part of a block's owner (msMemScope's FRAMEWORK level).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OwnerBase {
    /// Device memory: `CANN@<module>` when the driver's module is known.
    Hal(Option<u16>),
    /// Device memory from the CUDA runtime (`false`) or straight from the driver (`true`: NCCL's
    /// cuMem buffers, mapped pages).
    Cuda {
        driver: bool,
    },
    Host,
    Pool(Pool),
}

impl OwnerBase {
    /// msMemScope's label: `CANN@<module>`, `CANN@UNKNOWN` for device memory whose module was not
    /// seen (a mapping, a runtime call whose driver call was not traced), `HOST`, or the pool's;
    /// on NVIDIA `CUDA@RUNTIME` or `CUDA@DRIVER`, which Insight hangs under its HAL root alike.
    pub fn label(self) -> Owner {
        match self {
            Self::Hal(Some(m)) => hal::owner(m).into(),
            Self::Hal(None) => "CANN@UNKNOWN".into(),
            Self::Cuda { driver: false } => "CUDA@RUNTIME".into(),
            Self::Cuda { driver: true } => "CUDA@DRIVER".into(),
            Self::Host => "HOST".into(),
            Self::Pool(pool) => pool.owner().into(),
        }
    }

    /// The owner path with these labels. Every block has one: Insight leaves a block without an
    /// owner out of its decomposition tree, so the tree would not add up to the curve.
    pub fn owner(self, labels: &Labels) -> String {
        tags::owner_path(&self.label(), labels)
    }
}

/// How many (label, spans) pairs are kept: a few allocators times a few threads' spans.
const RECENT: usize = 16;

/// The owner paths made last, by allocator label and the labels' identity (the thread's shared
/// [`BlockLabels`], kept alive here so that identity cannot be reused by other labels).
#[derive(Debug, Default)]
pub(super) struct Owners {
    recent: Vec<(OwnerBase, BlockLabels, Owner)>,
    /// The entry to replace next once `recent` is full.
    next: usize,
}

impl Owners {
    /// The owner path of a block born with these labels.
    pub(super) fn get(&mut self, base: OwnerBase, labels: &BlockLabels) -> Owner {
        let same = |l: &BlockLabels| match (l, labels) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        if let Some((_, _, owner)) = self.recent.iter().find(|(b, l, _)| *b == base && same(l)) {
            return owner.clone();
        }
        let owner: Owner = match labels {
            None => base.label(),
            Some(labels) => base.owner(labels).into(),
        };
        let entry = (base, labels.clone(), owner.clone());
        if self.recent.len() < RECENT {
            self.recent.push(entry);
        } else {
            self.recent[self.next] = entry;
            self.next = (self.next + 1) % RECENT;
        }
        owner
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_is_shared_while_the_spans_stay_and_remade_when_they_change() {
        let mut owners = Owners::default();
        let mut labels = Labels::default();
        labels[1] = Some("vllm".into());
        let spans: BlockLabels = Some(Arc::new(labels.clone()));
        let a = owners.get(OwnerBase::Pool(Pool::Caching), &spans);
        assert_eq!(&*a, "PTA@vllm");
        assert!(Arc::ptr_eq(&a, &owners.get(OwnerBase::Pool(Pool::Caching), &spans)), "made once");
        assert_eq!(&*owners.get(OwnerBase::Host, &spans), "HOST@vllm", "another allocator, another path");
        assert_eq!(&*owners.get(OwnerBase::Hal(None), &None), "CANN@UNKNOWN");
        // New spans with the same text are other labels: their path is made again, and right.
        labels[2] = Some("decode".into());
        let changed: BlockLabels = Some(Arc::new(labels));
        assert_eq!(&*owners.get(OwnerBase::Pool(Pool::Caching), &changed), "PTA@vllm@decode");
        // More pairs than are kept: the oldest are made again, still right.
        for m in 0..(RECENT as u16 * 2) {
            assert_eq!(&*owners.get(OwnerBase::Hal(Some(m)), &None), hal::owner(m));
        }
        assert_eq!(&*owners.get(OwnerBase::Pool(Pool::Caching), &spans), "PTA@vllm");
    }
}
