//! Uses of blocks: copies and sets name the addresses they touch, a kernel launch names the
//! blocks in its argument buffer. Each becomes an ACCESS of the live block that holds the
//! address (a pool block if one does, else the device or host block), as msMemScope records
//! them for its inefficiency analyses; addresses in no known block (host buffers, memory from
//! before the attach) are not accesses of anything we track.

use std::collections::HashSet;

use super::event::{Call, DeviceKey, Pool};
use super::tracker::{AccessKind, Output, Site, Tracker};

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
        if let Some((&(_, start), _)) =
            self.pool_index.range((pid, 0)..=(pid, addr)).next_back().filter(|(_, end)| addr < **end)
        {
            let b = self.pool_blocks.get(&(pid, start))?;
            if b.hidden {
                return None;
            }
            let (device, pool) = (b.device, Some(b.pool));
            return Some(Hit { device, block_type: "PTA", block: start, allocation_id: b.allocation_id, pool });
        }
        let (&(_, start), &(space, _)) =
            self.block_index.range((pid, 0)..=(pid, addr)).next_back().filter(|(_, (_, end))| addr < *end)?;
        let b = self.blocks.get(&(pid, space, start))?;
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
