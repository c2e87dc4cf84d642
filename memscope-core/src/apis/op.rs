//! What a traced call did, as the catalogue decodes it ([`Op`], with the memory kinds, pools,
//! driver facts and markers it names): below the model, which works on these, so that `apis`
//! needs nothing from the layers above it.
//!
//! Only what a decoder produces lives here; what the DB calls these (an Event Type, an owner
//! label) is the model's and the store's (`impl Space` and `impl Pool` in `model::event`).

use super::Api;

/// Where memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Space {
    /// Accelerator memory (one device's HBM).
    Device,
    /// Host memory handed out by the runtime (`aclrtMallocHost`, pinned).
    Host,
    /// Ordinary host memory from a framework's CPU allocator (PyTorch's `c10::alloc_cpu`).
    Cpu,
    /// Host memory the program allocated itself and had the runtime or driver pin
    /// (`aclrtHostRegister`, `cudaHostRegister`, `cuMemHostRegister`): kept apart from the
    /// runtime's own host blocks, as the same range may be both (an `aclrtMallocHost` block
    /// registered for the device), and unregistering it frees nothing.
    Registered,
}

/// Page size class of driver memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageType {
    Normal,
    Huge,
    Giant,
}

impl PageType {
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Normal => "normal",
            Self::Huge => "huge",
            Self::Giant => "giant",
        }
    }
}

/// What the driver call behind an allocation said: set on a driver call itself, and on a runtime
/// call that a driver call ran inside of (merged into one fact, as one row).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DriverInfo {
    pub api: Api,
    /// `halMemAlloc`'s flag, or `halMemCreate`'s.
    pub flag: Option<u64>,
    /// Bytes the driver was asked for (the runtime pads requests).
    pub size: u64,
    pub module: Option<u16>,
    pub page: Option<PageType>,
}

/// A framework allocator's pool (msMemScope's PTA and PTA workspace).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Pool {
    /// torch_npu's caching allocator (tensors; also the external MallocBlock path).
    Caching,
    /// torch_npu's workspace allocator (operator scratch memory).
    Workspace,
}

