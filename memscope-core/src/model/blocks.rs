//! The live-block table: device and host blocks from their allocation to their free (runtime,
//! driver and CPU-allocator calls, and mappings, which `vmm` adds here), with each block's owner.
//!
//! - A block counts from its successful allocation to its successful free; a failed call is an
//!   [`Output::Failed`], never a block (so it is no leak).
//! - An address handed out again while still live: the stale block is retired, and its FREE row
//!   waits for a free still on its way from another thread (see `reuse`).
//! - A free of an address never seen allocated is counted apart (`untracked_frees`), without
//!   size or id.
//! - Owners: the allocator's label (the driver module, host) and the thread's open tag spans at
//!   the allocation; an address tag later replaces one level (see `marks`).

use std::collections::btree_map::Entry;

use super::event::{Call, DeviceKey, DriverInfo, Op, Space};
use super::output::{Origin, Output, Site};
use super::owners::OwnerBase;
use super::reuse::{free_row, Key, Slot};
use super::tags::BlockLabels;
use super::tracker::{Failure, Tracker};
use crate::apis::{Api, Backend, Family};

/// A live device or host block. Kept small (48 bytes): a job can hold a million of them, and the
/// tracer's memory is mostly these.
#[derive(Clone, Debug)]
pub(super) struct Live {
    pub(super) device: DeviceKey,
    pub(super) size: u64,
    pub(super) allocation_id: u64,
    pub(super) api: Api,
    pub(super) base: OwnerBase,
    pub(super) labels: BlockLabels,
    pub(super) hidden: bool,
    pub(super) born_ns: u64,
}

const _: () = assert!(std::mem::size_of::<Live>() <= 48, "a live block's state grew: see Live");

/// Where memory of `space` is counted: host memory on the host, device memory on `device`.
fn space_device(space: Space, device: DeviceKey) -> DeviceKey {
    match space {
        Space::Host | Space::Cpu => DeviceKey::Cpu,
        Space::Device => device,
    }
}

/// A block a call allocated (or a mapping made).
pub(super) struct NewBlock {
    pub(super) device: DeviceKey,
    pub(super) space: Space,
    pub(super) ptr: u64,
    /// (bytes taken, bytes requested).
    pub(super) sizes: (u64, u64),
    pub(super) origin: Origin,
}

/// A block a call freed (or a mapping removed).
pub(super) struct BlockFree {
    pub(super) space: Space,
    pub(super) ptr: u64,
    /// Where a free of a block never seen allocated is counted.
    pub(super) fallback: DeviceKey,
    /// Made up by the tracker (the block's free was missed), not a call's.
    pub(super) shadow: bool,
    pub(super) driver: Option<DriverInfo>,
}

impl Tracker {
    /// A malloc-style call (`Op::Malloc`).
    pub(super) fn apply_malloc(&mut self, site: Site, call: &Call, out: &mut Vec<Output>) {
        let Op::Malloc { space, size, ptr, policy, device, module, driver } = call.op else { return };
        let device = space_device(space, device.map_or_else(|| self.thread_device(site, call), DeviceKey::Npu));
        match ptr {
            Some(ptr) if call.status == 0 => {
                let taken = driver.map_or(size, |d| d.size);
                let origin = Origin::Direct { policy, module, driver };
                self.add_block(site, NewBlock { device, space, ptr, sizes: (taken, size), origin }, out);
                self.add_segment(site.pid, ptr, device, size, call.outer, out);
            }
            _ => self.fail(site, call, Failure { device, size: Some(size), ptr: None, driver }, out),
        }
    }

