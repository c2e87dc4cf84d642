//! The trace arguments of the offline verbs (`analyze`, `advise`, `compare`, `export`, `report`):
//! which traces they name (our DBs, msMemScope's DBs and CSVs, by content), which device each
//! holds, and `--device` as a user may write it. One place, so the verbs accept the same inputs
//! and say the same thing when a device is not among them; how a trace is opened (a CSV through
//! a temporary DB, msMemScope's DBs read-only unless `--write`, with what such a capture lacks
//! said once); and how the verbs that write a file write it (whole, or not at all).

use std::collections::HashSet;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::Context as _;
use memscope_core::analysis::db::{self, DbFile, DumpDb, Origin};

use crate::terminal::say::say;

/// The traces the inputs name (files, trace folders, folders of traces), each once, in the order
/// given; a CSV is imported into a temporary DB, whose path the entry then holds (`source` is the
/// CSV). Every input is resolved before any is analysed, so a typo in the last one fails first.
pub fn files(inputs: &[PathBuf]) -> anyhow::Result<Vec<DbFile>> {
    let mut files = Vec::new();
    let mut seen = HashSet::new();
    for input in inputs {
        for file in db::discover(input)? {
            let key = std::fs::canonicalize(&file.path).unwrap_or_else(|_| file.path.clone());
            if seen.insert(key) {
                files.push(file);
            }
        }
    }
    let mut out = Vec::new();
    for file in files {
        for part in super::imports::imported(file)? {
            out.extend(by_device(part)?);
        }
    }
    Ok(out)
}

/// A trace of no `device_<id>` folder holds the devices its rows name: one (its device from now
/// on), or several (msLeaks' early captures, all devices in one file), split into one per device.
fn by_device(mut file: DbFile) -> anyhow::Result<Vec<DbFile>> {
    if file.device.is_some() {
        return Ok(vec![file]);
    }
    let (devices, table) = {
        let db = DumpDb::open_read(&file.path).map_err(|e| shown_error(e, &file))?;
        (db.devices()?, db.table())
    };
    match devices.as_slice() {
        [] => Ok(vec![file]),
        [one] => {
            file.device = Some(one.clone());
            Ok(vec![file])
        }
        several => super::imports::split(&file, table, several),
    }
}

/// `--write`/`--no-write` of the verbs that store results in the DB they read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Store {
    /// Into our DBs; not into msMemScope's (said once).
    Default,
    Never,
    /// Also into msMemScope's DBs.
    Always,
}

impl Store {
    pub fn from_flags(write: bool, no_write: bool) -> Self {
        match (write, no_write) {
            (_, true) => Self::Never,
            (true, false) => Self::Always,
            (false, false) => Self::Default,
        }
    }
}

/// Opens `file` for `verb`, named as the user knows it, with its progress shown, saying once what
/// an msMemScope capture lacks. Returns whether results may be written into it.
pub fn open(file: &DbFile, verb: &str, store: Store) -> anyhow::Result<(DumpDb, bool)> {
    let read = DumpDb::open_read(&file.path).map_err(|e| shown_error(e, file))?;
    let origin = read.origin()?;
    let write = match (&origin, store) {
        (_, Store::Never) => false,
        _ if file.source.is_some() => {
            if store == Store::Always {
                anyhow::bail!(
                    "{}: results cannot be stored in a CSV or a memory snapshot; `memscope-bpf import {}` makes a DB of it, then run {verb} on that DB",
                    file.shown().display(),
                    file.shown().display()
                );
            }
            false
        }
        (Origin::MsMemScope, Store::Default) => {
            say!(
                "memscope-bpf: note: {} is msMemScope's DB: the results are printed, not stored in it \
                 (--write adds our ms_* tables to it, which Insight ignores)",
                file.shown().display()
            );
            false
        }
        _ => true,
    };
    say_lacks(&read, file)?;
    let db = if write { DumpDb::open(&file.path, true)? } else { read };
    let db = crate::terminal::progress::watched(db, crate::terminal::progress::label(verb, file.shown()));
    Ok((db.shown_as(file.shown()), write))
}

