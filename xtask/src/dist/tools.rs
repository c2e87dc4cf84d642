//! The release build's tools, installed by `dist` itself into `target/dist-tools/` (never into
//! the system): cargo-zigbuild and Zig from PyPI (prebuilt, so a fresh machine has them in
//! seconds instead of compiling them), the `wheel` package that writes the wheels, and the Rust
//! standard libraries of the musl targets.
//!
//! Why Zig: the binaries are static musl builds (they start on any glibc, and the OCI image needs
//! nothing beside them), and the one C dependency (SQLite, bundled by libsqlite3-sys) must be
//! compiled for each architecture's musl. Zig carries musl's headers for every architecture;
//! Debian has a musl C compiler for the host's architecture only.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context as _;

use crate::util::{ok, output, root, run as sh};

/// Pinned so two release builds use the same compiler and linker.
const PACKAGES: &[&str] = &["cargo-zigbuild==0.24.1", "ziglang==0.17.1", "wheel==0.48.0"];

pub struct Tools {
    /// The venv's bin folder: `cargo-zigbuild`, `python -m ziglang`, `wheel`.
    pub bin: PathBuf,
}

impl Tools {
    /// PATH with the venv's tools first (cargo-zigbuild finds Zig through its Python there).
    pub fn path(&self) -> String {
        format!("{}:{}", self.bin.display(), std::env::var("PATH").unwrap_or_default())
    }

    pub fn python(&self) -> PathBuf {
        self.bin.join("python")
    }
}

fn venv_ready(bin: &Path) -> bool {
    let Some(list) = output(Command::new(bin.join("python")).args(["-m", "pip", "freeze"])) else {
        return false;
    };
    PACKAGES.iter().all(|p| list.lines().any(|l| l.trim().eq_ignore_ascii_case(p)))
}

/// Installs what is missing; quick when everything is there.
pub fn ensure(targets: &[&str]) -> anyhow::Result<Tools> {
    let venv = root().join("target/dist-tools/venv");
    let bin = venv.join("bin");
    if !venv_ready(&bin) {
        eprintln!("xtask dist: installing {} into {}", PACKAGES.join(" "), venv.display());
        if !bin.join("python").exists() {
            sh(Command::new("python3").args(["-m", "venv"]).arg(&venv))
                .context("python3 -m venv failed (Debian: apt install python3-venv)")?;
        }
        sh(Command::new(bin.join("python")).args(["-m", "pip", "install", "--quiet"]).args(PACKAGES))
            .context("cannot install the release tools from PyPI")?;
    }
    let installed = output(Command::new("rustup").args(["target", "list", "--installed"])).unwrap_or_default();
    let missing: Vec<&str> = targets.iter().copied().filter(|t| !installed.lines().any(|l| l.trim() == *t)).collect();
    if !missing.is_empty() {
        sh(Command::new("rustup").args(["target", "add"]).args(&missing))?;
    }
    let tools = Tools { bin };
    if !ok(Command::new(tools.bin.join("cargo-zigbuild")).arg("--version")) {
        anyhow::bail!(
            "{} does not run; remove target/dist-tools and try again",
            tools.bin.join("cargo-zigbuild").display()
        );
    }
    Ok(tools)
}
