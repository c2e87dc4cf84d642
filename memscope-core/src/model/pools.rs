//! Framework pools (torch_npu's caching and workspace allocators, PTA): their blocks, their
//! segments and their totals, per device and process, with what a later call needs to place a
//! block (a handle's pending block, an mstx domain's pool, the open workspace).
//!
//! - A pool block counts in its pool's `used` from the allocator handing it out to taking it
//!   back, so a pool's `used` and `live_blocks` change only with its table of blocks here.
//! - The pool's `total` (reserved) is the device memory its allocator took: runtime allocations
//!   and mappings made inside a traced allocator call are the pool's segments, until freed or
//!   unmapped. When the pool reports its reserved bytes through mstx, that report wins. Segments
//!   taken before an attach are unknown, so `total` starts low then.
//! - Each process has its own allocator, so its counters are its own even on a shared device.
//!
//! The rules of a pool call (ids, owners, reuse, untracked frees) are the tracker's
//! (`route_pools`).

use std::collections::BTreeMap;

use super::event::{DeviceKey, Pool};
use super::keys::{Map, PoolBlock};
use super::output::{Output, Site};
use crate::apis::Api;

/// A framework pool's totals on one device.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    pub used: u64,
    pub total: u64,
    pub peak_used: u64,
    pub peak_total: u64,
    pub live_blocks: u64,
}

/// An external block known by its handle, waiting for `GetBlockPtr`.
#[derive(Clone, Copy, Debug)]
pub(super) struct PendingHandle {
    pub(super) device: DeviceKey,
    pub(super) pool: Pool,
    pub(super) req: Option<u64>,
    pub(super) size: Option<u64>,
    pub(super) api: Api,
    pub(super) stream: Option<u64>,
}

/// Device memory a pool's allocator took (a runtime block or a mapping made inside its call).
#[derive(Clone, Copy, Debug)]
struct Segment {
    device: DeviceKey,
    pool: Pool,
    size: u64,
}

/// Every pool's totals and live blocks, and the state of its calls in flight.
#[derive(Debug, Default)]
pub(super) struct Pools {
    /// Per (device, pool, process): each process has its own allocator, so its counters are its
    /// own even when processes share a device.
    stats: BTreeMap<(DeviceKey, Pool, u32), PoolStats>,
    /// Live pool blocks by (pid, start), ordered so that the block holding an address is found
    /// without a scan.
    blocks: BTreeMap<(u32, u64), PoolBlock>,
    handles: Map<(u32, u64), PendingHandle>,
    /// External block handles whose address is known.
    handle_ptrs: Map<(u32, u64), u64>,
    segments: Map<(u32, u64), Segment>,
    domains: Map<(u32, u64), Pool>,
    /// The open workspace use per device, when workspace frees are not probed.
    workspace_open: Map<(u32, DeviceKey), u64>,
}

impl Pools {
    /// Per-device, per-pool totals.
    pub(super) fn stats(&self) -> impl Iterator<Item = ((DeviceKey, Pool, u32), &PoolStats)> {
        self.stats.iter().map(|(k, v)| (*k, v))
    }

    fn stats_mut(&mut self, key: (DeviceKey, Pool, u32)) -> &mut PoolStats {
        self.stats.entry(key).or_default()
    }

    /// Every live pool block, in (pid, start) order.
    pub(super) fn table(&self) -> &BTreeMap<(u32, u64), PoolBlock> {
        &self.blocks
    }

    /// Counts a new block at `ptr` of process `pid` and keeps it: the pool's (used, total) after.
    pub(super) fn add_block(&mut self, pid: u32, ptr: u64, block: PoolBlock) -> (u64, u64) {
        let stats = self.stats_mut((block.device, block.pool, pid));
        stats.used += block.size;
        stats.peak_used = stats.peak_used.max(stats.used);
        stats.live_blocks += 1;
        let totals = (stats.used, stats.total);
        self.blocks.insert((pid, ptr), block);
        totals
    }

    /// Takes the live block at `ptr` out of its pool's table and totals.
    pub(super) fn remove_block(&mut self, pid: u32, ptr: u64) -> Option<PoolBlock> {
        let block = self.blocks.remove(&(pid, ptr))?;
        self.uncount(pid, &block);
        Some(block)
    }

    /// Takes the live block at `ptr` out of the table only: a block being displaced, whose
    /// totals must still hold it while an older displaced block's row is written (`reuse`),
    /// after which [`Self::uncount`] drops it.
    pub(super) fn take_block(&mut self, pid: u32, ptr: u64) -> Option<PoolBlock> {
        self.blocks.remove(&(pid, ptr))
    }

    /// Drops a block taken by [`Self::take_block`] from its pool's totals.
    pub(super) fn uncount(&mut self, pid: u32, block: &PoolBlock) {
        let stats = self.stats_mut((block.device, block.pool, pid));
        stats.used -= block.size;
        stats.live_blocks -= 1;
    }

