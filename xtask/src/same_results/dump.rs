//! The canonical text of what one run of the binary left in a DB, so two runs compare as text:
//! the schema, every `ms_*` table the run changed (rows sorted), and for every other table the
//! cells that differ from the input DB the run started from, by rowid (`inefficient` rewrites
//! `Attr` in `memscope_dump`; any other rewrite shows up the same way).

use std::path::Path;

use anyhow::Context as _;
use rusqlite::{Connection, OpenFlags};

/// The wall-clock interval the run was in, in ns since the epoch.
#[derive(Clone, Copy)]
pub struct Window {
    pub start_ns: u64,
    pub end_ns: u64,
}

/// `after` (the DB the run wrote into) against `before` (the input it was copied from).
pub fn dump(after: &Path, before: &Path, window: Window) -> anyhow::Result<String> {
    let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_URI;
    let conn = Connection::open_with_flags(after, flags).with_context(|| format!("cannot open {}", after.display()))?;
    // A URI, for mode=ro; the characters a URI gives a meaning to are escaped.
    let escaped = before.display().to_string().replace('%', "%25").replace('?', "%3f").replace('#', "%23");
    let uri = format!("file:{escaped}?mode=ro");
    conn.execute("ATTACH ?1 AS b", [uri]).with_context(|| format!("cannot attach {}", before.display()))?;
    let mut out = String::new();
    for pragma in ["journal_mode", "user_version", "page_size"] {
        let v = conn.query_row(&format!("PRAGMA main.{pragma}"), [], |r| r.get::<_, rusqlite::types::Value>(0))?;
        out.push_str(&format!("pragma {pragma}: {v:?}\n"));
    }
    let schema = rows(
        &conn,
        "SELECT type || ' ' || name || ': ' || coalesce(sql, '') FROM main.sqlite_master ORDER BY type, name",
    )?;
    out.push_str("schema:\n");
    for line in schema {
        out.push_str(&format!("  {line}\n"));
    }
    for (table, sql) in tables(&conn, "main")? {
        let columns = columns(&conn, &table)?;
        let in_before = tables(&conn, "b")?.iter().any(|(t, _)| *t == table);
        let by_rowid = !table.starts_with("ms_") && !sql.to_ascii_uppercase().contains("WITHOUT ROWID");
        if in_before && by_rowid {
            changed_cells(&conn, &table, &columns, &mut out)?;
        } else if in_before && same_as_before(&conn, &table, &columns)? {
            let n: i64 = conn.query_row(&format!("SELECT count(*) FROM main.\"{table}\""), [], |r| r.get(0))?;
            out.push_str(&format!("table {table}: as in the input ({n} rows)\n"));
        } else {
            whole_table(&conn, &table, &columns, window, &mut out)?;
        }
    }
    for (table, _) in tables(&conn, "b")? {
        if !tables(&conn, "main")?.iter().any(|(t, _)| *t == table) {
            out.push_str(&format!("table {table}: dropped\n"));
        }
    }
    Ok(out)
}

