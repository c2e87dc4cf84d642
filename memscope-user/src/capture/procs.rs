//! Which traced processes are still running, so that a trace that follows children ends when the
//! last traced process exits, not when the first one (the target) does.
//!
//! The kernel's traced set (the `TRACED` map: grown by the fork tracepoint in the forking task,
//! shrunk by the exit tracepoint in the exiting one) is the authority. It is complete the moment
//! the target's exit is seen, even while the ring still holds the fork records, or lost them.
//! Its keys are tgids and thread ids, told apart by `/proc/ID/status`; a pidfd says whether a
//! process has exited, also while it is a zombie that nobody reaps (an orphan whose new parent is
//! slow, or the tracer itself as PID 1) and not while only its leader thread has gone.

use std::collections::BTreeSet;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

/// How often the traced set is looked at once the target has exited: each look reads the status
/// of every traced process and thread.
const CHECK_EVERY: Duration = Duration::from_millis(100);

/// What a pid in the traced set is now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Liveness {
    /// A process (thread-group leader) that has not exited.
    Running,
    /// Gone, or a zombie.
    Exited,
    /// A thread of some process: its process is what counts.
    Thread,
}

/// The `Tgid:` and the first letter of `State:` in `/proc/PID/status`, if it can be read.
fn status(pid: u32) -> Option<(u32, char)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| text.lines().find_map(|l| l.strip_prefix(name)).map(str::trim);
    Some((field("Tgid:")?.parse().ok()?, field("State:")?.chars().next()?))
}

/// Whether `pid` is a running process, an exited one, or a thread id.
pub fn liveness(pid: u32) -> Liveness {
    // /proc/TID/status exists for threads too (only the listing hides them).
    let Some((tgid, state)) = status(pid) else { return Liveness::Exited };
    if tgid != pid {
        return Liveness::Thread;
    }
    let Ok(raw) = libc::pid_t::try_from(pid) else { return Liveness::Exited };
    // SAFETY: plain syscall; returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, raw, 0) };
    if fd < 0 {
        // No pidfd (kernel < 5.3, a seccomp filter): the state letter says zombie or dead, but
        // also for a leader thread gone before the rest of its process.
        let gone = std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) || matches!(state, 'Z' | 'X');
        return if gone { Liveness::Exited } else { Liveness::Running };
    }
    // SAFETY: a fresh descriptor we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let mut poll = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd, no wait. A pidfd polls readable once its whole process exited.
    let ready = unsafe { libc::poll(&mut poll, 1, 0) };
    if ready > 0 {
        Liveness::Exited
    } else {
        Liveness::Running
    }
}

/// Whether `pid` is a process (not a thread) that has not exited: what the recorder asks of
/// each pid a fork record names.
pub fn is_running_process(pid: u32) -> bool {
    liveness(pid) == Liveness::Running
}

/// The running processes among `ids` (tgids and thread ids mixed), `except` left out, in order.
pub fn running(ids: impl IntoIterator<Item = u32>, except: u32) -> Vec<u32> {
    let ids: BTreeSet<u32> = ids.into_iter().filter(|id| *id != except).collect();
    ids.into_iter().filter(|id| liveness(*id) == Liveness::Running).collect()
}

/// `pid 7` / `pids 7, 9 and 11` / `pids 7, 9, 11, 13, 15 and 3 more`.
pub fn describe(pids: &[u32]) -> String {
    const SHOWN: usize = 5;
    let shown: Vec<String> = pids.iter().take(SHOWN).map(u32::to_string).collect();
    match pids.len() {
        0 => "no process".to_owned(),
        1 => format!("pid {}", shown[0]),
        n if n <= SHOWN => format!("pids {} and {}", shown[..n - 1].join(", "), shown[n - 1]),
        n => format!("pids {} and {} more", shown.join(", "), n - SHOWN),
    }
}

/// The end of a trace that follows children: first the target exits, then, once no traced
/// process is left, the trace stops.
#[derive(Debug, Default)]
pub struct Ending {
    /// How the target ended, once it has.
    target_exit: Option<String>,
    /// Every child that was still running after the target's exit.
    awaited: BTreeSet<u32>,
    last_check: Option<Instant>,
}

impl Ending {
    /// Whether the target has exited.
    pub fn target_gone(&self) -> bool {
        self.target_exit.is_some()
    }

    /// Whether the traced set should be looked at now: after the target's exit, at most every
    /// [`CHECK_EVERY`].
    pub fn check_due(&mut self) -> bool {
        if !self.target_gone() || self.last_check.is_some_and(|t| t.elapsed() < CHECK_EVERY) {
            return false;
        }
        self.last_check = Some(Instant::now());
        true
    }

