//! msMemScope's own captures as our input: telling its files apart by what they hold, and
//! importing its dump CSV into a DB with `memscope_dump`'s columns, so every offline verb has one
//! reader (the DB's) whatever the user brings.
//!
//! Why import rather than read CSV rows straight into the analyses: the analyses read through
//! SQLite (time order across a file whose rows msMemScope writes out of order, a second pass,
//! the named rows of one call, their own tables), and a DB is what Insight opens too. The import
//! keeps every row and column as msMemScope wrote it, but the Attr, which becomes the compact JSON
//! of strings msMemScope's own DB holds ([`attr`]). It never writes beside its input on its own:
//! the caller names the DB (`memscope-bpf import`, or a temporary one for a verb).
//!
//! - [`sniff`]: what a file is, from its first bytes (SQLite, a dump CSV, another of
//!   msMemScope's CSVs), so folders are read by content, not by our naming.
//! - [`csv`]: the dump CSV, through the `csv` crate (quoting, multi-line stacks), one clear
//!   error with the line number for a malformed row.
//! - [`attr`]: the Attr's two forms.
//! - [`split`]: one DB per device of a file that holds several (msLeaks' early captures).

pub mod attr;
pub mod csv;
pub mod snapshot;
pub mod split;

use std::io::Read as _;
use std::path::{Path, PathBuf};

use thiserror::Error;

pub use self::csv::{import_csv, Imported};
pub use self::snapshot::{import_snapshot, SnapshotDevice};
pub use self::split::split_by_device;

/// The first field of msMemScope's dump CSV header (`ID,Event,Event Type,...`).
const DUMP_HEADER_START: &str = "ID,Event";

/// What a file holds, by its first bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Kind {
    /// An SQLite database (a trace DB, ours or msMemScope's, when it has the dump table).
    Sqlite,
    /// msMemScope's dump CSV (ours writes the same).
    DumpCsv,
    /// Another CSV, with its header line: msMemScope's Python trace, compare or watch CSVs.
    OtherCsv(String),
    /// A pickle (protocol 2 or later): PyTorch's or torch_npu's memory snapshot, if it is one.
    Pickle,
    /// Anything else.
    Other,
}

/// What `path` holds, from its first 4 KiB.
pub fn sniff(path: &Path) -> std::io::Result<Kind> {
    let mut head = Vec::with_capacity(4096);
    crate::files::open_regular(path)?.take(4096).read_to_end(&mut head)?;
    if head.starts_with(b"SQLite format 3\0") {
        return Ok(Kind::Sqlite);
    }
    if let [0x80, protocol, ..] = head[..] {
        if (2..=5).contains(&protocol) {
            return Ok(Kind::Pickle);
        }
    }
    let text = head.strip_prefix(b"\xef\xbb\xbf").unwrap_or(&head);
    let Some(end) = text.iter().position(|&b| b == b'\n') else { return Ok(Kind::Other) };
    let Ok(line) = std::str::from_utf8(&text[..end]) else { return Ok(Kind::Other) };
    let line = line.trim_end_matches('\r');
    if line.starts_with(DUMP_HEADER_START) {
        Ok(Kind::DumpCsv)
    } else if line.contains(',') && !line.contains('\0') {
        Ok(Kind::OtherCsv(line.to_owned()))
    } else {
        Ok(Kind::Other)
    }
}

/// What an msMemScope CSV other than the dump is, from its header, for the error that says why
/// it cannot be analysed.
pub fn describe_other_csv(header: &str) -> &'static str {
    if header.starts_with("FuncInfo") {
        "msMemScope's Python trace (python_trace_*.csv)"
    } else if header.starts_with(",,,Base") || header.starts_with("Event,Name,Device Id") {
        "msMemScope's compare result (memory_compare_*.csv)"
    } else if header.starts_with("Tensor info") {
        "msMemScope's watch checksums"
    } else {
        "not msMemScope's dump CSV"
    }
}

/// What can go wrong importing a CSV. Each names the file (and the line), and what to do.
#[derive(Debug, Error)]
pub enum ImportError {
    #[error("{path}: cannot read it ({source})")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path}: its first line is not msMemScope's dump header (ID,Event,Event Type,Name,Timestamp(ns),...): `{header}`; give the memscope_dump_*.csv (or leaks_dump_*.csv) from a device_<n>/dump/ folder")]
    NotDumpCsv { path: PathBuf, header: String },
    #[error("{path}: the header lacks the column(s) {missing}; the file is not msMemScope's dump CSV")]
    MissingColumns { path: PathBuf, missing: String },
    #[error("{path}, line {line}: {why}")]
    Csv { path: PathBuf, line: u64, why: String },
    #[error("{path}, line {line}: {found} fields where the header has {want}; a value with a comma must be quoted (\"...\"): fix or delete that line")]
    FieldCount { path: PathBuf, line: u64, found: usize, want: usize },
    #[error("{path}, line {line}, column {column}: `{text}` is not {what}; fix or delete that line")]
    Field { path: PathBuf, line: u64, column: &'static str, text: String, what: &'static str },
    #[error("{path}, line {line}, Attr column {at}: {why} in `{text}`; fix or delete that line")]
    Attr { path: PathBuf, line: u64, at: usize, why: String, text: String },
    #[error("{path}: {why}")]
    Snapshot { path: PathBuf, why: String },
    #[error("{path}: no rows after the header; the capture holds nothing to analyse")]
    Empty { path: PathBuf },
    #[error("{path}: already exists; pass --force to replace it, or -o to write elsewhere")]
    Exists { path: PathBuf },
    #[error("{path}: cannot write the imported DB ({source}); give a writable place with -o")]
    Write { path: PathBuf, source: rusqlite::Error },
    #[error("{path}: cannot write the imported DB ({source}); give a writable place with -o")]
    WriteIo { path: PathBuf, source: std::io::Error },
}
