//! The two writers against each other, and the page writer's fallbacks, read back by SQLite: the
//! same row stream through the pages and through SQL must give the same table, row for row.

use std::path::{Path, PathBuf};

use rusqlite::Connection;

use crate::model::DeviceKey;
use crate::store::batch::{single, RowText};
use crate::store::insight::Head;
use crate::store::sqlite::DbSink;
use crate::store::{Attr, DbWriter, Format, Row, Sink};
use crate::vocab::{Event, EventType};

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memscope-writers-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("memscope_dump_20260101000000.db")
}

/// Lengths that cross every boundary the pages have: empty, one byte, short, around the most a
/// 64 KiB leaf keeps in place (about 64 KiB less a few header bytes), and overflow chains of one
/// to several pages.
const LENGTHS: [usize; 14] =
    [0, 1, 90, 4_000, 16_000, 65_400, 65_450, 65_500, 65_536, 65_600, 131_072, 200_000, 300, 7];

fn text_of(len: usize, seed: usize) -> String {
    // Multi-byte characters too: lengths are counted in bytes.
    let alphabet = ['a', 'z', '0', '€', '中', '"', '{', ','];
    let mut s = String::with_capacity(len);
    let mut i = seed;
    while s.len() + 4 <= len {
        s.push(alphabet[i % alphabet.len()]);
        i = i.wrapping_mul(31).wrapping_add(7);
    }
    while s.len() < len {
        s.push('x');
    }
    s
}

/// The owner's, the Python stack's and the native stack's lengths of row `id`: [`LENGTHS`]
/// mixed, then payloads a byte apart across the most a leaf cell keeps in place, and across the
/// point where the part kept in place drops back to its minimum (one overflow page further on).
fn lengths(id: usize) -> (usize, usize, usize) {
    match id {
        0..=140 => {
            let len = LENGTHS[id % LENGTHS.len()];
            (len / 4, len / 2, len)
        }
        141..=340 => (10, 0, 65_380 + (id - 141)),
        _ => (10, 0, 130_912 + (id - 341)),
    }
}

fn write(path: &Path, writer: DbWriter, rows: usize) -> Box<DbSink> {
    let mut sink = Box::new(DbSink::create(path, DeviceKey::Npu(0), &vec![], writer).unwrap());
    for id in 1..=rows {
        let (owner, py, c) = lengths(id);
        let head = Head {
            event: Event::parse("MALLOC").unwrap(),
            event_type: EventType::parse("HAL").unwrap(),
            ts_ns: id as u64 * 1_000 + (id as u64 % 3) * (1 << 40),
            pid: id as u32 % 2,
            tid: u32::MAX - id as u32,
            device: DeviceKey::Npu(0),
            ptr: Some(0x7f00_0000_0000 + id as u64),
            broadcast: false,
            untracked: false,
            shadow: false,
        };
        let attr = Attr::new().with("size", id as u64).with("owner", text_of(owner, id));
        let row = Row { head, name: "aclrtMalloc".into(), attr };
        let batch = single(&row, Format::Db);
        let (py, c) = (text_of(py, id + 1), text_of(c, id + 2));
        sink.insert(id as u64, RowText { py_text: &py, c_stack: &c, ..batch.get(0) }).unwrap();
        if id % 37 == 0 {
            sink.commit().unwrap();
        }
    }
    sink
}

fn table(path: &Path) -> Vec<Vec<rusqlite::types::Value>> {
    let conn = Connection::open(path).unwrap();
    let ok: String = conn.query_row("PRAGMA integrity_check", [], |r| r.get(0)).unwrap();
    assert_eq!(ok, "ok", "{}", path.display());
    let mut stmt = conn.prepare("SELECT rowid, * FROM memscope_dump ORDER BY rowid").unwrap();
    let n = stmt.column_count();
    stmt.query_map([], |r| (0..n).map(|i| r.get(i)).collect()).unwrap().map(Result::unwrap).collect()
}

/// What the page writer's DBs say they used: "sql" in a build without `sqlite_dbpage`.
fn pages_or_fallback() -> &'static str {
    if DbWriter::unavailable_here().is_some() {
        "sql"
    } else {
        "pages"
    }
}

fn meta(path: &Path, key: &str) -> Option<String> {
    let conn = Connection::open(path).unwrap();
    conn.query_row("SELECT value FROM ms_meta WHERE key = ?1", [key], |r| r.get(0)).ok()
}

