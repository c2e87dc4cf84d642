//! Probe specs: what the generic call probes must capture for one API.
//!
//! The BPF side never knows API names. Userspace writes one [`ProbeSpec`] per API into an array map
//! and attaches every symbol with a cookie naming the spec and its layer; the probes read the spec
//! and act on it. Adding an API is a table row in userspace, not new BPF code.

/// Size of the spec array map. Cookies at or above it are ignored by the probes.
pub const MAX_SPECS: u32 = 256;

/// Nesting domains. Calls of the same layer nested on one thread (a public forwarder calling its
/// `...Impl`, one allocation API calling another) produce one record for the outermost call.
/// Calls of different layers each produce a record; a record names the call open in its spec's
/// `outer_layer` on the same thread, so userspace can merge a driver allocation into the runtime
/// call that made it.
pub mod layer {
    /// The ACL runtime (`aclrt*`).
    pub const RUNTIME: u32 = 1;
    /// The driver (`hal*` in libascend_hal.so).
    pub const HAL: u32 = 2;
    /// Framework memory pools (torch_npu's caching and workspace allocators).
    pub const POOL: u32 = 3;
    /// mstx memory-region reports (a pool describing its blocks; usually from inside a pool call).
    pub const MSTX: u32 = 4;
    /// The Python interpreter's cyclic garbage collector (a collection pass): frees reported
    /// inside it were made by the collector, not by the program dropping its last reference.
    pub const GC: u32 = 5;
    /// A framework operator's execution (ATB's `Runner::Execute`): an operator nested in another
    /// (a graph's nodes) is part of it, while the allocations and launches it makes are layers
    /// of their own.
    pub const OPERATOR: u32 = 6;
    /// Open-call slots per thread, a power of two above the highest layer id (ids 1..SLOTS).
    pub const SLOTS: usize = 8;
}

/// The attach cookie: the spec index in the low half, its layer in the high half, so the return
/// probe finds the thread's open call without looking the spec up first.
pub const fn cookie(spec_id: u32, layer: u32) -> u64 {
    ((layer as u64) << 32) | spec_id as u64
}

/// `(spec_id, layer)` of a cookie.
pub const fn split_cookie(cookie: u64) -> (u32, u32) {
    (cookie as u32, (cookie >> 32) as u32)
}

/// How the return register is interpreted.
pub mod ret_kind {
    /// An `aclError`/`drvError_t`-style status: 0 is success.
    pub const STATUS: u32 = 0;
    /// The return value carries no status (void functions, or a pointer/handle result).
    pub const NONE: u32 = 1;
}

/// Structures read with a loop the generic field reads cannot express.
pub mod cfg_kind {
    pub const NONE: u32 = 0;
    /// `aclrtMallocConfig { aclrtMallocAttribute *attrs; size_t numAttrs; }`, scanned for the
    /// DEVICE_ID and MODULE_ID attributes.
    pub const MALLOC_CONFIG: u32 = 1;
}

/// What a successful call does to the thread's current device, tracked in the kernel so that
/// later calls on the thread carry it.
pub mod device_effect {
    pub const NONE: u32 = 0;
    /// Argument 0 is the new device (`aclrtSetDevice(int32_t deviceId)`).
    pub const SET_FROM_ARG0: u32 = 1;
    /// Field 0 is the current device (`aclrtGetDevice(int32_t *deviceId)`).
    pub const SET_FROM_FIELD0: u32 = 2;
}

/// Layout facts of the ACL structures the probes read (from `acl_rt.h`; see
/// docs/architecture.md). Each `aclrtMallocAttribute` is `{u32 attr; union(8 bytes, align 4)}`.
pub mod acl_layout {
    pub const MALLOC_ATTR_SIZE: u64 = 12;
    pub const MALLOC_ATTR_VALUE_OFFSET: u64 = 4;
    /// At most this many attributes are scanned; a bounded loop keeps the verifier happy.
    pub const MALLOC_ATTR_MAX: u64 = 8;
    pub const ATTR_MODULE_ID: u32 = 1;
    pub const ATTR_DEVICE_ID: u32 = 2;
}

