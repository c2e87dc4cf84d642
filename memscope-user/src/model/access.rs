//! Uses of blocks: copies and sets name the addresses they touch, a kernel launch names the
//! blocks in its argument buffer. Each becomes an ACCESS of the live block that holds the
//! address (a pool block if one does, else the device or host block), as msMemScope records
//! them for its inefficiency analyses; addresses in no known block (host buffers, memory from
//! before the attach) are not accesses of anything we track.

use std::collections::HashSet;

use super::event::{Call, DeviceKey, Pool, Space};
use super::tracker::{AccessKind, Live, Output, PoolBlock, Site, Tracker};

/// A live block found by address.
pub(super) struct Hit {
    pub(super) device: DeviceKey,
    pub(super) block_type: &'static str,
    pub(super) block: u64,
    pub(super) allocation_id: u64,
    pub(super) pool: Option<Pool>,
}

impl Hit {
    /// The ACCESS row of a use of this block at `addr`.
    fn row(&self, site: Site, addr: u64, size: Option<u64>, kind: AccessKind) -> Output {
        Output::Access {
            site,
            device: self.device,
            block_type: self.block_type,
            block: self.block,
            allocation_id: self.allocation_id,
            pool: self.pool,
            addr,
            size,
            kind,
        }
    }
}

impl Tracker {
    pub(super) fn block_at(&self, pid: u32, addr: u64) -> Option<Hit> {
        if let Some((&(_, start), b)) = self.pool_block_at(pid, addr) {
            if b.hidden {
                return None;
            }
            let (device, pool) = (b.device, Some(b.pool));
            return Some(Hit { device, block_type: "PTA", block: start, allocation_id: b.allocation_id, pool });
        }
        let (&(_, space, start), b) = self.device_block_at(pid, addr)?;
        if b.hidden {
            return None;
        }
        Some(Hit {
            device: b.device,
            block_type: space.event_type(),
            block: start,
            allocation_id: b.allocation_id,
            pool: None,
        })
    }

    /// The live pool block whose range holds `addr`.
    pub(super) fn pool_block_at(&self, pid: u32, addr: u64) -> Option<(&(u32, u64), &PoolBlock)> {
        self.pool_blocks
            .range((pid, 0)..=(pid, addr))
            .next_back()
            .filter(|(&(_, start), b)| addr < start.saturating_add(b.size))
    }

    /// The live device or host block whose range holds `addr` (of the spaces, the one that
    /// starts nearest below it).
    pub(super) fn device_block_at(&self, pid: u32, addr: u64) -> Option<(&(u32, Space, u64), &Live)> {
        [Space::Device, Space::Host, Space::Cpu]
            .into_iter()
            .filter_map(|space| {
                self.blocks
                    .range((pid, space, 0)..=(pid, space, addr))
                    .next_back()
                    .filter(|(&(_, _, start), b)| addr < start.saturating_add(b.size))
            })
            .max_by_key(|(&(_, _, start), _)| start)
    }

    pub(super) fn access(
        &mut self,
        site: Site,
        call: &Call,
        addr: u64,
        size: Option<u64>,
        kind: AccessKind,
        out: &mut Vec<Output>,
    ) {
        if call.status != 0 || addr == 0 || self.is_paused(site.pid) {
            return;
        }
        if let Some(hit) = self.block_at(site.pid, addr) {
            out.push(hit.row(site, addr, size, kind));
        }
    }

    /// One KERNEL_LAUNCH row, then one ACCESS per distinct block its arguments name.
    #[allow(clippy::too_many_arguments, reason = "the launch's own facts")]
    pub(super) fn launch(
        &mut self,
        site: Site,
        call: &Call,
        function: u64,
        args: &[u8],
        args_size: u64,
        stream: u64,
        out: &mut Vec<Output>,
    ) {
        if self.is_paused(site.pid) {
            return;
        }
        let device = self.thread_device(site, call);
        let name = self.kernel_names.get(&(site.pid, function)).cloned();
        out.push(Output::KernelLaunch { site, device, name, function, stream, args_size });
        if call.status != 0 {
            return;
        }
        let mut seen = HashSet::new();
        for word in args.chunks_exact(8) {
            let addr = u64::from_le_bytes(word.try_into().expect("8 bytes"));
            if addr == 0 {
                continue;
            }
            if let Some(hit) = self.block_at(site.pid, addr) {
                if seen.insert((hit.block_type, hit.block)) {
                    out.push(hit.row(site, addr, None, AccessKind::Unknown));
                }
            }
        }
    }
}
