//! Per-device totals and ids, and which device a thread is on.
//!
//! - Each device's file has one `allocation_id` counter for every kind of block in it (device,
//!   pool, host): Insight groups a file's rows by this id alone.
//! - The kernel learns a thread's device only from its set/get-device calls. After an attach, a
//!   thread that chose its device earlier is known by the device its calls name (a driver flag,
//!   a pool block's device) until it calls one of them again. A call that places memory
//!   explicitly names where the memory goes, not where the thread is: a malloc config's device
//!   (a buffer on the peer device) or a physical handle's property teaches nothing.

use std::collections::BTreeMap;

use super::event::{Call, DeviceKey, Op, Space};
use super::keys::Map;
use super::output::Site;

/// Per-device totals.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceStats {
    pub used: u64,
    pub peak: u64,
    pub live_blocks: u64,
    pub mallocs: u64,
    pub frees: u64,
    /// Frees of blocks the trace never saw allocated (born before an attach), device and pool
    /// blocks alike; their rows go to `ms_untracked_frees`, not to Insight's table.
    pub untracked_frees: u64,
    pub failures: u64,
    /// Of [`Self::failures`], those out of memory (by the API's status, or a caching allocator
    /// that gave up).
    pub out_of_memory: u64,
    /// The last `allocation_id` given on this device's file. One counter for every kind of block
    /// in the file (device, pool, host), since Insight groups a file's rows by this id alone.
    next_allocation_id: u64,
}

impl DeviceStats {
    #[inline]
    fn take_allocation_id(&mut self) -> u64 {
        self.next_allocation_id += 1;
        self.next_allocation_id
    }
}

/// Every device's totals and id counter, and the devices threads named. Totals change only
/// through the steps of a block's life below, so `used` and `live_blocks` are always the sum of
/// the device's live blocks.
#[derive(Debug, Default)]
pub(super) struct Devices {
    stats: BTreeMap<DeviceKey, DeviceStats>,
    /// The device each thread last named itself (a driver flag, a malloc config's device, ...),
    /// by (pid, tid): used for its calls while the kernel does not know the thread's device (it
    /// chose it before an attach).
    learnt: Map<(u32, u32), u32>,
}

