//! mstx memory regions (`ms_tools_ext.h`, libms_tools_ext.so; shared/reference/accelerator-apis.md
//! §3): how a framework pool describes its blocks to a tool.
//!
//! torch_npu makes these calls only when it believes msMemScope is loaded; when it does, every
//! block malloc registers the pool's reserved bytes (`mstxMemHeapRegister`, `{device, ptr,
//! reserved}` behind `desc->typeSpecificDesc`) and the block (`mstxMemRegionsRegister`, `{device,
//! ptr, size}` at `batch->regionDescArray[0]`), and every free unregisters it
//! (`batch->refArray[0].pointer`). Each pool uses its own domain (`ptaCaching`, `ptaWorkspace`),
//! created with `mstxDomainCreateA(name)`. Only the first region of a batch is read; torch_npu
//! registers one at a time.
//!
//! Marks and ranges (`mstxMarkA`, `mstxRangeStartA`, `mstxRangeEnd` and their `Domain` forms) are
//! the program's own markers: they become MSTX rows, ranges become tag spans, and a range named
//! `step start` marks a step (msMemScope's convention).

use memscope_common::spec::{layer, ret_kind, FieldRead, ProbeSpec};

use super::op::{Marker, Op};
use super::{named, spec, Api, ApiDef, Family, Tracking};
use crate::raw::RawCall;

/// `mstxMemHeapRegister(domain, desc)`: `desc->typeSpecificDesc` -> `{device, ptr, reserved}`.
#[derive(Clone, Copy)]
enum Heap {
    Device,
    Total,
}

/// `mstxMemRegionsRegister(domain, batch)`: the batch's count, and its first region's
/// `{device, ptr, size}` behind `batch->regionDescArray`.
#[derive(Clone, Copy)]
enum Region {
    Count,
    Device,
    Ptr,
    Size,
}

/// `mstxMemRegionsUnregister(domain, batch)`: the batch's count and its first ref's pointer.
#[derive(Clone, Copy)]
enum Unregister {
    Count,
    Ptr,
}

const fn mstx_spec(fields: &[FieldRead]) -> ProbeSpec {
    let mut s = spec(layer::MSTX, layer::POOL, fields);
    s.ret_kind = ret_kind::NONE;
    s
}

/// A memory-region report: a pool reports its block from inside its allocator call, so the
/// report is one fact with that call.
const fn region_row(def: ApiDef) -> ApiDef {
    ApiDef { tracking: Tracking { folds_into_outer: true, ..Tracking::NONE }, ..def }
}

const fn row(api: Api, symbol: &'static str, spec: ProbeSpec, decode: fn(&RawCall) -> Op) -> ApiDef {
    ApiDef::plain(api, symbol, Family::Mstx, spec, decode)
}

/// A mark or range call: not nested in a pool call, and void (or returning a range id).
const fn marker_spec(text_arg: i32) -> ProbeSpec {
    let mut s = spec(layer::MSTX, 0, &[]);
    s.ret_kind = ret_kind::NONE;
    s.text_arg = text_arg;
    s
}

fn message(c: &RawCall) -> String {
    c.text.clone().unwrap_or_default()
}