#[test]
fn the_same_rows_through_pages_and_through_sql_give_the_same_table() {
    let (pages, sql) = (tmp("pages"), tmp("sql"));
    write(&pages, DbWriter::Pages, 540).finish(&vec![], &[]).unwrap();
    write(&sql, DbWriter::Sql, 540).finish(&vec![], &[]).unwrap();
    let (a, b) = (table(&pages), table(&sql));
    assert_eq!(a.len(), 540);
    for (x, y) in a.iter().zip(&b) {
        assert!(x == y, "row {:?} differs", x[0]);
    }
    assert_eq!(meta(&pages, "writer").as_deref(), Some(pages_or_fallback()));
    assert_eq!(meta(&pages, "writer_sql_transactions"), None, "alone, every transaction went through the pages");
    assert_eq!(meta(&sql, "writer").as_deref(), Some("sql"));
    assert!(meta(&sql, "writer_why").unwrap().contains("--writer sql"));
}

#[test]
fn a_db_the_pages_cannot_serve_is_written_through_sql() {
    // auto_vacuum keeps pointer-map pages the page writer does not maintain: the file is there
    // before the sink (as a user's or another tool's), so the writer must notice and use SQL.
    let path = tmp("autovacuum");
    let conn = Connection::open(&path).unwrap();
    conn.execute_batch("PRAGMA page_size = 65536; PRAGMA auto_vacuum = FULL; CREATE TABLE other (v)").unwrap();
    drop(conn);
    write(&path, DbWriter::Pages, 120).finish(&vec![], &[]).unwrap();
    assert_eq!(table(&path).len(), 120);
    assert_eq!(meta(&path, "writer").as_deref(), Some("sql"));
    let why = meta(&path, "writer_why").unwrap();
    assert!(why.contains("auto_vacuum") || pages_or_fallback() == "sql", "{why}");
}

#[test]
fn while_another_process_reads_the_live_db_rows_go_through_sql_and_all_read_back() {
    // Python's SQLite holds the DB open from the first commit on: every later transaction is
    // written through SQL; when it has gone, the pages take over again from the table SQL left.
    let (path, alone) = (tmp("shared"), tmp("alone"));
    let mut sink = write(&path, DbWriter::Pages, 40);
    sink.commit().unwrap();
    let script = "import sqlite3, sys\nc = sqlite3.connect(sys.argv[1])\n\
        c.execute('SELECT count(*) FROM memscope_dump').fetchall()\nprint('open', flush=True)\nsys.stdin.read()\n";
    let Some((mut child, line)) = crate::store::python_peer::spawn(script, &path) else { return };
    assert_eq!(line, "open");
    // The stream goes on where `write` left it (ids 41..): same rows as a sink written alone.
    let more = |sink: &mut Box<DbSink>, from: usize| {
        for id in from..from + 80 {
            let len = LENGTHS[id % LENGTHS.len()];
            let text = text_of(len, id);
            let head = Head {
                event: Event::parse("FREE").unwrap(),
                event_type: EventType::parse("HAL").unwrap(),
                ts_ns: id as u64,
                pid: 1,
                tid: 1,
                device: DeviceKey::Npu(0),
                ptr: Some(id as u64),
                broadcast: false,
                untracked: false,
                shadow: false,
            };
            let row = Row { head, name: "aclrtFree".into(), attr: Attr::new().with("owner", text) };
            sink.insert(id as u64, single(&row, Format::Db).get(0)).unwrap();
            if id % 20 == 0 {
                sink.commit().unwrap();
            }
        }
    };
    more(&mut sink, 41);
    drop(child.stdin.take());
    child.wait().unwrap();
    more(&mut sink, 121);
    sink.finish(&vec![], &[]).unwrap();
    let mut reference = write(&alone, DbWriter::Sql, 40);
    more(&mut reference, 41);
    more(&mut reference, 121);
    reference.finish(&vec![], &[]).unwrap();
    assert!(table(&path) == table(&alone), "the same rows as a DB written alone");
    if pages_or_fallback() == "pages" {
        let shared: u64 = meta(&path, "writer_sql_transactions").unwrap().parse().unwrap();
        assert!(shared >= 4, "the transactions while Python had the DB open went through SQL ({shared})");
    }
    assert_eq!(meta(&path, "writer").as_deref(), Some(pages_or_fallback()));
}

#[test]
fn a_build_without_sqlite_dbpage_writes_every_row_through_sql_and_says_why() {
    // `cargo xtask test` also builds this crate without the workspace's LIBSQLITE3_FLAGS, as
    // `cargo install --git` or a packager would, and runs this test there with the variable set.
    let expect_none = std::env::var_os("MEMSCOPE_EXPECT_NO_DBPAGE").is_some();
    let missing = DbWriter::unavailable_here();
    assert_eq!(missing.is_some(), expect_none, "this build's sqlite_dbpage: {missing:?}");
    let path = tmp("no-dbpage");
    write(&path, DbWriter::Pages, 140).finish(&vec![], &[]).unwrap();
    assert_eq!(table(&path).len(), 140);
    match missing {
        Some(_) => {
            assert_eq!(meta(&path, "writer").as_deref(), Some("sql"));
            let why = meta(&path, "writer_why").unwrap();
            assert!(why.contains("sqlite_dbpage") && why.contains("LIBSQLITE3_FLAGS"), "{why}");
        }
        None => assert_eq!(meta(&path, "writer").as_deref(), Some("pages")),
    }
}

