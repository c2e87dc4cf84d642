//! The traced APIs: for each one, the symbol names to attach, the capture rules handed to the BPF
//! probes ([`ProbeSpec`]) and how a captured call decodes into an [`Op`] (what the call did,
//! [`op`]: below the model, which works on them).
//!
//! This table is the only place that knows API semantics. The BPF side is generic, and the model
//! works on [`Op`]s, so adding an API is a row here plus a stand-in function and a ledger test.
//! One file per family: [`acl`] (runtime), [`hal`] (driver), [`torch_npu`], [`mstx`], [`c10`]
//! (PyTorch's CPU allocator), [`python_gc`] (CPython's garbage collector), [`atb`] (Ascend
//! Transformer Boost operations and their workspaces); the NVIDIA backend's [`cuda`] (cudart),
//! [`cuda_driver`] (libcuda, with its virtual-memory calls) and [`c10_cuda`] (PyTorch's CUDA
//! caching allocator: its USDT probes and internals). [`markers`] is the USDT side of our own
//! markers package.

mod acl;
mod acl_access;
pub mod atb;
mod c10;
pub mod c10_cuda;
pub mod cuda;
mod cuda_driver;
pub mod hal;
pub mod libraries;
pub mod markers;
mod mstx;
pub mod op;
mod python_gc;
pub mod torch_npu;

use memscope_common::spec::{
    field_source, sample_kind, value_at, FieldRead, ProbeSpec, SampleRule, MAX_FIELDS, MAX_SPECS,
};

use crate::raw::RawCall;
pub use op::Op;
use op::Pool;

/// A traced API. The discriminant is the spec index in the BPF `SPECS` map (and part of the
/// attach cookie), so it must stay below `MAX_SPECS` and never be renumbered within one build.
/// One byte (`MAX_SPECS` is 256): every live block keeps the API that made it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Api {
    AclrtSetDevice = 1,
    AclrtGetDevice = 2,
    AclrtMalloc = 3,
    AclrtMallocAlign32 = 4,
    AclrtMallocCached = 5,
    AclrtMallocWithCfg = 6,
    AclrtFree = 7,
    AclrtMallocHost = 8,
    AclrtFreeHost = 9,
    AclrtReserveMemAddress = 10,
    AclrtReleaseMemAddress = 11,
    AclrtMallocPhysical = 12,
    AclrtFreePhysical = 13,
    AclrtMapMem = 14,
    AclrtUnmapMem = 15,
    HalMemAlloc = 16,
    HalMemFree = 17,
    HalMemCreate = 18,
    HalMemRelease = 19,
    DeviceCachingAllocatorMalloc = 20,
    DeviceCachingAllocatorFree = 21,
    NpuCachingAllocatorMalloc = 22,
    NpuCachingAllocatorFree = 23,
    WorkspaceMalloc = 24,
    WorkspaceFree = 25,
    MallocBlock = 26,
    FreeBlock = 27,
    GetBlockPtr = 28,
    GetBlockSize = 29,
    AllocateWorkspace = 30,
    MstxDomainCreateA = 31,
    MstxMemHeapRegister = 32,
    MstxMemRegionsRegister = 33,
    MstxMemRegionsUnregister = 34,
    MstxMarkA = 35,
    MstxRangeStartA = 36,
    MstxRangeEnd = 37,
    MstxDomainMarkA = 38,
    MstxDomainRangeStartA = 39,
    MstxDomainRangeEnd = 40,
    C10AllocCpu = 41,
    C10FreeCpu = 42,
    AclrtMemcpy = 43,
    AclrtMemcpyAsync = 44,
    AclrtMemset = 45,
    AclrtLaunchKernel = 46,
    AclrtBinaryGetFunction = 47,
    PyGcCollect = 48,
    RecordStream = 49,
    EraseStream = 50,
    AclrtKernelArgsInit = 51,
    AclrtKernelArgsAppend = 52,
    AclrtLaunchKernelWithConfig = 53,
    AtbRunnerExecute = 60,
    CudaSetDevice = 61,
    CudaGetDevice = 62,
    CudaMalloc = 63,
    CudaFree = 64,
    CudaMallocAsync = 65,
    CudaFreeAsync = 66,
    CudaMallocHost = 67,
    CudaHostAlloc = 68,
    CudaFreeHost = 69,
    CudaMallocManaged = 70,
    CuMemAlloc = 71,
    CuMemFree = 72,
    CuMemAllocAsync = 73,
    CuMemFreeAsync = 74,
    CuMemAllocManaged = 75,
    CuMemAllocHost = 76,
    CuMemFreeHost = 77,
    CuMemCreate = 78,
    CuMemRelease = 79,
    CuMemMap = 80,
    CuMemUnmap = 81,
    CuMemAddressReserve = 82,
    CuMemAddressFree = 83,
    PytorchMalloc = 84,
    PytorchFree = 85,
    CudaAllocBlock = 86,
    CudaMapBlock = 87,
    AclrtHostRegister = 88,
    AclrtHostRegisterV2 = 89,
    AclrtHostUnregister = 90,
    CudaHostRegister = 91,
    CudaHostUnregister = 92,
    CuMemHostAlloc = 93,
    CuMemHostRegister = 94,
    CuMemHostUnregister = 95,
}

