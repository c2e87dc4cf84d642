//! The pages built by hand, checked by SQLite itself: `PRAGMA integrity_check` (structure, key
//! order, free space, every page used once, freelist count) and the rows it reads back, against
//! the rows the test fed in.

use std::path::PathBuf;

use rusqlite::Connection;

use super::*;

/// A reproducible stream of numbers (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Clone, Debug, PartialEq)]
struct Row {
    id: i64,
    name: String,
    attr: String,
}

fn db(name: &str, page_size: u32) -> (PathBuf, Connection) {
    let dir = std::env::temp_dir().join(format!("memscope-bulk-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.db");
    let conn = Connection::open(&path).unwrap();
    conn.pragma_update(None, "page_size", page_size).unwrap();
    conn.pragma_update(None, "journal_mode", "WAL").unwrap();
    conn.execute_batch("CREATE TABLE t (id INTEGER, name TEXT, n INTEGER, attr TEXT, empty TEXT)").unwrap();
    (path, conn)
}

fn random_row(rng: &mut Rng, id: i64) -> Row {
    // Mostly short rows, some long enough to overflow a page (the longest span several pages).
    let len = match rng.below(100) {
        0 => 4_000 + rng.below(150_000),
        1..=9 => rng.below(2_000),
        _ => rng.below(300),
    } as usize;
    let attr: String = (0..len).map(|i| char::from(b'a' + ((i as u64 + rng.below(3)) % 26) as u8)).collect();
    Row { id, name: format!("row-{id}"), attr }
}

fn n_of(id: i64) -> i64 {
    // Every integer width SQLite has, both signs.
    let widths = [0i64, 1, -1, 127, -129, 32_000, 8_000_000, -2_000_000_000, 1 << 40, i64::MIN, i64::MAX];
    widths[id as usize % widths.len()].wrapping_add(if id % 7 == 0 { 0 } else { id })
}

fn append(bulk: &mut BulkTable, row: &Row) -> i64 {
    bulk.append(&[Col::Int(row.id), Col::Text(&row.name), Col::Int(n_of(row.id)), Col::Text(&row.attr), Col::Text("")])
        .unwrap()
}

fn check(conn: &Connection, want: &[Row]) {
    let ok: String = conn.query_row("PRAGMA integrity_check", [], |r| r.get(0)).unwrap();
    assert_eq!(ok, "ok");
    let mut stmt = conn.prepare("SELECT rowid, id, name, n, attr, empty FROM t ORDER BY rowid").unwrap();
    let got: Vec<(i64, Row, i64, String)> = stmt
        .query_map([], |r| {
            Ok((r.get(0)?, Row { id: r.get(1)?, name: r.get(2)?, attr: r.get(4)? }, r.get(3)?, r.get(5)?))
        })
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(got.len(), want.len());
    for ((rowid, row, n, empty), w) in got.iter().zip(want) {
        assert_eq!((row, *n, empty.as_str()), (w, n_of(w.id), ""), "rowid {rowid}");
        assert_eq!(*rowid, w.id, "rowids are 1, 2, 3, ... in append order");
    }
    // SQLite's own lookups by rowid descend through the interior pages built here.
    for w in want.iter().step_by(97) {
        let name: String = conn.query_row("SELECT name FROM t WHERE rowid = ?1", [w.id], |r| r.get(0)).unwrap();
        assert_eq!(name, w.name);
    }
}

fn begin(conn: &Connection, bulk: &mut BulkTable) {
    conn.execute_batch("BEGIN IMMEDIATE").unwrap();
    bulk.begin(conn).unwrap();
}

fn commit(conn: &Connection, bulk: &mut BulkTable) {
    bulk.seal(conn).unwrap();
    conn.execute_batch("COMMIT").unwrap();
}

#[test]
fn rows_of_every_size_read_back_whole_across_commits() {
    for page_size in [512u32, 4096, 65_536] {
        let (path, conn) = db(&format!("sizes-{page_size}"), page_size);
        let mut bulk = BulkTable::open(&conn, &path, "t").unwrap();
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ u64::from(page_size));
        let mut want = Vec::new();
        let rows = if page_size == 512 { 3_000 } else { 6_000 };
        begin(&conn, &mut bulk);
        for id in 1..=rows {
            let row = random_row(&mut rng, id);
            assert_eq!(append(&mut bulk, &row), id);
            want.push(row);
            if rng.below(500) == 0 {
                commit(&conn, &mut bulk);
                check(&conn, &want);
                begin(&conn, &mut bulk);
            }
        }
        commit(&conn, &mut bulk);
        check(&conn, &want);
        // 512-byte pages make the table three interior levels deep.
        let depth = leaf_depth_of(&conn);
        assert!(page_size != 512 || depth >= 2, "depth {depth}");
    }
}

