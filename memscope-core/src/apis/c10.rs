//! PyTorch's CPU allocator (`c10/core/impl/alloc_cpu.cpp`, exported from `libc10.so`): every CPU
//! tensor's storage comes from `c10::alloc_cpu(size_t)` and goes back through
//! `c10::free_cpu(void*)`.
//!
//! This is the third-party check of the tracer: a real PyTorch, traced from outside, whose own
//! numbers (parameter and optimizer-state storage bytes) the owner decomposition must match.
//! The blocks are host memory (`HOST` rows on the cpu output, not pinned).

use memscope_common::spec::{layer, ret_kind, sample_class, ProbeSpec};

use super::op::{Op, Space};
use super::{at, sampled_alloc, sampled_free, spec, Api, ApiDef, Family};
use crate::raw::RawCall;

/// A framework allocator like torch_npu's pools; neither function returns a status. Frees inside
/// a garbage-collector pass are reported as the collector's (its layer is outer).
const fn c10_spec() -> ProbeSpec {
    let mut s = spec(layer::POOL, layer::GC, &[]);
    s.ret_kind = ret_kind::NONE;
    s
}

const fn row(api: Api, name: &'static str, symbol: &'static str, decode: fn(&RawCall) -> Op) -> ApiDef {
    let spec = match api {
        Api::C10AllocCpu => {
            sampled_alloc(c10_spec(), sample_class::CPU, [at::arg(0), at::NONE, at::RET, at::NONE, at::NONE])
        }
        _ => sampled_free(c10_spec(), sample_class::CPU, at::arg(0)),
    };
    ApiDef { name, ..ApiDef::plain(api, symbol, Family::C10, spec, decode) }
}

pub(super) static TABLE: [ApiDef; 2] = [
    row(Api::C10AllocCpu, "c10::alloc_cpu", "_ZN3c109alloc_cpuEm", |c| Op::Malloc {
        space: Space::Cpu,
        size: c.args[0],
        // alloc_cpu throws instead of returning null; a zero return means an unwound call.
        ptr: (c.ret != 0).then_some(c.ret),
        policy: None,
        device: None,
        module: None,
        driver: None,
    }),
    row(Api::C10FreeCpu, "c10::free_cpu", "_ZN3c108free_cpuEPv", |c| Op::Free {
        space: Space::Cpu,
        ptr: c.args[0],
        driver: None,
    }),
];