/// Which group of libraries an API lives in; decides where symbols are looked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    /// The ACL runtime: `libascendcl.so`, or `libacl_rt.so` + `libacl_rt_impl.so` in newer CANN.
    AclRuntime,
    /// The driver: `libascend_hal.so`.
    Hal,
    /// torch_npu's allocators: `libtorch_npu.so`.
    TorchNpu,
    /// MindStudio's tool extension (markers, memory regions): `libms_tools_ext.so`.
    Mstx,
    /// PyTorch's CPU allocator (`c10::alloc_cpu` / `c10::free_cpu`): `libc10.so`.
    C10,
    /// CPython's garbage collector: `libpython3.x.so`, or the interpreter itself when it is
    /// linked statically (Debian's `python3.x`).
    PythonGc,
    /// Ascend Transformer Boost's operators (`atb::Runner::Execute`): `libatb.so`.
    Atb,
    /// The CUDA runtime: `libcudart.so` (pip wheels keep it under `nvidia/cuda_runtime/lib` or
    /// `nvidia/cu13/lib`, reached through the framework's RPATH).
    CudaRuntime,
    /// The CUDA driver: `libcuda.so`, including the virtual-memory (`cuMem*`) calls of
    /// expandable segments and NCCL.
    CudaDriver,
    /// PyTorch's CUDA caching allocator: `libc10_cuda.so` (its `pytorch:malloc/free` USDT probes
    /// and, where `.symtab` is kept, its internals).
    CudaCaching,
}

impl Family {
    /// Outer layer first: the order libraries are attached in.
    pub const ALL: [Family; 10] = [
        Family::PythonGc,
        Family::Atb,
        Family::TorchNpu,
        Family::CudaCaching,
        Family::C10,
        Family::Mstx,
        Family::AclRuntime,
        Family::CudaRuntime,
        Family::Hal,
        Family::CudaDriver,
    ];

    /// Library file names (without version suffixes) that carry this family's symbols.
    pub fn library_names(self) -> &'static [&'static str] {
        match self {
            Self::AclRuntime => &["libascendcl.so", "libacl_rt.so", "libacl_rt_impl.so"],
            Self::Hal => &["libascend_hal.so"],
            Self::TorchNpu => &["libtorch_npu.so"],
            Self::Mstx => &["libms_tools_ext.so"],
            Self::C10 => &["libc10.so"],
            Self::Atb => &["libatb.so"],
            Self::CudaRuntime => &["libcudart.so"],
            Self::CudaDriver => &["libcuda.so"],
            Self::CudaCaching => &["libc10_cuda.so"],
            Self::PythonGc => &[
                "libpython3.8.so",
                "libpython3.9.so",
                "libpython3.10.so",
                "libpython3.11.so",
                "libpython3.12.so",
                "libpython3.13.so",
                "python3.8",
                "python3.9",
                "python3.10",
                "python3.11",
                "python3.12",
                "python3.13",
            ],
        }
    }

    /// The suffix of the implementation symbol a public function forwards to (`aclrtMallocImpl`,
    /// `halMemAllocInner`), for the families that have one.
    pub fn impl_suffix(self) -> Option<&'static str> {
        match self {
            Self::AclRuntime => Some("Impl"),
            Self::Hal => Some("Inner"),
            Self::TorchNpu
            | Self::Mstx
            | Self::C10
            | Self::PythonGc
            | Self::Atb
            | Self::CudaRuntime
            | Self::CudaDriver
            | Self::CudaCaching => None,
        }
    }

    /// What a user calls this layer.
    pub fn describe(self) -> &'static str {
        match self {
            Self::AclRuntime => "ACL runtime",
            Self::Hal => "driver (HAL)",
            Self::TorchNpu => "torch_npu allocators (PTA)",
            Self::Mstx => "mstx memory regions and markers",
            Self::C10 => "PyTorch CPU allocator (c10)",
            Self::PythonGc => "Python garbage collector",
            Self::Atb => "Ascend Transformer Boost operators (ATB)",
            Self::CudaRuntime => "CUDA runtime (cudart)",
            Self::CudaDriver => "CUDA driver (libcuda)",
            Self::CudaCaching => "PyTorch CUDA caching allocator (c10_cuda)",
        }
    }

    /// The accelerator backend this family belongs to; `None` for the ones both share (PyTorch's
    /// CPU allocator, Python's collector).
    pub fn backend(self) -> Option<Backend> {
        match self {
            Self::AclRuntime | Self::Hal | Self::TorchNpu | Self::Mstx | Self::Atb => Some(Backend::Ascend),
            Self::CudaRuntime | Self::CudaDriver | Self::CudaCaching => Some(Backend::Cuda),
            Self::C10 | Self::PythonGc => None,
        }
    }
}

