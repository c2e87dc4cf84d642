//! Where a privileged test runs: the paths `cargo xtask test` hands over in environment
//! variables, the per-test scratch folder, the user a run's files must belong to, and the skips
//! (no real PyTorch), each said out loud rather than passed silently.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// Paths handed over by `cargo xtask test`.
pub struct TestEnv {
    pub bin: PathBuf,
    pub ascend_home: PathBuf,
    pub libascendcl: PathBuf,
    pub late_lib: PathBuf,
    pub workload: PathBuf,
    pub scratch: PathBuf,
}
/// A path `cargo xtask test` handed over.
pub fn var(name: &str) -> PathBuf {
    PathBuf::from(
        std::env::var(name)
            .unwrap_or_else(|_| panic!("{name} is not set; run the privileged tier with `cargo xtask test`")),
    )
}
/// The environment, or a panic that says how to run these tests.
pub fn env(test: &str) -> TestEnv {
    assert_eq!(
        std::env::var("MEMSCOPE_PRIVILEGED_TIER").as_deref(),
        Ok("1"),
        "privileged tests load BPF and need the stand-ins: run them with `cargo xtask test`"
    );
    // SAFETY: no arguments.
    assert_eq!(unsafe { libc::geteuid() }, 0, "the privileged tier must run as root");
    let scratch = var("MEMSCOPE_SCRATCH").join(test);
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).unwrap();
    TestEnv {
        bin: var("MEMSCOPE_BIN"),
        ascend_home: var("MEMSCOPE_ASCEND_HOME"),
        libascendcl: var("MEMSCOPE_ASCEND_HOME").join("lib64/libascendcl.so"),
        late_lib: var("MEMSCOPE_LATE_LIB"),
        workload: var("MEMSCOPE_WORKLOAD"),
        scratch,
    }
}
pub fn wall_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64
}
/// The user and group that should own a run's files: `SUDO_UID`/`SUDO_GID` when the tests (and
/// so the tracers they start) run under sudo, else the tests' own.
pub fn expected_owner() -> (u32, u32) {
    let id = |name| std::env::var(name).ok().and_then(|v| v.parse::<u32>().ok());
    match (id("SUDO_UID"), id("SUDO_GID")) {
        (Some(uid), Some(gid)) => (uid, gid),
        // SAFETY: no arguments.
        _ => unsafe { (libc::geteuid(), libc::getegid()) },
    }
}
/// The torch venv's python and the markers package built for it, or None after saying why.
pub fn real_torch() -> Option<(PathBuf, PathBuf)> {
    match (std::env::var_os("MEMSCOPE_REAL_TORCH_PYTHON"), std::env::var_os("MEMSCOPE_MARKERS_TORCH")) {
        (Some(python), Some(markers)) if Path::new(&python).is_file() => {
            Some((PathBuf::from(python), PathBuf::from(markers)))
        }
        _ => {
            let why = std::env::var("MEMSCOPE_REAL_TORCH_MISSING").unwrap_or_else(|_| "not set up".into());
            eprintln!("SKIPPED: no real PyTorch ({why}); `cargo xtask test` prepares target/torch-venv");
            None
        }
    }
}
