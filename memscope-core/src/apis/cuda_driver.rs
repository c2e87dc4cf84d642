//! The CUDA driver's memory API (`cuda.h`, libcuda.so.1), the layer every device allocation
//! ends in, and its virtual-memory calls (shared/reference/accelerator-apis.md §2.2).
//!
//! - Plain allocations (`cuMemAlloc_v2`, `cuMemAllocAsync`, `cuMemAllocManaged`,
//!   `cuMemAllocHost_v2` and their frees): a call made inside a runtime call is that call's fact
//!   (one row, with the driver's size), so their outer layer is the runtime's.
//! - Virtual memory (`cuMemAddressReserve/Free`, `cuMemCreate/Release`, `cuMemMap/Unmap`):
//!   PyTorch's expandable segments and NCCL call these directly, never through the runtime, so
//!   their outer layer is the framework pool's: pages mapped inside the caching allocator's
//!   `map_block` are its segments. A mapping counts as a block from map to unmap, as ACL's do.
//!
//! Calls reached through `cuGetProcAddress` function pointers are seen too: uprobes fire on the
//! function's code, not on a PLT entry.

use memscope_common::spec::{layer, FieldRead, ProbeSpec};

use super::op::{DriverInfo, Op, Space};
use super::{named, spec, with_caller, Api, ApiDef, Family, Tracking, RESULT};
use crate::raw::RawCall;

/// `CUDA_ERROR_OUT_OF_MEMORY`.
pub const CUDA_ERROR_OUT_OF_MEMORY: i32 = 2;

/// `CUmemAllocationProp.location.id`: after the allocation type, the handle types and the
/// location's type, three 4-byte enums.
const PROP_DEVICE_OFFSET: u32 = 12;

/// Inside a runtime call: folded into it.
const PLAIN: ProbeSpec = spec(layer::HAL, layer::RUNTIME, &[]);
const OUT0: ProbeSpec = spec(layer::HAL, layer::RUNTIME, &[FieldRead::arg_at_exit(0, 0, 8)]);
/// [`OUT0`] of a call that takes memory: NCCL and cuBLAS, their runtime linked in, call these
/// themselves, and their address names the owner.
const ALLOC: ProbeSpec = with_caller(OUT0);
/// Virtual memory: inside a pool's step, its segments.
const VMM: ProbeSpec = spec(layer::HAL, layer::POOL, &[]);
const VMM_OUT0: ProbeSpec = spec(layer::HAL, layer::POOL, &[FieldRead::arg_at_exit(0, 0, 8)]);

fn oom(status: i32) -> bool {
    status == CUDA_ERROR_OUT_OF_MEMORY
}

/// A call folded into the runtime call it runs inside of.
const fn row(api: Api, symbol: &'static str, spec: ProbeSpec, decode: fn(&RawCall) -> Op) -> ApiDef {
    let tracking = Tracking { folds_into_outer: true, ..Tracking::NONE };
    ApiDef { tracking, out_of_memory: oom, ..ApiDef::plain(api, symbol, Family::CudaDriver, spec, decode) }
}

/// A virtual-memory call: a fact of its own.
const fn vmm_row(api: Api, symbol: &'static str, spec: ProbeSpec, decode: fn(&RawCall) -> Op) -> ApiDef {
    ApiDef { out_of_memory: oom, ..ApiDef::plain(api, symbol, Family::CudaDriver, spec, decode) }
}

fn info(api: Api, size: u64) -> Option<DriverInfo> {
    Some(DriverInfo { api, flag: None, size, module: None, page: None })
}

fn malloc(c: &RawCall, api: Api, space: Space) -> Op {
    let size = c.args[1];
    Op::Malloc { space, size, ptr: c.result(), policy: None, device: None, module: None, driver: info(api, size) }
}

fn free(c: &RawCall, api: Api, space: Space) -> Op {
    match c.args[0] {
        0 => Op::Scope,
        ptr => Op::Free { space, ptr, driver: info(api, 0) },
    }
}

/// `cuMemCreate(*handle, size, prop, flags)`'s reads: `*handle` at return, `prop`'s device at
/// entry.
#[derive(Clone, Copy)]
enum Create {
    Handle,
    Device,
}

const _: () = assert!(Create::Handle as usize == RESULT, "RawCall::result reads the handle");

