//! Shared helpers: the workspace root, running commands loudly, privilege.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context as _};

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace").to_owned()
}

pub fn is_root() -> bool {
    // SAFETY: no arguments, cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Runs a command, echoing it, and fails with its exit status.
pub fn run(cmd: &mut Command) -> anyhow::Result<()> {
    eprintln!("xtask: $ {}", show(cmd));
    let status = cmd.status().with_context(|| format!("cannot start `{}`", show(cmd)))?;
    if !status.success() {
        bail!("`{}` failed: {status}", show(cmd));
    }
    Ok(())
}

/// Runs a command quietly and returns whether it succeeded.
pub fn ok(cmd: &mut Command) -> bool {
    cmd.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).status().is_ok_and(|s| s.success())
}

/// Runs a command and returns its stdout.
pub fn output(cmd: &mut Command) -> Option<String> {
    let out = cmd.stderr(std::process::Stdio::null()).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

pub fn show(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// A command that runs as root: directly when we are root, else through sudo (keeping PATH so
/// cargo, rustup and bpf-linker stay reachable).
pub fn privileged(program: &str) -> Command {
    if is_root() {
        Command::new(program)
    } else {
        let mut cmd = Command::new("sudo");
        cmd.arg("--preserve-env").arg(format!("PATH={}", std::env::var("PATH").unwrap_or_default())).arg(program);
        cmd
    }
}

/// One line on the disk: what target/ holds and what is left where it lives, so a log that ends
/// in "No space left on device" shows which stage ate it (CI's disk is smaller than a
/// workstation's).
pub fn disk_note(stage: &str) {
    let target = root().join("target");
    let free = {
        let path = std::ffi::CString::new(target.as_os_str().as_encoded_bytes()).unwrap_or_default();
        // SAFETY: statvfs writes only into the zeroed struct it is given; the path is NUL-terminated.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        (unsafe { libc::statvfs(path.as_ptr(), &raw mut st) } == 0).then(|| st.f_bavail * st.f_frsize)
    };
    let used = output(Command::new("du").args(["-sxb"]).arg(&target))
        .and_then(|s| s.split_whitespace().next().and_then(|n| n.parse::<u64>().ok()));
    let gb = |b: Option<u64>| b.map_or("?".to_owned(), |b| format!("{:.1}", b as f64 / 1e9));
    eprintln!("xtask test: disk after {stage}: target/ holds {} GB, {} GB free", gb(used), gb(free));
}
