//! The CUDA runtime's memory API (`cuda_runtime_api.h`, libcudart; shared/reference/
//! accelerator-apis.md §2.2): the NVIDIA counterpart of the ACL runtime.
//!
//! Argument positions follow the C signatures: `cudaMalloc(void **devPtr, size_t size)` has the
//! out-pointer at 0 and the size at 1. The device is the thread's (`cudaSetDevice`, and what
//! `cudaGetDevice` answers, which PyTorch asks often). What the driver really allocated comes from
//! the nested `cuMem*` call when libcuda is probed too (one row, as for ACL over HAL).
//!
//! `cudaFree(NULL)` is how programs create the context: it frees nothing, so it is no row (and
//! no free of an unknown block).

use memscope_common::spec::{device_effect, layer, FieldRead, ProbeSpec};

use super::op::{Op, Space};
use super::{spec, with_caller, Api, ApiDef, Family};
use crate::raw::RawCall;

/// `cudaErrorMemoryAllocation`: the runtime's out-of-memory status.
pub const CUDA_ERROR_MEMORY_ALLOCATION: i32 = 2;

/// No pointer reads: the arguments say everything.
const PLAIN: ProbeSpec = spec(layer::RUNTIME, layer::POOL, &[]);
/// `*arg0` is the result.
const OUT0: ProbeSpec = spec(layer::RUNTIME, layer::POOL, &[FieldRead::arg_at_exit(0, 0, 8)]);
/// [`OUT0`] of a call that takes memory: its caller may be a library that names the owner.
const ALLOC: ProbeSpec = with_caller(OUT0);

const fn with_effect(mut s: ProbeSpec, effect: u32) -> ProbeSpec {
    s.device_effect = effect;
    s
}

fn oom(status: i32) -> bool {
    status == CUDA_ERROR_MEMORY_ALLOCATION
}

const fn row(api: Api, symbol: &'static str, spec: ProbeSpec, decode: fn(&RawCall) -> Op) -> ApiDef {
    ApiDef { out_of_memory: oom, ..ApiDef::plain(api, symbol, Family::CudaRuntime, spec, decode) }
}

fn malloc(c: &RawCall, space: Space) -> Op {
    Op::Malloc { space, size: c.args[1], ptr: c.result(), policy: None, device: None, module: None, driver: None }
}

fn free(c: &RawCall, space: Space) -> Op {
    match c.args[0] {
        0 => Op::Scope,
        ptr => Op::Free { space, ptr, driver: None },
    }
}

pub(super) static TABLE: [ApiDef; 12] = [
    row(Api::CudaSetDevice, "cudaSetDevice", with_effect(PLAIN, device_effect::SET_FROM_ARG0), |c| Op::SetDevice {
        device: c.args[0] as i32,
    }),
    row(
        Api::CudaGetDevice,
        "cudaGetDevice",
        with_effect(
            spec(layer::RUNTIME, layer::POOL, &[FieldRead::arg_at_exit(0, 0, 4)]),
            device_effect::SET_FROM_FIELD0,
        ),
        |c| Op::GetDevice { device: c.result().map(|v| v as i32) },
    ),
    row(Api::CudaMalloc, "cudaMalloc", ALLOC, |c| malloc(c, Space::Device)),
    row(Api::CudaFree, "cudaFree", PLAIN, |c| free(c, Space::Device)),
    // (void **devPtr, size_t size, cudaStream_t stream): the cudaMallocAsync backend's blocks.
    row(Api::CudaMallocAsync, "cudaMallocAsync", ALLOC, |c| malloc(c, Space::Device)),
    row(Api::CudaFreeAsync, "cudaFreeAsync", PLAIN, |c| free(c, Space::Device)),
    row(Api::CudaMallocHost, "cudaMallocHost", ALLOC, |c| malloc(c, Space::Host)),
    // (void **pHost, size_t size, unsigned int flags): pinned host memory, as cudaMallocHost.
    row(Api::CudaHostAlloc, "cudaHostAlloc", ALLOC, |c| malloc(c, Space::Host)),
    row(Api::CudaFreeHost, "cudaFreeHost", PLAIN, |c| free(c, Space::Host)),
    // (void **devPtr, size_t size, unsigned int flags): unified memory, counted on the device.
    row(Api::CudaMallocManaged, "cudaMallocManaged", ALLOC, |c| malloc(c, Space::Device)),
    // (void *ptr, size_t size, unsigned int flags): pins the caller's memory (its driver call,
    // cuMemHostRegister_v2, folds into it).
    row(Api::CudaHostRegister, "cudaHostRegister", with_caller(PLAIN), super::acl::registered),
    row(Api::CudaHostUnregister, "cudaHostUnregister", PLAIN, |c| Op::Free {
        space: Space::Registered,
        ptr: c.args[0],
        driver: None,
    }),
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apis::call_reading;

    #[test]
    fn a_malloc_decodes_the_size_argument_and_the_out_pointer() {
        let call = call_reading(Api::CudaMalloc, &[(FieldRead::arg_at_exit(0, 0, 8), 0x7f00_0000)]);
        let op = (Api::CudaMalloc.def().decode)(&call);
        assert!(matches!(op, Op::Malloc { space: Space::Device, size: 0x7000, ptr: Some(0x7f00_0000), .. }), "{op:?}");
        let mut failed = call.clone();
        failed.ret = CUDA_ERROR_MEMORY_ALLOCATION as u64;
        assert!(matches!((Api::CudaMalloc.def().decode)(&failed), Op::Malloc { ptr: None, .. }));
        assert!((Api::CudaMalloc.def().out_of_memory)(failed.status()));
        let host = (Api::CudaHostAlloc.def().decode)(&call);
        assert!(matches!(host, Op::Malloc { space: Space::Host, .. }), "{host:?}");
    }

    #[test]
    fn freeing_null_is_no_free() {
        let mut call = call_reading(Api::CudaFree, &[]);
        call.args[0] = 0;
        assert_eq!((Api::CudaFree.def().decode)(&call), Op::Scope);
        call.args[0] = 0x7f00_0000;
        let op = (Api::CudaFree.def().decode)(&call);
        assert_eq!(op, Op::Free { space: Space::Device, ptr: 0x7f00_0000, driver: None });
    }
}
