//! Uses of blocks: copies and sets name the addresses they touch, a kernel launch names the
//! blocks in its argument buffer. Each becomes an ACCESS of the live block that holds the
//! address (a pool block if one does, else the device or host block), as msMemScope records
//! them for its inefficiency analyses; addresses in no known block (host buffers, memory from
//! before the attach) are not accesses of anything we track.

use std::collections::HashSet;

use super::event::{Call, DeviceKey, Op, Pool};
use super::output::{AccessKind, Output, Site};
use super::tracker::Tracker;
use crate::vocab::EventType;

/// A live block found by address.
pub(super) struct Hit {
    pub(super) device: DeviceKey,
    pub(super) block_type: EventType,
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

/// A kernel launch: its function handle and the argument bytes it names blocks in.
pub(super) struct Launch<'a> {
    pub(super) function: u64,
    pub(super) args: &'a [u8],
    pub(super) args_size: u64,
    pub(super) stream: u64,
}

impl Tracker {
    pub(super) fn block_at(&self, pid: u32, addr: u64) -> Option<Hit> {
        if let Some((&(_, start), b)) = self.pools.at(pid, addr) {
            if b.hidden {
                return None;
            }
            let (device, pool) = (b.device, Some(b.pool));
            return Some(Hit {
                device,
                block_type: EventType::Pta,
                block: start,
                allocation_id: b.allocation_id,
                pool,
            });
        }
        let (&(_, space, start), b) = self.blocks.at(pid, addr)?;
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

    /// A call that uses memory: a copy, a set, a kernel launch, or one of the calls that name a
    /// kernel or build its argument list for a later launch.
    pub(super) fn apply_use(&mut self, site: Site, call: &Call, out: &mut Vec<Output>) {
        let failed = call.status != 0;
        match call.op {
            Op::Copy { dst, src, size } => {
                self.access(site, call, src, Some(size), AccessKind::Read, out);
                self.access(site, call, dst, Some(size), AccessKind::Write, out);
            }
            Op::Set { ptr, size } => self.access(site, call, ptr, Some(size), AccessKind::Write, out),
            Op::Launch { function, ref args, args_size, stream } => {
                self.launch(site, call, Launch { function, args, args_size, stream }, out);
            }
            Op::KernelName { function: Some(function), name: Some(ref name) } => {
                self.kernel_names.insert((site.pid, function), name.clone());
            }
            Op::KernelArgs { handle, append: None } if !failed => {
                self.kernel_args.insert((site.pid, handle), Vec::new());
            }
            Op::KernelArgs { handle, append: Some(ref bytes) } if !failed => {
                let list = self.kernel_args.entry((site.pid, handle)).or_default();
                // A launch copies at most this much of a plain argument buffer; the same bound here.
                let room = memscope_common::record::BLOB_LEN.saturating_sub(list.len());
                list.extend_from_slice(&bytes[..bytes.len().min(room)]);
            }
            Op::LaunchArgs { function, handle, stream } => {
                // Taken, not kept: a list is built for one launch, and the runtime reports no end of
                // a handle, so keeping them would grow with every launch of a long job.
                let args = self.kernel_args.remove(&(site.pid, handle)).unwrap_or_default();
                let size = args.len() as u64;
                self.launch(site, call, Launch { function, args: &args, args_size: size, stream }, out);
            }
            _ => {}
        }
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
    pub(super) fn launch(&mut self, site: Site, call: &Call, launch: Launch<'_>, out: &mut Vec<Output>) {
        let Launch { function, args, args_size, stream } = launch;
        if self.is_paused(site.pid) {
            return;
        }
        let device = self.devices.thread_device(site, call);
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

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;
    use crate::apis::Api;
    use crate::model::Space;

    #[test]
    fn a_handle_launch_uses_the_parameters_appended_to_its_handle() {
        let args = |handle, append| call(Api::AclrtKernelArgsAppend, 1, Some(0), 0, Op::KernelArgs { handle, append });
        let word = |v: u64| Some(v.to_le_bytes().to_vec());
        let launch = |handle| {
            call(Api::AclrtLaunchKernelWithConfig, 1, Some(0), 0, Op::LaunchArgs { function: 9, handle, stream: 3 })
        };
        let (_, out) = run(&[
            malloc(Some(0x1000), 64, Some(0), 0),
            malloc(Some(0x2000), 64, Some(0), 0),
            args(7, None),
            args(7, word(0x1010)),
            args(8, word(0x2000)), // another handle's list
            args(7, word(5)),
            launch(7),
            launch(7), // the list was taken by the first launch
        ]);
        let accessed: Vec<u64> = out
            .iter()
            .filter_map(|o| match o {
                Output::Access { block, .. } => Some(*block),
                _ => None,
            })
            .collect();
        assert_eq!(accessed, [0x1000], "only the block named on handle 7, once");
        let sizes: Vec<u64> = out
            .iter()
            .filter_map(|o| match o {
                Output::KernelLaunch { args_size, .. } => Some(*args_size),
                _ => None,
            })
            .collect();
        assert_eq!(sizes, [16, 0]);
    }

    #[test]
    fn accesses_and_oom_listings_carry_the_id_of_the_block_they_name() {
        let copy = call(Api::AclrtMemcpy, 1, Some(0), 0, Op::Copy { dst: 0x10_0010, src: 0x90_0000, size: 16 });
        let oom = call(
            Api::AclrtMalloc,
            1,
            Some(0),
            207_001,
            Op::Malloc {
                space: Space::Device,
                size: 1 << 40,
                ptr: None,
                policy: None,
                device: None,
                module: None,
                driver: None,
            },
        );
        let (_, out) = run(&[
            with_outer(malloc(Some(0x10_0000), 2 << 20, Some(0), 0), Api::DeviceCachingAllocatorMalloc),
            pool_malloc(0x10_0000, 4096, 0),
            malloc(Some(0x90_0000), 512, Some(0), 0),
            copy,
            oom,
        ]);
        let id_of = |ptr: u64, kind: &str| {
            ids(&out)
                .into_iter()
                .zip(out.iter().filter(|o| matches!(o, Output::Malloc { .. } | Output::PoolMalloc { .. })))
                .find(|((_, _, what), o)| {
                    *what == kind
                        && matches!(o, Output::Malloc { ptr: p, .. } | Output::PoolMalloc { ptr: p, .. } if *p == ptr)
                })
                .map(|((_, id, _), _)| id)
                .unwrap()
        };
        let (pta, hal) = (id_of(0x10_0000, "PTA"), id_of(0x90_0000, "HAL"));
        assert_ne!(pta, id_of(0x10_0000, "HAL"), "a segment and its first block are two blocks");
        let accessed: Vec<(u64, u64)> = out
            .iter()
            .filter_map(|o| match o {
                Output::Access { block, allocation_id, .. } => Some((*block, *allocation_id)),
                _ => None,
            })
            .collect();
        assert_eq!(
            accessed,
            [(0x90_0000, hal), (0x10_0000, pta)],
            "read from the HAL block, written into the PTA block"
        );
        let listed: Vec<(u64, u64)> = out
            .iter()
            .filter_map(|o| match o {
                Output::OomBlock { ptr, allocation_id, recent: true, .. } => Some((*ptr, *allocation_id)),
                _ => None,
            })
            .collect();
        assert_eq!(listed, [(0x90_0000, hal), (0x10_0000, id_of(0x10_0000, "HAL"))]);
    }
}