/// An error about a temporary DB, naming the CSV it came from instead.
fn shown_error(e: memscope_core::analysis::AnalysisError, file: &DbFile) -> anyhow::Error {
    match &file.source {
        Some(csv) => anyhow::Error::new(e).context(format!("reading the DB imported from {}", csv.display())),
        None => e.into(),
    }
}

/// Says, once per file and run, what msMemScope's data lacks that our traces hold
/// ([`DumpDb::capture_note`]).
fn say_lacks(db: &DumpDb, file: &DbFile) -> anyhow::Result<()> {
    static SAID: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
    if let Ok(mut said) = SAID.lock() {
        if said.contains(&file.shown().to_path_buf()) {
            return Ok(());
        }
        said.push(file.shown().to_path_buf());
    }
    if let Some(note) = db.capture_note()? {
        say!("memscope-bpf: note: {} is {note}", file.shown().display());
    }
    Ok(())
}

/// The device a DB holds: its `device_<id>` folder's, else the `Device Id`s of its rows in `db`
/// (comma-joined; `?` when it has none).
pub fn device_of(file: &DbFile, db: &DumpDb) -> anyhow::Result<String> {
    if let Some(d) = &file.device {
        return Ok(d.clone());
    }
    let devices = db.devices()?;
    Ok(if devices.is_empty() { "?".to_owned() } else { devices.join(",") })
}

/// [`device_of`] for a DB not opened yet: opened only when its folder names no device.
pub fn device_of_file(file: &DbFile) -> anyhow::Result<String> {
    match &file.device {
        Some(d) => Ok(d.clone()),
        None => device_of(file, &DumpDb::open_read(&file.path).map_err(|e| shown_error(e, file))?),
    }
}

/// The DBs of one input (a file or a folder) with the device each holds, only `want`'s when
/// given: an error names the devices there are when none is `want`, or says the input holds no
/// DB.
pub fn device_files(input: &Path, want: Option<&str>) -> anyhow::Result<Vec<(DbFile, String)>> {
    let (mut picked, mut found) = (Vec::new(), Vec::new());
    for file in files(&[input.to_owned()])? {
        let device = device_of_file(&file)?;
        found.push(device.clone());
        if want.is_none_or(|w| is_device(&device, w)) {
            picked.push((file, device));
        }
    }
    match (picked.len(), want) {
        (0, Some(w)) => Err(no_such_device(w, found)),
        (0, None) => Err(anyhow::anyhow!("{} holds no trace", input.display())),
        _ => Ok(picked),
    }
}

/// The DBs of the inputs as the ranks of distributed jobs, when they are: `explicit` (--ranks,
/// or more traces than two given), or an input holding several traces (a daemon's output
/// folder, a node's folders). `None` when they are one or two traces to view or compare. An
/// input's error names it by `names` (A, B), where the verb has names.
pub fn rank_files(
    inputs: &[PathBuf],
    names: &[&str],
    want: Option<&str>,
    explicit: bool,
) -> anyhow::Result<Option<Vec<(DbFile, String)>>> {
    if !explicit && inputs.len() == 2 && inputs.iter().all(|i| i.is_file()) {
        return Ok(None);
    }
    let mut files = Vec::new();
    let mut several = false;
    for (i, input) in inputs.iter().enumerate() {
        let found = match (device_files(input, want), names.get(i)) {
            (Err(e), Some(name)) => return Err(e.context(name.to_string())),
            (found, _) => found?,
        };
        several |= several_traces(&found);
        files.extend(found);
    }
    if !explicit && !several {
        return Ok(None);
    }
    files.sort_by(|(fa, da), (fb, db)| {
        (db::device_order(Some(da)), &fa.path).cmp(&(db::device_order(Some(db)), &fb.path))
    });
    files.dedup_by(|a, b| a.0.path == b.0.path);
    Ok(Some(files))
}

