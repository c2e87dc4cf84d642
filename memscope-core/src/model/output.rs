//! The facts the model hands to the store ([`Output`]), one per row (or per change of an
//! earlier row), in the order the events that made them happened; and the small types they
//! carry. The model makes them and never reads them back; `store::insight` turns them into rows.

use std::sync::Arc;

use super::event::{DeviceKey, DriverInfo, Pool, Space};
use crate::apis::Api;
use crate::vocab::EventType;

/// A block's owner path (`PTA@vllm@kv_cache`), shared by the rows of every block born under the
/// same allocator and spans.
pub type Owner = Arc<str>;

/// Where a block's owner path came from (`Attr.owner_source`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OwnerBy {
    /// Only the allocator's label: no marker span was open and no rule named a frame.
    #[default]
    Allocator,
    /// The markers' spans or address tags.
    Marker,
    /// The rules, from the allocation's Python stack ([`crate::infer`]).
    Inferred,
}

impl OwnerBy {
    /// The `owner_source` value; `None` for [`Self::Allocator`], which writes no key.
    pub fn as_str(self) -> Option<&'static str> {
        match self {
            Self::Allocator => None,
            Self::Marker => Some("marker"),
            Self::Inferred => Some("inferred"),
        }
    }
}

/// What a block's allocation says beyond its call: where its owner came from and the job's own
/// line that made it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockFrom {
    pub owner_by: OwnerBy,
    /// The innermost frame of the job's own code (`file:line function`), when the allocation
    /// had a Python stack ([`crate::infer::site`]).
    pub site: Option<Arc<str>>,
    /// The allocating thread ran no Python: the stack read was the main thread's.
    pub main_thread: bool,
}

/// Who did it and when.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Site {
    pub api: Api,
    pub wall_ns: u64,
    pub pid: u32,
    pub tid: u32,
    /// The call ran inside a pass of Python's garbage collector (a free the collector caused).
    pub gc: bool,
    /// The call's sampling weight ([`super::event::Call::sample_weight`]).
    pub weight: Option<u64>,
    /// The thread's Python stack at the call ([`super::event::Call::py_stack`]), or none.
    pub py_stack: crate::stacks::StackId,
    /// The library that made the call ([`super::event::Call::caller`]).
    pub caller: Option<crate::apis::libraries::Library>,
}

impl Site {
    /// A call of `api` at `wall_ns` on `pid`'s thread `tid`, outside the garbage collector,
    /// unsampled, with no Python stack: the tracer's own rows (shadow frees) and tests.
    pub fn of(api: Api, wall_ns: u64, pid: u32, tid: u32) -> Self {
        Self { api, wall_ns, pid, tid, gc: false, weight: None, py_stack: crate::stacks::NO_STACK, caller: None }
    }
}

/// The bytes a sampled block stands for: the call's weight is in requested bytes, and the block
/// holds `size` for each `req` of them (a ratio the sampling did not see, so it scales exactly).
pub fn block_weight(site: &Site, size: u64, req: Option<u64>) -> Option<u64> {
    let weight = site.weight?;
    Some(match req {
        Some(req) if req > 0 => (u128::from(weight) * u128::from(size) / u128::from(req)) as u64,
        _ => weight,
    })
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
        owner: Option<Owner>,
        /// Taken inside a framework allocator's call: a segment of that pool (its reserved
        /// memory, which the pool's blocks are carved from).
        segment: Option<Pool>,
        from: BlockFrom,
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
        /// The free was not seen: the daemon's window closed while the block was live, and the
        /// block was forgotten (`Tracker::forget_windowed`).
        implied: bool,
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
        /// The pool whose segment the call was taking (made inside its allocator's step).
        segment: Option<Pool>,
    },
    Vmm {
        site: Site,
        device: DeviceKey,
        step: VmmStep,
        addr: u64,
        size: Option<u64>,
        driver: Option<DriverInfo>,
        /// A release of a range or a handle the trace never saw made (before an attach): its
        /// device is the calling thread's, a guess, as for an unmatched `FREE`.
        unmatched: bool,
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
        /// The stream it was requested on, when the source gives it.
        stream: Option<u64>,
        allocation_id: u64,
        used: u64,
        total: u64,
        owner: Owner,
        from: BlockFrom,
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
        event_type: EventType,
        ptr: u64,
        owner: String,
        by: OwnerBy,
    },
    /// A block was used: read, written, or named in a kernel's arguments (`ACCESS` rows).
    Access {
        site: Site,
        device: DeviceKey,
        /// The block's row kind (`PTA`, `HAL`, `HOST`) and start address.
        block_type: EventType,
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
        block_type: EventType,
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
    OpLaunch { wall_ns: u64, pid: u32, tid: u32, start: bool, name: String },
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
    KernelLaunch { site: Site, device: DeviceKey, name: Option<String>, function: u64, stream: u64, args_size: u64 },
    /// One of the live blocks listed with an out-of-memory trigger (`OOM_RECENT_ALLOC` /
    /// `OOM_TOP_ALLOC` rows, right after the `OOM_TRIGGER` of `site`).
    OomBlock {
        site: Site,
        device: DeviceKey,
        /// true: among the most recent; false: among the largest.
        recent: bool,
        rank: usize,
        block_type: EventType,
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
        /// Found from the job's Python frames, not given by a marker.
        inferred: bool,
    },
    /// A mark or range boundary (`MSTX` rows). `api` is the mstx call, `None` for the markers
    /// package.
    Mstx { wall_ns: u64, pid: u32, tid: u32, api: Option<Api>, kind: MstxKind, id: Option<u64>, message: String },
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
