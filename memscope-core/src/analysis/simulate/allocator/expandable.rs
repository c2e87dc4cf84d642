//! Expandable segments: one reserved address range per stream and pool, mapped page by page
//! (2 MiB pages in the small pool, 20 MiB in the large), grown where free or unmapped room
//! follows a block, and unmapped by whole pages when the cache is emptied.

use super::{Allocator, Block, Expandable, Id, SegmentStep, LARGE_BUFFER, SMALL, SMALL_BUFFER};

/// Address space reserved per expandable segment when the device's size is unknown (the
/// allocator reserves 1 1/8 of the device's memory).
const UNKNOWN_RANGE: u64 = 1 << 44;

impl Allocator {
    /// A block of at least `size` bytes made of free and unmapped room, its unmapped part mapped
    /// (C:2363-2394, N:2373-2404).
    pub(super) fn alloc_expandable(&mut self, p: usize, size: u64, stream: u64, others: u64) -> Option<Id> {
        let mut candidate = self.find_expandable(p, size, stream);
        if !self.blocks[candidate].mapped {
            let want = self.blocks[candidate].size.min(size);
            candidate = self.map_block(p, candidate, want, others)?;
        }
        while self.blocks[candidate].size < size {
            let next = self.blocks[candidate].next?;
            let want = (size - self.blocks[candidate].size).min(self.blocks[next].size);
            candidate = self.map_block(p, next, want, others)?;
        }
        self.remove_free(p, candidate);
        Some(candidate)
    }

    /// The lowest unmapped range of the stream (with the free block before it) that holds the
    /// request, or a new segment's whole range (C:2239-2293, N:2271-2323).
    fn find_expandable(&mut self, p: usize, size: u64, stream: u64) -> Id {
        let allocatable = |s: &Self, b: Option<Id>| b.filter(|&b| !s.blocks[b].allocated);
        let unmapped: Vec<Id> =
            self.pools[p].unmapped.range((stream, 0, 0)..).take_while(|k| k.0 == stream).map(|k| k.2).collect();
        for id in unmapped {
            let start = allocatable(self, self.blocks[id].prev).unwrap_or(id);
            let (mut bytes, mut at) = (0, Some(start));
            while bytes < size {
                let Some(b) = allocatable(self, at) else { break };
                bytes += self.blocks[b].size;
                at = self.blocks[b].next;
            }
            if bytes >= size {
                return start;
            }
        }
        let page = if p == SMALL { SMALL_BUFFER } else { LARGE_BUFFER };
        let range = self.cfg.capacity.map_or(UNKNOWN_RANGE, |c| c + c / 8);
        let base = self.next_addr;
        self.next_addr += range.next_multiple_of(LARGE_BUFFER);
        self.expandables.push(Expandable { base, page, pages: range / page });
        let b = Block {
            ptr: base,
            size: (range / page) * page,
            stream,
            small: p == SMALL,
            allocated: false,
            mapped: false,
            prev: None,
            next: None,
            expandable: Some(self.expandables.len() - 1),
            gc_base: 0,
        };
        let id = self.new_block(b);
        self.pools[p].unmapped.insert((stream, base, id));
        id
    }

    /// Maps the pages under the first `size` bytes of an unmapped block; the mapped part joins
    /// its free neighbours. `None` when the device (or its share) has no room for the pages
    /// (C:2295-2361, 389-426; N:2325-2371).
    fn map_block(&mut self, p: usize, id: Id, size: u64, others: u64) -> Option<Id> {
        let seg = &self.expandables[self.blocks[id].expandable?];
        let (page, base) = (seg.page, seg.base);
        let start = self.blocks[id].ptr;
        let end = (start + size).next_multiple_of(page).min(base + seg.pages * page);
        let bytes = end - start;
        if bytes == 0 || self.cfg.capacity.is_some_and(|cap| others + self.held.reserved + bytes > cap) {
            return None;
        }
        let key = (self.blocks[id].stream, start, id);
        self.pools[p].unmapped.remove(&key);
        if self.blocks[id].size > bytes {
            let rest = Block {
                ptr: start + bytes,
                size: self.blocks[id].size - bytes,
                prev: Some(id),
                ..self.blocks[id].clone()
            };
            let rest = self.new_block(rest);
            if let Some(n) = self.blocks[id].next {
                self.blocks[n].prev = Some(rest);
            }
            self.blocks[id].next = Some(rest);
            self.pools[p].unmapped.insert((self.blocks[rest].stream, self.blocks[rest].ptr, rest));
        }
        self.blocks[id].mapped = true;
        self.blocks[id].size = bytes;
        let (prev, next) = (self.blocks[id].prev, self.blocks[id].next);
        self.try_merge(id, prev, p);
        self.try_merge(id, next, p);
        self.insert_free(p, id);
        self.held.reserved += bytes;
        self.steps.extend((0..bytes / page).map(|_| SegmentStep::Map(page)));
        Some(id)
    }

    /// Unmaps the whole pages inside a free expandable block; the bytes before and after them
    /// stay mapped and free (C:2974-3044, 431-439; N:2916-2967).
    pub(super) fn unmap_block(&mut self, p: usize, id: Id) {
        let Some(seg) = self.blocks[id].expandable.map(|e| &self.expandables[e]) else { return };
        let page = seg.page;
        let (ptr, size) = (self.blocks[id].ptr, self.blocks[id].size);
        let begin = ptr.next_multiple_of(page);
        let end = (ptr + size) / page * page;
        if begin >= end {
            return;
        }
        self.remove_free(p, id);
        if begin > ptr {
            let before = Block { size: begin - ptr, next: Some(id), ..self.blocks[id].clone() };
            let before = self.new_block(before);
            if let Some(pp) = self.blocks[id].prev {
                self.blocks[pp].next = Some(before);
            }
            self.blocks[id].prev = Some(before);
            self.insert_free(p, before);
        }
        if ptr + size > end {
            let after = Block { ptr: end, size: ptr + size - end, prev: Some(id), ..self.blocks[id].clone() };
            let after = self.new_block(after);
            if let Some(n) = self.blocks[id].next {
                self.blocks[n].prev = Some(after);
            }
            self.blocks[id].next = Some(after);
            self.insert_free(p, after);
        }
        self.blocks[id].ptr = begin;
        self.blocks[id].size = end - begin;
        self.blocks[id].mapped = false;
        let (prev, next) = (self.blocks[id].prev, self.blocks[id].next);
        self.try_merge(id, prev, p);
        self.try_merge(id, next, p);
        let key = (self.blocks[id].stream, self.blocks[id].ptr, id);
        self.pools[p].unmapped.insert(key);
        self.held.reserved -= end - begin;
        self.steps.extend((0..(end - begin) / page).map(|_| SegmentStep::Unmap(page)));
    }
}