pub(super) static TABLE: [ApiDef; 10] = [
    row(
        Api::MstxDomainCreateA,
        "mstxDomainCreateA",
        {
            let mut s = mstx_spec(&[]);
            s.text_arg = 0;
            s
        },
        |c| Op::MstxDomain { handle: (c.ret != 0).then_some(c.ret), name: c.text.clone() },
    ),
    row(
        Api::MstxMemHeapRegister,
        "mstxMemHeapRegister",
        mstx_spec(&named(&[
            (Heap::Device as usize, FieldRead::arg_via_at_entry(1, 8, 0, 4)),
            (Heap::Total as usize, FieldRead::arg_via_at_entry(1, 8, 16, 8)),
        ])),
        |c| Op::MstxHeap {
            domain: c.args[0],
            device: c.field(Heap::Device as usize).map(|d| d as u32),
            total: c.field(Heap::Total as usize),
        },
    ),
    region_row(row(
        Api::MstxMemRegionsRegister,
        "mstxMemRegionsRegister",
        mstx_spec(&named(&[
            (Region::Count as usize, FieldRead::arg_at_entry(1, 16, 8)),
            (Region::Device as usize, FieldRead::arg_via_at_entry(1, 24, 0, 4)),
            (Region::Ptr as usize, FieldRead::arg_via_at_entry(1, 24, 8, 8)),
            (Region::Size as usize, FieldRead::arg_via_at_entry(1, 24, 16, 8)),
        ])),
        |c| Op::MstxRegion {
            domain: c.args[0],
            register: true,
            count: c.field(Region::Count as usize),
            device: c.field(Region::Device as usize).map(|d| d as u32),
            ptr: c.field(Region::Ptr as usize),
            size: c.field(Region::Size as usize),
        },
    )),
    region_row(row(
        Api::MstxMemRegionsUnregister,
        "mstxMemRegionsUnregister",
        mstx_spec(&named(&[
            (Unregister::Count as usize, FieldRead::arg_at_entry(1, 0, 8)),
            (Unregister::Ptr as usize, FieldRead::arg_via_at_entry(1, 8, 8, 8)),
        ])),
        |c| Op::MstxRegion {
            domain: c.args[0],
            register: false,
            count: c.field(Unregister::Count as usize),
            device: None,
            ptr: c.field(Unregister::Ptr as usize),
            size: None,
        },
    )),
    row(Api::MstxMarkA, "mstxMarkA", marker_spec(0), |c| Op::Marker(Marker::Mark { message: message(c) })),
    row(Api::MstxRangeStartA, "mstxRangeStartA", marker_spec(0), |c| {
        Op::Marker(Marker::RangeStart { id: c.ret, message: message(c) })
    }),
    row(Api::MstxRangeEnd, "mstxRangeEnd", marker_spec(-1), |c| Op::Marker(Marker::RangeEnd { id: c.args[0] })),
    row(Api::MstxDomainMarkA, "mstxDomainMarkA", marker_spec(1), |c| Op::Marker(Marker::Mark { message: message(c) })),
    row(Api::MstxDomainRangeStartA, "mstxDomainRangeStartA", marker_spec(1), |c| {
        Op::Marker(Marker::RangeStart { id: c.ret, message: message(c) })
    }),
    row(Api::MstxDomainRangeEnd, "mstxDomainRangeEnd", marker_spec(-1), |c| {
        Op::Marker(Marker::RangeEnd { id: c.args[1] })
    }),
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apis::call_reading;

    #[test]
    fn a_pools_region_and_heap_reports_decode_each_value_from_its_own_read() {
        // The batch's count at +16; its first region's {device: u32, ptr, size} behind +24.
        let call = call_reading(
            Api::MstxMemRegionsRegister,
            &[
                (FieldRead::arg_at_entry(1, 16, 8), 1),
                (FieldRead::arg_via_at_entry(1, 24, 0, 4), 3),
                (FieldRead::arg_via_at_entry(1, 24, 8, 8), 0x10_0000),
                (FieldRead::arg_via_at_entry(1, 24, 16, 8), 512),
            ],
        );
        let op = (Api::MstxMemRegionsRegister.def().decode)(&call);
        let (domain, register) = (0x5000, true);
        let (count, device, ptr, size) = (Some(1), Some(3), Some(0x10_0000), Some(512));
        assert_eq!(op, Op::MstxRegion { domain, register, count, device, ptr, size });

        // The count at +0; the first ref's pointer behind +8, at +8.
        let call = call_reading(
            Api::MstxMemRegionsUnregister,
            &[(FieldRead::arg_at_entry(1, 0, 8), 1), (FieldRead::arg_via_at_entry(1, 8, 8, 8), 0x10_0000)],
        );
        let op = (Api::MstxMemRegionsUnregister.def().decode)(&call);
        let (register, device, size) = (false, None, None);
        assert_eq!(op, Op::MstxRegion { domain, register, count, device, ptr, size });

        // `{device: u32, ptr, reserved}` behind +8.
        let call = call_reading(
            Api::MstxMemHeapRegister,
            &[(FieldRead::arg_via_at_entry(1, 8, 0, 4), 2), (FieldRead::arg_via_at_entry(1, 8, 16, 8), 8 << 20)],
        );
        let op = (Api::MstxMemHeapRegister.def().decode)(&call);
        assert_eq!(op, Op::MstxHeap { domain, device: Some(2), total: Some(8 << 20) });
    }
}
