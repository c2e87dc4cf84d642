//! An address handed out again while the tracer still holds a block there.
//!
//! Two different things look alike at that moment. Either the old block's free was missed (it
//! happened before an attach, or its record was dropped), or it was not missed but is still on
//! its way: a free's record is sent when the free returns, so thread A's free can give the
//! address back, thread B's malloc take it and return, and B's record reach the ring before A's
//! (seen with the stand-in driver's threads, whose freed addresses come straight back). The
//! calls' entry times tell the two apart: a free called before a block was handed out cannot be
//! that block's free.
//!
//! So the stale block is retired at once (its device's totals drop as the runtime's did, so no
//! peak is ever counted twice), but its FREE row waits in [`Displaced`]: a late free writes it
//! as the real free it is, with that call's values; otherwise, once no free can still be on its
//! way (the next free of the address, [`REUSE_WAIT_NS`] of trace time, its process's exit or the
//! trace's end), it is written as the shadow free it would have been, at the reuse's time.
//!
//! The waiting blocks are this part's own; settling one writes a row that reads its device's or
//! pool's totals, so those parts are passed in rather than reached for.

use std::collections::VecDeque;

use super::devices::Devices;
use super::event::DeviceKey;
use super::keys::{Key, Live, Map, PoolBlock, Slot};
use super::output::{Output, Site};
use super::pools::Pools;

/// How long after a reuse a late free of the old block is still waited for. A free's record
/// trails its return by the time the consumer takes to reach it, far less than this.
pub(super) const REUSE_WAIT_NS: u64 = 1_000_000_000;

/// The block a [`Displaced`] entry holds.
#[derive(Clone, Debug)]
enum Retired {
    Block(Live),
    Pool(PoolBlock),
}

/// A block whose address was handed out again before its free was seen.
#[derive(Clone, Debug)]
struct Displaced {
    retired: Retired,
    /// The call that handed the address out again (its row's time is the shadow free's).
    reuse: Site,
}

/// The retired blocks whose free row waits for a late free.
#[derive(Debug, Default)]
pub(super) struct Reuse {
    displaced: Map<Slot, Displaced>,
    /// When each was displaced, oldest first (entries since settled are skipped).
    order: VecDeque<(u64, Slot)>,
}

/// Which displaced blocks [`Reuse::settle_where`] settles.
#[derive(Clone, Copy, Debug)]
pub(super) enum Settle {
    Expired,
    Process(u32),
    All,
}

impl Reuse {
    /// Retires `block`, found at `key` when `reuse` handed the address out again: its device's
    /// totals drop now, its row waits.
    pub(super) fn retire_block(
        &mut self,
        reuse: Site,
        key: Key,
        block: Live,
        (devices, pools): (&mut Devices, &mut Pools),
        out: &mut Vec<Output>,
    ) {
        self.settle(Slot::Block(key), devices, pools, out);
        devices.remove_block(block.device, block.size);
        self.hold(Slot::Block(key), Displaced { retired: Retired::Block(block), reuse });
    }

    /// As [`Self::retire_block`], for a pool block at `ptr` of `reuse`'s process, already taken
    /// out of the pool's table but still in its totals.
    pub(super) fn retire_pool(
        &mut self,
        reuse: Site,
        ptr: u64,
        block: PoolBlock,
        (devices, pools): (&Devices, &mut Pools),
        out: &mut Vec<Output>,
    ) {
        let slot = Slot::Pool(reuse.pid, ptr);
        // Before the block leaves the totals: a row settled here reads them as they were.
        self.settle(slot, devices, pools, out);
        pools.uncount(reuse.pid, &block);
        self.hold(slot, Displaced { retired: Retired::Pool(block), reuse });
    }

    fn hold(&mut self, slot: Slot, d: Displaced) {
        self.order.push_back((d.reuse.wall_ns, slot));
        self.displaced.insert(slot, d);
    }