pub(super) static TABLE: [ApiDef; 16] = [
    row(Api::CuMemAlloc, "cuMemAlloc_v2", ALLOC, |c| malloc(c, Api::CuMemAlloc, Space::Device)),
    row(Api::CuMemFree, "cuMemFree_v2", PLAIN, |c| free(c, Api::CuMemFree, Space::Device)),
    row(Api::CuMemAllocAsync, "cuMemAllocAsync", ALLOC, |c| malloc(c, Api::CuMemAllocAsync, Space::Device)),
    row(Api::CuMemFreeAsync, "cuMemFreeAsync", PLAIN, |c| free(c, Api::CuMemFreeAsync, Space::Device)),
    row(Api::CuMemAllocManaged, "cuMemAllocManaged", ALLOC, |c| malloc(c, Api::CuMemAllocManaged, Space::Device)),
    row(Api::CuMemAllocHost, "cuMemAllocHost_v2", ALLOC, |c| malloc(c, Api::CuMemAllocHost, Space::Host)),
    row(Api::CuMemFreeHost, "cuMemFreeHost", PLAIN, |c| free(c, Api::CuMemFreeHost, Space::Host)),
    // (void **pp, size_t bytesize, unsigned int Flags): pinned host memory, freed by
    // cuMemFreeHost (NCCL's bundled runtime pins its host buffers so).
    row(Api::CuMemHostAlloc, "cuMemHostAlloc", ALLOC, |c| malloc(c, Api::CuMemHostAlloc, Space::Host)),
    // (void *p, size_t bytesize, unsigned int Flags): `cuMemHostRegister` in cuda.h.
    row(Api::CuMemHostRegister, "cuMemHostRegister_v2", with_caller(PLAIN), |c| {
        let size = c.args[1];
        let ptr = (c.status() == 0).then_some(c.args[0]);
        let driver = info(Api::CuMemHostRegister, size);
        Op::Malloc { space: Space::Registered, size, ptr, policy: None, device: None, module: None, driver }
    }),
    row(Api::CuMemHostUnregister, "cuMemHostUnregister", PLAIN, |c| {
        free(c, Api::CuMemHostUnregister, Space::Registered)
    }),
    vmm_row(
        Api::CuMemCreate,
        "cuMemCreate",
        with_caller(spec(
            layer::HAL,
            layer::POOL,
            &named(&[
                (Create::Handle as usize, FieldRead::arg_at_exit(0, 0, 8)),
                (Create::Device as usize, FieldRead::arg_at_entry(2, PROP_DEVICE_OFFSET, 4)),
            ]),
        )),
        |c| Op::MallocPhysical {
            size: c.args[1],
            handle: c.result(),
            device: c.field(Create::Device as usize).map(|d| d as u32),
            flags: c.args[3],
            driver: info(Api::CuMemCreate, c.args[1]),
        },
    ),
    vmm_row(Api::CuMemRelease, "cuMemRelease", VMM, |c| Op::FreePhysical {
        handle: c.args[0],
        driver: info(Api::CuMemRelease, 0),
    }),
    vmm_row(Api::CuMemMap, "cuMemMap", VMM, |c| Op::Map {
        va: c.args[0],
        size: c.args[1],
        offset: c.args[2],
        handle: c.args[3],
        flags: c.args[4],
    }),
    vmm_row(Api::CuMemUnmap, "cuMemUnmap", VMM, |c| Op::Unmap { va: c.args[0] }),
    // (CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr, unsigned long long flags)
    vmm_row(Api::CuMemAddressReserve, "cuMemAddressReserve", VMM_OUT0, |c| Op::Reserve {
        size: c.args[1],
        va: c.result(),
        alignment: c.args[2],
        flags: c.args[4],
    }),
    vmm_row(Api::CuMemAddressFree, "cuMemAddressFree", VMM, |c| Op::Release { va: c.args[0] }),
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apis::call_reading;

    #[test]
    fn mem_create_decodes_the_handle_and_the_props_device_from_their_reads() {
        let call = call_reading(
            Api::CuMemCreate,
            &[(FieldRead::arg_at_exit(0, 0, 8), 0x77), (FieldRead::arg_at_entry(2, PROP_DEVICE_OFFSET, 4), 3)],
        );
        let op = (Api::CuMemCreate.def().decode)(&call);
        assert!(matches!(op, Op::MallocPhysical { handle: Some(0x77), device: Some(3), size: 0x7000, .. }), "{op:?}");
    }

    #[test]
    fn a_driver_allocation_says_it_is_the_drivers() {
        let call = call_reading(Api::CuMemAllocHost, &[(FieldRead::arg_at_exit(0, 0, 8), 0x5000_0000)]);
        let Op::Malloc { space, ptr, driver: Some(d), .. } = (Api::CuMemAllocHost.def().decode)(&call) else {
            panic!("an allocation")
        };
        assert_eq!((space, ptr, d.api, d.size), (Space::Host, Some(0x5000_0000), Api::CuMemAllocHost, 0x7000));
    }
}
