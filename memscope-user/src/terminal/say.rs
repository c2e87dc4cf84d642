//! Lines for the person watching, on stderr, written so that stderr can never end a trace.
//!
//! `eprintln!` panics when the write fails, and a trace's stderr is often a pipe whose reader
//! goes away first (`trace ... 2>&1 | head -1`, a log shipper that restarts): the tracer then
//! died with rc 101 before finishing its DBs. Rust ignores SIGPIPE, so such a write returns
//! EPIPE; these helpers drop that error (and any other: there is nobody left to tell).

use std::fmt;
use std::io::Write as _;
use std::sync::Mutex;

use indicatif::ProgressBar;

/// The live status area while one is drawn ([`super::status`]): every other stderr line is
/// written above it, so it is kept here, where those lines are written.
pub(crate) static AREA: Mutex<Option<ProgressBar>> = Mutex::new(None);

/// Runs `write` (a line for stderr) with the status area, if any, cleared meanwhile.
fn suspended(write: impl FnOnce()) {
    let area = AREA.lock().ok().and_then(|a| a.clone());
    match area {
        Some(bar) => bar.suspend(write),
        None => write(),
    }
}

/// Writes `args` to stderr as they are, ignoring write errors; above `trace`'s status area
/// when one is drawn.
pub fn text(args: fmt::Arguments<'_>) {
    suspended(|| {
        let mut err = std::io::stderr().lock();
        let _ = err.write_fmt(args);
        let _ = err.flush();
    });
}

/// `eprintln!` that ignores write errors.
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::terminal::say::text(format_args!("{}\n", format_args!($($arg)*)))
    };
}

pub(crate) use say;

/// A `memscope-bpf: ` line, unless `--quiet`.
pub fn note(quiet: bool, msg: impl AsRef<str>) {
    if !quiet {
        say!("memscope-bpf: {}", msg.as_ref());
    }
}
