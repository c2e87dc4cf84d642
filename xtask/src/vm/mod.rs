//! The VM tier (`cargo xtask test --vm`; not yet in the full run, see issue 37): a smoke set
//! of the privileged tests, run inside virtual machines that boot Debian 12's own 6.1 kernel
//! under qemu (TCG: no KVM here) with a root file system made of Debian's packages, and the
//! release's static binary for that machine. The host kernel (6.18) takes paths users' kernels
//! do not: 6.1 has no multi-uprobe links (the per-probe perf-event fallback runs instead) and
//! older tracepoint layouts, as the 5.10–6.6 kernels of Ascend servers have.
//!
//! Each machine prints its test binaries' results on its console (`payload.rs`); a failure names
//! the kernel and the tests that failed, and leaves the console log under `target/vm/ARCH/`.

mod payload;
mod rootfs;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};

use crate::build::Built;
use crate::dist::Arch;
use crate::util::root;

/// The smoke set: per test binary of tests/integration, the tests run in each VM. Launch mode
/// against the ledger, SIGTERM to a complete DB, the markers' semaphores,
/// native stacks (frame pointers and DWARF), Python stacks on the VM's own python3, and the
/// daemon's discovery, status and `/metrics`.
const SMOKE: &[(&str, &[&str])] = &[
    (
        "trace",
        // Not yet `attach_by_pid_mid_run_...`: on 6.1 under TCG it failed one run in two (a
        // row recorded while the per-probe fallback was still attaching matched no ledger call);
        // issue 37's notes hold the case.
        &["launch_mode_matches_the_ledger_exactly", "sigint_and_sigterm_stop_cleanly_with_a_complete_db"],
    ),
    ("tags", &["semaphores_rise_while_traced_and_drop_when_the_tracer_exits_or_is_killed"]),
    (
        "stacks",
        &[
            "frame_pointer_stacks_hold_the_ledgers_chain_with_its_lines_and_inlined_step",
            "dwarf_unwinding_walks_the_whole_chain_through_a_library_without_frame_pointers",
            "python_stacks_are_the_calling_threads_own_on_every_cpython",
        ],
    ),
    ("daemon", &["the_daemons_json_status_has_each_running_jobs_ledger_bytes"]),
    ("daemon_live", &["the_daemon_exports_each_jobs_owners_and_the_offline_degradation_verdict_while_it_runs"]),
];

/// A machine that takes longer has hung.
const BOOT_LIMIT: Duration = Duration::from_secs(25 * 60);

/// The privileged tests' binaries for this machine, by name (`trace`, `stacks`, ...).
fn test_binaries(arch: Arch) -> anyhow::Result<Vec<(String, PathBuf)>> {
    if arch.name() != std::env::consts::ARCH {
        bail!("the {} VM needs its tests compiled for it, which this tier does not do yet", arch.name());
    }
    let out = Command::new("cargo")
        .current_dir(root())
        .args(["test", "-p", "memscope-integration", "--no-run", "--message-format=json"])
        .stderr(Stdio::inherit())
        .output()?;
    if !out.status.success() {
        bail!("building the integration tests failed");
    }
    let mut found = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        let (Some(name), Some(exe)) = (msg["target"]["name"].as_str(), msg["executable"].as_str()) else { continue };
        if SMOKE.iter().any(|(file, _)| *file == name) {
            found.push((name.to_owned(), PathBuf::from(exe)));
        }
    }
    Ok(found)
}

fn boot(arch: Arch, kernel: &Path, initrd: &Path, log: &Path) -> anyhow::Result<String> {
    let (qemu, machine, console) = match arch {
        Arch::X86_64 => ("qemu-system-x86_64", "q35", "ttyS0"),
        Arch::Aarch64 => ("qemu-system-aarch64", "virt", "ttyAMA0"),
    };
    let mut child = Command::new(qemu)
        .args(["-machine", machine, "-cpu", "max", "-smp", "2", "-m", "3072", "-nographic", "-no-reboot"])
        .arg("-kernel")
        .arg(kernel)
        .arg("-initrd")
        .arg(initrd)
        .args(["-append", &format!("console={console} rdinit=/init panic=-1 quiet")])
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(log)?)
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("cannot start {qemu} (`cargo xtask setup` installs it)"))?;
    let started = Instant::now();
    while child.try_wait()?.is_none() {
        if started.elapsed() > BOOT_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    Ok(String::from_utf8_lossy(&std::fs::read(log)?).into_owned())
}

/// The smoke tests the console does not show as passed.
fn failures(console: &str) -> Vec<String> {
    let passed = |name: &str| console.lines().any(|l| l.trim_end() == format!("test {name} ... ok"));
    SMOKE
        .iter()
        .flat_map(|(file, names)| names.iter().map(move |n| (file, n)))
        .filter(|(_, n)| !passed(n))
        .map(|(f, n)| format!("{f}::{n}"))
        .collect()
}

/// Boots `arch`'s VM with the smoke set; fails naming the kernel and each failed test.
fn run_arch(built: &Built, release: &Path, arch: Arch) -> anyhow::Result<()> {
    let root = root();
    let fs = rootfs::ensure(arch)?;
    let tests = test_binaries(arch)?;
    let binary =
        release.join(format!("stage/memscope-bpf-{}-{}-linux/memscope-bpf", crate::dist::VERSION, arch.name()));
    let env = crate::test::standin_env(&root, built);
    let mirrored = [root.join("target/standin"), built.markers.clone(), root.join("tests/workloads")];
    let dir = fs.cpio.parent().expect("in its folder").to_owned();
    let inputs =
        payload::Inputs { binary: &binary, tests: &tests, smoke: SMOKE, mirrored: &mirrored, env: &env, cwd: &root };
    let initrd = payload::build(&dir, &fs.cpio, &inputs)?;
    let log = dir.join("console.log");
    eprintln!("xtask vm: booting Linux {} ({}) under qemu; console in {}", fs.release, arch.name(), log.display());
    let started = Instant::now();
    let console = boot(arch, &fs.kernel, &initrd, &log)?;
    let failed = failures(&console);
    let done = console.contains("VM-DONE");
    eprintln!(
        "xtask vm: {} on {}: {} failed, {:.0} s",
        arch.name(),
        fs.release,
        failed.len(),
        started.elapsed().as_secs_f64()
    );
    if !failed.is_empty() || !done {
        let tail: Vec<&str> = console.lines().rev().take(60).collect();
        eprintln!("{}", tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
        bail!(
            "on Linux {} ({}){}: {} failed: {}",
            fs.release,
            arch.name(),
            if done { "" } else { ", the VM did not finish" },
            failed.len(),
            failed.join(", ")
        );
    }
    Ok(())
}

/// The VM tier for each of `arches`.
pub fn run(built: &Built, release: &Path, arches: &[Arch]) -> anyhow::Result<()> {
    for &arch in arches {
        run_arch(built, release, arch)?;
    }
    Ok(())
}
