//! The live state of everything traced, updated one event at a time: each event goes to the
//! part of the model that owns its kind of memory, and the facts it adds go to the caller as
//! [`Output`]s, in the order events happened.
//!
//! The state is split by owner, each part a type that keeps its own invariants and never names
//! the tracker: `blocks` (the live-block table), `devices` (per-device totals and ids, the device
//! a thread is on), `pools` (framework pools' blocks, segments and totals), `vmm` (reserved
//! ranges, physical handles), `reuse` (retired blocks whose free row waits), `owners` and `tags`.
//! A rule that needs two parts lives above them, in the tracker's own files, so the imports
//! among the parts point one way:
//! - `route_blocks`: device and host blocks' allocation and free (owners, reuse, segments);
//! - `route_vmm`: the virtual-memory calls (a mapping is a block);
//! - `route_pools`: framework pools' calls (ids, owners, reuse, untracked frees);
//! - `access`, `atb`, `marks`, `oom`: uses of blocks, ATB operations, markers, OOM listings;
//! - `finish`: the shadow frees at the stop.
//!
//! Here: which part an event goes to, and the rules that hold for all of them.
//! - A driver call that ran inside a runtime call (`aclrtMalloc` -> `halMemAlloc`) is one fact:
//!   the driver's record arrives first and waits for the runtime's, which then carries the
//!   driver's device, flag, module and size (the memory really taken). A driver call on its own
//!   is a fact of its own. An mstx region reported from inside a traced allocator call is folded
//!   into that call the same way.
//! - Keys include the process id: in launch mode several processes can reuse the same address.
//! - Collection gating: while the program has asked not to be recorded (`stop()` of the
//!   markers), blocks born then are tracked but never reported, nor are their frees.

use super::blocks::Blocks;
use super::devices::{DeviceStats, Devices};
use super::event::{Call, DeviceKey, DriverInfo, Event, EventKind, Op, Pool};
use super::inferred::Inference;
use super::keys::{Map, Slot};
use super::output::{Output, Site};
use super::owners::Owners;
use super::pools::{PoolStats, Pools};
use super::reuse::{Reuse, Settle};
use super::tags::Tags;
use super::vmm::Vmm;

/// Where the store's tests name it.
#[cfg(test)]
pub use super::owners::OwnerBase;

/// The live state of everything traced.
#[derive(Debug, Default)]
pub struct Tracker {
    /// Driver calls waiting for the runtime call they ran inside of, per thread.
    inner: Map<u32, Vec<Event>>,
    pub(super) blocks: Blocks,
    /// Blocks and pool blocks retired because their address was handed out again, whose free row
    /// waits for a free still on its way.
    pub(super) reuse: Reuse,
    pub(super) vmm: Vmm,
    pub(super) devices: Devices,
    pub(super) pools: Pools,
    pub(super) last_wall_ns: u64,
    pub(super) tags: Tags,
    /// Owner paths shared by the rows of blocks born under the same spans.
    pub(super) owners: Owners,
    /// Open ranges by (pid, from mstx, id): the thread and label of their tag span.
    pub(super) ranges: Map<(u32, bool, u64), (u32, String)>,
    /// Kernel names by (pid, function handle), from `aclrtBinaryGetFunction`.
    pub(super) kernel_names: Map<(u32, u64), String>,
    /// Kernel argument lists by (pid, args handle), built by `aclrtKernelArgsAppend`.
    pub(super) kernel_args: Map<(u32, u64), Vec<u8>>,
    /// The last step number per process.
    pub(super) steps: Map<u32, u64>,
    /// Owners, phases and steps from the Python stacks of allocations (no markers needed).
    pub(super) inference: Inference,
    /// Open operators per (pid, tid), innermost last (markers `trace_ops()`).
    pub(super) ops: Map<(u32, u32), Vec<String>>,
    /// Processes that asked to be recorded (`true`, markers `start()`) or not (`false`,
    /// `stop()`); the others follow `paused_by_default`.
    pub(super) collect: Map<u32, bool>,
    /// Record nothing until a process asks (`trace --wait-for-start`).
    paused_by_default: bool,
}

impl Tracker {
    pub fn new() -> Self {
        Self::default()
    }

