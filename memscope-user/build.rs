//! Builds the eBPF object (memscope-ebpf) with aya-build, after checking that the toolchain it
//! needs is installed, so a missing piece is one clear message instead of a linker error deep in
//! a nested cargo run.

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

fn main() -> anyhow::Result<()> {
    println!("cargo:rerun-if-changed=../memscope-common/src");
    println!("cargo:rerun-if-env-changed=PATH");
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