fn leaf_depth_of(conn: &Connection) -> usize {
    let root: u32 = conn.query_row("SELECT rootpage FROM sqlite_master WHERE name = 't'", [], |r| r.get(0)).unwrap();
    let mut pgno = root;
    for depth in 0.. {
        let page = read_page(conn, pgno).unwrap();
        if page[0] == 0x0d {
            return depth;
        }
        pgno = u32::from_be_bytes(page[8..12].try_into().unwrap());
    }
    unreachable!()
}

#[test]
fn sql_changes_between_commits_are_kept_and_appending_goes_on() {
    let (path, conn) = db("sql", 4096);
    let mut bulk = BulkTable::open(&conn, &path, "t").unwrap();
    let mut rng = Rng(42);
    let mut want: Vec<Row> = Vec::new();
    let mut id = 0;
    for round in 0..40 {
        begin(&conn, &mut bulk);
        for _ in 0..rng.below(400) {
            id += 1;
            let row = random_row(&mut rng, id);
            append(&mut bulk, &row);
            want.push(row);
        }
        commit(&conn, &mut bulk);
        if round % 3 == 0 && !want.is_empty() {
            // What the sink does for an owner change: rows grow in place, leaves split, pages
            // are taken from the end of the file or the freelist.
            bulk.hand_to_sql(&conn, true);
            conn.execute_batch("BEGIN IMMEDIATE").unwrap();
            for _ in 0..20 {
                let target = 1 + rng.below(want.len() as u64) as usize;
                let grow = "x".repeat(rng.below(900) as usize);
                conn.execute("UPDATE t SET attr = attr || ?1 WHERE rowid = ?2", rusqlite::params![grow, target])
                    .unwrap();
                want[target - 1].attr.push_str(&grow);
            }
            // Other tables of the file grow too.
            conn.execute_batch(
                "CREATE TABLE IF NOT EXISTS other (v TEXT); INSERT INTO other VALUES (randomblob(9000));",
            )
            .unwrap();
            conn.execute_batch("COMMIT").unwrap();
        }
        check(&conn, &want);
    }
    assert!(id > 2_000, "{id} rows");
}

#[test]
fn a_reader_sees_each_commit_whole() {
    let (path, conn) = db("reader", 65_536);
    let mut bulk = BulkTable::open(&conn, &path, "t").unwrap();
    let reader = Connection::open(&path).unwrap();
    let mut rng = Rng(7);
    let mut want = Vec::new();
    begin(&conn, &mut bulk);
    for id in 1..=20_000 {
        let row = random_row(&mut rng, id);
        append(&mut bulk, &row);
        want.push(row);
        if id % 5_000 == 0 {
            // Before the commit the reader sees the last commit only; after it, everything.
            let before: i64 = reader.query_row("SELECT count(*) FROM t", [], |r| r.get(0)).unwrap();
            assert_eq!(before, id - 5_000);
            commit(&conn, &mut bulk);
            check(&reader, &want);
            begin(&conn, &mut bulk);
        }
    }
    commit(&conn, &mut bulk);
}

