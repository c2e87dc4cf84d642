//! Gathering the corpus' input DBs into `DIR/inputs/`: the demo's run folders, every DB the
//! privileged tier left, a copy of one DB with its rows in random order, and DBs written as
//! msMemScope writes them (`msmemscope.rs`). The layout under each source is kept
//! (`device_<id>/dump/memscope_dump_*.db`), because the analyses take the device from it.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _};
use rusqlite::Connection;

use super::msmemscope;

/// Where the inputs come from.
pub struct Sources {
    pub demo: PathBuf,
    pub run_demo: bool,
    pub privileged: PathBuf,
}

/// Fills `inputs` (emptied first); returns one line per source saying what it gave.
pub fn gather(inputs: &Path, sources: &Sources) -> anyhow::Result<Vec<String>> {
    let _ = std::fs::remove_dir_all(inputs);
    std::fs::create_dir_all(inputs).with_context(|| format!("cannot create {}", inputs.display()))?;
    let mut said = Vec::new();
    if sources.run_demo || dump_dbs(&sources.demo)?.is_empty() {
        crate::demo::run(&crate::demo::Options { steps: 20, output: sources.demo.to_string_lossy().into_owned() })?;
    }
    let runs = run_folders(&sources.demo)?;
    if runs.is_empty() {
        bail!("{} holds no trace run folder even after `cargo xtask demo`", sources.demo.display());
    }
    for run in &runs {
        copy_tree(run, &inputs.join("demo").join(run.file_name().expect("a run folder has a name")))?;
    }
    said.push(format!("demo: {} run folders from {}", runs.len(), sources.demo.display()));
    let privileged = dump_dbs(&sources.privileged)?;
    for db in &privileged {
        let rel = db.strip_prefix(&sources.privileged).expect("found under it");
        copy_db(db, &inputs.join("privileged").join(rel))?;
    }
    said.push(format!("privileged tier: {} DBs from {}", privileged.len(), sources.privileged.display()));
    said.push(stripped(inputs)?);
    said.push(shuffled(inputs)?);
    said.push(msmemscope::write(inputs)?);
    Ok(said)
}

/// Every trace DB under `dir` (by Insight's file names), sorted; none when `dir` is absent.
pub fn dump_dbs(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut found = Vec::new();
    if dir.is_dir() {
        walk(dir, &mut |p| {
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            if (name.starts_with("memscope_dump_") || name.starts_with("leaks_dump_")) && name.ends_with(".db") {
                found.push(p.to_owned());
            }
        })?;
    }
    found.sort();
    Ok(found)
}

/// Folders holding `device_*` folders (a trace's output folder), sorted.
pub fn run_folders(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut runs: Vec<PathBuf> = Vec::new();
    for db in dump_dbs(dir)? {
        let device = db.parent().and_then(Path::parent);
        let run = device.filter(|d| d.file_name().is_some_and(|n| n.to_string_lossy().starts_with("device_")));
        if let Some(run) = run.and_then(Path::parent) {
            if !runs.iter().any(|r| r == run) {
                runs.push(run.to_owned());
            }
        }
    }
    runs.sort();
    Ok(runs)
}

fn walk(dir: &Path, each: &mut dyn FnMut(&Path)) -> anyhow::Result<()> {
    let entries = std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))?;
    for entry in entries {
        let path = entry?.path();
        if path.is_dir() {
            walk(&path, each)?;
        } else {
            each(&path);
        }
    }
    Ok(())
}

/// A DB and its WAL (a killed trace leaves one; opening it is part of what is checked). The
/// `-shm` is not copied: SQLite rebuilds it from the WAL.
pub fn copy_db(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to.parent().expect("a file has a folder"))?;
    std::fs::copy(from, to).with_context(|| format!("cannot copy {} to {}", from.display(), to.display()))?;
    let wal = |p: &Path| PathBuf::from(format!("{}-wal", p.display()));
    if wal(from).exists() {
        std::fs::copy(wal(from), wal(to)).with_context(|| format!("cannot copy {}-wal", from.display()))?;
    }
    Ok(())
}

/// The trace DBs of a folder, with the folders above them (other files are not inputs).
pub fn copy_tree(from: &Path, to: &Path) -> anyhow::Result<()> {
    for db in dump_dbs(from)? {
        copy_db(&db, &to.join(db.strip_prefix(from).expect("found under it")))?;
    }
    Ok(())
}

/// The result tables of today's analyses and their `ms_meta` stamps. A trace run with
/// `--analysis` (several privileged tests do) leaves them in its DBs; an analysis that silently
/// wrote nothing would then still leave the same tables behind, so such DBs also go in stripped.
const RESULT_TABLES: [&str; 9] = [
    "ms_decompose",
    "ms_inefficient",
    "ms_steps",
    "ms_leaks",
    "ms_degradation",
    "ms_oom",
    "ms_oom_blocks",
    "ms_fragmentation",
    "ms_advice",
];
const RESULT_STAMPS: &str = "'decompose_at', 'inefficient_at', 'leaks_at', 'oom_at', 'advise_at'";

