//! What a VM runs: the release's binary, the privileged tests' binaries and what they read (the
//! stand-ins, the workloads, the markers) at the same absolute paths as on the host (the
//! stand-ins find each other through RUNPATHs), and `/init`, which mounts what the tracer needs,
//! runs its work (the smoke set one test binary at a time, or the figures' script) and powers the
//! machine off. Its console is
//! the only way out: each test binary's libtest lines, then `VM-TESTS NAME rc=N`, then `VM-DONE`.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::util::run as sh;

/// Where the binary under test lives inside the VM.
const BIN: &str = "/memscope/memscope-bpf";
const TESTS: &str = "/memscope/tests";

pub struct Inputs<'a> {
    pub binary: &'a Path,
    /// (test binary's name, its file) for each file of the smoke set.
    pub tests: &'a [(String, PathBuf)],
    /// What `/init` runs once the machine is up ([`smoke`] or the figures' script).
    pub body: &'a str,
    /// Host paths copied in at the same place (the stand-ins' folders, workloads, markers).
    pub mirrored: &'a [PathBuf],
    /// The tests' environment (tests/integration's `environment.rs`), without binary and scratch.
    pub env: &'a [(&'static str, PathBuf)],
    /// The folder the tests run in (the workspace root, as on the host).
    pub cwd: &'a Path,
}

/// `/init`. The root is the initramfs, writable already: nothing is mounted over /tmp, where a
/// checkout (CI's clone) and so the payload's mirrored files may live.
fn init_script(inputs: &Inputs<'_>) -> String {
    let mut s = String::from(
        "#!/bin/sh\n\
         export PATH=/memscope:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root RUST_BACKTRACE=1\n\
         mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev\n\
         mount -t tracefs tracefs /sys/kernel/tracing; mount -t debugfs debugfs /sys/kernel/debug\n\
         mount -t bpf bpf /sys/fs/bpf; mount -t cgroup2 cgroup2 /sys/fs/cgroup; mkdir -p /tmp\n\
         mkdir -p /root; busybox ip link set lo up\n\
         echo \"VM-KERNEL $(uname -r) $(uname -m)\"\n",
    );
    for (key, value) in inputs.env {
        let _ = writeln!(s, "export {key}='{}'", value.display());
    }
    let _ = writeln!(s, "export MEMSCOPE_BIN={BIN} MEMSCOPE_SCRATCH=/tmp/scratch\ncd '{}'", inputs.cwd.display());
    s.push_str(inputs.body);
    s.push_str("echo VM-DONE\necho o > /proc/sysrq-trigger\nsleep 60\n");
    s
}

/// The smoke set's part of `/init`: each test binary with its tests, then `VM-TESTS NAME rc=N`.
pub fn smoke(smoke: &[(&str, &[&str])]) -> String {
    let mut s = String::new();
    for (file, names) in smoke {
        let _ = writeln!(
            s,
            "{TESTS}/{file} --test-threads=1 --color never --exact {}\necho \"VM-TESTS {file} rc=$?\"",
            names.join(" ")
        );
    }
    s
}

/// Writes the payload's folder and returns the initramfs: the root file system's archive with
/// the payload's appended (the kernel unpacks concatenated archives in order).
pub fn build(dir: &Path, rootfs_cpio: &Path, inputs: &Inputs<'_>) -> anyhow::Result<PathBuf> {
    let tree = dir.join("payload");
    let _ = std::fs::remove_dir_all(&tree);
    std::fs::create_dir_all(tree.join(TESTS.trim_start_matches('/')))?;
    std::fs::copy(inputs.binary, tree.join(BIN.trim_start_matches('/')))?;
    for (name, file) in inputs.tests {
        std::fs::copy(file, tree.join(TESTS.trim_start_matches('/')).join(name))?;
    }
    for path in inputs.mirrored {
        let inside = tree.join(path.strip_prefix("/").unwrap_or(path));
        std::fs::create_dir_all(inside.parent().expect("not the root"))?;
        sh(Command::new("cp").arg("-a").arg(path).arg(&inside))?;
    }
    std::fs::create_dir_all(tree.join(inputs.cwd.strip_prefix("/").unwrap_or(inputs.cwd)))?;
    let init = tree.join("init");
    std::fs::write(&init, init_script(inputs))?;
    std::fs::set_permissions(&init, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let payload = dir.join("payload.cpio");
    let script = format!("find . -print | cpio -o -H newc --quiet > '{}'", payload.display());
    sh(Command::new("sh").current_dir(&tree).args(["-c", &script]))?;
    let initrd = dir.join("initrd.cpio");
    let mut out = std::fs::File::create(&initrd)?;
    for part in [rootfs_cpio, payload.as_path()] {
        std::io::copy(&mut std::fs::File::open(part)?, &mut out)?;
    }
    Ok(initrd)
}
