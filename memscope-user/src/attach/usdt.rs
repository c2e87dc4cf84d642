//! What to attach for USDT probes in one library: every call site of our markers package's
//! probes (see `apis::markers`) and of the catalogue's USDT rows (PyTorch's `pytorch:malloc` and
//! `pytorch:free` in libc10_cuda.so, see `apis::c10_cuda`), with its decoded argument spec and
//! its semaphore.
//!
//! Notes of other providers (a library may carry libc's, Python's) are left alone. A note of
//! ours that cannot be used (unknown argument syntax, an argument count that is not the
//! contract's) is skipped with the reason, so `probes` can say why a probe will not be seen
//! instead of the tracer guessing where its arguments are.

use memscope_common::usdt::UsdtSpec;
use memscope_core::apis::{self, markers};

use super::usdt_args::{build_spec, parse_args, Arch};
use super::usdt_notes::{read_notes, UsdtNoteError};

/// One call site to attach.
#[derive(Clone, Debug)]
pub struct UsdtSite {
    /// `provider:name`.
    pub name: String,
    pub file_offset: u64,
    pub semaphore_offset: Option<u64>,
    pub spec: UsdtSpec,
    /// The note's argument text (shown by `probes`).
    pub args: String,
}

/// The sites of a library, and the notes of ours that were skipped, with why.
#[derive(Clone, Debug, Default)]
pub struct UsdtPlan {
    pub sites: Vec<UsdtSite>,
    pub skipped: Vec<String>,
}

/// What a probe of ours expects: the probe id its hits carry, its argument count, its string
/// argument, and whose contract it is (for the skip reason).
struct Expected {
    probe: u32,
    args: usize,
    text_arg: Option<usize>,
    contract: &'static str,
}

fn expected(provider: &str, name: &str) -> Option<Expected> {
    if let Some(def) = markers::find(provider, name) {
        let contract = "the markers contract";
        return Some(Expected { probe: def.probe as u32, args: def.args, text_arg: def.text_arg, contract });
    }
    let api = apis::usdt_api(provider, name)?;
    let args = apis::c10_cuda::usdt_args(api)?;
    let contract = "PyTorch's probe";
    Some(Expected { probe: apis::API_PROBE_BASE + api.spec_id(), args, text_arg: None, contract })
}

/// Our sites in an ELF file's bytes.
pub fn plan(data: &[u8]) -> Result<UsdtPlan, UsdtNoteError> {
    let mut plan = UsdtPlan::default();
    for note in read_notes(data)? {
        let Some(want) = expected(&note.provider, &note.name) else { continue };
        let shown = format!("{}:{} at {:#x} (`{}`)", note.provider, note.name, note.file_offset, note.args);
        let Some(arch) = Arch::of_files() else {
            plan.skipped.push(format!("{shown}: USDT arguments are not decoded on this architecture"));
            continue;
        };
        let args = match parse_args(&note.args, arch) {
            Ok(args) => args,
            Err(e) => {
                plan.skipped.push(format!("{shown}: {e}"));
                continue;
            }
        };
        if args.len() != want.args {
            plan.skipped.push(format!(
                "{shown}: {} arguments, {} has {} (a different version?)",
                args.len(),
                want.contract,
                want.args
            ));
            continue;
        }
        match build_spec(&args, want.text_arg, want.probe) {
            Ok(spec) => plan.sites.push(UsdtSite {
                name: format!("{}:{}", note.provider, note.name),
                file_offset: note.file_offset,
                semaphore_offset: note.semaphore_offset,
                spec,
                args: note.args.clone(),
            }),
            Err(e) => plan.skipped.push(format!("{shown}: {e}")),
        }
    }
    Ok(plan)
}
