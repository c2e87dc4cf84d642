//! `cargo xtask dist`: the release, under `target/dist/`, for x86-64 and aarch64 (Kunpeng):
//! - `memscope-bpf-VER-ARCH-linux.tar.gz`: the static binary (musl; its eBPF objects for that
//!   architecture inside), the driver helper beside it (`memscope-driver-query`, glibc 2.28),
//!   README, docs, the markers' sdist and wheels, and SHA256SUMS of those;
//! - `memscope-bpf-VER-ARCH-linux.debug`: the binary's debug info, which the stripped binary
//!   names through `.gnu_debuglink`;
//! - `memscope_bpf-VER-py3-none-manylinux_2_28_ARCH.whl`: the binary as a pip-installable wheel;
//! - `oci/` and `memscope-bpf-VER-oci.tar`: the DaemonSet's image (`oci.rs`);
//! - `SHA256SUMS` of all of the above.
//!
//! Static musl rather than glibc: one file that starts on glibc 2.28 systems (openEuler 22.03,
//! Kylin) and in an image with nothing else in it. A static binary cannot load a shared library,
//! so the driver's management library (libdcmi.so, libnvidia-ml.so.1) is loaded by the helper,
//! linked against glibc 2.28 (the oldest the tracer's hosts run); the image leaves it out, as
//! it has no C library for it. The SQLite features the store uses come from
//! the workspace's `.cargo/config.toml`, which cargo reads for this build as for any other.

mod archive;
mod oci;
mod pywheel;
pub(crate) mod tools;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context as _;

use crate::util::{output, root, run as sh};

#[derive(clap::Args)]
pub struct Options {
    /// Build only these architectures (default: both).
    #[arg(long, value_enum)]
    pub arch: Vec<Arch>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Arch {
    #[value(name = "x86_64", alias = "amd64")]
    X86_64,
    #[value(name = "aarch64", alias = "arm64")]
    Aarch64,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Self::X86_64 => "x86_64",
            Self::Aarch64 => "aarch64",
        }
    }

    pub(crate) fn triple(self) -> &'static str {
        match self {
            Self::X86_64 => "x86_64-unknown-linux-musl",
            Self::Aarch64 => "aarch64-unknown-linux-musl",
        }
    }

    /// The driver helper's target: glibc, which `dlopen` needs.
    fn gnu_triple(self) -> &'static str {
        match self {
            Self::X86_64 => "x86_64-unknown-linux-gnu",
            Self::Aarch64 => "aarch64-unknown-linux-gnu",
        }
    }

    /// The name of this architecture's tarball, its folder and its debug file.
    pub fn release_name(self) -> String {
        format!("memscope-bpf-{VERSION}-{}-linux", self.name())
    }

    /// The OCI (Go) architecture name.
    fn oci(self) -> &'static str {
        match self {
            Self::X86_64 => "amd64",
            Self::Aarch64 => "arm64",
        }
    }
}

pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The archives' timestamp: SOURCE_DATE_EPOCH, or the commit's time, so a rebuild of one commit
/// gives the same bytes.
fn release_time() -> u64 {
    std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .or_else(|| output(Command::new("git").current_dir(root()).args(["log", "-1", "--format=%ct"])))
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(0)
}

/// The unstripped static binary for `arch`.
fn build(tools: &tools::Tools, arch: Arch) -> anyhow::Result<PathBuf> {
    eprintln!("xtask dist: building the static binary for {}", arch.name());
    sh(Command::new("cargo")
        .current_dir(root())
        .env("PATH", tools.path())
        .args(["zigbuild", "--release", "--locked", "-p", "memscope-user", "--target", arch.triple()])
        // A build id (Zig's linker writes none unless asked), so the debug file is found by it.
        .arg("--config")
        .arg(format!("target.{}.rustflags=[\"-C\", \"link-arg=-Wl,--build-id=sha1\"]", arch.triple()))
        .args(["--target-dir", "target/dist-build"]))
    .with_context(|| format!("the {} release build failed", arch.name()))?;
    Ok(root().join("target/dist-build").join(arch.triple()).join("release/memscope-bpf"))
}

/// The driver helper for `arch`, against glibc 2.28, stripped into `to`.
fn build_helper(tools: &tools::Tools, arch: Arch, to: &Path) -> anyhow::Result<()> {
    eprintln!("xtask dist: building the driver helper for {}", arch.name());
    sh(Command::new("cargo")
        .current_dir(root())
        .env("PATH", tools.path())
        .args(["zigbuild", "--release", "--locked", "-p", "memscope-driver"])
        .arg("--target")
        .arg(format!("{}.2.28", arch.gnu_triple()))
        .args(["--target-dir", "target/dist-build"]))
    .with_context(|| format!("the {} driver helper build failed", arch.name()))?;
    let built = root().join("target/dist-build").join(arch.gnu_triple()).join("release/memscope-driver-query");
    let objcopy = Path::new(crate::setup::LLVM_PREFIX).join("bin/llvm-objcopy");
    sh(Command::new(&objcopy).arg("--strip-all").arg(&built).arg(to))
}

/// Splits `binary`'s debug info into `debug` and writes the stripped binary to `stripped`.
fn strip(binary: &Path, stripped: &Path, debug: &Path) -> anyhow::Result<()> {
    let objcopy = Path::new(crate::setup::LLVM_PREFIX).join("bin/llvm-objcopy");
    sh(Command::new(&objcopy).args(["--only-keep-debug", "--compress-debug-sections=zlib"]).arg(binary).arg(debug))?;
    sh(Command::new(&objcopy)
        .arg("--strip-all")
        .arg(format!("--add-gnu-debuglink={}", debug.display()))
        .arg(binary)
        .arg(stripped))
}

