//! The ACL runtime memory API (`acl_rt.h`; shared/reference/accelerator-apis.md §1 and §6).
//!
//! Argument positions follow the C signatures: `aclrtMalloc(void **devPtr, size_t size,
//! aclrtMemMallocPolicy policy)` has the out-pointer at 0, the size at 1, the policy at 2. The
//! size recorded is the one the caller asked for; what the driver really allocated (with the
//! runtime's padding) comes from the nested HAL call when libascend_hal.so is probed too.

use memscope_common::spec::{cfg_kind, device_effect, layer, FieldRead, ProbeSpec};

use super::op::{Op, Space};
use super::{named, spec, with_caller, Api, ApiDef, Family, RESULT};
use crate::raw::RawCall;

/// `ACL_ERROR_RT_MEMORY_ALLOCATION`: the runtime's out-of-memory status.
pub const ACL_ERROR_RT_MEMORY_ALLOCATION: i32 = 207_001;

/// `ACL_HOST_REG_PINNED`: `aclrtHostRegisterV2` page-locks the range. Without it the call maps
/// memory for the device that is pinned already (an `aclrtMallocHost` block, a common pattern),
/// which would then count twice; msMemScope counts only this flag, and so do we.
pub const ACL_HOST_REG_PINNED: u64 = 0x1000_0000;

/// `aclrtPhysicalMemProp.location.id`.
const PHYS_PROP_DEVICE_OFFSET: u32 = 12;

/// No pointer reads: the arguments say everything.
const PLAIN: ProbeSpec = spec(layer::RUNTIME, layer::POOL, &[]);
/// `*arg0` is the result (a pointer or a handle).
const OUT0: ProbeSpec = spec(layer::RUNTIME, layer::POOL, &[FieldRead::arg_at_exit(0, 0, 8)]);
/// [`OUT0`] of a call that takes memory: its caller may be a library that names the owner.
const ALLOC: ProbeSpec = with_caller(OUT0);

const fn with_cfg(mut s: ProbeSpec, cfg_arg: u32) -> ProbeSpec {
    s.cfg_kind = cfg_kind::MALLOC_CONFIG;
    s.cfg_arg = cfg_arg;
    s
}

const fn with_effect(mut s: ProbeSpec, effect: u32) -> ProbeSpec {
    s.device_effect = effect;
    s
}

fn oom(status: i32) -> bool {
    status == ACL_ERROR_RT_MEMORY_ALLOCATION
}

/// `aclrtMallocPhysical(*handle, size, prop, flags)`'s reads: `*handle` at return, `prop`'s
/// device at entry.
#[derive(Clone, Copy)]
enum Physical {
    Handle,
    Device,
}

const _: () = assert!(Physical::Handle as usize == RESULT, "RawCall::result reads the handle");

const fn row(api: Api, symbol: &'static str, spec: ProbeSpec, decode: fn(&RawCall) -> Op) -> ApiDef {
    ApiDef { out_of_memory: oom, ..ApiDef::plain(api, symbol, Family::AclRuntime, spec, decode) }
}