/// Where a field read starts.
pub mod field_source {
    pub const NONE: u8 = 0;
    /// The value of argument `arg`.
    pub const ARG: u8 = 1;
    /// The return value.
    pub const RET: u8 = 2;
    /// The caller's address: the call's return address at entry (x86-64: the word at the stack
    /// pointer; arm64: the link register), with no pointer followed. It names the library that
    /// called (NCCL, HCCL, cuBLAS taking memory straight from the runtime or driver) for one
    /// register or stack read, where a stack walk costs a hundred times that.
    pub const CALLER: u8 = 3;
}

/// Reads one value through pointers: start from an argument or the return value, follow up to
/// [`MAX_HOPS`] pointers (`p = *(u64 *)(p + hop_offset[i])`), then read `width` bytes at
/// `p + offset`. Covers out-pointers (`*arg0`), struct fields (`prop->devid`), fields of a
/// returned object (`block->size`) and of an array behind a pointer (`batch->descs[0].ptr`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FieldRead {
    /// A [`field_source`] value.
    pub source: u8,
    pub arg: u8,
    /// 1, 2, 4 or 8.
    pub width: u8,
    /// 1: read at function entry (the object may be gone at return, e.g. a block being freed).
    pub at_entry: u8,
    pub hops: u8,
    pub _pad: [u8; 3],
    pub hop_offset: [u16; MAX_HOPS],
    pub offset: u32,
}

pub const MAX_HOPS: usize = 2;
/// Field reads per spec (and values per record).
pub const MAX_FIELDS: usize = 4;

impl FieldRead {
    pub const NONE: Self =
        Self { source: 0, arg: 0, width: 0, at_entry: 0, hops: 0, _pad: [0; 3], hop_offset: [0; MAX_HOPS], offset: 0 };

    /// `*(T *)(arg + offset)` read at return (out-pointers and structs the call filled in).
    pub const fn arg_at_exit(arg: u8, offset: u32, width: u8) -> Self {
        Self { source: field_source::ARG, arg, width, offset, ..Self::NONE }
    }

    /// `*(T *)(arg + offset)` read at entry.
    pub const fn arg_at_entry(arg: u8, offset: u32, width: u8) -> Self {
        Self { at_entry: 1, ..Self::arg_at_exit(arg, offset, width) }
    }

    /// `*(T *)(ret + offset)`: a field of a returned object.
    pub const fn ret_field(offset: u32, width: u8) -> Self {
        Self { source: field_source::RET, width, offset, ..Self::NONE }
    }

    /// The caller's address ([`field_source::CALLER`]), read at entry.
    pub const fn caller() -> Self {
        Self { source: field_source::CALLER, width: 8, at_entry: 1, ..Self::NONE }
    }

    /// `*(T *)(*(u64 *)(arg + hop) + offset)`, read at entry.
    pub const fn arg_via_at_entry(arg: u8, hop: u16, offset: u32, width: u8) -> Self {
        Self { source: field_source::ARG, arg, width, at_entry: 1, hops: 1, offset, hop_offset: [hop, 0], _pad: [0; 3] }
    }
}

/// Where a sampling rule finds one value of a call.
pub mod value_at {
    /// Nowhere: the rule has no such value.
    pub const NONE: u8 = 0;
    /// Argument `index`.
    pub const ARG: u8 = 1;
    /// The spec's field read `index` (entry-time reads for a free, return-time for an alloc).
    pub const FIELD: u8 = 2;
    /// The return value.
    pub const RET: u8 = 3;
    /// The device the thread last set (for a block's device only).
    pub const THREAD_DEVICE: u8 = 4;
}

/// What sampling does with an API's calls (`memscope-bpf daemon --sample-bytes`).
pub mod sample_kind {
    /// Always recorded (device-level calls, markers, everything that is not a pool block).
    pub const NONE: u8 = 0;
    /// Hands out a block: recorded when the sampler picks it; counted always.
    pub const ALLOC: u8 = 1;
    /// Takes a block back: recorded when its allocation was; counted always.
    pub const FREE: u8 = 2;
}

/// A family of sampled blocks, counted apart in the kernel's exact counters.
pub mod sample_class {
    /// torch_npu's caching allocator.
    pub const CACHING: u8 = 1;
    /// torch_npu's workspace allocator.
    pub const WORKSPACE: u8 = 2;
    /// PyTorch's CPU allocator (host memory).
    pub const CPU: u8 = 3;
}