    /// A tracker that reports nothing until the traced program starts collection itself
    /// (markers `start()`, msMemScope's `start()`), as msMemScope's API mode records.
    pub fn paused_until_start() -> Self {
        Self { paused_by_default: true, ..Self::default() }
    }

    pub(super) fn is_paused(&self, pid: u32) -> bool {
        !self.collect.get(&pid).copied().unwrap_or(!self.paused_by_default)
    }

    /// Per-device totals, in device order.
    pub fn devices(&self) -> impl Iterator<Item = (DeviceKey, &DeviceStats)> {
        self.devices.iter()
    }

    /// Per-device, per-pool totals.
    pub fn pools(&self) -> impl Iterator<Item = ((DeviceKey, Pool, u32), &PoolStats)> {
        self.pools.stats()
    }

    /// Applies one event, appending what it adds to `out`.
    pub fn apply(&mut self, mut event: Event, out: &mut Vec<Output>) {
        self.last_wall_ns = self.last_wall_ns.max(event.wall_ns);
        self.settle_displaced_where(Settle::Expired, out);
        if let EventKind::Marker(marker) = &event.kind {
            return self.apply_marker(&event, marker, None, out);
        }
        let call = match &mut event.kind {
            EventKind::Call(call) => call,
            EventKind::Exit => return self.process_exited(event.pid, out),
            EventKind::Marker(_)
            | EventKind::Fork { .. }
            | EventKind::Stack(_)
            | EventKind::PyStack { .. }
            | EventKind::PySample(_) => return,
        };
        if call.outer.is_some() && call.api.tracking().folds_into_outer {
            self.inner.entry(event.tid).or_default().push(event);
            return;
        }
        // The common cases, a call with nothing held or with only its own driver calls, allocate
        // nothing: the thread's list keeps its capacity for the next driver call.
        let Some(held) = self.inner.get_mut(&event.tid).filter(|held| !held.is_empty()) else {
            return self.apply_one(&event, out);
        };
        let inside = |e: &Event| matches!(&e.kind, EventKind::Call(inner) if inner.outer == Some(call.api));
        if held.iter().all(inside) {
            for e in held.iter() {
                if let EventKind::Call(inner) = &e.kind {
                    merge_inner(call, inner);
                }
            }
            held.clear();
            return self.apply_one(&event, out);
        }
        // Others are held too (their runtime call was lost): they are facts of their own, in order.
        let mut held = std::mem::take(held);
        for e in held.drain(..) {
            match &e.kind {
                EventKind::Call(inner) if inner.outer == Some(call.api) => merge_inner(call, inner),
                _ => self.apply_one(&e, out),
            }
        }
        if let Some(list) = self.inner.get_mut(&event.tid) {
            *list = held;
        }
        self.apply_one(&event, out);
    }

    /// A process ended: its threads' spans, devices and operators go, and the driver calls they
    /// still held are facts of their own.
    fn process_exited(&mut self, pid: u32, out: &mut Vec<Output>) {
        self.settle_displaced_where(Settle::Process(pid), out);
        self.tags.forget_process(pid);
        self.devices.forget_process(pid);
        self.ops.retain(|(p, _), _| *p != pid);
        let tids: Vec<u32> =
            self.inner.iter().filter(|(_, v)| v.iter().any(|e| e.pid == pid)).map(|(t, _)| *t).collect();
        for tid in tids {
            self.flush_inner(tid, out);
        }
    }

    /// Applies the held driver calls of a thread whose runtime call never came (its record was
    /// lost, or the process ended).
    fn flush_inner(&mut self, tid: u32, out: &mut Vec<Output>) {
        for e in self.inner.remove(&tid).unwrap_or_default() {
            self.apply_one(&e, out);
        }
    }

    /// Applies the held driver calls of every thread (the trace ends).
    pub(super) fn flush_all_inner(&mut self, out: &mut Vec<Output>) {
        let tids: Vec<u32> = self.inner.keys().copied().collect();
        for tid in tids {
            self.flush_inner(tid, out);
        }
    }

    fn apply_one(&mut self, event: &Event, out: &mut Vec<Output>) {
        if let EventKind::Call(call) = &event.kind {
            let gc = call.outer.is_some_and(|outer| outer.tracking().collects_garbage);
            let (wall_ns, pid, tid, weight) = (event.wall_ns, event.pid, event.tid, call.sample_weight);
            let site =
                Site { api: call.api, wall_ns, pid, tid, gc, weight, py_stack: call.py_stack, caller: call.caller };
            self.devices.learn(site, call);
            if matches!(call.op, Op::Malloc { .. } | Op::PoolMalloc { .. }) {
                self.observe_allocation(site, out);
            }
            self.apply_call(site, call, out);
        }
    }

