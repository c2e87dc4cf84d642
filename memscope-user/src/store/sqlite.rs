//! The SQLite sink: `memscope_dump` for Insight plus our `ms_*` tables, in WAL mode with one open
//! transaction that `commit` closes and reopens.

use std::ops::Range;
use std::path::{Path, PathBuf};

use rusqlite::{params, Connection};

use super::insight::Row;
use super::schema::{self, SCHEMA_VERSION};
use super::sqlite_raw::{tune_sqlite_once, Param, RawStatement};
use super::{Meta, ProbeRow, Sink, StoreError};

pub struct DbSink {
    /// Declared before `conn`: statements must be finalized before the connection closes.
    full: Option<RawStatement>,
    single: Option<RawStatement>,
    conn: Connection,
    path: PathBuf,
    batch: Batch,
}

/// Rows waiting for the next multi-row INSERT. One statement per [`BATCH_ROWS`] rows amortises the
/// statement lookup and the VM start-up that otherwise cost as much as the row itself; text
/// columns are formatted into one reused buffer, so steady state allocates nothing.
#[derive(Default)]
struct Batch {
    text: String,
    rows: Vec<Pending>,
}

struct Pending {
    id: u64,
    event: &'static str,
    event_type: &'static str,
    name: Range<usize>,
    ts_ns: u64,
    pid: u32,
    tid: u32,
    device: Range<usize>,
    ptr: Range<usize>,
    attr: Range<usize>,
}

/// Rows per INSERT statement (12 parameters each, well under SQLite's 32766-parameter limit).
const BATCH_ROWS: usize = 256;

impl DbSink {
    pub fn create(path: &Path, meta: &Meta) -> Result<Self, StoreError> {
        tune_sqlite_once();
        let err = |source| StoreError::Sqlite { path: path.to_owned(), source };
        let conn = Connection::open(path).map_err(err)?;
        // WAL: committed rows survive a SIGKILL of the tracer and readers never block it.
        // synchronous=NORMAL: a commit costs no fsync; only a power loss can drop the last ones.
        // A 32 MiB page cache holds a second's worth of rows, so pages are not spilled mid-batch.
        conn.pragma_update(None, "journal_mode", "WAL").map_err(err)?;
        conn.pragma_update(None, "synchronous", "NORMAL").map_err(err)?;
        conn.pragma_update(None, "wal_autocheckpoint", 8192).map_err(err)?;
        conn.pragma_update(None, "cache_size", -32768).map_err(err)?;
        conn.execute_batch(&schema::create_dump_table()).map_err(err)?;
        conn.execute_batch(&schema::create_rows_table(schema::UNTRACKED_FREES_TABLE)).map_err(err)?;
        conn.execute_batch(schema::OWN_TABLES).map_err(err)?;
        let sink = Self { full: None, single: None, conn, path: path.to_owned(), batch: Batch::default() };
        sink.write_meta(meta)?;
        sink.conn.execute_batch("BEGIN").map_err(err)?;
        Ok(sink)
    }

    fn err(&self) -> impl Fn(rusqlite::Error) -> StoreError + '_ {
        move |source| StoreError::Sqlite { path: self.path.clone(), source }
    }

    fn write_meta(&self, meta: &Meta) -> Result<(), StoreError> {
        let mut stmt = self
            .conn
            .prepare_cached("INSERT OR REPLACE INTO ms_meta (key, value) VALUES (?1, ?2)")
            .map_err(self.err())?;
        stmt.execute(params!["schema_version", SCHEMA_VERSION.to_string()]).map_err(self.err())?;
        for (k, v) in meta {
            stmt.execute(params![k, v]).map_err(self.err())?;
        }
        Ok(())
    }

    /// Inserts the batched rows: full statements first, then one row at a time for the rest.
    fn flush(&mut self) -> Result<(), StoreError> {
        let Self { full, single, conn, path, batch } = self;
        let err = |source| StoreError::Sqlite { path: path.clone(), source };
        for chunk in batch.rows.chunks(BATCH_ROWS) {
            let slot = if chunk.len() == BATCH_ROWS { &mut *full } else { &mut *single };
            let rows_per_statement = if chunk.len() == BATCH_ROWS { BATCH_ROWS } else { 1 };
            if slot.is_none() {
                *slot = Some(RawStatement::prepare(conn, &schema::insert_dump_rows(rows_per_statement)).map_err(err)?);
            }
            let stmt = slot.as_mut().expect("prepared above");
            let text = batch.text.as_str();
            for rows in chunk.chunks(rows_per_statement) {
                let params = rows.iter().flat_map(|row| {
                    [
                        Param::Int(row.id as i64),
                        Param::Text(row.event),
                        Param::Text(row.event_type),
                        Param::Text(&text[row.name.clone()]),
                        Param::Int(row.ts_ns as i64),
                        Param::Int(row.pid.into()),
                        Param::Int(row.tid.into()),
                        Param::Text(&text[row.device.clone()]),
                        Param::Text(&text[row.ptr.clone()]),
                        Param::Text(&text[row.attr.clone()]),
                        Param::Text(""),
                        Param::Text(""),
                    ]
                });
                stmt.execute(params).map_err(err)?;
            }
        }
        batch.rows.clear();
        batch.text.clear();
        Ok(())
    }
}

