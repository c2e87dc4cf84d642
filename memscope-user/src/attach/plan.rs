//! What to attach in one library, and why: the decision `trace` acts on and `probes` prints.
//!
//! - Runtime and driver: the implementation symbol (`...Impl`, `...Inner`) where exported, else
//!   the public one; both with `--probe-set all`.
//! - torch_npu: the allocator internals when their symbols can be found (the library's `.symtab`,
//!   or its debug file) — `DeviceCachingAllocator::malloc/free` with `Block`'s layout from DWARF,
//!   else `NpuCachingAllocator::malloc/free` — plus the workspace allocator's; otherwise the
//!   exported external-block and workspace functions. Never both: an exported function calls the
//!   internals, and nested calls of one layer are one call.
//! - mstx: every memory-region function found; regions reported from inside a traced allocator
//!   call are merged into it (see `model::tracker`).
//! - ATB: `atb::Runner::Execute`, with `RunnerVariantPack`'s layout from the library's DWARF, or
//!   its debug file's, else the open-source ATB's offsets (`apis::atb`); the note says which.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use memscope_common::spec::{FieldRead, ProbeSpec};
use memscope_core::apis::{Api, Family};

use super::debug::{self, DebugFile, Found};
use super::dwarf;
use super::elf::{ElfError, ElfSymbols, SymbolSource};
use super::file;
use super::libs::{self, wanted_symbols, Library};
use super::usdt;

/// Which symbols to probe in a library that has both `aclrtX` and `aclrtXImpl`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ProbeSet {
    /// The `...Impl` symbol where the library exports it (every front end funnels through it),
    /// else the public one.
    Default,
    /// Both. The kernel side still reports one call per logical call (nesting on the thread).
    All,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttachedProbe {
    pub library: String,
    pub symbol: String,
    pub api: Api,
    pub file_offset: u64,
    pub source: SymbolSource,
}

/// The debug file situation of a library.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DebugStatus {
    /// The library keeps its own `.symtab`.
    NotNeeded,
    Found(DebugFile),
    /// Stripped, and no matching debug file was found.
    Missing {
        link: Option<String>,
        build_id: Option<String>,
    },
}

/// How one layer of a library will be traced (or why it will not).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerNote {
    pub family: Family,
    pub text: String,
}

