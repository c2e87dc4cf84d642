//! CPython's cyclic garbage collector: one probe on the function that runs a collection pass
//! (`gc_collect_main`, a static function of `libpython3.x.so` or of a statically linked
//! `python3.x`, found through `.symtab` or the interpreter's debug file).
//!
//! Why trace it: a tensor caught in a reference cycle is not freed when the program drops it but
//! when the collector next reaches its generation, which can be many steps later. The pool and
//! CPU-allocator frees the collector causes run inside this call, so their specs name this layer
//! as their outer one, and their FREE rows say `freed_by: gc`. That evidence is what makes the
//! advisor recommend collecting at epoch ends (`analysis::gc_held`).
//!
//! The pass's own record is not written: the frees inside it are what matter, and a program can
//! run hundreds of passes a second that free no traced memory. Stripped interpreters without a
//! debug file lack the symbol; `probes` then lists no Python layer and nothing else changes.

use memscope_common::spec::{layer, ret_kind, ProbeSpec};

use super::op::Op;
use super::{no_status, spec, Api, ApiDef, Attach, Family, Tracking};

const fn gc_spec() -> ProbeSpec {
    let mut s = spec(layer::GC, 0, &[]);
    // It returns the number of objects collected, not a status.
    s.ret_kind = ret_kind::NONE;
    s
}

/// `gc_collect_main(PyThreadState *tstate, int generation, ...)` from 3.8 to 3.13; the arguments
/// after the generation changed between versions and are not read.
pub(super) static TABLE: [ApiDef; 1] = [ApiDef {
    api: Api::PyGcCollect,
    name: "gc_collect_main",
    symbol: "gc_collect_main",
    family: Family::PythonGc,
    spec: gc_spec(),
    decode: |c| Op::GcPass { generation: c.args[1] as i32 },
    out_of_memory: no_status,
    layout: None,
    // The pool and CPU-allocator frees it causes run inside it.
    tracking: Tracking { collects_garbage: true, ..Tracking::NONE },
    attach: Attach::Symbol,
}];
