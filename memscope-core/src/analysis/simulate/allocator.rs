//! The caching allocator's decisions, as a model that takes the requests and frees a job made
//! and says which segments the allocator would take, map, unmap and free under a configuration.
//!
//! It follows PyTorch's `c10/cuda/CUDACachingAllocator.cpp` (C: v2.6.0's lines, whose rules
//! v2.7.1 keeps), which torch_npu's `NPUCachingAllocator.cpp` ports (N: branch v2.7.1 @ adc41e69);
//! each function cites the lines it follows, and docs/simulate.md lists every rule. Where
//! torch_npu differs, the model takes torch_npu's rule under [`Flavour::Npu`]. Only what
//! decides memory is modelled: no events, graphs, IPC or private pools. Blocks live in a slab
//! indexed by id; the free sets are ordered as the allocator's `BlockComparator` orders them
//! (stream, size, address), so "best fit" is the same `lower_bound`.
//!
//! Why by hand: no library models a caching allocator; the model is the product.

use std::collections::BTreeSet;

use super::config::{Config, Flavour};

pub(super) const MIN_BLOCK: u64 = 512;
pub(super) const SMALL_SIZE: u64 = 1 << 20;
pub(super) const SMALL_BUFFER: u64 = 2 << 20;
pub(super) const LARGE_BUFFER: u64 = 20 << 20;
pub(super) const MIN_LARGE_ALLOC: u64 = 10 << 20;
pub(super) const ROUND_LARGE: u64 = 2 << 20;

/// A change of the memory the allocator holds, as the trace records it: a whole segment taken
/// or given back, or one page of an expandable segment mapped or unmapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SegmentStep {
    Alloc(u64),
    Free(u64),
    Map(u64),
    Unmap(u64),
}

impl SegmentStep {
    pub(crate) fn takes(self) -> bool {
        matches!(self, Self::Alloc(_) | Self::Map(_))
    }

    pub(crate) fn size(self) -> u64 {
        match self {
            Self::Alloc(s) | Self::Free(s) | Self::Map(s) | Self::Unmap(s) => s,
        }
    }
}

type Id = usize;

#[derive(Clone, Debug)]
struct Block {
    ptr: u64,
    size: u64,
    stream: u64,
    small: bool,
    allocated: bool,
    mapped: bool,
    prev: Option<Id>,
    next: Option<Id>,
    /// The expandable segment it lies in.
    expandable: Option<usize>,
    /// The pool's count of free-block searches when it entered the free set (its age for the
    /// garbage collector is the count now minus this).
    gc_base: u64,
}

#[derive(Default)]
struct Pool {
    /// Free mapped blocks: (stream, size, ptr, id).
    free: BTreeSet<(u64, u64, u64, Id)>,
    /// Unmapped ranges of expandable segments: (stream, ptr, id).
    unmapped: BTreeSet<(u64, u64, Id)>,
    searches: u64,
}

struct Expandable {
    base: u64,
    page: u64,
    pages: u64,
}

/// What the pool holds right now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Held {
    pub reserved: u64,
    pub allocated: u64,
}

/// One process's caching allocator on one device.
pub(crate) struct Allocator {
    cfg: Config,
    blocks: Vec<Block>,
    spare: Vec<Id>,
    pools: [Pool; 2],
    expandables: Vec<Expandable>,
    held: Held,
    /// Allocated blocks by address (an allocated block is never split or merged).
    live: foldhash::HashMap<u64, Id>,
    next_addr: u64,
    /// The segment steps since the caller last took them.
    pub(crate) steps: Vec<SegmentStep>,
    /// Addresses the recorded run's segments had, used in order while the sizes agree, so a
    /// replay under the recorded settings breaks best-fit ties as the allocator did.
    hints: std::collections::VecDeque<(u64, u64)>,
}

const SMALL: usize = 0;
const LARGE: usize = 1;

impl Allocator {
    pub(crate) fn new(cfg: Config, hints: Vec<(u64, u64)>) -> Self {
        let top = hints.iter().map(|&(size, ptr)| ptr + size).max().unwrap_or(0);
        Self {
            cfg,
            blocks: Vec::new(),
            spare: Vec::new(),
            pools: [Pool::default(), Pool::default()],
            expandables: Vec::new(),
            held: Held::default(),
            live: foldhash::HashMap::default(),
            next_addr: (top.max(1 << 40)).next_multiple_of(LARGE_BUFFER),
            steps: Vec::new(),
            hints: hints.into(),
        }
    }

    pub(crate) fn held(&self) -> Held {
        self.held
    }

