//! The Python packages of a release:
//! - the tracer as a wheel per architecture (`pip install memscope_bpf-…whl` puts `memscope-bpf` on
//!   PATH, the way py-spy ships its binary): the static binary under the wheel's `.data/scripts`,
//!   packed with the `wheel` package's `wheel pack`, which writes RECORD;
//! - the markers package as an sdist (any machine with a C compiler and Python's headers), and as
//!   wheels for the build machine's architecture, one per pyenv CPython found (3.9–3.13).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context as _};

use super::tools::Tools;
use crate::util::{root, run as sh};

/// The tracer's wheel file name for an architecture (`x86_64`, `aarch64`).
pub fn tracer_wheel_name(version: &str, arch: &str) -> String {
    format!("memscope_bpf-{version}-py3-none-manylinux_2_28_{arch}.whl")
}

/// Packs `binaries` (the tracer, its driver helper) as the tracer's wheel into `out`; returns
/// the wheel's path.
pub fn tracer(
    tools: &Tools,
    stage: &Path,
    out: &Path,
    version: &str,
    arch: &str,
    binaries: &[&Path],
) -> anyhow::Result<PathBuf> {
    let tree = stage.join(format!("wheel-{arch}/memscope_bpf-{version}"));
    let _ = std::fs::remove_dir_all(&tree);
    let scripts = tree.join(format!("memscope_bpf-{version}.data/scripts"));
    let info = tree.join(format!("memscope_bpf-{version}.dist-info"));
    std::fs::create_dir_all(&scripts)?;
    std::fs::create_dir_all(&info)?;
    for binary in binaries {
        std::fs::copy(binary, scripts.join(binary.file_name().expect("named")))?;
    }
    // The tracer is static (musl) and its helper needs glibc 2.28: the manylinux tag's own.
    std::fs::write(
        info.join("WHEEL"),
        format!("Wheel-Version: 1.0\nGenerator: cargo-xtask-dist\nRoot-Is-Purelib: false\nTag: py3-none-manylinux_2_28_{arch}\n"),
    )?;
    std::fs::write(
        info.join("METADATA"),
        format!(
            "Metadata-Version: 2.1\nName: memscope-bpf\nVersion: {version}\n\
             Summary: eBPF tracer of accelerator memory (Ascend NPU, NVIDIA GPU) in running AI jobs, without restarting them\n\
             License: MIT OR Apache-2.0\nRequires-Python: >=3.6\n\
             Classifier: Operating System :: POSIX :: Linux\n\n\
             Installs the static `memscope-bpf` binary on PATH. Run it as root: `sudo memscope-bpf trace --pid N`.\n"
        ),
    )?;
    sh(Command::new(tools.python()).args(["-m", "wheel", "pack", "--dest-dir"]).arg(out).arg(&tree))?;
    let wheel = out.join(tracer_wheel_name(version, arch));
    if !wheel.is_file() {
        bail!("`wheel pack` did not write {}", wheel.display());
    }
    Ok(wheel)
}

/// pyenv's CPythons 3.9 and later, newest patch release of each minor version.
fn pyenv_pythons() -> Vec<PathBuf> {
    let home = std::env::var_os("PYENV_ROOT").map_or_else(|| PathBuf::from("/root/.pyenv"), PathBuf::from);
    let mut found: Vec<(u32, u32, PathBuf)> = std::fs::read_dir(home.join("versions"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let mut parts = name.split('.').map(|p| p.parse::<u32>().ok());
            let (Some(Some(3)), Some(Some(minor)), Some(Some(patch))) = (parts.next(), parts.next(), parts.next())
            else {
                return None;
            };
            let python = e.path().join("bin/python3");
            (minor >= 9 && python.is_file()).then_some((minor, patch, python))
        })
        .collect();
    found.sort();
    // Sorted, so the newest patch release of a minor version comes last and replaces the others.
    let mut newest: Vec<(u32, u32, PathBuf)> = Vec::new();
    for item in found {
        match newest.last_mut() {
            Some(last) if last.0 == item.0 => *last = item,
            _ => newest.push(item),
        }
    }
    newest.into_iter().map(|(_, _, p)| p).collect()
}

