//! The end of one of the daemon's windows: the probes of the sampled APIs ([`Api::sampled`])
//! are attached only part of the time, and once they are gone the frees of the blocks born in
//! the window can no longer be seen. The blocks still live then are forgotten: each gets a FREE
//! marked `implied` (its fate is unknown, not a leak), and the totals drop them, so that the
//! pool's and the CPU's live bytes are those of the window's blocks, never of blocks whose free
//! went unseen.

use super::output::Site;
use super::route_blocks::BlockFree;
use super::route_pools::PoolBlockFree;
use super::tracker::Tracker;
use super::Output;
use crate::apis::Api;

impl Tracker {
    /// Live blocks of the sampled APIs, all processes together.
    pub fn sampled_blocks(&self) -> usize {
        let pool = self.pools.table().values().filter(|b| b.api.sampled()).count();
        pool + self.blocks.table().values().filter(|b| b.api.sampled()).count()
    }

    /// Forgets every live block of the sampled APIs at `wall_ns`, appending their implied
    /// FREEs to `out`. Returns how many were forgotten.
    pub fn forget_sampled(&mut self, wall_ns: u64, out: &mut Vec<Output>) -> usize {
        let at = wall_ns.max(self.last_wall_ns);
        let pool: Vec<(u32, u64, Api, _, _)> = self
            .pools
            .table()
            .iter()
            .filter(|(_, b)| b.api.sampled())
            .map(|(&(pid, ptr), b)| (pid, ptr, b.api, b.pool, b.device))
            .collect();
        let blocks: Vec<_> = self
            .blocks
            .table()
            .iter()
            .filter(|(_, b)| b.api.sampled())
            .map(|(&(pid, space, ptr), b)| (pid, space, ptr, b.api, b.device))
            .collect();
        for &(pid, ptr, api, pool, fallback) in &pool {
            let free = PoolBlockFree { ptr, pool, fallback, shadow: false, implied: true, entry_ns: 0 };
            self.remove_pool_block(Site::of(api, at, pid, pid), free, out);
        }
        for &(pid, space, ptr, api, fallback) in &blocks {
            let free = BlockFree { space, ptr, fallback, shadow: false, implied: true, driver: None };
            self.remove_block(Site::of(api, at, pid, pid), free, out);
        }
        pool.len() + blocks.len()
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;
    use crate::model::{DeviceKey, Op, Pool, Space};

    #[test]
    fn forgetting_drops_the_sampled_blocks_alone_with_implied_frees() {
        let mut t = Tracker::new();
        let mut out = Vec::new();
        // A device block (always probed), a pool block and a CPU tensor (sampled).
        t.apply(malloc(Some(0x10), 4096, Some(0), 0), &mut out);
        t.apply(pool_malloc(0x20, 512, 0), &mut out);
        let (policy, device, module, driver) = (None, None, None, None);
        let cpu = Op::Malloc { space: Space::Cpu, size: 64, ptr: Some(0x30), policy, device, module, driver };
        t.apply(call(Api::C10AllocCpu, 1, None, 0, cpu), &mut out);
        out.clear();
        assert_eq!(t.sampled_blocks(), 2);
        assert_eq!(t.forget_sampled(100, &mut out), 2);
        assert_eq!(t.sampled_blocks(), 0);
        let implied: Vec<_> = out
            .iter()
            .filter_map(|o| match o {
                Output::PoolFree { ptr, implied: true, shadow: false, size: Some(_), .. } => Some(*ptr),
                Output::Free { ptr, implied: true, shadow: false, size: Some(_), .. } => Some(*ptr),
                _ => None,
            })
            .collect();
        assert_eq!(implied, [0x20, 0x30], "{out:?}");
        let used = |d| t.devices().find(|(k, _)| *k == d).map(|(_, s)| s.used);
        assert_eq!(used(DeviceKey::Npu(0)), Some(4096), "the device block stays");
        assert_eq!(t.pools().map(|(k, s)| (k.1, s.used)).collect::<Vec<_>>(), [(Pool::Caching, 0)]);
    }
}
