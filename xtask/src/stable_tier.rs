//! The unprivileged tier as a machine with stable Rust only would run it: no nightly, no
//! bpf-linker, no rustup proxies on PATH, and the user crate built against its stub eBPF object
//! (`MEMSCOPE_EBPF_STUB=1`, memscope-user/build.rs). Running it so on every `cargo xtask test` is
//! what keeps the core crate free of aya and of the eBPF toolchain: a dependency that needs either
//! fails here, not on a contributor's laptop.
//!
//! It builds into its own target folder (`target/stable-only`) so the stub binary never replaces the
//! real one that the privileged tier runs.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context as _};

use crate::util::{output, run as sh};

/// `cargo test` of the default members, then `cargo clippy` of the core crate, with PATH cut down
/// to the stable toolchain and the system.
pub fn run(root: &Path) -> anyhow::Result<()> {
    let path = stable_path()?;
    let target = root.join("target/stable-only");
    let cargo = |args: &[&str]| {
        let mut cmd = Command::new("cargo");
        // With PATH set here, the program is looked up in it too (std's documented behaviour).
        cmd.current_dir(root)
            .env("PATH", &path)
            .env("MEMSCOPE_EBPF_STUB", "1")
            .env("CARGO_TARGET_DIR", &target)
            .env_remove("RUSTUP_TOOLCHAIN")
            .env_remove("RUSTC")
            .args(args);
        cmd
    };
    for tool in ["bpf-linker", "rustup"] {
        if find(&path, tool).is_some() {
            bail!("the stable-only tier's PATH still has `{tool}`");
        }
    }
    for tool in ["cargo", "rustc"] {
        let version = output(Command::new(tool).env("PATH", &path).arg("--version"))
            .with_context(|| format!("no {tool} on the stable-only PATH"))?;
        if version.contains("nightly") {
            bail!("the stable-only tier found a nightly {tool}: {version}");
        }
    }
    eprintln!("xtask test: unprivileged tier with stable Rust only (no nightly, no bpf-linker on PATH)");
    sh(&mut cargo(&["test"]))?;
    sh(&mut cargo(&["clippy", "-p", "memscope-core", "--all-targets", "--", "-D", "warnings"]))?;
    sh(&mut cargo(&["build", "-p", "memscope-user"]))?;
    stub_refuses_to_trace(&target.join("debug/memscope-bpf"))?;
    without_dbpage(root, &path)
}

/// The store's tests in a build without the workspace's `LIBSQLITE3_FLAGS` (`cargo install
/// --git`, a packager's build): SQLite has no `sqlite_dbpage`, and every DB must still be written,
/// through SQL. Its own target folder, since the flag changes libsqlite3-sys's build.
fn without_dbpage(root: &Path, path: &OsString) -> anyhow::Result<()> {
    eprintln!("xtask test: the store without sqlite_dbpage (LIBSQLITE3_FLAGS empty, as outside this workspace)");
    sh(Command::new("cargo")
        .current_dir(root)
        .env("PATH", path)
        .env("CARGO_TARGET_DIR", root.join("target/no-dbpage"))
        .env("LIBSQLITE3_FLAGS", "")
        .env("MEMSCOPE_EXPECT_NO_DBPAGE", "1")
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("RUSTC")
        .args(["test", "-p", "memscope-core", "--lib", "store::dump_rows", "--", "--test-threads=2"]))
}

/// The stub binary must refuse `trace` with the one sentence that names the switch, before it
/// launches the command (`true` would otherwise run and the trace come back empty).
fn stub_refuses_to_trace(binary: &Path) -> anyhow::Result<()> {
    let out = Command::new(binary)
        .args(["trace", "--", "true"])
        .output()
        .with_context(|| format!("cannot run {}", binary.display()))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.code() != Some(1) || !stderr.contains("MEMSCOPE_EBPF_STUB=1") || stderr.lines().count() != 1 {
        bail!(
            "the stub binary did not refuse `trace` in one line naming MEMSCOPE_EBPF_STUB ({}): {stderr}",
            out.status
        );
    }
    eprintln!("xtask test: the stub binary refuses `trace`: {}", stderr.trim());
    Ok(())
}

/// The stable toolchain's own `bin` (cargo, rustc, clippy without rustup's proxies), first so its
/// cargo and rustc win, followed by every PATH entry that holds neither `rustup` nor `bpf-linker`
/// (`~/.cargo/bin` holds both).
fn stable_path() -> anyhow::Result<OsString> {
    let sysroot = output(Command::new("rustup").args(["run", "stable", "rustc", "--print", "sysroot"])).context(
        "cannot find the stable toolchain (`rustup run stable rustc --print sysroot`); run `cargo xtask setup`",
    )?;
    let mut dirs = vec![PathBuf::from(sysroot.trim()).join("bin")];
    let current = std::env::var_os("PATH").unwrap_or_default();
    dirs.extend(
        std::env::split_paths(&current).filter(|d| !d.join("rustup").exists() && !d.join("bpf-linker").exists()),
    );
    Ok(std::env::join_paths(dirs)?)
}

fn find(path: &OsString, tool: &str) -> Option<PathBuf> {
    std::env::split_paths(path).map(|d| d.join(tool)).find(|p| p.exists())
}