impl Sink for DbSink {
    fn insert(&mut self, id: u64, row: &Row) -> Result<(), StoreError> {
        let text = &mut self.batch.text;
        let span = |text: &mut String, f: &dyn Fn(&mut String)| {
            let start = text.len();
            f(text);
            start..text.len()
        };
        let device = span(text, &|t| row.write_device_id(t));
        let ptr = span(text, &|t| row.write_ptr(t));
        let attr = span(text, &|t| row.attr.write_json(t));
        let name = span(text, &|t| t.push_str(&row.name));
        self.batch.rows.push(Pending {
            id,
            event: row.event,
            event_type: row.event_type,
            name,
            ts_ns: row.ts_ns,
            pid: row.pid,
            tid: row.tid,
            device,
            ptr,
            attr,
        });
        if self.batch.rows.len() >= BATCH_ROWS {
            self.flush()?;
        }
        Ok(())
    }

    fn insert_untracked(&mut self, id: u64, row: &Row) -> Result<(), StoreError> {
        // Rare (frees of blocks from before an attach): one statement per row is enough.
        let mut attr = String::new();
        row.attr.write_json(&mut attr);
        let mut stmt =
            self.conn.prepare_cached(&schema::insert_rows(schema::UNTRACKED_FREES_TABLE, 1)).map_err(self.err())?;
        stmt.execute(params![
            id as i64,
            row.event,
            row.event_type,
            row.name.as_ref(),
            row.ts_ns as i64,
            row.pid,
            row.tid,
            row.device_id(),
            row.ptr_text(),
            attr,
            "",
            "",
        ])
        .map_err(self.err())?;
        Ok(())
    }

    fn update_owner(&mut self, id: u64, owner: &str) -> Result<(), StoreError> {
        // The row may still be in the batch.
        self.flush()?;
        // Rows are appended to a fresh table in ID order, so a row's rowid is its ID: found by
        // rowid, the row is one B-tree lookup away, where `ID = ?` alone (no index) scans the
        // whole table per retag (0.6 s on 2 M rows). The `ID` term keeps it right regardless,
        // and the scan remains the fallback.
        let by_rowid = self
            .conn
            .prepare_cached(
                "UPDATE memscope_dump SET Attr = json_set(Attr, '$.owner', ?1) WHERE rowid = ?2 AND ID = ?2",
            )
            .map_err(self.err())?
            .execute(params![owner, id as i64])
            .map_err(self.err())?;
        if by_rowid == 0 {
            let mut stmt = self
                .conn
                .prepare_cached("UPDATE memscope_dump SET Attr = json_set(Attr, '$.owner', ?1) WHERE ID = ?2")
                .map_err(self.err())?;
            stmt.execute(params![owner, id as i64]).map_err(self.err())?;
        }
        Ok(())
    }

    fn set_meta(&mut self, meta: &Meta) -> Result<(), StoreError> {
        self.write_meta(meta)
    }

    fn commit(&mut self) -> Result<(), StoreError> {
        self.flush()?;
        self.conn.execute_batch("COMMIT; BEGIN").map_err(self.err())
    }