    /// The device a late free's block was on, if the tracer knew it.
    pub(super) fn late_free_device(&self, key: Key) -> Option<DeviceKey> {
        match self.displaced.get(&Slot::Block(key)) {
            Some(Displaced { retired: Retired::Block(b), .. }) => Some(b.device),
            _ => None,
        }
    }

    /// A late free's block, if the tracer knew it: its row is the free's, no longer a shadow.
    pub(super) fn take_block(&mut self, key: Key) -> Option<Live> {
        match self.displaced.remove(&Slot::Block(key)) {
            Some(Displaced { retired: Retired::Block(block), .. }) => Some(block),
            _ => None,
        }
    }

    /// As [`Self::take_block`], for a late pool free.
    pub(super) fn take_pool(&mut self, pid: u32, ptr: u64) -> Option<PoolBlock> {
        match self.displaced.remove(&Slot::Pool(pid, ptr)) {
            Some(Displaced { retired: Retired::Pool(block), .. }) => Some(block),
            _ => None,
        }
    }

    /// The displaced block at `slot`, if any, missed its free after all: its shadow row now.
    #[inline]
    pub(super) fn settle(&mut self, slot: Slot, devices: &Devices, pools: &mut Pools, out: &mut Vec<Output>) {
        // Every free asks; the table is almost always empty, and a lookup would hash the key.
        if self.displaced.is_empty() {
            return;
        }
        if let Some(d) = self.displaced.remove(&slot) {
            Self::shadow(slot, d, devices, pools, out);
        }
    }

    /// Settles the displaced blocks whose late free can no longer come at trace time `now`:
    /// those displaced more than [`REUSE_WAIT_NS`] ago (checked at every event, so from the
    /// oldest only), all of an exited process's, or all at the trace's end.
    #[inline]
    pub(super) fn settle_where(
        &mut self,
        which: Settle,
        now: u64,
        devices: &Devices,
        pools: &mut Pools,
        out: &mut Vec<Output>,
    ) {
        // Asked at every event; the table is almost always empty.
        if !self.displaced.is_empty() {
            self.settle_due(which, now, devices, pools, out);
        }
    }

    fn settle_due(&mut self, which: Settle, now: u64, devices: &Devices, pools: &mut Pools, out: &mut Vec<Output>) {
        let mut due = Vec::new();
        match which {
            Settle::Expired => {
                while let Some(&(at, slot)) = self.order.front() {
                    if at.saturating_add(REUSE_WAIT_NS) >= now {
                        break;
                    }
                    self.order.pop_front();
                    // Skip an entry already settled, or displaced again since.
                    if self.displaced.get(&slot).is_some_and(|d| d.reuse.wall_ns == at) {
                        due.push((at, slot));
                    }
                }
            }
            Settle::Process(exited) => {
                due.extend(self.displaced.iter().filter(|(k, _)| k.pid() == exited).map(|(&k, d)| (d.reuse.wall_ns, k)))
            }
            Settle::All => due.extend(self.displaced.iter().map(|(&k, d)| (d.reuse.wall_ns, k))),
        }
        // In the order they were displaced, so the rows keep time order among themselves.
        due.sort_unstable();
        for (_, slot) in due {
            self.settle(slot, devices, pools, out);
        }
        if self.displaced.is_empty() {
            self.order.clear();
        }
    }