/// Whether one input's DBs are several traces: of more than one trace folder (the folder above
/// `device_<id>/dump/` or `dump/`), or more than one of a device.
fn several_traces(files: &[(DbFile, String)]) -> bool {
    let trace = |p: &Path| -> PathBuf {
        let dump = p.parent().filter(|d| d.file_name().is_some_and(|n| n == "dump"));
        let above = dump.and_then(Path::parent);
        let run = match above {
            Some(d) if d.file_name().is_some_and(|n| n.to_string_lossy().starts_with("device_")) => d.parent(),
            other => other,
        };
        run.unwrap_or(p).to_owned()
    };
    // As the user named them: a CSV read through a temporary DB is where the CSV is.
    let runs: HashSet<PathBuf> = files.iter().map(|(f, _)| trace(f.shown())).collect();
    let devices: HashSet<&str> = files.iter().map(|(_, d)| d.as_str()).collect();
    runs.len() > 1 || devices.len() < files.len()
}

/// `--device` as written (`0`, `device_0`, `npu:0`, `cpu`) -> the id DB folders use.
pub fn normalise_device(device: &str) -> &str {
    let d = device.trim();
    d.strip_prefix("device_").or_else(|| d.strip_prefix("npu:")).unwrap_or(d)
}

/// Whether a DB holding `device` (possibly comma-joined) is the one asked for.
pub fn is_device(device: &str, want: &str) -> bool {
    device.split(',').any(|d| d == want)
}

/// The error for a `--device` no input has, listing those they have.
pub fn no_such_device(want: &str, mut found: Vec<String>) -> anyhow::Error {
    found.sort_by_key(|d| db::device_order(Some(d)));
    found.dedup();
    anyhow::anyhow!(
        "no DB of device {want} among the inputs (devices found: {}); pick one of those with --device",
        if found.is_empty() { "none".to_owned() } else { found.join(", ") }
    )
}

/// Writes `output` through a temporary file beside it, renamed over it only when complete.
///
/// What is not a regular file is never replaced: a device or a FIFO (`-o /dev/stdout`, `-o
/// /dev/null`) is written as a stream, a folder is an error, and a symlink is followed to the
/// file it names, unless another user planted it in a shared folder
/// ([`memscope_core::files::refuse_planted_symlink`]). The temporary is created exclusively under
/// a fresh name ([`memscope_core::files::create_temp_beside`]).
pub fn write_atomically<T>(
    output: &Path,
    write: impl FnOnce(&mut std::io::BufWriter<std::fs::File>) -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    let cannot = || format!("cannot write {}", output.display());
    memscope_core::files::refuse_planted_symlink(output).with_context(cannot)?;
    let output = &match std::fs::symlink_metadata(output) {
        Ok(m) if m.file_type().is_symlink() => std::fs::canonicalize(output)
            .with_context(|| format!("{} is a symlink to a file that does not exist", output.display()))?,
        _ => output.to_owned(),
    };
    if let Ok(m) = std::fs::metadata(output) {
        if m.is_dir() {
            anyhow::bail!("{} is a folder: name the file to write (e.g. {}/out)", output.display(), output.display());
        }
        if !m.is_file() {
            let file = std::fs::OpenOptions::new().write(true).open(output).with_context(cannot)?;
            let mut out = std::io::BufWriter::new(file);
            let r = write(&mut out)?;
            out.flush().with_context(cannot)?;
            return Ok(r);
        }
    }
    let (partial, file) = memscope_core::files::create_temp_beside(output).with_context(cannot)?;
    let mut out = std::io::BufWriter::new(file);
    let result = write(&mut out).and_then(|r| {
        out.flush().with_context(|| format!("cannot write {}", partial.display()))?;
        Ok(r)
    });
    match result {
        Ok(r) => {
            std::fs::rename(&partial, output).with_context(cannot)?;
            Ok(r)
        }
        Err(e) => {
            let _ = std::fs::remove_file(&partial);
            Err(e)
        }
    }
}
