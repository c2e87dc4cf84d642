//! `cargo xtask setup`: everything a fresh Debian bookworm machine lacks to build and test, and
//! nothing it already has (each step checks first, so a second run takes seconds).
//!
//! The eBPF build chain (shared/reference/toolchain-recipe.md): Debian's llvm-22 (from
//! bookworm-security), bpf-linker 0.13 built against it, and nightly Rust with rust-src for
//! `-Z build-std=core`. Plus gcc for the stand-in libraries, bpftrace as the benchmark's peer and
//! Python's development headers for the markers package's C extension, pip to fetch the real
//! torch_npu wheel a test reads, Prometheus to scrape `--listen`'s metrics in the tests, and Chromium to open `report`'s pages.

use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context as _};

use crate::util::{ok, output, privileged, run as sh};

#[derive(clap::Args)]
pub struct Options {
    /// Only report what is missing; install nothing.
    #[arg(long)]
    pub check: bool,
}

const APT_PACKAGES: &[&str] = &[
    "llvm-22-dev",
    "libzstd-dev",
    "zlib1g-dev",
    "systemtap-sdt-dev",
    "python3-dev",
    "python3-pip",
    "bpftrace",
    "gcc",
    "util-linux",
    // Ascend hosts are often arm64: a unit test lays out CPython's fields for it from CPython's
    // own headers with the cross compiler.
    "gcc-aarch64-linux-gnu",
    "libc6-dev-arm64-cross",
    // The real consumer of `--listen`'s metrics: the tests scrape the tracer with Prometheus and
    // query it, and check the exposition with its `promtool`.
    "prometheus",
    // `trace`'s status area is checked on a real terminal, inside tmux.
    "tmux",
    // `report`'s page is opened in headless Chromium by the tests and the benchmark.
    "chromium",
    // The release's checks (tests/integration/tests/release.rs): the aarch64 binary run under
    // qemu-user, the OCI image unpacked by umoci, the split debug info read by gdb.
    "qemu-user-static",
    "umoci",
    "gdb",
    "unzip",
    // The VM tier (xtask/src/vm): Debian's packages into a root file system, and the machines.
    "debootstrap",
    "cpio",
    "qemu-system-x86",
    "qemu-system-arm",
    // ... and the arm64 machine's stand-ins, built for Debian's arm64 libc.
    "g++-aarch64-linux-gnu",
    // The power-cut test records the trace DB's writes and syncs with it (store/crash_tests.rs).
    "strace",
];
const BPF_LINKER_VERSION: &str = "0.13.0";
pub const LLVM_PREFIX: &str = "/usr/lib/llvm-22";

fn apt_missing() -> Vec<&'static str> {
    APT_PACKAGES
        .iter()
        .copied()
        .filter(|pkg| {
            let status = output(Command::new("dpkg-query").args(["-W", "-f=${Status}", pkg])).unwrap_or_default();
            !status.contains("install ok installed")
        })
        .collect()
}

fn nightly_ready() -> (bool, bool) {
    let toolchains = output(Command::new("rustup").args(["toolchain", "list"])).unwrap_or_default();
    let has_nightly = toolchains.lines().any(|l| l.starts_with("nightly"));
    let has_src = has_nightly
        && output(Command::new("rustup").args(["component", "list", "--installed", "--toolchain", "nightly"]))
            .unwrap_or_default()
            .lines()
            .any(|l| l.starts_with("rust-src"));
    (has_nightly, has_src)
}

fn bpf_linker_ready() -> bool {
    output(Command::new("bpf-linker").arg("--version")).is_some_and(|v| v.contains(BPF_LINKER_VERSION))
}

pub fn run(opts: &Options) -> anyhow::Result<()> {
    let started = Instant::now();
    let missing = apt_missing();
    let (has_nightly, has_src) = nightly_ready();
    let linker = bpf_linker_ready();
    if opts.check {
        eprintln!("apt packages missing: {missing:?}");
        eprintln!("nightly toolchain: {has_nightly}, rust-src: {has_src}, bpf-linker {BPF_LINKER_VERSION}: {linker}");
        return Ok(());
    }

    if missing.is_empty() {
        eprintln!("xtask setup: apt packages present");
    } else {
        eprintln!("xtask setup: installing {}", missing.join(" "));
        sh(privileged("apt-get").args(["update", "-qq"]))?;
        sh(privileged("apt-get")
            .env("DEBIAN_FRONTEND", "noninteractive")
            .args(["install", "-y", "-qq", "--no-install-recommends"])
            .args(&missing))
        .context("apt-get install failed (llvm-22-dev comes from bookworm-security; is it in the apt sources?)")?;
    }

    if !has_nightly {
        sh(Command::new("rustup").args([
            "toolchain",
            "install",
            "nightly",
            "--profile",
            "minimal",
            "--component",
            "rust-src",
        ]))?;
    } else if !has_src {
        sh(Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", "nightly"]))?;
    } else {
        eprintln!("xtask setup: nightly with rust-src present");
    }

    if linker {
        eprintln!("xtask setup: bpf-linker {BPF_LINKER_VERSION} present");
    } else {
        eprintln!("xtask setup: building bpf-linker {BPF_LINKER_VERSION} against llvm-22 (about 2 minutes)");
        // /usr/bin/llvm-config is an older LLVM; llvm-22's must win.
        let path = format!("{LLVM_PREFIX}/bin:{}", std::env::var("PATH").unwrap_or_default());
        sh(Command::new("cargo").env("PATH", path).env("LLVM_PREFIX", LLVM_PREFIX).args([
            "install",
            "bpf-linker",
            "--locked",
            "--version",
            BPF_LINKER_VERSION,
            "--no-default-features",
            "--features",
            "llvm-22",
        ]))?;
        if !bpf_linker_ready() {
            bail!("bpf-linker was installed but is not on PATH; add ~/.cargo/bin to PATH");
        }
    }
    // The release's tools and Rust targets (cargo-zigbuild and Zig, musl for both machines).
    crate::dist::prepare()?;
    if !ok(Command::new("python3").args(["-c", "import ctypes, sqlite3"])) {
        bail!("python3 with ctypes and sqlite3 is needed for the workloads; install python3");
    }
    eprintln!("xtask setup: done in {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}