/// Which accelerator stack a trace's probes came from: the run folder and the summary say it,
/// and the advice names that stack's allocator settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Backend {
    /// Huawei Ascend: CANN (ACL, HAL), torch_npu, ATB.
    Ascend,
    /// NVIDIA: cudart, libcuda, PyTorch's CUDA caching allocator.
    Cuda,
}

impl Backend {
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Ascend => "ascend",
            Self::Cuda => "cuda",
        }
    }

    /// The environment variable that configures this stack's PyTorch caching allocator.
    pub const fn alloc_conf(self) -> &'static str {
        match self {
            Self::Ascend => "PYTORCH_NPU_ALLOC_CONF",
            Self::Cuda => "PYTORCH_CUDA_ALLOC_CONF",
        }
    }

    /// The Python module of this stack's device memory calls (`set_per_process_memory_fraction`).
    pub const fn python_module(self) -> &'static str {
        match self {
            Self::Ascend => "torch_npu.npu",
            Self::Cuda => "torch.cuda",
        }
    }

    /// The backends the traced APIs belong to, in order.
    pub fn of(apis: impl IntoIterator<Item = Api>) -> Vec<Backend> {
        let set: std::collections::BTreeSet<Backend> = apis.into_iter().filter_map(|a| a.family().backend()).collect();
        set.into_iter().collect()
    }

    /// A run folder's suffix (`memscope_<pid>_<time>_<suffix>`): `cuda` when only NVIDIA's
    /// stack was traced, else msMemScope's `ascend` (which its tools look for).
    pub fn folder_suffix(backends: &[Backend]) -> &'static str {
        if backends == [Backend::Cuda] {
            Backend::Cuda.as_str()
        } else {
            Backend::Ascend.as_str()
        }
    }

    /// `ms_meta.backend`: the backends joined with `+`, or `none` (only the CPU allocator or
    /// the markers were traced).
    pub fn meta(backends: &[Backend]) -> String {
        match backends {
            [] => "none".to_owned(),
            _ => backends.iter().map(|b| b.as_str()).collect::<Vec<_>>().join("+"),
        }
    }
}

/// How a row's probe is found in a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attach {
    /// The function whose name is the row's `symbol`.
    Symbol,
    /// The first function whose mangled name starts with the row's `symbol` (which ends with
    /// the name's closing `E`): C++ internals whose parameter lists drift between versions, and
    /// whose arguments the row does not read. Split-off parts (`.cold`, `.isra`) never match.
    SymbolPrefix,
    /// A USDT probe, `symbol` being `provider:name`: its hits are calls of this API made at the
    /// site, with the note's arguments as the call's (`apis::usdt_call`).
    Usdt,
}

/// A struct whose field offsets a spec needs, found in the library's DWARF at attach time.
pub struct Layout {
    /// A namespace the struct is nested in (anonymous namespaces in between are allowed).
    pub namespace: &'static str,
    pub name: &'static str,
    pub members: &'static [&'static str],
}

