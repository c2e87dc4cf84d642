//! PyTorch's and torch_npu's memory snapshots as our input: the pickle
//! `torch.cuda.memory._dump_snapshot()` / `torch.npu.memory._dump_snapshot()` write (and
//! `export --format memory-viz` writes), imported into one DB per device with `memscope_dump`'s
//! columns, so every offline verb reads it as it reads a trace.
//!
//! What becomes what ([`rows`]): `alloc` and `free_completed` are the caching pool's `PTA`
//! MALLOC and FREE rows (`free_requested` is the free's request: the block stays until its
//! completion); `segment_alloc`/`segment_free` and `segment_map`/`segment_unmap` the pool's
//! segments (`HAL` rows with `segment`=`caching`, mappings with `vmm`); `oom` an `OOM_TRIGGER` of
//! the allocator; each entry's `frames` its `Call Stack(Python)` (Python frames) and
//! `Call Stack(C)` (the others), and the owner rules of [`crate::infer`] give its owner. The
//! trace is a ring of the last events: the `segments` at the end, rewound through the entries,
//! give what existed before the first one, written first.
//!
//! Read by [`pickle`], which builds plain values and never runs a pickle's code: a pickle naming
//! a class (anything but dicts, lists, tuples, strings, numbers) is refused.

mod pickle;
mod rows;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

use pickle::Py;
use rusqlite::Connection;

use super::ImportError;
use crate::store::schema::{create_dump_table, DUMP_TABLE, SCHEMA_VERSION};

pub use rows::Frame;

/// One device's import.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotDevice {
    pub device: String,
    pub db: PathBuf,
    pub entries: u64,
    pub rows: u64,
    /// Segments and live blocks that existed before the trace's first entry.
    pub segments_before: u64,
    pub blocks_before: u64,
    /// Whether the entries had times (`time_us`; torch_npu's have none: they are spaced 1 µs).
    pub timed: bool,
}

/// A trace entry of `device_traces`.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Entry {
    pub action: String,
    pub addr: u64,
    pub size: u64,
    pub stream: u64,
    pub time_us: Option<i64>,
    pub frames: Vec<Frame>,
}

/// A segment of the final state, with its blocks.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Segment {
    pub device: i64,
    pub address: u64,
    pub total_size: u64,
    pub stream: u64,
    pub expandable: bool,
    pub blocks: Vec<Block>,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Block {
    pub address: u64,
    pub size: u64,
    pub requested_size: u64,
    /// `active_allocated`, `active_pending_free` or `inactive`.
    pub state: String,
    pub frames: Vec<Frame>,
}

/// The snapshot, read.
#[derive(Clone, Debug, Default)]
pub(crate) struct Snapshot {
    pub segments: Vec<Segment>,
    pub traces: Vec<Vec<Entry>>,
    /// `allocator_settings.PYTORCH_CUDA_ALLOC_CONF` (PyTorch's; torch_npu's snapshots have none).
    pub alloc_conf: Option<String>,
    /// PyTorch's (`allocator_settings` present), else torch_npu's.
    pub cuda: bool,
}

fn bad(path: &Path, why: impl Into<String>) -> ImportError {
    ImportError::Snapshot { path: path.to_owned(), why: why.into() }
}

/// Reads a snapshot pickle.
pub(crate) fn read(path: &Path) -> Result<Snapshot, ImportError> {
    let read_err = |source| ImportError::Read { path: path.to_owned(), source };
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut crate::files::open_regular(path).map_err(read_err)?, &mut bytes)
        .map_err(read_err)?;
    let top = pickle::read(&bytes).map_err(|e| bad(path, format!("not a memory snapshot: {e}; only PyTorch's and torch_npu's memory snapshots (plain dicts and lists) are read, and no pickle's code is ever run")))?;
    if !top.is_dict() {
        return Err(bad(
            path,
            "a pickle, but not of a dict; a memory snapshot is a dict with `segments` and `device_traces`",
        ));
    }
    let (Some(segments), Some(traces)) = (top.get("segments"), top.get("device_traces")) else {
        return Err(bad(path, "a pickled dict without `segments` and `device_traces`: not a memory snapshot (torch.cuda.memory._dump_snapshot() writes them)"));
    };
    let segments = segments.items().ok_or_else(|| bad(path, "`segments` is not a list"))?;
    let traces = traces.items().ok_or_else(|| bad(path, "`device_traces` is not a list"))?;
    let settings = top.get("allocator_settings").filter(Py::is_dict);
    Ok(Snapshot {
        segments: segments.iter().map(|s| segment(path, s)).collect::<Result<_, _>>()?,
        traces: traces
            .iter()
            .map(|t| {
                t.items()
                    .ok_or_else(|| bad(path, "a device's trace is not a list"))?
                    .iter()
                    .map(|e| entry(path, e))
                    .collect()
            })
            .collect::<Result<_, _>>()?,
        alloc_conf: settings
            .as_ref()
            .and_then(|s| s.get("PYTORCH_CUDA_ALLOC_CONF"))
            .and_then(|c| c.text())
            .filter(|c| !c.is_empty()),
        cuda: settings.is_some(),
    })
}

