//! A machine's root file system and kernel from Debian's own packages, cached under
//! `target/vm/ARCH/`: `debootstrap --foreign` resolves and fetches the packages (no program of
//! the other architecture runs: that stage only downloads and unpacks), then every fetched
//! package is unpacked with `dpkg-deb -x` (no maintainer scripts: nothing here needs them),
//! and the tree, less the kernel's modules and the documentation, becomes a cpio archive the
//! kernel unpacks as its initramfs. The kernel is Debian's `linux-image-ARCH` of the release.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context as _};

use crate::dist::Arch;
use crate::util::{root, run as sh};

/// Debian 12: its 6.1 kernel has no multi-uprobe links (6.6), no `group_dead` in
/// `sched_process_exit` (6.16), and the BPF of Ascend servers' 5.10–6.6 kernels.
pub const SUITE: &str = "bookworm";
const MIRROR: &str = "http://deb.debian.org/debian";
/// What the smoke tests run beside the tracer: the stand-in workloads' interpreter, busybox for
/// `ip` (the daemon listens on loopback), libc's symbols (as on the host, where valgrind brings
/// them), by which a native stack's outermost frame is named `__libc_start_call_main`, and
/// binutils, whose `readelf` gives the tests their ground truth as on the host.
const PACKAGES: &[&str] = &["python3", "busybox", "libc6-dbg", "binutils"];
/// Left out of the initramfs: large, and nothing in the VM reads them.
const LEFT_OUT: &[&str] = &[
    // Where the kernel package puts them (debootstrap's first stage leaves /lib a folder).
    "./lib/modules",
    "./usr/lib/modules",
    "./usr/share/doc",
    "./usr/share/man",
    "./usr/share/locale",
    "./usr/share/info",
    "./var/cache/apt",
    "./boot",
];

pub struct Rootfs {
    pub kernel: PathBuf,
    /// The kernel's release (`uname -r`), for messages.
    pub release: String,
    /// The root file system as a newc cpio archive.
    pub cpio: PathBuf,
    /// The unpacked tree it was made from.
    pub tree: PathBuf,
}

fn debian_arch(arch: Arch) -> &'static str {
    match arch {
        Arch::X86_64 => "amd64",
        Arch::Aarch64 => "arm64",
    }
}

/// The cached root file system of `arch`, made first if missing.
pub fn ensure(arch: Arch) -> anyhow::Result<Rootfs> {
    let dir = root().join("target/vm").join(debian_arch(arch));
    let tree = dir.join("rootfs");
    let cpio = dir.join("rootfs.cpio");
    let stamp = dir.join("ready");
    // The stamp names what was fetched and what the archive leaves out, so a change to either
    // makes them again.
    let wanted = format!("{SUITE} {}; {}\n", PACKAGES.join(" "), LEFT_OUT.join(" "));
    if std::fs::read_to_string(&stamp).ok().as_deref() != Some(wanted.as_str()) {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        fetch(arch, &tree, SUITE, PACKAGES)?;
        archive(&tree, &cpio)?;
        prune(&tree)?;
        std::fs::write(&stamp, &wanted)?;
    }
    let (kernel, release) = kernel_in(&tree, &dir)?;
    Ok(Rootfs { kernel, release, cpio, tree })
}

/// Debian 11's kernel (5.10, as openEuler 22.03's), booted with the Debian 12 root file system:
/// the kernel without BPF attach cookies and perf-event BPF links (both 5.15), which the tracer
/// needs. Only its kernel is used, so only its base set and kernel are fetched; returns the
/// kernel and its release.
pub fn older_kernel(arch: Arch) -> anyhow::Result<(PathBuf, String)> {
    let dir = root().join("target/vm").join(format!("{}-{OLDER_SUITE}", debian_arch(arch)));
    let tree = dir.join("rootfs");
    let stamp = dir.join("ready");
    if std::fs::read_to_string(&stamp).ok().as_deref() != Some(OLDER_SUITE) {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        fetch(arch, &tree, OLDER_SUITE, &[])?;
        // Only the kernel boots from here.
        prune(&tree)?;
        std::fs::write(&stamp, OLDER_SUITE)?;
    }
    kernel_in(&tree, &dir)
}

/// Debian 11 (bullseye): its 5.10 kernel.
const OLDER_SUITE: &str = "bullseye";

fn kernel_in(tree: &Path, dir: &Path) -> anyhow::Result<(PathBuf, String)> {
    let boot = tree.join("boot");
    let kernel = std::fs::read_dir(&boot)
        .with_context(|| format!("{} is incomplete; remove {} and run again", boot.display(), dir.display()))?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz-")))
        .with_context(|| format!("no kernel in {}", boot.display()))?;
    let release = kernel.file_name().expect("named").to_string_lossy().trim_start_matches("vmlinuz-").to_owned();
    Ok((kernel, release))
}

fn fetch(arch: Arch, tree: &Path, suite: &str, packages: &[&str]) -> anyhow::Result<()> {
    let debian = debian_arch(arch);
    eprintln!("xtask vm: fetching Debian {suite} ({debian}) and its kernel into {}", tree.display());
    let include: Vec<String> =
        packages.iter().map(|p| (*p).to_owned()).chain([format!("linux-image-{debian}")]).collect();
    sh(Command::new("debootstrap")
        .args(["--foreign", "--variant=minbase", &format!("--arch={debian}")])
        .arg(format!("--include={}", include.join(",")))
        .arg(suite)
        .arg(tree)
        .arg(MIRROR))
    .context("debootstrap failed (`cargo xtask setup` installs it; it needs root and deb.debian.org)")?;
    let archives = tree.join("var/cache/apt/archives");
    let mut debs: Vec<PathBuf> = std::fs::read_dir(&archives)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "deb"))
        // With no packages asked for, only the kernel is wanted.
        .filter(|p| {
            !packages.is_empty() || p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("linux-image-"))
        })
        .collect();
    debs.sort();
    for deb in &debs {
        sh(Command::new("dpkg-deb").arg("-x").arg(deb).arg(tree))?;
    }
    if packages.contains(&"python3") && !tree.join("usr/bin/python3").exists() {
        bail!("the {debian} root file system has no python3 after unpacking {} packages", debs.len());
    }
    Ok(())
}

/// Removes from the tree what the archive left out, but the kernel: the tree is kept only for its
/// kernel and a look at its python3, and the modules and the fetched packages are most of it.
fn prune(tree: &Path) -> anyhow::Result<()> {
    for path in LEFT_OUT.iter().filter(|p| **p != "./boot") {
        let path = tree.join(path);
        // Under merged /usr, ./lib is a link into ./usr/lib: the link itself is not a folder.
        if path.is_dir() && !path.is_symlink() {
            std::fs::remove_dir_all(&path).with_context(|| format!("cannot remove {}", path.display()))?;
        }
    }
    Ok(())
}

fn archive(tree: &Path, cpio: &Path) -> anyhow::Result<()> {
    let prune: Vec<String> = LEFT_OUT.iter().map(|p| format!("-path {p} -prune -o")).collect();
    let script = format!("find . {} -print | cpio -o -H newc --quiet > '{}'", prune.join(" "), cpio.display());
    sh(Command::new("sh").current_dir(tree).args(["-c", &script]))
}