    /// A request of `req` bytes on `stream`; `others` is the device memory held outside this
    /// allocator (other processes, direct runtime calls). Returns the block's address and size,
    /// or `None`: out of memory. The order of the attempts: C:1215-1242, N:1252-1294.
    pub(crate) fn malloc(&mut self, req: u64, stream: u64, others: u64) -> Option<(u64, u64)> {
        let size = self.cfg.round_size(req);
        let p = if size <= SMALL_SIZE { SMALL } else { LARGE };
        let alloc_size = allocation_size(size);
        let found = self.get_free_block(p, size, stream).or_else(|| {
            if self.cfg.gc_enabled() {
                self.garbage_collect();
            }
            self.alloc_block(p, size, alloc_size, stream, others)
                .or_else(|| {
                    self.release_available_cached(p, size, stream)
                        .then(|| self.alloc_block(p, size, alloc_size, stream, others))
                        .flatten()
                })
                .or_else(|| {
                    self.release_cached();
                    self.alloc_block(p, size, alloc_size, stream, others)
                })
        })?;
        let found = self.align_base(found, p, size);
        let block = self.split(found, p, size);
        let b = &mut self.blocks[block];
        b.allocated = true;
        let (ptr, size) = (b.ptr, b.size);
        self.held.allocated += size;
        self.live.insert(ptr, block);
        Some((ptr, size))
    }

    /// Gives back the block at `ptr`, merged with its free neighbours (C:2397-2505,
    /// N:2406-2498); false when the allocator holds no such block.
    pub(crate) fn free(&mut self, ptr: u64) -> bool {
        let Some(id) = self.live.remove(&ptr) else { return false };
        let p = self.pool_of(id);
        self.blocks[id].allocated = false;
        self.held.allocated -= self.blocks[id].size;
        for other in [self.blocks[id].prev, self.blocks[id].next] {
            self.try_merge(id, other, p);
        }
        self.insert_free(p, id);
        true
    }

    /// `empty_cache()`: every cached segment not split (and the free pages of expandable ones).
    pub(crate) fn empty_cache(&mut self) {
        self.release_cached();
    }

    /// The largest free mapped block.
    pub(crate) fn largest_free(&self) -> u64 {
        self.pools.iter().flat_map(|p| p.free.iter().map(|&(_, size, _, _)| size)).max().unwrap_or(0)
    }

    fn pool_of(&self, id: Id) -> usize {
        if self.blocks[id].small {
            SMALL
        } else {
            LARGE
        }
    }

    fn new_block(&mut self, b: Block) -> Id {
        match self.spare.pop() {
            Some(id) => {
                self.blocks[id] = b;
                id
            }
            None => {
                self.blocks.push(b);
                self.blocks.len() - 1
            }
        }
    }

    fn key(&self, id: Id) -> (u64, u64, u64, Id) {
        let b = &self.blocks[id];
        (b.stream, b.size, b.ptr, id)
    }

    fn insert_free(&mut self, p: usize, id: Id) {
        self.blocks[id].gc_base = self.pools[p].searches;
        let key = self.key(id);
        self.pools[p].free.insert(key);
    }

    fn remove_free(&mut self, p: usize, id: Id) {
        let key = self.key(id);
        self.pools[p].free.remove(&key);
    }

    fn is_split(&self, id: Id) -> bool {
        self.blocks[id].prev.is_some() || self.blocks[id].next.is_some()
    }

    /// The best fit: the smallest free block of the stream at least `size`, under the
    /// oversize rules of `max_split_size_mb` (C:2560-2618, N:2555-2617).
    fn get_free_block(&mut self, p: usize, size: u64, stream: u64) -> Option<Id> {
        if self.cfg.gc_enabled() {
            self.pools[p].searches += 1;
        }
        let mut candidates = self.pools[p].free.range((stream, size, 0, 0)..).take_while(|k| k.0 == stream);
        let mut pick = *candidates.next()?;
        if self.blocks[pick.3].expandable.is_some() {
            // A block that an unmapped range follows can grow: it counts at the size it can reach.
            let reach = |s: &Self, id: Id| {
                let b = &s.blocks[id];
                b.size + b.next.filter(|&n| !s.blocks[n].mapped).map_or(0, |n| s.blocks[n].size)
            };
            for next in candidates {
                if self.blocks[pick.3].expandable.is_none() || reach(self, next.3) >= reach(self, pick.3) {
                    break;
                }
                pick = *next;
            }
        }
        let found = self.blocks[pick.3].size;
        let max_split = self.cfg.max_split;
        if (size < max_split && found >= max_split) || (size >= max_split && found >= size + LARGE_BUFFER) {
            return None;
        }
        self.pools[p].free.remove(&pick);
        Some(pick.3)
    }

