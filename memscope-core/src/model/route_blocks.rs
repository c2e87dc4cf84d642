//! The rules of a device or host block's life, which take more than one part of the state: an
//! allocation adds a block (`blocks`), counts it on its device (`devices`), may retire the stale
//! block at its address (`reuse`) and may be a pool's segment (`pools`); a free undoes that, or
//! is a late free of a retired block, or of one the trace never saw.
//!
//! - A block counts from its successful allocation to its successful free; a failed call is an
//!   [`Output::Failed`], never a block (so it is no leak).
//! - An address handed out again while still live: the stale block is retired, and its FREE row
//!   waits for a free still on its way from another thread (see `reuse`).
//! - A free of an address never seen allocated is counted apart (`untracked_frees`), without
//!   size or id.
//! - Owners: the allocator's label (the driver module, host) and the thread's open tag spans at
//!   the allocation, else the rules' reading of its Python stack (`route_owner`); an address tag
//!   later replaces one level (see `marks`), and a block with an inferred owner that is freed
//!   before its phase ended takes its rule's temporary owner at the free (see `inferred`).

use super::event::{Call, DeviceKey, DriverInfo, Op, Space};
use super::keys::{Key, Live, Slot};
use super::output::{Origin, Output, OwnerBy, Site};
use super::owners::OwnerBase;
use super::route_owner::NewOwner;
use super::tags;
use super::tracker::{Failure, Tracker};
use crate::apis::{Backend, Family};

