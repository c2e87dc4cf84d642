//! Live memory state, updated one event at a time, and the facts each event adds ([`Output`]).
//!
//! Accounting rules:
//! - A device block counts from its successful allocation to its successful free. A failed call
//!   changes nothing and is reported as [`Output::Failed`], never as a block (so it is no leak).
//! - Virtual memory: a reserved range is address space, not memory; a physical handle is memory
//!   that becomes a block when mapped. A mapping therefore counts as one block from map to unmap,
//!   on the device of its physical handle, so "used" equals what is mapped.
//! - Keys include the process id: in launch mode several processes can reuse the same address.
//! - A driver call that ran inside a runtime call (`aclrtMalloc` -> `halMemAlloc`) is one fact:
//!   the driver's record arrives first and waits for the runtime's, which then carries the
//!   driver's device, flag, module and size (the memory really taken). A driver call on its own
//!   is a fact of its own. An mstx region reported from inside a traced allocator call is folded
//!   into that call the same way.
//! - Framework pools (PTA): a block counts in its pool's `used` from the allocator handing it out
//!   to taking it back. The pool's `total` (reserved) is the device memory its allocator took:
//!   runtime allocations and mappings made inside a traced allocator call are the pool's
//!   segments, until freed or unmapped; when the pool reports its reserved bytes through mstx,
//!   that report wins. Segments taken before an attach are unknown, so `total` starts low then.
//! - Owners: a block's owner is its allocator's label (the driver module, the pool, host) and
//!   the allocating thread's open tag spans at that moment; an address tag later replaces one
//!   level for that block and is reported as [`Output::Retag`] (see `model::marks`).
//! - Collection gating: while the program has asked not to be recorded (`stop()` of the
//!   markers), blocks born then are tracked but never reported, nor are their frees.

use std::collections::{BTreeMap, HashMap};

use super::event::{Call, DeviceKey, DriverInfo, Event, EventKind, Op, Pool, Space};
use super::tags::{self, BlockLabels, Labels, Tags};
use crate::apis::{hal, Api, Family};

/// Who did it and when.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Site {
    pub api: Api,
    pub wall_ns: u64,
    pub pid: u32,
    pub tid: u32,
    /// The call ran inside a pass of Python's garbage collector (a free the collector caused).
    pub gc: bool,
}

/// How a block came to exist.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// A malloc-style call; `driver` when the driver call behind it was seen.
    Direct { policy: Option<u64>, module: Option<u16>, driver: Option<DriverInfo> },
    /// Physical memory mapped at a virtual address (expandable segments).
    Mapped { handle: u64, offset: u64 },
}

/// Steps of the virtual-memory family that are not blocks themselves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VmmStep {
    Reserve,
    Release,
    MallocPhysical,
    FreePhysical,
}

/// A fact for the store, in the order events happened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Output {
    Malloc {
        site: Site,
        device: DeviceKey,
        space: Space,
        ptr: u64,
        /// Bytes taken: the driver's size when its call was seen, else the request.
        size: u64,
        /// Bytes the API was asked for.
        req_size: u64,
        allocation_id: u64,
        /// Bytes live on this device right after the allocation.
        used: u64,
        origin: Origin,
        /// The owner path, when anything is known about it (module, host, tags).
        owner: Option<String>,
        /// Taken inside a framework allocator's call: a segment of that pool (its reserved
        /// memory, which the pool's blocks are carved from).
        segment: Option<Pool>,
    },
    Free {
        site: Site,
        device: DeviceKey,
        space: Space,
        ptr: u64,
        /// `None` when the block was allocated before the trace started.
        size: Option<u64>,
        allocation_id: Option<u64>,
        used: u64,
        /// Written by [`Tracker::finish`] for blocks still alive at the end, so that every MALLOC
        /// has a FREE (as msMemScope does); not a real call.
        shadow: bool,
        /// The driver call behind the free, when seen.
        driver: Option<DriverInfo>,
    },
    /// A call that returned an error status. `size` is the request for allocations.
    Failed {
        site: Site,
        device: DeviceKey,
        status: i32,
        out_of_memory: bool,
        size: Option<u64>,
        ptr: Option<u64>,
        driver: Option<DriverInfo>,
    },
    Vmm {
        site: Site,
        device: DeviceKey,
        step: VmmStep,
        addr: u64,
        size: Option<u64>,
        driver: Option<DriverInfo>,
    },
    /// A framework pool handed out a block. `used`/`total` are the pool's allocated and reserved
    /// bytes right after.
    PoolMalloc {
        site: Site,
        device: DeviceKey,
        pool: Pool,
        ptr: u64,
        size: u64,
        req_size: Option<u64>,
        allocation_id: u64,
        used: u64,
        total: u64,
        owner: String,
    },
    PoolFree {
        site: Site,
        device: DeviceKey,
        pool: Pool,
        ptr: u64,
        /// `None` for a block handed out before the trace started.
        size: Option<u64>,
        allocation_id: Option<u64>,
        used: u64,
        total: u64,
        shadow: bool,
        /// The free was not seen but follows from the allocator's rules (a workspace use ends
        /// with the next one on its device when only `allocate_workspace` is probed).
        implied: bool,
        /// Other streams the block was still marked on (`recordStream` without `eraseStream`):
        /// the allocator keeps it until their work completes.
        stream_uses: u32,
    },
    /// An address tag changed the owner of a live block reported earlier.
    Retag {
        device: DeviceKey,
        pid: u32,
        /// The block's row kind (`HAL`, `HOST`, `PTA`).
        event_type: &'static str,
        ptr: u64,
        owner: String,
    },
    /// A block was used: read, written, or named in a kernel's arguments (`ACCESS` rows).
    Access {
        site: Site,
        device: DeviceKey,
        /// The block's row kind (`PTA`, `HAL`, `HOST`) and start address.
        block_type: &'static str,
        block: u64,
        allocation_id: u64,
        pool: Option<Pool>,
        addr: u64,
        size: Option<u64>,
        kind: AccessKind,
    },
    /// An operator's tensor was read or written (`ACCESS` rows from the markers' `trace_ops()`):
    /// the live block holding `addr`, named by the operator rather than by an API.
    OpAccess {
        wall_ns: u64,
        pid: u32,
        tid: u32,
        device: DeviceKey,
        /// The block's row kind (`PTA`, `HAL`, `HOST`) and start address.
        block_type: &'static str,
        block: u64,
        allocation_id: u64,
        pool: Option<Pool>,
        addr: u64,
        size: u64,
        kind: AccessKind,
        /// The thread's innermost open operator, if any.
        op: Option<String>,
        /// dtype and shape as the markers send them (`float32[4,8]`).
        desc: Option<String>,
    },
    /// An operator began (`start`) or ended (`OP_LAUNCH` rows, `ATEN_START` / `ATEN_END`).
    OpLaunch {
        wall_ns: u64,
        pid: u32,
        tid: u32,
        start: bool,
        name: String,
    },
    /// An ATB operation began (`start`, at its call's entry) or ended (at its return): `OP_LAUNCH`
    /// rows `ATB_START` / `ATB_END`, on the device of the workspace block it ran in (else the
    /// thread's). The same workspace facts are on both rows, as msMemScope writes them.
    AtbLaunch {
        /// `wall_ns` is this row's time: the entry for the start, the return for the end.
        site: Site,
        device: DeviceKey,
        start: bool,
        runner: u64,
        workspace: Option<u64>,
        workspace_size: Option<u64>,
        intermediate_size: Option<u64>,
        /// The operation's `atb::Status` (0: success); known at the end only.
        status: Option<i32>,
    },
    /// A kernel was launched (`KERNEL_LAUNCH` rows).
    KernelLaunch {
        site: Site,
        device: DeviceKey,
        name: Option<String>,
        function: u64,
        stream: u64,
        args_size: u64,
    },
    /// One of the live blocks listed with an out-of-memory trigger (`OOM_RECENT_ALLOC` /
    /// `OOM_TOP_ALLOC` rows, right after the `OOM_TRIGGER` of `site`).
    OomBlock {
        site: Site,
        device: DeviceKey,
        /// true: among the most recent; false: among the largest.
        recent: bool,
        rank: usize,
        block_type: &'static str,
        ptr: u64,
        size: u64,
        born_ns: u64,
        /// The listed block's, so the row names the same block as its MALLOC.
        allocation_id: u64,
        owner: Option<String>,
    },
    /// A step boundary (`SYSTEM`/`STEP`), numbered per process.
    Step {
        wall_ns: u64,
        pid: u32,
        tid: u32,
        number: u64,
    },
    /// A mark or range boundary (`MSTX` rows). `api` is the mstx call, `None` for the markers
    /// package.
    Mstx {
        wall_ns: u64,
        pid: u32,
        tid: u32,
        api: Option<Api>,
        kind: MstxKind,
        id: Option<u64>,
        message: String,
    },
}

