//! The VM tier (the last part of `cargo xtask test`; `--vm` runs it alone): a smoke set of the
//! privileged tests, run inside virtual machines that boot Debian 12's own 6.1 kernel, x86-64
//! and arm64, under qemu (TCG: no KVM here) with a root file system made of Debian's packages,
//! and the release's static binary for that machine. The host kernel (6.18) takes paths users'
//! kernels do not: 6.1 has no multi-uprobe links (the per-probe perf-event fallback runs
//! instead) and older tracepoint layouts, as the 5.10–6.6 kernels of Ascend servers have; and
//! the host is no arm64 machine (Kunpeng): there the tests' native stacks walk arm64 frame
//! records and DWARF, and the markers are the release's aarch64 wheel on the VM's python3.
//!
//! `cargo xtask bench --vm-only` boots the same machines with the figures' script instead
//! ([`figures`]).
//!
//! Each machine prints its test binaries' results on its console (`payload.rs`); a failure names
//! the kernel and the tests that failed, and leaves the console log under `target/vm/ARCH/`.

pub mod figures;
mod machine;
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
/// and an attach by pid (the per-probe fallback attaching while the job runs) against the
/// ledger, SIGTERM to a complete DB, the markers' semaphores,
/// native stacks (frame pointers and DWARF), Python stacks on the VM's own python3, and the
/// daemon's discovery, status and `/metrics`.
const SMOKE: &[(&str, &[&str])] = &[
    (
        "trace",
        &[
            "launch_mode_matches_the_ledger_exactly",
            "attach_by_pid_mid_run_records_every_call_after_attach_and_stops_at_target_exit",
            "sigint_and_sigterm_stop_cleanly_with_a_complete_db",
        ],
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

fn boot(arch: Arch, kernel: &Path, initrd: &Path, log: &Path) -> anyhow::Result<String> {
    // Neoverse N1: ARMv8.2 without pointer authentication, like Kunpeng 920's cores (and `max`'s
    // emulated pointer authentication would slow every kernel function under TCG).
    let (qemu, machine, cpu, console) = match arch {
        Arch::X86_64 => ("qemu-system-x86_64", "q35", "max", "ttyS0"),
        Arch::Aarch64 => ("qemu-system-aarch64", "virt", "neoverse-n1", "ttyAMA0"),
    };
    let mut child = Command::new(qemu)
        .args(["-machine", machine, "-cpu", cpu, "-smp", "2", "-m", "3072", "-nographic", "-no-reboot"])
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

/// What a machine does once up.
enum Work<'a> {
    Smoke,
    Figures(&'a figures::Params),
    /// One trace of the stand-in job on the older kernel, which must refuse it.
    Older,
}

/// The older kernel's run: `trace` must stop at once, saying why, and never hang or half-trace.
const OLDER_SCRIPT: &str = "ASCEND_HOME_PATH=\"$MEMSCOPE_ASCEND_HOME\" \"$MEMSCOPE_BIN\" trace --output /tmp/older \
     -- python3 \"$MEMSCOPE_WORKLOAD\" --ledger /tmp/older.jsonl --steps 1 2>&1\necho \"VM-OLDER rc=$?\"\n";

/// What the tracer must say on a kernel without the helpers its probes call (`attach::loader`).
const OLDER_SAYS: &[&str] = &["5.10.0", " lacks ", "needs Linux 5.17 or later"];

/// A machine's run: its kernel's release and its console.
struct Booted {
    release: String,
    console: String,
}

/// Builds `arch`'s machine for `work`, boots it (on `kernel`, else the root file system's own)
/// and waits until it powers off.
fn boot_machine(
    built: &Built,
    release: &Path,
    arch: Arch,
    work: &Work<'_>,
    kernel: Option<(PathBuf, String)>,
) -> anyhow::Result<Booted> {
    let root = root();
    let mut fs = rootfs::ensure(arch)?;
    if let Some((file, release)) = kernel {
        (fs.kernel, fs.release) = (file, release);
    }
    let files: Vec<&str> = match work {
        Work::Smoke => SMOKE.iter().map(|(file, _)| *file).collect(),
        Work::Figures(_) | Work::Older => Vec::new(),
    };
    let machine = machine::prepare(arch, built, release, &fs, &files)?;
    let body = match work {
        Work::Smoke => payload::smoke(SMOKE),
        Work::Figures(params) => figures::script(&machine.built, &root, params),
        Work::Older => OLDER_SCRIPT.to_owned(),
    };
    let env = crate::test::standin_env(&root, &machine.built);
    let standins = machine.built.ascend_home.parent().expect("in the stand-ins' folder").to_owned();
    let mirrored = [standins, machine.built.markers.clone(), root.join("tests/workloads")];
    let dir = fs.cpio.parent().expect("in its folder").to_owned();
    let inputs = payload::Inputs {
        binary: &machine.binary,
        tests: &machine.tests,
        body: &body,
        mirrored: &mirrored,
        env: &env,
        cwd: &root,
    };
    let initrd = payload::build(&dir, &fs.cpio, &inputs)?;
    let log = dir.join("console.log");
    eprintln!("xtask vm: booting Linux {} ({}) under qemu; console in {}", fs.release, arch.name(), log.display());
    let console = boot(arch, &fs.kernel, &initrd, &log)?;
    Ok(Booted { release: fs.release, console })
}

/// Boots `arch`'s VM with the smoke set; fails naming the kernel and each failed test.
fn run_arch(built: &Built, release: &Path, arch: Arch) -> anyhow::Result<()> {
    let started = Instant::now();
    let Booted { release: kernel, console } = boot_machine(built, release, arch, &Work::Smoke, None)?;
    let failed = failures(&console);
    let done = console.contains("VM-DONE");
    eprintln!(
        "xtask vm: {} on {kernel}: {} failed, {:.0} s",
        arch.name(),
        failed.len(),
        started.elapsed().as_secs_f64()
    );
    if !failed.is_empty() || !done {
        let tail: Vec<&str> = console.lines().rev().take(60).collect();
        eprintln!("{}", tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
        bail!(
            "on Linux {kernel} ({}){}: {} failed: {}",
            arch.name(),
            if done { "" } else { ", the VM did not finish" },
            failed.len(),
            failed.join(", ")
        );
    }
    Ok(())
}

/// Boots Debian 11's 5.10 kernel, which lacks what the tracer needs: `trace` must fail at
/// start, saying so.
fn older_kernel_refused(built: &Built, release: &Path, arch: Arch) -> anyhow::Result<()> {
    let started = Instant::now();
    let kernel = rootfs::older_kernel(arch)?;
    let name = kernel.1.clone();
    let Booted { console, .. } = boot_machine(built, release, arch, &Work::Older, Some(kernel))?;
    let rc = console.lines().find_map(|l| l.trim_end().strip_prefix("VM-OLDER rc="));
    let said = OLDER_SAYS.iter().all(|s| console.contains(s));
    eprintln!(
        "xtask vm: {} on {name}: trace refused ({}), {:.0} s",
        arch.name(),
        rc.unwrap_or("?"),
        started.elapsed().as_secs_f64()
    );
    if rc.is_none_or(|rc| rc == "0") || !said {
        bail!(
            "on Linux {name} ({}), `trace` should fail at start saying {OLDER_SAYS:?}; its console:\n{console}",
            arch.name()
        );
    }
    Ok(())
}

/// The VM tier for each of `arches`, then the older kernel's refusal (x86-64).
pub fn run(built: &Built, release: &Path, arches: &[Arch]) -> anyhow::Result<()> {
    for &arch in arches {
        run_arch(built, release, arch)?;
    }
    if arches.contains(&Arch::X86_64) {
        older_kernel_refused(built, release, Arch::X86_64)?;
    }
    Ok(())
}

/// The figures' script on the host (the release's binary for it) and inside each of `arches`'
/// machines; returns the results section.
pub fn figures(built: &Built, release: &Path, arches: &[Arch], params: &figures::Params) -> anyhow::Result<String> {
    let host_arch = arches.iter().copied().find(|a| a.name() == std::env::consts::ARCH);
    let host_arch = host_arch.context("the figures need the release for this machine too")?;
    let binary = machine::release_binary(release, host_arch);
    eprintln!("xtask bench: VM figures on the host");
    let out = Command::new("sh")
        .arg("-c")
        .arg(figures::script(built, &root(), params))
        .env("MEMSCOPE_BIN", &binary)
        .env("MEMSCOPE_FIGURES", root().join("target/bench/vm-figures"))
        .stderr(Stdio::inherit())
        .output()?;
    let host_out = String::from_utf8_lossy(&out.stdout).into_owned();
    eprint!("{host_out}");
    let host = figures::Figures::parse(&host_out);
    let host_kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut machines = Vec::new();
    for &arch in arches {
        let booted = boot_machine(built, release, arch, &Work::Figures(params), None)?;
        let got = figures::Figures::parse(&booted.console);
        if got.stop_ms.is_none() || got.traced_ns.is_none() {
            bail!("the {} machine printed no figures; its console:\n{}", arch.name(), booted.console);
        }
        machines.push((format!("{} VM, {}", arch.name(), booted.release), got));
    }
    Ok(figures::table(params, (host_kernel.trim(), &host), &machines))
}
