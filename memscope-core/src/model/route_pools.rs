//! The rules of a framework pool's calls, which take more than one part of the state: a pool
//! block takes its `allocation_id` from its device's file (`devices`), its owner from the
//! thread's spans, may retire the stale block at its address (`reuse`), and a free of a block the
//! pool never saw is counted on the device.
//!
//! - An external block known first by its handle becomes a block at `GetBlockPtr`.
//! - Pools that report through mstx (domains `ptaCaching`, `msleaks`, `ptaWorkspace`) have their
//!   regions as blocks, merged into the allocator call they were reported from when traced.
//! - With only `allocate_workspace` probed, a device's workspace use ends when the next starts.

use super::event::{Call, DeviceKey, Op, Pool};
use super::keys::{PoolBlock, Slot};
use super::output::{Output, OwnerBy, Site};
use super::owners::OwnerBase;
use super::pools::PendingHandle;
use super::route_owner::NewOwner;
use super::tags;
use super::tracker::Tracker;
use crate::vocab::EventType;

/// A block a framework pool handed out; its facts come from different sources (the call, a
/// handle resolved later, an mstx report).
struct NewPoolBlock {
    device: DeviceKey,
    pool: Pool,
    ptr: u64,
    size: u64,
    req_size: Option<u64>,
    stream: Option<u64>,
}

/// A block a framework pool took back (or the tracker retired).
pub(super) struct PoolBlockFree {
    pub(super) ptr: u64,
    pub(super) pool: Pool,
    /// Where a free of a block never seen is counted.
    pub(super) fallback: DeviceKey,
    /// Made up by the tracker (the block was handed out again), not a call's.
    pub(super) shadow: bool,
    /// Not seen but known: inferred from the next workspace use (no free of it is probed), or
    /// missed because the daemon's window closed (`window`).
    pub(super) implied: bool,
    /// When the freeing call was entered (0: not a call of this block's): a free entered before
    /// the live block at its address was handed out is the block's before it (`reuse`).
    pub(super) entry_ns: u64,
}