    fn apply_call(&mut self, site: Site, call: &Call, out: &mut Vec<Output>) {
        match call.op {
            Op::Malloc { .. } => self.apply_malloc(site, call, out),
            Op::Free { .. } => self.apply_free(site, call, out),
            Op::Reserve { .. }
            | Op::Release { .. }
            | Op::MallocPhysical { .. }
            | Op::FreePhysical { .. }
            | Op::Map { .. }
            | Op::Unmap { .. } => self.apply_vmm(site, call, out),
            Op::PoolMalloc { .. }
            | Op::PoolFree { .. }
            | Op::PoolHandle { .. }
            | Op::StreamMark { .. }
            | Op::MstxDomain { .. }
            | Op::MstxHeap { .. }
            | Op::MstxRegion { .. } => self.apply_pool(site, call, out),
            Op::Copy { .. }
            | Op::Set { .. }
            | Op::Launch { .. }
            | Op::KernelName { .. }
            | Op::KernelArgs { .. }
            | Op::LaunchArgs { .. } => self.apply_use(site, call, out),
            Op::AtbExecute { .. } => self.atb_execute(site, call, out),
            Op::Marker(ref marker) => {
                let event = Event { wall_ns: site.wall_ns, pid: site.pid, tid: site.tid, kind: EventKind::Exit };
                self.apply_marker(&event, marker, Some(call.api), out);
            }
            // Its frees came first and carry `site.gc`; the pass itself is not a row.
            Op::GcPass { .. } => {}
            // What it means is in the calls made inside it, which name it as their outer call.
            Op::Scope => {}
            // The kernel keeps the thread's device; nothing is stored for these calls.
            Op::SetDevice { .. } | Op::GetDevice { .. } => {}
        }
    }

    /// A failed call: counted on its device, reported (with an OOM listing when it ran out of
    /// memory), never a block.
    pub(super) fn fail(&mut self, site: Site, call: &Call, failure: Failure, out: &mut Vec<Output>) {
        let Failure { device, size, ptr, driver } = failure;
        self.devices.fail(device, call.out_of_memory);
        if self.is_paused(site.pid) {
            return;
        }
        out.push(Output::Failed {
            site,
            device,
            status: call.status,
            out_of_memory: call.out_of_memory,
            size,
            ptr,
            driver,
            segment: call.outer.and_then(|outer| outer.tracking().segment_pool),
        });
        if call.out_of_memory {
            self.oom_snapshot(site, device, false, out);
        }
    }

    /// A displaced block at `slot`, if any, missed its free after all: its shadow row now.
    pub(super) fn settle_displaced(&mut self, slot: Slot, out: &mut Vec<Output>) {
        self.reuse.settle(slot, &self.devices, &mut self.pools, out);
    }

    /// Settles the displaced blocks whose late free can no longer come (see `reuse`).
    pub(super) fn settle_displaced_where(&mut self, which: Settle, out: &mut Vec<Output>) {
        self.reuse.settle_where(which, self.last_wall_ns, &self.devices, &mut self.pools, out);
    }
}

/// What a failed call had, whichever kind of call it was.
pub(super) struct Failure {
    /// Where the failure is counted.
    pub(super) device: DeviceKey,
    /// The bytes asked for, by an allocation.
    pub(super) size: Option<u64>,
    /// The address named, by a free.
    pub(super) ptr: Option<u64>,
    pub(super) driver: Option<DriverInfo>,
}

