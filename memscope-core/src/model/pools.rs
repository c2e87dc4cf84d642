//! Framework pools (torch_npu's caching and workspace allocators, PTA): their blocks, their
//! segments and their totals, per device and process.
//!
//! - A pool block counts in its pool's `used` from the allocator handing it out to taking it
//!   back; an external block known first by its handle becomes a block at `GetBlockPtr`.
//! - The pool's `total` (reserved) is the device memory its allocator took: runtime allocations
//!   and mappings made inside a traced allocator call are the pool's segments, until freed or
//!   unmapped. When the pool reports its reserved bytes through mstx, that report wins. Segments
//!   taken before an attach are unknown, so `total` starts low then.
//! - Each process has its own allocator, so its counters are its own even on a shared device.
//! - Pools that report through mstx (domains `ptaCaching`, `msleaks`, `ptaWorkspace`) have their
//!   regions as blocks, merged into the allocator call they were reported from when traced.

use super::event::{Call, DeviceKey, Op, Pool};
use super::output::{Output, Site};
use super::owners::OwnerBase;
use super::reuse::Slot;
use super::tags::BlockLabels;
use super::tracker::Tracker;
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

#[derive(Clone, Debug)]
pub(super) struct PoolBlock {
    pub(super) device: DeviceKey,
    pub(super) pool: Pool,
    pub(super) size: u64,
    pub(super) allocation_id: u64,
    pub(super) api: Api,
    pub(super) labels: BlockLabels,
    /// Born while collection was off: never reported.
    pub(super) hidden: bool,
    pub(super) born_ns: u64,
    /// Streams it is marked on (`recordStream`, until `eraseStream`).
    pub(super) streams: Vec<u64>,
}

/// An external block known by its handle, waiting for `GetBlockPtr`.
#[derive(Clone, Copy, Debug)]
pub(super) struct PendingHandle {
    device: DeviceKey,
    pool: Pool,
    req: Option<u64>,
    size: Option<u64>,
    api: Api,
}

/// Device memory a pool's allocator took (a runtime block or a mapping made inside its call).
#[derive(Clone, Copy, Debug)]
pub(super) struct Segment {
    device: DeviceKey,
    pool: Pool,
    size: u64,
}

/// A block a framework pool handed out; its facts come from different sources (the call, a
/// handle resolved later, an mstx report).
struct NewPoolBlock {
    device: DeviceKey,
    pool: Pool,
    ptr: u64,
    size: u64,
    req_size: Option<u64>,
}

/// A block a framework pool took back (or the tracker retired).
struct PoolBlockFree {
    ptr: u64,
    pool: Pool,
    /// Where a free of a block never seen is counted.
    fallback: DeviceKey,
    /// Made up by the tracker (the block was handed out again), not a call's.
    shadow: bool,
    /// Inferred from the next workspace use (no free of it is probed).
    implied: bool,
    /// When the freeing call was entered (0: not a call of this block's): a free entered before
    /// the live block at its address was handed out is the block's before it (`reuse`).
    entry_ns: u64,
}

impl Tracker {
    /// One call of a framework allocator, or an mstx report of a pool.
    pub(super) fn apply_pool(&mut self, site: Site, call: &Call, out: &mut Vec<Output>) {
        match call.op {
            Op::PoolMalloc { .. } => self.pool_malloc(site, call, out),
            Op::PoolFree { pool, ptr, handle, device, .. } => {
                let by_handle = handle.and_then(|h| {
                    self.handles.remove(&(site.pid, h));
                    self.handle_ptrs.remove(&(site.pid, h))
                });
                if let Some(ptr) = ptr.or(by_handle) {
                    // A block allocated before an attach is unknown; its own device field (when
                    // the source reads it) still places its free, also on a thread whose device
                    // the trace never learnt.
                    let device = device.map_or_else(|| self.thread_device(site, call), DeviceKey::Npu);
                    self.remove_pool_block(
                        site,
                        PoolBlockFree {
                            ptr,
                            pool,
                            fallback: device,
                            shadow: false,
                            implied: false,
                            entry_ns: call.entry_wall_ns,
                        },
                        out,
                    );
                }
            }
            Op::PoolHandle { handle, ptr, size } => {
                if let Some(pending) = self.handles.get_mut(&(site.pid, handle)) {
                    pending.size = size.or(pending.size);
                }
                if let (Some(ptr), Some(pending)) = (ptr, self.handles.remove(&(site.pid, handle))) {
                    self.handle_ptrs.insert((site.pid, handle), ptr);
                    let site = Site { api: pending.api, ..site };
                    let size = pending.size.or(pending.req).unwrap_or(0);
                    self.add_pool_block(
                        site,
                        NewPoolBlock { device: pending.device, pool: pending.pool, ptr, size, req_size: pending.req },
                        out,
                    );
                }
            }
            Op::StreamMark { ptr: Some(ptr), stream, record } => {
                if let Some(block) = self.pool_blocks.get_mut(&(site.pid, ptr)) {
                    if record && !block.streams.contains(&stream) {
                        block.streams.push(stream);
                    } else if !record {
                        block.streams.retain(|s| *s != stream);
                    }
                }
            }
            _ => self.apply_mstx_pool(site, call, out),
        }
    }