/// The markers' sdist, and a wheel per pyenv CPython for each of `arches` (x86-64's built here,
/// the others cross-compiled), written into `out`.
pub fn markers(tools: &Tools, out: &Path, arches: &[&str]) -> anyhow::Result<Vec<PathBuf>> {
    let _ = std::fs::remove_dir_all(out);
    std::fs::create_dir_all(out)?;
    let source = root().join("markers");
    let script = format!(
        "import sys; sys.path.insert(0, 'build_backend'); import memscope_build_backend as b; print(b.build_sdist({:?}))",
        out.display().to_string()
    );
    sh(Command::new(tools.python()).current_dir(&source).args(["-c", &script]))
        .context("cannot build the markers' sdist")?;
    let pythons = pyenv_pythons();
    if pythons.is_empty() {
        eprintln!("xtask dist: WARNING: no pyenv CPython 3.9+ here: the markers ship as an sdist only");
    }
    for python in &pythons {
        for arch in arches {
            markers_wheel(tools, python, out, arch)
                .with_context(|| format!("cannot build the markers' {arch} wheel with {}", python.display()))?;
        }
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(out)?.flatten().map(|e| e.path()).collect();
    files.sort();
    Ok(files)
}

/// One wheel of the markers for `python`'s version and `arch`. Another architecture's is built by
/// setuptools as usual (so setup.py's flags apply) with Zig's compiler for that architecture and
/// glibc 2.28, then its extension renamed and the wheel retagged: setuptools names both after the
/// machine it runs on.
fn markers_wheel(tools: &Tools, python: &Path, out: &Path, arch: &str) -> anyhow::Result<()> {
    let native = arch == std::env::consts::ARCH;
    // A fresh copy each time: setuptools would reuse an extension it built for another machine.
    let source = out.with_file_name(format!("markers-src-{arch}"));
    let _ = std::fs::remove_dir_all(&source);
    super::copy_tree(&root().join("markers"), &source, &["build", "memscope_markers.egg-info"])?;
    let built = out.with_file_name(format!("markers-{arch}"));
    let _ = std::fs::remove_dir_all(&built);
    let mut pip = Command::new(python);
    pip.args(["-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir"]).arg(if native { out } else { &built });
    if !native {
        let cc = format!("{} -m ziglang cc -target {arch}-linux-gnu.2.28", tools.python().display());
        // No RELRO segment. Zig's linker (lld) packs segments into shared file pages, and its
        // RELRO segment, writable while the loader relocates it, then maps the semaphores' page
        // too: a process that imports the markers after a tracer attached gets its semaphores
        // raised at that segment's address instead (the kernel takes the first writable mapping
        // of the page), so they stay 0 and the probes never fire there. The daemon's test found
        // it on the arm64 VM. Zig's linker has no `-z separate-loadable-segments`; without RELRO
        // one writable segment holds the page (a module of a few functions loses little).
        let ld = format!("{cc} -shared -Wl,-z,norelro");
        pip.env("CC", &cc).env("LDSHARED", ld);
    }
    sh(pip.arg(&source))?;
    if native {
        return Ok(());
    }
    let wheel = std::fs::read_dir(&built)?.flatten().map(|e| e.path()).next().context("pip wrote no wheel")?;
    let unpacked = built.join("unpacked");
    sh(Command::new(tools.python()).args(["-m", "wheel", "unpack", "--dest"]).arg(&unpacked).arg(&wheel))?;
    let tree = std::fs::read_dir(&unpacked)?.flatten().map(|e| e.path()).next().context("an empty wheel")?;
    let host = std::env::consts::ARCH;
    for entry in std::fs::read_dir(tree.join("memscope"))?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(&format!("-{host}-linux-gnu.so")) {
            std::fs::rename(entry.path(), entry.path().with_file_name(name.replace(host, arch)))?;
        }
    }
    let info =
        std::fs::read_dir(&tree)?.flatten().map(|e| e.path()).find(|p| p.extension().is_some_and(|e| e == "dist-info"));
    let wheel_file = info.context("the wheel has no .dist-info")?.join("WHEEL");
    let text = std::fs::read_to_string(&wheel_file)?;
    std::fs::write(&wheel_file, text.replace(&format!("-linux_{host}"), &format!("-manylinux_2_28_{arch}")))?;
    sh(Command::new(tools.python()).args(["-m", "wheel", "pack", "--dest-dir"]).arg(out).arg(&tree))
}