/// Folds a detail call into the call it ran inside of. A driver call into a runtime call: the
/// driver's device (from its flag or property) and module are the truth, and its size is what
/// the memory really took. An mstx region into an allocator call: the region's address, size and
/// device fill what the allocator call's probe could not read.
fn merge_inner(outer: &mut Call, inner: &Call) {
    match (&mut outer.op, &inner.op) {
        (
            Op::PoolMalloc { ptr, size, device, .. },
            Op::MstxRegion { register: true, ptr: inner_ptr, size: inner_size, device: inner_device, .. },
        ) => {
            *ptr = ptr.or(*inner_ptr);
            *size = size.or(*inner_size);
            *device = device.or(*inner_device);
        }
        (Op::PoolFree { ptr, .. }, Op::MstxRegion { register: false, ptr: inner_ptr, .. }) => *ptr = ptr.or(*inner_ptr),
        (
            Op::Malloc { device, module, driver, .. },
            Op::Malloc { device: inner_device, module: inner_module, driver: inner_driver, .. },
        ) => {
            *device = inner_device.or(*device);
            *module = inner_module.or(*module);
            *driver = *inner_driver;
        }
        (Op::Free { driver, .. }, Op::Free { driver: inner_driver, .. })
        | (Op::FreePhysical { driver, .. }, Op::FreePhysical { driver: inner_driver, .. }) => *driver = *inner_driver,
        (
            Op::MallocPhysical { device, driver, .. },
            Op::MallocPhysical { device: inner_device, driver: inner_driver, .. },
        ) => {
            *device = device.or(*inner_device);
            *driver = *inner_driver;
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;
    use crate::apis::Api;
    use crate::model::*;

    #[test]
    fn a_driver_call_inside_a_runtime_call_is_one_fact_with_the_drivers_size_and_device() {
        // The driver's record arrives first (it returns first), then the runtime's.
        let inner = with_outer(driver_alloc(0x1000, 544, 1, 33), Api::AclrtMalloc);
        let (t, out) = run(&[inner, malloc(Some(0x1000), 512, None, 0)]);
        assert_eq!(out.len(), 1, "{out:?}");
        let Output::Malloc { site, device, size, req_size, origin, .. } = &out[0] else { panic!("{out:?}") };
        assert_eq!(site.api, Api::AclrtMalloc);
        assert_eq!((*device, *size, *req_size), (DeviceKey::Npu(1), 544, 512));
        let Origin::Direct { driver: Some(d), .. } = origin else { panic!("{origin:?}") };
        assert_eq!((d.api, d.module), (Api::HalMemAlloc, Some(33)));
        assert_eq!(t.devices().next().unwrap().1.used, 544);
    }

    #[test]
    fn a_driver_call_on_its_own_is_a_fact_of_its_own() {
        let (_, out) = run(&[driver_alloc(0x1000, 4096, 0, 3), malloc(Some(0x2000), 512, Some(0), 0)]);
        assert_eq!(out.len(), 2);
        assert!(matches!(out[0], Output::Malloc { site: Site { api: Api::HalMemAlloc, .. }, size: 4096, .. }));
    }

    #[test]
    fn driver_calls_whose_runtime_call_was_lost_are_facts_of_their_own_in_order() {
        let driver_free = |ptr| {
            let driver = DriverInfo { api: Api::HalMemFree, flag: None, size: 0, module: None, page: None };
            call(Api::HalMemFree, 1, None, 0, Op::Free { space: Space::Device, ptr, driver: Some(driver) })
        };
        let (_, out) = run(&[
            malloc(Some(0x9000), 64, Some(0), 0),
            // aclrtMalloc's driver call, whose own record was lost; then a free's two calls.
            with_outer(driver_alloc(0x1000, 544, 1, 33), Api::AclrtMalloc),
            with_outer(driver_free(0x9000), Api::AclrtFree),
            free(0x9000, Some(0)),
            // Another lost one, then the process exits.
            with_outer(driver_alloc(0x2000, 4096, 1, 33), Api::AclrtMalloc),
            Event { wall_ns: 5_000, pid: 100, tid: 100, kind: EventKind::Exit },
        ]);
        let facts: Vec<(Api, u64, Option<Api>)> = out
            .iter()
            .map(|o| match o {
                Output::Malloc { site, ptr, .. } => (site.api, *ptr, None),
                Output::Free { site, ptr, driver, .. } => (site.api, *ptr, driver.map(|d| d.api)),
                _ => panic!("{o:?}"),
            })
            .collect();
        assert_eq!(
            facts,
            [
                (Api::AclrtMalloc, 0x9000, None),
                (Api::HalMemAlloc, 0x1000, None),
                (Api::AclrtFree, 0x9000, Some(Api::HalMemFree)),
                (Api::HalMemAlloc, 0x2000, None),
            ]
        );
    }
}