    /// The target exited (`reason`), leaving `running` (its traced descendants still alive).
    /// `Ok(stop reason)` when nothing is left to trace, else `Err(note)`: what the trace now
    /// waits for, to tell the user.
    pub fn target_exited(&mut self, reason: String, running: &[u32]) -> Result<String, String> {
        if running.is_empty() {
            return Ok(reason);
        }
        let note = format!(
            "{reason}; still tracing {} ({}) until {}",
            if running.len() == 1 {
                "1 child process".to_owned()
            } else {
                format!("{} child processes", running.len())
            },
            describe(running),
            if running.len() == 1 { "it exits" } else { "they exit" },
        );
        self.awaited.extend(running);
        self.target_exit = Some(reason);
        Err(note)
    }

    /// After the target's exit, with the traced processes `running` now: the stop reason once
    /// none is left.
    pub fn check(&mut self, running: &[u32]) -> Option<String> {
        let reason = self.target_exit.as_ref()?;
        self.awaited.extend(running);
        if !running.is_empty() {
            return None;
        }
        let awaited: Vec<u32> = self.awaited.iter().copied().collect();
        Some(format!("{reason}, then the last of its traced children ({})", describe(&awaited)))
    }
}

#[cfg(test)]
mod tests {
    use std::process::{Command, Stdio};

    use super::*;

    fn sleeper() -> std::process::Child {
        Command::new("sleep").arg("30").stdin(Stdio::null()).spawn().expect("spawn sleep")
    }

    #[test]
    fn a_running_child_then_its_zombie_then_nothing() {
        let mut child = sleeper();
        let pid = child.id();
        assert_eq!(liveness(pid), Liveness::Running);
        child.kill().unwrap();
        // Not reaped yet: a zombie, which kill(pid, 0) would call alive.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while liveness(pid) == Liveness::Running {
            assert!(std::time::Instant::now() < deadline, "pid {pid} still running after SIGKILL");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(liveness(pid), Liveness::Exited, "a zombie has exited");
        child.wait().unwrap();
        assert_eq!(liveness(pid), Liveness::Exited);
    }

    #[test]
    fn a_thread_id_is_not_a_process() {
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            // SAFETY: no arguments.
            tx.send(unsafe { libc::gettid() } as u32).unwrap();
            let _ = done_rx.recv();
        });
        let tid = rx.recv().unwrap();
        assert_eq!(liveness(tid), Liveness::Thread);
        assert_eq!(liveness(std::process::id()), Liveness::Running);
        // Our own threads are never "running processes", and `except` leaves the target out.
        assert_eq!(running([tid, std::process::id()], std::process::id()), Vec::<u32>::new());
        done_tx.send(()).unwrap();
        thread.join().unwrap();
    }

    #[test]
    fn running_keeps_live_processes_once_each_in_order() {
        let (mut a, mut b) = (sleeper(), sleeper());
        let (pa, pb) = (a.id(), b.id());
        b.kill().unwrap();
        b.wait().unwrap();
        assert_eq!(running([pb, pa, pa], 0), vec![pa]);
        a.kill().unwrap();
        a.wait().unwrap();
        assert!(running([pa, pb], 0).is_empty());
    }

    #[test]
    fn the_trace_ends_with_the_last_child_not_the_target() {
        let mut ending = Ending::default();
        assert!(!ending.target_gone());
        assert!(!ending.check_due(), "nothing to look at while the target runs");
        assert_eq!(ending.check(&[]), None, "nothing ends before the target does");
        let note = ending.target_exited("target exited with status 0".into(), &[41]).unwrap_err();
        assert_eq!(note, "target exited with status 0; still tracing 1 child process (pid 41) until it exits");
        assert!(ending.target_gone());
        assert!(ending.check_due(), "the first look comes at once");
        assert!(!ending.check_due(), "the next one waits");
        assert_eq!(ending.check(&[41, 42]), None);
        assert_eq!(
            ending.check(&[]).as_deref(),
            Some("target exited with status 0, then the last of its traced children (pids 41 and 42)")
        );
    }

    #[test]
    fn a_target_without_children_ends_the_trace_at_once() {
        let mut ending = Ending::default();
        assert_eq!(ending.target_exited("target exited".into(), &[]).as_deref(), Ok("target exited"));
    }

    #[test]
    fn descriptions_name_a_few_pids() {
        assert_eq!(describe(&[7]), "pid 7");
        assert_eq!(describe(&[7, 9, 11]), "pids 7, 9 and 11");
        assert_eq!(describe(&[1, 2, 3, 4, 5, 6, 7, 8]), "pids 1, 2, 3, 4, 5 and 3 more");
    }
}