    fn pool_malloc(&mut self, site: Site, call: &Call, out: &mut Vec<Output>) {
        let Op::PoolMalloc { pool, ptr, size, req, device, handle } = call.op else { return };
        let device = device.map_or_else(|| self.thread_device(site, call), DeviceKey::Npu);
        match (ptr, handle) {
            (Some(ptr), _) => {
                if pool == Pool::Workspace && call.api.tracking().workspace_until_next {
                    self.end_open_workspace(site, device, out);
                    self.workspace_open.insert((site.pid, device), ptr);
                }
                self.add_pool_block(
                    site,
                    NewPoolBlock { device, pool, ptr, size: size.or(req).unwrap_or(0), req_size: req },
                    out,
                );
            }
            (None, Some(handle)) => {
                let pending = PendingHandle { device, pool, req, size, api: call.api };
                self.handles.insert((site.pid, handle), pending);
            }
            (None, None) => {
                // The allocator gave up (after freeing its cache and retrying): out of memory.
                let stats = self.stats(device);
                stats.failures += 1;
                stats.out_of_memory += 1;
                let (status, out_of_memory, ptr, driver) = (0, true, None, None);
                if !self.is_paused(site.pid) {
                    let segment = None;
                    out.push(Output::Failed { site, device, status, out_of_memory, size: req, ptr, driver, segment });
                    self.oom_snapshot(site, device, true, out);
                }
            }
        }
    }

    /// A pool's own reports through mstx: its domain, its reserved bytes, its blocks.
    fn apply_mstx_pool(&mut self, site: Site, call: &Call, out: &mut Vec<Output>) {
        match call.op {
            Op::MstxDomain { handle, ref name } => {
                let pool = match name.as_deref() {
                    Some("ptaCaching" | "msleaks") => Some(Pool::Caching),
                    Some("ptaWorkspace") => Some(Pool::Workspace),
                    _ => None,
                };
                if let (Some(handle), Some(pool)) = (handle, pool) {
                    self.domains.insert((site.pid, handle), pool);
                }
            }
            Op::MstxHeap { domain, device, total } => {
                let pool = self.domains.get(&(site.pid, domain)).copied();
                if let (Some(pool), Some(device), Some(total)) = (pool, device, total) {
                    let stats = self.pools.entry((DeviceKey::Npu(device), pool, site.pid)).or_default();
                    stats.total = total;
                    stats.peak_total = stats.peak_total.max(total);
                }
            }
            Op::MstxRegion { domain, register, device, ptr, size, .. } => {
                let pool = self.domains.get(&(site.pid, domain)).copied();
                let (Some(pool), Some(ptr)) = (pool, ptr) else { return };
                let device = device.map_or_else(|| self.thread_device(site, call), DeviceKey::Npu);
                if register {
                    self.add_pool_block(
                        site,
                        NewPoolBlock { device, pool, ptr, size: size.unwrap_or(0), req_size: size },
                        out,
                    );
                } else {
                    let entry_ns = call.entry_wall_ns;
                    self.remove_pool_block(
                        site,
                        PoolBlockFree { ptr, pool, fallback: device, shadow: false, implied: false, entry_ns },
                        out,
                    );
                }
            }
            _ => {}
        }
    }

