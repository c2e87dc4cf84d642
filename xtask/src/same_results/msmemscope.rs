//! DBs as msMemScope writes them (shared/reference/msmemscope-and-insight.md §2-3), for the
//! corpus: no `ms_meta`, Attr values all JSON strings, `Ptr` as `0x%016llx`, MALLOC and ACCESS
//! rows held back per block and written with its FREE (so rows are not in time order, IDs are),
//! blocks still live at the end written at clean-up with a `shadow` FREE at the last stop + 1,
//! `SYSTEM`/`STEP` rows from `msmemscope.step()`, a `python_trace_<pid>` table, WAL mode. And the
//! same rows in prof2memscope's older `leaks_dump` table (ID an autoincrement key, given by
//! SQLite in the order rows are written), named
//! `leaks_dump_<ns>.db` outside any device folder.

use std::path::Path;

use anyhow::Context as _;
use rusqlite::{params, Connection};

const PID: i64 = 4242;
const T0: i64 = 1_764_590_400_000_000_000;
const MIB: u64 = 1 << 20;

/// One row: Event, Event Type, Name, Timestamp, Device Id, Ptr, Attr (key, value pairs).
struct Row {
    id: i64,
    event: &'static str,
    ty: &'static str,
    name: String,
    ts: i64,
    device: &'static str,
    ptr: Option<u64>,
    attr: Vec<(&'static str, String)>,
}

/// The rows of a small training job in the order msMemScope writes them.
#[derive(Default)]
struct Job {
    next_id: i64,
    written: Vec<Row>,
    /// Held-back rows per live block (MALLOC, then its ACCESSes), by Event Type and pointer.
    held: Vec<(&'static str, u64, Vec<Row>)>,
    next_allocation: u64,
}

impl Job {
    fn row(&mut self, event: &'static str, ty: &'static str, name: &str, ts: i64, ptr: Option<u64>) -> Row {
        self.next_id += 1;
        let device = if ty == "ACL_INIT" { "N/A" } else { "0" };
        Row { id: self.next_id, event, ty, name: name.to_owned(), ts, device, ptr, attr: Vec::new() }
    }

