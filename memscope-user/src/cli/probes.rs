//! `memscope-bpf probes`: what a trace would attach to, without attaching anything. With `--lib`
//! only it reads files and needs no privileges.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _};

use crate::apis::Api;
use crate::attach::elf::ElfSymbols;
use crate::attach::libs::{self, Library, Origin};
use crate::attach::loader::plan;
use crate::attach::ProbeSet;
use crate::preflight::{self, PreflightError};

/// List the traced API symbols found in a process's libraries or in given files: where each one
/// is, which would be attached, and which are missing. Attaches nothing.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Look at the libraries this process has mapped (and its ASCEND_HOME_PATH).
    #[arg(short, long, value_name = "PID")]
    pub pid: Option<u32>,

    /// A library file (any name) or folder to inspect. Repeatable.
    #[arg(long = "lib", value_name = "PATH")]
    pub libs: Vec<PathBuf>,

    /// As for `trace`: probe the Impl symbols only (default) or both public and Impl.
    #[arg(long, value_enum, value_name = "SET", default_value_t = ProbeSet::Default)]
    pub probe_set: ProbeSet,
}

fn origin(o: &Origin) -> String {
    match o {
        Origin::UserPath => "--lib".into(),
        Origin::Mapped { pid } => format!("mapped by pid {pid}"),
        Origin::AscendHome => "ASCEND_HOME_PATH".into(),
        Origin::LibraryPath => "LD_LIBRARY_PATH".into(),
        Origin::Dependency => "needed by a traced library".into(),
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if args.pid.is_none() && args.libs.is_empty() {
        bail!("nothing to inspect: give --pid PID or --lib PATH");
    }
    let mut found: Vec<Library> = Vec::new();
    for path in &args.libs {
        found.extend(libs::from_user_path(path).with_context(|| format!("--lib {}: cannot read it", path.display()))?);
    }
    if let Some(pid) = args.pid {
        preflight::check_pid(pid)?;
        found.extend(
            libs::from_maps(pid)
                .with_context(|| format!("cannot read /proc/{pid}/maps (are you allowed to inspect this process?)"))?,
        );
        if let Ok(env) = libs::process_env(pid) {
            found.extend(libs::from_env(&env, Path::new(&format!("/proc/{pid}/root")), false));
        }
    }
    let found = libs::with_dependencies(found);
    if found.is_empty() {
        let where_ = args.pid.map_or_else(|| "in the given paths".to_owned(), |p| format!("in process {p}"));
        return Err(PreflightError::NoLibrary { where_ }.into());
    }
    let wanted = libs::wanted_symbols();
    for lib in &found {
        println!("{} ({})", lib.shown, origin(&lib.origin));
        let symbols = match ElfSymbols::load(&lib.path, &wanted) {
            Ok(s) => s,
            Err(e) => {
                println!("  unreadable: {e}");
                continue;
            }
        };
        let chosen: HashSet<String> =
            plan(&symbols, args.probe_set, &lib.shown).into_iter().map(|p| p.symbol).collect();
        // Only the families this file carries: a runtime library is not missing the driver's API.
        let families: HashSet<_> = Api::all()
            .filter(|d| symbols.get(d.symbol).is_some() || symbols.get(&d.api.impl_symbol()).is_some())
            .map(|d| d.family)
            .collect();
        if families.is_empty() {
            println!("  none of the traced symbols is defined here");
        }
        for def in Api::all().filter(|d| families.contains(&d.family)) {
            let mut line = format!("  {:<24}", def.symbol);
            let mut any = false;
            for name in [def.symbol.to_owned(), def.api.impl_symbol()] {
                if let Some(sym) = symbols.get(&name) {
                    any = true;
                    let mark = if chosen.contains(&name) { "attach" } else { "skip  " };
                    line.push_str(&format!("  {mark} {name} ({}, offset {:#x})", sym.source.as_str(), sym.file_offset));
                }
            }
            if !any {
                line.push_str(&format!(
                    "  missing: neither {} nor {} is defined here",
                    def.symbol,
                    def.api.impl_symbol()
                ));
            }
            println!("{line}");
        }
    }
    Ok(())
}