/// An address, size or stream: a Python int (a stream handle above 2^63 is read as its bits).
fn uint(v: &Py) -> Option<u64> {
    let n = v.int()?;
    u64::try_from(n).ok().or_else(|| i64::try_from(n).ok().map(|s| s as u64))
}

fn field(path: &Path, d: &Py, what: &str, key: &str) -> Result<Py, ImportError> {
    d.get(key).ok_or_else(|| bad(path, format!("a {what} without `{key}`")))
}

fn number(path: &Path, d: &Py, what: &str, key: &str) -> Result<u64, ImportError> {
    uint(&field(path, d, what, key)?).ok_or_else(|| bad(path, format!("a {what}'s `{key}` is not a whole number")))
}

fn frames(v: Option<Py>) -> Vec<Frame> {
    let Some(items) = v.and_then(|v| v.items()) else { return Vec::new() };
    items
        .iter()
        .filter(|f| f.is_dict())
        .map(|f| Frame {
            filename: f.get("filename").and_then(|v| v.text()).unwrap_or_default(),
            line: f.get("line").as_ref().and_then(uint).unwrap_or(0),
            name: f.get("name").and_then(|v| v.text()).unwrap_or_default(),
        })
        .collect()
}

fn entry(path: &Path, d: &Py) -> Result<Entry, ImportError> {
    if !d.is_dict() {
        return Err(bad(path, "a trace entry is not a dict"));
    }
    let action = field(path, d, "trace entry", "action")?
        .text()
        .ok_or_else(|| bad(path, "a trace entry's `action` is not text"))?;
    Ok(Entry {
        // `oom` entries carry the device's free bytes in place of an address.
        addr: d.get("addr").as_ref().and_then(uint).unwrap_or(0),
        size: number(path, d, "trace entry", "size")?,
        stream: d.get("stream").as_ref().and_then(uint).unwrap_or(0),
        time_us: d.get("time_us").and_then(|t| t.int()).and_then(|t| i64::try_from(t).ok()),
        frames: frames(d.get("frames")),
        action,
    })
}

fn segment(path: &Path, d: &Py) -> Result<Segment, ImportError> {
    if !d.is_dict() {
        return Err(bad(path, "a segment is not a dict"));
    }
    let blocks =
        field(path, d, "segment", "blocks")?.items().ok_or_else(|| bad(path, "a segment's `blocks` is not a list"))?;
    let blocks = blocks
        .iter()
        .map(|b| {
            if !b.is_dict() {
                return Err(bad(path, "a block is not a dict"));
            }
            Ok(Block {
                address: b.get("address").as_ref().and_then(uint).unwrap_or(0),
                size: number(path, b, "block", "size")?,
                requested_size: b.get("requested_size").as_ref().and_then(uint).unwrap_or(0),
                state: b.get("state").and_then(|s| s.text()).unwrap_or_default(),
                frames: frames(b.get("frames")),
            })
        })
        .collect::<Result<_, ImportError>>()?;
    Ok(Segment {
        device: d.get("device").and_then(|v| v.int()).and_then(|v| i64::try_from(v).ok()).unwrap_or(0),
        address: number(path, d, "segment", "address")?,
        total_size: number(path, d, "segment", "total_size")?,
        stream: d.get("stream").as_ref().and_then(uint).unwrap_or(0),
        expandable: d.get("is_expandable").and_then(|v| v.int()).unwrap_or(0) != 0,
        blocks,
    })
}