/// What the tracker does with an API's calls beyond what their [`Op`] says: the decisions that
/// differ between APIs whose calls decode alike, kept in the table so that the model names no
/// API.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tracking {
    /// A call of it made inside a traced call of an outer layer (a driver call inside a runtime
    /// call, an mstx region a pool reports from inside its allocator call) is folded into that
    /// call: one fact, one row. Its record arrives first and waits for the outer call's.
    pub folds_into_outer: bool,
    /// Device memory taken inside a call of it is a segment of this framework pool.
    pub segment_pool: Option<Pool>,
    /// Frees inside a call of it are the garbage collector's (`freed_by`).
    pub collects_garbage: bool,
    /// A workspace block it hands out is in use until it hands out the next on the same device
    /// (no free of it is probed).
    pub workspace_until_next: bool,
}

impl Tracking {
    /// A call that is a fact of its own, with no effect on the calls inside it.
    pub const NONE: Self =
        Self { folds_into_outer: false, segment_pool: None, collects_garbage: false, workspace_until_next: false };
}

/// One row of the table.
pub struct ApiDef {
    pub api: Api,
    /// The name written to the DB (`aclrtMalloc`, `DeviceCachingAllocator::malloc`).
    pub name: &'static str,
    /// The symbol attached to (mangled for C++).
    pub symbol: &'static str,
    pub family: Family,
    pub spec: ProbeSpec,
    pub decode: fn(&RawCall) -> Op,
    /// Whether a failure status means "out of memory" (msMemScope's OOM trigger).
    pub out_of_memory: fn(i32) -> bool,
    /// Field reads that need a struct layout: the spec's fields `0..members.len()` read those
    /// members, at offsets filled in from DWARF when attaching.
    pub layout: Option<&'static Layout>,
    pub tracking: Tracking,
    pub attach: Attach,
}

impl ApiDef {
    /// The common row: written as its symbol, no failure is out of memory, no struct layout, no
    /// special tracking. Families change what differs with struct update syntax.
    pub const fn plain(
        api: Api,
        symbol: &'static str,
        family: Family,
        spec: ProbeSpec,
        decode: fn(&RawCall) -> Op,
    ) -> Self {
        Self {
            api,
            name: symbol,
            symbol,
            family,
            spec,
            decode,
            out_of_memory: no_status,
            layout: None,
            tracking: Tracking::NONE,
            attach: Attach::Symbol,
        }
    }
}

/// Never out of memory: APIs without a status.
pub fn no_status(_: i32) -> bool {
    false
}

/// Builds a spec: layer, outer layer and field reads; everything else as in [`ProbeSpec::EMPTY`].
pub const fn spec(layer: u32, outer_layer: u32, fields: &[FieldRead]) -> ProbeSpec {
    let mut s = ProbeSpec::EMPTY;
    s.layer = layer;
    s.outer_layer = outer_layer;
    let mut i = 0;
    while i < fields.len() && i < MAX_FIELDS {
        s.fields[i] = fields[i];
        i += 1;
    }
    s
}

/// Where a [`SampleRule`] finds a value: argument `i`, field read `i`, the return value, nowhere.
pub mod at {
    use super::value_at;

    pub const fn arg(i: u8) -> [u8; 2] {
        [value_at::ARG, i]
    }
    pub const fn field(i: usize) -> [u8; 2] {
        [value_at::FIELD, i as u8]
    }
    pub const RET: [u8; 2] = [value_at::RET, 0];
    pub const THREAD_DEVICE: [u8; 2] = [value_at::THREAD_DEVICE, 0];
    pub const NONE: [u8; 2] = [value_at::NONE, 0];
}

/// `spec` with the sampling rule of an API that hands out blocks of `class`
/// (`memscope_common::spec::sample_class`): where its requested bytes, block size, address and
/// device (and where else the device is, when that read fails) are. These must be the values its
/// `decode` reads (a test checks them against it).
pub const fn sampled_alloc(
    mut spec: ProbeSpec,
    class: u8,
    [request, size, ptr, device, device_else]: [[u8; 2]; 5],
) -> ProbeSpec {
    let kind = sample_kind::ALLOC;
    spec.sample = SampleRule { kind, class, request, size, ptr, device, device_else, ..SampleRule::NONE };
    spec
}

/// `spec` with the sampling rule of the API that takes the blocks of `class` back, by the
/// address at `ptr` (at its entry).
pub const fn sampled_free(mut spec: ProbeSpec, class: u8, ptr: [u8; 2]) -> ProbeSpec {
    spec.sample = SampleRule { kind: sample_kind::FREE, class, ptr, ..SampleRule::NONE };
    spec
}

