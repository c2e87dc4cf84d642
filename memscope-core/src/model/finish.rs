//! The stop's shadow frees: every block still alive when the trace ends gets a FREE one
//! nanosecond after the last event (msMemScope writes them so that every MALLOC has a FREE),
//! marked `shadow`, in allocation order per device (per device and pool for pool blocks).
//!
//! The DB is complete only once they are written, and a stop has a second for it with a million
//! live blocks, so they are made straight from the live tables: in the tables' own order when
//! that already is allocation order (an allocator handing out rising addresses), else from one
//! sorted list of references; never a copy of a block, nor a list of the frees.

use std::collections::BTreeMap;

use super::event::{DeviceKey, Pool};
use super::output::{Output, Site};
use super::reuse::Settle;
use super::tracker::Tracker;

impl Tracker {
    /// Ends the trace at `wall_ns`: held driver calls are applied, then every block still alive
    /// gets a shadow free one nanosecond later, in allocation order per device. Totals (`used`,
    /// `live_blocks`) are left as they were at the end, for the summary. Each fact goes to `emit`
    /// as it is made: with a million live blocks, a list of them all would double the memory the
    /// tracer holds at the stop.
    pub fn finish<E>(&mut self, wall_ns: u64, mut emit: impl FnMut(Output) -> Result<(), E>) -> Result<(), E> {
        let mut held = Vec::new();
        self.flush_all_inner(&mut held);
        self.settle_displaced_where(Settle::All, &mut held);
        held.into_iter().try_for_each(&mut emit)?;
        let at = wall_ns.max(self.last_wall_ns) + 1;
        self.shadow_free_blocks(at, &mut emit)?;
        self.shadow_free_pool_blocks(at, &mut emit)
    }

    fn shadow_free_blocks<E>(&self, at: u64, emit: &mut impl FnMut(Output) -> Result<(), E>) -> Result<(), E> {
        // A device's blocks come one after another: its `used` is looked up once.
        let mut device: Option<(DeviceKey, u64)> = None;
        for (&(pid, space, ptr), block) in in_order(self.blocks.table(), |b| (b.device, b.allocation_id)) {
            let remaining = match &mut device {
                Some((key, used)) if *key == block.device => used,
                _ => {
                    let used = self.devices.used(block.device);
                    &mut device.insert((block.device, used)).1
                }
            };
            *remaining -= block.size;
            if block.hidden {
                continue;
            }
            emit(Output::Free {
                site: Site::of(block.api, at, pid, pid),
                device: block.device,
                space,
                ptr,
                size: Some(block.size),
                allocation_id: Some(block.allocation_id),
                used: *remaining,
                shadow: true,
                implied: false,
                driver: None,
            })?;
        }
        Ok(())
    }

    fn shadow_free_pool_blocks<E>(&self, at: u64, emit: &mut impl FnMut(Output) -> Result<(), E>) -> Result<(), E> {
        // (used, total) per (device, pool, process): processes interleave within a pool.
        let mut pools: BTreeMap<(DeviceKey, Pool, u32), (u64, u64)> =
            self.pools.stats().map(|(k, v)| (k, (v.used, v.total))).collect();
        for (&(pid, ptr), block) in in_order(self.pools.table(), |b| (b.device, b.pool, b.allocation_id)) {
            let (remaining, total) = pools.entry((block.device, block.pool, pid)).or_default();
            *remaining -= block.size;
            if block.hidden {
                continue;
            }
            emit(Output::PoolFree {
                site: Site::of(block.api, at, pid, pid),
                device: block.device,
                pool: block.pool,
                ptr,
                size: Some(block.size),
                allocation_id: Some(block.allocation_id),
                used: *remaining,
                total: *total,
                shadow: true,
                implied: false,
                stream_uses: 0,
            })?;
        }
        Ok(())
    }
}

/// The entries of `map` in `key` order: the map's own when it already is (one pass to check),
/// else a sorted list of references.
fn in_order<'a, K, V, O: Ord>(
    map: &'a BTreeMap<K, V>,
    key: impl Fn(&V) -> O,
) -> Box<dyn Iterator<Item = (&'a K, &'a V)> + 'a> {
    if map.values().is_sorted_by_key(&key) {
        return Box::new(map.iter());
    }
    let mut sorted: Vec<(&K, &V)> = map.iter().collect();
    sorted.sort_unstable_by_key(|(_, v)| key(v));
    Box::new(sorted.into_iter())
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;

    #[test]
    fn finish_writes_shadow_frees_after_the_last_event() {
        let (mut t, _) = run(&[malloc(Some(0x1), 10, Some(0), 0), malloc(Some(0x2), 20, Some(0), 0)]);
        let mut out = Vec::new();
        t.finish(0, |o| {
            out.push(o);
            Ok::<_, ()>(())
        })
        .unwrap();
        assert_eq!(out.len(), 2);
        for o in &out {
            let Output::Free { shadow, site, .. } = o else { panic!("{o:?}") };
            assert!(*shadow);
            assert!(site.wall_ns > 1_001, "shadow frees come after the last real event");
        }
        assert!(matches!(out[1], Output::Free { used: 0, .. }));
        // Summary totals still show what was live at the end.
        assert_eq!(t.devices().next().unwrap().1.used, 30);
    }

    /// The shadow frees of `t`'s blocks as (device, allocation_id, ptr, used after).
    fn shadow_frees(t: &mut Tracker) -> Vec<(DeviceKey, u64, u64, u64)> {
        let mut frees = Vec::new();
        t.finish(0, |o| {
            let Output::Free { device, allocation_id: Some(id), ptr, used, shadow: true, .. } = o else {
                panic!("{o:?}")
            };
            frees.push((device, id, ptr, used));
            Ok::<_, ()>(())
        })
        .unwrap();
        frees
    }

    #[test]
    fn shadow_frees_follow_allocation_order_per_device_whatever_the_addresses() {
        let on = |ptr, size, device| malloc(Some(ptr), size, Some(device), 0);
        // Rising addresses on one device: the table's own order is allocation order.
        let (mut t, _) = run(&[on(0x1000, 10, 0), on(0x2000, 20, 0), on(0x3000, 30, 0)]);
        assert_eq!(
            shadow_frees(&mut t),
            [(DeviceKey::Npu(0), 1, 0x1000, 50), (DeviceKey::Npu(0), 2, 0x2000, 30), (DeviceKey::Npu(0), 3, 0x3000, 0)]
        );
        // Falling addresses, two devices interleaved, a freed block and a reused address: the
        // ledger's allocation order, device by device, with each device's own `used`.
        let (mut t, _) = run(&[
            on(0x9000, 1, 1),
            on(0x8000, 2, 0),
            on(0x7000, 4, 1),
            on(0x6000, 8, 0),
            free(0x7000, Some(1)),
            on(0x5000, 16, 1),
            on(0x9000, 32, 1),
        ]);
        assert_eq!(
            shadow_frees(&mut t),
            [
                (DeviceKey::Npu(1), 1, 0x9000, 48),
                (DeviceKey::Npu(0), 1, 0x8000, 8),
                (DeviceKey::Npu(0), 2, 0x6000, 0),
                (DeviceKey::Npu(1), 3, 0x5000, 32),
                (DeviceKey::Npu(1), 4, 0x9000, 0),
            ],
            "device 1's block at 0x9000 was handed out again (id 4): its first life, retired then, \
             gets its row first (no late free came)"
        );
    }
}
