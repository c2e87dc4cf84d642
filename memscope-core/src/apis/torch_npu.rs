//! torch_npu's allocators (shared/reference/accelerator-apis.md §2.1), by mangled name.
//!
//! Three ways to see blocks, in the order they are preferred (chosen per library by
//! `attach::plan`):
//! - the internals, hidden in release builds and found through the debug file:
//!   `DeviceCachingAllocator::malloc(int device, size_t size, aclrtStream, uint8_t)` returns a
//!   `Block*` whose address, size and device are read at offsets taken from DWARF, and `free(Block*,
//!   uint8_t)` is read at entry (the block may be merged away after); `NpuCachingAllocator::malloc(void
//!   **devPtr, int device, size_t size, aclrtStream)` / `free(void*)` when the layout is unknown;
//!   `NPUWorkspaceAllocator::DeviceWorkspaceAllocator::malloc(size_t, aclrtStream)` / `free(void*)`;
//! - the exported `MallocBlock(size_t, void* stream, int device)` -> handle, `GetBlockPtr`,
//!   `GetBlockSize`, `FreeBlock(handle)` (the external path) and
//!   `at_npu::native::allocate_workspace(uint64_t size, void* stream)`, which returns an
//!   `at::DataPtr` through a hidden pointer in the first argument register (data pointer first);
//! - mstx memory regions (`super::mstx`), when the process makes them.
//!
//! Stream marks, exported: `recordStream(const c10::DataPtr&, c10_npu::NPUStream)` marks a block as
//! used by another stream (ProcessGroupHCCL does it for a collective's tensors), and
//! `eraseStream(...)` (MULTI_STREAM_MEMORY_REUSE 1 and 3) drops the mark once the collective was
//! waited for. A block freed while marked is not reusable until that stream's work completes.
//! The DataPtr's data pointer is its first word; the NPUStream (a 16-byte `c10::Stream`: device,
//! then stream id) travels by value in two registers, the id in the third argument register.
//!
//! Member functions take `this` as argument 0.

use memscope_common::spec::{layer, ret_kind, sample_class, FieldRead, ProbeSpec};

use super::op::{Op, Pool};
use super::{at, named, sampled_alloc, sampled_free, spec, Api, ApiDef, Family, Layout, Tracking};
use crate::raw::RawCall;

/// `c10_npu::NPUWorkspaceAllocator::DeviceWorkspaceAllocator`: one per device, so its `device`
/// member places a workspace block even on a thread whose device the trace never learnt.
pub static WORKSPACE_ALLOCATOR: Layout =
    Layout { namespace: "NPUWorkspaceAllocator", name: "DeviceWorkspaceAllocator", members: &["device"] };

/// The field [`WORKSPACE_ALLOCATOR`]'s member fills (its members are in this order).
#[derive(Clone, Copy)]
enum WorkspaceField {
    Device,
}

/// `c10_npu::NPUCachingAllocator::(anonymous)::Block`: the fields read from a block.
pub static BLOCK: Layout =
    Layout { namespace: "NPUCachingAllocator", name: "Block", members: &["ptr", "size", "device"] };

/// The fields [`BLOCK`]'s members fill (its members are in this order).
#[derive(Clone, Copy)]
enum BlockField {
    Ptr,
    Size,
    Device,
}

/// `NpuCachingAllocator::malloc(this, void **ptr, ...)`: `*ptr` at return.
#[derive(Clone, Copy)]
enum OutPtr {
    Ptr,
}

/// A `c10::DataPtr`: its data pointer is its first word.
#[derive(Clone, Copy)]
enum DataPtr {
    Ptr,
}

/// Frees inside a garbage-collector pass are reported as the collector's (its layer is outer).
const fn pool_spec(fields: &[FieldRead]) -> ProbeSpec {
    let mut s = spec(layer::POOL, layer::GC, fields);
    s.ret_kind = ret_kind::NONE;
    s
}