/// The catalogue's families' tables, in spec-id order.
const TABLES: [&[ApiDef]; 11] = [
    &acl::TABLE,
    &hal::TABLE,
    &torch_npu::TABLE,
    &mstx::TABLE,
    &c10::TABLE,
    &acl_access::TABLE,
    &python_gc::TABLE,
    &atb::TABLE,
    &cuda::TABLE,
    &cuda_driver::TABLE,
    &c10_cuda::TABLE,
];

/// The table by spec id, built by the compiler: every record and row looks its API up, several
/// times, so a lookup is one load. Two rows for one API do not build.
static BY_ID: [Option<&'static ApiDef>; MAX_SPECS as usize] = {
    let mut by_id = [None; MAX_SPECS as usize];
    let mut t = 0;
    while t < TABLES.len() {
        let mut i = 0;
        while i < TABLES[t].len() {
            let def = &TABLES[t][i];
            assert!(by_id[def.api as usize].is_none(), "two table rows for one API");
            by_id[def.api as usize] = Some(def);
            i += 1;
        }
        t += 1;
    }
    by_id
};

/// Places a spec's field reads given by name where the probe writes their values and the decoder
/// reads them. Each spec's fields are an enum next to it, in slot order; a read is given as
/// `(Field::X as usize, read)` and decoded with `c.field(Field::X as usize)`, so the order the
/// reads are written in changes nothing, and a name stands for the same value on both sides. A
/// slot named twice, or one left without a read below the last, does not build.
pub const fn named(reads: &[(usize, FieldRead)]) -> [FieldRead; MAX_FIELDS] {
    let mut fields = [FieldRead::NONE; MAX_FIELDS];
    let mut set = [false; MAX_FIELDS];
    let mut i = 0;
    while i < reads.len() {
        let (slot, read) = reads[i];
        assert!(slot < MAX_FIELDS, "a spec has MAX_FIELDS field slots");
        assert!(!set[slot], "two reads for one field");
        fields[slot] = read;
        set[slot] = true;
        i += 1;
    }
    let mut slot = 0;
    while slot < reads.len() {
        assert!(set[slot], "a field slot below the last has no read");
        slot += 1;
    }
    fields
}

/// The slot [`RawCall::result`] reads: a spec's out-pointer read is its first.
pub const RESULT: usize = 0;

/// The field slot of the caller's address ([`with_caller`]): the last, which no other read of
/// an allocating API takes.
pub const CALLER_FIELD: usize = MAX_FIELDS - 1;

/// `spec` reading its caller's address too, for the APIs that take memory: a library that calls
/// them itself names the memory's owner ([`libraries`]). One read at entry, no stack walk.
pub const fn with_caller(mut spec: ProbeSpec) -> ProbeSpec {
    assert!(spec.fields[CALLER_FIELD].source == field_source::NONE, "the caller's slot is taken");
    spec.fields[CALLER_FIELD] = FieldRead::caller();
    spec
}

/// The caller's address a call recorded, for an API [`with_caller`] made read it.
pub fn caller_address(api: Api, call: &RawCall) -> Option<u64> {
    (api.def().spec.fields[CALLER_FIELD].source == field_source::CALLER).then(|| call.field(CALLER_FIELD)).flatten()
}