/// Where memory of `space` is counted: host memory on the host, device memory on `device`.
fn space_device(space: Space, device: DeviceKey) -> DeviceKey {
    match space {
        Space::Host | Space::Cpu | Space::Registered => DeviceKey::Cpu,
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
    /// Not seen, but known to have been missed: the daemon's window closed (`window`).
    pub(super) implied: bool,
    pub(super) driver: Option<DriverInfo>,
}

impl Tracker {
    /// A malloc-style call (`Op::Malloc`).
    pub(super) fn apply_malloc(&mut self, site: Site, call: &Call, out: &mut Vec<Output>) {
        let Op::Malloc { space, size, ptr, policy, device, module, driver } = call.op else { return };
        let device = space_device(space, device.map_or_else(|| self.devices.thread_device(site, call), DeviceKey::Npu));
        match ptr {
            // A zero-size request answered with no memory and no error (torch's `alloc_cpu(0)`,
            // `cudaMalloc(&p, 0)`) took nothing: no block, and no failure either.
            None | Some(0) if size == 0 && call.status == 0 => {}
            Some(ptr) if call.status == 0 => {
                let taken = driver.map_or(size, |d| d.size);
                let origin = Origin::Direct { policy, module, driver };
                self.add_block(site, NewBlock { device, space, ptr, sizes: (taken, size), origin }, out);
                self.pools.add_segment(site.pid, ptr, device, size, call.outer, out);
            }
            _ => self.fail(site, call, Failure { device, size: Some(size), ptr: None, driver }, out),
        }
    }

    /// A free-style call (`Op::Free`).
    pub(super) fn apply_free(&mut self, site: Site, call: &Call, out: &mut Vec<Output>) {
        let Op::Free { space, ptr, driver } = call.op else { return };
        let fallback = space_device(space, self.devices.thread_device(site, call));
        let key = (site.pid, space, ptr);
        let late = self.blocks.is_late_free(&key, call.entry_wall_ns);
        if call.status != 0 {
            let device = if late { self.reuse.late_free_device(key) } else { self.blocks.get(&key).map(|b| b.device) };
            let device = device.unwrap_or(fallback);
            self.fail(site, call, Failure { device, size: None, ptr: Some(ptr), driver }, out);
        } else if late {
            // The block now at the address (and its segment) is not this free's.
            self.late_free(site, key, (fallback, driver), out);
        } else {
            self.settle_displaced(Slot::Block(key), out);
            self.remove_block(site, BlockFree { space, ptr, fallback, shadow: false, implied: false, driver }, out);
            self.pools.remove_segment(site.pid, ptr);
        }
    }

    pub(super) fn add_block(&mut self, site: Site, block: NewBlock, out: &mut Vec<Output>) {
        let NewBlock { device, space, ptr, sizes: (size, req_size), origin } = block;
        let family = site.api.family();
        // A library that called for the memory itself names its owner under the allocator's
        // root; mapped pages are their physical memory's creator's.
        let device_base = |module: Option<u16>| match family.backend() {
            Some(Backend::Cuda) => OwnerBase::Cuda { driver: family == Family::CudaDriver },
            _ => OwnerBase::Hal(module),
        };
        let base = match (space, origin) {
            (Space::Host | Space::Cpu | Space::Registered, _) => OwnerBase::Host.called_by(site.caller),
            (Space::Device, Origin::Direct { module, driver, .. }) => {
                device_base(driver.and_then(|d| d.module).or(module)).called_by(site.caller)
            }
            (Space::Device, Origin::Mapped { handle, .. }) => {
                let (module, lib) = self.vmm.physical_creator(site.pid, handle);
                device_base(module).called_by(lib)
            }
        };
        let NewOwner { labels, from } = self.new_owner(site);
        let hidden = self.is_paused(site.pid);
        let owner = (!hidden).then(|| self.owners.get(base, &labels));
        let key = (site.pid, space, ptr);
        let (allocation_id, used) = self.blocks.insert_with(key, |stale| {
            if let Some(stale) = stale {
                // The runtime handed out an address we still consider live: retire the stale
                // block first so the totals stay true to what the runtime says is allocated.
                self.reuse.retire_block(site, key, stale, (&mut self.devices, &mut self.pools), out);
            }
            let (allocation_id, used) = self.devices.add_block(device, size);
            let born_ns = site.wall_ns;
            let live = Live { device, size, allocation_id, api: site.api, base, labels, hidden, born_ns };
            (live, (allocation_id, used))
        });
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
                from,
            });
        }
    }

    pub(super) fn remove_block(&mut self, site: Site, free: BlockFree, out: &mut Vec<Output>) {
        let BlockFree { space, ptr, fallback, shadow, implied, driver } = free;
        let key = (site.pid, space, ptr);
        let Some(block) = self.blocks.remove(&key) else {
            return self.untracked_free(site, key, fallback, driver, out);
        };
        let used = self.devices.remove_block(block.device, block.size);
        if block.hidden {
            return;
        }
        if let Some(temporary) = self.inference.temporary(site.pid, &block.labels, block.born_ns).filter(|_| !shadow) {
            let owner = block.base.owner(tags::of(temporary));
            let (device, event_type, by) = (block.device, space.event_type(), OwnerBy::Inferred);
            out.push(Output::Retag { device, pid: site.pid, event_type, ptr, owner, by });
        }
        out.push(block.free_row(site, key, used, (shadow, implied), driver));
    }

    /// A free of an address the trace never saw allocated: counted on `fallback`, no size or id.
    fn untracked_free(
        &mut self,
        site: Site,
        (_, space, ptr): Key,
        fallback: DeviceKey,
        driver: Option<DriverInfo>,
        out: &mut Vec<Output>,
    ) {
        let used = self.devices.untracked_free(fallback);
        if self.is_paused(site.pid) {
            return;
        }
        let (size, allocation_id, shadow, implied) = (None, None, false, false);
        out.push(Output::Free {
            site,
            device: fallback,
            space,
            ptr,
            size,
            allocation_id,
            used,
            shadow,
            implied,
            driver,
        });
    }

    /// Writes a late free: the displaced block's real FREE row, else an untracked free.
    fn late_free(
        &mut self,
        site: Site,
        key: Key,
        (fallback, driver): (DeviceKey, Option<DriverInfo>),
        out: &mut Vec<Output>,
    ) {
        let Some(block) = self.reuse.take_block(key) else {
            return self.untracked_free(site, key, fallback, driver, out);
        };
        if !block.hidden {
            let used = self.devices.used(block.device);
            out.push(block.free_row(site, key, used, (false, false), driver));
        }
    }
}
