//! `cargo xtask test`: the README's test command. Setup, build, the unprivileged tests (plain
//! `cargo test`, with stable Rust only: [`stable_tier`]), the release (`cargo xtask dist`, for
//! x86-64 and aarch64), the privileged tier (tests/integration, which loads BPF, and checks the
//! release) as root, then the VM tier ([`vm`]: a smoke set on Debian 12's 6.1 kernel, x86-64 and
//! arm64, under qemu).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::util::{disk_note, privileged, root, run as sh};
use crate::{build, dist, setup, stable_tier, torch_env, vm, wheel};

#[derive(clap::Args)]
pub struct Options {
    /// Skip `cargo xtask setup` (for quick reruns on a machine already set up).
    #[arg(long)]
    pub no_setup: bool,
    /// Run only the unprivileged tests.
    #[arg(long)]
    pub unprivileged_only: bool,
    /// Only privileged tests whose name contains this.
    #[arg(long)]
    pub filter: Option<String>,
    /// Only the privileged tier (with --filter: a quick rerun of one privileged test while
    /// working on it; the README's command runs every tier).
    #[arg(long, conflicts_with = "unprivileged_only")]
    pub privileged_only: bool,
    /// The VM tier alone (the full run ends with it): the smoke set inside qemu, on Debian 12's
    /// 6.1 kernel, on the machines named (x86_64, aarch64; both without a value). Builds the
    /// release first; caches the machines' files under target/vm/.
    #[arg(long, num_args = 0.., value_delimiter = ',', value_name = "ARCH")]
    #[arg(conflicts_with_all = ["unprivileged_only", "privileged_only", "filter"])]
    pub vm: Option<Vec<dist::Arch>>,
}

pub fn run(opts: &Options) -> anyhow::Result<()> {
    if !opts.no_setup {
        setup::run(&setup::Options { check: false })?;
    }
    disk_note("setup");
    let built = build::run()?;
    disk_note("the build");
    let root = root();
    if let Some(arches) = &opts.vm {
        let arches = if arches.is_empty() { VM_MACHINES.to_vec() } else { arches.clone() };
        let release = dist::run(&dist::Options { arch: arches.clone() })?;
        return vm::run(&built, &release, &arches);
    }
    if !opts.privileged_only {
        unprivileged(&root, &built)?;
        // Only that tier reads them.
        ci_prune(&root, &["target/stable-only", "target/no-dbpage"]);
        disk_note("the unprivileged tier");
    }
    // The release, for both architectures: this is also where the tracer and its eBPF object are
    // compiled for arm64. A quick privileged-only rerun checks the release already there.
    let release = if opts.privileged_only {
        Some(root.join("target/dist"))
            .filter(|d| d.join("SHA256SUMS").is_file())
            .ok_or_else(|| "no target/dist yet: run `cargo xtask dist`".to_owned())
    } else {
        let dir = dist::run(&dist::Options { arch: Vec::new() })?;
        disk_note("the release");
        Ok(dir)
    };
    if opts.unprivileged_only {
        return Ok(());
    }
    privileged_tier(opts, &root, &built, &release)?;
    // The tests' outputs, kept for a look at a failure; this one passed.
    ci_prune(&root, &["target/privileged-tests"]);
    disk_note("the privileged tier");
    // Last, the smoke set inside the VMs (a quick privileged-only rerun leaves it out).
    if !opts.privileged_only {
        let release = release.map_err(anyhow::Error::msg)?;
        vm::run(&built, &release, &VM_MACHINES)?;
        disk_note("the VM tier");
    }
    Ok(())
}

/// On CI (`CI` set: a clone built once, on a small disk), a passed tier's own build folders and
/// outputs go, so the VM tier at the end has room. A workstation keeps them for quick reruns.
fn ci_prune(root: &Path, paths: &[&str]) {
    if std::env::var_os("CI").is_none() {
        return;
    }
    for p in paths {
        let _ = std::fs::remove_dir_all(root.join(p));
    }
}

/// The machines the VM tier boots.
const VM_MACHINES: [dist::Arch; 2] = [dist::Arch::X86_64, dist::Arch::Aarch64];

/// Everything that needs no root: the stable-only tier, the arm64 check, the markers' tests.
fn unprivileged(root: &Path, built: &build::Built) -> anyhow::Result<()> {
    stable_tier::run(root)?;
    let real_torch = torch_env::python();
    if let Err(why) = &real_torch {
        eprintln!("xtask test: WARNING: the real PyTorch tests will skip: {why}");
    }
    eprintln!("xtask test: markers package unit tests");
    // With the torch venv's python when there is one, so the torch hooks are tested too; the
    // markers are built for the system python, so the venv gets its own copy.
    let unittests = |python: &Path, markers: &Path| {
        sh(Command::new(python).current_dir(root).env("PYTHONPATH", markers).args([
            "-m",
            "unittest",
            "discover",
            "-s",
            "markers/tests",
        ]))
    };
    unittests(Path::new("python3"), &built.markers)?;
    if let Ok(python) = &real_torch {
        unittests(python, &markers_for_torch(root, python)?)?;
    }
    Ok(())
}

/// The markers package installed anew for the torch venv's python (the system python's build
/// does not fit it); the real-PyTorch tests put it on their PYTHONPATH.
fn markers_for_torch(root: &Path, python: &Path) -> anyhow::Result<std::path::PathBuf> {
    let markers = root.join("target/markers-torch");
    let _ = std::fs::remove_dir_all(&markers);
    sh(Command::new(python)
        .args(["-m", "pip", "install", "--quiet", "--no-build-isolation", "--no-deps", "--target"])
        .arg(&markers)
        .arg(root.join("markers")))?;
    Ok(markers)
}