impl Api {
    /// Every API, in spec-id order.
    pub fn all() -> impl Iterator<Item = &'static ApiDef> {
        TABLES.into_iter().flatten()
    }

    pub fn def(self) -> &'static ApiDef {
        BY_ID[self as usize].expect("every Api variant has a table row (checked by a unit test)")
    }

    /// The API of a public name (as `ms_probes.api` and the DB write it).
    pub fn from_name(name: &str) -> Option<Self> {
        Api::all().find(|d| d.name == name).map(|d| d.api)
    }

    pub fn from_spec_id(id: u32) -> Option<Self> {
        BY_ID.get(usize::try_from(id).ok()?).copied().flatten().map(|def| def.api)
    }

    pub fn spec_id(self) -> u32 {
        self as u32
    }

    /// The public name, used in the DB whichever symbol (public or implementation) was hit.
    pub fn name(self) -> &'static str {
        self.def().name
    }

    pub fn family(self) -> Family {
        self.def().family
    }

    /// Whether the daemon samples its blocks (pool, workspace and CPU-tensor calls): the calls
    /// its windows probe only part of the time.
    pub fn sampled(self) -> bool {
        self.def().spec.sample.kind != sample_kind::NONE
    }

    /// What the tracker does with its calls beyond their [`Op`].
    pub fn tracking(self) -> Tracking {
        self.def().tracking
    }

    /// The implementation symbol the public one forwards to, for families that have one.
    pub fn impl_symbol(self) -> Option<String> {
        self.family().impl_suffix().map(|suffix| format!("{}{suffix}", self.def().symbol))
    }

    /// The symbols that may stand for this API in a library (none for a USDT probe; a
    /// prefix row's is [`Api::symbol_prefix`]).
    pub fn symbols(self) -> impl Iterator<Item = String> {
        let exact = self.def().attach == Attach::Symbol;
        exact.then(|| std::iter::once(self.def().symbol.to_owned()).chain(self.impl_symbol())).into_iter().flatten()
    }

    /// The name prefix a [`Attach::SymbolPrefix`] row's function is found by.
    pub fn symbol_prefix(self) -> Option<&'static str> {
        (self.def().attach == Attach::SymbolPrefix).then_some(self.def().symbol)
    }

    /// What this API's probe is looked up by in a file's symbols: its exact names, or its
    /// prefix (the key a prefix match is stored under).
    pub fn lookup_names(self) -> impl Iterator<Item = String> {
        self.symbols().chain(self.symbol_prefix().map(str::to_owned))
    }

    /// `(provider, name)` of a USDT row.
    pub fn usdt_probe(self) -> Option<(&'static str, &'static str)> {
        (self.def().attach == Attach::Usdt).then(|| self.def().symbol.split_once(':')).flatten()
    }
}

/// USDT probe ids at or above this are API rows (`API_PROBE_BASE + spec id`); below are the
/// markers package's ([`markers::MarkerProbe`]).
pub const API_PROBE_BASE: u32 = 0x1_0000;

/// The API row of a USDT probe note, if one is traced.
pub fn usdt_api(provider: &str, name: &str) -> Option<Api> {
    Api::all().find(|d| d.api.usdt_probe() == Some((provider, name))).map(|d| d.api)
}

/// A USDT hit of an API row as the call it stands for: made and returned at the site, with the
/// note's arguments as its arguments and nothing read through pointers. `None` for a marker's
/// probe id.
pub fn usdt_call(raw: &crate::raw::RawUsdt) -> Option<RawCall> {
    let api = Api::from_spec_id(raw.probe.checked_sub(API_PROBE_BASE)?)?;
    (api.def().attach == Attach::Usdt).then(|| RawCall {
        spec_id: api.spec_id(),
        tgid: raw.tgid,
        tid: raw.tid,
        entry_mono_ns: raw.mono_ns,
        return_mono_ns: raw.mono_ns,
        args: raw.args,
        ret: 0,
        fields: [None; MAX_FIELDS],
        outer_spec: None,
        cfg_device: None,
        cfg_module: None,
        thread_device: None,
        text: None,
        blob: None,
        points: 0,
    })
}

/// A call of `api` as its probe would report it, each field's value in the slot where the spec
/// has the read it is given with: written from what each value is (which read of which argument),
/// never from a field's name or slot, so a read given the wrong name, or a decoder reading the
/// wrong one, shows in the decoded op.
#[cfg(test)]
pub(crate) fn call_reading(api: Api, values: &[(FieldRead, u64)]) -> RawCall {
    let spec = api.def().spec;
    let mut fields = [None; MAX_FIELDS];
    for (read, value) in values {
        let slots: Vec<usize> = (0..MAX_FIELDS).filter(|&i| spec.fields[i] == *read).collect();
        assert_eq!(slots.len(), 1, "{api:?}: the spec has {} reads {read:?}", slots.len());
        fields[slots[0]] = Some(*value);
    }
    call_with(api, [0x5000, 0x7000, 0x8000, 0x9000, 0, 0], fields)
}

/// A successful call of `api` on device 0 with these arguments and field values.
#[cfg(test)]
pub(crate) fn call_with(api: Api, args: [u64; 6], fields: [Option<u64>; MAX_FIELDS]) -> RawCall {
    RawCall {
        spec_id: api.spec_id(),
        tgid: 1,
        tid: 2,
        entry_mono_ns: 10,
        return_mono_ns: 20,
        args,
        ret: 0,
        fields,
        outer_spec: None,
        cfg_device: None,
        cfg_module: None,
        thread_device: Some(0),
        text: None,
        blob: None,
        points: 0,
    }
}