/// Writes `NAME-VER-ARCH-linux.tar.gz` from the staged folder; returns its path.
fn tarball(dist: &Path, folder: &Path, mtime: u64) -> anyhow::Result<PathBuf> {
    let mut files = Vec::new();
    collect_files(folder, &mut files)?;
    files.sort();
    std::fs::write(folder.join("SHA256SUMS"), archive::checksums(folder, &files)?)?;
    let name = folder.file_name().expect("named").to_string_lossy().into_owned();
    let out = dist.join(format!("{name}.tar.gz"));
    std::fs::write(&out, archive::gzip(&archive::tar(&archive::tree(folder, &name)?, mtime)?)?)?;
    Ok(out)
}

fn collect_files(dir: &Path, into: &mut Vec<PathBuf>) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            collect_files(&entry.path(), into)?;
        } else {
            into.push(entry.path());
        }
    }
    Ok(())
}

/// Copies the folder `from` to `to`, leaving out the entries named in `skip` at its top.
fn copy_tree(from: &Path, to: &Path, skip: &[&str]) -> anyhow::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        if skip.iter().any(|s| entry.file_name() == *s) {
            continue;
        }
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_tree(&entry.path(), &target, &[])?;
        } else {
            std::fs::copy(entry.path(), &target)?;
        }
    }
    Ok(())
}

/// One architecture's binary, debug file, tarball and wheel; returns the stripped binary.
fn release_arch(
    t: &tools::Tools,
    dist: &Path,
    markers: &[PathBuf],
    arch: Arch,
    mtime: u64,
) -> anyhow::Result<Vec<PathBuf>> {
    let binary = build(t, arch)?;
    let name = arch.release_name();
    let folder = dist.join("stage").join(&name);
    let _ = std::fs::remove_dir_all(&folder);
    std::fs::create_dir_all(folder.join("markers"))?;
    let debug = dist.join(format!("{name}.debug"));
    let stripped = folder.join("memscope-bpf");
    strip(&binary, &stripped, &debug)?;
    let helper = folder.join("memscope-driver-query");
    build_helper(t, arch, &helper)?;
    std::fs::copy(root().join("README.md"), folder.join("README.md"))?;
    copy_tree(&root().join("docs"), &folder.join("docs"), &[])?;
    // The sdist, and this architecture's wheels.
    let wheel_suffix = format!("_{}.whl", arch.name());
    for file in markers
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e != "whl") || f.to_string_lossy().ends_with(&wheel_suffix))
    {
        std::fs::copy(file, folder.join("markers").join(file.file_name().expect("named")))?;
    }
    let tarball = tarball(dist, &folder, mtime)?;
    let wheel = pywheel::tracer(t, &dist.join("stage"), dist, VERSION, arch.name(), &[&stripped, &helper])?;
    Ok(vec![stripped, tarball, debug, wheel])
}

/// Installs what the release build needs (`cargo xtask setup` calls this too).
pub fn prepare() -> anyhow::Result<()> {
    let arches = [Arch::X86_64, Arch::Aarch64];
    let triples: Vec<&str> = arches.iter().flat_map(|a| [a.triple(), a.gnu_triple()]).collect();
    tools::ensure(&triples).map(|_| ())
}

/// Builds the release; returns its folder.
pub fn run(opts: &Options) -> anyhow::Result<PathBuf> {
    let started = std::time::Instant::now();
    let arches = if opts.arch.is_empty() { vec![Arch::X86_64, Arch::Aarch64] } else { opts.arch.clone() };
    let triples: Vec<&str> = arches.iter().flat_map(|a| [a.triple(), a.gnu_triple()]).collect();
    let t = tools::ensure(&triples)?;
    let dist = root().join("target/dist");
    let mtime = release_time();
    let names: Vec<&str> = arches.iter().map(|a| a.name()).collect();
    let markers = pywheel::markers(&t, &dist.join("stage/markers"), &names)?;
    let mut binaries = Vec::new();
    let mut artifacts = Vec::new();
    for &arch in &arches {
        let mut made = release_arch(&t, &dist, &markers, arch, mtime)?;
        binaries.push((arch, made.remove(0)));
        artifacts.extend(made);
    }
    let images: Vec<oci::Image> =
        binaries.iter().map(|(a, b)| oci::Image { arch: a.oci(), binary: b.clone() }).collect();
    let layout = dist.join("oci");
    oci::write(&layout, VERSION, &images, mtime)?;
    let image_tar = dist.join(format!("memscope-bpf-{VERSION}-oci.tar"));
    std::fs::write(&image_tar, archive::tar(&archive::tree(&layout, "")?, mtime)?)?;
    artifacts.push(image_tar);
    std::fs::write(dist.join("SHA256SUMS"), archive::checksums(&dist, &artifacts)?)?;
    eprintln!("xtask dist: done in {:.0} s, in {}:", started.elapsed().as_secs_f64(), dist.display());
    for file in binaries.iter().map(|(_, b)| b).chain(&artifacts) {
        let size = std::fs::metadata(file)?.len() as f64 / 1024.0 / 1024.0;
        eprintln!("  {:>7.1} MiB  {}", size, file.strip_prefix(&dist).unwrap_or(file).display());
    }
    Ok(dist)
}
