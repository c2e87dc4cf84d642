//! Virtual memory (expandable segments): reserved address ranges, physical handles, and the
//! mappings between them.
//!
//! A reserved range is address space, not memory; a physical handle is memory that becomes a
//! block when mapped. A mapping therefore counts as one block (in `blocks`) from map to unmap,
//! on the device of its physical handle and owned by the module that created the handle, so a
//! device's "used" equals what is mapped. Reserves, releases and physical allocations are rows
//! of their own ([`Output::Vmm`]), never blocks.

use super::blocks::{BlockFree, NewBlock};
use super::event::{Call, DeviceKey, Op, Space};
use super::output::{Origin, Output, Site, VmmStep};
use super::tracker::{Failure, Tracker};

/// A physical memory handle, until it is freed.
#[derive(Clone, Copy, Debug)]
pub(super) struct Physical {
    device: DeviceKey,
    /// The CANN module that created it (`halMemCreate`'s flag), the owner of its mappings.
    module: Option<u16>,
}

impl Tracker {
    /// The module that created a physical handle, if it was seen.
    pub(super) fn physical_module(&self, pid: u32, handle: u64) -> Option<u16> {
        self.physical.get(&(pid, handle)).and_then(|p| p.module)
    }

    /// The device of a physical handle, else the thread's.
    fn physical_device(&self, site: Site, call: &Call, handle: u64) -> DeviceKey {
        self.physical.get(&(site.pid, handle)).map_or_else(|| self.thread_device(site, call), |p| p.device)
    }

    /// One call of the virtual-memory family.
    pub(super) fn apply_vmm(&mut self, site: Site, call: &Call, out: &mut Vec<Output>) {
        let failed = call.status != 0;
        match call.op {
            Op::Reserve { size, va, .. } => {
                let device = self.thread_device(site, call);
                match va {
                    Some(va) if !failed => {
                        self.reserved.insert((site.pid, va), (device, size));
                        let step = VmmStep::Reserve;
                        out.push(Output::Vmm { site, device, step, addr: va, size: Some(size), driver: None });
                    }
                    _ => self.fail(site, call, Failure { device, size: Some(size), ptr: None, driver: None }, out),
                }
            }
            Op::Release { va } => {
                let (device, size) = match self.reserved.get(&(site.pid, va)) {
                    Some(&(device, size)) => (device, Some(size)),
                    None => (self.thread_device(site, call), None),
                };
                if failed {
                    self.fail(site, call, Failure { device, size: None, ptr: Some(va), driver: None }, out);
                } else {
                    self.reserved.remove(&(site.pid, va));
                    out.push(Output::Vmm { site, device, step: VmmStep::Release, addr: va, size, driver: None });
                }
            }
            Op::MallocPhysical { size, handle, device, driver, .. } => {
                let device = device.map_or_else(|| self.thread_device(site, call), DeviceKey::Npu);
                match handle {
                    Some(handle) if !failed => {
                        let module = driver.and_then(|d| d.module);
                        self.physical.insert((site.pid, handle), Physical { device, module });
                        let step = VmmStep::MallocPhysical;
                        out.push(Output::Vmm { site, device, step, addr: handle, size: Some(size), driver });
                    }
                    _ => self.fail(site, call, Failure { device, size: Some(size), ptr: None, driver }, out),
                }
            }
            Op::FreePhysical { handle, driver } => {
                let device = self.physical_device(site, call, handle);
                if failed {
                    self.fail(site, call, Failure { device, size: None, ptr: Some(handle), driver }, out);
                } else {
                    self.physical.remove(&(site.pid, handle));
                    let step = VmmStep::FreePhysical;
                    out.push(Output::Vmm { site, device, step, addr: handle, size: None, driver });
                }
            }
            Op::Map { va, size, offset, handle, .. } => {
                let device = self.physical_device(site, call, handle);
                if failed {
                    self.fail(site, call, Failure { device, size: Some(size), ptr: Some(va), driver: None }, out);
                } else {
                    let origin = Origin::Mapped { handle, offset };
                    self.add_block(
                        site,
                        NewBlock { device, space: Space::Device, ptr: va, sizes: (size, size), origin },
                        out,
                    );
                    self.add_segment(site.pid, va, device, size, call.outer, out);
                }
            }
            Op::Unmap { va } => {
                let fallback = self.thread_device(site, call);
                if failed {
                    self.fail(site, call, Failure { device: fallback, size: None, ptr: Some(va), driver: None }, out);
                } else {
                    self.remove_block(
                        site,
                        BlockFree { space: Space::Device, ptr: va, fallback, shadow: false, driver: None },
                        out,
                    );
                    self.remove_segment(site.pid, va);
                }
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

    #[test]
    fn vmm_counts_mapped_memory_on_the_handles_device() {
        let events = [
            call(
                Api::AclrtReserveMemAddress,
                1,
                None,
                0,
                Op::Reserve { size: 1 << 30, va: Some(0x7000_0000), alignment: 0, flags: 1 },
            ),
            call(
                Api::AclrtMallocPhysical,
                1,
                None,
                0,
                Op::MallocPhysical { size: 2 << 20, handle: Some(0xabc), device: Some(1), flags: 0, driver: None },
            ),
            call(
                Api::AclrtMapMem,
                1,
                None,
                0,
                Op::Map { va: 0x7000_0000, size: 2 << 20, offset: 0, handle: 0xabc, flags: 0 },
            ),
        ];
        let (t, out) = run(&events);
        assert!(matches!(out[0], Output::Vmm { step: VmmStep::Reserve, device: DeviceKey::Unknown, .. }));
        assert!(matches!(out[1], Output::Vmm { step: VmmStep::MallocPhysical, device: DeviceKey::Npu(1), .. }));
        assert!(matches!(
            out[2],
            Output::Malloc { device: DeviceKey::Npu(1), size, origin: Origin::Mapped { handle: 0xabc, offset: 0 }, .. } if size == 2 << 20
        ));
        let npu1 = t.devices().find(|(k, _)| *k == DeviceKey::Npu(1)).unwrap().1;
        assert_eq!(npu1.used, 2 << 20, "reserved address space is not memory; the mapping is");
        let (_, out) =
            run(&[&events[..], &[call(Api::AclrtUnmapMem, 1, None, 0, Op::Unmap { va: 0x7000_0000 })]].concat());
        assert!(matches!(out[3], Output::Free { device: DeviceKey::Npu(1), used: 0, .. }));
    }
}