    /// A free-style call (`Op::Free`).
    pub(super) fn apply_free(&mut self, site: Site, call: &Call, out: &mut Vec<Output>) {
        let Op::Free { space, ptr, driver } = call.op else { return };
        let fallback = space_device(space, self.thread_device(site, call));
        let key = (site.pid, space, ptr);
        let late = self.is_late_free(key, call);
        if call.status != 0 {
            let device = if late { self.late_free_device(key) } else { self.blocks.get(&key).map(|b| b.device) };
            let device = device.unwrap_or(fallback);
            self.fail(site, call, Failure { device, size: None, ptr: Some(ptr), driver }, out);
        } else if late {
            // The block now at the address (and its segment) is not this free's.
            self.late_free(site, key, (fallback, driver), out);
        } else {
            self.settle_displaced(Slot::Block(key), out);
            self.remove_block(site, BlockFree { space, ptr, fallback, shadow: false, driver }, out);
            self.remove_segment(site.pid, ptr);
        }
    }

    pub(super) fn add_block(&mut self, site: Site, block: NewBlock, out: &mut Vec<Output>) {
        let NewBlock { device, space, ptr, sizes: (size, req_size), origin } = block;
        let family = site.api.family();
        let base = match (space, origin) {
            (Space::Host | Space::Cpu, _) => OwnerBase::Host,
            (Space::Device, _) if family.backend() == Some(Backend::Cuda) => {
                OwnerBase::Cuda { driver: family == Family::CudaDriver }
            }
            (Space::Device, Origin::Direct { module, driver, .. }) => {
                OwnerBase::Hal(driver.and_then(|d| d.module).or(module))
            }
            // Mapped pages belong to the module that created their physical memory.
            (Space::Device, Origin::Mapped { handle, .. }) => OwnerBase::Hal(self.physical_module(site.pid, handle)),
        };
        let labels = self.tags.block_labels(site.pid, site.tid);
        let hidden = self.is_paused(site.pid);
        let owner = (!hidden).then(|| self.owners.get(base, &labels));
        let key = (site.pid, space, ptr);
        // One search of the table for a new block, the common case.
        let slot = match self.blocks.entry(key) {
            Entry::Vacant(slot) => slot,
            Entry::Occupied(stale) => {
                // The runtime handed out an address we still consider live: retire the stale
                // block first so the totals stay true to what the runtime says is allocated.
                let stale = stale.remove();
                self.displace(site, key, stale, out);
                match self.blocks.entry(key) {
                    Entry::Vacant(slot) => slot,
                    Entry::Occupied(_) => unreachable!("removed above"),
                }
            }
        };
        let stats = self.devices.entry(device).or_default();
        let allocation_id = stats.take_allocation_id();
        stats.used += size;
        stats.peak = stats.peak.max(stats.used);
        stats.live_blocks += 1;
        stats.mallocs += 1;
        let used = stats.used;
        let born_ns = site.wall_ns;
        slot.insert(Live { device, size, allocation_id, api: site.api, base, labels, hidden, born_ns });
        if let Some(owner) = owner {
            let (owner, segment) = (Some(owner), None);
            out.push(Output::Malloc {
                site,
                device,
                space,
                ptr,
                size,
                req_size,
                allocation_id,
                used,
                origin,
                owner,
                segment,
            });
        }
    }

    pub(super) fn remove_block(&mut self, site: Site, free: BlockFree, out: &mut Vec<Output>) {
        let BlockFree { space, ptr, fallback, shadow, driver } = free;
        let key = (site.pid, space, ptr);
        let Some(block) = self.blocks.remove(&key) else {
            return self.untracked_free(site, key, fallback, driver, out);
        };
        let stats = self.stats(block.device);
        stats.used -= block.size;
        stats.live_blocks -= 1;
        stats.frees += 1;
        let used = stats.used;
        if !block.hidden {
            out.push(free_row(site, key, &block, used, shadow, driver));
        }
    }