impl Tracker {
    /// One call of a framework allocator, or an mstx report of a pool.
    pub(super) fn apply_pool(&mut self, site: Site, call: &Call, out: &mut Vec<Output>) {
        match call.op {
            Op::PoolMalloc { .. } => self.pool_malloc(site, call, out),
            Op::PoolFree { pool, ptr, handle, device, .. } => {
                let by_handle = handle.and_then(|h| self.pools.forget_handle(site.pid, h));
                if let Some(ptr) = ptr.or(by_handle) {
                    // A block allocated before an attach is unknown; its own device field (when
                    // the source reads it) still places its free, also on a thread whose device
                    // the trace never learnt.
                    let device = device.map_or_else(|| self.devices.thread_device(site, call), DeviceKey::Npu);
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
                if let Some((ptr, pending)) = self.pools.resolve_handle(site.pid, handle, ptr, size) {
                    let site = Site { api: pending.api, ..site };
                    let size = pending.size.or(pending.req).unwrap_or(0);
                    self.add_pool_block(
                        site,
                        NewPoolBlock {
                            device: pending.device,
                            pool: pending.pool,
                            ptr,
                            size,
                            req_size: pending.req,
                            stream: pending.stream,
                        },
                        out,
                    );
                }
            }
            Op::StreamMark { ptr: Some(ptr), stream, record } => self.pools.mark_stream(site.pid, ptr, stream, record),
            _ => self.apply_mstx_pool(site, call, out),
        }
    }

    fn pool_malloc(&mut self, site: Site, call: &Call, out: &mut Vec<Output>) {
        let Op::PoolMalloc { pool, ptr, size, req, device, handle, stream } = call.op else { return };
        let device = device.map_or_else(|| self.devices.thread_device(site, call), DeviceKey::Npu);
        match (ptr, handle) {
            (Some(ptr), _) => {
                if pool == Pool::Workspace && call.api.tracking().workspace_until_next {
                    self.end_open_workspace(site, device, out);
                    self.pools.open_workspace(site.pid, device, ptr);
                }
                self.add_pool_block(
                    site,
                    NewPoolBlock { device, pool, ptr, size: size.or(req).unwrap_or(0), req_size: req, stream },
                    out,
                );
            }
            (None, Some(handle)) => {
                let pending = PendingHandle { device, pool, req, size, api: call.api, stream };
                self.pools.hold_handle(site.pid, handle, pending);
            }
            (None, None) => {
                // The allocator gave up (after freeing its cache and retrying): out of memory.
                self.devices.fail(device, true);
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
                    self.pools.name_domain(site.pid, handle, pool);
                }
            }
            Op::MstxHeap { domain, device, total } => {
                let pool = self.pools.domain(site.pid, domain);
                if let (Some(pool), Some(device), Some(total)) = (pool, device, total) {
                    self.pools.report_total((DeviceKey::Npu(device), pool, site.pid), total);
                }
            }
            Op::MstxRegion { domain, register, device, ptr, size, .. } => {
                let pool = self.pools.domain(site.pid, domain);
                let (Some(pool), Some(ptr)) = (pool, ptr) else { return };
                let device = device.map_or_else(|| self.devices.thread_device(site, call), DeviceKey::Npu);
                if register {
                    self.add_pool_block(
                        site,
                        NewPoolBlock { device, pool, ptr, size: size.unwrap_or(0), req_size: size, stream: None },
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

    /// With only `allocate_workspace` probed, a device's workspace use ends when the next starts.
    fn end_open_workspace(&mut self, site: Site, device: DeviceKey, out: &mut Vec<Output>) {
        if let Some(ptr) = self.pools.close_workspace(site.pid, device) {
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

    fn add_pool_block(&mut self, site: Site, block: NewPoolBlock, out: &mut Vec<Output>) {
        let NewPoolBlock { device, pool, ptr, size, req_size, stream } = block;
        // Handed out again while we think it is live: its free was missed, or is still on its way
        // from another thread (`reuse`). Retire the old one so `used` stays the allocator's.
        if let Some(stale) = self.pools.take_block(site.pid, ptr) {
            self.reuse.retire_pool(site, ptr, stale, (&self.devices, &mut self.pools), out);
        }
        let allocation_id = self.devices.next_allocation_id(device);
        let NewOwner { labels, from } = self.new_owner(site);
        let hidden = self.is_paused(site.pid);
        let owner = (!hidden).then(|| self.owners.get(OwnerBase::Pool(pool), &labels));
        let (born_ns, streams, api) = (site.wall_ns, Vec::new(), site.api);
        let block = PoolBlock { device, pool, size, allocation_id, api, labels, hidden, born_ns, streams };
        let (used, total) = self.pools.add_block(site.pid, ptr, block);
        if let Some(owner) = owner {
            out.push(Output::PoolMalloc {
                site,
                device,
                pool,
                ptr,
                size,
                req_size,
                stream,
                allocation_id,
                used,
                total,
                owner,
                from,
            });
        }
    }

    pub(super) fn remove_pool_block(&mut self, site: Site, free: PoolBlockFree, out: &mut Vec<Output>) {
        let PoolBlockFree { ptr, pool, fallback, shadow, implied, entry_ns } = free;
        let block = if self.pools.is_late_free(site.pid, ptr, entry_ns) {
            // The block now at the address is not this free's.
            self.reuse.take_pool(site.pid, ptr)
        } else {
            self.settle_displaced(Slot::Pool(site.pid, ptr), out);
            self.pools.remove_block(site.pid, ptr)
        };
        match block {
            Some(block) if block.hidden => {}
            Some(block) => {
                if let Some(temporary) =
                    self.inference.temporary(site.pid, &block.labels, block.born_ns).filter(|_| !shadow)
                {
                    let owner = tags::owner_path(block.pool.owner(), tags::of(temporary));
                    let (device, event_type, by) = (block.device, EventType::Pta, OwnerBy::Inferred);
                    out.push(Output::Retag { device, pid: site.pid, event_type, ptr, owner, by });
                }
                out.push(self.pools.free_row(site, ptr, &block, (shadow, implied)));
            }
            None => {
                self.devices.untracked_pool_free(fallback);
                let (used, total) = self.pools.untracked_free(fallback, pool, site.pid);
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
}
