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
use crate::apis::libraries::Library;

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
    /// Memory a library took itself ([`Library`]), under its root: `CANN@HCCL`, `CUDA@NCCL`,
    /// `HOST@NCCL`.
    Library {
        root: Root,
        lib: Library,
    },
}

/// The first level of a library's memory: what kind of memory it took (one byte, as live
/// blocks keep their base).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Root {
    Cann,
    Cuda,
    Host,
}

impl Root {
    fn label(self) -> &'static str {
        match self {
            Self::Cann => "CANN",
            Self::Cuda => "CUDA",
            Self::Host => "HOST",
        }
    }
}

impl OwnerBase {
    /// msMemScope's label: `CANN@<module>`, `CANN@UNKNOWN` for device memory whose module was not
    /// seen (a mapping, a runtime call whose driver call was not traced), `HOST`, or the pool's;
    /// on NVIDIA `CUDA@RUNTIME` or `CUDA@DRIVER`, which Insight hangs under its HAL root alike;
    /// or the library's that took it (`CANN@HCCL`, `CUDA@NCCL`).
    pub fn label(self) -> Owner {
        match self {
            Self::Hal(Some(m)) => hal::owner(m).into(),
            Self::Hal(None) => "CANN@UNKNOWN".into(),
            Self::Cuda { driver: false } => "CUDA@RUNTIME".into(),
            Self::Cuda { driver: true } => "CUDA@DRIVER".into(),
            Self::Host => "HOST".into(),
            Self::Pool(pool) => pool.owner().into(),
            Self::Library { root, lib } => format!("{}@{}", root.label(), lib.label()).into(),
        }
    }

    /// This base, when `lib` made the call: the library names the owner under the same root.
    /// A pool's blocks stay the pool's (the framework calls the pool, whoever asked it).
    pub fn called_by(self, lib: Option<Library>) -> Self {
        let Some(lib) = lib else { return self };
        let root = match self {
            Self::Hal(_) => Root::Cann,
            Self::Cuda { .. } => Root::Cuda,
            Self::Host => Root::Host,
            Self::Pool(_) | Self::Library { .. } => return self,
        };
        Self::Library { root, lib }
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
    use crate::model::output::Output;
    use crate::model::{Event, EventKind};

    #[test]
    fn a_pools_blocks_stay_the_pools_whoever_called() {
        assert_eq!(OwnerBase::Pool(Pool::Caching).called_by(Some(Library::Hccl)), OwnerBase::Pool(Pool::Caching));
        assert_eq!(OwnerBase::Hal(Some(3)).called_by(None), OwnerBase::Hal(Some(3)));
    }

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

    fn with_caller(mut e: Event, lib: Library) -> Event {
        if let EventKind::Call(c) = &mut e.kind {
            c.caller = Some(lib);
        }
        e
    }

    fn owner_of(out: &[Output], ptr: u64) -> &str {
        out.iter()
            .find_map(|o| match o {
                Output::Malloc { ptr: p, owner, .. } if *p == ptr => owner.as_deref(),
                _ => None,
            })
            .unwrap_or_else(|| panic!("no block at {ptr:#x}"))
    }

    /// Memory a known library took itself is that library's, under the memory's root; the
    /// same calls from anywhere else keep the allocator's label. Mapped pages are the library's that created their physical memory.
    #[test]
    fn the_library_that_called_names_the_owner_of_what_it_took() {
        use super::super::testing::*;
        use crate::apis::Api;
        use crate::model::{DriverInfo, Op, Space};
        let cu = |api, space, ptr| {
            let driver = Some(DriverInfo { api, flag: None, size: 4096, module: None, page: None });
            call(
                api,
                1,
                Some(0),
                0,
                Op::Malloc { space, size: 4096, ptr: Some(ptr), policy: None, device: None, module: None, driver },
            )
        };
        let physical =
            Op::MallocPhysical { size: 2 << 20, handle: Some(0xabc), device: Some(0), flags: 0, driver: None };
        let events = [
            with_caller(cu(Api::CuMemAlloc, Space::Device, 0x1000), Library::Nccl),
            cu(Api::CuMemAlloc, Space::Device, 0x2000),
            with_caller(cu(Api::CuMemHostAlloc, Space::Host, 0x3000), Library::Nccl),
            with_caller(cu(Api::CudaMalloc, Space::Device, 0x4000), Library::Cublas),
            with_caller(malloc(Some(0x5000), 4096, Some(0), 0), Library::Hccl),
            with_caller(
                call(Api::DeviceCachingAllocatorMalloc, 1, Some(0), 0, pool_malloc_op(0x6000, 512)),
                Library::Hccl,
            ),
            with_caller(call(Api::CuMemCreate, 1, Some(0), 0, physical), Library::Nccl),
            call(
                Api::CuMemMap,
                1,
                Some(0),
                0,
                Op::Map { va: 0x7000, size: 2 << 20, offset: 0, handle: 0xabc, flags: 0 },
            ),
        ];
        let (_, out) = run(&events);
        assert_eq!(owner_of(&out, 0x1000), "CUDA@NCCL");
        assert_eq!(owner_of(&out, 0x2000), "CUDA@DRIVER");
        assert_eq!(owner_of(&out, 0x3000), "HOST@NCCL");
        assert_eq!(owner_of(&out, 0x4000), "CUDA@CUBLAS");
        assert_eq!(owner_of(&out, 0x5000), "CANN@HCCL");
        assert_eq!(owner_of(&out, 0x7000), "CUDA@NCCL");
    }
}
