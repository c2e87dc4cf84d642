//! msMemScope's dump CSV into a DB with `memscope_dump`'s twelve columns.
//!
//! Read with the `csv` crate: quoted fields with commas and newlines (the call-stack columns are
//! multi-line), doubled quotes and the backslash-escaped quotes msMemScope leaves in an Attr.
//! Columns are found by name (old captures lack one or both call-stack columns, and the docs
//! spell `Thread ID`), values are kept as written (`N/A` ids, decimal or `0x` pointers) but the
//! Attr, which becomes msMemScope's DB form ([`super::attr`]). Rows stay in file order: msMemScope
//! writes a block's MALLOC with its FREE, and the analyses' reader puts rows in time order
//! whatever the order stored, as it does for msMemScope's own DBs.
//!
//! The DB is written beside its final name and renamed over it only when complete, so an error
//! (the line is named) or an interruption never leaves a half DB under that name.

use std::path::Path;

use rusqlite::types::{ToSqlOutput, ValueRef};
use rusqlite::Connection;

use super::attr::{self, Form};
use super::ImportError;
use crate::store::schema::{create_dump_table, DUMP_COLUMNS, DUMP_TABLE, SCHEMA_VERSION};

/// What an import read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Imported {
    pub rows: u64,
    /// Rows stamped earlier than a row before them (msMemScope writes MALLOCs with their FREE).
    pub out_of_order: u64,
    /// Attrs in the bare `{k:v}` form, in JSON, and empty.
    pub bare: u64,
    pub json: u64,
    pub empty: u64,
    /// The `Device Id`s seen, in first-seen order.
    pub devices: Vec<String>,
    /// Dump columns the CSV did not have (written empty).
    pub missing_columns: Vec<&'static str>,
    /// Whether `memscope-bpf trace --format csv` wrote it (its SYSTEM rows say `tool`), not
    /// msMemScope.
    pub ours: bool,
    /// Whether its timestamps were microseconds (msLeaks' early captures), multiplied into ns.
    pub micros: bool,
}

/// A wall-clock timestamp below this is no nanosecond count (it would be before 1973) but one of
/// microseconds since 1970 (msLeaks' early captures, `Timestamp(ns)` as the header says or not):
/// 1746006014162153 is 2025-04-30 in µs. Monotonic clocks in ns since boot stay below 1e14 too
/// (three years), so only the range [1e14, 1e17) is taken for µs.
const MICROS: std::ops::Range<i64> = 100_000_000_000_000..100_000_000_000_000_000;

/// Columns a dump CSV must have; the two call-stack columns are optional.
const REQUIRED: usize = 10;

/// The CSV column of each of `memscope_dump`'s columns.
fn column_map(path: &Path, header: &::csv::StringRecord) -> Result<[Option<usize>; 12], ImportError> {
    let norm = |s: &str| s.trim().trim_start_matches('\u{feff}').to_ascii_lowercase();
    let mut map = [None; 12];
    for (slot, (name, _)) in map.iter_mut().zip(DUMP_COLUMNS) {
        *slot = header.iter().position(|h| norm(h) == name.to_ascii_lowercase());
    }
    let missing: Vec<&str> =
        DUMP_COLUMNS[..REQUIRED].iter().zip(&map).filter(|(_, m)| m.is_none()).map(|(c, _)| c.0).collect();
    if missing.len() > REQUIRED / 2 {
        return Err(ImportError::NotDumpCsv {
            path: path.to_owned(),
            header: header.iter().collect::<Vec<_>>().join(","),
        });
    }
    if !missing.is_empty() {
        return Err(ImportError::MissingColumns { path: path.to_owned(), missing: missing.join(", ") });
    }
    Ok(map)
}

