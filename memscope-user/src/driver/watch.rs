//! The helper process and the thread that asks it: one `read` line every period, one reading
//! back, handed to the session over a channel. The session never waits on the helper (a vendor
//! library that hangs holds only this thread); the thread ends when the helper's output does,
//! which killing it at the stop makes happen.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::time::Duration;

use memscope_driver::{protocol::READ, Hello, Message, Reading};

use super::find::{credentials, Credentials, Library};

/// Makes `cmd` run as `who` (groups, then group, then user), unless that is root already.
fn run_as(cmd: &mut Command, who: Credentials) {
    use std::os::unix::process::CommandExt as _;
    if who.uid == 0 {
        return;
    }
    let Credentials { uid, gid, groups } = who;
    // SAFETY: between fork and exec only async-signal-safe calls are made (setgroups, setgid,
    // setuid), on data prepared before the fork; nothing is allocated there.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setgroups(groups.len(), groups.as_ptr()) != 0 || libc::setgid(gid) != 0 || libc::setuid(uid) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// What the helper said.
#[derive(Debug)]
pub enum Said {
    Hello(Hello),
    Reading(Reading),
    /// It could not load the library, or stopped answering: no more readings.
    Gone(String),
}

pub struct Watch {
    child: Child,
    rx: Receiver<Said>,
}

/// Hands on the helper's next line; false when nothing more will come.
fn relay(lines: &mut impl Iterator<Item = std::io::Result<String>>, tx: &Sender<Said>) -> bool {
    let said = match lines.next() {
        Some(Ok(line)) => match Message::parse(&line) {
            Ok(Message::Hello(h)) => Said::Hello(h),
            Ok(Message::Reading(r)) => Said::Reading(r),
            Ok(Message::Error(e)) => Said::Gone(e),
            Err(e) => Said::Gone(format!("the helper answered `{line}`: {e}")),
        },
        Some(Err(e)) => Said::Gone(format!("reading the helper's answer: {e}")),
        None => Said::Gone("the helper exited".into()),
    };
    let go_on = !matches!(said, Said::Gone(_));
    tx.send(said).is_ok() && go_on
}

/// Asks for a reading every `every` until the helper's output ends or the session is gone.
fn ask(mut stdin: ChildStdin, out: impl BufRead, tx: &Sender<Said>, every: Duration) {
    let mut lines = out.lines();
    if !relay(&mut lines, tx) {
        return;
    }
    loop {
        if writeln!(stdin, "{READ}").and_then(|()| stdin.flush()).is_err() {
            let _ = tx.send(Said::Gone("the helper exited".into()));
            return;
        }
        if !relay(&mut lines, tx) {
            return;
        }
        std::thread::sleep(every);
    }
}

impl Watch {
    /// Starts `helper` on `library`, as the user of the job that chose it (see
    /// [`Library::chosen_by`]); the hello, or why it failed, is the first thing said.
    pub fn start(helper: &Path, library: &Library, every: Duration) -> std::io::Result<Self> {
        let mut cmd = Command::new(helper);
        cmd.arg(library.kind.name())
            .arg(&library.path)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        if let Some(pid) = library.chosen_by {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
            let who = credentials(&status)
                .ok_or_else(|| std::io::Error::other(format!("/proc/{pid}/status names no user")))?;
            run_as(&mut cmd, who);
        }
        let mut child = cmd.spawn()?;
        let (stdin, stdout) = (child.stdin.take().expect("piped"), child.stdout.take().expect("piped"));
        let (tx, rx) = channel();
        std::thread::Builder::new()
            .name("memscope-driver".into())
            .spawn(move || ask(stdin, BufReader::new(stdout), &tx, every))?;
        Ok(Self { child, rx })
    }

    /// What it said since the last look.
    pub fn said(&self) -> Vec<Said> {
        self.rx.try_iter().collect()
    }

    /// Waits up to `wait` for the next thing it says.
    pub fn next_within(&self, wait: Duration) -> Option<Said> {
        self.rx.recv_timeout(wait).ok()
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