pub struct LibraryPlan {
    pub probes: Vec<AttachedProbe>,
    /// Specs whose field offsets come from this library's debug information.
    pub specs: Vec<(Api, ProbeSpec)>,
    pub debug: DebugStatus,
    pub symbols: ElfSymbols,
    /// Families this library carries (any of their symbols is defined here).
    pub families: Vec<Family>,
    pub notes: Vec<LayerNote>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn probe(lib: &Library, symbols: &ElfSymbols, api: Api, symbol: &str) -> Option<AttachedProbe> {
    symbols.get(symbol).map(|found| AttachedProbe {
        library: lib.shown.clone(),
        symbol: found.name.clone(),
        api,
        file_offset: found.file_offset,
        source: found.source,
    })
}

/// The spec of a layout-reading API with its field offsets filled in.
fn spec_with_offsets(api: Api, offsets: &[u64]) -> ProbeSpec {
    let def = api.def();
    let mut spec = def.spec;
    let members = def.layout.map_or(&[][..], |l| l.members);
    for (i, offset) in offsets.iter().enumerate().take(members.len()) {
        let width = if members[i] == "device" { 4 } else { 8 };
        let template = spec.fields[i];
        spec.fields[i] = FieldRead { offset: *offset as u32, width, ..template };
    }
    spec
}

/// Plans one library. `debug_dirs` are the user's `--debug-dir` folders.
pub fn plan(lib: &Library, set: ProbeSet, debug_dirs: &[PathBuf]) -> Result<LibraryPlan, ElfError> {
    let data = file::map_library(&lib.path)?;
    let wanted = wanted_symbols();
    let parse_err = |source| ElfError::Parse { path: lib.path.clone(), source };
    let own = ElfSymbols::parse(&data, &wanted).map_err(parse_err)?;
    let own_families: HashSet<Family> =
        Api::all().filter(|d| d.api.lookup_names().any(|s| own.get(&s).is_some())).map(|d| d.family).collect();

    // Hidden symbols matter only for torch_npu: the runtime and driver export what we need.
    let reference = debug::debug_ref(&data);
    let mut debug_data = None;
    let debug = if !own_families.contains(&Family::TorchNpu) || reference.has_symtab {
        DebugStatus::NotNeeded
    } else {
        match debug::find(&lib.path, &reference, debug_dirs) {
            Some(found) => {
                debug_data = file::map_debug_file(&found.path).ok();
                DebugStatus::Found(found)
            }
            None => DebugStatus::Missing {
                link: reference.link.as_ref().map(|(name, _)| name.clone()),
                build_id: reference.build_id.as_deref().map(hex),
            },
        }
    };
    let symbols = match &debug_data {
        Some(d) => ElfSymbols::parse_with_debug(&data, d, &wanted).map_err(parse_err)?,
        None => own,
    };
    // PyTorch's CUDA allocator is planned by its file name too: its blocks come from USDT notes
    // (attached with the markers), and the plan says whether its segments can be told apart.
    let c10_cuda = Path::new(&lib.shown).file_name().is_some_and(|n| libs::is_family_file(n, Family::CudaCaching));
    let families: Vec<Family> = Family::ALL
        .into_iter()
        .filter(|f| {
            (*f == Family::CudaCaching && c10_cuda)
                || Api::all().any(|d| d.family == *f && d.api.lookup_names().any(|s| symbols.get(&s).is_some()))
        })
        .collect();

    let mut plan = LibraryPlan {
        probes: Vec::new(),
        specs: Vec::new(),
        debug,
        symbols,
        families: families.clone(),
        notes: Vec::new(),
    };
    for family in families {
        match family {
            Family::AclRuntime | Family::Hal => plan_forwarders(lib, set, family, &mut plan),
            Family::TorchNpu => plan_torch(lib, debug_data.as_deref().unwrap_or(&data), &mut plan),
            Family::Atb => plan_atb(lib, &data, debug_dirs, &mut plan),
            Family::CudaCaching => plan_c10_cuda(lib, &data, &mut plan),
            Family::Mstx | Family::C10 | Family::CudaRuntime | Family::CudaDriver | Family::PythonGc => {
                plan_every(lib, family, &mut plan);
            }
        }
    }
    Ok(plan)
}

fn plan_forwarders(lib: &Library, set: ProbeSet, family: Family, plan: &mut LibraryPlan) {
    for def in Api::all().filter(|d| d.family == family) {
        let implementation = def.api.impl_symbol();
        let has_impl = implementation.as_ref().is_some_and(|s| plan.symbols.get(s).is_some());
        let mut chosen = Vec::new();
        if set == ProbeSet::All || !has_impl {
            chosen.push(def.symbol.to_owned());
        }
        if has_impl {
            chosen.extend(implementation);
        }
        for symbol in chosen {
            plan.probes.extend(probe(lib, &plan.symbols, def.api, &symbol));
        }
    }
}

/// A family whose every function found is probed as it is, with what its rows are.
fn plan_every(lib: &Library, family: Family, plan: &mut LibraryPlan) {
    for def in Api::all().filter(|d| d.family == family) {
        plan.probes.extend(probe(lib, &plan.symbols, def.api, def.symbol));
    }
    let text = match family {
        Family::Mstx => {
            "memory regions as the process reports them (torch_npu does only when it believes msMemScope is \
             loaded); marks and ranges become MSTX rows and tag spans"
        }
        Family::C10 => "CPU tensor storage (HOST rows on the cpu output)",
        Family::CudaRuntime => {
            "device, managed and pinned host memory; a driver call made inside a runtime call is part of its row"
        }
        Family::CudaDriver => {
            "device and pinned host memory, and the virtual-memory calls (cuMem*) of expandable segments and \
             NCCL; mapped pages count from map to unmap"
        }
        _ => "collection passes: tensor frees made by the cyclic collector are marked `freed_by: gc`",
    };
    plan.notes.push(LayerNote { family, text: text.to_owned() });
}

/// PyTorch's CUDA caching allocator: the internal steps that take segments, where `.symtab` has
/// them (blocks come from its USDT probes, which `attach::usdt` plans, where the build has them:
/// torch's aarch64 wheels, built without SDT, have none).
fn plan_c10_cuda(lib: &Library, data: &[u8], plan: &mut LibraryPlan) {
    let steps = [Api::CudaAllocBlock, Api::CudaMapBlock];
    let found: Vec<AttachedProbe> = steps
        .into_iter()
        .filter_map(|api| {
            let prefix = api.symbol_prefix()?;
            probe(lib, &plan.symbols, api, prefix)
        })
        .collect();
    let text = if found.is_empty() {
        "the internals (DeviceCachingAllocator::alloc_block/map_block) are not in this library's symbols: segments count as CUDA@RUNTIME device memory, not as the pool's".to_owned()
    } else {
        let names: Vec<&str> = found.iter().map(|p| p.api.name()).collect();
        format!(
            "segments: device memory taken inside {} ({}) is the caching pool's",
            names.join(" and "),
            found[0].source.as_str()
        )
    };
    plan.probes.extend(found);
    let sites = usdt::plan(data).map(|p| p.sites).unwrap_or_default();
    let blocks = if sites.iter().any(|s| s.name.starts_with("pytorch:")) {
        "tensor blocks from the pytorch:malloc/free USDT probes (semaphore-gated; listed with the marker sites)"
    } else {
        "no pytorch:malloc/free USDT sites in this build (torch's aarch64 wheels are built without them): its \
         tensor blocks are not seen, only the device memory of its segments"
    };
    plan.notes.push(LayerNote { family: Family::CudaCaching, text: blocks.into() });
    plan.notes.push(LayerNote { family: Family::CudaCaching, text });
}

fn found_in(symbols: &ElfSymbols, api: Api) -> Option<SymbolSource> {
    symbols.get(api.def().symbol).map(|s| s.source)
}

fn plan_torch(lib: &Library, dwarf_data: &[u8], plan: &mut LibraryPlan) {
    let symbols = &plan.symbols;
    let has = |api: Api| found_in(symbols, api).is_some();
    let mut attach: Vec<Api> = Vec::new();
    let mut specs = Vec::new();
    let layout = if has(Api::DeviceCachingAllocatorMalloc) && has(Api::DeviceCachingAllocatorFree) {
        let l = &memscope_core::apis::torch_npu::BLOCK;
        dwarf::member_offsets(dwarf_data, Some(l.namespace), l.name, l.members)
    } else {
        None
    };
    let caching = if let Some(offsets) = &layout {
        for api in [Api::DeviceCachingAllocatorMalloc, Api::DeviceCachingAllocatorFree] {
            attach.push(api);
            specs.push((api, spec_with_offsets(api, offsets)));
        }
        format!(
            "tensor blocks from DeviceCachingAllocator::malloc/free ({}), Block layout from DWARF: ptr +{}, size +{}, device +{}",
            found_in(symbols, Api::DeviceCachingAllocatorMalloc).map_or("", SymbolSource::as_str),
            offsets[0],
            offsets[1],
            offsets[2]
        )
    } else if has(Api::NpuCachingAllocatorMalloc) && has(Api::NpuCachingAllocatorFree) {
        attach.extend([Api::NpuCachingAllocatorMalloc, Api::NpuCachingAllocatorFree]);
        "tensor blocks from NpuCachingAllocator::malloc/free (no Block layout in the debug info: block sizes are the requested sizes unless mstx reports them)".to_owned()
    } else {
        let why = match &plan.debug {
            DebugStatus::Missing { link, build_id } => format!(
                "the allocator internals are hidden (no .symtab) and no debug file was found{}{}; pass --debug-dir with the folder holding it",
                link.as_ref().map(|l| format!(" (.gnu_debuglink: {l})")).unwrap_or_default(),
                build_id.as_ref().map(|b| format!(" (build id {b})")).unwrap_or_default(),
            ),
            _ => "the allocator internals are not in this library's symbols".to_owned(),
        };
        for api in [Api::MallocBlock, Api::FreeBlock, Api::GetBlockPtr, Api::GetBlockSize] {
            if has(api) {
                attach.push(api);
            }
        }
        format!("{why}: tensor blocks are seen only through mstx regions, when the process reports them; external blocks through the exported MallocBlock/FreeBlock")
    };
    let workspace = if has(Api::WorkspaceMalloc) && has(Api::WorkspaceFree) {
        attach.extend([Api::WorkspaceMalloc, Api::WorkspaceFree]);
        let l = &memscope_core::apis::torch_npu::WORKSPACE_ALLOCATOR;
        match dwarf::member_offsets(dwarf_data, Some(l.namespace), l.name, l.members) {
            Some(offsets) => {
                let mut spec = Api::WorkspaceMalloc.def().spec;
                spec.fields[0] = FieldRead::arg_at_entry(0, offsets[0] as u32, 4);
                specs.push((Api::WorkspaceMalloc, spec));
                format!("workspace blocks from DeviceWorkspaceAllocator::malloc/free, device from DWARF: this +{}", offsets[0])
            }
            None => "workspace blocks from DeviceWorkspaceAllocator::malloc/free (no layout in the debug info: a block's device is its thread's)".to_owned(),
        }
    } else if has(Api::AllocateWorkspace) {
        attach.push(Api::AllocateWorkspace);
        "workspace blocks from the exported allocate_workspace (a use ends at the next one on its stream, or when mstx reports it)".to_owned()
    } else {
        "workspace blocks: not visible".to_owned()
    };
    let marks = has(Api::RecordStream).then(|| {
        attach.push(Api::RecordStream);
        attach.extend(has(Api::EraseStream).then_some(Api::EraseStream));
        "stream marks from recordStream/eraseStream: a block freed while used by another stream is marked on its FREE (`stream_uses`)".to_owned()
    });
    for api in attach {
        plan.probes.extend(probe(lib, &plan.symbols, api, api.def().symbol));
    }
    plan.specs.extend(specs);
    plan.notes.push(LayerNote { family: Family::TorchNpu, text: caching });
    plan.notes.push(LayerNote { family: Family::TorchNpu, text: workspace });
    plan.notes.extend(marks.map(|text| LayerNote { family: Family::TorchNpu, text }));
}

/// Where the offsets of `RunnerVariantPack`'s workspace members came from.
fn atb_layout(lib: &Library, data: &[u8], debug_dirs: &[PathBuf]) -> (Vec<u64>, String) {
    let l = &memscope_core::apis::atb::RUNNER_VARIANT_PACK;
    let offsets = |d: &[u8]| dwarf::member_offsets(d, Some(l.namespace), l.name, l.members);
    if let Some(found) = offsets(data) {
        return (found, "from the library's DWARF".to_owned());
    }
    let reference = debug::debug_ref(data);
    if let Some(debug_file) = debug::find(&lib.path, &reference, debug_dirs) {
        if let Some(found) = file::map_debug_file(&debug_file.path).ok().as_deref().and_then(offsets) {
            return (found, format!("from the DWARF of {}", debug_file.path.display()));
        }
    }
    let why =
        "no DWARF describes atb::RunnerVariantPack (none in the library or a debug file): the open-source ATB's layout assumed";
    (memscope_core::apis::atb::FALLBACK_OFFSETS.to_vec(), why.to_owned())
}

fn plan_atb(lib: &Library, data: &[u8], debug_dirs: &[PathBuf], plan: &mut LibraryPlan) {
    let api = Api::AtbRunnerExecute;
    let Some(found) = probe(lib, &plan.symbols, api, api.def().symbol) else { return };
    let (offsets, source) = atb_layout(lib, data, debug_dirs);
    plan.specs.push((api, spec_with_offsets(api, &offsets)));
    plan.notes.push(LayerNote {
        family: Family::Atb,
        text: format!(
            "operations from atb::Runner::Execute ({}): ATB_START/ATB_END rows with each one's workspace; RunnerVariantPack {source}: workspaceBuffer +{}, workspaceBufferSize +{}, intermediateBufferSize +{}",
            found.source.as_str(),
            offsets[0],
            offsets[1],
            offsets[2]
        ),
    });
    plan.probes.push(found);
}

/// How a found debug file is described to the user.
pub fn describe_debug(status: &DebugStatus) -> String {
    match status {
        DebugStatus::NotNeeded => "not needed".into(),
        DebugStatus::Found(DebugFile { path, found }) => format!(
            "{} (via {})",
            path.display(),
            match found {
                Found::BuildId => "build id",
                Found::DebugLink => ".gnu_debuglink",
            }
        ),
        DebugStatus::Missing { link, build_id } => format!(
            "not found (looked for {} next to the library, in its .debug/, /usr/lib/debug and --debug-dir{})",
            link.as_deref().unwrap_or("a .gnu_debuglink name"),
            build_id.as_ref().map(|b| format!("; build id {b} under .build-id/")).unwrap_or_default()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `libc10_cuda.so` whose build has no `pytorch:` USDT notes (torch's aarch64 wheels; here
    /// this test binary under that name, which has none either): the plan says its tensor blocks
    /// are not seen, instead of promising the USDT probes.
    #[test]
    fn a_c10_cuda_without_pytorchs_usdt_sites_says_its_tensor_blocks_are_not_seen() {
        let dir = std::env::temp_dir().join(format!("memscope-plan-c10-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let lib = dir.join("libc10_cuda.so");
        std::fs::copy(std::env::current_exe().unwrap(), &lib).unwrap();
        let found = libs::from_user_path(&lib).unwrap();
        let plan = plan(&found[0], ProbeSet::Default, &[]).unwrap();
        let notes: Vec<&str> =
            plan.notes.iter().filter(|n| n.family == Family::CudaCaching).map(|n| n.text.as_str()).collect();
        assert!(notes.iter().any(|n| n.starts_with("no pytorch:malloc/free USDT sites")), "{notes:?}");
        assert!(!notes.iter().any(|n| n.starts_with("tensor blocks from the pytorch")), "{notes:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