impl Devices {
    /// Per-device totals, in device order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (DeviceKey, &DeviceStats)> {
        self.stats.iter().map(|(k, v)| (*k, v))
    }

    #[inline]
    fn stats(&mut self, device: DeviceKey) -> &mut DeviceStats {
        self.stats.entry(device).or_default()
    }

    /// The device's total in use (0 for a device never seen).
    #[inline]
    pub(super) fn used(&self, device: DeviceKey) -> u64 {
        self.stats.get(&device).map_or(0, |s| s.used)
    }

    /// The next `allocation_id` of `device`'s file, for a block of any kind.
    #[inline]
    pub(super) fn next_allocation_id(&mut self, device: DeviceKey) -> u64 {
        self.stats(device).take_allocation_id()
    }

    /// Counts a new device or host block of `size` bytes: its `allocation_id` and the device's
    /// `used` after it.
    #[inline]
    pub(super) fn add_block(&mut self, device: DeviceKey, size: u64) -> (u64, u64) {
        // One search of the table: this is every allocation's path.
        let stats = self.stats(device);
        let allocation_id = stats.take_allocation_id();
        stats.used += size;
        stats.peak = stats.peak.max(stats.used);
        stats.live_blocks += 1;
        stats.mallocs += 1;
        (allocation_id, stats.used)
    }

    /// Counts the free (or retirement) of a block of `size` bytes: the device's `used` after it.
    #[inline]
    pub(super) fn remove_block(&mut self, device: DeviceKey, size: u64) -> u64 {
        let stats = self.stats(device);
        stats.used -= size;
        stats.live_blocks -= 1;
        stats.frees += 1;
        stats.used
    }

    /// Counts a free of a block never seen allocated: the device's `used`, unchanged.
    pub(super) fn untracked_free(&mut self, device: DeviceKey) -> u64 {
        let stats = self.stats(device);
        stats.frees += 1;
        stats.untracked_frees += 1;
        stats.used
    }

    /// Counts a pool's free of a block never seen (the device's own frees count device blocks).
    pub(super) fn untracked_pool_free(&mut self, device: DeviceKey) {
        self.stats(device).untracked_frees += 1;
    }

    /// Counts a failed call.
    pub(super) fn fail(&mut self, device: DeviceKey, out_of_memory: bool) {
        let stats = self.stats(device);
        stats.failures += 1;
        stats.out_of_memory += u64::from(out_of_memory);
    }

    /// The device of the calling thread: the kernel's (from its set/get-device calls), else the
    /// one it last named itself.
    #[inline]
    pub(super) fn thread_device(&self, site: Site, call: &Call) -> DeviceKey {
        call.thread_device
            .or_else(|| self.learnt.get(&(site.pid, site.tid)).copied())
            .map_or(DeviceKey::Unknown, DeviceKey::Npu)
    }

    /// Notes the device a successful call names for the thread it ran on.
    #[inline]
    pub(super) fn learn(&mut self, site: Site, call: &Call) {
        if call.status != 0 || call.thread_device.is_some() {
            return;
        }
        let explicit = call.api.def().spec.cfg_kind == memscope_common::spec::cfg_kind::MALLOC_CONFIG;
        let named = match call.op {
            Op::Malloc { space: Space::Device, device, .. } if !explicit => device,
            Op::PoolMalloc { device, .. } => device,
            _ => None,
        };
        if let Some(device) = named {
            self.learnt.insert((site.pid, site.tid), device);
        }
    }

    /// An exited process's threads name no device any more.
    pub(super) fn forget_process(&mut self, pid: u32) {
        self.learnt.retain(|(p, _), _| *p != pid);
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;
    use crate::apis::Api;
    use crate::model::*;

    #[test]
    fn config_device_wins_over_thread_device() {
        let e = call(
            Api::AclrtMallocWithCfg,
            1,
            Some(0),
            0,
            Op::Malloc {
                space: Space::Device,
                size: 4,
                ptr: Some(0x40),
                policy: Some(0),
                device: Some(1),
                module: Some(3),
                driver: None,
            },
        );
        let (_, out) = run(&[e]);
        assert!(matches!(
            out[0],
            Output::Malloc { device: DeviceKey::Npu(1), origin: Origin::Direct { module: Some(3), .. }, .. }
        ));
    }

    #[test]
    fn a_thread_whose_device_the_kernel_does_not_know_is_placed_by_the_device_it_names() {
        // After an attach, thread 1 chose its device earlier: the kernel knows none.
        let plain = |ptr| malloc(Some(ptr), 64, None, 0);
        let launch = call(
            Api::AclrtLaunchKernel,
            1,
            None,
            0,
            Op::Launch { function: 1, args: Vec::new(), args_size: 0, stream: 0 },
        );
        let mut other = malloc(Some(0x5000), 64, None, 0);
        other.tid = 2;
        let merged = [with_outer(driver_alloc(0x2000, 4096, 1, 33), Api::AclrtMalloc), plain(0x2000)];
        let (_, out) = run(&[
            &[plain(0x1000)],
            &merged[..],
            &[plain(0x3000), launch, other, malloc(Some(0x4000), 64, Some(0), 0)],
        ]
        .concat());
        let devices: Vec<(u64, DeviceKey)> = out
            .iter()
            .filter_map(|o| match o {
                Output::Malloc { ptr, device, .. } => Some((*ptr, *device)),
                Output::KernelLaunch { device, .. } => Some((0, *device)),
                _ => None,
            })
            .collect();
        assert_eq!(
            devices,
            [
                (0x1000, DeviceKey::Unknown), // before it named any
                (0x2000, DeviceKey::Npu(1)),  // the driver's flag names device 1
                (0x3000, DeviceKey::Npu(1)),  // learnt
                (0, DeviceKey::Npu(1)),
                (0x5000, DeviceKey::Unknown), // another thread learns nothing from it
                (0x4000, DeviceKey::Npu(0)),  // the kernel's device wins once known
            ]
        );
    }

    /// A buffer placed on the peer device by a malloc config, or physical memory made for
    /// another device, says where the memory goes, not the thread's device (seen after an
    /// attach: the thread's next plain malloc was filed under the peer).
    #[test]
    fn an_explicit_placement_teaches_nothing_of_the_threads_device() {
        let cfg = Op::Malloc {
            space: Space::Device,
            size: 64,
            ptr: Some(0x1000),
            policy: Some(0),
            device: Some(0),
            module: None,
            driver: None,
        };
        let physical =
            Op::MallocPhysical { size: 2 << 20, handle: Some(0x77), device: Some(0), flags: 0, driver: None };
        let (_, out) = run(&[
            call(Api::AclrtMallocWithCfg, 1, None, 0, cfg),
            call(Api::AclrtMallocPhysical, 1, None, 0, physical),
            malloc(Some(0x2000), 64, None, 0),
        ]);
        let devices: Vec<(u64, DeviceKey)> = out
            .iter()
            .filter_map(|o| match o {
                Output::Malloc { ptr, device, .. } => Some((*ptr, *device)),
                _ => None,
            })
            .collect();
        assert_eq!(devices, [(0x1000, DeviceKey::Npu(0)), (0x2000, DeviceKey::Unknown)]);
    }
}
