//! A real third-party file for cross-checks: `libtorch_npu.so` from torch_npu's wheels on PyPI,
//! for x86-64 and for aarch64.
//!
//! `probes --lib` is tested against it (no process, no Ascend hardware needed), so the symbol
//! names and the offset arithmetic are checked on the real release build, not only on our
//! stand-in. Fetching is best effort: without network or pip the test skips and says why.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::util::{root, run as sh};

/// Pinned so a CI run is reproducible; the test reads the answers from this file's own tables,
/// so a newer release works too (`MEMSCOPE_TORCH_NPU_VERSION`).
const DEFAULT_VERSION: &str = "2.14.0";
const MEMBER: &str = "torch_npu/lib/libtorch_npu.so";

fn version() -> String {
    std::env::var("MEMSCOPE_TORCH_NPU_VERSION").unwrap_or_else(|_| DEFAULT_VERSION.to_owned())
}

/// The machines whose wheel is fetched: x86-64, and aarch64 (Kunpeng: most Ascend servers),
/// whose library `probes --lib --arch aarch64` reads from here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Machine {
    X86_64,
    Aarch64,
}

impl Machine {
    /// The wheel's platform tag's architecture.
    fn tag(self) -> &'static str {
        match self {
            Self::X86_64 => "x86_64",
            Self::Aarch64 => "aarch64",
        }
    }
}

/// Where the extracted library lives for a version (x86-64's where it always was).
fn library_path(version: &str, machine: Machine) -> PathBuf {
    let folder = match machine {
        Machine::X86_64 => format!("torch_npu-{version}"),
        Machine::Aarch64 => format!("torch_npu-{version}-aarch64"),
    };
    root().join("target/wheels").join(folder).join("libtorch_npu.so")
}

/// The extracted `libtorch_npu.so` of `machine`'s wheel, or why there is none (a warning, not
/// an error).
pub fn torch_npu_library(machine: Machine) -> Result<PathBuf, String> {
    let version = version();
    let lib = library_path(&version, machine);
    if lib.is_file() {
        return Ok(lib);
    }
    let dir = lib.parent().expect("has a parent").to_owned();
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let tag = machine.tag();
    eprintln!("xtask: fetching torch_npu {version}'s {tag} wheel from PyPI for the real-library probes test (40 MB)");
    // A wheel for a fixed platform and Python: the library is the same whichever Python runs
    // here, and pip then needs no matching interpreter.
    sh(Command::new("python3")
        .args(["-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"])
        .args(["--platform", &format!("manylinux_2_28_{tag}"), "--python-version", "3.11", "--implementation", "cp"])
        .arg("-d")
        .arg(&dir)
        .arg(format!("torch-npu=={version}")))
    .map_err(|e| format!("pip download torch-npu=={version} ({tag}) failed (no network or no pip?): {e:#}"))?;
    let wheel = std::fs::read_dir(&dir)
        .map_err(|e| e.to_string())?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| format!("pip left no wheel in {}", dir.display()))?;
    extract(&wheel, &lib)?;
    // The wheel is 44 MB and no longer needed.
    let _ = std::fs::remove_file(&wheel);
    Ok(lib)
}

fn extract(wheel: &Path, to: &Path) -> Result<(), String> {
    let script = "import sys, zipfile, shutil\n\
                  with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3] + '.part', 'wb') as dst:\n    \
                  shutil.copyfileobj(src, dst)\n";
    sh(Command::new("python3").args(["-c", script]).arg(wheel).arg(MEMBER).arg(to))
        .map_err(|e| format!("cannot extract {MEMBER} from {}: {e:#}", wheel.display()))?;
    let part = format!("{}.part", to.display());
    std::fs::rename(&part, to).map_err(|e| format!("cannot move {part} into place: {e}"))
}
