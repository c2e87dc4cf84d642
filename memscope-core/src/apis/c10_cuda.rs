//! PyTorch's CUDA caching allocator (`c10/cuda/CUDACachingAllocator.cpp`, libc10_cuda.so;
//! shared/reference/accelerator-apis.md §2.2 and ebpf-landscape.md §0).
//!
//! - Blocks: the library's own USDT probes. `pytorch:malloc(devPtr, int8 device, size, stream
//!   id)` fires at the end of `NativeCachingAllocator::allocate`, `pytorch:free(ptr)` in
//!   `local_raw_delete` and `uncached_delete`. Both sit behind semaphores, raised through the
//!   kernel's uprobe reference counter while attached, so an untraced process pays one load and
//!   branch. The size is the one asked for (the probe does not say the block's rounded size).
//!   `raw_alloc`/`raw_delete` (used by a few libraries) bypass them.
//! - Segments: the internals, found in `.symtab` (the PyPI wheel keeps it). Device memory taken
//!   inside `DeviceCachingAllocator::alloc_block` (`cudaMalloc`) or `map_block` (expandable
//!   segments: `cuMemCreate` + `cuMemMap`) is the pool's segment. These run only when the pool
//!   grows, so probing them costs nothing per tensor. Their parameter lists changed between
//!   releases (2.1 dropped `int` devices, 2.9 moved the device into the allocator), so they are
//!   found by name up to the parameters; their arguments are never read.

use memscope_common::spec::{layer, ret_kind, ProbeSpec};

use super::op::{Op, Pool};
use super::{spec, Api, ApiDef, Attach, Family, Tracking};
use crate::raw::RawCall;

/// A pool step without a status; frees inside a garbage-collector pass are the collector's.
const fn pool_spec() -> ProbeSpec {
    let mut s = spec(layer::POOL, layer::GC, &[]);
    s.ret_kind = ret_kind::NONE;
    s
}

fn non_zero(v: u64) -> Option<u64> {
    (v != 0).then_some(v)
}

/// An `int8` device as the probe extends it: -1 (no device) is none.
fn device_arg(v: u64) -> Option<u32> {
    u32::try_from(v as i64).ok()
}

const fn usdt_row(api: Api, probe: &'static str, decode: fn(&RawCall) -> Op) -> ApiDef {
    ApiDef { attach: Attach::Usdt, ..ApiDef::plain(api, probe, Family::CudaCaching, pool_spec(), decode) }
}

/// An internal step whose device calls are the caching pool's segments.
const fn segment_row(api: Api, name: &'static str, prefix: &'static str) -> ApiDef {
    ApiDef {
        name,
        attach: Attach::SymbolPrefix,
        tracking: Tracking { segment_pool: Some(Pool::Caching), ..Tracking::NONE },
        ..ApiDef::plain(api, prefix, Family::CudaCaching, pool_spec(), |_| Op::Scope)
    }
}

pub(super) static TABLE: [ApiDef; 4] = [
    usdt_row(Api::PytorchMalloc, "pytorch:malloc", |c| Op::PoolMalloc {
        pool: Pool::Caching,
        ptr: non_zero(c.args[0]),
        size: None,
        req: Some(c.args[2]),
        device: device_arg(c.args[1]),
        handle: None,
        stream: Some(c.args[3]),
    }),
    usdt_row(Api::PytorchFree, "pytorch:free", |c| Op::PoolFree {
        pool: Pool::Caching,
        ptr: non_zero(c.args[0]),
        handle: None,
        size: None,
        device: None,
    }),
    segment_row(
        Api::CudaAllocBlock,
        "DeviceCachingAllocator::alloc_block",
        "_ZN3c104cuda20CUDACachingAllocator6Native22DeviceCachingAllocator11alloc_blockE",
    ),
    segment_row(
        Api::CudaMapBlock,
        "DeviceCachingAllocator::map_block",
        "_ZN3c104cuda20CUDACachingAllocator6Native22DeviceCachingAllocator9map_blockE",
    ),
];

/// The argument count of a USDT row's note (a note with another is a different PyTorch, and
/// is skipped rather than misread).
pub fn usdt_args(api: Api) -> Option<usize> {
    match api {
        Api::PytorchMalloc => Some(4),
        Api::PytorchFree => Some(1),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apis::{usdt_api, usdt_call, API_PROBE_BASE};
    use crate::raw::RawUsdt;

    fn hit(api: Api, args: [u64; 6]) -> RawUsdt {
        let probe = API_PROBE_BASE + api.spec_id();
        RawUsdt { spec_id: 9, probe, tgid: 1, tid: 2, mono_ns: 30, args, text: None }
    }

    /// The note's argument order: ptr, device (sign-extended int8), size, stream id.
    #[test]
    fn a_malloc_hit_is_a_caching_block_in_the_notes_argument_order() {
        let call = usdt_call(&hit(Api::PytorchMalloc, [0x7f00_0000, 1, 4096, 0x55, 0, 0])).unwrap();
        assert_eq!((call.entry_mono_ns, call.return_mono_ns, call.spec_id), (30, 30, Api::PytorchMalloc.spec_id()));
        let op = (Api::PytorchMalloc.def().decode)(&call);
        let want = Op::PoolMalloc {
            pool: Pool::Caching,
            ptr: Some(0x7f00_0000),
            size: None,
            req: Some(4096),
            device: Some(1),
            handle: None,
            stream: Some(0x55),
        };
        assert_eq!(op, want);
        let no_device = usdt_call(&hit(Api::PytorchMalloc, [0x7f00_0000, u64::MAX, 4096, 0, 0, 0])).unwrap();
        assert!(matches!((Api::PytorchMalloc.def().decode)(&no_device), Op::PoolMalloc { device: None, .. }));
        let free = usdt_call(&hit(Api::PytorchFree, [0x7f00_0000, 0, 0, 0, 0, 0])).unwrap();
        assert!(matches!((Api::PytorchFree.def().decode)(&free), Op::PoolFree { ptr: Some(0x7f00_0000), .. }));
    }

    #[test]
    fn only_pytorchs_probes_are_api_rows_and_markers_ids_are_not_calls() {
        assert_eq!(usdt_api("pytorch", "malloc"), Some(Api::PytorchMalloc));
        assert_eq!(usdt_api("pytorch", "free"), Some(Api::PytorchFree));
        assert_eq!(usdt_api("memscope", "malloc"), None);
        assert_eq!(usdt_api("pytorch", "alloc_block"), None);
        let mut marker = hit(Api::PytorchFree, [0; 6]);
        marker.probe = 4;
        assert!(usdt_call(&marker).is_none());
        // A symbol row's id past the base is no USDT call either.
        marker.probe = API_PROBE_BASE + Api::CudaMalloc.spec_id();
        assert!(usdt_call(&marker).is_none());
    }

    #[test]
    fn internals_are_found_by_prefix_and_are_segment_scopes() {
        for api in [Api::CudaAllocBlock, Api::CudaMapBlock] {
            let prefix = api.symbol_prefix().unwrap();
            assert!(prefix.starts_with("_ZN") && prefix.ends_with('E'), "{prefix}");
            assert_eq!(api.symbols().count(), 0);
            assert_eq!(api.tracking().segment_pool, Some(Pool::Caching));
        }
        assert_eq!(Api::PytorchMalloc.lookup_names().count(), 0, "a USDT row has no symbol");
    }
}