/// msMemScope's ACCESS event types.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AccessKind {
    Read,
    Write,
    /// Named in a kernel's arguments: used, direction unknown.
    Unknown,
}

/// Which MSTX row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MstxKind {
    Mark,
    RangeStart,
    RangeEnd,
}

/// The allocator part of a block's owner (msMemScope's FRAMEWORK level).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OwnerBase {
    /// Device memory: `CANN@<module>` when the driver's module is known.
    Hal(Option<u16>),
    Host,
    Pool(Pool),
}

impl OwnerBase {
    /// msMemScope's label: `CANN@<module>`, `CANN@UNKNOWN` for device memory whose module was not
    /// seen (a mapping, a runtime call whose driver call was not traced), `HOST`, or the pool's.
    pub fn label(self) -> String {
        match self {
            Self::Hal(Some(m)) => hal::owner(m),
            Self::Hal(None) => "CANN@UNKNOWN".to_owned(),
            Self::Host => "HOST".to_owned(),
            Self::Pool(pool) => pool.owner().to_owned(),
        }
    }

    /// The owner path with these labels. Every block has one: Insight leaves a block without an
    /// owner out of its decomposition tree, so the tree would not add up to the curve.
    pub fn owner(self, labels: &Labels) -> String {
        tags::owner_path(&self.label(), labels)
    }
}

/// A framework pool's totals on one device.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    pub used: u64,
    pub total: u64,
    pub peak_used: u64,
    pub peak_total: u64,
    pub live_blocks: u64,
}

#[derive(Clone, Debug)]
pub(super) struct PoolBlock {
    pub(super) device: DeviceKey,
    pub(super) pool: Pool,
    pub(super) size: u64,
    pub(super) allocation_id: u64,
    api: Api,
    pub(super) labels: BlockLabels,
    /// Born while collection was off: never reported.
    pub(super) hidden: bool,
    pub(super) born_ns: u64,
    /// Streams it is marked on (`recordStream`, until `eraseStream`).
    pub(super) streams: Vec<u64>,
}

/// An external block known by its handle, waiting for `GetBlockPtr`.
#[derive(Clone, Copy, Debug)]
struct PendingHandle {
    device: DeviceKey,
    pool: Pool,
    req: Option<u64>,
    size: Option<u64>,
    api: Api,
}

#[derive(Clone, Copy, Debug)]
struct Segment {
    device: DeviceKey,
    pool: Pool,
    size: u64,
}

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
    /// The last `allocation_id` given on this device's file. One counter for every kind of block
    /// in the file (device, pool, host), since Insight groups a file's rows by this id alone.
    next_allocation_id: u64,
}

/// A live device or host block. Kept small (48 bytes): a job can hold a million of them, and the
/// tracer's memory is mostly these.
#[derive(Clone, Debug)]
pub(super) struct Live {
    pub(super) device: DeviceKey,
    pub(super) size: u64,
    pub(super) allocation_id: u64,
    api: Api,
    pub(super) base: OwnerBase,
    pub(super) labels: BlockLabels,
    pub(super) hidden: bool,
    pub(super) born_ns: u64,
}

const _: () = assert!(std::mem::size_of::<Live>() <= 48, "a live block's state grew: see Live");

#[derive(Clone, Copy, Debug)]
struct Physical {
    device: DeviceKey,
    /// The CANN module that created it (`halMemCreate`'s flag), the owner of its mappings.
    module: Option<u16>,
}

/// The live state of everything traced.
#[derive(Debug, Default)]
pub struct Tracker {
    /// Driver calls waiting for the runtime call they ran inside of, per thread (looked up for
    /// every call, hence the fast hash).
    inner: HashMap<u32, Vec<Event>, foldhash::fast::RandomState>,
    /// Live device and host blocks, ordered so that the block holding an address inside it is
    /// found without a scan (and without a second index: a B-tree also has no resize that
    /// briefly doubles a million-entry table).
    pub(super) blocks: BTreeMap<(u32, Space, u64), Live>,
    physical: HashMap<(u32, u64), Physical>,
    reserved: HashMap<(u32, u64), (DeviceKey, u64)>,
    devices: BTreeMap<DeviceKey, DeviceStats>,
    /// The device each thread last named itself (a driver flag, a malloc config's device, ...),
    /// by (pid, tid): used for its calls while the kernel does not know the thread's device (it
    /// chose it before an attach).
    learnt_devices: HashMap<(u32, u32), u32>,
    /// Per (device, pool, process): each process has its own allocator, so its counters are its
    /// own even when processes share a device.
    pools: BTreeMap<(DeviceKey, Pool, u32), PoolStats>,
    /// Live pool blocks by (pid, start), ordered like `blocks`.
    pub(super) pool_blocks: BTreeMap<(u32, u64), PoolBlock>,
    handles: HashMap<(u32, u64), PendingHandle>,
    /// External block handles whose address is known.
    handle_ptrs: HashMap<(u32, u64), u64>,
    segments: HashMap<(u32, u64), Segment>,
    domains: HashMap<(u32, u64), Pool>,
    /// The open workspace use per device, when workspace frees are not probed.
    workspace_open: HashMap<(u32, DeviceKey), u64>,
    last_wall_ns: u64,
    pub(super) tags: Tags,
    /// Open ranges by (pid, from mstx, id): the thread and label of their tag span.
    pub(super) ranges: HashMap<(u32, bool, u64), (u32, String)>,
    /// Kernel names by (pid, function handle), from `aclrtBinaryGetFunction`.
    pub(super) kernel_names: HashMap<(u32, u64), String>,
    /// Kernel argument lists by (pid, args handle), built by `aclrtKernelArgsAppend`.
    kernel_args: HashMap<(u32, u64), Vec<u8>>,
    /// The last step number per process.
    pub(super) steps: HashMap<u32, u64>,
    /// Open operators per (pid, tid), innermost last (markers `trace_ops()`).
    pub(super) ops: HashMap<(u32, u32), Vec<String>>,
    /// Processes that asked to be recorded (`true`, markers `start()`) or not (`false`,
    /// `stop()`); the others follow `paused_by_default`.
    pub(super) collect: HashMap<u32, bool>,
    /// Record nothing until a process asks (`trace --wait-for-start`).
    paused_by_default: bool,
}