#[test]
fn readers_polling_the_live_db_cannot_make_the_stop_fail() {
    // Two loops of read-only readers (as `sqlite3 -readonly` polled by a user), each opening,
    // querying and closing, across the stop: the stop must finish the DB with every row.
    let path = tmp("readers");
    let mut sink = write(&path, DbWriter::Pages, 300);
    sink.commit().unwrap();
    let script = "import sqlite3, sys, time\n\
        end = time.time() + 30\n\
        print('reading', flush=True)\n\
        while time.time() < end:\n\
        \x20   try:\n\
        \x20       c = sqlite3.connect('file:' + sys.argv[1] + '?mode=ro', uri=True, timeout=0)\n\
        \x20       c.execute('BEGIN'); c.execute('SELECT count(*), max(length(Attr)) FROM memscope_dump').fetchall()\n\
        \x20       c.close()\n\
        \x20   except sqlite3.Error:\n\
        \x20       pass\n";
    let mut readers = Vec::new();
    for _ in 0..2 {
        let Some((child, _)) = crate::store::python_peer::spawn(script, &path) else { return };
        readers.push(child);
    }
    std::thread::sleep(std::time::Duration::from_millis(200));
    sink.stopping().unwrap();
    let finished = sink.finish(&vec![("stop".into(), "yes".into())], &[]);
    for mut r in readers {
        let _ = r.kill();
        let _ = r.wait();
    }
    finished.unwrap();
    // Whole either way: folded into one file, or in WAL mode with its -wal beside it.
    assert_eq!(table(&path).len(), 300);
    assert_eq!(meta(&path, "stop").as_deref(), Some("yes"));
}

/// `cargo xtask bench --writers-only`: rows per second through each writer, in the same run, and
/// what a commit costs now that it syncs (the pages, then the WAL). Not a test: figures for
/// docs/benchmarks.md.
#[test]
#[ignore = "a benchmark, run by `cargo xtask bench --writers-only`"]
fn bench_writers() {
    let rows: u64 = std::env::var("MEMSCOPE_BENCH_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(2_000_000);
    for writer in [DbWriter::Pages, DbWriter::Sql, DbWriter::Pages, DbWriter::Sql] {
        let path = tmp(&format!("bench-{writer:?}"));
        let started = std::time::Instant::now();
        let mut sink = Box::new(DbSink::create(&path, DeviceKey::Npu(0), &vec![], writer).unwrap());
        let mut commits = Vec::new();
        for id in 1..=rows {
            let head = Head {
                event: Event::parse(if id % 2 == 0 { "FREE" } else { "MALLOC" }).unwrap(),
                event_type: EventType::parse("PTA").unwrap(),
                ts_ns: id * 700,
                pid: 4242,
                tid: 4242 + (id % 8) as u32,
                device: DeviceKey::Npu(0),
                ptr: Some(0x1240_0000_0000 + (id % 100_000) * 512),
                broadcast: false,
                untracked: false,
                shadow: false,
            };
            let attr = Attr::new()
                .with("allocation_id", id)
                .with("addr", 0x1240_0000_0000 + (id % 100_000) * 512)
                .with("size", 512 * (id % 4096))
                .with("owner", "PTA@model@weight")
                .with("total", 1u64 << 34)
                .with("used", 1u64 << 33);
            let row = Row { head, name: "aclrtMalloc".into(), attr };
            sink.insert(id, single(&row, Format::Db).get(0)).unwrap();
            if id % 50_000 == 0 {
                let at = std::time::Instant::now();
                sink.commit().unwrap();
                commits.push(at.elapsed());
            }
        }
        sink.finish(&vec![], &[]).unwrap();
        let secs = started.elapsed().as_secs_f64();
        commits.sort();
        let median = commits[commits.len() / 2];
        println!(
            "writer {:<5} {rows} rows in {secs:.2} s = {:.0} rows/s; commit (sync of the pages and the WAL) median {:.1} ms, max {:.1} ms over {}",
            format!("{writer:?}").to_lowercase(),
            rows as f64 / secs,
            median.as_secs_f64() * 1e3,
            commits.last().unwrap().as_secs_f64() * 1e3,
            commits.len()
        );
        let _ = std::fs::remove_dir_all(path.parent().unwrap());
    }
}