#[cfg(test)]
mod tests {
    use memscope_common::spec::layer;

    use super::*;

    /// What the kernel reads for a rule's value (`memscope-ebpf/src/probes/sample.rs`).
    fn rule_value(at: [u8; 2], call: &RawCall) -> Option<u64> {
        match at[0] {
            value_at::ARG => call.args.get(usize::from(at[1])).copied(),
            value_at::FIELD => call.field(usize::from(at[1])),
            value_at::RET => Some(call.ret),
            _ => None,
        }
    }

    /// The kernel counts and samples blocks by the rule's values and the model by the decoded
    /// op's: for every sampled API they must be the same values of one call.
    #[test]
    fn each_sampling_rule_reads_what_its_api_decodes() {
        let mut sampled = Vec::new();
        for def in Api::all().filter(|d| d.spec.sample.kind != sample_kind::NONE) {
            let rule = def.spec.sample;
            let fields = std::array::from_fn(|i| Some(0x10_0000 * (i as u64 + 1)));
            let mut call = call_with(def.api, [0x1000, 3, 0x3000, 0x4000, 0x5000, 0x6000], fields);
            call.ret = 0x70_0000;
            let (ptr, size, req, device) = match (def.decode)(&call) {
                Op::PoolMalloc { ptr, size, req, device, .. } => (ptr, size, req, device),
                Op::Malloc { ptr, size, device, .. } => (ptr, Some(size), Some(size), device),
                Op::PoolFree { ptr, .. } => (ptr, None, None, None),
                Op::Free { ptr, .. } => (Some(ptr), None, None, None),
                op => panic!("{:?} has a sampling rule but decodes to {op:?}", def.api),
            };
            assert_eq!(rule_value(rule.ptr, &call), ptr, "{:?}: address", def.api);
            if rule.kind == sample_kind::ALLOC {
                assert_eq!(rule_value(rule.request, &call), req, "{:?}: requested bytes", def.api);
                let counted = rule_value(rule.size, &call).or(rule_value(rule.request, &call));
                assert_eq!(counted, size.or(req), "{:?}: size", def.api);
                let found = |call: &RawCall| rule_value(rule.device, call).or(rule_value(rule.device_else, call));
                assert_eq!(found(&call), device.map(u64::from), "{:?}: device", def.api);
                // And when the reads fail, as the kernel falls back.
                call.fields = [None; MAX_FIELDS];
                if let Op::PoolMalloc { device: Some(device), .. } = (def.decode)(&call) {
                    assert_eq!(found(&call), Some(u64::from(device)), "{:?}: device without reads", def.api);
                }
            }
            sampled.push(def.api);
        }
        // Device-level calls are never sampled: the pool blocks and CPU tensors are.
        let expected = [
            Api::DeviceCachingAllocatorMalloc,
            Api::DeviceCachingAllocatorFree,
            Api::NpuCachingAllocatorMalloc,
            Api::NpuCachingAllocatorFree,
            Api::WorkspaceMalloc,
            Api::WorkspaceFree,
            Api::C10AllocCpu,
            Api::C10FreeCpu,
        ];
        assert_eq!(sampled, expected);
    }

    /// The daemon sends a sampled free's record from its entry probe alone (no return probe):
    /// what its return would add must change nothing the free decodes to.
    #[test]
    fn every_sampled_free_decodes_the_same_from_its_entry_alone() {
        let frees: Vec<&ApiDef> = Api::all().filter(|d| d.spec.sample.kind == sample_kind::FREE).collect();
        assert_eq!(frees.len(), 4);
        for def in frees {
            assert!(def.spec.complete_at_entry(), "{:?} needs its return", def.api);
            let fields = std::array::from_fn(|i| Some(0x10_0000 * (i as u64 + 1)));
            let mut returned = call_with(def.api, [0x1000, 3, 0x3000, 0x4000, 0x5000, 0x6000], fields);
            returned.ret = 0x70_0000;
            let mut at_entry = returned.clone();
            at_entry.ret = 0;
            for (i, f) in def.spec.fields.iter().enumerate() {
                if f.at_entry == 0 {
                    at_entry.fields[i] = None;
                }
            }
            let (a, b) = ((def.decode)(&returned), (def.decode)(&at_entry));
            assert_eq!(format!("{a:?}"), format!("{b:?}"), "{:?}", def.api);
        }
    }

