//! The live-block table: device and host blocks from their allocation to their free (runtime,
//! driver and CPU-allocator calls, and mappings), found by their start or by any address inside.
//!
//! The table is ordered, not hashed, so that the block holding an address inside it is found
//! without a scan and without a second index (a B-tree also has no resize that briefly doubles a
//! million-entry table). It holds blocks only; what a block counts on its device is `devices`',
//! and the rules of allocation and free (owners, reuse, failures) are the tracker's
//! (`route_blocks`), so that this table stays one thing a million entries can afford.

use std::collections::btree_map::Entry;
use std::collections::BTreeMap;

use super::event::Space;
use super::keys::{Key, Live};

/// Live device and host blocks by (pid, space, start).
#[derive(Debug, Default)]
pub(super) struct Blocks {
    live: BTreeMap<Key, Live>,
}

impl Blocks {
    #[inline]
    pub(super) fn get(&self, key: &Key) -> Option<&Live> {
        self.live.get(key)
    }

    /// For a retag: the block's labels change, never its size or device.
    #[inline]
    pub(super) fn get_mut(&mut self, key: &Key) -> Option<&mut Live> {
        self.live.get_mut(key)
    }

    /// Every live block, in key order.
    pub(super) fn table(&self) -> &BTreeMap<Key, Live> {
        &self.live
    }

    /// Puts the block `make` returns at `key`. `make` gets the block the table still held there
    /// (whose address the runtime handed out again), taken out, so that it can be retired before
    /// the new block counts. One search of the table when the place is free, the common case.
    #[inline]
    pub(super) fn insert_with<R>(&mut self, key: Key, make: impl FnOnce(Option<Live>) -> (Live, R)) -> R {
        let (slot, stale) = match self.live.entry(key) {
            Entry::Vacant(slot) => (slot, None),
            Entry::Occupied(stale) => {
                let stale = stale.remove();
                match self.live.entry(key) {
                    Entry::Vacant(slot) => (slot, Some(stale)),
                    Entry::Occupied(_) => unreachable!("removed above"),
                }
            }
        };
        let (block, made) = make(stale);
        slot.insert(block);
        made
    }

    #[inline]
    pub(super) fn remove(&mut self, key: &Key) -> Option<Live> {
        self.live.remove(key)
    }

    /// A free called (entered at `entry_ns`; 0: unknown) before the live block at `key` was
    /// handed out: the free is of the block that was there before (`reuse`).
    #[inline]
    pub(super) fn is_late_free(&self, key: &Key, entry_ns: u64) -> bool {
        entry_ns != 0 && self.live.get(key).is_some_and(|live| live.born_ns > entry_ns)
    }

    /// The live block whose range holds `addr` (of the spaces, the one that starts nearest
    /// below it).
    pub(super) fn at(&self, pid: u32, addr: u64) -> Option<(&Key, &Live)> {
        [Space::Device, Space::Host, Space::Cpu, Space::Registered]
            .into_iter()
            .filter_map(|space| {
                self.live
                    .range((pid, space, 0)..=(pid, space, addr))
                    .next_back()
                    .filter(|(&(_, _, start), b)| addr < start.saturating_add(b.size))
            })
            .max_by_key(|(&(_, _, start), _)| start)
    }

    /// The key of the block an address tag at `addr` names: the block starting there (the common
    /// case: a tensor's storage is its block), else the one whose range holds it.
    pub(super) fn holding(&self, pid: u32, addr: u64) -> Option<Key> {
        [Space::Device, Space::Cpu, Space::Host, Space::Registered]
            .into_iter()
            .map(|space| (pid, space, addr))
            .find(|key| self.live.contains_key(key))
            .or_else(|| self.at(pid, addr).map(|(k, _)| *k))
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use crate::apis::Api;
    use crate::model::*;

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
    fn a_zero_size_request_answered_with_null_is_no_block_and_no_failure() {
        let alloc_cpu = |ptr| {
            let op =
                Op::Malloc { space: Space::Cpu, size: 0, ptr, policy: None, device: None, module: None, driver: None };
            call(Api::C10AllocCpu, 1, None, 0, op)
        };
        // `cudaMalloc(&p, 0)` succeeds and writes NULL; `alloc_cpu(0)` returns it.
        let (t, out) = run(&[alloc_cpu(None), alloc_cpu(Some(0)), malloc(Some(0), 0, Some(0), 0)]);
        assert!(out.is_empty(), "{out:?}");
        assert!(t.devices().all(|(_, s)| s.failures == 0 && s.live_blocks == 0 && s.mallocs == 0));
        // Asked for bytes and given none is still a failure, as is an error status for nothing.
        let (_, out) = run(&[malloc(None, 64, Some(0), 0), malloc(None, 0, Some(0), 107_000)]);
        assert_eq!(out.iter().filter(|o| matches!(o, Output::Failed { .. })).count(), 2, "{out:?}");
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
