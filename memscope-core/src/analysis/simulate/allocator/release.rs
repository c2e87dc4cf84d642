//! Giving cached memory back: the garbage collector's age rule, the oversize blocks freed for
//! a request that found no segment, and `empty_cache` (every segment not split, every free
//! page of an expandable segment).

use super::{Allocator, Id, SegmentStep, LARGE, SMALL};

impl Allocator {
    /// Past `garbage_collection_threshold` of the allowed memory, frees the large pool's unsplit
    /// cached segments that waited longest (at least the average age), until the excess is
    /// reclaimed or none is left (C:2629-2686, N:2633-2700).
    pub(super) fn garbage_collect(&mut self) {
        let Some(allowed) = self.cfg.allowed() else { return };
        let threshold = (self.cfg.gc_threshold * allowed as f64) as u64;
        if self.held.reserved <= threshold {
            return;
        }
        let target = self.held.reserved - threshold;
        let searches = self.pools[LARGE].searches;
        let age = |s: &Self, id: Id| searches - s.blocks[id].gc_base;
        let freeable: Vec<Id> = self.whole_free(LARGE);
        let mut total_age: u64 = freeable.iter().map(|&id| age(self, id)).sum();
        let mut count = freeable.len() as u64;
        let mut reclaimed = 0;
        let mut freed_one = true;
        while reclaimed < target && freed_one && count > 0 {
            let threshold_age = total_age as f64 / count as f64;
            freed_one = false;
            for id in self.whole_free(LARGE) {
                if self.blocks[id].expandable.is_none() && age(self, id) as f64 >= threshold_age {
                    freed_one = true;
                    reclaimed += self.blocks[id].size;
                    total_age -= age(self, id);
                    count -= 1;
                    self.release_block(LARGE, id);
                }
            }
        }
    }

    /// The free blocks of a pool that are whole segments, in the free set's order.
    fn whole_free(&self, p: usize) -> Vec<Id> {
        self.pools[p].free.iter().map(|k| k.3).filter(|&id| !self.is_split(id)).collect()
    }

    /// With `max_split_size_mb` set, frees one cached oversize segment big enough for the
    /// request, or else the largest ones of the stream until their bytes cover it (C:2811-2857,
    /// N:2781-2829).
    pub(super) fn release_available_cached(&mut self, p: usize, size: u64, stream: u64) -> bool {
        let max_split = self.cfg.max_split;
        if max_split == u64::MAX {
            return false;
        }
        let want = size.max(max_split);
        let first = self.pools[p].free.range((stream, want, 0, 0)..).next().copied();
        if let Some(k) = first.filter(|k| k.0 == stream && self.blocks[k.3].expandable.is_none()) {
            self.release_block(p, k.3);
            return true;
        }
        // From the largest of the stream down, while they are oversize.
        let below: Vec<_> = self.pools[p].free.range(..(stream, want, 0, 0)).rev().copied().collect();
        let mut released = 0;
        for k in below {
            if released >= want || k.1 < max_split || k.0 != stream {
                break;
            }
            if self.blocks[k.3].expandable.is_none() {
                released += k.1;
                self.release_block(p, k.3);
            }
        }
        released >= want
    }

    /// Every cached segment not split, large pool first; the free pages of expandable ones
    /// (C:2859-2905, 3045-3069; N:2832-2857, 2969-3000).
    pub(super) fn release_cached(&mut self) {
        for p in [LARGE, SMALL] {
            let mut unmap = Vec::new();
            for id in self.pools[p].free.iter().map(|k| k.3).collect::<Vec<_>>() {
                if self.blocks[id].expandable.is_some() {
                    unmap.push(id);
                } else if !self.is_split(id) {
                    self.release_block(p, id);
                }
            }
            for id in unmap {
                self.unmap_block(p, id);
            }
        }
    }

    /// Frees a whole cached segment.
    fn release_block(&mut self, p: usize, id: Id) {
        self.remove_free(p, id);
        let size = self.blocks[id].size;
        self.held.reserved -= size;
        self.steps.push(SegmentStep::Free(size));
        self.spare.push(id);
    }
}