    #[test]
    fn named_reads_go_to_their_slots_in_whatever_order_they_are_written() {
        let (a, b) = (FieldRead::arg_at_entry(1, 0, 8), FieldRead::arg_at_exit(0, 8, 4));
        assert_eq!(named(&[(1, b), (0, a)]), named(&[(0, a), (1, b)]));
        assert_eq!(named(&[(1, b), (0, a)]), [a, b, FieldRead::NONE, FieldRead::NONE]);
        let twice = std::panic::catch_unwind(|| named(&[(0, a), (0, b)]));
        assert!(twice.is_err(), "two reads for one field");
        let gap = std::panic::catch_unwind(|| named(&[(1, a)]));
        assert!(gap.is_err(), "a slot below the last without a read");
    }

    /// Every call that takes device, host or registered memory outside a pool reads its
    /// caller (a library calling it itself owns what it takes), and nothing else hands one out.
    #[test]
    fn every_call_that_takes_memory_reads_its_caller_and_only_those() {
        for def in Api::all() {
            // Flags with every bit a call may test (aclrtHostRegisterV2 pins only with PINNED).
            let call = call_with(def.api, [0x1000_1000; 6], [Some(0x2000); MAX_FIELDS]);
            let takes = match (def.decode)(&call) {
                Op::Malloc { space, .. } => space != op::Space::Cpu,
                Op::MallocPhysical { .. } => true,
                _ => false,
            };
            let caller = caller_address(def.api, &call);
            assert_eq!(caller.is_some(), takes, "{:?}: takes memory {takes}, caller {caller:?}", def.api);
            if takes {
                assert_eq!(caller, Some(0x2000));
            }
        }
    }

    #[test]
    fn every_api_has_one_row_and_a_valid_cookie() {
        let ids: Vec<u32> = Api::all().map(|d| d.api as u32).collect();
        let mut sorted = ids.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(ids.len(), sorted.len(), "duplicate table rows");
        for def in Api::all() {
            assert!(def.api.spec_id() > 0 && def.api.spec_id() < MAX_SPECS);
            assert_ne!(def.spec.layer, 0, "{} has no layer: its probes would do nothing", def.symbol);
            assert_eq!(Api::from_spec_id(def.api.spec_id()), Some(def.api));
        }
        for id in 1..=Api::AclrtBinaryGetFunction as u32 {
            assert!(Api::from_spec_id(id).is_some(), "spec id {id} has no row");
        }
    }

    #[test]
    fn every_apis_def_is_its_own_row() {
        for def in Api::all() {
            assert!(std::ptr::eq(def.api.def(), def), "{:?} finds another row", def.api);
            assert_eq!(def.api.name(), def.name);
        }
    }

    /// The decisions the tracker takes per API, spelt out apart from the rows that hold them.
    #[test]
    fn the_trackers_per_api_decisions_are_the_rows() {
        for def in Api::all() {
            let (t, api) = (def.tracking, def.api);
            let region = matches!(api, Api::MstxMemRegionsRegister | Api::MstxMemRegionsUnregister);
            // The driver's virtual-memory calls are made by the pools themselves, not the runtime.
            let cuda_driver = def.family == Family::CudaDriver && def.spec.outer_layer == layer::RUNTIME;
            assert_eq!(t.folds_into_outer, def.family == Family::Hal || region || cuda_driver, "{api:?}");
            let segment = match api {
                Api::WorkspaceMalloc | Api::AllocateWorkspace => Some(Pool::Workspace),
                Api::CudaAllocBlock | Api::CudaMapBlock => Some(Pool::Caching),
                _ if def.family == Family::TorchNpu => Some(Pool::Caching),
                _ => None,
            };
            assert_eq!(t.segment_pool, segment, "{api:?}");
            assert_eq!(t.collects_garbage, api == Api::PyGcCollect, "{api:?}");
            assert_eq!(t.workspace_until_next, api == Api::AllocateWorkspace, "{api:?}");
        }
    }

    /// The catalogue sits below the model: a decoder that needs a type of the model, the store
    /// or the analyses would make the layers a cycle again.
    #[test]
    fn the_catalogue_imports_nothing_from_the_layers_above_it() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src/apis");
        let mut files = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let text = std::fs::read_to_string(&path).unwrap();
            for above in ["model", "store", "analysis"] {
                assert!(!text.contains(&format!("crate::{above}")), "{} names crate::{above}", path.display());
            }
            files += 1;
        }
        assert!(files > 5, "read the catalogue's files");
    }
}