/// The values a sampled API's call is weighed and counted by, each a ([`value_at`], index)
/// pair: for an alloc, the requested bytes (known at entry, so the decision and the stack capture
/// that depends on it happen there), the block's size and address and its device (known at
/// return); for a free, the address (at entry).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SampleRule {
    /// A [`sample_kind`] value.
    pub kind: u8,
    /// A [`sample_class`] value.
    pub class: u8,
    pub request: [u8; 2],
    /// The block's size; when absent, the request is.
    pub size: [u8; 2],
    pub ptr: [u8; 2],
    /// The block's device; when absent, `device_else`; when that is too, -1 (host memory, or
    /// not known).
    pub device: [u8; 2],
    pub device_else: [u8; 2],
    /// 1: a free counted and recorded at entry, with no return probe (set by the loader for the
    /// daemon: a free returns nothing the record needs, and its return trap is a third of the
    /// cost of an allocation and its free).
    pub at_entry_only: u8,
    /// The daemon's window this spec's probes were last attached for (mod 256; 0: not
    /// windowed). A call left open on a thread when its probes went (its return never seen)
    /// belongs to an older window, so the next window's first call replaces it rather than
    /// nesting in it.
    pub window: u8,
    pub _pad: [u8; 2],
}

impl SampleRule {
    pub const NONE: Self = Self {
        kind: 0,
        class: 0,
        request: [0; 2],
        size: [0; 2],
        ptr: [0; 2],
        device: [0; 2],
        device_else: [0; 2],
        at_entry_only: 0,
        window: 0,
        _pad: [0; 2],
    };
}

/// One API's capture rules, indexed by attach cookie.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProbeSpec {
    /// Nesting domain ([`layer`]). 0 marks an unused slot: probes with that cookie do nothing.
    pub layer: u32,
    /// The layer whose open call this one is reported inside of (0: none).
    pub outer_layer: u32,
    /// A [`ret_kind`] value.
    pub ret_kind: u32,
    /// A [`cfg_kind`] value.
    pub cfg_kind: u32,
    /// Index of the argument that points to the config struct.
    pub cfg_arg: u32,
    /// A [`device_effect`] value.
    pub device_effect: u32,
    /// Argument holding a C string copied into the record (up to [`crate::record::TEXT_LEN`]
    /// bytes), or -1.
    pub text_arg: i32,
    /// Argument pointing at a buffer copied at entry into a [`crate::record::BlobRecord`]
    /// (kernel launch arguments), or -1.
    pub blob_arg: i16,
    /// Argument holding that buffer's length in bytes (at most [`crate::record::BLOB_LEN`] are
    /// copied).
    pub blob_len_arg: i16,
    pub fields: [FieldRead; MAX_FIELDS],
    /// What sampling does with its calls.
    pub sample: SampleRule,
}

impl ProbeSpec {
    pub const EMPTY: Self = Self {
        layer: 0,
        outer_layer: 0,
        ret_kind: ret_kind::STATUS,
        cfg_kind: cfg_kind::NONE,
        cfg_arg: 0,
        device_effect: device_effect::NONE,
        text_arg: -1,
        blob_arg: -1,
        blob_len_arg: -1,
        fields: [FieldRead::NONE; MAX_FIELDS],
        sample: SampleRule::NONE,
    };

    /// Whether any field is read at entry (the entry probe only looks at the spec then).
    pub fn reads_at_entry(&self) -> bool {
        self.fields.iter().any(|f| f.source != field_source::NONE && f.at_entry == 1)
    }

    /// Whether a call's record needs nothing from its return: a sampled free that returns no
    /// status and reads nothing then, whose record can be sent from its entry probe alone.
    pub fn complete_at_entry(&self) -> bool {
        self.sample.kind == sample_kind::FREE
            && self.ret_kind == ret_kind::NONE
            && self.text_arg < 0
            && self.cfg_kind == cfg_kind::NONE
            && self.device_effect == device_effect::NONE
            && !self.fields.iter().any(|f| f.source != field_source::NONE && f.at_entry == 0)
    }
}

const _: () = assert!(core::mem::size_of::<FieldRead>() == 16);
const _: () = assert!(core::mem::size_of::<SampleRule>() == 16);
const _: () = assert!(core::mem::size_of::<ProbeSpec>() == 32 + 16 * MAX_FIELDS + 16);
