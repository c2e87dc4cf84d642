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

/// Set while this build script runs as the nested cargo's rustc wrapper.
const WRAPPER_SWITCH: &str = "MEMSCOPE_BPF_RUSTC_WRAPPER";

/// The probes need BPF's v3 instruction set (fetching atomics, for the sampling counters: an
/// add that returns the sum and a compare-and-swap), where rustc's default CPU for the bpf target
/// is v1; every kernel with multi-uprobe links has v3. aya-build sets the eBPF crate's rustflags
/// itself and takes no more, so the nested cargo runs its rustc through this same program,
/// which adds `-C target-cpu=v3` to the compiles for the bpf target and nothing to the others.
fn run_as_rustc_wrapper() -> Option<std::convert::Infallible> {
    use std::os::unix::process::CommandExt as _;
    std::env::var_os(WRAPPER_SWITCH)?;
    let mut args = std::env::args_os().skip(1);
    let rustc = args.next()?;
    let args: Vec<_> = args.collect();
    let is_bpf = |a: &std::ffi::OsStr| a.to_str().is_some_and(|t| t.trim_start_matches("--target=").starts_with("bpf"));
    let bpf = args.windows(2).any(|w| w[0] == "--target" && is_bpf(&w[1]))
        || args.iter().any(|a| a.to_str().is_some_and(|t| t.starts_with("--target=")) && is_bpf(a));
    let mut cmd = Command::new(&rustc);
    cmd.args(&args);
    if bpf {
        cmd.arg("-Ctarget-cpu=v3");
    }
    let error = cmd.exec();
    eprintln!("error: memscope-user's build script could not run {}: {error}", rustc.to_string_lossy());
    std::process::exit(1);
}

fn main() -> anyhow::Result<()> {
    if let Some(never) = run_as_rustc_wrapper() {
        match never {}
    }
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
    // SAFETY: single-threaded here; the variables are for the nested cargo aya-build starts.
    unsafe {
        std::env::set_var(WRAPPER_SWITCH, "1");
        std::env::set_var("RUSTC_WRAPPER", std::env::current_exe()?);
    }
    aya_build::build_ebpf([ebpf], aya_build::Toolchain::default())
}
