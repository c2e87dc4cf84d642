//! The ACL runtime memory API (`acl_rt.h`; shared/reference/accelerator-apis.md §1 and §6).
//!
//! Argument positions follow the C signatures: `aclrtMalloc(void **devPtr, size_t size,
//! aclrtMemMallocPolicy policy)` has the out-pointer at 0, the size at 1, the policy at 2. The
//! size recorded is the one the caller asked for; the runtime's own padding is not visible here.

use memscope_common::spec::{cfg_kind, device_effect, layer, ret_kind, ProbeSpec};

use super::{Api, ApiDef, Family};
use crate::model::{Op, Space};
use crate::record::RawCall;

const fn spec(out_arg: i32, out_width: u32, cfg: u32, cfg_arg: u32, effect: u32) -> ProbeSpec {
    ProbeSpec {
        layer: layer::RUNTIME,
        ret_kind: ret_kind::STATUS,
        out_arg,
        out_width,
        cfg_kind: cfg,
        cfg_arg,
        device_effect: effect,
        _reserved: 0,
    }
}

/// No pointer reads: the arguments say everything.
const PLAIN: ProbeSpec = spec(-1, 0, cfg_kind::NONE, 0, device_effect::NONE);
/// `*arg0` is the result (a pointer or a handle).
const OUT0: ProbeSpec = spec(0, 8, cfg_kind::NONE, 0, device_effect::NONE);

const fn row(api: Api, symbol: &'static str, spec: ProbeSpec, decode: fn(&RawCall) -> Op) -> ApiDef {
    ApiDef { api, symbol, family: Family::AclRuntime, spec, decode }
}

pub(super) static TABLE: [ApiDef; 15] = [
    row(Api::AclrtSetDevice, "aclrtSetDevice", spec(-1, 0, cfg_kind::NONE, 0, device_effect::SET_FROM_ARG0), |c| {
        Op::SetDevice { device: c.args[0] as i32 }
    }),
    row(Api::AclrtGetDevice, "aclrtGetDevice", spec(0, 4, cfg_kind::NONE, 0, device_effect::SET_FROM_OUT), |c| {
        Op::GetDevice { device: c.result().map(|v| v as i32) }
    }),
    row(Api::AclrtMalloc, "aclrtMalloc", OUT0, device_malloc),
    row(Api::AclrtMallocAlign32, "aclrtMallocAlign32", OUT0, device_malloc),
    row(Api::AclrtMallocCached, "aclrtMallocCached", OUT0, device_malloc),
    row(
        Api::AclrtMallocWithCfg,
        "aclrtMallocWithCfg",
        spec(0, 8, cfg_kind::MALLOC_CONFIG, 3, device_effect::NONE),
        device_malloc,
    ),
    row(Api::AclrtFree, "aclrtFree", PLAIN, |c| Op::Free { space: Space::Device, ptr: c.args[0] }),
    row(Api::AclrtMallocHost, "aclrtMallocHost", OUT0, |c| Op::Malloc {
        space: Space::Host,
        size: c.args[1],
        ptr: c.result(),
        policy: None,
        device: None,
        module: None,
    }),
    row(Api::AclrtFreeHost, "aclrtFreeHost", PLAIN, |c| Op::Free { space: Space::Host, ptr: c.args[0] }),
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
        spec(0, 8, cfg_kind::PHYSICAL_PROP, 2, device_effect::NONE),
        |c| Op::MallocPhysical { size: c.args[1], handle: c.result(), device: c.cfg_device, flags: c.args[3] },
    ),
    row(Api::AclrtFreePhysical, "aclrtFreePhysical", PLAIN, |c| Op::FreePhysical { handle: c.args[0] }),
    row(Api::AclrtMapMem, "aclrtMapMem", PLAIN, |c| Op::Map {
        va: c.args[0],
        size: c.args[1],
        offset: c.args[2],
        handle: c.args[3],
        flags: c.args[4],
    }),
    row(Api::AclrtUnmapMem, "aclrtUnmapMem", PLAIN, |c| Op::Unmap { va: c.args[0] }),
];

fn device_malloc(c: &RawCall) -> Op {
    Op::Malloc {
        space: Space::Device,
        size: c.args[1],
        ptr: c.result(),
        policy: Some(c.args[2]),
        device: c.cfg_device,
        module: c.cfg_module,
    }
}
