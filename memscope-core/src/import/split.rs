//! One DB per device, of a capture that holds several in one file: msLeaks' early captures wrote
//! every device's rows (and the host's, as `host`) into one `leaks_dump`/`memscope_dump` file,
//! where msMemScope and `trace` now write a file per device. The analyses take one file for one
//! device (a pool, a peak, a timeline), so such a file is split first, as msMemScope splits its
//! output: the memory rows go to their device, rows of no device (`N/A`: the runtime's
//! initialisation, marks) to every one.

use std::path::{Path, PathBuf};

use rusqlite::Connection;

use super::ImportError;
use crate::store::schema::{create_dump_table, DUMP_COLUMNS, DUMP_TABLE};

/// Writes one DB per device of `devices` into `dir`, from table `table` of `src`; returns each
/// device's DB. `stem` names the files (`<stem>-device_<id>.db`).
pub fn split_by_device(
    src: &Path,
    table: &str,
    devices: &[String],
    dir: &Path,
    stem: &str,
) -> Result<Vec<(String, PathBuf)>, ImportError> {
    let mut out = Vec::new();
    for device in devices {
        let safe: String = device.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
        let dst = dir.join(format!("{stem}-device_{safe}.db"));
        copy_device(src, table, device, &dst)?;
        out.push((device.clone(), dst));
    }
    Ok(out)
}

fn copy_device(src: &Path, table: &str, device: &str, dst: &Path) -> Result<(), ImportError> {
    let werr = |source| ImportError::Write { path: dst.to_owned(), source };
    let _ = std::fs::remove_file(dst);
    let conn = Connection::open(dst).map_err(werr)?;
    conn.execute_batch("PRAGMA journal_mode = OFF; PRAGMA synchronous = OFF; PRAGMA page_size = 65536;")
        .map_err(werr)?;
    conn.execute_batch(&create_dump_table()).map_err(werr)?;
    conn.execute("ATTACH DATABASE ?1 AS src", [src.to_string_lossy()]).map_err(werr)?;
    let have: Vec<String> = conn
        .prepare("SELECT name FROM src.pragma_table_info(?1)")
        .and_then(|mut s| s.query_map([table], |r| r.get(0))?.collect())
        .map_err(werr)?;
    // Old files lack the stack columns: those are empty here.
    let columns: Vec<String> = DUMP_COLUMNS
        .iter()
        .map(|(c, _)| if have.iter().any(|h| h == c) { format!("\"{c}\"") } else { "NULL".to_owned() })
        .collect();
    let sql = format!(
        "INSERT INTO main.{DUMP_TABLE} SELECT {} FROM src.\"{table}\" \
         WHERE CAST(\"Device Id\" AS TEXT) = ?1 \
            OR (\"Event\" NOT IN ('MALLOC', 'FREE') AND coalesce(\"Device Id\", '') IN ('N/A', '')) \
         ORDER BY rowid",
        columns.join(", ")
    );
    conn.execute(&sql, [device]).map_err(werr)?;
    let meta: i64 = conn
        .query_row("SELECT count(*) FROM src.sqlite_master WHERE type = 'table' AND name = 'ms_meta'", [], |r| r.get(0))
        .map_err(werr)?;
    if meta > 0 {
        conn.execute_batch("CREATE TABLE main.ms_meta AS SELECT * FROM src.ms_meta").map_err(werr)?;
    }
    conn.execute_batch("DETACH DATABASE src").map_err(werr)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_device_gets_its_rows_and_the_rows_of_none() {
        let d = std::env::temp_dir().join(format!("memscope-split-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let src = d.join("leaks_dump_1.db");
        let conn = Connection::open(&src).unwrap();
        // msLeaks' table: ten columns, no stacks.
        conn.execute_batch(
            "CREATE TABLE leaks_dump (ID INTEGER, Event TEXT, \"Event Type\" TEXT, Name TEXT, \"Timestamp(ns)\" INTEGER,
               \"Process Id\" INTEGER, \"Thread Id\" INTEGER, \"Device Id\" TEXT, Ptr TEXT, Attr TEXT);
             INSERT INTO leaks_dump VALUES (1, 'SYSTEM', 'acl init', 'N/A', 1, 1, 1, 'N/A', 'N/A', '');
             INSERT INTO leaks_dump VALUES (2, 'MALLOC', 'HAL', 'N/A', 2, 1, 1, '0', '16', '{\"size\":\"4\"}');
             INSERT INTO leaks_dump VALUES (3, 'MALLOC', 'HAL', 'N/A', 3, 1, 1, '1', '32', '{\"size\":\"8\"}');
             INSERT INTO leaks_dump VALUES (4, 'MALLOC', 'PTA', 'N/A', 4, 1, 1, 'host', '48', '{\"size\":\"2\"}');
             INSERT INTO leaks_dump VALUES (5, 'MALLOC', 'HAL', 'N/A', 5, 1, 1, 'N/A', '64', '{\"size\":\"1\"}');",
        )
        .unwrap();
        drop(conn);
        let devices: Vec<String> = ["0", "1", "host", "N/A"].map(str::to_owned).to_vec();
        let out = split_by_device(&src, "leaks_dump", &devices, &d, "leaks_dump_1").unwrap();
        let ids = |p: &Path| -> Vec<i64> {
            let c = Connection::open(p).unwrap();
            let mut s = c.prepare("SELECT ID FROM memscope_dump ORDER BY rowid").unwrap();
            s.query_map([], |r| r.get(0)).unwrap().map(Result::unwrap).collect()
        };
        let got: Vec<(String, Vec<i64>)> = out.iter().map(|(dev, p)| (dev.clone(), ids(p))).collect();
        let want = [("0", vec![1, 2]), ("1", vec![1, 3]), ("host", vec![1, 4]), ("N/A", vec![1, 5])];
        assert_eq!(got, want.map(|(d, v)| (d.to_owned(), v)));
        assert!(out[3].1.ends_with("leaks_dump_1-device_N_A.db"));
        // No ms_meta in the source (msMemScope's): none in the parts, which stay msMemScope's.
        let tables: i64 = Connection::open(&out[0].1)
            .unwrap()
            .query_row("SELECT count(*) FROM sqlite_master WHERE name = 'ms_meta'", [], |r| r.get(0))
            .unwrap();
        assert_eq!(tables, 0);
    }
}
