//! Builds the eBPF object (memscope-ebpf) with aya-build, after checking that the toolchain it
//! needs is installed, so a missing piece is one clear message instead of a linker error deep in
//! a nested cargo run.
//!
//! `MEMSCOPE_EBPF_STUB=1` builds against an empty stub object instead, needing neither nightly nor
//! bpf-linker: for machines with stable Rust only (the unprivileged test tier runs so). Such a
//! binary runs every verb but `trace`, which says it was built without its eBPF programs.

use std::process::Command;

use anyhow::bail;

const SETUP_HINT: &str = "run `cargo xtask setup` (installs llvm-22, bpf-linker and nightly's rust-src)";

fn check_toolchain() -> anyhow::Result<()> {
    let linker = Command::new("bpf-linker").arg("--version").output();
    if !linker.is_ok_and(|o| o.status.success()) {
        bail!("the eBPF linker `bpf-linker` is not installed or not on PATH; {SETUP_HINT}");
    }
    let sysroot = Command::new("rustup")
        .args(["run", "nightly", "rustc", "--print", "sysroot"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned());
    let Some(sysroot) = sysroot else {
        bail!("the nightly Rust toolchain is not installed; {SETUP_HINT}");
    };
    let rust_src = std::path::Path::new(&sysroot).join("lib/rustlib/src/rust/library/core");
    if !rust_src.is_dir() {
        bail!("nightly's rust-src component is missing ({} not found); {SETUP_HINT}", rust_src.display());
    }
    Ok(())
}

/// The switch's name; the binary's loader names it too when it meets the stub.
const STUB_SWITCH: &str = "MEMSCOPE_EBPF_STUB";

fn main() -> anyhow::Result<()> {
    println!("cargo:rerun-if-changed=../memscope-common/src");
    println!("cargo:rerun-if-env-changed=PATH");
    println!("cargo:rerun-if-env-changed={STUB_SWITCH}");
    if std::env::var_os(STUB_SWITCH).is_some_and(|v| !v.is_empty() && v != "0") {
        let out = std::path::PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
        std::fs::write(out.join("memscope"), b"")?;
        println!("cargo:warning=memscope-bpf: built with {STUB_SWITCH}: no eBPF programs, `trace` will refuse to run");
        return Ok(());
    }
    if let Err(e) = check_toolchain() {
        // Shown by cargo as a warning and as the build script's stderr; exit without a backtrace.
        println!("cargo:warning=memscope-bpf: {e}");
        eprintln!("error: the eBPF toolchain is incomplete: {e}");
        std::process::exit(1);
    }
    let ebpf = aya_build::Package {
        name: "memscope-ebpf",
        root_dir: concat!(env!("CARGO_MANIFEST_DIR"), "/../memscope-ebpf"),
        ..Default::default()
    };
    aya_build::build_ebpf([ebpf], aya_build::Toolchain::default())
}
