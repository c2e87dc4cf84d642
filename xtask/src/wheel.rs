//! Real third-party files for cross-checks: `libtorch_npu.so` from torch_npu's wheels on PyPI,
//! for x86-64 and for aarch64, and torch's aarch64 `libc10.so` and `libc10_cuda.so` (the x86-64
//! ones come with the torch venv, `torch_env`).
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

/// PyTorch's release whose aarch64 `libc10.so` and `libc10_cuda.so` are read by `probes --arch
/// aarch64` (the x86-64 venv's torch, `torch_env`, is the same release).
const TORCH_AARCH64_MEMBERS: &[&str] = &["torch/lib/libc10.so", "torch/lib/libc10_cuda.so"];

/// Reads members of a remote zip by HTTP range requests: the aarch64 torch wheel is 484 MB and
/// two members of 8 MB each are wanted. zipfile seeks to the central directory at the end, then to
/// each member; each read is one `Range:` request (buffered by 1 MiB). PyPI's files are served
/// with ranges; a server that ignores them fails here rather than sending the whole file.
const RANGE_FETCH: &str = r#"
import io, json, os, sys, urllib.parse, urllib.request, zipfile
version, tag, dest = sys.argv[1:4]
members = sys.argv[4:]
index = "https://pypi.org/pypi/torch/json"
meta = json.load(urllib.request.urlopen(index, timeout=60))
suffix = f"-cp311-cp311-manylinux_2_28_{tag}.whl"
wheel = next((u for u in meta["releases"].get(version, []) if u["filename"].endswith(suffix)), None)
if wheel is None: sys.exit(f"PyPI lists no torch {version} wheel ending {suffix}")
class Remote(io.RawIOBase):
    def __init__(self, url, size):
        self.url, self.size, self.pos = url, size, 0
    def readable(self): return True
    def seekable(self): return True
    def tell(self): return self.pos
    def seek(self, off, whence=0):
        self.pos = [off, self.pos + off, self.size + off][whence]
        return self.pos
    def readinto(self, b):
        if self.pos >= self.size: return 0
        end = min(self.pos + len(b), self.size) - 1
        req = urllib.request.Request(self.url, headers={"Range": f"bytes={self.pos}-{end}"})
        with urllib.request.urlopen(req, timeout=60) as r:
            if r.status != 206: sys.exit(f"{self.url} ignores byte ranges (HTTP {r.status})")
            data = r.read()
        b[:len(data)] = data
        self.pos += len(data)
        return len(data)
# A mirror may give the files' addresses relative to the index's.
raw = Remote(urllib.parse.urljoin(index, wheel["url"]), wheel["size"])
with zipfile.ZipFile(io.BufferedReader(raw, buffer_size=1 << 20)) as z:
    for m in members:
        out = os.path.join(dest, os.path.basename(m))
        with z.open(m) as src, open(out + ".part", "wb") as dst:
            dst.write(src.read())
        os.rename(out + ".part", out)
print(wheel["filename"])
"#;

/// The folder holding the aarch64 torch wheel's `libc10.so` and `libc10_cuda.so`, fetched once
/// (only those members) from PyPI; or why there is none (a warning: the test skips).
pub fn torch_aarch64_libraries() -> Result<PathBuf, String> {
    let version = crate::torch_env::version();
    let dir = root().join("target/wheels").join(format!("torch-{version}-aarch64"));
    let names: Vec<&str> = TORCH_AARCH64_MEMBERS.iter().map(|m| m.rsplit('/').next().expect("named")).collect();
    if names.iter().all(|n| dir.join(n).is_file()) {
        return Ok(dir);
    }
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    eprintln!("xtask: fetching libc10.so and libc10_cuda.so of torch {version}'s aarch64 wheel (byte ranges, 17 MB)");
    sh(Command::new("python3").args(["-c", RANGE_FETCH, &version, "aarch64"]).arg(&dir).args(TORCH_AARCH64_MEMBERS))
        .map(|_| dir)
        .map_err(|e| format!("fetching torch {version}'s aarch64 libraries from PyPI failed (no network?): {e:#}"))
}