    /// The pool's (used, total) at a free of a block it never saw.
    pub(super) fn untracked_free(&mut self, device: DeviceKey, pool: Pool, pid: u32) -> (u64, u64) {
        let stats = self.stats_mut((device, pool, pid));
        (stats.used, stats.total)
    }

    /// A pool free entered at `entry_ns` (0: not a call's) before the live block at `ptr` was
    /// handed out: the free is of the block that was there before (`reuse`).
    #[inline]
    pub(super) fn is_late_free(&self, pid: u32, ptr: u64, entry_ns: u64) -> bool {
        entry_ns != 0 && self.blocks.get(&(pid, ptr)).is_some_and(|live| live.born_ns > entry_ns)
    }

    /// The live pool block whose range holds `addr`.
    pub(super) fn at(&self, pid: u32, addr: u64) -> Option<(&(u32, u64), &PoolBlock)> {
        self.blocks
            .range((pid, 0)..=(pid, addr))
            .next_back()
            .filter(|(&(_, start), b)| addr < start.saturating_add(b.size))
    }

    /// The key of the block an address tag at `addr` names: the block starting there, else the
    /// one whose range holds it.
    pub(super) fn holding(&self, pid: u32, addr: u64) -> Option<(u32, u64)> {
        if self.blocks.contains_key(&(pid, addr)) {
            Some((pid, addr))
        } else {
            self.at(pid, addr).map(|(k, _)| *k)
        }
    }

    /// For a retag: the block's labels change, never its size or pool.
    pub(super) fn block_mut(&mut self, key: &(u32, u64)) -> Option<&mut PoolBlock> {
        self.blocks.get_mut(key)
    }

    /// Marks (`record`) or unmarks the live block at `ptr` as used on `stream`.
    pub(super) fn mark_stream(&mut self, pid: u32, ptr: u64, stream: u64, record: bool) {
        if let Some(block) = self.blocks.get_mut(&(pid, ptr)) {
            if record && !block.streams.contains(&stream) {
                block.streams.push(stream);
            } else if !record {
                block.streams.retain(|s| *s != stream);
            }
        }
    }

    /// An external block known by its handle only, until `GetBlockPtr` names its address.
    pub(super) fn hold_handle(&mut self, pid: u32, handle: u64, pending: PendingHandle) {
        self.handles.insert((pid, handle), pending);
    }

    /// `GetBlockPtr`: the handle's pending block, with its size updated, now that its address is
    /// known. A handle named without an address is dropped.
    pub(super) fn resolve_handle(
        &mut self,
        pid: u32,
        handle: u64,
        ptr: Option<u64>,
        size: Option<u64>,
    ) -> Option<(u64, PendingHandle)> {
        // GetBlockSize may come first: the handle stays pending, its size learnt.
        let pending = self.handles.get_mut(&(pid, handle))?;
        pending.size = size.or(pending.size);
        let ptr = ptr?;
        let pending = self.handles.remove(&(pid, handle))?;
        self.handle_ptrs.insert((pid, handle), ptr);
        Some((ptr, pending))
    }

    /// A free by handle: the handle is done with, and its block's address if it was known.
    pub(super) fn forget_handle(&mut self, pid: u32, handle: u64) -> Option<u64> {
        self.handles.remove(&(pid, handle));
        self.handle_ptrs.remove(&(pid, handle))
    }

    pub(super) fn name_domain(&mut self, pid: u32, handle: u64, pool: Pool) {
        self.domains.insert((pid, handle), pool);
    }

    /// The pool an mstx domain reports for.
    pub(super) fn domain(&self, pid: u32, handle: u64) -> Option<Pool> {
        self.domains.get(&(pid, handle)).copied()
    }

    /// A pool's own report of its reserved bytes: it wins over the segments seen.
    pub(super) fn report_total(&mut self, key: (DeviceKey, Pool, u32), total: u64) {
        let stats = self.stats_mut(key);
        stats.total = total;
        stats.peak_total = stats.peak_total.max(total);
    }

    /// Counts device memory taken inside a traced allocator call (`outer`) as that pool's
    /// segment.
    #[inline]
    pub(super) fn add_segment(
        &mut self,
        pid: u32,
        ptr: u64,
        device: DeviceKey,
        size: u64,
        outer: Option<Api>,
        out: &mut [Output],
    ) {
        let Some(pool) = outer.and_then(|api| api.tracking().segment_pool) else { return };
        // The block's row was just produced by `add_block`: mark it as this pool's segment.
        if let Some(Output::Malloc { ptr: p, segment, .. }) = out.last_mut() {
            if *p == ptr {
                *segment = Some(pool);
            }
        }
        self.segments.insert((pid, ptr), Segment { device, pool, size });
        let stats = self.stats_mut((device, pool, pid));
        stats.total += size;
        stats.peak_total = stats.peak_total.max(stats.total);
    }