/// What the privileged tests find the stand-ins and workloads by (tests/integration's
/// `environment.rs`), but the binary and the scratch folder; the VM tier hands the same over.
pub fn standin_env(root: &Path, built: &build::Built) -> Vec<(&'static str, PathBuf)> {
    vec![
        ("MEMSCOPE_PRIVILEGED_TIER", PathBuf::from("1")),
        ("MEMSCOPE_ASCEND_HOME", built.ascend_home.clone()),
        ("MEMSCOPE_LATE_LIB", built.late_lib.clone()),
        ("MEMSCOPE_WORKLOAD", root.join("tests/workloads/standin_train.py")),
        ("MEMSCOPE_TAGS_WORKLOAD", root.join("tests/workloads/standin_tags.py")),
        ("MEMSCOPE_MARKERS", built.markers.clone()),
        ("MEMSCOPE_TORCH_WITH_DEBUG", built.torch.with_debug.clone()),
        ("MEMSCOPE_TORCH_WITHOUT_DEBUG", built.torch.without_debug.clone()),
        ("MEMSCOPE_TORCH_DEBUG_STORE", built.torch.debug_store.clone()),
        ("MEMSCOPE_KERNEL_HOOK", built.torch.kernel_hook.clone()),
        ("MEMSCOPE_ATB_LIB", built.atb.clone()),
        ("MEMSCOPE_CUDA_LIB", built.cuda.clone()),
    ]
}

/// The privileged tier: the tracer's root-only unit tests, tests/integration as root, and the
/// sweep of every DB it wrote against Insight's rules.
fn privileged_tier(
    opts: &Options,
    root: &Path,
    built: &build::Built,
    release: &Result<PathBuf, String>,
) -> anyhow::Result<()> {
    // Installed (once) by the unprivileged part; found again here.
    let real_torch = torch_env::python();
    if let (Ok(python), true) = (&real_torch, opts.privileged_only) {
        markers_for_torch(root, python)?;
    }
    let real_torch_npu = wheel::torch_npu_library(wheel::Machine::X86_64);
    let real_torch_npu_arm = wheel::torch_npu_library(wheel::Machine::Aarch64);
    let real_torch_arm = wheel::torch_aarch64_libraries();
    for why in [&real_torch_npu, &real_torch_npu_arm, &real_torch_arm].into_iter().filter_map(|r| r.as_ref().err()) {
        eprintln!("xtask test: WARNING: a real torch_npu library test will skip: {why}");
    }
    eprintln!("xtask test: privileged tier (loads BPF, as root)");
    // Root-only unit tests of the tracer itself (perf uprobes with semaphores and cookies).
    // (Only those: the other ignored tests are benchmarks, run by hand.)
    sh(privileged("cargo").current_dir(root).args([
        "test",
        "-p",
        "memscope-user",
        "attach::perf_uprobe",
        "--",
        "--ignored",
    ]))?;
    let scratch = root.join("target/privileged-tests");
    // The sweep below checks the DBs written from here on (a filtered run leaves older ones).
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs().saturating_sub(1);
    let mut cmd = privileged("cargo");
    match &real_torch_npu {
        Ok(lib) => cmd.env("MEMSCOPE_REAL_TORCH_NPU", lib),
        Err(why) => cmd.env("MEMSCOPE_REAL_TORCH_NPU_MISSING", why),
    };
    match &real_torch_npu_arm {
        Ok(lib) => cmd.env("MEMSCOPE_REAL_TORCH_NPU_AARCH64", lib),
        Err(why) => cmd.env("MEMSCOPE_REAL_TORCH_NPU_AARCH64_MISSING", why),
    };
    match &real_torch_arm {
        Ok(dir) => cmd.env("MEMSCOPE_REAL_TORCH_AARCH64", dir),
        Err(why) => cmd.env("MEMSCOPE_REAL_TORCH_AARCH64_MISSING", why),
    };
    match release {
        Ok(dir) => cmd.env("MEMSCOPE_DIST", dir),
        Err(why) => cmd.env("MEMSCOPE_DIST_MISSING", why),
    };
    match &real_torch {
        Ok(python) => cmd
            .env("MEMSCOPE_REAL_TORCH_PYTHON", python)
            .env("MEMSCOPE_MARKERS_TORCH", root.join("target/markers-torch")),
        Err(why) => cmd.env("MEMSCOPE_REAL_TORCH_MISSING", why),
    };
    cmd.current_dir(root)
        .envs(standin_env(root, built))
        .env("MEMSCOPE_BIN", &built.binary)
        .env("MEMSCOPE_SCRATCH", &scratch);
    // Every test binary runs even after one fails: a CI log then names every failure at once.
    cmd.args(["test", "--no-fail-fast", "-p", "memscope-integration", "--"])
        // One at a time: the attach tests time their steps, and 2 cores are shared.
        .arg("--test-threads=1");
    if let Some(filter) = &opts.filter {
        cmd.arg(filter);
    }
    sh(&mut cmd)?;
    eprintln!("xtask test: every DB the privileged tier wrote, against MindStudio Insight's import rules");
    sh(privileged("cargo")
        .current_dir(root)
        .env("MEMSCOPE_SCRATCH", &scratch)
        .env("MEMSCOPE_SWEEP_SINCE", since.to_string())
        .args(["test", "-p", "memscope-integration", "--test", "insight", "--"])
        .args(["--ignored", "--exact", "every_db_the_privileged_tier_wrote_passes_insights_import_rules"]))?;
    if let Err(why) = &real_torch_npu {
        eprintln!("xtask test: passed, but the real torch_npu library test was SKIPPED: {why}");
    }
    if let Err(why) = &real_torch {
        eprintln!("xtask test: passed, but the real PyTorch tests were SKIPPED: {why}");
    }
    Ok(())
}