    /// A free of an address the trace never saw allocated: counted on `fallback`, no size or id.
    pub(super) fn untracked_free(
        &mut self,
        site: Site,
        (_, space, ptr): Key,
        fallback: DeviceKey,
        driver: Option<DriverInfo>,
        out: &mut Vec<Output>,
    ) {
        let stats = self.stats(fallback);
        stats.frees += 1;
        stats.untracked_frees += 1;
        let used = stats.used;
        if self.is_paused(site.pid) {
            return;
        }
        let (size, allocation_id, shadow) = (None, None, false);
        out.push(Output::Free { site, device: fallback, space, ptr, size, allocation_id, used, shadow, driver });
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;
    use crate::apis::Api;
    use crate::model::Pool;

    #[test]
    fn malloc_then_free_pairs_with_size_and_id() {
        let (t, out) = run(&[malloc(Some(0x1000), 64, Some(1), 0), free(0x1000, Some(0))]);
        assert!(matches!(
            out[0],
            Output::Malloc { device: DeviceKey::Npu(1), size: 64, allocation_id: 1, used: 64, .. }
        ));
        // The free goes to the block's device even though the thread has moved to device 0.
        assert!(matches!(
            out[1],
            Output::Free {
                device: DeviceKey::Npu(1),
                size: Some(64),
                allocation_id: Some(1),
                used: 0,
                shadow: false,
                ..
            }
        ));
        let stats: Vec<_> = t.devices().collect();
        assert_eq!(stats[0].1.peak, 64);
        assert_eq!(stats[0].1.used, 0);
    }

    #[test]
    fn failed_malloc_is_no_block_and_no_leak() {
        let mut t = Tracker::new();
        let mut out = Vec::new();
        t.apply(malloc(None, 1 << 40, Some(0), 207_001), &mut out);
        assert!(matches!(out[0], Output::Failed { status: 207_001, size: Some(s), .. } if s == 1 << 40));
        out.clear();
        t.finish(5_000, |o| {
            out.push(o);
            Ok::<_, ()>(())
        })
        .unwrap();
        assert!(out.is_empty(), "a failed allocation must not get a shadow free: {out:?}");
    }

    #[test]
    fn failed_free_keeps_the_block_alive() {
        let fail_free =
            call(Api::AclrtFree, 1, Some(0), 100_000, Op::Free { space: Space::Device, ptr: 0x10, driver: None });
        let (t, out) = run(&[malloc(Some(0x10), 8, Some(0), 0), fail_free]);
        assert!(matches!(out[1], Output::Failed { status: 100_000, ptr: Some(0x10), .. }));
        assert_eq!(t.devices().next().unwrap().1.live_blocks, 1);
    }

    #[test]
    fn unknown_free_is_recorded_without_size() {
        let (_, out) = run(&[free(0x99, None)]);
        assert!(matches!(out[0], Output::Free { device: DeviceKey::Unknown, size: None, allocation_id: None, .. }));
    }

    #[test]
    fn host_memory_goes_to_cpu() {
        let e = call(
            Api::AclrtMallocHost,
            1,
            Some(1),
            0,
            Op::Malloc {
                space: Space::Host,
                size: 10,
                ptr: Some(0x5),
                policy: None,
                device: None,
                module: None,
                driver: None,
            },
        );
        let (_, out) = run(&[e]);
        assert!(matches!(out[0], Output::Malloc { device: DeviceKey::Cpu, space: Space::Host, .. }));
    }

    #[test]
    fn reused_address_retires_the_stale_block() {
        let (mut t, mut out) = run(&[malloc(Some(0x1), 10, Some(0), 0), malloc(Some(0x1), 20, Some(0), 0)]);
        assert_eq!(t.devices().next().unwrap().1.used, 20, "the stale block no longer counts");
        t.finish(0, |o| {
            out.push(o);
            Ok::<_, ()>(())
        })
        .unwrap();
        assert!(matches!(out[2], Output::Free { shadow: true, size: Some(10), .. }), "{out:?}");
    }

    #[test]
    fn allocation_ids_are_unique_in_each_file_across_layers() {
        // A caching segment (HAL) and its first block (PTA) share an address; a workspace
        // segment and block; a plain runtime block; host pinned and CPU tensor memory. Insight
        // groups a file's ACCESS/MALLOC/FREE rows by allocation_id alone.
        let (_, out) = run(&[
            with_outer(malloc(Some(0x10_0000), 2 << 20, Some(0), 0), Api::DeviceCachingAllocatorMalloc),
            pool_malloc(0x10_0000, 4096, 0),
            with_outer(malloc(Some(0x40_0000), 1 << 20, Some(0), 0), Api::WorkspaceMalloc),
            workspace_malloc(0x40_0000, 1 << 20, 0),
            malloc(Some(0x90_0000), 512, Some(0), 0),
            pool_malloc(0x10_1000, 4096, 0),
            host_malloc(Api::AclrtMallocHost, Space::Host, 0x7000),
            host_malloc(Api::C10AllocCpu, Space::Cpu, 0x8000),
        ]);
        let all = ids(&out);
        assert_eq!(all.len(), 8, "{out:?}");
        let mut seen = std::collections::HashSet::new();
        for (device, id, what) in &all {
            assert!(seen.insert((*device, *id)), "{what} reuses id {id} in {device:?}'s file: {all:?}");
        }
        let npu0: Vec<u64> = all.iter().filter(|(d, _, _)| *d == DeviceKey::Npu(0)).map(|(_, id, _)| *id).collect();
        assert_eq!(npu0, [1, 2, 3, 4, 5, 6], "one counter for the whole file, in allocation order");
        let cpu: Vec<u64> = all.iter().filter(|(d, _, _)| *d == DeviceKey::Cpu).map(|(_, id, _)| *id).collect();
        assert_eq!(cpu, [1, 2]);
    }

    #[test]
    fn every_device_block_has_an_owner() {
        let map = |va, handle| {
            call(Api::AclrtMapMem, 1, Some(0), 0, Op::Map { va, size: 2 << 20, offset: 0, handle, flags: 0 })
        };
        let physical = |handle, driver| {
            let op = Op::MallocPhysical { size: 2 << 20, handle: Some(handle), device: Some(0), flags: 0, driver };
            call(Api::AclrtMallocPhysical, 1, Some(0), 0, op)
        };
        let created =
            DriverInfo { api: Api::HalMemCreate, flag: Some(3 << 56), size: 2 << 20, module: Some(3), page: None };
        let (_, out) = run(&[
            malloc(Some(0x1000), 64, Some(0), 0), // a runtime call whose driver call was not seen
            physical(0xa, None),
            map(0x7000_0000, 0xa), // a mapping of memory whose creator was not seen
            physical(0xb, Some(created)),
            map(0x7020_0000, 0xb), // created by HCCL (module 3)
            driver_alloc(0x9000, 4096, 0, 33),
        ]);
        let owners: Vec<Option<String>> = out
            .iter()
            .filter_map(|o| match o {
                Output::Malloc { owner, .. } => Some(owner.as_deref().map(str::to_owned)),
                _ => None,
            })
            .collect();
        let want = ["CANN@UNKNOWN", "CANN@UNKNOWN", &crate::apis::hal::owner(3), &crate::apis::hal::owner(33)];
        assert_eq!(owners, want.map(|o| Some(o.to_owned())));
    }

    #[test]
    fn frees_of_blocks_never_seen_are_counted_apart() {
        let pool_free =
            Op::PoolFree { pool: Pool::Caching, ptr: Some(0x5000), handle: None, size: Some(4096), device: Some(0) };
        let (t, out) = run(&[
            free(0x99, Some(0)),
            call(Api::DeviceCachingAllocatorFree, 1, None, 0, pool_free),
            malloc(Some(0x1000), 8, Some(0), 0),
            free(0x1000, Some(0)),
        ]);
        assert!(matches!(out[0], Output::Free { size: None, allocation_id: None, .. }));
        let npu0 = t.devices().find(|(k, _)| *k == DeviceKey::Npu(0)).unwrap().1;
        assert_eq!((npu0.untracked_frees, npu0.frees), (2, 2), "a device and a pool block from before the trace");
    }
}