    #[inline]
    pub(super) fn remove_segment(&mut self, pid: u32, ptr: u64) {
        if let Some(seg) = self.segments.remove(&(pid, ptr)) {
            let stats = self.stats_mut((seg.device, seg.pool, pid));
            stats.total = stats.total.saturating_sub(seg.size);
        }
    }

    /// With only `allocate_workspace` probed, a device's workspace use is open until the next.
    pub(super) fn open_workspace(&mut self, pid: u32, device: DeviceKey, ptr: u64) {
        self.workspace_open.insert((pid, device), ptr);
    }

    /// Closes the device's open workspace use: its block's address, if the block is still live.
    pub(super) fn close_workspace(&mut self, pid: u32, device: DeviceKey) -> Option<u64> {
        self.workspace_open.remove(&(pid, device)).filter(|ptr| self.blocks.contains_key(&(pid, *ptr)))
    }

    /// The free row of a pool block already taken out of its pool's totals.
    pub(super) fn free_row(
        &mut self,
        site: Site,
        ptr: u64,
        block: &PoolBlock,
        (shadow, implied): (bool, bool),
    ) -> Output {
        let stats = self.stats_mut((block.device, block.pool, site.pid));
        Output::PoolFree {
            site,
            device: block.device,
            pool: block.pool,
            ptr,
            size: Some(block.size),
            allocation_id: Some(block.allocation_id),
            used: stats.used,
            total: stats.total,
            shadow,
            implied,
            stream_uses: block.streams.len() as u32,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;
    use crate::apis::Api;
    use crate::model::*;

    #[test]
    fn each_process_has_its_own_pool_counters_on_a_shared_device() {
        let segment = |pid: u32, ptr: u64, size: u64| Event {
            pid,
            ..with_outer(malloc(Some(ptr), size, Some(0), 0), Api::DeviceCachingAllocatorMalloc)
        };
        let block = |pid: u32, ptr: u64, size: u64| Event { pid, ..pool_malloc(ptr, size, 0) };
        let (t, out) = run(&[
            segment(1, 0x10_0000, 2 << 20),
            block(1, 0x10_0000, 4096),
            segment(2, 0x90_0000, 4 << 20),
            block(2, 0x90_0000, 8192),
        ]);
        let Output::PoolMalloc { used, total, allocation_id, .. } = out[3] else { panic!("{out:?}") };
        assert_eq!((used, total), (8192, 4 << 20), "process 2's allocator, not the sum of both");
        assert_eq!(allocation_id, 4, "ids are per device file, whatever the process or layer");
        assert_eq!(t.pools().count(), 2);
    }

    #[test]
    fn runtime_allocations_inside_the_allocator_are_its_reserved_segments() {
        let segment = with_outer(malloc(Some(0x10_0000), 2 << 20, Some(0), 0), Api::DeviceCachingAllocatorMalloc);
        let (t, out) = run(&[segment, pool_malloc(0x10_0000, 4096, 0), malloc(Some(0x90_0000), 1 << 20, Some(0), 0)]);
        let Output::PoolMalloc { used, total, device, .. } = out[1] else { panic!("{out:?}") };
        assert_eq!((used, total, device), (4096, 2 << 20, DeviceKey::Npu(0)));
        assert!(matches!(out[0], Output::Malloc { segment: Some(Pool::Caching), .. }), "the row says it is a segment");
        assert!(matches!(out[2], Output::Malloc { segment: None, .. }));
        // A runtime allocation outside the allocator is no segment of it.
        let pool = t.pools().next().unwrap().1;
        assert_eq!((pool.used, pool.total), (4096, 2 << 20));
        let (_, out) = run(&[
            with_outer(malloc(Some(0x10_0000), 2 << 20, Some(0), 0), Api::DeviceCachingAllocatorMalloc),
            free(0x10_0000, Some(0)),
            pool_malloc(0x20_0000, 4096, 0),
        ]);
        assert!(
            matches!(out[2], Output::PoolMalloc { total: 0, .. }),
            "a freed segment is no longer reserved: {out:?}"
        );
    }

    #[test]
    fn a_pool_free_of_an_unknown_block_is_placed_by_the_blocks_own_device() {
        let op =
            Op::PoolFree { pool: Pool::Caching, ptr: Some(0x5000), handle: None, size: Some(4096), device: Some(1) };
        let (_, out) = run(&[call(Api::DeviceCachingAllocatorFree, 1, None, 0, op)]);
        let Output::PoolFree { device, size, .. } = out[0] else { panic!("{out:?}") };
        assert_eq!(device, DeviceKey::Npu(1));
        assert_eq!(size, None, "unknown to the trace, so Insight must skip it");
    }
}