/// Imports the dump CSV `src` into a new DB at `dst` (replaced only with `force`). `progress` is
/// told the bytes read so far and the file's size.
pub fn import_csv(
    src: &Path,
    dst: &Path,
    force: bool,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Imported, ImportError> {
    if dst.exists() && !force {
        return Err(ImportError::Exists { path: dst.to_owned() });
    }
    let read = |source| ImportError::Read { path: src.to_owned(), source };
    let total = std::fs::metadata(src).map_err(read)?.len();
    let file = crate::files::open_regular(src).map_err(read)?;
    let mut reader = ::csv::ReaderBuilder::new().flexible(true).escape(Some(b'\\')).from_reader(file);
    let header = reader.headers().map_err(|e| csv_error(src, &e))?.clone();
    let map = column_map(src, &header)?;

    // Created here, exclusively and under a name nobody can plant a symlink at beforehand;
    // SQLite then opens the empty file as a new DB.
    let (partial, _) = crate::files::create_temp_beside(dst)
        .map_err(|source| ImportError::WriteIo { path: dst.to_owned(), source })?;
    let result = write(src, &partial, &mut reader, &map, header.len(), total, progress).and_then(|mut imported| {
        std::fs::rename(&partial, dst).map_err(|source| ImportError::WriteIo { path: dst.to_owned(), source })?;
        imported.missing_columns =
            DUMP_COLUMNS.iter().zip(&map).filter(|(_, m)| m.is_none()).map(|(c, _)| c.0).collect();
        Ok(imported)
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    result
}

fn csv_error(path: &Path, e: &::csv::Error) -> ImportError {
    let line = e.position().map_or(0, ::csv::Position::line);
    let why = match e.kind() {
        ::csv::ErrorKind::Utf8 { .. } => "not UTF-8 text (is this a CSV?)".to_owned(),
        ::csv::ErrorKind::Io(io) => io.to_string(),
        _ => e.to_string(),
    };
    ImportError::Csv { path: path.to_owned(), line, why }
}

/// Creates the DB at `partial` and fills it from `reader`.
fn write(
    src: &Path,
    partial: &Path,
    reader: &mut ::csv::Reader<std::fs::File>,
    map: &[Option<usize>; 12],
    width: usize,
    total: u64,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Imported, ImportError> {
    let werr = |source| ImportError::Write { path: partial.to_owned(), source };
    let mut conn = Connection::open(partial).map_err(werr)?;
    // The file is renamed into place only when complete: no journal is needed while it is written.
    conn.execute_batch("PRAGMA journal_mode = OFF; PRAGMA synchronous = OFF; PRAGMA page_size = 65536;")
        .map_err(werr)?;
    conn.execute_batch(&create_dump_table()).map_err(werr)?;
    conn.execute_batch("CREATE TABLE ms_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)").map_err(werr)?;
    let tx = conn.transaction().map_err(werr)?;
    let meta = [
        ("tool", "memscope-bpf import".to_owned()),
        ("version", env!("CARGO_PKG_VERSION").to_owned()),
        ("schema_version", SCHEMA_VERSION.to_string()),
        ("imported_from", src.display().to_string()),
    ];
    for (k, v) in meta {
        tx.execute("INSERT INTO ms_meta (key, value) VALUES (?1, ?2)", [k, v.as_str()]).map_err(werr)?;
    }
    let mut out = Imported::default();
    {
        let sql = format!("INSERT INTO {DUMP_TABLE} VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)");
        let mut insert = tx.prepare(&sql).map_err(werr)?;
        let mut record = ::csv::StringRecord::new();
        let mut latest = i64::MIN;
        while reader.read_record(&mut record).map_err(|e| csv_error(src, &e))? {
            let line = record.position().map_or(0, ::csv::Position::line);
            if record.len() != width {
                if record.len() == 1 && record.get(0).is_some_and(|f| f.trim().is_empty()) {
                    continue; // a blank line
                }
                return Err(ImportError::FieldCount { path: src.to_owned(), line, found: record.len(), want: width });
            }
            let mut checked = checked(src, line, &record, map, &mut out)?;
            if out.rows == 0 {
                out.micros = MICROS.contains(&checked.1);
            }
            if out.micros {
                checked.1 = checked.1.saturating_mul(1000);
            }
            if checked.1 < latest {
                out.out_of_order += 1;
            }
            latest = latest.max(checked.1);
            if !out.ours && record.get(map[1].unwrap_or(0)).is_some_and(|e| e.trim() == "SYSTEM") {
                out.ours = checked.2.contains(r#""tool":"memscope-bpf""#);
            }
            let row = values(&record, map, &checked).map(ToSqlOutput::Borrowed);
            insert.execute(rusqlite::params_from_iter(row)).map_err(werr)?;
            out.rows += 1;
            if out.rows % 65_536 == 0 {
                progress(record.position().map_or(0, ::csv::Position::byte), total);
            }
        }
    }
    if out.rows == 0 {
        return Err(ImportError::Empty { path: src.to_owned() });
    }
    let format = if out.ours { "memscope-bpf-csv" } else { "msmemscope-csv" };
    tx.execute("INSERT INTO ms_meta (key, value) VALUES ('source_format', ?1)", [format]).map_err(werr)?;
    if out.micros {
        tx.execute("INSERT INTO ms_meta (key, value) VALUES ('timestamps', 'us, multiplied into ns')", [])
            .map_err(werr)?;
    }
    tx.commit().map_err(werr)?;
    conn.close().map_err(|(_, e)| werr(e))?;
    progress(total, total);
    Ok(out)
}

/// One CSV record's checked values: ID, timestamp and the Attr as JSON (the other columns are
/// stored as the record holds them).
fn checked(
    src: &Path,
    line: u64,
    record: &::csv::StringRecord,
    map: &[Option<usize>; 12],
    out: &mut Imported,
) -> Result<(i64, i64, String), ImportError> {
    let get = |c: usize| map[c].and_then(|i| record.get(i)).unwrap_or("");
    let bad = |c: usize, what| ImportError::Field {
        path: src.to_owned(),
        line,
        column: DUMP_COLUMNS[c].0,
        text: get(c).to_owned(),
        what,
    };
    let id: i64 = get(0).trim().parse().map_err(|_| bad(0, "a row number"))?;
    let ts: i64 = get(4).trim().parse().map_err(|_| bad(4, "a time in ns"))?;
    if get(1).trim().is_empty() {
        return Err(bad(1, "an event (MALLOC, FREE, ...)"));
    }
    let (attr_json, form) = attr::to_json(get(9)).map_err(|e| ImportError::Attr {
        path: src.to_owned(),
        line,
        at: e.column,
        why: e.why,
        text: get(9).chars().take(200).collect(),
    })?;
    match form {
        Form::Bare => out.bare += 1,
        Form::Json => out.json += 1,
        Form::Empty => out.empty += 1,
    }
    let device = get(7).trim();
    if !out.devices.iter().any(|d| d == device) {
        out.devices.push(device.to_owned());
    }
    Ok((id, ts, attr_json))
}

/// The twelve column values of a checked record, borrowed from it (millions of rows: no copy).
fn values<'r>(
    record: &'r ::csv::StringRecord,
    map: &[Option<usize>; 12],
    (id, ts, attr): &'r (i64, i64, String),
) -> [ValueRef<'r>; 12] {
    let get = |c: usize| map[c].and_then(|i| record.get(i));
    let text = |c: usize| get(c).map_or(ValueRef::Null, |t| ValueRef::Text(t.as_bytes()));
    let trimmed = |c: usize| ValueRef::Text(get(c).unwrap_or("").trim().as_bytes());
    [
        ValueRef::Integer(*id),
        trimmed(1),
        trimmed(2),
        text(3),
        ValueRef::Integer(*ts),
        id_value(get(5).unwrap_or("")),
        id_value(get(6).unwrap_or("")),
        trimmed(7),
        trimmed(8),
        ValueRef::Text(attr.as_bytes()),
        text(10),
        text(11),
    ]
}

/// A process or thread id: a number, or the text msMemScope wrote (`N/A`), or nothing.
fn id_value(text: &str) -> ValueRef<'_> {
    let t = text.trim();
    match t.parse::<i64>() {
        Ok(n) => ValueRef::Integer(n),
        Err(_) if t.is_empty() => ValueRef::Null,
        Err(_) => ValueRef::Text(t.as_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use rusqlite::types::Value;

    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("memscope-import-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn import(d: &Path, text: &str) -> (Result<Imported, ImportError>, PathBuf) {
        let csv = d.join("in.csv");
        std::fs::write(&csv, text).unwrap();
        let db = d.join("out.db");
        (import_csv(&csv, &db, true, &mut |_, _| {}), db)
    }

    fn rows(db: &Path) -> Vec<Vec<Value>> {
        let conn = Connection::open(db).unwrap();
        let mut stmt = conn.prepare("SELECT * FROM memscope_dump ORDER BY rowid").unwrap();
        stmt.query_map([], |r| (0..12).map(|i| r.get::<_, Value>(i)).collect()).unwrap().map(Result::unwrap).collect()
    }

    /// Nothing but the file the test wrote: no DB, no partial one.
    fn only_input_left(d: &Path) {
        let names: Vec<String> =
            std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        assert_eq!(names, ["in.csv"]);
    }

    #[test]
    fn columns_are_found_by_name_and_values_kept_as_written() {
        let d = dir("names");
        // The docs' spelling, a BOM, no stack columns, columns in another order, CRLF, a blank line.
        let text = "\u{feff}Event,ID,Event Type,Name,Timestamp(ns),Process Id,Thread ID,Device ID,Ptr,Attr\r\n\
                    SYSTEM,1,ACL_INIT,N/A,10,N/A,,N/A,N/A,\r\n\
                    \r\n\
                    MALLOC,2,HAL,N/A,5,7,8,0,20615843020800,\"{addr:20615843020800,size:16384,owner:,MID:7,name:\\\"a,b\\\"}\"\r\n";
        let (got, db) = import(&d, text);
        let got = got.unwrap();
        assert_eq!((got.rows, got.out_of_order, got.bare, got.empty), (2, 1, 1, 1));
        assert_eq!(got.missing_columns, ["Call Stack(Python)", "Call Stack(C)"]);
        assert_eq!(got.devices, ["N/A", "0"]);
        let rows = rows(&db);
        assert_eq!(rows[0][5], Value::Text("N/A".into()), "an N/A process id stays N/A");
        assert_eq!(rows[0][6], Value::Null, "an empty thread id is no value");
        assert_eq!(rows[1][0], Value::Integer(2));
        assert_eq!(rows[1][8], Value::Text("20615843020800".into()), "a decimal pointer stays decimal");
        assert_eq!(
            rows[1][9],
            Value::Text(r#"{"addr":"20615843020800","size":"16384","owner":"","MID":"7","name":"a,b"}"#.into())
        );
        assert_eq!(rows[1][10], Value::Null);
        let conn = Connection::open(&db).unwrap();
        let from: String =
            conn.query_row("SELECT value FROM ms_meta WHERE key = 'imported_from'", [], |r| r.get(0)).unwrap();
        assert!(from.ends_with("in.csv"));
    }

    #[test]
    fn a_file_that_is_not_a_dump_or_has_no_rows_leaves_nothing() {
        let d = dir("refused");
        let (err, _) = import(&d, "ID,Event,Event Type,Name,Timestamp(ns)\n1,MALLOC,HAL,x,1\n");
        let err = err.unwrap_err().to_string();
        assert!(err.contains("lacks the column(s) Process Id, Thread Id, Device Id, Ptr, Attr"), "{err}");
        only_input_left(&d);
        let (err, _) = import(&d, "FuncInfo,StartTime(ns),EndTime(ns),Thread Id,Process Id\n");
        assert!(matches!(err, Err(ImportError::NotDumpCsv { .. })));
        let header = "ID,Event,Event Type,Name,Timestamp(ns),Process Id,Thread Id,Device Id,Ptr,Attr\n";
        let (err, _) = import(&d, header);
        assert!(matches!(err, Err(ImportError::Empty { .. })), "{err:?}");
        only_input_left(&d);
        // An error on the last line: no half DB under the name, no partial one beside it.
        let text = format!("{header}1,MALLOC,HAL,x,1,2,3,0,0x1,\"{{size:1}}\"\n2,FREE,HAL,x,oops,2,3,0,0x1,\n");
        let (err, _) = import(&d, &text);
        let err = err.unwrap_err().to_string();
        assert!(err.contains("line 3, column Timestamp(ns): `oops` is not a time in ns"), "{err}");
        only_input_left(&d);
    }

    #[test]
    fn an_existing_db_is_replaced_only_when_forced() {
        let d = dir("exists");
        let csv = d.join("in.csv");
        std::fs::write(&csv, "ID,Event,Event Type,Name,Timestamp(ns),Process Id,Thread Id,Device Id,Ptr,Attr\n1,SYSTEM,STEP,1,5,1,1,0,N/A,\n").unwrap();
        let db = d.join("out.db");
        std::fs::write(&db, "mine").unwrap();
        assert!(matches!(import_csv(&csv, &db, false, &mut |_, _| {}), Err(ImportError::Exists { .. })));
        assert_eq!(std::fs::read(&db).unwrap(), b"mine");
        let got = import_csv(&csv, &db, true, &mut |_, _| {}).unwrap();
        assert_eq!((got.rows, got.ours), (1, false));
        assert_eq!(rows(&db).len(), 1);
    }

    #[test]
    fn microsecond_timestamps_become_nanoseconds() {
        let d = dir("micros");
        let header = "ID,Event,Event Type,Name,Timestamp(ns),Process Id,Thread Id,Device Id,Ptr,Attr\n";
        let rows_us = "1,SYSTEM,acl init,N/A,1746006014162153,1,1,N/A,N/A,\n2,MALLOC,HAL,N/A,1746006014361575,1,1,0,20615843020800,\"{addr:20615843020800,size:16384,owner:,MID:7}\"\n";
        let (got, db) = import(&d, &format!("{header}{rows_us}"));
        assert!(got.unwrap().micros);
        let ts: Vec<Value> = rows(&db).into_iter().map(|r| r[4].clone()).collect();
        assert_eq!(ts, [Value::Integer(1_746_006_014_162_153_000), Value::Integer(1_746_006_014_361_575_000)]);
        let (got, db) = import(&d, &format!("{header}1,SYSTEM,START_TRACE,N/A,1764753083996495030,1,1,N/A,N/A,\n"));
        assert!(!got.unwrap().micros);
        assert_eq!(rows(&db)[0][4], Value::Integer(1_764_753_083_996_495_030));
    }

    #[test]
    fn a_csv_our_tracer_wrote_is_told_from_msmemscopes() {
        let d = dir("ours");
        let header = "ID,Event,Event Type,Name,Timestamp(ns),Process Id,Thread Id,Device Id,Ptr,Attr\n";
        let (got, db) = import(
            &d,
            &format!("{header}1,SYSTEM,START_TRACE,N/A,1,1,1,0,N/A,\"{{tool:memscope-bpf,version:0.1.0}}\"\n"),
        );
        assert!(got.unwrap().ours);
        let conn = Connection::open(&db).unwrap();
        let format: String =
            conn.query_row("SELECT value FROM ms_meta WHERE key = 'source_format'", [], |r| r.get(0)).unwrap();
        assert_eq!(format, "memscope-bpf-csv");
        let (got, _) = import(&d, &format!("{header}1,SYSTEM,START_TRACE,N/A,1,1,1,0,N/A,\"{{free:1,total:2}}\"\n"));
        assert!(!got.unwrap().ours);
    }
}