fn rows(conn: &Connection, sql: &str) -> anyhow::Result<Vec<String>> {
    let mut stmt = conn.prepare(sql).with_context(|| format!("cannot prepare {sql}"))?;
    let rows = stmt.query_map([], |r| r.get::<_, String>(0))?.collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

/// Tables (not indexes, not SQLite's own) with their DDL, by name.
fn tables(conn: &Connection, schema: &str) -> anyhow::Result<Vec<(String, String)>> {
    let sql = format!(
        "SELECT name, coalesce(sql, '') FROM {schema}.sqlite_master WHERE type = 'table' \
         AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\' ORDER BY name"
    );
    let mut stmt = conn.prepare(&sql)?;
    let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?.collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

fn columns(conn: &Connection, table: &str) -> anyhow::Result<Vec<String>> {
    let mut stmt = conn.prepare("SELECT name FROM pragma_table_info(?1, 'main') ORDER BY cid")?;
    let cols = stmt.query_map([table], |r| r.get(0))?.collect::<Result<Vec<String>, _>>()?;
    Ok(cols)
}

/// One row's cells as SQL literals (`quote()`), tab-separated: types stay visible (1 vs '1').
fn quoted(columns: &[String], alias: &str) -> String {
    let cells: Vec<String> = columns.iter().map(|c| format!("quote({alias}.\"{c}\")")).collect();
    cells.join(" || char(9) || ")
}

/// Same columns and the same rows (as sets, and the same count) as the input's table.
fn same_as_before(conn: &Connection, table: &str, columns: &[String]) -> anyhow::Result<bool> {
    let before: Vec<String> = {
        let mut stmt = conn.prepare("SELECT name FROM pragma_table_info(?1, 'b') ORDER BY cid")?;
        let cols = stmt.query_map([table], |r| r.get(0))?.collect::<Result<Vec<String>, _>>()?;
        cols
    };
    if before != columns {
        return Ok(false);
    }
    let sql = format!(
        "SELECT (SELECT count(*) FROM main.\"{table}\") = (SELECT count(*) FROM b.\"{table}\") \
         AND NOT EXISTS (SELECT * FROM main.\"{table}\" EXCEPT SELECT * FROM b.\"{table}\") \
         AND NOT EXISTS (SELECT * FROM b.\"{table}\" EXCEPT SELECT * FROM main.\"{table}\")"
    );
    Ok(conn.query_row(&sql, [], |r| r.get(0))?)
}

/// Every row, sorted as text, so the order rows were inserted in does not matter.
fn whole_table(
    conn: &Connection,
    table: &str,
    columns: &[String],
    window: Window,
    out: &mut String,
) -> anyhow::Result<()> {
    let mut lines = rows(conn, &format!("SELECT {} FROM main.\"{table}\" AS t", quoted(columns, "t")))?;
    if table == "ms_meta" {
        for line in &mut lines {
            *line = wall_clock_stamp(line, window);
        }
    }
    lines.sort();
    out.push_str(&format!("table {table} ({} rows): {}\n", lines.len(), columns.join("\t")));
    for line in lines {
        out.push_str(&format!("  {line}\n"));
    }
    Ok(())
}

/// `ms_meta`'s `<analysis>_at` keys hold the wall clock of the run that wrote the results
/// (`run_wall_ns`), which no two runs share. Only a value inside this run's own interval is
/// replaced, so a stamp the input already had, or a wrong one, still shows.
fn wall_clock_stamp(line: &str, window: Window) -> String {
    let Some((key, value)) = line.split_once('\t') else { return line.to_owned() };
    let stamp = value.trim_matches('\'').parse::<u64>().ok();
    match stamp {
        Some(ns) if key.ends_with("_at'") && (window.start_ns..=window.end_ns).contains(&ns) => {
            format!("{key}\t<wall clock of this run>")
        }
        _ => line.to_owned(),
    }
}

/// Rows added, removed or changed against the input's table, by rowid; only the changed cells.
fn changed_cells(conn: &Connection, table: &str, columns: &[String], out: &mut String) -> anyhow::Result<()> {
    let differs: Vec<String> = columns.iter().map(|c| format!("a.\"{c}\" IS NOT b.\"{c}\"")).collect();
    let sql = format!(
        "SELECT a.rowid, {}, {} FROM main.\"{table}\" a JOIN b.\"{table}\" b ON b.rowid = a.rowid WHERE {}",
        columns.iter().map(|c| format!("quote(a.\"{c}\")")).collect::<Vec<_>>().join(", "),
        columns.iter().map(|c| format!("quote(b.\"{c}\")")).collect::<Vec<_>>().join(", "),
        differs.join(" OR ")
    );
    let mut lines = Vec::new();
    let mut stmt = conn.prepare(&sql)?;
    let mut q = stmt.query([])?;
    let n = columns.len();
    while let Some(r) = q.next()? {
        let rowid: i64 = r.get(0)?;
        for (i, c) in columns.iter().enumerate() {
            let (now, was): (String, String) = (r.get(1 + i)?, r.get(1 + n + i)?);
            if now != was {
                lines.push(format!("  rowid {rowid} {c}: {was} -> {now}"));
            }
        }
    }
    for (side, sql) in [
        (
            "added",
            format!(
                "SELECT a.rowid, {} FROM main.\"{table}\" a WHERE a.rowid NOT IN (SELECT rowid FROM b.\"{table}\")",
                quoted(columns, "a")
            ),
        ),
        (
            "removed",
            format!(
                "SELECT a.rowid, {} FROM b.\"{table}\" a WHERE a.rowid NOT IN (SELECT rowid FROM main.\"{table}\")",
                quoted(columns, "a")
            ),
        ),
    ] {
        let mut stmt = conn.prepare(&sql)?;
        let found =
            stmt.query_map([], |r| Ok(format!("  rowid {} {side}: {}", r.get::<_, i64>(0)?, r.get::<_, String>(1)?)))?;
        for line in found {
            lines.push(line?);
        }
    }
    if lines.is_empty() {
        let n: i64 = conn.query_row(&format!("SELECT count(*) FROM main.\"{table}\""), [], |r| r.get(0))?;
        out.push_str(&format!("table {table}: as in the input ({n} rows)\n"));
        return Ok(());
    }
    out.push_str(&format!("table {table}: {} changes against the input, by rowid\n", lines.len()));
    for line in lines {
        out.push_str(&line);
        out.push('\n');
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn db(path: &Path, sql: &str) {
        Connection::open(path).unwrap().execute_batch(sql).unwrap();
    }

    #[test]
    fn shows_changed_cells_sorted_result_tables_and_only_this_runs_stamps() {
        let dir = std::env::temp_dir().join(format!("xtask-same-results-{}-dump", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (before, after) = (dir.join("before.db"), dir.join("after.db"));
        let input = "CREATE TABLE memscope_dump (\"ID\" INTEGER, \"Attr\" TEXT);
             INSERT INTO memscope_dump VALUES (1, '{\"size\":\"1\"}'), (2, '{\"size\":\"2\"}');
             CREATE TABLE ms_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
             INSERT INTO ms_meta VALUES ('leaks_at', '5'), ('start_ns', '7');";
        db(&before, input);
        db(&after, input);
        let window = Window { start_ns: 1_000, end_ns: 2_000 };
        let same = dump(&after, &before, window).unwrap();
        assert!(same.contains("table memscope_dump: as in the input (2 rows)"), "{same}");
        assert!(same.contains("table ms_meta: as in the input (2 rows)"), "{same}");
        db(
            &after,
            "UPDATE memscope_dump SET Attr = '{\"size\":\"2\",\"x\":\"y\"}' WHERE ID = 2;
             INSERT INTO memscope_dump VALUES (3, NULL);
             UPDATE ms_meta SET value = '1500' WHERE key = 'leaks_at';
             INSERT INTO ms_meta VALUES ('oom_at', '2001');
             CREATE TABLE ms_x (a INTEGER, b TEXT); INSERT INTO ms_x VALUES (2, 'b'), (1, 'a');",
        );
        let text = dump(&after, &before, window).unwrap();
        assert!(text.contains("table memscope_dump: 2 changes against the input, by rowid"), "{text}");
        assert!(text.contains("  rowid 2 Attr: '{\"size\":\"2\"}' -> '{\"size\":\"2\",\"x\":\"y\"}'\n"), "{text}");
        assert!(text.contains("  rowid 3 added: 3\tNULL\n"), "{text}");
        // The stamp inside the run's window is normalised; one outside it is not.
        assert!(text.contains("  'leaks_at'\t<wall clock of this run>\n"), "{text}");
        assert!(text.contains("  'oom_at'\t'2001'\n"), "{text}");
        assert!(text.contains("table ms_x (2 rows): a\tb\n  1\t'a'\n  2\t'b'\n"), "{text}");
        assert!(text.contains("table ms_x: CREATE TABLE ms_x (a INTEGER, b TEXT)"), "{text}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