pub(super) static TABLE: [ApiDef; 18] = [
    row(Api::AclrtSetDevice, "aclrtSetDevice", with_effect(PLAIN, device_effect::SET_FROM_ARG0), |c| Op::SetDevice {
        device: c.args[0] as i32,
    }),
    row(
        Api::AclrtGetDevice,
        "aclrtGetDevice",
        with_effect(
            spec(layer::RUNTIME, layer::POOL, &[FieldRead::arg_at_exit(0, 0, 4)]),
            device_effect::SET_FROM_FIELD0,
        ),
        |c| Op::GetDevice { device: c.result().map(|v| v as i32) },
    ),
    row(Api::AclrtMalloc, "aclrtMalloc", ALLOC, device_malloc),
    row(Api::AclrtMallocAlign32, "aclrtMallocAlign32", ALLOC, device_malloc),
    row(Api::AclrtMallocCached, "aclrtMallocCached", ALLOC, device_malloc),
    row(Api::AclrtMallocWithCfg, "aclrtMallocWithCfg", with_cfg(ALLOC, 3), device_malloc),
    row(Api::AclrtFree, "aclrtFree", PLAIN, |c| Op::Free { space: Space::Device, ptr: c.args[0], driver: None }),
    row(Api::AclrtMallocHost, "aclrtMallocHost", ALLOC, |c| Op::Malloc {
        space: Space::Host,
        size: c.args[1],
        ptr: c.result(),
        policy: None,
        device: None,
        module: None,
        driver: None,
    }),
    row(Api::AclrtFreeHost, "aclrtFreeHost", PLAIN, |c| Op::Free { space: Space::Host, ptr: c.args[0], driver: None }),
    row(Api::AclrtReserveMemAddress, "aclrtReserveMemAddress", OUT0, |c| Op::Reserve {
        size: c.args[1],
        va: c.result(),
        alignment: c.args[2],
        flags: c.args[4],
    }),
    row(Api::AclrtReleaseMemAddress, "aclrtReleaseMemAddress", PLAIN, |c| Op::Release { va: c.args[0] }),
    row(
        Api::AclrtMallocPhysical,
        "aclrtMallocPhysical",
        with_caller(spec(
            layer::RUNTIME,
            layer::POOL,
            &named(&[
                (Physical::Handle as usize, FieldRead::arg_at_exit(0, 0, 8)),
                (Physical::Device as usize, FieldRead::arg_at_entry(2, PHYS_PROP_DEVICE_OFFSET, 4)),
            ]),
        )),
        |c| Op::MallocPhysical {
            size: c.args[1],
            handle: c.result(),
            device: c.field(Physical::Device as usize).map(|d| d as u32),
            flags: c.args[3],
            driver: None,
        },
    ),
    row(Api::AclrtFreePhysical, "aclrtFreePhysical", PLAIN, |c| Op::FreePhysical { handle: c.args[0], driver: None }),
    row(Api::AclrtMapMem, "aclrtMapMem", PLAIN, |c| Op::Map {
        va: c.args[0],
        size: c.args[1],
        offset: c.args[2],
        handle: c.args[3],
        flags: c.args[4],
    }),
    row(Api::AclrtUnmapMem, "aclrtUnmapMem", PLAIN, |c| Op::Unmap { va: c.args[0] }),
    // (void *ptr, uint64_t size, aclrtHostRegisterType type, void **devPtr): pins the range.
    row(Api::AclrtHostRegister, "aclrtHostRegister", with_caller(PLAIN), registered),
    // (void *ptr, uint64_t size, uint32_t flag)
    row(Api::AclrtHostRegisterV2, "aclrtHostRegisterV2", with_caller(PLAIN), |c| {
        if c.args[2] & ACL_HOST_REG_PINNED != 0 {
            registered(c)
        } else {
            Op::Scope
        }
    }),
    row(Api::AclrtHostUnregister, "aclrtHostUnregister", PLAIN, |c| Op::Free {
        space: Space::Registered,
        ptr: c.args[0],
        driver: None,
    }),
];

/// A registration of the caller's host memory (`ptr`, `size` at 0 and 1): pinned host memory
/// from its success on.
pub(super) fn registered(c: &RawCall) -> Op {
    Op::Malloc {
        space: Space::Registered,
        size: c.args[1],
        ptr: (c.status() == 0).then_some(c.args[0]),
        policy: None,
        device: None,
        module: None,
        driver: None,
    }
}

fn device_malloc(c: &RawCall) -> Op {
    Op::Malloc {
        space: Space::Device,
        size: c.args[1],
        ptr: c.result(),
        policy: Some(c.args[2]),
        device: c.cfg_device,
        module: c.cfg_module,
        driver: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_registration_pins_the_callers_range_and_v2_only_with_the_pinned_flag() {
        let mut call = crate::apis::call_with(Api::AclrtHostRegisterV2, [0x5000, 0x7000, 0x2, 0, 0, 0], [None; 4]);
        assert_eq!((Api::AclrtHostRegisterV2.def().decode)(&call), Op::Scope, "mapped only: pinned already");
        call.args[2] |= ACL_HOST_REG_PINNED;
        let op = (Api::AclrtHostRegisterV2.def().decode)(&call);
        assert!(matches!(op, Op::Malloc { space: Space::Registered, size: 0x7000, ptr: Some(0x5000), .. }), "{op:?}");
        call.ret = 100_000;
        assert!(matches!((Api::AclrtHostRegisterV2.def().decode)(&call), Op::Malloc { ptr: None, .. }));
        let v1 = crate::apis::call_with(Api::AclrtHostRegister, [0x6000, 0x1000, 0, 0x9000, 0, 0], [None; 4]);
        assert!(matches!(
            (Api::AclrtHostRegister.def().decode)(&v1),
            Op::Malloc { space: Space::Registered, ptr: Some(0x6000), .. }
        ));
        let un = crate::apis::call_with(Api::AclrtHostUnregister, [0x6000, 0, 0, 0, 0, 0], [None; 4]);
        assert_eq!(
            (Api::AclrtHostUnregister.def().decode)(&un),
            Op::Free { space: Space::Registered, ptr: 0x6000, driver: None }
        );
    }

    #[test]
    fn malloc_physical_decodes_the_handle_and_the_props_device_from_their_reads() {
        let call = crate::apis::call_reading(
            Api::AclrtMallocPhysical,
            &[(FieldRead::arg_at_exit(0, 0, 8), 0x77), (FieldRead::arg_at_entry(2, PHYS_PROP_DEVICE_OFFSET, 4), 3)],
        );
        let op = (Api::AclrtMallocPhysical.def().decode)(&call);
        assert!(matches!(op, Op::MallocPhysical { handle: Some(0x77), device: Some(3), .. }), "{op:?}");
    }
}
