//! What each machine's tests run on: their own binaries, the stand-ins, the markers and the
//! tracer, all built for that machine's architecture.
//!
//! The x86-64 machine takes the host's builds as they are (the host is Debian 12 too). The arm64
//! machine gets the integration tests cross-compiled to static musl binaries with the release's
//! tools (cargo-zigbuild), the stand-ins built by Debian's arm64 cross compilers into their own
//! folder (their RUNPATHs name it, so the VM holds them at that same path), and the markers'
//! arm64 wheel for the VM's python3, unpacked.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context as _};

use super::rootfs::Rootfs;
use crate::build::{self, Built, Toolchain};
use crate::dist::{self, Arch};
use crate::util::{root, run as sh};

pub struct Machine {
    /// The release's stripped binary for this architecture.
    pub binary: PathBuf,
    /// (test binary's name, its file) for each file of the smoke set.
    pub tests: Vec<(String, PathBuf)>,
    /// The stand-ins and markers the tests' environment names.
    pub built: Built,
}

/// Builds what `arch`'s machine runs; `host` is what `cargo xtask build` made for the host.
pub fn prepare(arch: Arch, host: &Built, release: &Path, fs: &Rootfs, wanted: &[&str]) -> anyhow::Result<Machine> {
    let binary = release_binary(release, arch);
    if arch.name() == std::env::consts::ARCH {
        let tests = if wanted.is_empty() {
            Vec::new()
        } else {
            test_binaries(Command::new("cargo").args(["test", "-p", "memscope-integration", "--no-run"]), wanted)?
        };
        return Ok(Machine { binary, tests, built: host.clone() });
    }
    if arch != Arch::Aarch64 {
        bail!("no {} machine on a {} host", arch.name(), std::env::consts::ARCH);
    }
    let tests = if wanted.is_empty() { Vec::new() } else { cross_tests(arch, wanted)? };
    eprintln!("xtask vm: building the stand-ins for {}", arch.name());
    let mut built = build::standins_in(Toolchain::AARCH64, &root().join("target/standin-aarch64"))
        .context("building the arm64 stand-ins failed (`cargo xtask setup` installs g++-aarch64-linux-gnu)")?;
    let folder = binary.parent().expect("in the release's folder");
    built.markers = markers(&folder.join("markers"), fs, arch)?;
    Ok(Machine { binary, tests, built })
}

/// The release's stripped binary for `arch`.
pub fn release_binary(release: &Path, arch: Arch) -> PathBuf {
    release.join("stage").join(arch.release_name()).join("memscope-bpf")
}

/// The test files in `wanted`, cross-compiled for `arch` as static musl binaries.
fn cross_tests(arch: Arch, wanted: &[&str]) -> anyhow::Result<Vec<(String, PathBuf)>> {
    let tools = dist::tools::ensure(&[arch.triple()])?;
    eprintln!("xtask vm: cross-compiling the integration tests for {}", arch.name());
    let mut cargo = Command::new("cargo");
    cargo.env("PATH", tools.path()).args(["zigbuild", "--tests", "-p", "memscope-integration", "--target"]);
    cargo.args([arch.triple(), "--target-dir", "target/dist-build"]);
    test_binaries(&mut cargo, wanted)
}

/// The test binaries `cargo` builds (it is given `--message-format=json` here), by target name,
/// of the test files in `wanted`.
fn test_binaries(cargo: &mut Command, wanted: &[&str]) -> anyhow::Result<Vec<(String, PathBuf)>> {
    let out = cargo.current_dir(root()).arg("--message-format=json").stderr(Stdio::inherit()).output()?;
    if !out.status.success() {
        bail!("building the integration tests failed");
    }
    let mut found = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        let (Some(name), Some(exe)) = (msg["target"]["name"].as_str(), msg["executable"].as_str()) else { continue };
        if wanted.contains(&name) && msg["profile"]["test"].as_bool() == Some(true) {
            found.push((name.to_owned(), PathBuf::from(exe)));
        }
    }
    let missing: Vec<&&str> = wanted.iter().filter(|w| !found.iter().any(|(n, _)| n == **w)).collect();
    if !missing.is_empty() {
        bail!("cargo built no test binary for {missing:?}");
    }
    Ok(found)
}

/// The release's markers wheel for the VM's python3, unpacked into a folder for PYTHONPATH.
fn markers(wheels: &Path, fs: &Rootfs, arch: Arch) -> anyhow::Result<PathBuf> {
    let python = std::fs::read_link(fs.tree.join("usr/bin/python3")).context("the VM has no python3")?;
    let tag = python.to_string_lossy().replace("python3.", "cp3");
    let wheel = std::fs::read_dir(wheels)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().contains(&format!("-{tag}-{tag}-"))))
        .with_context(|| {
            format!("the release has no {tag} markers wheel for {} in {}", arch.name(), wheels.display())
        })?;
    let dest = root().join(format!("target/markers-{}", arch.name()));
    let _ = std::fs::remove_dir_all(&dest);
    sh(Command::new("unzip").args(["-q", "-o"]).arg(&wheel).arg("-d").arg(&dest))?;
    Ok(dest)
}