/// Runs `name` in a process of its own: SQLite's pending byte is process-wide.
fn in_child(name: &str) -> bool {
    if std::env::var_os("MEMSCOPE_BULK_CHILD").is_some() {
        return true;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env("MEMSCOPE_BULK_CHILD", "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("1 passed"), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    false
}

#[test]
fn the_pending_byte_page_is_skipped() {
    if !in_child("store::bulk::tests::the_pending_byte_page_is_skipped") {
        return;
    }
    // Move SQLite's lock byte from 1 GiB to 256 KiB (page 65 of 4 KiB pages), before any
    // connection exists in this process, so a small table crosses it.
    const PENDING: u64 = 0x4_0000;
    // SAFETY: test-control call with an int argument, made before SQLite is used here.
    unsafe { rusqlite::ffi::sqlite3_test_control(rusqlite::ffi::SQLITE_TESTCTRL_PENDING_BYTE, PENDING as i32) };
    let (path, conn) = db("pending", 4096);
    let mut bulk = BulkTable::open_with_pending_byte(&conn, &path, "t", PENDING).unwrap();
    let mut rng = Rng(3);
    let mut want = Vec::new();
    begin(&conn, &mut bulk);
    for id in 1..=3_000 {
        let row = random_row(&mut rng, id);
        append(&mut bulk, &row);
        want.push(row);
    }
    commit(&conn, &mut bulk);
    let pages: u32 = conn.query_row("PRAGMA page_count", [], |r| r.get(0)).unwrap();
    assert!(pages > 65 * 2, "the table spans the pending page ({pages} pages)");
    check(&conn, &want);
}

#[test]
fn a_table_sql_thinned_is_rebuilt_and_appending_goes_on() {
    // 512-byte pages: thousands of rows make a three-level table. SQL then deletes most rows
    // (SQLite merges leaves and interior pages); appending resumes after the largest rowid left.
    let (path, conn) = db("thinned", 512);
    let mut bulk = BulkTable::open(&conn, &path, "t").unwrap();
    let mut rng = Rng(11);
    let mut want = Vec::new();
    begin(&conn, &mut bulk);
    for id in 1..=6_000 {
        let row = Row { id, name: format!("r{id}"), attr: "a".repeat(rng.below(40) as usize) };
        append(&mut bulk, &row);
        want.push(row);
    }
    commit(&conn, &mut bulk);
    bulk.hand_to_sql(&conn, true);
    conn.execute_batch("DELETE FROM t WHERE rowid % 3 != 0 OR rowid > 2000").unwrap();
    want.retain(|r| r.id % 3 == 0 && r.id <= 2000);
    // New rowids follow the largest left, as SQLite's own would.
    let next = want.last().unwrap().id + 1;
    begin(&conn, &mut bulk);
    for id in next..next + 500 {
        let row = Row { id, name: format!("r{id}"), attr: String::new() };
        append(&mut bulk, &row);
        want.push(row);
    }
    commit(&conn, &mut bulk);
    check(&conn, &want);
}

#[test]
fn interior_pages_a_table_no_longer_needs_go_on_the_freelist() {
    let (path, conn) = db("spare", 4096);
    let mut bulk = BulkTable::open(&conn, &path, "t").unwrap();
    let mut want = Vec::new();
    begin(&conn, &mut bulk);
    for id in 1..=50 {
        let row = Row { id, name: format!("r{id}"), attr: "b".repeat(200) };
        append(&mut bulk, &row);
        want.push(row);
    }
    // Two pages an earlier shape of the table used for interior nodes (as after SQL split them).
    bulk.builder.spare_interior();
    bulk.builder.spare_interior();
    commit(&conn, &mut bulk);
    check(&conn, &want);
    let free: i64 = conn.query_row("PRAGMA freelist_count", [], |r| r.get(0)).unwrap();
    assert_eq!(free, 2);
    // SQLite takes them from the freelist for its own use.
    conn.execute_batch("CREATE TABLE other (v TEXT); INSERT INTO other VALUES (randomblob(5000));").unwrap();
    let free: i64 = conn.query_row("PRAGMA freelist_count", [], |r| r.get(0)).unwrap();
    assert_eq!(free, 0);
    check(&conn, &want);
}

#[test]
fn a_record_header_over_127_bytes_reads_back() {
    // 80 texts of 70 bytes: two-byte serial types, a 161-byte header whose length is itself a
    // two-byte varint.
    let (path, conn) = db("wide", 4096);
    let columns: Vec<String> = (0..80).map(|i| format!("c{i} TEXT")).collect();
    conn.execute_batch(&format!("CREATE TABLE wide ({})", columns.join(", "))).unwrap();
    let mut bulk = BulkTable::open(&conn, &path, "wide").unwrap();
    let values: Vec<String> = (0..80).map(|i| format!("{i:02}").repeat(35)).collect();
    let cols: Vec<Col<'_>> = values.iter().map(|v| Col::Text(v)).collect();
    begin(&conn, &mut bulk);
    for _ in 0..3 {
        bulk.append(&cols).unwrap();
    }
    commit(&conn, &mut bulk);
    let ok: String = conn.query_row("PRAGMA integrity_check", [], |r| r.get(0)).unwrap();
    assert_eq!(ok, "ok");
    let got: Vec<String> =
        conn.query_row("SELECT * FROM wide WHERE rowid = 3", [], |r| (0..80).map(|i| r.get(i)).collect()).unwrap();
    assert_eq!(got, values);
}

#[test]
fn a_writer_killed_mid_transaction_leaves_its_last_commit_whole() {
    // The child commits 2,000 rows, writes 3,000 more (full leaves go past the committed end of
    // the file), and aborts: no rollback, no close, as under SIGKILL.
    const NAME: &str = "store::bulk::tests::a_writer_killed_mid_transaction_leaves_its_last_commit_whole";
    let rows = |rng: &mut Rng| (1..=5_000).map(|id| random_row(rng, id)).collect::<Vec<_>>();
    if let Some(path) = std::env::var_os("MEMSCOPE_BULK_CRASH") {
        let conn = Connection::open(&path).unwrap();
        let mut bulk = BulkTable::open(&conn, path.as_ref(), "t").unwrap();
        let want = rows(&mut Rng(5));
        begin(&conn, &mut bulk);
        for (i, row) in want.iter().enumerate() {
            append(&mut bulk, row);
            if i + 1 == 2_000 {
                commit(&conn, &mut bulk);
                begin(&conn, &mut bulk);
            }
        }
        std::process::abort();
    }
    let (path, conn) = db(&format!("crash-{}", std::process::id()), 4096);
    drop(conn);
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", NAME, "--test-threads=1"])
        .env("MEMSCOPE_BULK_CRASH", &path)
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(!status.success(), "the child aborted");
    let size_before = std::fs::metadata(&path).unwrap().len();
    let conn = Connection::open(&path).unwrap();
    let want = rows(&mut Rng(5));
    check(&conn, &want[..2_000]);
    // The next writer's checkpoint folds the WAL and cuts the file at its committed end.
    conn.execute_batch("CREATE TABLE x (v); INSERT INTO x VALUES (1);").unwrap();
    conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(())).unwrap();
    check(&conn, &want[..2_000]);
    let size_after = std::fs::metadata(&path).unwrap().len();
    assert!(
        size_after < size_before,
        "the uncommitted pages past the end were dropped ({size_before} -> {size_after})"
    );
}

#[test]
fn while_another_process_has_the_db_open_every_page_goes_through_the_pager() {
    // An independent SQLite (Python's) holds the DB open and checkpoints it over and over. A
    // checkpoint cuts the file at its committed end, so a page written past it would be lost:
    // the writer must see the other process and write no page past the pager.
    let (path, conn) = db("other", 4096);
    let mut bulk = BulkTable::open(&conn, &path, "t").unwrap();
    let script = "import sqlite3, sys, time\n\
        c = sqlite3.connect(sys.argv[1])\n\
        c.execute('SELECT count(*) FROM t').fetchall()\n\
        print('open', flush=True)\n\
        end = time.time() + 20\n\
        while time.time() < end and sys.stdin.readable():\n\
        \x20   c.execute('PRAGMA wal_checkpoint(PASSIVE)').fetchall()\n\
        \x20   time.sleep(0.0005)\n";
    let Some((mut child, line)) = crate::store::python_peer::spawn(script, &path) else { return };
    assert_eq!(line, "open");
    let mut rng = Rng(9);
    let mut want = Vec::new();
    for round in 0..30 {
        begin(&conn, &mut bulk);
        for i in 0..300 {
            let row = random_row(&mut rng, round * 300 + i + 1);
            append(&mut bulk, &row);
            want.push(row);
        }
        commit(&conn, &mut bulk);
    }
    child.kill().unwrap();
    child.wait().unwrap();
    check(&conn, &want);
    assert_eq!(bulk.written_direct(), 0);
    // Alone again, the writer goes back to writing new pages straight into the file.
    begin(&conn, &mut bulk);
    for i in 0..300 {
        let row = random_row(&mut rng, 9_000 + i + 1);
        append(&mut bulk, &row);
        want.push(row);
    }
    commit(&conn, &mut bulk);
    check(&conn, &want);
    assert!(bulk.written_direct() > 0);
}

#[test]
fn rows_another_connection_rewrote_between_transactions_are_kept() {
    // Another connection (an `analyze` of the live trace) rewrites rows in place between two of
    // the writer's transactions, splitting leaves; the writer must notice and read the table back.
    let (path, conn) = db("foreign", 4096);
    let mut bulk = BulkTable::open(&conn, &path, "t").unwrap();
    let other = Connection::open(&path).unwrap();
    let mut rng = Rng(21);
    let mut want: Vec<Row> = Vec::new();
    let mut id = 0;
    for round in 0..20 {
        begin(&conn, &mut bulk);
        for _ in 0..200 {
            id += 1;
            let row = random_row(&mut rng, id);
            append(&mut bulk, &row);
            want.push(row);
        }
        commit(&conn, &mut bulk);
        if round % 2 == 1 {
            other.execute_batch("BEGIN IMMEDIATE").unwrap();
            for _ in 0..30 {
                let target = 1 + rng.below(want.len() as u64) as usize;
                let grow = "y".repeat(rng.below(1500) as usize);
                other
                    .execute("UPDATE t SET attr = attr || ?1 WHERE rowid = ?2", rusqlite::params![grow, target])
                    .unwrap();
                want[target - 1].attr.push_str(&grow);
            }
            other.execute_batch("COMMIT").unwrap();
        }
    }
    check(&conn, &want);
    check(&other, &want);
}

#[test]
fn a_checkpoint_another_process_starts_mid_transaction_cuts_no_page() {
    // Committed frames wait in the WAL; the writer, alone, begins and writes pages past the
    // committed end; then another process (Python's SQLite, as a user's sqlite3 would) opens the
    // DB and asks for a checkpoint that folds the whole WAL, which cuts the file at its committed
    // end. The writer's lock must make it answer busy, and every row must read back.
    let (path, conn) = db("checkpoint", 4096);
    let mut bulk = BulkTable::open(&conn, &path, "t").unwrap();
    let mut rng = Rng(33);
    let mut want = Vec::new();
    let mut add = |bulk: &mut BulkTable, want: &mut Vec<Row>, n: usize| {
        for _ in 0..n {
            let row = random_row(&mut rng, want.len() as i64 + 1);
            append(bulk, &row);
            want.push(row);
        }
    };
    begin(&conn, &mut bulk);
    add(&mut bulk, &mut want, 500);
    commit(&conn, &mut bulk);
    bulk.committed();
    begin(&conn, &mut bulk);
    // Several MiB: full runs of pages are in the file before the checkpoint starts.
    add(&mut bulk, &mut want, 8_000);
    assert!(bulk.written_direct() > 256, "pages went past the pager");
    let script = "import sqlite3, sys\n\
        c = sqlite3.connect(sys.argv[1])\n\
        print(c.execute('PRAGMA wal_checkpoint(TRUNCATE)').fetchall()[0][0])\n";
    let Ok(out) = std::process::Command::new("python3").args(["-c", script]).arg(&path).output() else {
        eprintln!("skipped: no python3 to checkpoint the DB");
        return;
    };
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "1", "the other process's checkpoint is refused (busy)");
    add(&mut bulk, &mut want, 500);
    commit(&conn, &mut bulk);
    bulk.committed();
    check(&conn, &want);
    // Once committed, the same checkpoint runs and the rows stay whole.
    let out = std::process::Command::new("python3").args(["-c", script]).arg(&path).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "0", "checkpointed after the commit");
    check(&Connection::open(&path).unwrap(), &want);
}

