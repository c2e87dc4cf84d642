//! The temporary DBs of the traces the offline verbs are given as they cannot read them: each CSV
//! and each memory snapshot imported, and each file holding several devices (msLeaks' early captures) split into one DB
//! per device, once per run into `$TMPDIR/memscope-bpf-imports.<pid>/`, removed when the verb ends
//! (and, should a run be killed first, by the next run). So the verbs read every trace through
//! the DB reader, one device at a time, and never write beside the user's files.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::Context as _;
use memscope_core::analysis::db::{DbFile, Format};

use crate::terminal::say::say;

/// A file as imported or split: its canonical path, size and modification time (a file rewritten
/// since is read again).
type FileKey = (PathBuf, u64, Option<std::time::SystemTime>);

/// The temporary DBs of this run, so a file named twice (or opened for its device, then
/// analysed) is imported or split once.
struct Imports {
    dir: Option<PathBuf>,
    done: Vec<(FileKey, PathBuf)>,
    split: Vec<(FileKey, Vec<(String, PathBuf)>)>,
}

static IMPORTS: Mutex<Imports> = Mutex::new(Imports { dir: None, done: Vec::new(), split: Vec::new() });

fn key_of(path: &Path) -> anyhow::Result<FileKey> {
    let meta = std::fs::metadata(path).with_context(|| format!("cannot read {}", path.display()))?;
    let canonical = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_owned());
    Ok((canonical, meta.len(), meta.modified().ok()))
}

/// The folder of this process's temporary DBs (`$TMPDIR/memscope-bpf-imports.<pid>`), made on
/// first use; those of processes no longer running (killed before they could remove theirs) go.
fn imports_dir(imports: &mut Imports) -> anyhow::Result<PathBuf> {
    if let Some(dir) = &imports.dir {
        return Ok(dir.clone());
    }
    let tmp = std::env::temp_dir();
    if let Ok(entries) = std::fs::read_dir(&tmp) {
        for entry in entries.flatten() {
            let name = entry.file_name();
            let pid =
                name.to_str().and_then(|n| n.strip_prefix("memscope-bpf-imports.")).and_then(|p| p.parse::<u32>().ok());
            if pid.is_some_and(|p| !Path::new(&format!("/proc/{p}")).exists()) {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
    let dir = tmp.join(format!("memscope-bpf-imports.{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| {
        format!(
            "cannot make a temporary folder {} for the CSVs' import (set TMPDIR to a writable place)",
            dir.display()
        )
    })?;
    imports.dir = Some(dir.clone());
    Ok(dir)
}

/// Removes this run's temporary DBs (at the end of every verb).
pub fn remove_imports() {
    if let Ok(mut imports) = IMPORTS.lock() {
        if let Some(dir) = imports.dir.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
        imports.done.clear();
        imports.split.clear();
    }
}

/// What `make` makes of `path` (in the temporary folder, given a number no other file there has),
/// once per run: later calls with the same file get the first result from `table`.
fn once<T: Clone>(
    path: &Path,
    table: fn(&mut Imports) -> &mut Vec<(FileKey, T)>,
    make: impl FnOnce(&Path, usize) -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    let key = key_of(path)?;
    let mut imports = IMPORTS.lock().map_err(|_| anyhow::anyhow!("the imports' registry was poisoned"))?;
    if let Some((_, done)) = table(&mut imports).iter().find(|(k, _)| *k == key) {
        return Ok(done.clone());
    }
    let dir = imports_dir(&mut imports)?;
    let number = imports.done.len() + imports.split.len();
    let made = make(&dir, number)?;
    table(&mut imports).push((key, made.clone()));
    Ok(made)
}

/// `file` itself; for a CSV, the temporary DB it was imported into; for a memory snapshot, one
/// temporary DB per device (once per run).
pub(super) fn imported(file: DbFile) -> anyhow::Result<Vec<DbFile>> {
    match file.format {
        Format::Db => Ok(vec![file]),
        Format::Csv => Ok(vec![imported_csv(file)?]),
        Format::Snapshot => snapshot(&file),
    }
}

fn imported_csv(file: DbFile) -> anyhow::Result<DbFile> {
    let db_path = once(
        &file.path,
        |i| &mut i.done,
        |dir, n| {
            let db_path = dir.join(format!("{n}-{}.db", stem(&file.path)));
            let started = std::time::Instant::now();
            let mut bar = crate::terminal::progress::bytes(crate::terminal::progress::label("import", &file.path));
            let got = memscope_core::import::import_csv(&file.path, &db_path, true, &mut bar)?;
            say!(
                "memscope-bpf: read {} ({} rows{}) through a temporary DB in {:.1} s; `memscope-bpf import` \
             on it keeps a DB beside it, for Insight and faster reruns",
                file.path.display(),
                got.rows,
                match (got.out_of_order, got.micros) {
                    (0, false) => String::new(),
                    (n, false) => format!(", {n} out of time order"),
                    (n, true) => format!(", {n} out of time order, timestamps in µs (msLeaks'), read as ns"),
                },
                started.elapsed().as_secs_f64(),
            );
            Ok(db_path)
        },
    )?;
    Ok(DbFile { source: Some(file.path.clone()), path: db_path, format: Format::Db, device: file.device })
}

/// A memory snapshot as one temporary DB per device, said once.
fn snapshot(file: &DbFile) -> anyhow::Result<Vec<DbFile>> {
    let parts = once(
        &file.path,
        |i| &mut i.split,
        |dir, n| {
            let stem = format!("{n}-{}", stem(&file.path));
            let got = memscope_core::import::import_snapshot(&file.path, |d| dir.join(format!("{stem}-{d}.db")))?;
            say!("memscope-bpf: {}", super::import::snapshot_summary(&file.path, &got));
            Ok(got.into_iter().map(|d| (d.device, d.db)).collect())
        },
    )?;
    let source = Some(file.path.clone());
    Ok(parts
        .into_iter()
        .map(|(device, path)| DbFile { path, device: Some(device), format: Format::Db, source: source.clone() })
        .collect())
}

/// `file` (a DB of no device folder that holds `devices`, several) as one temporary DB per device,
/// each named as the user knows the file; said once.
pub(super) fn split(file: &DbFile, table: &str, devices: &[String]) -> anyhow::Result<Vec<DbFile>> {
    let parts = once(
        &file.path,
        |i| &mut i.split,
        |dir, n| {
            let stem = format!("{n}-{}", stem(file.shown()));
            let parts = memscope_core::import::split_by_device(&file.path, table, devices, dir, &stem)?;
            say!(
                "memscope-bpf: {} holds devices {} in one file (as msLeaks wrote them): each is analysed on its own",
                file.shown().display(),
                devices.join(", ")
            );
            Ok(parts)
        },
    )?;
    let source = Some(file.shown().to_owned());
    Ok(parts
        .into_iter()
        .map(|(device, path)| DbFile { path, device: Some(device), format: Format::Db, source: source.clone() })
        .collect())
}

fn stem(path: &Path) -> String {
    path.file_stem().map_or_else(|| "dump".into(), |s| s.to_string_lossy().into_owned())
}