    /// Counts device memory taken inside a traced allocator call as that pool's segment.
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
        let stats = self.pools.entry((device, pool, pid)).or_default();
        stats.total += size;
        stats.peak_total = stats.peak_total.max(stats.total);
    }

    pub(super) fn remove_segment(&mut self, pid: u32, ptr: u64) {
        if let Some(seg) = self.segments.remove(&(pid, ptr)) {
            let stats = self.pools.entry((seg.device, seg.pool, pid)).or_default();
            stats.total = stats.total.saturating_sub(seg.size);
        }
    }

    /// With only `allocate_workspace` probed, a device's workspace use ends when the next starts.
    fn end_open_workspace(&mut self, site: Site, device: DeviceKey, out: &mut Vec<Output>) {
        if let Some(ptr) = self.workspace_open.remove(&(site.pid, device)) {
            if self.pool_blocks.contains_key(&(site.pid, ptr)) {
                self.remove_pool_block(
                    site,
                    PoolBlockFree {
                        ptr,
                        pool: Pool::Workspace,
                        fallback: device,
                        shadow: false,
                        implied: true,
                        entry_ns: 0,
                    },
                    out,
                );
            }
        }
    }

    fn add_pool_block(&mut self, site: Site, block: NewPoolBlock, out: &mut Vec<Output>) {
        let NewPoolBlock { device, pool, ptr, size, req_size } = block;
        // Handed out again while we think it is live: its free was missed, or is still on its way
        // from another thread (`reuse`). Retire the old one so `used` stays the allocator's.
        if let Some(stale) = self.pool_blocks.remove(&(site.pid, ptr)) {
            self.displace_pool(site, ptr, stale, out);
        }
        let allocation_id = self.next_allocation_id(device);
        let stats = self.pools.entry((device, pool, site.pid)).or_default();
        stats.used += size;
        stats.peak_used = stats.peak_used.max(stats.used);
        stats.live_blocks += 1;
        let (used, total) = (stats.used, stats.total);
        let labels = self.tags.block_labels(site.pid, site.tid);
        let hidden = self.is_paused(site.pid);
        if !hidden {
            let owner = self.owners.get(OwnerBase::Pool(pool), &labels);
            out.push(Output::PoolMalloc { site, device, pool, ptr, size, req_size, allocation_id, used, total, owner });
        }
        let born_ns = site.wall_ns;
        let streams = Vec::new();
        let block = PoolBlock { device, pool, size, allocation_id, api: site.api, labels, hidden, born_ns, streams };
        self.pool_blocks.insert((site.pid, ptr), block);
    }

    fn remove_pool_block(&mut self, site: Site, free: PoolBlockFree, out: &mut Vec<Output>) {
        let PoolBlockFree { ptr, pool, fallback, shadow, implied, entry_ns } = free;
        let block = if self.is_late_pool_free(site.pid, ptr, entry_ns) {
            // The block now at the address is not this free's.
            self.take_displaced_pool(site.pid, ptr)
        } else {
            self.settle_displaced(Slot::Pool(site.pid, ptr), out);
            self.pool_blocks.remove(&(site.pid, ptr)).inspect(|block| {
                let stats = self.pools.entry((block.device, block.pool, site.pid)).or_default();
                stats.used -= block.size;
                stats.live_blocks -= 1;
            })
        };
        match block {
            Some(block) if block.hidden => {}
            Some(block) => out.push(self.pool_free_row(site, ptr, &block, (shadow, implied))),
            None => {
                self.stats(fallback).untracked_frees += 1;
                let stats = self.pools.entry((fallback, pool, site.pid)).or_default();
                let (used, total) = (stats.used, stats.total);
                if self.is_paused(site.pid) {
                    return;
                }
                let (size, allocation_id) = (None, None);
                let device = fallback;
                out.push(Output::PoolFree {
                    site,
                    device,
                    pool,
                    ptr,
                    size,
                    allocation_id,
                    used,
                    total,
                    shadow,
                    implied,
                    stream_uses: 0,
                });
            }
        }
    }

    /// The free row of a pool block already taken out of its pool's totals.
    pub(super) fn pool_free_row(
        &mut self,
        site: Site,
        ptr: u64,
        block: &PoolBlock,
        (shadow, implied): (bool, bool),
    ) -> Output {
        let stats = self.pools.entry((block.device, block.pool, site.pid)).or_default();
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
