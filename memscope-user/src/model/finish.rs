//! The stop's shadow frees: every block still alive when the trace ends gets a FREE one
//! nanosecond after the last event (msMemScope writes them so that every MALLOC has a FREE),
//! marked `shadow`, in allocation order per device (per device and pool for pool blocks).

use std::collections::BTreeMap;

use super::blocks::Live;
use super::event::{DeviceKey, Pool, Space};
use super::output::{Output, Site};
use super::pools::PoolBlock;
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
        held.into_iter().try_for_each(&mut emit)?;
        let at = wall_ns.max(self.last_wall_ns) + 1;
        // By reference: at stop a million live blocks are common, and the DB waits for this.
        let mut live: Vec<(&(u32, Space, u64), &Live)> = self.blocks.iter().collect();
        live.sort_unstable_by_key(|(_, b)| (b.device, b.allocation_id));
        let mut used: BTreeMap<DeviceKey, u64> = self.devices.iter().map(|(k, v)| (*k, v.used)).collect();
        for (&(pid, space, ptr), block) in live {
            let remaining = used.entry(block.device).or_default();
            *remaining -= block.size;
            if block.hidden {
                continue;
            }
            emit(Output::Free {
                site: Site { api: block.api, wall_ns: at, pid, tid: pid, gc: false },
                device: block.device,
                space,
                ptr,
                size: Some(block.size),
                allocation_id: Some(block.allocation_id),
                used: *remaining,
                shadow: true,
                driver: None,
            })?;
        }
        let mut live: Vec<(&(u32, u64), &PoolBlock)> = self.pool_blocks.iter().collect();
        live.sort_unstable_by_key(|(_, b)| (b.device, b.pool, b.allocation_id));
        let mut used: BTreeMap<(DeviceKey, Pool, u32), u64> = self.pools.iter().map(|(k, v)| (*k, v.used)).collect();
        for (&(pid, ptr), block) in live {
            let remaining = used.entry((block.device, block.pool, pid)).or_default();
            *remaining -= block.size;
            if block.hidden {
                continue;
            }
            let total = self.pools.get(&(block.device, block.pool, pid)).map_or(0, |s| s.total);
            emit(Output::PoolFree {
                site: Site { api: block.api, wall_ns: at, pid, tid: pid, gc: false },
                device: block.device,
                pool: block.pool,
                ptr,
                size: Some(block.size),
                allocation_id: Some(block.allocation_id),
                used: *remaining,
                total,
                shadow: true,
                implied: false,
                stream_uses: 0,
            })?;
        }
        Ok(())
    }
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
}