    fn add_probes(&mut self, probes: &[ProbeRow]) -> Result<(), StoreError> {
        let mut stmt = self
            .conn
            .prepare_cached(
                "INSERT INTO ms_probes (library, symbol, api, file_offset, source, attached_ns) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            )
            .map_err(self.err())?;
        for p in probes {
            stmt.execute(params![
                p.library,
                p.symbol,
                p.api,
                p.file_offset as i64,
                p.source,
                p.attached_wall_ns as i64
            ])
            .map_err(self.err())?;
        }
        Ok(())
    }

    fn finish(mut self: Box<Self>, meta: &Meta, lost_per_cpu: &[u64]) -> Result<PathBuf, StoreError> {
        self.flush()?;
        self.write_meta(meta)?;
        {
            let mut stmt = self
                .conn
                .prepare_cached("INSERT OR REPLACE INTO ms_lost (cpu, lost) VALUES (?1, ?2)")
                .map_err(self.err())?;
            for (cpu, lost) in lost_per_cpu.iter().enumerate() {
                stmt.execute(params![cpu as i64, *lost as i64]).map_err(self.err())?;
            }
        }
        self.conn.execute_batch("COMMIT").map_err(self.err())?;
        // Fold the WAL back into the main file and leave WAL mode, so the .db alone is the whole
        // trace (Insight opens one file, and may copy it without its -wal).
        self.conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(())).map_err(self.err())?;
        self.conn.pragma_update(None, "journal_mode", "DELETE").map_err(self.err())?;
        let path = self.path.clone();
        let Self { full, single, conn, .. } = *self;
        drop((full, single));
        conn.close().map_err(|(_, source)| StoreError::Sqlite { path: path.clone(), source })?;
        Ok(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::DeviceKey;
    use crate::store::schema::{DUMP_COLUMNS, INSIGHT_OWNED_TABLES};
    use crate::store::Attr;

    /// The column list as shared/reference/msmemscope-and-insight.md §3.2-3.3 gives it: Insight
    /// reads columns by position, so both names and order are the contract.
    const INSIGHT_COLUMNS: [&str; 12] = [
        "ID",
        "Event",
        "Event Type",
        "Name",
        "Timestamp(ns)",
        "Process Id",
        "Thread Id",
        "Device Id",
        "Ptr",
        "Attr",
        "Call Stack(Python)",
        "Call Stack(C)",
    ];

    fn tmp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("memscope-sqlite-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("memscope_dump_20260101000000.db")
    }

    fn row(ts: u64) -> Row {
        Row {
            event: "MALLOC",
            event_type: "HAL",
            name: "aclrtMalloc".into(),
            ts_ns: ts,
            pid: 1,
            tid: 2,
            device: DeviceKey::Npu(0),
            ptr: Some(0x10),
            attr: Attr::new().with("size", 8u64),
            broadcast: false,
        }
    }

    #[test]
    fn schema_matches_insight_and_leaves_its_tables_alone() {
        let path = tmp("schema");
        let mut sink = Box::new(DbSink::create(&path, &vec![("mode".into(), "attach".into())]).unwrap());
        sink.insert(1, &row(5)).unwrap();
        sink.finish(&vec![], &[0, 3]).unwrap();
        let conn = Connection::open(&path).unwrap();
        let cols: Vec<(String, String)> = conn
            .prepare("SELECT name, type FROM pragma_table_info('memscope_dump') ORDER BY cid")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        let names: Vec<&str> = cols.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, INSIGHT_COLUMNS);
        assert_eq!(cols.len(), DUMP_COLUMNS.len());
        assert_eq!(cols[0].1, "INTEGER");
        assert_eq!(cols[4].1, "INTEGER");
        for t in INSIGHT_OWNED_TABLES {
            let n: i64 =
                conn.query_row("SELECT count(*) FROM sqlite_master WHERE name = ?1", [t], |r| r.get(0)).unwrap();
            assert_eq!(n, 0, "{t} must be left to Insight");
        }
        // Insight's device query and its Attr getter.
        let (ptr, attr): (String, String) = conn
            .query_row(
                "SELECT Ptr, Attr FROM memscope_dump WHERE \"Device Id\" NOT IN ('N/A','','host') ORDER BY \"Timestamp(ns)\"",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap();
        assert_eq!(ptr, "0x0000000000000010");
        assert_eq!(attr, r#"{"size":"8"}"#);
        let lost: i64 = conn.query_row("SELECT sum(lost) FROM ms_lost", [], |r| r.get(0)).unwrap();
        assert_eq!(lost, 3);
        let mode: String = conn.query_row("SELECT value FROM ms_meta WHERE key='mode'", [], |r| r.get(0)).unwrap();
        assert_eq!(mode, "attach");
        let journal: String = conn.query_row("PRAGMA journal_mode", [], |r| r.get(0)).unwrap();
        assert_eq!(journal, "delete", "a finished DB is one self-contained file");
    }

    #[test]
    fn owner_update_finds_a_row_whose_rowid_is_not_its_id() {
        let path = tmp("owner-id");
        let mut sink = Box::new(DbSink::create(&path, &vec![]).unwrap());
        // IDs 7 and 1 get rowids 1 and 2: the rowid lookup of ID 1 meets row 7 and must not
        // touch it, and ID 7 is only found by its ID.
        sink.insert(7, &row(7)).unwrap();
        sink.insert(1, &row(1)).unwrap();
        sink.update_owner(1, "PTA@a").unwrap();
        sink.update_owner(7, "PTA@b").unwrap();
        let path = sink.finish(&vec![], &[]).unwrap();
        let conn = rusqlite::Connection::open(&path).unwrap();
        let owners: Vec<(i64, String)> = conn
            .prepare("SELECT ID, json_extract(Attr, '$.owner') FROM memscope_dump ORDER BY ID")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(owners, [(1, "PTA@a".to_owned()), (7, "PTA@b".to_owned())]);
    }

    #[test]
    fn owner_update_rewrites_only_that_rows_owner_even_while_batched() {
        let path = tmp("owner");
        let mut sink = Box::new(DbSink::create(&path, &vec![]).unwrap());
        let mut tagged = row(1);
        tagged.attr = Attr::new().with("size", 8u64).with("owner", "PTA").with("used", 8u64);
        sink.insert(1, &tagged).unwrap();
        sink.insert(2, &row(2)).unwrap();
        sink.update_owner(1, "PTA@kv_cache").unwrap();
        sink.update_owner(2, "HOST@weight").unwrap();
        let path = sink.finish(&vec![], &[]).unwrap();
        let conn = rusqlite::Connection::open(&path).unwrap();
        let attrs: Vec<String> = conn
            .prepare("SELECT Attr FROM memscope_dump ORDER BY ID")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(attrs[0], r#"{"size":"8","owner":"PTA@kv_cache","used":"8"}"#, "in place, compact, other keys kept");
        assert_eq!(attrs[1], r#"{"size":"8","owner":"HOST@weight"}"#, "added when the row had none");
    }

    #[test]
    fn batches_keep_every_row_in_order() {
        let path = tmp("batches");
        let mut sink = Box::new(DbSink::create(&path, &vec![]).unwrap());
        let n = BATCH_ROWS as u64 * 2 + 17;
        for id in 1..=n {
            let mut r = row(id * 10);
            r.ptr = Some(id);
            r.device = if id % 2 == 0 { DeviceKey::Npu(1) } else { DeviceKey::Cpu };
            sink.insert(id, &r).unwrap();
        }
        sink.finish(&vec![], &[]).unwrap();
        let conn = Connection::open(&path).unwrap();
        let rows: Vec<(i64, i64, String, String)> = conn
            .prepare("SELECT ID, \"Timestamp(ns)\", \"Device Id\", Ptr FROM memscope_dump ORDER BY rowid")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(rows.len() as u64, n);
        for (i, (id, ts, dev, ptr)) in rows.iter().enumerate() {
            let want = i as i64 + 1;
            assert_eq!((*id, *ts), (want, want * 10));
            assert_eq!(dev, if want % 2 == 0 { "1" } else { "cpu" });
            assert_eq!(ptr, &format!("0x{want:016x}"));
        }
    }

    #[test]
    fn committed_rows_are_visible_before_finish() {
        let path = tmp("commit");
        let mut sink = DbSink::create(&path, &vec![]).unwrap();
        sink.insert(1, &row(1)).unwrap();
        sink.commit().unwrap();
        sink.insert(2, &row(2)).unwrap();
        // A second connection (as after a crash of the tracer) sees the committed row only.
        let reader = Connection::open(&path).unwrap();
        let n: i64 = reader.query_row("SELECT count(*) FROM memscope_dump", [], |r| r.get(0)).unwrap();
        assert_eq!(n, 1);
        drop(sink);
    }
}
