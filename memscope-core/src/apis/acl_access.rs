//! What the ACL runtime does with memory it did not allocate: copies and sets (`aclrtMemcpy`,
//! `aclrtMemcpyAsync`, `aclrtMemset`) and kernel launches (`aclrtLaunchKernel`, whose argument
//! buffer holds the device addresses the kernel will use), plus `aclrtBinaryGetFunction`, which
//! names the kernel behind a function handle. These are the "uses" of a block that the
//! inefficiency analyses need (msMemScope's ACCESS and KERNEL_LAUNCH events).
//!
//! The launch's argument buffer is copied at entry, bounded to `BLOB_LEN` bytes, and every
//! 8-byte word in it that falls inside a live block counts as an access of that block. The newer
//! launch path builds the arguments on an opaque handle instead (`aclrtKernelArgsInit`, one
//! `aclrtKernelArgsAppend` per parameter, `aclrtLaunchKernelWithConfig(func, blockDim, stream,
//! cfg, argsHandle, reserve)`): each appended parameter is copied at its append, the tracker
//! keeps them per handle, and the launch names the handle. The
//! buffer is readable by the probe when it is host memory (the stand-in; launch paths that
//! stage arguments on the host); on hardware where `argsData` is device memory the copy fails
//! and the launch is recorded without accesses.

use memscope_common::spec::{layer, FieldRead, ProbeSpec};

use super::op::Op;
use super::{named, spec, Api, ApiDef, Family};
use crate::raw::RawCall;

const PLAIN: ProbeSpec = spec(layer::RUNTIME, layer::POOL, &[]);

/// `aclrtLaunchKernel(funcHandle, blockDim, argsData, argsSize, stream)`: copy `argsData`.
const LAUNCH: ProbeSpec = {
    let mut s = PLAIN;
    s.blob_arg = 2;
    s.blob_len_arg = 3;
    s
};

/// `aclrtKernelArgsAppend(argsHandle, param, paramSize, *paramHandle)`: copy `param`.
const APPEND: ProbeSpec = {
    let mut s = PLAIN;
    s.blob_arg = 1;
    s.blob_len_arg = 2;
    s
};

/// `aclrtKernelArgsInit(funcHandle, *argsHandle)`: the new handle, written at return.
const ARGS_INIT: ProbeSpec =
    spec(layer::RUNTIME, layer::POOL, &named(&[(ArgsInit::Handle as usize, FieldRead::arg_at_exit(1, 0, 8))]));

/// `aclrtKernelArgsInit(kernel, *argsHandle)`: `*argsHandle` at return.
#[derive(Clone, Copy)]
enum ArgsInit {
    Handle,
}

/// `aclrtBinaryGetFunction(binHandle, kernelName, *funcHandle)`.
const GET_FUNCTION: ProbeSpec = {
    let mut s = spec(layer::RUNTIME, layer::POOL, &[FieldRead::arg_at_exit(2, 0, 8)]);
    s.text_arg = 1;
    s
};

const fn row(api: Api, symbol: &'static str, spec: ProbeSpec, decode: fn(&RawCall) -> Op) -> ApiDef {
    ApiDef::plain(api, symbol, Family::AclRuntime, spec, decode)
}

pub(super) static TABLE: [ApiDef; 8] = [
    // (dst, destMax, src, count, kind): the destination is written, the source read.
    row(Api::AclrtMemcpy, "aclrtMemcpy", PLAIN, |c| Op::Copy { dst: c.args[0], src: c.args[2], size: c.args[3] }),
    row(Api::AclrtMemcpyAsync, "aclrtMemcpyAsync", PLAIN, |c| Op::Copy {
        dst: c.args[0],
        src: c.args[2],
        size: c.args[3],
    }),
    // (devPtr, maxCount, value, count)
    row(Api::AclrtMemset, "aclrtMemset", PLAIN, |c| Op::Set { ptr: c.args[0], size: c.args[3] }),
    row(Api::AclrtLaunchKernel, "aclrtLaunchKernel", LAUNCH, |c| Op::Launch {
        function: c.args[0],
        args: c.blob.clone().unwrap_or_default(),
        args_size: c.args[3],
        stream: c.args[4],
    }),
    row(Api::AclrtBinaryGetFunction, "aclrtBinaryGetFunction", GET_FUNCTION, |c| Op::KernelName {
        function: c.result(),
        name: c.text.clone(),
    }),
    row(Api::AclrtKernelArgsInit, "aclrtKernelArgsInit", ARGS_INIT, |c| Op::KernelArgs {
        handle: c.field(ArgsInit::Handle as usize).unwrap_or(0),
        append: None,
    }),
    row(Api::AclrtKernelArgsAppend, "aclrtKernelArgsAppend", APPEND, |c| Op::KernelArgs {
        handle: c.args[0],
        append: Some(c.blob.clone().unwrap_or_default()),
    }),
    // (funcHandle, blockDim, stream, cfg, argsHandle, reserve)
    row(Api::AclrtLaunchKernelWithConfig, "aclrtLaunchKernelWithConfig", PLAIN, |c| Op::LaunchArgs {
        function: c.args[0],
        handle: c.args[4],
        stream: c.args[2],
    }),
];
