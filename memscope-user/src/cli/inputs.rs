//! The DB arguments of the offline verbs (`analyze`, `advise`, `compare`, `export`, `report`):
//! which DB files they name, which device each holds, and `--device` as a user may write it. One
//! place, so the verbs accept the same inputs and say the same thing when a device is not among
//! them; and how the verbs that write a file write it (whole, or not at all).

use std::collections::HashSet;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context as _;

use crate::analysis::db::{self, DbFile, DumpDb};

/// The DBs the inputs name (files, trace folders, folders of traces), each once, in the order
/// given. Every input is resolved before any is analysed, so a typo in the last one fails first.
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
    Ok(files)
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
        None => device_of(file, &DumpDb::open_read(&file.path)?),
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
        (0, None) => Err(anyhow::anyhow!("{} holds no trace DB", input.display())),
        _ => Ok(picked),
    }
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
pub fn write_atomically<T>(
    output: &Path,
    write: impl FnOnce(&mut std::io::BufWriter<std::fs::File>) -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    let dir = output.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = output.file_name().with_context(|| format!("{} is not a file name", output.display()))?;
    let partial = dir.join(format!(".{}.partial", name.to_string_lossy()));
    let file = std::fs::File::create(&partial).with_context(|| format!("cannot write {}", partial.display()))?;
    let mut out = std::io::BufWriter::new(file);
    let result = write(&mut out).and_then(|r| {
        out.flush().with_context(|| format!("cannot write {}", partial.display()))?;
        Ok(r)
    });
    match result {
        Ok(r) => {
            std::fs::rename(&partial, output).with_context(|| format!("cannot write {}", output.display()))?;
            Ok(r)
        }
        Err(e) => {
            let _ = std::fs::remove_file(&partial);
            Err(e)
        }
    }
}