#[test]
fn the_header_fields_the_pages_rely_on_are_each_checked() {
    let mut page1 = vec![0u8; 4096];
    page1[16..18].copy_from_slice(&4096u16.to_be_bytes());
    page1[18] = 2;
    page1[19] = 2;
    page1[21..24].copy_from_slice(&[64, 32, 32]);
    page1[44..48].copy_from_slice(&4u32.to_be_bytes());
    page1[56..60].copy_from_slice(&1u32.to_be_bytes());
    assert_eq!(check_header(&page1, 4096), Ok(()));
    type Spoil = fn(&mut Vec<u8>);
    let broken: [(&str, Spoil); 7] = [
        ("page size", |p| p[16..18].copy_from_slice(&1024u16.to_be_bytes())),
        ("versions", |p| p[19] = 3),
        ("reserved", |p| p[20] = 8),
        ("payload fractions", |p| p[21] = 40),
        ("schema format 1", |p| p[44..48].copy_from_slice(&1u32.to_be_bytes())),
        ("auto_vacuum", |p| p[52..56].copy_from_slice(&3u32.to_be_bytes())),
        ("not UTF-8", |p| p[56..60].copy_from_slice(&2u32.to_be_bytes())),
    ];
    for (what, spoil) in broken {
        let mut p = page1.clone();
        spoil(&mut p);
        let err = check_header(&p, 4096).unwrap_err();
        assert!(err.contains(what.split(' ').next().unwrap()), "{what}: {err}");
    }
    assert!(check_header(&page1, 65_536).is_err(), "another page size than the connection's");
}
