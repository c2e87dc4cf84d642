use super::*;
use crate::analysis::testdb::{dir, TestDb};
use crate::store::schema::OWN_TABLES;
use crate::store::Attr;

const MIB: i64 = 1 << 20;

fn reading(db: &TestDb, ts: i64, pid: i64, used: i64) {
    db.conn()
        .execute(
            "INSERT INTO ms_driver (ts_ns, pid, process_used, device_used, device_total, source) \
             VALUES (?1, ?2, ?3, ?4, ?5, 'dcmi')",
            rusqlite::params![ts, pid, used, 900 * MIB, 1024 * MIB],
        )
        .unwrap();
}

fn with_driver_table(name: &str) -> TestDb {
    let db = TestDb::create(&dir(name).join("memscope_dump_1.db"));
    db.conn().execute_batch(OWN_TABLES).unwrap();
    db
}

fn analysed(db: &TestDb) -> Report {
    analyse(&DumpDb::open_read(&db.path).unwrap()).unwrap()
}

#[test]
fn each_reading_is_put_against_the_hal_bytes_live_just_before_it() {
    let mut db = with_driver_table("readings");
    db.system("START_TRACE", 1);
    db.malloc("HAL", 10, 0x1000, (100 * MIB) as u64, None);
    // Pool blocks are inside HAL ones: never counted twice.
    db.malloc("PTA", 11, 0x1000, (60 * MIB) as u64, None);
    reading(&db, 15, 1, 164 * MIB);
    db.malloc("HAL", 20, 0x9000, (50 * MIB) as u64, None);
    reading(&db, 25, 1, 214 * MIB);
    db.free("HAL", 30, 0x1000);
    reading(&db, 35, 1, 114 * MIB);
    // The stop's shadow free of a block still live is not the process letting go.
    db.free_marked("HAL", 40, 0x9000, "shadow");
    reading(&db, 45, 1, 114 * MIB);
    let report = analysed(&db);
    assert_eq!(report.source, Source::DriverTable);
    let p = &report.processes[0];
    let got: Vec<(i64, i64)> = p.points.iter().map(|q| (q.traced / MIB, q.unexplained / MIB)).collect();
    assert_eq!(got, [(100, 64), (150, 64), (50, 64), (50, 64)]);
    assert_eq!(report.device, Some((900 * MIB, 1024 * MIB)));
    let text = text(&report, &db.path, "0");
    assert!(text.contains("64.0 MiB unexplained"), "{text}");
    assert!(text.contains("what usually explains it"), "{text}");
}

#[test]
fn processes_sharing_a_device_are_kept_apart() {
    let mut db = with_driver_table("pids");
    db.malloc("HAL", 10, 0x1000, (10 * MIB) as u64, None);
    db.row("MALLOC", "HAL", 11, 2, Some(0x1000), Attr::new().addr("addr", 0x1000).with("size", (30 * MIB) as u64));
    reading(&db, 20, 1, 10 * MIB);
    reading(&db, 20, 2, 40 * MIB);
    reading(&db, 30, 2, 30 * MIB);
    let report = analysed(&db);
    let by_pid: Vec<(i64, Vec<i64>)> =
        report.processes.iter().map(|p| (p.pid, p.points.iter().map(|q| q.unexplained / MIB).collect())).collect();
    assert_eq!(by_pid, [(1, vec![0]), (2, vec![10, 0])]);
    let mut one = report.clone();
    one.processes.retain(|p| p.pid == 1);
    assert!(!text(&one, &db.path, "0").contains("what usually explains it"), "nothing to explain");
}

#[test]
fn msmemscopes_process_used_on_hal_rows_is_read_when_there_is_no_table() {
    let mut db = TestDb::create(&dir("attr").join("memscope_dump_1.db"));
    let attr = |size: i64, used: i64| {
        Attr::new().addr("addr", 0x1000).with("size", size as u64).with("process_used", used as u64)
    };
    db.row("MALLOC", "HAL", 10, 1, Some(0x1000), attr(8 * MIB, 20 * MIB));
    db.row("FREE", "HAL", 20, 1, Some(0x1000), attr(8 * MIB, 12 * MIB));
    let report = analysed(&db);
    assert_eq!(report.source, Source::RowAttr);
    let got: Vec<i64> = report.processes[0].points.iter().map(|q| q.unexplained / MIB).collect();
    assert_eq!(got, [12, 12], "each row's figure against the bytes live after it");
}

#[test]
fn a_trace_without_readings_says_how_to_get_them() {
    let mut db = with_driver_table("none");
    db.malloc("HAL", 10, 0x1000, 4096, None);
    let report = analysed(&db);
    assert_eq!(report.source, Source::None);
    assert!(text(&report, &db.path, "0").contains("--driver-every"));
}