/// What one call did, decoded from its arguments and results.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// An allocation. `ptr` is `None` when it failed. `device` is set when the call names its
    /// device itself (a malloc config's DEVICE_ID attribute, a driver flag); otherwise the
    /// thread's device counts. `size` is what this API was asked for.
    Malloc {
        space: Space,
        size: u64,
        ptr: Option<u64>,
        policy: Option<u64>,
        device: Option<u32>,
        module: Option<u16>,
        driver: Option<DriverInfo>,
    },
    Free {
        space: Space,
        ptr: u64,
        driver: Option<DriverInfo>,
    },
    /// Virtual address space only: not memory until something is mapped into it.
    Reserve {
        size: u64,
        va: Option<u64>,
        alignment: u64,
        flags: u64,
    },
    Release {
        va: u64,
    },
    /// Physical memory behind a handle; it becomes addressable (and counted) when mapped.
    MallocPhysical {
        size: u64,
        handle: Option<u64>,
        device: Option<u32>,
        flags: u64,
        driver: Option<DriverInfo>,
    },
    FreePhysical {
        handle: u64,
        driver: Option<DriverInfo>,
    },
    Map {
        va: u64,
        size: u64,
        offset: u64,
        handle: u64,
        flags: u64,
    },
    Unmap {
        va: u64,
    },
    /// A framework allocator handed out a block. `ptr` is `None` when it failed or is not known
    /// yet (an external block known by its handle until `GetBlockPtr`). `size` is the block's
    /// size when the probe could read it, `req` what was asked for.
    PoolMalloc {
        pool: Pool,
        ptr: Option<u64>,
        size: Option<u64>,
        req: Option<u64>,
        device: Option<u32>,
        handle: Option<u64>,
        /// The stream it was requested on: the caching allocator keeps its free blocks per
        /// stream, so a replay of the requests (`analysis::simulate`) needs it.
        stream: Option<u64>,
    },
    /// A framework allocator took a block back, by address or by handle.
    PoolFree {
        pool: Pool,
        ptr: Option<u64>,
        handle: Option<u64>,
        size: Option<u64>,
        device: Option<u32>,
    },
    /// What an external block handle stands for (`GetBlockPtr`, `GetBlockSize`).
    PoolHandle {
        handle: u64,
        ptr: Option<u64>,
        size: Option<u64>,
    },
    /// An mstx domain was created; pools report their blocks in their own domain.
    MstxDomain {
        handle: Option<u64>,
        name: Option<String>,
    },
    /// A pool reported its reserved bytes on a device (`mstxMemHeapRegister`).
    MstxHeap {
        domain: u64,
        device: Option<u32>,
        total: Option<u64>,
    },
    /// A pool reported a block handed out or taken back (`mstxMemRegions(Un)Register`).
    MstxRegion {
        domain: u64,
        register: bool,
        count: Option<u64>,
        device: Option<u32>,
        ptr: Option<u64>,
        size: Option<u64>,
    },
    SetDevice {
        device: i32,
    },
    /// An mstx mark or range (`mstxMarkA`, `mstxRangeStartA`, ...): a marker like the USDT ones.
    Marker(Marker),
    /// `size` bytes copied from `src` to `dst` (either may be host memory).
    Copy {
        dst: u64,
        src: u64,
        size: u64,
    },
    /// `size` bytes at `ptr` set.
    Set {
        ptr: u64,
        size: u64,
    },
    /// A kernel launched with this argument buffer (as copied at entry; empty if unreadable).
    Launch {
        function: u64,
        args: Vec<u8>,
        args_size: u64,
        stream: u64,
    },
    /// A kernel argument list on a handle: created (`append: None`, the list starts empty) or one
    /// parameter appended (its bytes, as copied at the call).
    KernelArgs {
        handle: u64,
        append: Option<Vec<u8>>,
    },
    /// A kernel launched with the argument list built on `handle`.
    LaunchArgs {
        function: u64,
        handle: u64,
        stream: u64,
    },
    /// The kernel a function handle stands for.
    KernelName {
        function: Option<u64>,
        name: Option<String>,
    },
    GetDevice {
        device: Option<i32>,
    },
    /// The pool block at `ptr` was marked as used by `stream` (`record`), or the mark was erased:
    /// freed while marked, the allocator keeps it until that stream's work completes.
    StreamMark {
        ptr: Option<u64>,
        stream: u64,
        record: bool,
    },
    /// A call that changes nothing by itself: a framework allocator's internal step, traced so
    /// that the device calls made inside it are known as its pool's segments (PyTorch's CUDA
    /// `alloc_block`, `map_block`), or a call with nothing to do (`cudaFree(NULL)`, which
    /// programs make to create the context).
    Scope,
    /// A pass of Python's cyclic garbage collector over `generation` (0-2) ended; the frees it
    /// caused came before it, each naming it as their outer call.
    GcPass {
        generation: i32,
    },
    /// An ATB operation ran (`atb::Runner::Execute`) with the workspace its caller allocated:
    /// `workspace_size` bytes of kernel scratch at `workspace`, followed by `intermediate_size`
    /// bytes of the graph's intermediate tensors. `runner` (the Runner object) names the
    /// operation within its process. Sizes are `None` when the probe could not read them.
    AtbExecute {
        runner: u64,
        workspace: Option<u64>,
        workspace_size: Option<u64>,
        intermediate_size: Option<u64>,
    },
}

/// msMemScope's owner levels (`OwnerLevel`): where a tag sits in an owner path.
#[allow(
    dead_code,
    reason = "the full list as msMemScope defines it; the markers name every level (all used by the tests)"
)]
pub mod level {
    pub const FRAMEWORK: u8 = 0;
    pub const COMPONENT: u8 = 1;
    pub const PROCESS: u8 = 2;
    pub const DETAIL_1: u8 = 3;
    pub const DETAIL_2: u8 = 4;
    /// User labels; a thread's open user spans fill USER_DEFINED_1..3 in the order they opened.
    pub const USER_DEFINED_1: u8 = 5;
    pub const USER_DEFINED_3: u8 = 7;
}

/// A marker fired by the traced program: a tag span, an address tag, a step, a mark or a range
/// (from the markers package's USDT probes, or from mstx calls).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Marker {
    /// A span opens on the thread: later allocations of the thread carry `label` at `level`.
    TagPush {
        level: u8,
        label: String,
    },
    TagPop {
        level: u8,
        label: String,
    },
    /// The block containing `addr` is owned by `label` at `level` (wins over spans).
    AddrTag {
        addr: u64,
        level: u8,
        label: String,
    },
    /// A training step begins; `number` when the marker counts them.
    Step {
        number: Option<u64>,
    },
    Mark {
        message: String,
    },
    RangeStart {
        id: u64,
        message: String,
    },
    RangeEnd {
        id: u64,
    },
    /// The program asked the tracer to record (`true`) or not (`false`) from here on.
    Collect {
        on: bool,
    },
    /// An operator begins on the thread (`aten.mm.default`; markers `trace_ops()`).
    OpStart {
        name: String,
    },
    /// The operator of that name ends on the thread.
    OpEnd {
        name: String,
    },
    /// The thread's current operator reads (`write` false) or writes `size` bytes at `ptr`;
    /// `desc` is the tensor's dtype and shape as the markers send it (`float32[4,8]`).
    TensorAccess {
        ptr: u64,
        size: u64,
        write: bool,
        desc: Option<String>,
    },
}
