//! Ascend Transformer Boost (`libatb.so`): one probe on `atb::Runner::Execute(RunnerVariantPack&)`,
//! the function msMemScope's ATB hook interposes (reference: msmemscope-and-insight.md §5), which
//! every ATB operation runs through with the workspace its caller allocated.
//!
//! What is read, at entry, from the pack (argument 1; argument 0 is the runner, `this`):
//! `workspaceBuffer` and `workspaceBufferSize` (the kernels' scratch) and `intermediateBufferSize`
//! (the graph's intermediate tensors, laid out right after the scratch in the same caller-provided
//! buffer; ATB's Setup asks the caller for the sum of the two). The intermediate part is what
//! ATB_WORKSPACE_MEM_ALLOC_ALG_TYPE changes, which is why the advisor needs it.
//!
//! Offsets come from DWARF when the library (or its debug file) describes `atb::RunnerVariantPack`
//! (`attach::plan`). Release builds of ATB carry no DWARF, so otherwise the offsets of the open-source ATB's
//! public declarations are assumed ([`FALLBACK_OFFSETS`]): the pack starts with two
//! `SVector<Tensor>` and two `SVector<bool>` of 64+1 inline elements, and that arithmetic is
//! checked against a compiled copy of the declarations (tests/standin/atb/atb_standin.h) below. An
//! ATB whose pack changed shape would give wrong sizes, which is why `probes` says which source
//! was used.
//!
//! A graph runner executes its nodes' runners through the same function; those nested calls are
//! one call of this layer, so one ATB operation is one record, with the outermost pack (the whole
//! graph's workspace). The runner's name is a `std::string` the generic probe cannot copy, so
//! operations are told apart by their runner's address.

use memscope_common::spec::{layer, FieldRead, ProbeSpec};

use super::op::Op;
use super::{named, no_status, spec, Api, ApiDef, Attach, Family, Layout, Tracking};

/// `atb::RunnerVariantPack`: the members read, in field order.
pub static RUNNER_VARIANT_PACK: Layout = Layout {
    namespace: "atb",
    name: "RunnerVariantPack",
    members: &["workspaceBuffer", "workspaceBufferSize", "intermediateBufferSize"],
};

/// The fields [`RUNNER_VARIANT_PACK`]'s members fill (its members, and [`FALLBACK_OFFSETS`], are
/// in this order).
#[derive(Clone, Copy)]
enum Pack {
    Workspace,
    WorkspaceSize,
    IntermediateSize,
}

/// Offsets of [`RUNNER_VARIANT_PACK`]'s members in the open-source ATB (hicann/ascend-transformer-boost) on LP64 targets, used when no DWARF
/// describes the pack. `Tensor` is 104 bytes (`TensorDesc` 80: two int enums and `Dims` of eight
/// `int64_t` plus a count; two pointers; a size), an `SVector<T>` is capacity, size, 65 inline
/// elements and a heap pointer (6784 bytes for `Tensor`, 96 for `bool`), and the pack's pointers
/// and sizes follow the four vectors from byte 13760.
pub const FALLBACK_OFFSETS: [u64; 3] = [13784, 13792, 13808];

const fn execute_spec(offsets: [u64; 3]) -> ProbeSpec {
    spec(
        layer::OPERATOR,
        0,
        &named(&[
            (Pack::Workspace as usize, FieldRead::arg_at_entry(1, offsets[Pack::Workspace as usize] as u32, 8)),
            (Pack::WorkspaceSize as usize, FieldRead::arg_at_entry(1, offsets[Pack::WorkspaceSize as usize] as u32, 8)),
            (
                Pack::IntermediateSize as usize,
                FieldRead::arg_at_entry(1, offsets[Pack::IntermediateSize as usize] as u32, 8),
            ),
        ]),
    )
}

pub(super) static TABLE: [ApiDef; 1] = [ApiDef {
    api: Api::AtbRunnerExecute,
    name: "atb::Runner::Execute",
    symbol: "_ZN3atb6Runner7ExecuteERNS_17RunnerVariantPackE",
    family: Family::Atb,
    // Returns atb::Status, 0 on success.
    spec: execute_spec(FALLBACK_OFFSETS),
    decode: |c| Op::AtbExecute {
        runner: c.args[0],
        workspace: c.field(Pack::Workspace as usize),
        workspace_size: c.field(Pack::WorkspaceSize as usize),
        intermediate_size: c.field(Pack::IntermediateSize as usize),
    },
    out_of_memory: no_status,
    layout: Some(&RUNNER_VARIANT_PACK),
    tracking: Tracking::NONE,
    attach: Attach::Symbol,
}];

#[cfg(test)]
mod tests {

    use super::*;
    use crate::raw::RawCall;

    fn raw(fields: [Option<u64>; 4]) -> RawCall {
        super::super::call_with(Api::AtbRunnerExecute, [0x5000, 0x7000, 0, 0, 0, 0], fields)
    }

    #[test]
    fn execute_decodes_the_runner_and_the_packs_workspace() {
        let def = Api::AtbRunnerExecute.def();
        let op = (def.decode)(&raw([Some(0x9000), Some(1 << 20), Some(44 << 20), None]));
        assert_eq!(
            op,
            Op::AtbExecute {
                runner: 0x5000,
                workspace: Some(0x9000),
                workspace_size: Some(1 << 20),
                intermediate_size: Some(44 << 20),
            }
        );
        // A field the probe could not read stays unknown rather than zero.
        let op = (def.decode)(&raw([None, Some(512), None, None]));
        assert!(matches!(op, Op::AtbExecute { workspace: None, intermediate_size: None, .. }));
    }

    /// Attaching fills the fields from DWARF in the order of the layout's members, and
    /// [`FALLBACK_OFFSETS`] is in that order too: each name must be the member its field reads.
    #[test]
    fn each_pack_field_is_named_as_the_member_that_fills_it() {
        let pack = [
            (Pack::Workspace, "workspaceBuffer"),
            (Pack::WorkspaceSize, "workspaceBufferSize"),
            (Pack::IntermediateSize, "intermediateBufferSize"),
        ];
        for (field, member) in pack {
            assert_eq!(RUNNER_VARIANT_PACK.members[field as usize], member);
        }
        assert_eq!(RUNNER_VARIANT_PACK.members.len(), pack.len());
        // The open-source layout: the buffer pointer, its size, then the intermediate size.
        assert!(FALLBACK_OFFSETS[Pack::Workspace as usize] < FALLBACK_OFFSETS[Pack::WorkspaceSize as usize]);
        assert_eq!(FALLBACK_OFFSETS[Pack::IntermediateSize as usize], 13808);
    }

    #[test]
    fn the_spec_reads_the_pack_at_entry_on_its_own_layer() {
        let s = Api::AtbRunnerExecute.def().spec;
        assert_eq!(s.layer, layer::OPERATOR);
        for (i, offset) in FALLBACK_OFFSETS.iter().enumerate() {
            let f = s.fields[i];
            assert_eq!((f.arg, f.at_entry, f.width, u64::from(f.offset)), (1, 1, 8, *offset));
        }
        assert!(s.reads_at_entry());
    }
}
