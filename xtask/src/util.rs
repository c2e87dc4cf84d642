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
