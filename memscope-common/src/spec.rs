//! Probe specs: what the generic call probes must capture for one API.
//!
//! The BPF side never knows API names. Userspace writes one [`ProbeSpec`] per API into an array map
//! and attaches every symbol with the spec's index as its cookie; the probes read the spec and act
//! on it. Adding an API is a table row in userspace, not new BPF code.

/// Size of the spec array map. Cookies at or above it are ignored by the probes.
pub const MAX_SPECS: u32 = 256;

/// Nesting domains. Calls of the same layer nested on one thread (a public forwarder calling its
/// `...Impl`, or one allocation API calling another) produce one record for the outermost call.
pub mod layer {
    /// The ACL runtime (`aclrt*`).
    pub const RUNTIME: u32 = 1;
    /// Layers a thread can have calls open in at once; layer ids run 1..=SLOTS.
    pub const SLOTS: usize = 4;
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
    /// An `aclError`-style status: 0 is success.
    pub const STATUS: u32 = 0;
    /// The return value carries no status.
    pub const NONE: u32 = 1;
}

/// Extra structures read at return through a pointer argument.
pub mod cfg_kind {
    pub const NONE: u32 = 0;
    /// `aclrtMallocConfig { aclrtMallocAttribute *attrs; size_t numAttrs; }`, scanned for the
    /// DEVICE_ID and MODULE_ID attributes.
    pub const MALLOC_CONFIG: u32 = 1;
    /// `aclrtPhysicalMemProp`, whose `location.id` is the device.
    pub const PHYSICAL_PROP: u32 = 2;
}

/// What a successful call does to the thread's current device, tracked in the kernel so that
/// later calls on the thread carry it.
pub mod device_effect {
    pub const NONE: u32 = 0;
    /// Argument 0 is the new device (`aclrtSetDevice(int32_t deviceId)`).
    pub const SET_FROM_ARG0: u32 = 1;
    /// The out-pointer's value is the current device (`aclrtGetDevice(int32_t *deviceId)`).
    pub const SET_FROM_OUT: u32 = 2;
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
    /// `aclrtPhysicalMemProp.location.id`.
    pub const PHYS_PROP_DEVICE_OFFSET: u64 = 12;
}

/// One API's capture rules, indexed by attach cookie.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProbeSpec {
    /// Nesting domain ([`layer`]). 0 marks an unused slot: probes with that cookie do nothing.
    pub layer: u32,
    /// A [`ret_kind`] value.
    pub ret_kind: u32,
    /// Index of the argument whose pointee is read at return, or -1.
    pub out_arg: i32,
    /// Width in bytes of that pointee: 4 or 8.
    pub out_width: u32,
    /// A [`cfg_kind`] value.
    pub cfg_kind: u32,
    /// Index of the argument that points to the config struct.
    pub cfg_arg: u32,
    /// A [`device_effect`] value.
    pub device_effect: u32,
    pub _reserved: u32,
}

const _: () = assert!(core::mem::size_of::<ProbeSpec>() == 32);