/// Copies under `stripped/` of every trace DB holding analysis results, without them: no result
/// table, no stamp, no `inefficient_type` in any Attr (removed with SQLite's `json_remove`, which
/// writes compact JSON in the same key order, as the tracer does).
fn stripped(inputs: &Path) -> anyhow::Result<String> {
    let mut n = 0;
    for db in [dump_dbs(&inputs.join("demo"))?, dump_dbs(&inputs.join("privileged"))?].concat() {
        let has_results = {
            let conn = Connection::open_with_flags(&db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)?;
            let tables: i64 = conn.query_row(
                &format!(
                    "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name IN ('{}')",
                    RESULT_TABLES.join("', '")
                ),
                [],
                |r| r.get(0),
            )?;
            let flagged: i64 = conn.query_row(
                "SELECT count(*) FROM memscope_dump WHERE Attr LIKE '%\"inefficient_type\"%'",
                [],
                |r| r.get(0),
            )?;
            tables + flagged > 0
        };
        if !has_results {
            continue;
        }
        let to = inputs.join("stripped").join(db.strip_prefix(inputs).expect("found under it"));
        copy_db(&db, &to)?;
        let conn = Connection::open(&to)?;
        for table in RESULT_TABLES {
            conn.execute_batch(&format!("DROP TABLE IF EXISTS {table}"))?;
        }
        let has_meta: i64 =
            conn.query_row("SELECT count(*) FROM sqlite_master WHERE name = 'ms_meta'", [], |r| r.get(0))?;
        if has_meta > 0 {
            conn.execute_batch(&format!("DELETE FROM ms_meta WHERE key IN ({RESULT_STAMPS})"))?;
        }
        conn.execute_batch(
            "UPDATE memscope_dump SET Attr = json_remove(Attr, '$.inefficient_type') \
             WHERE Attr LIKE '%\"inefficient_type\"%'",
        )?;
        n += 1;
    }
    Ok(format!("stripped: {n} DBs that held analysis results, again without them"))
}

/// A copy of the demo's first device-0 DB whose `memscope_dump` rows were inserted in a random
/// (seeded) order: the same rows, so every result must be the same, but `ORDER BY rowid` is no
/// longer time order, which catches a reader that relies on insertion order.
fn shuffled(inputs: &Path) -> anyhow::Result<String> {
    let source = dump_dbs(&inputs.join("demo"))?
        .into_iter()
        .find(|p| p.to_string_lossy().contains("/device_0/"))
        .context("the demo left no device_0 DB to shuffle")?;
    let rel = source.strip_prefix(inputs.join("demo")).expect("found under it");
    let to = inputs.join("shuffled").join(rel);
    copy_db(&source, &to)?;
    let mut conn = Connection::open(&to)?;
    let rowids: Vec<i64> = {
        let mut stmt = conn.prepare("SELECT rowid FROM memscope_dump")?;
        let ids = stmt.query_map([], |r| r.get(0))?.collect::<Result<_, _>>()?;
        ids
    };
    let order = permutation(rowids.len(), 0x5eed_cafe_f00d_d00d);
    let tx = conn.transaction()?;
    tx.execute_batch(
        "CREATE TEMP TABLE rows_in_order AS SELECT rowid AS r, * FROM memscope_dump; DELETE FROM memscope_dump;",
    )?;
    {
        let columns: Vec<String> = {
            let mut stmt = tx.prepare("SELECT name FROM pragma_table_info('memscope_dump') ORDER BY cid")?;
            let c = stmt.query_map([], |r| r.get::<_, String>(0))?.collect::<Result<Vec<_>, _>>()?;
            c
        };
        let list: Vec<String> = columns.iter().map(|c| format!("\"{c}\"")).collect();
        let list = list.join(", ");
        let mut insert =
            tx.prepare(&format!("INSERT INTO memscope_dump ({list}) SELECT {list} FROM rows_in_order WHERE r = ?1"))?;
        for i in order {
            insert.execute([rowids[i]])?;
        }
    }
    tx.execute_batch("DROP TABLE rows_in_order")?;
    tx.commit()?;
    conn.execute_batch("VACUUM")?;
    let out_of_order: i64 = conn.query_row(
        "SELECT count(*) FROM memscope_dump a JOIN memscope_dump b ON b.rowid = a.rowid + 1 \
         WHERE b.\"Timestamp(ns)\" < a.\"Timestamp(ns)\"",
        [],
        |r| r.get(0),
    )?;
    if out_of_order == 0 {
        bail!("the shuffled copy {} is still in time order", to.display());
    }
    Ok(format!(
        "shuffled: {} ({} rows, {out_of_order} of them earlier than the row before)",
        to.strip_prefix(inputs).unwrap_or(&to).display(),
        rowids.len()
    ))
}

/// A Fisher-Yates shuffle of 0..n driven by xorshift64: the same order on every machine.
fn permutation(n: usize, mut seed: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        order.swap(i, (seed % (i as u64 + 1)) as usize);
    }
    order
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_shuffle_is_a_fixed_permutation() {
        let order = super::permutation(1000, 0x5eed_cafe_f00d_d00d);
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..1000).collect::<Vec<_>>());
        assert!(order.windows(2).filter(|w| w[1] < w[0]).count() > 400, "far from time order");
        assert_eq!(order, super::permutation(1000, 0x5eed_cafe_f00d_d00d));
    }
}
