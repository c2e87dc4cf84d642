//! The virtual-memory calls, which reach past `vmm`'s own tables: a mapping is a block (in
//! `blocks`, on the device of its physical handle) and, made inside a traced allocator call, a
//! pool's segment (in `pools`); a failed call is counted on its device.

use super::event::{Call, DeviceKey, Op, Space};
use super::output::{Origin, Output, Site, VmmStep};
use super::route_blocks::{BlockFree, NewBlock};
use super::tracker::{Failure, Tracker};

impl Tracker {
    /// The device of a physical handle, else the thread's (then `false`: a guess).
    fn physical_device(&self, site: Site, call: &Call, handle: u64) -> (DeviceKey, bool) {
        match self.vmm.physical_device(site.pid, handle) {
            Some(device) => (device, true),
            None => (self.devices.thread_device(site, call), false),
        }
    }

    /// One call of the virtual-memory family.
    pub(super) fn apply_vmm(&mut self, site: Site, call: &Call, out: &mut Vec<Output>) {
        let failed = call.status != 0;
        match call.op {
            Op::Reserve { size, va, .. } => {
                let device = self.devices.thread_device(site, call);
                match va {
                    Some(va) if !failed => {
                        self.vmm.reserve(site.pid, va, device, size);
                        let step = VmmStep::Reserve;
                        let (addr, size, driver) = (va, Some(size), None);
                        out.push(Output::Vmm { site, device, step, addr, size, driver, unmatched: false });
                    }
                    _ => self.fail(site, call, Failure { device, size: Some(size), ptr: None, driver: None }, out),
                }
            }
            Op::Release { va } => {
                let (device, size, unmatched) = match self.vmm.reservation(site.pid, va) {
                    Some((device, size)) => (device, Some(size), false),
                    None => (self.devices.thread_device(site, call), None, true),
                };
                if failed {
                    self.fail(site, call, Failure { device, size: None, ptr: Some(va), driver: None }, out);
                } else {
                    self.vmm.release(site.pid, va);
                    let step = VmmStep::Release;
                    out.push(Output::Vmm { site, device, step, addr: va, size, driver: None, unmatched });
                }
            }
            Op::MallocPhysical { size, handle, device, driver, .. } => {
                let device = device.map_or_else(|| self.devices.thread_device(site, call), DeviceKey::Npu);
                match handle {
                    Some(handle) if !failed => {
                        self.vmm.add_physical(site.pid, handle, device, (driver.and_then(|d| d.module), site.caller));
                        let step = VmmStep::MallocPhysical;
                        let size = Some(size);
                        out.push(Output::Vmm { site, device, step, addr: handle, size, driver, unmatched: false });
                    }
                    _ => self.fail(site, call, Failure { device, size: Some(size), ptr: None, driver }, out),
                }
            }
            Op::FreePhysical { handle, driver } => {
                let (device, known) = self.physical_device(site, call, handle);
                if failed {
                    self.fail(site, call, Failure { device, size: None, ptr: Some(handle), driver }, out);
                } else {
                    self.vmm.free_physical(site.pid, handle);
                    let step = VmmStep::FreePhysical;
                    let unmatched = !known;
                    out.push(Output::Vmm { site, device, step, addr: handle, size: None, driver, unmatched });
                }
            }
            Op::Map { va, size, offset, handle, .. } => {
                let (device, _) = self.physical_device(site, call, handle);
                if failed {
                    self.fail(site, call, Failure { device, size: Some(size), ptr: Some(va), driver: None }, out);
                } else {
                    let origin = Origin::Mapped { handle, offset };
                    self.add_block(
                        site,
                        NewBlock { device, space: Space::Device, ptr: va, sizes: (size, size), origin },
                        out,
                    );
                    self.pools.add_segment(site.pid, va, device, size, call.outer, out);
                }
            }
            Op::Unmap { va } => {
                let fallback = self.devices.thread_device(site, call);
                if failed {
                    self.fail(site, call, Failure { device: fallback, size: None, ptr: Some(va), driver: None }, out);
                } else {
                    self.remove_block(
                        site,
                        BlockFree {
                            space: Space::Device,
                            ptr: va,
                            fallback,
                            shadow: false,
                            implied: false,
                            driver: None,
                        },
                        out,
                    );
                    self.pools.remove_segment(site.pid, va);
                }
            }
            _ => {}
        }
    }
}