fn space_device(space: Space, device: DeviceKey) -> DeviceKey {
    match space {
        Space::Host | Space::Cpu => DeviceKey::Cpu,
        Space::Device => device,
    }
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
        self.devices.iter().map(|(k, v)| (*k, v))
    }

    /// Per-device, per-pool totals.
    pub fn pools(&self) -> impl Iterator<Item = ((DeviceKey, Pool, u32), &PoolStats)> {
        self.pools.iter().map(|(k, v)| (*k, v))
    }

    /// Applies one event, appending what it adds to `out`.
    pub fn apply(&mut self, event: &Event, out: &mut Vec<Output>) {
        self.last_wall_ns = self.last_wall_ns.max(event.wall_ns);
        if let EventKind::Marker(marker) = &event.kind {
            self.apply_marker(event, marker, None, out);
            return;
        }
        let EventKind::Call(call) = &event.kind else {
            if event.kind == EventKind::Exit {
                self.tags.forget_process(event.pid);
                self.learnt_devices.retain(|(pid, _), _| *pid != event.pid);
                self.ops.retain(|(pid, _), _| *pid != event.pid);
                let tids: Vec<u32> =
                    self.inner.iter().filter(|(_, v)| v.iter().any(|e| e.pid == event.pid)).map(|(t, _)| *t).collect();
                for tid in tids {
                    self.flush_inner(tid, out);
                }
            }
            return;
        };
        let detail = call.api.family() == Family::Hal || matches!(call.op, Op::MstxRegion { .. });
        if call.outer.is_some() && detail {
            self.inner.entry(event.tid).or_default().push(event.clone());
            return;
        }
        // The common case, a call with nothing held (or one driver call), allocates nothing: the
        // thread's list keeps its capacity for the next driver call.
        let mut held = match self.inner.get_mut(&event.tid) {
            Some(held) if !held.is_empty() => std::mem::take(held),
            _ => return self.apply_one(event, out),
        };
        let mut merged: Option<Call> = None;
        for e in &held {
            match &e.kind {
                EventKind::Call(inner) if inner.outer == Some(call.api) => {
                    merge_inner(merged.get_or_insert_with(|| call.clone()), inner);
                }
                _ => self.apply_one(e, out),
            }
        }
        held.clear();
        if let Some(list) = self.inner.get_mut(&event.tid) {
            *list = held;
        }
        match merged {
            None => self.apply_one(event, out),
            Some(call) => self.apply_one(&Event { kind: EventKind::Call(call), ..*event }, out),
        }
    }

    /// Applies the held driver calls of a thread whose runtime call never came (its record was
    /// lost, or the process ended).
    fn flush_inner(&mut self, tid: u32, out: &mut Vec<Output>) {
        for e in self.inner.remove(&tid).unwrap_or_default() {
            self.apply_one(&e, out);
        }
    }

    fn apply_one(&mut self, event: &Event, out: &mut Vec<Output>) {
        if let EventKind::Call(call) = &event.kind {
            let gc = call.outer == Some(Api::PyGcCollect);
            let site = Site { api: call.api, wall_ns: event.wall_ns, pid: event.pid, tid: event.tid, gc };
            self.learn_device(site, call);
            self.apply_call(site, call, out);
        }
    }

    /// The device of the calling thread: the kernel's (from its set/get-device calls), else the
    /// one it last named itself.
    pub(super) fn thread_device(&self, site: Site, call: &Call) -> DeviceKey {
        call.thread_device
            .or_else(|| self.learnt_devices.get(&(site.pid, site.tid)).copied())
            .map_or(DeviceKey::Unknown, DeviceKey::Npu)
    }

    /// Notes the device a successful call names for the thread it ran on. The kernel learns a
    /// thread's device only from set/get-device calls, so after an attach a thread that chose
    /// its device earlier is known by these until it calls one of them again.
    fn learn_device(&mut self, site: Site, call: &Call) {
        if call.status != 0 || call.thread_device.is_some() {
            return;
        }
        let named = match call.op {
            Op::Malloc { space: Space::Device, device, .. }
            | Op::MallocPhysical { device, .. }
            | Op::PoolMalloc { device, .. } => device,
            _ => None,
        };
        if let Some(device) = named {
            self.learnt_devices.insert((site.pid, site.tid), device);
        }
    }

    fn stats(&mut self, device: DeviceKey) -> &mut DeviceStats {
        self.devices.entry(device).or_default()
    }

    /// The next `allocation_id` of `device`'s file, for a block of any kind.
    fn next_allocation_id(&mut self, device: DeviceKey) -> u64 {
        let stats = self.stats(device);
        stats.next_allocation_id += 1;
        stats.next_allocation_id
    }

    #[allow(clippy::too_many_arguments, reason = "a failure carries whatever the call had")]
    fn fail(
        &mut self,
        site: Site,
        call: &Call,
        device: DeviceKey,
        size: Option<u64>,
        ptr: Option<u64>,
        driver: Option<DriverInfo>,
        out: &mut Vec<Output>,
    ) {
        self.stats(device).failures += 1;
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
        });
        if call.out_of_memory {
            self.oom_snapshot(site, device, false, out);
        }
    }

    fn apply_call(&mut self, site: Site, call: &Call, out: &mut Vec<Output>) {
        let failed = call.status != 0;
        match call.op {
            Op::Malloc { space, size, ptr, policy, device, module, driver } => {
                let device = space_device(space, device.map_or_else(|| self.thread_device(site, call), DeviceKey::Npu));
                match ptr {
                    Some(ptr) if !failed => {
                        let taken = driver.map_or(size, |d| d.size);
                        let origin = Origin::Direct { policy, module, driver };
                        self.add_block(site, device, space, ptr, (taken, size), origin, out);
                        self.add_segment(site.pid, ptr, device, size, call.outer, out);
                    }
                    _ => self.fail(site, call, device, Some(size), None, driver, out),
                }
            }
            Op::Free { space, ptr, driver } => {
                let fallback = space_device(space, self.thread_device(site, call));
                if failed {
                    let device = self.blocks.get(&(site.pid, space, ptr)).map_or(fallback, |b| b.device);
                    self.fail(site, call, device, None, Some(ptr), driver, out);
                } else {
                    self.remove_block(site, space, ptr, fallback, false, driver, out);
                    self.remove_segment(site.pid, ptr);
                }
            }
            Op::Reserve { size, va, .. } => {
                let device = self.thread_device(site, call);
                match va {
                    Some(va) if !failed => {
                        self.reserved.insert((site.pid, va), (device, size));
                        let step = VmmStep::Reserve;
                        out.push(Output::Vmm { site, device, step, addr: va, size: Some(size), driver: None });
                    }
                    _ => self.fail(site, call, device, Some(size), None, None, out),
                }
            }
            Op::Release { va } => {
                let (device, size) = match self.reserved.get(&(site.pid, va)) {
                    Some(&(device, size)) => (device, Some(size)),
                    None => (self.thread_device(site, call), None),
                };
                if failed {
                    self.fail(site, call, device, None, Some(va), None, out);
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
                    _ => self.fail(site, call, device, Some(size), None, driver, out),
                }
            }
            Op::FreePhysical { handle, driver } => {
                let device =
                    self.physical.get(&(site.pid, handle)).map_or_else(|| self.thread_device(site, call), |p| p.device);
                if failed {
                    self.fail(site, call, device, None, Some(handle), driver, out);
                } else {
                    self.physical.remove(&(site.pid, handle));
                    let step = VmmStep::FreePhysical;
                    out.push(Output::Vmm { site, device, step, addr: handle, size: None, driver });
                }
            }
            Op::Map { va, size, offset, handle, .. } => {
                let device =
                    self.physical.get(&(site.pid, handle)).map_or_else(|| self.thread_device(site, call), |p| p.device);
                if failed {
                    self.fail(site, call, device, Some(size), Some(va), None, out);
                } else {
                    self.add_block(
                        site,
                        device,
                        Space::Device,
                        va,
                        (size, size),
                        Origin::Mapped { handle, offset },
                        out,
                    );
                    self.add_segment(site.pid, va, device, size, call.outer, out);
                }
            }
            Op::Unmap { va } => {
                let fallback = self.thread_device(site, call);
                if failed {
                    self.fail(site, call, fallback, None, Some(va), None, out);
                } else {
                    self.remove_block(site, Space::Device, va, fallback, false, None, out);
                    self.remove_segment(site.pid, va);
                }
            }
            Op::StreamMark { ptr: Some(ptr), stream, record } => {
                if let Some(block) = self.pool_blocks.get_mut(&(site.pid, ptr)) {
                    if record && !block.streams.contains(&stream) {
                        block.streams.push(stream);
                    } else if !record {
                        block.streams.retain(|s| *s != stream);
                    }
                }
            }
            Op::StreamMark { ptr: None, .. } => {}
            Op::GcPass { .. } => {
                // Its frees came first and carry `site.gc`; the pass itself is not a row.
            }
            Op::AtbExecute { .. } => self.atb_execute(site, call, out),
            Op::SetDevice { .. } | Op::GetDevice { .. } => {
                // The kernel keeps the thread's device; nothing is stored for these calls.
            }
            Op::Copy { dst, src, size } => {
                self.access(site, call, src, Some(size), AccessKind::Read, out);
                self.access(site, call, dst, Some(size), AccessKind::Write, out);
            }
            Op::Set { ptr, size } => self.access(site, call, ptr, Some(size), AccessKind::Write, out),
            Op::Launch { function, ref args, args_size, stream } => {
                self.launch(site, call, function, args, args_size, stream, out);
            }
            Op::KernelName { function: Some(function), name: Some(ref name) } => {
                self.kernel_names.insert((site.pid, function), name.clone());
            }
            Op::KernelName { .. } => {}
            Op::KernelArgs { handle, append: None } if !failed => {
                self.kernel_args.insert((site.pid, handle), Vec::new());
            }
            Op::KernelArgs { handle, append: Some(ref bytes) } if !failed => {
                let list = self.kernel_args.entry((site.pid, handle)).or_default();
                // A launch copies at most this much of a plain argument buffer; the same bound here.
                let room = memscope_common::record::BLOB_LEN.saturating_sub(list.len());
                list.extend_from_slice(&bytes[..bytes.len().min(room)]);
            }
            Op::KernelArgs { .. } => {}
            Op::LaunchArgs { function, handle, stream } => {
                // Taken, not kept: a list is built for one launch, and the runtime reports no end of
                // a handle, so keeping them would grow with every launch of a long job.
                let args = self.kernel_args.remove(&(site.pid, handle)).unwrap_or_default();
                let size = args.len() as u64;
                self.launch(site, call, function, &args, size, stream, out);
            }
            Op::Marker(ref marker) => {
                let event = Event { wall_ns: site.wall_ns, pid: site.pid, tid: site.tid, kind: EventKind::Exit };
                self.apply_marker(&event, marker, Some(call.api), out);
            }
            Op::PoolMalloc { pool, ptr, size, req, device, handle } => {
                let device = device.map_or_else(|| self.thread_device(site, call), DeviceKey::Npu);
                match (ptr, handle) {
                    (Some(ptr), _) => {
                        if pool == Pool::Workspace && call.api == Api::AllocateWorkspace {
                            self.end_open_workspace(site, device, out);
                            self.workspace_open.insert((site.pid, device), ptr);
                        }
                        self.add_pool_block(site, device, pool, ptr, size.or(req).unwrap_or(0), req, out);
                    }
                    (None, Some(handle)) => {
                        let pending = PendingHandle { device, pool, req, size, api: call.api };
                        self.handles.insert((site.pid, handle), pending);
                    }
                    (None, None) => {
                        // The allocator gave up (after freeing its cache and retrying): out of memory.
                        self.stats(device).failures += 1;
                        let (status, out_of_memory, ptr, driver) = (0, true, None, None);
                        if !self.is_paused(site.pid) {
                            out.push(Output::Failed { site, device, status, out_of_memory, size: req, ptr, driver });
                            self.oom_snapshot(site, device, true, out);
                        }
                    }
                }
            }
            Op::PoolFree { pool, ptr, handle, device, .. } => {
                let by_handle = handle.and_then(|h| {
                    self.handles.remove(&(site.pid, h));
                    self.handle_ptrs.remove(&(site.pid, h))
                });
                if let Some(ptr) = ptr.or(by_handle) {
                    // A block allocated before an attach is unknown; its own device field (when
                    // the source reads it) still places its free, also on a thread whose device
                    // the trace never learnt.
                    let device = device.map_or_else(|| self.thread_device(site, call), DeviceKey::Npu);
                    self.remove_pool_block(site, ptr, pool, device, false, false, out);
                }
            }
            Op::PoolHandle { handle, ptr, size } => {
                if let Some(pending) = self.handles.get_mut(&(site.pid, handle)) {
                    pending.size = size.or(pending.size);
                }
                if let (Some(ptr), Some(pending)) = (ptr, self.handles.remove(&(site.pid, handle))) {
                    self.handle_ptrs.insert((site.pid, handle), ptr);
                    let site = Site { api: pending.api, ..site };
                    let size = pending.size.or(pending.req).unwrap_or(0);
                    self.add_pool_block(site, pending.device, pending.pool, ptr, size, pending.req, out);
                }
            }
            Op::MstxDomain { handle, ref name } => {
                let pool = match name.as_deref() {
                    Some("ptaCaching" | "msleaks") => Some(Pool::Caching),
                    Some("ptaWorkspace") => Some(Pool::Workspace),
                    _ => None,
                };
                if let (Some(handle), Some(pool)) = (handle, pool) {
                    self.domains.insert((site.pid, handle), pool);
                }
            }
            Op::MstxHeap { domain, device, total } => {
                let pool = self.domains.get(&(site.pid, domain)).copied();
                if let (Some(pool), Some(device), Some(total)) = (pool, device, total) {
                    let stats = self.pools.entry((DeviceKey::Npu(device), pool, site.pid)).or_default();
                    stats.total = total;
                    stats.peak_total = stats.peak_total.max(total);
                }
            }
            Op::MstxRegion { domain, register, device, ptr, size, .. } => {
                let pool = self.domains.get(&(site.pid, domain)).copied();
                let (Some(pool), Some(ptr)) = (pool, ptr) else { return };
                let device = device.map_or_else(|| self.thread_device(site, call), DeviceKey::Npu);
                if register {
                    self.add_pool_block(site, device, pool, ptr, size.unwrap_or(0), size, out);
                } else {
                    self.remove_pool_block(site, ptr, pool, device, false, false, out);
                }
            }
        }
    }

    /// Counts device memory taken inside a traced allocator call as that pool's segment.
    fn add_segment(
        &mut self,
        pid: u32,
        ptr: u64,
        device: DeviceKey,
        size: u64,
        outer: Option<Api>,
        out: &mut [Output],
    ) {
        let pool = match outer {
            Some(Api::WorkspaceMalloc | Api::AllocateWorkspace) => Pool::Workspace,
            Some(api) if api.family() == Family::TorchNpu => Pool::Caching,
            _ => return,
        };
        // The block's row was just produced by `add_block`: mark it as this pool's segment.
        if let Some(Output::Malloc { ptr: p, segment, .. }) = out.last_mut() {
            if *p == ptr {
                *segment = Some(pool);
            }
        }
        self.segments.insert((pid, ptr), Segment { device, pool, size });
        let stats = self.pools.entry((device, pool, pid)).or_default();
        stats.total += size;
        stats.peak_total = stats.peak_total.max(stats.total);
    }

    fn remove_segment(&mut self, pid: u32, ptr: u64) {
        if let Some(seg) = self.segments.remove(&(pid, ptr)) {
            let stats = self.pools.entry((seg.device, seg.pool, pid)).or_default();
            stats.total = stats.total.saturating_sub(seg.size);
        }
    }

    /// With only `allocate_workspace` probed, a device's workspace use ends when the next starts.
    fn end_open_workspace(&mut self, site: Site, device: DeviceKey, out: &mut Vec<Output>) {
        if let Some(ptr) = self.workspace_open.remove(&(site.pid, device)) {
            if self.pool_blocks.contains_key(&(site.pid, ptr)) {
                self.remove_pool_block(site, ptr, Pool::Workspace, device, false, true, out);
            }
        }
    }

    #[allow(clippy::too_many_arguments, reason = "a block's facts, each from a different source")]
    fn add_pool_block(
        &mut self,
        site: Site,
        device: DeviceKey,
        pool: Pool,
        ptr: u64,
        size: u64,
        req_size: Option<u64>,
        out: &mut Vec<Output>,
    ) {
        // Handed out again while we think it is live: the free was not seen (before the attach,
        // or lost). Retire the old one so `used` stays the allocator's.
        if self.pool_blocks.contains_key(&(site.pid, ptr)) {
            self.remove_pool_block(site, ptr, pool, device, true, false, out);
        }
        let allocation_id = self.next_allocation_id(device);
        let stats = self.pools.entry((device, pool, site.pid)).or_default();
        stats.used += size;
        stats.peak_used = stats.peak_used.max(stats.used);
        stats.live_blocks += 1;
        let (used, total) = (stats.used, stats.total);
        let labels = self.tags.block_labels(site.pid, site.tid);
        let hidden = self.is_paused(site.pid);
        if !hidden {
            let owner = OwnerBase::Pool(pool).owner(tags::of(&labels));
            out.push(Output::PoolMalloc { site, device, pool, ptr, size, req_size, allocation_id, used, total, owner });
        }
        let born_ns = site.wall_ns;
        let streams = Vec::new();
        let block = PoolBlock { device, pool, size, allocation_id, api: site.api, labels, hidden, born_ns, streams };
        self.pool_blocks.insert((site.pid, ptr), block);
    }

    #[allow(clippy::too_many_arguments, reason = "fallbacks for a block that was never seen")]
    fn remove_pool_block(
        &mut self,
        site: Site,
        ptr: u64,
        pool: Pool,
        fallback: DeviceKey,
        shadow: bool,
        implied: bool,
        out: &mut Vec<Output>,
    ) {
        match self.pool_blocks.remove(&(site.pid, ptr)) {
            Some(block) => {
                let stats = self.pools.entry((block.device, block.pool, site.pid)).or_default();
                stats.used -= block.size;
                stats.live_blocks -= 1;
                let (used, total) = (stats.used, stats.total);
                if block.hidden {
                    return;
                }
                let block_streams = block.streams.len() as u32;
                out.push(Output::PoolFree {
                    site,
                    device: block.device,
                    pool: block.pool,
                    ptr,
                    size: Some(block.size),
                    allocation_id: Some(block.allocation_id),
                    used,
                    total,
                    shadow,
                    implied,
                    stream_uses: block_streams,
                });
            }
            None => {
                self.stats(fallback).untracked_frees += 1;
                let stats = self.pools.entry((fallback, pool, site.pid)).or_default();
                let (used, total) = (stats.used, stats.total);
                if self.is_paused(site.pid) {
                    return;
                }
                let (size, allocation_id) = (None, None);
                let device = fallback;
                out.push(Output::PoolFree {
                    site,
                    device,
                    pool,
                    ptr,
                    size,
                    allocation_id,
                    used,
                    total,
                    shadow,
                    implied,
                    stream_uses: 0,
                });
            }
        }
    }

    /// `sizes` is (bytes taken, bytes requested).
    #[allow(clippy::too_many_arguments, reason = "one call site per origin; a struct would only rename them")]
    fn add_block(
        &mut self,
        site: Site,
        device: DeviceKey,
        space: Space,
        ptr: u64,
        sizes: (u64, u64),
        origin: Origin,
        out: &mut Vec<Output>,
    ) {
        let (size, req_size) = sizes;
        // The runtime handed out an address we still consider live: the free was missed (it
        // happened before an attach, or its record was dropped). Retire the stale block first so
        // the totals stay true to what the runtime says is allocated.
        if self.blocks.contains_key(&(site.pid, space, ptr)) {
            self.remove_block(site, space, ptr, device, true, None, out);
        }
        let base = match (space, origin) {
            (Space::Host | Space::Cpu, _) => OwnerBase::Host,
            (Space::Device, Origin::Direct { module, driver, .. }) => {
                OwnerBase::Hal(driver.and_then(|d| d.module).or(module))
            }
            // Mapped pages belong to the module that created their physical memory.
            (Space::Device, Origin::Mapped { handle, .. }) => {
                OwnerBase::Hal(self.physical.get(&(site.pid, handle)).and_then(|p| p.module))
            }
        };
        let allocation_id = self.next_allocation_id(device);
        let stats = self.stats(device);
        stats.used += size;
        stats.peak = stats.peak.max(stats.used);
        stats.live_blocks += 1;
        stats.mallocs += 1;
        let used = stats.used;
        let labels = self.tags.block_labels(site.pid, site.tid);
        let hidden = self.is_paused(site.pid);
        if !hidden {
            let owner = Some(base.owner(tags::of(&labels)));
            let segment = None;
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
            });
        }
        let born_ns = site.wall_ns;
        let block = Live { device, size, allocation_id, api: site.api, base, labels, hidden, born_ns };
        self.blocks.insert((site.pid, space, ptr), block);
    }

    #[allow(clippy::too_many_arguments, reason = "the fallback device and driver only matter for some callers")]
    fn remove_block(
        &mut self,
        site: Site,
        space: Space,
        ptr: u64,
        fallback: DeviceKey,
        shadow: bool,
        driver: Option<DriverInfo>,
        out: &mut Vec<Output>,
    ) {
        match self.blocks.remove(&(site.pid, space, ptr)) {
            Some(block) => {
                let stats = self.stats(block.device);
                stats.used -= block.size;
                stats.live_blocks -= 1;
                stats.frees += 1;
                let used = stats.used;
                if block.hidden {
                    return;
                }
                out.push(Output::Free {
                    site,
                    device: block.device,
                    space,
                    ptr,
                    size: Some(block.size),
                    allocation_id: Some(block.allocation_id),
                    used,
                    shadow,
                    driver,
                });
            }
            None => {
                let stats = self.stats(fallback);
                stats.frees += 1;
                stats.untracked_frees += 1;
                let used = stats.used;
                if self.is_paused(site.pid) {
                    return;
                }
                let (size, allocation_id) = (None, None);
                out.push(Output::Free {
                    site,
                    device: fallback,
                    space,
                    ptr,
                    size,
                    allocation_id,
                    used,
                    shadow,
                    driver,
                });
            }
        }
    }

    /// Ends the trace at `wall_ns`: held driver calls are applied, then every block still alive
    /// gets a shadow free one nanosecond later, in allocation order per device. Totals (`used`,
    /// `live_blocks`) are left as they were at the end, for the summary. Each fact goes to `emit`
    /// as it is made: with a million live blocks, a list of them all would double the memory the
    /// tracer holds at the stop.
    pub fn finish<E>(&mut self, wall_ns: u64, mut emit: impl FnMut(Output) -> Result<(), E>) -> Result<(), E> {
        let mut held = Vec::new();
        let tids: Vec<u32> = self.inner.keys().copied().collect();
        for tid in tids {
            self.flush_inner(tid, &mut held);
        }
        held.into_iter().try_for_each(&mut emit)?;
        let at = wall_ns.max(self.last_wall_ns) + 1;
        // By reference: at stop a million live blocks are common, and the DB waits for this.
        let mut live: Vec<(&(u32, Space, u64), &Live)> = self.blocks.iter().collect();
        live.sort_unstable_by_key(|(_, b)| (b.device, b.allocation_id));
        let mut used: BTreeMap<DeviceKey, u64> = self.devices.iter().map(|(k, v)| (*k, v.used)).collect();
        for (&(pid, space, ptr), block) in live {
            let remaining = used.entry(block.device).or_default();
            *remaining -= block.size;
            if block.hidden {
                continue;
            }
            emit(Output::Free {
                site: Site { api: block.api, wall_ns: at, pid, tid: pid, gc: false },
                device: block.device,
                space,
                ptr,
                size: Some(block.size),
                allocation_id: Some(block.allocation_id),
                used: *remaining,
                shadow: true,
                driver: None,
            })?;
        }
        let mut live: Vec<(&(u32, u64), &PoolBlock)> = self.pool_blocks.iter().collect();
        live.sort_unstable_by_key(|(_, b)| (b.device, b.pool, b.allocation_id));
        let mut used: BTreeMap<(DeviceKey, Pool, u32), u64> = self.pools.iter().map(|(k, v)| (*k, v.used)).collect();
        for (&(pid, ptr), block) in live {
            let remaining = used.entry((block.device, block.pool, pid)).or_default();
            *remaining -= block.size;
            if block.hidden {
                continue;
            }
            let total = self.pools.get(&(block.device, block.pool, pid)).map_or(0, |s| s.total);
            emit(Output::PoolFree {
                site: Site { api: block.api, wall_ns: at, pid, tid: pid, gc: false },
                device: block.device,
                pool: block.pool,
                ptr,
                size: Some(block.size),
                allocation_id: Some(block.allocation_id),
                used: *remaining,
                total,
                shadow: true,
                implied: false,
                stream_uses: 0,
            })?;
        }
        Ok(())
    }
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
    use super::*;

    fn call(api: Api, tid: u32, device: Option<u32>, status: i32, op: Op) -> Event {
        Event {
            wall_ns: 1_000 + u64::from(tid),
            pid: 100,
            tid,
            kind: EventKind::Call(Call {
                api,
                entry_wall_ns: 900,
                status,
                out_of_memory: status == 207_001,
                outer: None,
                thread_device: device,
                op,
            }),
        }
    }

    fn malloc(ptr: Option<u64>, size: u64, device: Option<u32>, status: i32) -> Event {
        call(
            Api::AclrtMalloc,
            1,
            device,
            status,
            Op::Malloc { space: Space::Device, size, ptr, policy: Some(0), device: None, module: None, driver: None },
        )
    }

    fn free(ptr: u64, device: Option<u32>) -> Event {
        call(Api::AclrtFree, 1, device, 0, Op::Free { space: Space::Device, ptr, driver: None })
    }

    fn run(events: &[Event]) -> (Tracker, Vec<Output>) {
        let mut t = Tracker::new();
        let mut out = Vec::new();
        for e in events {
            t.apply(e, &mut out);
        }
        (t, out)
    }

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
    fn malloc_then_free_pairs_with_size_and_id() {
        let (t, out) = run(&[malloc(Some(0x1000), 64, Some(1), 0), free(0x1000, Some(0))]);
        assert!(matches!(
            out[0],
            Output::Malloc { device: DeviceKey::Npu(1), size: 64, allocation_id: 1, used: 64, .. }
        ));
        // The free goes to the block's device even though the thread has moved to device 0.
        assert!(matches!(
            out[1],
            Output::Free {
                device: DeviceKey::Npu(1),
                size: Some(64),
                allocation_id: Some(1),
                used: 0,
                shadow: false,
                ..
            }
        ));
        let stats: Vec<_> = t.devices().collect();
        assert_eq!(stats[0].1.peak, 64);
        assert_eq!(stats[0].1.used, 0);
    }

    #[test]
    fn failed_malloc_is_no_block_and_no_leak() {
        let mut t = Tracker::new();
        let mut out = Vec::new();
        t.apply(&malloc(None, 1 << 40, Some(0), 207_001), &mut out);
        assert!(matches!(out[0], Output::Failed { status: 207_001, size: Some(s), .. } if s == 1 << 40));
        out.clear();
        t.finish(5_000, |o| {
            out.push(o);
            Ok::<_, ()>(())
        })
        .unwrap();
        assert!(out.is_empty(), "a failed allocation must not get a shadow free: {out:?}");
    }

    #[test]
    fn failed_free_keeps_the_block_alive() {
        let fail_free =
            call(Api::AclrtFree, 1, Some(0), 100_000, Op::Free { space: Space::Device, ptr: 0x10, driver: None });
        let (t, out) = run(&[malloc(Some(0x10), 8, Some(0), 0), fail_free]);
        assert!(matches!(out[1], Output::Failed { status: 100_000, ptr: Some(0x10), .. }));
        assert_eq!(t.devices().next().unwrap().1.live_blocks, 1);
    }

    #[test]
    fn unknown_free_is_recorded_without_size() {
        let (_, out) = run(&[free(0x99, None)]);
        assert!(matches!(out[0], Output::Free { device: DeviceKey::Unknown, size: None, allocation_id: None, .. }));
    }

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

    #[test]
    fn host_memory_goes_to_cpu() {
        let e = call(
            Api::AclrtMallocHost,
            1,
            Some(1),
            0,
            Op::Malloc {
                space: Space::Host,
                size: 10,
                ptr: Some(0x5),
                policy: None,
                device: None,
                module: None,
                driver: None,
            },
        );
        let (_, out) = run(&[e]);
        assert!(matches!(out[0], Output::Malloc { device: DeviceKey::Cpu, space: Space::Host, .. }));
    }

    #[test]
    fn finish_writes_shadow_frees_after_the_last_event() {
        let (mut t, _) = run(&[malloc(Some(0x1), 10, Some(0), 0), malloc(Some(0x2), 20, Some(0), 0)]);
        let mut out = Vec::new();
        t.finish(0, |o| {
            out.push(o);
            Ok::<_, ()>(())
        })
        .unwrap();
        assert_eq!(out.len(), 2);
        for o in &out {
            let Output::Free { shadow, site, .. } = o else { panic!("{o:?}") };
            assert!(*shadow);
            assert!(site.wall_ns > 1_001, "shadow frees come after the last real event");
        }
        assert!(matches!(out[1], Output::Free { used: 0, .. }));
        // Summary totals still show what was live at the end.
        assert_eq!(t.devices().next().unwrap().1.used, 30);
    }

    #[test]
    fn reused_address_retires_the_stale_block() {
        let (t, out) = run(&[malloc(Some(0x1), 10, Some(0), 0), malloc(Some(0x1), 20, Some(0), 0)]);
        assert!(matches!(out[1], Output::Free { shadow: true, size: Some(10), .. }));
        assert_eq!(t.devices().next().unwrap().1.used, 20);
    }

    fn with_outer(mut e: Event, outer: Api) -> Event {
        if let EventKind::Call(c) = &mut e.kind {
            c.outer = Some(outer);
        }
        e
    }

    fn driver_alloc(ptr: u64, size: u64, device: u32, module: u16) -> Event {
        let flag = u64::from(device) | (u64::from(module) << 56);
        let driver = DriverInfo { api: Api::HalMemAlloc, flag: Some(flag), size, module: Some(module), page: None };
        let op = Op::Malloc {
            space: Space::Device,
            size,
            ptr: Some(ptr),
            policy: None,
            device: Some(device),
            module: Some(module),
            driver: Some(driver),
        };
        call(Api::HalMemAlloc, 1, None, 0, op)
    }

    fn pool_malloc(ptr: u64, size: u64, device: u32) -> Event {
        let op = Op::PoolMalloc {
            pool: Pool::Caching,
            ptr: Some(ptr),
            size: Some(size),
            req: Some(size),
            device: Some(device),
            handle: None,
        };
        call(Api::DeviceCachingAllocatorMalloc, 1, None, 0, op)
    }

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
    fn each_process_has_its_own_pool_counters_on_a_shared_device() {
        let segment = |pid: u32, ptr: u64, size: u64| Event {
            pid,
            ..with_outer(malloc(Some(ptr), size, Some(0), 0), Api::DeviceCachingAllocatorMalloc)
        };
        let block = |pid: u32, ptr: u64, size: u64| Event { pid, ..pool_malloc(ptr, size, 0) };
        let (t, out) = run(&[
            segment(1, 0x10_0000, 2 << 20),
            block(1, 0x10_0000, 4096),
            segment(2, 0x90_0000, 4 << 20),
            block(2, 0x90_0000, 8192),
        ]);
        let Output::PoolMalloc { used, total, allocation_id, .. } = out[3] else { panic!("{out:?}") };
        assert_eq!((used, total), (8192, 4 << 20), "process 2's allocator, not the sum of both");
        assert_eq!(allocation_id, 4, "ids are per device file, whatever the process or layer");
        assert_eq!(t.pools().count(), 2);
    }

    #[test]
    fn runtime_allocations_inside_the_allocator_are_its_reserved_segments() {
        let segment = with_outer(malloc(Some(0x10_0000), 2 << 20, Some(0), 0), Api::DeviceCachingAllocatorMalloc);
        let (t, out) = run(&[segment, pool_malloc(0x10_0000, 4096, 0), malloc(Some(0x90_0000), 1 << 20, Some(0), 0)]);
        let Output::PoolMalloc { used, total, device, .. } = out[1] else { panic!("{out:?}") };
        assert_eq!((used, total, device), (4096, 2 << 20, DeviceKey::Npu(0)));
        assert!(matches!(out[0], Output::Malloc { segment: Some(Pool::Caching), .. }), "the row says it is a segment");
        assert!(matches!(out[2], Output::Malloc { segment: None, .. }));
        // A runtime allocation outside the allocator is no segment of it.
        let pool = t.pools().next().unwrap().1;
        assert_eq!((pool.used, pool.total), (4096, 2 << 20));
        let (_, out) = run(&[
            with_outer(malloc(Some(0x10_0000), 2 << 20, Some(0), 0), Api::DeviceCachingAllocatorMalloc),
            free(0x10_0000, Some(0)),
            pool_malloc(0x20_0000, 4096, 0),
        ]);
        assert!(
            matches!(out[2], Output::PoolMalloc { total: 0, .. }),
            "a freed segment is no longer reserved: {out:?}"
        );
    }

    #[test]
    fn a_pool_free_of_an_unknown_block_is_placed_by_the_blocks_own_device() {
        let op =
            Op::PoolFree { pool: Pool::Caching, ptr: Some(0x5000), handle: None, size: Some(4096), device: Some(1) };
        let (_, out) = run(&[call(Api::DeviceCachingAllocatorFree, 1, None, 0, op)]);
        let Output::PoolFree { device, size, .. } = out[0] else { panic!("{out:?}") };
        assert_eq!(device, DeviceKey::Npu(1));
        assert_eq!(size, None, "unknown to the trace, so Insight must skip it");
    }

    /// Every MALLOC-like output as (file, allocation_id, what).
    fn ids(out: &[Output]) -> Vec<(DeviceKey, u64, &'static str)> {
        out.iter()
            .filter_map(|o| match o {
                Output::Malloc { device, allocation_id, space, .. } => {
                    Some((*device, *allocation_id, space.event_type()))
                }
                Output::PoolMalloc { device, allocation_id, pool, .. } => Some((*device, *allocation_id, pool.owner())),
                _ => None,
            })
            .collect()
    }

    fn host_malloc(api: Api, space: Space, ptr: u64) -> Event {
        let op = Op::Malloc { space, size: 64, ptr: Some(ptr), policy: None, device: None, module: None, driver: None };
        call(api, 1, Some(0), 0, op)
    }

    fn workspace_malloc(ptr: u64, size: u64, device: u32) -> Event {
        let op = Op::PoolMalloc {
            pool: Pool::Workspace,
            ptr: Some(ptr),
            size: Some(size),
            req: Some(size),
            device: Some(device),
            handle: None,
        };
        call(Api::WorkspaceMalloc, 1, None, 0, op)
    }

    #[test]
    fn allocation_ids_are_unique_in_each_file_across_layers() {
        // A caching segment (HAL) and its first block (PTA) share an address; a workspace
        // segment and block; a plain runtime block; host pinned and CPU tensor memory. Insight
        // groups a file's ACCESS/MALLOC/FREE rows by allocation_id alone.
        let (_, out) = run(&[
            with_outer(malloc(Some(0x10_0000), 2 << 20, Some(0), 0), Api::DeviceCachingAllocatorMalloc),
            pool_malloc(0x10_0000, 4096, 0),
            with_outer(malloc(Some(0x40_0000), 1 << 20, Some(0), 0), Api::WorkspaceMalloc),
            workspace_malloc(0x40_0000, 1 << 20, 0),
            malloc(Some(0x90_0000), 512, Some(0), 0),
            pool_malloc(0x10_1000, 4096, 0),
            host_malloc(Api::AclrtMallocHost, Space::Host, 0x7000),
            host_malloc(Api::C10AllocCpu, Space::Cpu, 0x8000),
        ]);
        let all = ids(&out);
        assert_eq!(all.len(), 8, "{out:?}");
        let mut seen = std::collections::HashSet::new();
        for (device, id, what) in &all {
            assert!(seen.insert((*device, *id)), "{what} reuses id {id} in {device:?}'s file: {all:?}");
        }
        let npu0: Vec<u64> = all.iter().filter(|(d, _, _)| *d == DeviceKey::Npu(0)).map(|(_, id, _)| *id).collect();
        assert_eq!(npu0, [1, 2, 3, 4, 5, 6], "one counter for the whole file, in allocation order");
        let cpu: Vec<u64> = all.iter().filter(|(d, _, _)| *d == DeviceKey::Cpu).map(|(_, id, _)| *id).collect();
        assert_eq!(cpu, [1, 2]);
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

    #[test]
    fn every_device_block_has_an_owner() {
        let map = |va, handle| {
            call(Api::AclrtMapMem, 1, Some(0), 0, Op::Map { va, size: 2 << 20, offset: 0, handle, flags: 0 })
        };
        let physical = |handle, driver| {
            let op = Op::MallocPhysical { size: 2 << 20, handle: Some(handle), device: Some(0), flags: 0, driver };
            call(Api::AclrtMallocPhysical, 1, Some(0), 0, op)
        };
        let created =
            DriverInfo { api: Api::HalMemCreate, flag: Some(3 << 56), size: 2 << 20, module: Some(3), page: None };
        let (_, out) = run(&[
            malloc(Some(0x1000), 64, Some(0), 0), // a runtime call whose driver call was not seen
            physical(0xa, None),
            map(0x7000_0000, 0xa), // a mapping of memory whose creator was not seen
            physical(0xb, Some(created)),
            map(0x7020_0000, 0xb), // created by HCCL (module 3)
            driver_alloc(0x9000, 4096, 0, 33),
        ]);
        let owners: Vec<Option<String>> = out
            .iter()
            .filter_map(|o| match o {
                Output::Malloc { owner, .. } => Some(owner.clone()),
                _ => None,
            })
            .collect();
        let want = ["CANN@UNKNOWN", "CANN@UNKNOWN", &hal::owner(3), &hal::owner(33)];
        assert_eq!(owners, want.map(|o| Some(o.to_owned())));
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

    #[test]
    fn frees_of_blocks_never_seen_are_counted_apart() {
        let pool_free =
            Op::PoolFree { pool: Pool::Caching, ptr: Some(0x5000), handle: None, size: Some(4096), device: Some(0) };
        let (t, out) = run(&[
            free(0x99, Some(0)),
            call(Api::DeviceCachingAllocatorFree, 1, None, 0, pool_free),
            malloc(Some(0x1000), 8, Some(0), 0),
            free(0x1000, Some(0)),
        ]);
        assert!(matches!(out[0], Output::Free { size: None, allocation_id: None, .. }));
        let npu0 = t.devices().find(|(k, _)| *k == DeviceKey::Npu(0)).unwrap().1;
        assert_eq!((npu0.untracked_frees, npu0.frees), (2, 2), "a device and a pool block from before the trace");
    }
}