    fn now(&mut self, mut row: Row, attr: &[(&'static str, String)]) {
        row.attr = attr.to_vec();
        self.written.push(row);
    }

    fn malloc(&mut self, ty: &'static str, ts: i64, ptr: u64, size: u64, owner: &str) {
        self.next_allocation += 1;
        let mut row = self.row("MALLOC", ty, "N/A", ts, Some(ptr));
        row.attr = vec![
            ("allocation_id", self.next_allocation.to_string()),
            ("addr", format!("0x{ptr:016x}")),
            ("size", size.to_string()),
            ("owner", owner.to_owned()),
        ];
        if ty == "HAL" {
            row.attr.extend([("page_type", "huge".to_owned()), ("alloc_type", "alloc".to_owned())]);
        }
        self.held.push((ty, ptr, vec![row]));
    }

    fn access(&mut self, ts: i64, ptr: u64, write: bool) {
        let row = self.row("ACCESS", if write { "WRITE" } else { "READ" }, "aten::add", ts, Some(ptr));
        let (_, _, rows) =
            self.held.iter_mut().find(|(t, p, _)| *t == "PTA" && *p == ptr).expect("access to a live block");
        let malloc = &rows[0].attr;
        let mut attr = malloc[..3].to_vec();
        attr.extend([
            ("type", "PTA".to_owned()),
            ("dtype", "torch.float32".to_owned()),
            ("shape", "[1024]".to_owned()),
        ]);
        rows.push(Row { attr, ..row });
    }

    /// The FREE, written now, after the block's held-back rows.
    fn free(&mut self, ts: i64, ty: &str, ptr: u64, shadow: bool) {
        let at = self.held.iter().position(|(t, p, _)| *t == ty && *p == ptr).expect("free of a live block");
        let (_, _, rows) = self.held.remove(at);
        let (ty, attr) = (rows[0].ty, rows[0].attr[..3].to_vec());
        let mut free = self.row("FREE", ty, "N/A", ts, Some(ptr));
        free.attr = attr;
        if shadow {
            free.attr.push(("shadow", "true".to_owned()));
        }
        self.written.extend(rows);
        self.written.push(free);
    }

    fn op(&mut self, ts: i64, name: &str) {
        let start = self.row("OP_LAUNCH", "ATEN_START", name, ts, None);
        self.now(start, &[]);
        let kernel = self.row("KERNEL_LAUNCH", "KERNEL_LAUNCH", &format!("{name}_kernel"), ts + 200, None);
        self.now(kernel, &[("streamId", "2".to_owned()), ("taskId", (ts % 997).to_string())]);
        let end = self.row("OP_LAUNCH", "ATEN_END", name, ts + 500, None);
        self.now(end, &[]);
    }
}

/// Six steps: weights before step 1, per step an activation freed within it, from step 3 on
/// one tensor that is never freed, a HAL segment for the pool, and one refused allocation.
fn training_job() -> Vec<Row> {
    let mut job = Job::default();
    let init = job.row("SYSTEM", "ACL_INIT", "N/A", T0, None);
    job.now(init, &[]);
    let start = job.row("SYSTEM", "START_TRACE", "N/A", T0 + 1_000, None);
    job.now(start, &[("free", (30 * 1024 * MIB).to_string()), ("total", (32 * 1024 * MIB).to_string())]);
    let segment = 0x1240_0000_0000u64;
    job.malloc("HAL", T0 + 10_000, segment, 64 * MIB, "CANN@APP");
    job.malloc("PTA", T0 + 20_000, segment, 8 * MIB, "PTA@model@weight");
    job.access(T0 + 21_000, segment, true);
    for step in 1..=6i64 {
        let base = T0 + step * 10_000_000;
        let act = segment + 16 * MIB + step as u64 * 0x10_0000;
        job.malloc("PTA", base + 1_000, act, 2 * MIB, "PTA@ops@aten");
        job.op(base + 2_000, "aten::matmul");
        job.access(base + 3_000, act, true);
        job.access(base + 3_500, segment, false);
        if step >= 3 {
            let leak = segment + 40 * MIB + step as u64 * 0x10_0000;
            job.malloc("PTA", base + 9_000, leak, 512 * 1024, "PTA@ops@aten@leaks_mem");
            job.access(base + 9_500, leak, true);
        }
        job.access(base + 8_000_000, act, false);
        if step == 4 {
            let oom = job.row("OOM_DETAIL", "OOM_TRIGGER", "aclrtMalloc", base + 9_000_000, None);
            job.now(
                oom,
                &[
                    ("func", "aclrtMalloc".to_owned()),
                    ("req_size", (64 * 1024 * MIB).to_string()),
                    ("flag", "0".to_owned()),
                ],
            );
        }
        job.free(base + 9_500_000, "PTA", act, false);
        let mark = job.row("SYSTEM", "STEP", &step.to_string(), base + 9_900_000, None);
        job.now(mark, &[]);
    }
    let stop_ts = T0 + 70_000_000;
    let stop = job.row("SYSTEM", "STOP_TRACE", "N/A", stop_ts, None);
    job.now(stop, &[]);
    // Clean-up: every block still live, with its synthetic FREE after the last stop.
    while let Some((ty, ptr)) = job.held.first().map(|(t, p, _)| (*t, *p)) {
        job.free(stop_ts + 1, ty, ptr, true);
    }
    job.written
}

fn attr_json(attr: &[(&str, String)]) -> String {
    let map: serde_json::Map<String, serde_json::Value> =
        attr.iter().map(|(k, v)| ((*k).to_owned(), serde_json::Value::String(v.clone()))).collect();
    serde_json::Value::Object(map).to_string()
}

fn write_db(path: &Path, table: &str, id_column: &str, rows: &[Row]) -> anyhow::Result<()> {
    std::fs::create_dir_all(path.parent().expect("a file has a folder"))?;
    let _ = std::fs::remove_file(path);
    let mut conn = Connection::open(path).with_context(|| format!("cannot create {}", path.display()))?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.execute_batch(&format!(
        "CREATE TABLE IF NOT EXISTS {table} ({id_column}, \"Event\" TEXT, \"Event Type\" TEXT, \"Name\" TEXT, \
         \"Timestamp(ns)\" INTEGER, \"Process Id\" INTEGER, \"Thread Id\" INTEGER, \"Device Id\" TEXT, \"Ptr\" TEXT, \
         \"Attr\" TEXT, \"Call Stack(Python)\" TEXT, \"Call Stack(C)\" TEXT);
         CREATE TABLE IF NOT EXISTS python_trace_{PID} (\"FuncInfo\" TEXT, \"StartTime(ns)\" TEXT, \
         \"EndTime(ns)\" TEXT, \"Thread Id\" INTEGER, \"Process Id\" INTEGER);"
    ))?;
    // prof2memscope leaves the ID to SQLite: rows are numbered in the order they are written.
    let autoincrement = id_column.contains("AUTOINCREMENT");
    let tx = conn.transaction()?;
    {
        let mut insert =
            tx.prepare(&format!("INSERT INTO {table} VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)"))?;
        for r in rows {
            let ptr = r.ptr.map_or_else(|| "N/A".to_owned(), |p| format!("0x{p:016x}"));
            let python = if r.event == "MALLOC" { "\"train.py(42): forward\"" } else { "\"NA\"" };
            insert.execute(params![
                (!autoincrement).then_some(r.id),
                r.event,
                r.ty,
                r.name,
                r.ts,
                PID,
                PID + 1,
                r.device,
                ptr,
                attr_json(&r.attr),
                python,
                "\"\""
            ])?;
        }
        let mut trace = tx.prepare(&format!("INSERT INTO python_trace_{PID} VALUES (?1, ?2, ?3, ?4, ?5)"))?;
        for step in 1..=6i64 {
            let base = T0 + step * 10_000_000;
            trace.execute(params![
                "train.py:train_step",
                base.to_string(),
                (base + 9_800_000).to_string(),
                PID + 1,
                PID
            ])?;
        }
    }
    tx.commit()?;
    conn.query_row("PRAGMA wal_checkpoint(FULL)", [], |_| Ok(()))?;
    Ok(())
}

/// Writes both DBs under `inputs`; returns what it wrote.
pub fn write(inputs: &Path) -> anyhow::Result<String> {
    let rows = training_job();
    let db =
        inputs.join("msmemscope/msmemscope_4242_20251201120000_ascend/device_0/dump/memscope_dump_20251201120000.db");
    write_db(&db, "memscope_dump", "\"ID\" INTEGER", &rows)?;
    let legacy = inputs.join(format!("msmemscope-legacy/leaks_dump_{T0}.db"));
    write_db(&legacy, "leaks_dump", "\"ID\" INTEGER PRIMARY KEY AUTOINCREMENT", &rows)?;
    Ok(format!("msMemScope-style: {} rows as memscope_dump and as leaks_dump", rows.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_held_back_per_block_as_msmemscope_writes_them() {
        let dir = std::env::temp_dir().join(format!("xtask-same-results-{}-ms", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        write(&dir).unwrap();
        for (file, table) in [
            (
                "msmemscope/msmemscope_4242_20251201120000_ascend/device_0/dump/memscope_dump_20251201120000.db",
                "memscope_dump",
            ),
            (&format!("msmemscope-legacy/leaks_dump_{T0}.db"), "leaks_dump"),
        ] {
            let conn = Connection::open(dir.join(file)).unwrap();
            let count = |sql: &str| -> i64 { conn.query_row(&sql.replace("$t", table), [], |r| r.get(0)).unwrap() };
            // msMemScope's IDs follow time, the file's order does not (MALLOCs come with their FREE).
            let id_order =
                "SELECT count(*) FROM $t a JOIN $t b ON b.ID = a.ID + 1 WHERE b.\"Timestamp(ns)\" < a.\"Timestamp(ns)\"";
            let legacy = table == "leaks_dump";
            assert_eq!(count(id_order) == 0, !legacy, "{table}: IDs in time order unless SQLite numbered them");
            let file_order = "SELECT count(*) FROM (SELECT \"Timestamp(ns)\" AS ts, lag(\"Timestamp(ns)\") OVER (ORDER BY rowid) AS prev FROM $t) WHERE ts < prev";
            assert!(count(file_order) > 0, "{table}");
            // Every block still live at the stop gets one shadow FREE at the stop + 1.
            let stop: i64 = conn
                .query_row(
                    &format!("SELECT \"Timestamp(ns)\" FROM {table} WHERE \"Event Type\" = 'STOP_TRACE'"),
                    [],
                    |r| r.get(0),
                )
                .unwrap();
            assert_eq!(
                count(&format!(
                    "SELECT count(*) FROM $t WHERE Event = 'FREE' AND Attr LIKE '%shadow%' AND \"Timestamp(ns)\" = {}",
                    stop + 1
                )),
                6
            );
            assert_eq!(
                count("SELECT count(*) FROM $t WHERE Event = 'MALLOC'"),
                count("SELECT count(*) FROM $t WHERE Event = 'FREE'")
            );
            let mut stmt = conn.prepare(&format!("SELECT Attr, Ptr, Event FROM {table}")).unwrap();
            let rows = stmt
                .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?, r.get::<_, String>(2)?)))
                .unwrap();
            for row in rows {
                let (attr, ptr, event) = row.unwrap();
                let parsed: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&attr).unwrap();
                assert!(parsed.values().all(serde_json::Value::is_string), "{attr}");
                if ["MALLOC", "FREE", "ACCESS"].contains(&event.as_str()) {
                    assert!(ptr.len() == 18 && ptr.starts_with("0x"), "{ptr}");
                }
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