    /// A new segment (or, with expandable segments, newly mapped pages) for the request; the
    /// fraction's ceiling first (C:2701-2805, N:2701-2777).
    fn alloc_block(&mut self, p: usize, size: u64, alloc_size: u64, stream: u64, others: u64) -> Option<Id> {
        if let Some(allowed) = self.cfg.allowed() {
            if self.held.reserved + alloc_size > allowed {
                return None;
            }
        }
        if self.cfg.expandable {
            return self.alloc_expandable(p, size, stream, others);
        }
        if self.cfg.capacity.is_some_and(|cap| others + self.held.reserved + alloc_size > cap) {
            return None;
        }
        let ptr = self.segment_address(alloc_size);
        self.held.reserved += alloc_size;
        self.steps.push(SegmentStep::Alloc(alloc_size));
        let small = p == SMALL;
        let b = Block {
            ptr,
            size: alloc_size,
            stream,
            small,
            allocated: false,
            mapped: true,
            prev: None,
            next: None,
            expandable: None,
            gc_base: 0,
        };
        Some(self.new_block(b))
    }

    fn segment_address(&mut self, size: u64) -> u64 {
        if let Some(&(hint_size, ptr)) = self.hints.front() {
            if hint_size == size {
                self.hints.pop_front();
                return ptr;
            }
            // The replay left the recorded run's path: its addresses mean nothing from here.
            self.hints.clear();
        }
        let ptr = self.next_addr;
        self.next_addr += size.next_multiple_of(ROUND_LARGE);
        ptr
    }

    /// torch_npu's base-address alignment: with expandable segments, a block of 2 MiB or more
    /// that does not start on a 16 KiB boundary leaves its first bytes free and starts at the
    /// boundary, when the rest still holds it (NPUCachingAllocator.cpp:1359-1384).
    fn align_base(&mut self, id: Id, p: usize, size: u64) -> Id {
        const ALIGN: u64 = 16 << 10;
        let b = &self.blocks[id];
        if self.cfg.flavour != Flavour::Npu || !self.cfg.expandable || size < ROUND_LARGE || b.ptr.is_multiple_of(ALIGN)
        {
            return id;
        }
        let offset = ALIGN - b.ptr % ALIGN;
        if offset + size > b.size {
            return id;
        }
        let rest = Block { ptr: b.ptr + offset, size: b.size - offset, prev: Some(id), ..b.clone() };
        let rest = self.new_block(rest);
        if let Some(n) = self.blocks[id].next {
            self.blocks[n].prev = Some(rest);
        }
        self.blocks[id].next = Some(rest);
        self.blocks[id].size = offset;
        self.insert_free(p, id);
        rest
    }

    /// Cuts the request's bytes off the front of a found block when the rest is worth keeping
    /// (`should_split`, C:2540-2548, N:2534-2542; `alloc_found_block`, C:1388-1404).
    fn split(&mut self, id: Id, p: usize, size: u64) -> Id {
        let remaining = self.blocks[id].size - size;
        let worth = if p == SMALL || self.cfg.expandable {
            remaining >= MIN_BLOCK
        } else {
            size < self.cfg.max_split && remaining > SMALL_SIZE
        };
        if !worth {
            return id;
        }
        let rest = id;
        let r = self.blocks[rest].clone();
        let front = self.new_block(Block { size, next: Some(rest), ..r });
        if let Some(prev) = r.prev {
            self.blocks[prev].next = Some(front);
        }
        let b = &mut self.blocks[rest];
        b.prev = Some(front);
        b.ptr += size;
        b.size -= size;
        self.insert_free(p, rest);
        front
    }

    /// Merges the free neighbour `other` into `id` (both mapped or both unmapped).
    fn try_merge(&mut self, id: Id, other: Option<Id>, p: usize) {
        let Some(o) = other else { return };
        if self.blocks[o].allocated || self.blocks[o].mapped != self.blocks[id].mapped {
            return;
        }
        if self.blocks[o].mapped {
            self.remove_free(p, o);
        } else {
            let key = (self.blocks[o].stream, self.blocks[o].ptr, o);
            self.pools[p].unmapped.remove(&key);
        }
        let src = self.blocks[o].clone();
        if self.blocks[id].prev == Some(o) {
            self.blocks[id].ptr = src.ptr;
            self.blocks[id].prev = src.prev;
            if let Some(pp) = src.prev {
                self.blocks[pp].next = Some(id);
            }
        } else {
            self.blocks[id].next = src.next;
            if let Some(nn) = src.next {
                self.blocks[nn].prev = Some(id);
            }
        }
        self.blocks[id].size += src.size;
        self.spare.push(o);
    }
}

/// The segment size for a rounded request: small requests share 2 MiB segments, those under
/// 10 MiB share 20 MiB ones, bigger ones get their own, rounded to 2 MiB (C:2550-2558,
/// N:2544-2553).
pub(super) fn allocation_size(size: u64) -> u64 {
    if size <= SMALL_SIZE {
        SMALL_BUFFER
    } else if size < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        size.next_multiple_of(ROUND_LARGE)
    }
}

mod expandable;
mod release;
