//! Progress of the offline verbs' passes over big DBs (`analyze`, `advise`, `compare`,
//! `export`): a bar on the terminal with rows per second and the time left, drawn by indicatif
//! once a pass has run for a second (a small DB shows nothing), and nothing when stderr is not a
//! terminal (indicatif hides itself there). Rows are counted by rowid, which the reader goes
//! through in order.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressState, ProgressStyle};
use memscope_core::analysis::db::{DumpDb, Progress};

/// A pass shows its bar once it has run this long.
const SHOW_AFTER: Duration = Duration::from_secs(1);

struct Bar {
    label: String,
    /// The bar of the pass running, and when that pass started.
    pass: Mutex<Option<(ProgressBar, Instant)>>,
}

impl Progress for Bar {
    fn start(&self, last_rowid: u64) {
        let bar = ProgressBar::with_draw_target(Some(last_rowid), ProgressDrawTarget::hidden());
        let style = ProgressStyle::with_template("{msg} [{bar:30}] {percent:>3}% {rate} rows/s, {eta} left")
            .expect("a valid template")
            .with_key("rate", |state: &ProgressState, w: &mut dyn std::fmt::Write| {
                let _ = write!(w, "{:.0}", state.per_sec());
            })
            .progress_chars("=> ");
        bar.set_style(style);
        bar.set_message(self.label.clone());
        if let Ok(mut pass) = self.pass.lock() {
            *pass = Some((bar, Instant::now()));
        }
    }

    fn at(&self, rowid: u64) {
        let Ok(pass) = self.pass.lock() else { return };
        let Some((bar, started)) = pass.as_ref() else { return };
        if bar.is_hidden() && started.elapsed() >= SHOW_AFTER {
            bar.set_draw_target(ProgressDrawTarget::stderr());
        }
        bar.set_position(rowid);
    }

    fn finish(&self) {
        if let Some((bar, _)) = self.pass.lock().ok().and_then(|mut p| p.take()) {
            bar.finish_and_clear();
        }
    }
}

/// `db`, showing the progress of its passes under `label` (the verb and the file).
pub fn watched(db: DumpDb, label: String) -> DumpDb {
    db.with_progress(Arc::new(Bar { label, pass: Mutex::new(None) }))
}

/// The label of a DB's bar: the verb and the file's device folder and name.
pub fn label(verb: &str, path: &std::path::Path) -> String {
    let device = path.ancestors().nth(2).and_then(|d| d.file_name()).map(|d| d.to_string_lossy().into_owned());
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    match device {
        Some(d) if d.starts_with("device_") => format!("{verb} {d}/{name}"),
        _ => format!("{verb} {name}"),
    }
}

/// A bar for a pass over a file's bytes (`import`, and the verbs importing a CSV), shown as
/// [`watched`]'s: once it has run for a second, on a terminal only. Called with the bytes read
/// and the file's size.
pub fn bytes(label: String) -> impl FnMut(u64, u64) {
    let started = Instant::now();
    let mut bar: Option<ProgressBar> = None;
    move |done, total| {
        let bar = bar.get_or_insert_with(|| {
            let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::hidden());
            if let Ok(style) =
                ProgressStyle::with_template("{msg} [{bar:30}] {percent:>3}% {bytes_per_sec}, {eta} left")
            {
                bar.set_style(style.progress_chars("=> "));
            }
            bar.set_message(label.clone());
            bar
        });
        if bar.is_hidden() && started.elapsed() >= SHOW_AFTER {
            bar.set_draw_target(ProgressDrawTarget::stderr());
        }
        bar.set_position(done);
        if done >= total {
            bar.finish_and_clear();
        }
    }
}