    fn shadow(slot: Slot, d: Displaced, devices: &Devices, pools: &mut Pools, out: &mut Vec<Output>) {
        match (slot, d.retired) {
            (Slot::Block(key), Retired::Block(block)) if !block.hidden => {
                let used = devices.used(block.device);
                out.push(block.free_row(d.reuse, key, used, (true, false), None));
            }
            (Slot::Pool(_, ptr), Retired::Pool(block)) if !block.hidden => {
                out.push(pools.free_row(d.reuse, ptr, &block, (true, false)));
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;
    use crate::apis::Api;
    use crate::model::{Event, EventKind, Op, Pool, Tracker};

    /// `e` with its call's entry and return times set.
    fn timed(mut e: Event, entry: u64, ret: u64, tid: u32) -> Event {
        e.wall_ns = ret;
        e.tid = tid;
        if let EventKind::Call(c) = &mut e.kind {
            c.entry_wall_ns = entry;
        }
        e
    }

    fn frees(out: &[Output]) -> Vec<(DeviceKey, Option<u64>, Option<u64>, bool)> {
        out.iter()
            .filter_map(|o| match o {
                Output::Free { device, size, allocation_id, shadow, .. } => {
                    Some((*device, *size, *allocation_id, *shadow))
                }
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_free_that_returns_after_its_address_was_handed_out_again_is_the_old_blocks_real_free() {
        // Thread 1 frees 0x1000 (device 1) at 200..400; thread 2 takes it on device 0 at
        // 250..300, and its record comes first.
        let (t, out) = run(&[
            timed(malloc(Some(0x1000), 64, Some(1), 0), 90, 100, 1),
            timed(malloc(Some(0x1000), 32, Some(0), 0), 250, 300, 2),
            timed(free(0x1000, Some(1)), 200, 400, 1),
            timed(free(0x1000, Some(0)), 500, 600, 2),
        ]);
        let npu = DeviceKey::Npu;
        assert_eq!(
            frees(&out),
            [(npu(1), Some(64), Some(1), false), (npu(0), Some(32), Some(1), false)],
            "each free is its own block's, none shadow: {out:#?}"
        );
        // Device 1's total dropped at the reuse, not 100 ns later: no moment counts both.
        let used: Vec<_> = t.devices().map(|(d, s)| (d, s.used, s.peak, s.frees)).collect();
        assert_eq!(used, [(npu(0), 0, 32, 1), (npu(1), 0, 64, 1)]);
    }

    #[test]
    fn a_reused_address_whose_free_never_comes_gets_its_shadow_free_at_the_reuse_time() {
        let later = 300 + REUSE_WAIT_NS + 1;
        let (_, out) = run(&[
            timed(malloc(Some(0x1000), 64, Some(1), 0), 90, 100, 1),
            timed(malloc(Some(0x1000), 32, Some(0), 0), 250, 300, 2),
            timed(malloc(Some(0x2000), 8, Some(0), 0), later - 10, later, 2),
        ]);
        let shadow = out.iter().find_map(|o| match o {
            Output::Free { site, size: Some(64), shadow: true, .. } => Some(site.wall_ns),
            _ => None,
        });
        assert_eq!(shadow, Some(300), "{out:#?}");
    }

    #[test]
    fn the_next_free_of_the_address_settles_a_missed_free_first() {
        // The old block's free was missed; the new block's own free (called after it was handed
        // out) comes: the old block gets its shadow row first, then the new block its free.
        let (_, out) = run(&[
            timed(malloc(Some(0x1000), 64, Some(1), 0), 90, 100, 1),
            timed(malloc(Some(0x1000), 32, Some(0), 0), 250, 300, 2),
            timed(free(0x1000, Some(0)), 350, 400, 2),
        ]);
        let npu = DeviceKey::Npu;
        assert_eq!(frees(&out), [(npu(1), Some(64), Some(1), true), (npu(0), Some(32), Some(1), false)]);
    }

    #[test]
    fn a_late_free_of_a_block_never_seen_leaves_the_new_block_alone() {
        // 0x1000 was allocated before the attach; its free and the reuse race as above.
        let (t, out) =
            run(&[timed(malloc(Some(0x1000), 32, Some(0), 0), 250, 300, 2), timed(free(0x1000, Some(0)), 200, 400, 1)]);
        assert_eq!(frees(&out), [(DeviceKey::Npu(0), None, None, false)]);
        let stats: Vec<_> = t.devices().map(|(d, s)| (d, s.used, s.untracked_frees)).collect();
        assert_eq!(stats, [(DeviceKey::Npu(0), 32, 1)], "the new block stays live");
    }

    #[test]
    fn exit_and_the_end_settle_what_is_displaced() {
        let mut t = Tracker::new();
        let mut out = Vec::new();
        t.apply(timed(malloc(Some(0x1000), 64, Some(1), 0), 90, 100, 1), &mut out);
        t.apply(timed(malloc(Some(0x1000), 32, Some(0), 0), 250, 300, 2), &mut out);
        assert!(frees(&out).is_empty(), "the old block's row waits for a late free");
        t.finish(1_000, |o| {
            out.push(o);
            Ok::<_, ()>(())
        })
        .unwrap();
        let npu = DeviceKey::Npu;
        assert_eq!(frees(&out), [(npu(1), Some(64), Some(1), true), (npu(0), Some(32), Some(1), true)]);
    }

    fn pool_free(ptr: u64) -> Event {
        let op = Op::PoolFree { pool: Pool::Caching, ptr: Some(ptr), handle: None, size: None, device: Some(0) };
        call(Api::DeviceCachingAllocatorFree, 1, None, 0, op)
    }

    fn pool_frees(out: &[Output]) -> Vec<(Option<u64>, bool, u64)> {
        out.iter()
            .filter_map(|o| match o {
                Output::PoolFree { size, shadow, used, .. } => Some((*size, *shadow, *used)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_pool_free_that_returns_after_its_block_was_handed_out_again_is_the_old_blocks_free() {
        // The caching allocator's lock serializes the calls, not their returns: thread 1's free
        // (200..400) unlocks, thread 2's malloc (250..300) takes the block, and returns first.
        let (t, out) = run(&[
            timed(pool_malloc(0x1000, 64, 0), 90, 100, 1),
            timed(pool_malloc(0x1000, 32, 0), 250, 300, 2),
            timed(pool_free(0x1000), 200, 400, 1),
        ]);
        assert_eq!(pool_frees(&out), [(Some(64), false, 32)], "the old block's real free: {out:#?}");
        let pool = t.pools().next().unwrap().1;
        assert_eq!(
            (pool.used, pool.live_blocks, pool.peak_used),
            (32, 1, 64),
            "the new block stays live, and no moment held both"
        );
    }

    #[test]
    fn a_missed_pool_free_gets_its_shadow_row_at_the_reuse_and_the_next_free_settles_it() {
        let (_, out) = run(&[
            timed(pool_malloc(0x1000, 64, 0), 90, 100, 1),
            timed(pool_malloc(0x1000, 32, 0), 250, 300, 2),
            timed(pool_free(0x1000), 350, 400, 2),
        ]);
        assert_eq!(pool_frees(&out), [(Some(64), true, 32), (Some(32), false, 0)]);
        let shadow_time = out.iter().find_map(|o| match o {
            Output::PoolFree { site, shadow: true, .. } => Some(site.wall_ns),
            _ => None,
        });
        assert_eq!(shadow_time, Some(300), "timed at the reuse");
        let later = 300 + REUSE_WAIT_NS + 1;
        let (_, out) = run(&[
            timed(pool_malloc(0x1000, 64, 0), 90, 100, 1),
            timed(pool_malloc(0x1000, 32, 0), 250, 300, 2),
            timed(pool_malloc(0x2000, 8, 0), later - 10, later, 2),
        ]);
        assert_eq!(pool_frees(&out), [(Some(64), true, 32)], "settled once no late free can come");
    }

    #[test]
    fn a_late_pool_free_of_a_block_never_seen_leaves_the_new_block_alone() {
        let (t, out) = run(&[timed(pool_malloc(0x1000, 32, 0), 250, 300, 2), timed(pool_free(0x1000), 200, 400, 1)]);
        assert_eq!(pool_frees(&out), [(None, false, 32)]);
        let pool = t.pools().next().unwrap().1;
        assert_eq!((pool.used, pool.live_blocks), (32, 1));
    }
}