const fn row(
    api: Api,
    name: &'static str,
    symbol: &'static str,
    spec: ProbeSpec,
    decode: fn(&RawCall) -> Op,
) -> ApiDef {
    let tracking = Tracking { segment_pool: Some(Pool::Caching), ..Tracking::NONE };
    ApiDef { name, tracking, ..ApiDef::plain(api, symbol, Family::TorchNpu, spec, decode) }
}

fn non_zero(v: u64) -> Option<u64> {
    (v != 0).then_some(v)
}

fn device_arg(v: u64) -> Option<u32> {
    u32::try_from(v as i32).ok()
}

/// A stream mark: the block's address (the DataPtr's first word) and the stream id.
fn stream_mark(c: &RawCall, record: bool) -> Op {
    Op::StreamMark { ptr: c.field(DataPtr::Ptr as usize).and_then(non_zero), stream: c.args[2], record }
}

pub(super) static TABLE: [ApiDef; 13] = [
    ApiDef {
        layout: Some(&BLOCK),
        ..row(
            Api::DeviceCachingAllocatorMalloc,
            "DeviceCachingAllocator::malloc",
            "_ZN7c10_npu19NPUCachingAllocator22DeviceCachingAllocator6mallocEimPvh",
            // Offsets are placeholders until the DWARF layout is known.
            sampled_alloc(
                pool_spec(&named(&[
                    (BlockField::Ptr as usize, FieldRead::ret_field(0, 8)),
                    (BlockField::Size as usize, FieldRead::ret_field(0, 8)),
                    (BlockField::Device as usize, FieldRead::ret_field(0, 4)),
                ])),
                sample_class::CACHING,
                [
                    at::arg(2),
                    at::field(BlockField::Size as usize),
                    at::field(BlockField::Ptr as usize),
                    at::field(BlockField::Device as usize),
                    at::arg(1),
                ],
            ),
            |c| Op::PoolMalloc {
                pool: Pool::Caching,
                ptr: if c.ret == 0 { None } else { c.field(BlockField::Ptr as usize) },
                size: c.field(BlockField::Size as usize),
                req: Some(c.args[2]),
                device: c.field(BlockField::Device as usize).and_then(device_arg).or_else(|| device_arg(c.args[1])),
                handle: None,
                stream: Some(c.args[3]),
            },
        )
    },
    ApiDef {
        layout: Some(&BLOCK),
        ..row(
            Api::DeviceCachingAllocatorFree,
            "DeviceCachingAllocator::free",
            "_ZN7c10_npu19NPUCachingAllocator22DeviceCachingAllocator4freeEPNS0_12_GLOBAL__N_15BlockEh",
            sampled_free(
                pool_spec(&named(&[
                    (BlockField::Ptr as usize, FieldRead::arg_at_entry(1, 0, 8)),
                    (BlockField::Size as usize, FieldRead::arg_at_entry(1, 0, 8)),
                    (BlockField::Device as usize, FieldRead::arg_at_entry(1, 0, 4)),
                ])),
                sample_class::CACHING,
                at::field(BlockField::Ptr as usize),
            ),
            |c| Op::PoolFree {
                pool: Pool::Caching,
                ptr: c.field(BlockField::Ptr as usize),
                handle: None,
                size: c.field(BlockField::Size as usize),
                device: c.field(BlockField::Device as usize).and_then(device_arg),
            },
        )
    },
    row(
        Api::NpuCachingAllocatorMalloc,
        "NpuCachingAllocator::malloc",
        "_ZN7c10_npu19NPUCachingAllocator19NpuCachingAllocator6mallocEPPvimS2_",
        sampled_alloc(
            pool_spec(&named(&[(OutPtr::Ptr as usize, FieldRead::arg_at_exit(1, 0, 8))])),
            sample_class::CACHING,
            [at::arg(3), at::NONE, at::field(OutPtr::Ptr as usize), at::arg(2), at::NONE],
        ),
        |c| Op::PoolMalloc {
            pool: Pool::Caching,
            ptr: c.field(OutPtr::Ptr as usize).and_then(non_zero),
            size: None,
            req: Some(c.args[3]),
            device: device_arg(c.args[2]),
            handle: None,
            stream: Some(c.args[4]),
        },
    ),
    row(
        Api::NpuCachingAllocatorFree,
        "NpuCachingAllocator::free",
        "_ZN7c10_npu19NPUCachingAllocator19NpuCachingAllocator4freeEPv",
        sampled_free(pool_spec(&[]), sample_class::CACHING, at::arg(1)),
        |c| Op::PoolFree { pool: Pool::Caching, ptr: non_zero(c.args[1]), handle: None, size: None, device: None },
    ),
    ApiDef {
        tracking: Tracking { segment_pool: Some(Pool::Workspace), ..Tracking::NONE },
        ..row(
            Api::WorkspaceMalloc,
            "DeviceWorkspaceAllocator::malloc",
            "_ZN7c10_npu21NPUWorkspaceAllocator24DeviceWorkspaceAllocator6mallocEmPv",
            // `this->device` is read only once DWARF gave its offset (the plan patches field 0 in).
            sampled_alloc(
                pool_spec(&[]),
                sample_class::WORKSPACE,
                [at::arg(1), at::arg(1), at::RET, at::field(WorkspaceField::Device as usize), at::THREAD_DEVICE],
            ),
            |c| Op::PoolMalloc {
                pool: Pool::Workspace,
                ptr: non_zero(c.ret),
                size: Some(c.args[1]),
                req: Some(c.args[1]),
                device: c.field(WorkspaceField::Device as usize).and_then(device_arg),
                handle: None,
                stream: None,
            },
        )
    },
    row(
        Api::WorkspaceFree,
        "DeviceWorkspaceAllocator::free",
        "_ZN7c10_npu21NPUWorkspaceAllocator24DeviceWorkspaceAllocator4freeEPv",
        sampled_free(pool_spec(&[]), sample_class::WORKSPACE, at::arg(1)),
        |c| Op::PoolFree { pool: Pool::Workspace, ptr: non_zero(c.args[1]), handle: None, size: None, device: None },
    ),
    row(Api::MallocBlock, "MallocBlock", "_ZN7c10_npu19NPUCachingAllocator11MallocBlockEmPvi", pool_spec(&[]), |c| {
        Op::PoolMalloc {
            pool: Pool::Caching,
            ptr: None,
            size: None,
            req: Some(c.args[0]),
            device: device_arg(c.args[2]),
            handle: non_zero(c.ret),
            stream: Some(c.args[1]),
        }
    }),
    row(Api::FreeBlock, "FreeBlock", "_ZN7c10_npu19NPUCachingAllocator9FreeBlockEPv", pool_spec(&[]), |c| {
        Op::PoolFree { pool: Pool::Caching, ptr: None, handle: non_zero(c.args[0]), size: None, device: None }
    }),
    row(Api::GetBlockPtr, "GetBlockPtr", "_ZN7c10_npu19NPUCachingAllocator11GetBlockPtrEPKv", pool_spec(&[]), |c| {
        Op::PoolHandle { handle: c.args[0], ptr: non_zero(c.ret), size: None }
    }),
    row(Api::GetBlockSize, "GetBlockSize", "_ZN7c10_npu19NPUCachingAllocator12GetBlockSizeEPKv", pool_spec(&[]), |c| {
        Op::PoolHandle { handle: c.args[0], ptr: None, size: non_zero(c.ret) }
    }),
    ApiDef {
        tracking: Tracking { segment_pool: Some(Pool::Workspace), workspace_until_next: true, ..Tracking::NONE },
        ..row(
            Api::AllocateWorkspace,
            "allocate_workspace",
            "_ZN6at_npu6native18allocate_workspaceEmPv",
            // The DataPtr comes back through the hidden pointer in argument 0; its data pointer is first.
            pool_spec(&named(&[(DataPtr::Ptr as usize, FieldRead::arg_at_exit(0, 0, 8))])),
            |c| Op::PoolMalloc {
                pool: Pool::Workspace,
                ptr: c.field(DataPtr::Ptr as usize).and_then(non_zero),
                size: Some(c.args[1]),
                req: Some(c.args[1]),
                device: None,
                handle: None,
                stream: None,
            },
        )
    },
    row(
        Api::RecordStream,
        "recordStream",
        "_ZN7c10_npu19NPUCachingAllocator12recordStreamERKN3c107DataPtrENS_9NPUStreamE",
        pool_spec(&named(&[(DataPtr::Ptr as usize, FieldRead::arg_at_entry(0, 0, 8))])),
        |c| stream_mark(c, true),
    ),
    row(
        Api::EraseStream,
        "eraseStream",
        "_ZN7c10_npu19NPUCachingAllocator11eraseStreamERKN3c107DataPtrENS_9NPUStreamE",
        pool_spec(&named(&[(DataPtr::Ptr as usize, FieldRead::arg_at_entry(0, 0, 8))])),
        |c| stream_mark(c, false),
    ),
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apis::call_reading;

    /// Attaching fills a layout's fields from DWARF in the order of its members: each name must
    /// be the member its field reads.
    #[test]
    fn each_layout_field_is_named_as_the_member_that_fills_it() {
        let block = [(BlockField::Ptr, "ptr"), (BlockField::Size, "size"), (BlockField::Device, "device")];
        for (field, member) in block {
            assert_eq!(BLOCK.members[field as usize], member);
        }
        assert_eq!(BLOCK.members.len(), block.len());
        assert_eq!(WORKSPACE_ALLOCATOR.members, ["device"]);
        assert_eq!(WorkspaceField::Device as usize, 0);
        for api in [Api::DeviceCachingAllocatorMalloc, Api::DeviceCachingAllocatorFree] {
            assert_eq!(api.def().spec.fields[BlockField::Device as usize].width, 4, "{api:?}: device is an int");
        }
    }

    #[test]
    fn a_block_decodes_each_value_from_its_members_field() {
        let def = Api::DeviceCachingAllocatorFree.def();
        let mut call = call_reading(Api::DeviceCachingAllocatorFree, &[]);
        // As attaching lays them out: the block's members in BLOCK's order.
        call.fields = [Some(0x10_0000), Some(4096), Some(1), None];
        let op = (def.decode)(&call);
        let (pool, handle) = (Pool::Caching, None);
        assert_eq!(op, Op::PoolFree { pool, ptr: Some(0x10_0000), handle, size: Some(4096), device: Some(1) });
    }

    #[test]
    fn out_pointers_and_data_ptrs_decode_from_their_read() {
        let call = call_reading(Api::AllocateWorkspace, &[(FieldRead::arg_at_exit(0, 0, 8), 0x20_0000)]);
        let op = (Api::AllocateWorkspace.def().decode)(&call);
        assert!(matches!(op, Op::PoolMalloc { pool: Pool::Workspace, ptr: Some(0x20_0000), .. }), "{op:?}");
        let call = call_reading(Api::RecordStream, &[(FieldRead::arg_at_entry(0, 0, 8), 0x20_0000)]);
        let op = (Api::RecordStream.def().decode)(&call);
        assert_eq!(op, Op::StreamMark { ptr: Some(0x20_0000), stream: 0x8000, record: true });
        let call = call_reading(Api::NpuCachingAllocatorMalloc, &[(FieldRead::arg_at_exit(1, 0, 8), 0x30_0000)]);
        let op = (Api::NpuCachingAllocatorMalloc.def().decode)(&call);
        assert!(matches!(op, Op::PoolMalloc { pool: Pool::Caching, ptr: Some(0x30_0000), .. }), "{op:?}");
    }
}
