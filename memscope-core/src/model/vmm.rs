//! Virtual memory (expandable segments): reserved address ranges and physical handles.
//!
//! A reserved range is address space, not memory; a physical handle is memory that becomes a
//! block when mapped. A mapping therefore counts as one block (in `blocks`, see `route_vmm`) from
//! map to unmap, on the device of its physical handle and owned by the module that created the
//! handle, so a device's "used" equals what is mapped. Reserves, releases and physical
//! allocations are rows of their own ([`Output::Vmm`](super::output::Output::Vmm)), never
//! blocks: what is kept here is only what a later call needs to place its row or its mapping.

use super::event::DeviceKey;
use super::keys::Map;
use crate::apis::libraries::Library;

/// Who created a physical handle: the CANN module its driver call named, and the library that
/// called, each if seen. Its mappings are theirs.
pub(super) type Creator = (Option<u16>, Option<Library>);

/// A physical memory handle, until it is freed.
#[derive(Clone, Copy, Debug)]
struct Physical {
    device: DeviceKey,
    /// The CANN module that created it (`halMemCreate`'s flag), the owner of its mappings.
    module: Option<u16>,
    /// The library that created it, when one known to take memory itself (NCCL's buffers).
    caller: Option<Library>,
}

/// Reserved ranges and physical handles, by (pid, address or handle).
#[derive(Debug, Default)]
pub(super) struct Vmm {
    physical: Map<(u32, u64), Physical>,
    /// (device, size) of each reserved range.
    reserved: Map<(u32, u64), (DeviceKey, u64)>,
}

impl Vmm {
    pub(super) fn reserve(&mut self, pid: u32, va: u64, device: DeviceKey, size: u64) {
        self.reserved.insert((pid, va), (device, size));
    }

    /// The (device, size) of a reserved range, if it was seen.
    pub(super) fn reservation(&self, pid: u32, va: u64) -> Option<(DeviceKey, u64)> {
        self.reserved.get(&(pid, va)).copied()
    }

    pub(super) fn release(&mut self, pid: u32, va: u64) {
        self.reserved.remove(&(pid, va));
    }

    pub(super) fn add_physical(&mut self, pid: u32, handle: u64, device: DeviceKey, creator: Creator) {
        let (module, caller) = creator;
        self.physical.insert((pid, handle), Physical { device, module, caller });
    }

    pub(super) fn free_physical(&mut self, pid: u32, handle: u64) {
        self.physical.remove(&(pid, handle));
    }

    /// The module and library that created a physical handle, as far as they were seen.
    pub(super) fn physical_creator(&self, pid: u32, handle: u64) -> Creator {
        self.physical.get(&(pid, handle)).map_or((None, None), |p| (p.module, p.caller))
    }

    /// The device of a physical handle, if it was seen.
    pub(super) fn physical_device(&self, pid: u32, handle: u64) -> Option<DeviceKey> {
        self.physical.get(&(pid, handle)).map(|p| p.device)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use crate::apis::Api;
    use crate::model::*;

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

    /// A handle or range made before an attach is released on the calling thread's device, as
    /// the row says (`unmatched`); one the trace saw made goes to its own device, unmarked.
    #[test]
    fn releases_of_what_the_trace_never_saw_made_are_marked_as_guesses() {
        let made = Op::MallocPhysical { size: 2 << 20, handle: Some(0xabc), device: Some(1), flags: 0, driver: None };
        let events = [
            call(Api::AclrtSetDevice, 1, Some(0), 0, Op::SetDevice { device: 0 }),
            call(Api::AclrtMallocPhysical, 1, Some(0), 0, made),
            call(Api::AclrtFreePhysical, 1, Some(0), 0, Op::FreePhysical { handle: 0xabc, driver: None }),
            call(Api::AclrtFreePhysical, 1, Some(0), 0, Op::FreePhysical { handle: 0xdef, driver: None }),
            call(Api::AclrtReleaseMemAddress, 1, Some(0), 0, Op::Release { va: 0x7000_0000 }),
        ];
        let (_, out) = run(&events);
        let vmm: Vec<(VmmStep, DeviceKey, bool)> = out
            .iter()
            .filter_map(|o| match o {
                Output::Vmm { step, device, unmatched, .. } => Some((*step, *device, *unmatched)),
                _ => None,
            })
            .collect();
        assert_eq!(
            vmm,
            [
                (VmmStep::MallocPhysical, DeviceKey::Npu(1), false),
                (VmmStep::FreePhysical, DeviceKey::Npu(1), false),
                (VmmStep::FreePhysical, DeviceKey::Npu(0), true),
                (VmmStep::Release, DeviceKey::Npu(0), true),
            ]
        );
    }
}
