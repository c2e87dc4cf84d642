//! Launch mode: start the program stopped before its first instruction, so every probe is live
//! before it runs.
//!
//! The child is forked before the tracer starts any thread and waits on a pipe; the parent
//! attaches, adds the child to the traced set, then writes one byte and the child execs. If the
//! parent fails (or dies) before that, the pipe closes and the child exits without ever running
//! the program. Exec errors come back through a second, close-on-exec pipe.

use std::ffi::{CString, OsStr, OsString};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use thiserror::Error;

#[derive(Debug, Error)]
pub enum LaunchError {
    #[error("cannot find `{0}` in PATH; give a path to the program")]
    NotFound(String),
    #[error("the command contains a NUL byte")]
    Nul,
    #[error("cannot start the program: {0}")]
    Os(std::io::Error),
    #[error("cannot execute `{program}` (give a program file that you may execute)")]
    Exec { program: String, source: std::io::Error },
}

/// A launched program, held before exec until [`Launched::release`].
pub struct Launched {
    pub pid: u32,
    gate: Option<OwnedFd>,
    exec_errors: OwnedFd,
    program: String,
}

/// The program a command names: a path as given, else the first executable of that name in PATH.
pub(crate) fn resolve(program: &OsStr) -> Result<PathBuf, LaunchError> {
    let as_path = Path::new(program);
    if program.as_bytes().contains(&b'/') {
        return Ok(as_path.to_owned());
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| {
            std::fs::metadata(candidate)
                .is_ok_and(|m| m.is_file() && std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o111 != 0)
        })
        .ok_or_else(|| LaunchError::NotFound(program.to_string_lossy().into_owned()))
}

fn pipe() -> Result<(OwnedFd, OwnedFd), LaunchError> {
    let mut fds = [0; 2];
    // SAFETY: valid out array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(LaunchError::Os(std::io::Error::last_os_error()));
    }
    // SAFETY: fresh descriptors we own.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Forks `command`, held before exec. Must run before the tracer starts threads: only
/// async-signal-safe calls happen in the child, and everything it needs is prepared here.
pub fn spawn_held(command: &[OsString]) -> Result<Launched, LaunchError> {
    let program = resolve(&command[0])?;
    let c_program = CString::new(program.as_os_str().as_bytes()).map_err(|_| LaunchError::Nul)?;
    let c_args: Vec<CString> =
        command.iter().map(|a| CString::new(a.as_bytes()).map_err(|_| LaunchError::Nul)).collect::<Result<_, _>>()?;
    let mut argv: Vec<*const libc::c_char> = c_args.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    let (gate_r, gate_w) = pipe()?;
    let (err_r, err_w) = pipe()?;

    // SAFETY: the child only calls async-signal-safe functions (read, write, close, execv,
    // _exit) on data prepared before the fork.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(LaunchError::Os(std::io::Error::last_os_error()));
    }
    if pid == 0 {
        // SAFETY: in the forked child, only the async-signal-safe calls named above, on
        // descriptors and buffers made before the fork.
        unsafe {
            libc::close(gate_w.as_raw_fd());
            libc::close(err_r.as_raw_fd());
            let mut byte = 0u8;
            let n = libc::read(gate_r.as_raw_fd(), (&mut byte as *mut u8).cast(), 1);
            if n != 1 {
                // The tracer gave up before the probes were live: never run untraced.
                libc::_exit(126);
            }
            libc::close(gate_r.as_raw_fd());
            libc::execv(c_program.as_ptr(), argv.as_ptr());
            let errno = *libc::__errno_location();
            libc::write(err_w.as_raw_fd(), (&errno as *const i32).cast(), 4);
            libc::_exit(127);
        }
    }
    drop(gate_r);
    drop(err_w);
    Ok(Launched { pid: pid as u32, gate: Some(gate_w), exec_errors: err_r, program: program.display().to_string() })
}

impl Launched {
    /// Lets the program run, and reports whether it could be executed.
    pub fn release(&mut self) -> Result<(), LaunchError> {
        let Some(gate) = self.gate.take() else { return Ok(()) };
        let byte = 1u8;
        // SAFETY: valid fd and buffer.
        unsafe { libc::write(gate.as_raw_fd(), (&byte as *const u8).cast(), 1) };
        drop(gate);
        let mut errno = 0i32;
        // SAFETY: valid fd and buffer. EOF (0 bytes) means exec succeeded and closed the pipe.
        let n = unsafe { libc::read(self.exec_errors.as_raw_fd(), (&mut errno as *mut i32).cast(), 4) };
        if n == 4 {
            return Err(LaunchError::Exec {
                program: self.program.clone(),
                source: std::io::Error::from_raw_os_error(errno),
            });
        }
        Ok(())
    }
}

/// Waits for a child and returns its exit status as a shell would show it.
pub fn wait(pid: u32) -> std::io::Result<i32> {
    let mut status = 0;
    loop {
        // SAFETY: valid out pointer.
        let rc = unsafe { libc::waitpid(pid as i32, &mut status, 0) };
        if rc == pid as i32 {
            break;
        }
        let err = std::io::Error::last_os_error();
        if err.kind() != std::io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
    Ok(if libc::WIFEXITED(status) { libc::WEXITSTATUS(status) } else { 128 + libc::WTERMSIG(status) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_child_runs_only_after_release() {
        let marker = std::env::temp_dir().join(format!("memscope-launch-{}", std::process::id()));
        let _ = std::fs::remove_file(&marker);
        let cmd: Vec<OsString> = vec!["sh".into(), "-c".into(), format!("touch {}", marker.display()).into()];
        let mut child = spawn_held(&cmd).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(!marker.exists(), "the program ran before release");
        child.release().unwrap();
        assert_eq!(wait(child.pid).unwrap(), 0);
        assert!(marker.exists());
        std::fs::remove_file(&marker).unwrap();
    }

    #[test]
    fn dropped_gate_means_the_program_never_runs() {
        let marker = std::env::temp_dir().join(format!("memscope-launch-drop-{}", std::process::id()));
        let cmd: Vec<OsString> = vec!["sh".into(), "-c".into(), format!("touch {}", marker.display()).into()];
        let child = spawn_held(&cmd).unwrap();
        let pid = child.pid;
        drop(child);
        assert_eq!(wait(pid).unwrap(), 126);
        assert!(!marker.exists());
    }

    #[test]
    fn missing_program_is_a_clear_error() {
        let err = spawn_held(&["memscope-no-such-program".into()]).err().unwrap();
        assert!(matches!(err, LaunchError::NotFound(_)), "{err}");
    }

    #[test]
    fn exec_failure_is_reported() {
        let mut child = spawn_held(&["/dev/null".into()]).unwrap();
        assert!(matches!(child.release(), Err(LaunchError::Exec { .. })));
        assert_eq!(wait(child.pid).unwrap(), 127);
    }
}
