//! What to attach for the markers package in one library: every call site of our provider's
//! probes (see `apis::markers`), with its decoded argument spec and its semaphore.
//!
//! Notes of other providers (a library may carry libc's, Python's, PyTorch's) are not ours and
//! are left alone. A note of ours that cannot be used (unknown argument syntax, an argument count
//! that is not the contract's) is skipped with the reason, so `probes` can say why a marker
//! will not be seen instead of the tracer guessing where its arguments are.

use memscope_common::usdt::UsdtSpec;

use super::usdt_args::{build_spec, parse_args, Arch};
use super::usdt_notes::{read_notes, UsdtNoteError};
use crate::apis::markers::{self, MarkerDef};

/// One call site to attach.
#[derive(Clone, Debug)]
pub struct UsdtSite {
    pub def: &'static MarkerDef,
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

/// Our marker sites in an ELF file's bytes.
pub fn plan(data: &[u8]) -> Result<UsdtPlan, UsdtNoteError> {
    let mut plan = UsdtPlan::default();
    for note in read_notes(data)? {
        let Some(def) = markers::find(&note.provider, &note.name) else { continue };
        let shown = format!("{}:{} at {:#x} (`{}`)", note.provider, note.name, note.file_offset, note.args);
        let Some(arch) = Arch::host() else {
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
        if args.len() != def.args {
            plan.skipped.push(format!(
                "{shown}: {} arguments, the markers contract has {} (a different markers version?)",
                args.len(),
                def.args
            ));
            continue;
        }
        match build_spec(&args, def.text_arg, def.probe as u32) {
            Ok(spec) => plan.sites.push(UsdtSite {
                def,
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
