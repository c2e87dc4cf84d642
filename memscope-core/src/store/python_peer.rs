//! Python's SQLite as another process on a test's DB: the independent peer the store's tests
//! hold a DB open, read it or checkpoint it with, as Insight or a user's `sqlite3` would.

use std::io::BufRead as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};

/// Runs `script` with the DB's path as its argument, and returns once it has printed its first
/// line (it says it has the DB open), with that line; `None` (and a note) without a python3.
pub(crate) fn spawn(script: &str, db: &Path) -> Option<(Child, String)> {
    let Ok(mut child) =
        Command::new("python3").args(["-c", script]).arg(db).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn()
    else {
        eprintln!("skipped: no python3 to open the DB from another process");
        return None;
    };
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line).expect("python3's first line");
    Some((child, line.trim().to_owned()))
}