/// Imports `src` into one DB per device that has a trace or segments, at the path `dest` gives
/// for the device (its folder must exist); each is written beside its name and renamed when
/// complete.
pub fn import_snapshot(src: &Path, dest: impl Fn(&str) -> PathBuf) -> Result<Vec<SnapshotDevice>, ImportError> {
    let snap = read(src)?;
    let mut devices: Vec<usize> = (0..snap.traces.len()).filter(|&d| !snap.traces[d].is_empty()).collect();
    for s in &snap.segments {
        let d = s.device.max(0) as usize;
        if !devices.contains(&d) {
            devices.push(d);
        }
    }
    devices.sort_unstable();
    if devices.is_empty() {
        return Err(bad(
            src,
            "a memory snapshot with no trace entries and no segments: was `_record_memory_history()` on?",
        ));
    }
    let mut out = Vec::new();
    for d in devices {
        let made = rows::device_rows(&snap, d);
        let db = dest(&d.to_string());
        write(src, &db, &snap, &made)?;
        out.push(SnapshotDevice {
            device: d.to_string(),
            db,
            entries: snap.traces.get(d).map_or(0, |t| t.len() as u64),
            rows: made.rows.len() as u64,
            segments_before: made.segments_before,
            blocks_before: made.blocks_before,
            timed: made.timed,
        });
    }
    Ok(out)
}

fn write(src: &Path, dst: &Path, snap: &Snapshot, made: &rows::Made) -> Result<(), ImportError> {
    let (partial, _) = crate::files::create_temp_beside(dst)
        .map_err(|source| ImportError::WriteIo { path: dst.to_owned(), source })?;
    let werr = |source| ImportError::Write { path: dst.to_owned(), source };
    let result = (|| {
        let mut conn = Connection::open(&partial).map_err(werr)?;
        conn.execute_batch("PRAGMA journal_mode = OFF; PRAGMA synchronous = OFF;").map_err(werr)?;
        conn.execute_batch(&create_dump_table()).map_err(werr)?;
        conn.execute_batch("CREATE TABLE ms_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)").map_err(werr)?;
        let tx = conn.transaction().map_err(werr)?;
        let backend = if snap.cuda { crate::apis::Backend::Cuda } else { crate::apis::Backend::Ascend };
        let mut meta = vec![
            ("tool", "memscope-bpf import".to_owned()),
            ("version", env!("CARGO_PKG_VERSION").to_owned()),
            ("schema_version", SCHEMA_VERSION.to_string()),
            ("imported_from", src.display().to_string()),
            ("source_format", SOURCE_FORMAT.to_owned()),
            ("backend", backend.as_str().to_owned()),
        ];
        if snap.cuda {
            meta.push(("allocator_settings", "recorded".to_owned()));
        }
        if let Some(conf) = &snap.alloc_conf {
            meta.push(("env.PYTORCH_CUDA_ALLOC_CONF", conf.clone()));
        }
        for (k, v) in meta {
            tx.execute("INSERT INTO ms_meta (key, value) VALUES (?1, ?2)", [k, v.as_str()]).map_err(werr)?;
        }
        {
            let sql = format!("INSERT INTO {DUMP_TABLE} VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)");
            let mut insert = tx.prepare(&sql).map_err(werr)?;
            for (id, r) in made.rows.iter().enumerate() {
                insert
                    .execute(rusqlite::params![
                        id as i64 + 1,
                        r.event,
                        r.event_type,
                        r.name,
                        r.ts,
                        1,
                        1,
                        r.device,
                        format!("0x{:016x}", r.ptr),
                        serde_json::Value::Object(r.attr.clone()).to_string(),
                        r.python,
                        r.native
                    ])
                    .map_err(werr)?;
            }
        }
        tx.commit().map_err(werr)?;
        conn.close().map_err(|(_, e)| werr(e))?;
        // Private, as a trace's DBs are: a job's frames and sizes are its owner's.
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&partial, std::fs::Permissions::from_mode(0o600))
            .map_err(|source| ImportError::WriteIo { path: dst.to_owned(), source })?;
        std::fs::rename(&partial, dst).map_err(|source| ImportError::WriteIo { path: dst.to_owned(), source })
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    result
}

/// `ms_meta.source_format` of a DB imported from a snapshot.
pub const SOURCE_FORMAT: &str = "torch-memory-snapshot";
