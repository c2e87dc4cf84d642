//! Results of the inefficient-memory analysis ([`super`]): msMemScope's
//! `inefficient_type` in the Attr of each flagged MALLOC row (as its offline `check_inefficient`
//! writes it), table `ms_inefficient` with the facts of every accessed block, and the per-device
//! summary, as text or JSON.
//!
//! Writing is one transaction on its own connection, so a failure leaves the file exactly as it
//! was; values left by an earlier run (or by msMemScope) are replaced, never added to, so reruns
//! converge. Nothing else in `memscope_dump` changes.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::Path;

use rusqlite::params;
use serde_json::{json, Value};

use super::{flag_list, human_ns, Block, End, Options, Report, FLAG_NAMES, OP_INDEX_FLAGS};
use crate::analysis::db::DumpDb;
use crate::analysis::AnalysisError;
use crate::printable::printable;
use crate::units::human_bytes;

pub const INEFFICIENT_TABLE: &str = "ms_inefficient";
/// Dropped and recreated on every run: it always holds the latest analysis only.
const CREATE_TABLE: &str = "CREATE TABLE ms_inefficient (
    malloc_id INTEGER NOT NULL, pid INTEGER NOT NULL, event_type TEXT NOT NULL, pool TEXT,
    ptr TEXT NOT NULL, allocation_id TEXT, size INTEGER NOT NULL, owner TEXT,
    malloc_ns INTEGER NOT NULL, first_access_ns INTEGER, last_access_ns INTEGER,
    free_ns INTEGER NOT NULL, live_at_end INTEGER NOT NULL, accesses INTEGER NOT NULL,
    max_idle_ns INTEGER, malloc_api INTEGER, first_access_api INTEGER, last_access_api INTEGER,
    free_api INTEGER, max_idle_api INTEGER, flags TEXT NOT NULL)";

/// Blocks listed by name in the summary, and in the JSON (all of them are in the table).
const TOP_BLOCKS: usize = 10;
const TOP_JSON_BLOCKS: usize = 1000;

/// What a write changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Written {
    /// MALLOC rows whose `inefficient_type` was set or changed.
    pub set: usize,
    /// MALLOC rows whose stale `inefficient_type` was removed.
    pub removed: usize,
    pub table_rows: usize,
}

fn ptr_text(ptr: u64) -> String {
    format!("0x{ptr:016x}")
}

/// Stores `report` in the DB: `inefficient_type` in place with `json_set`/`json_remove` (rows
/// whose value is already right are not touched), `ms_inefficient` replaced, and
/// `ms_meta.inefficient_at` when the file has our `ms_meta`. One transaction.
pub fn store(db: &DumpDb, report: &Report, run_wall_ns: u64) -> Result<Written, AnalysisError> {
    let table = db.table();
    let mut wanted: HashMap<i64, String> = report
        .blocks
        .iter()
        .filter(|b| b.flags & OP_INDEX_FLAGS != 0)
        .map(|b| (b.malloc_rowid, flag_list(b.flags, OP_INDEX_FLAGS)))
        .collect();
    let mut stale = Vec::new();
    for (rowid, old) in &report.existing {
        match wanted.get(rowid) {
            Some(new) if new.as_str() == &**old => {
                wanted.remove(rowid);
            }
            Some(_) => {} // json_set replaces it where it stands
            None => stale.push(*rowid),
        }
    }
    let mut written = Written { set: wanted.len(), removed: stale.len(), table_rows: 0 };

    let stamps = [
        ("inefficient_at", run_wall_ns.to_string()),
        ("inefficient_options", options_json(&report.options).to_string()),
    ];
    db.replace_tables(&[(INEFFICIENT_TABLE, CREATE_TABLE)], &stamps, |tx| {
        {
            let mut set = tx.prepare(&format!(
                "UPDATE \"{table}\" SET \"Attr\" = json_set(\"Attr\", '$.inefficient_type', ?1) WHERE rowid = ?2"
            ))?;
            let mut rows: Vec<(&i64, &String)> = wanted.iter().collect();
            rows.sort_unstable();
            for (rowid, value) in rows {
                set.execute(params![value, rowid])?;
            }
            let mut remove = tx.prepare(&format!(
                "UPDATE \"{table}\" SET \"Attr\" = json_remove(\"Attr\", '$.inefficient_type') WHERE rowid = ?1"
            ))?;
            for rowid in &stale {
                remove.execute([rowid])?;
            }
        }
        {
            // Many rows per statement: a trace can have millions of accessed blocks, and one
            // statement per row would cost more than the analysis.
            let row = format!("({})", vec!["?"; TABLE_COLUMNS].join(","));
            let insert =
                |n: usize| format!("INSERT INTO {INEFFICIENT_TABLE} VALUES {}", vec![row.as_str(); n].join(","));
            let mut many = tx.prepare(&insert(INSERT_BATCH))?;
            let mut one = tx.prepare(&insert(1))?;
            let accessed: Vec<&Block> = report.blocks.iter().filter(|b| b.accesses > 0).collect();
            for chunk in accessed.chunks(INSERT_BATCH) {
                if chunk.len() == INSERT_BATCH {
                    for (k, b) in chunk.iter().enumerate() {
                        bind_row(&mut many, k * TABLE_COLUMNS, report, b)?;
                    }
                    many.raw_execute()?;
                } else {
                    for b in chunk {
                        bind_row(&mut one, 0, report, b)?;
                        one.raw_execute()?;
                    }
                }
            }
            written.table_rows = accessed.len();
        }
        Ok(written)
    })
}

const TABLE_COLUMNS: usize = 21;
const INSERT_BATCH: usize = 64;

/// Binds one block's `ms_inefficient` row at parameter offset `at`, in the table's column order.
fn bind_row(stmt: &mut rusqlite::Statement<'_>, at: usize, report: &Report, b: &Block) -> rusqlite::Result<()> {
    let api = b.api.as_ref();
    let api_fact = |f: fn(&super::ApiFacts) -> Option<u64>| api.and_then(f).map(|v| v as i64);
    let owner = Some(report.owner(b)).filter(|o| !o.is_empty());
    stmt.raw_bind_parameter(at + 1, b.malloc_id)?;
    stmt.raw_bind_parameter(at + 2, b.pid)?;
    stmt.raw_bind_parameter(at + 3, report.event_type(b))?;
    stmt.raw_bind_parameter(at + 4, b.pool.as_deref())?;
    stmt.raw_bind_parameter(at + 5, ptr_text(b.ptr))?;
    stmt.raw_bind_parameter(at + 6, b.allocation_id.as_deref())?;
    stmt.raw_bind_parameter(at + 7, b.size as i64)?;
    stmt.raw_bind_parameter(at + 8, owner)?;
    stmt.raw_bind_parameter(at + 9, b.malloc_ns)?;
    stmt.raw_bind_parameter(at + 10, b.first_access_ns)?;
    stmt.raw_bind_parameter(at + 11, b.last_access_ns)?;
    stmt.raw_bind_parameter(at + 12, b.end_ns)?;
    stmt.raw_bind_parameter(at + 13, b.end == End::Live)?;
    stmt.raw_bind_parameter(at + 14, b.accesses as i64)?;
    stmt.raw_bind_parameter(at + 15, b.max_idle_ns)?;
    stmt.raw_bind_parameter(at + 16, api_fact(|a| Some(a.malloc)))?;
    stmt.raw_bind_parameter(at + 17, api_fact(|a| a.first_access))?;
    stmt.raw_bind_parameter(at + 18, api_fact(|a| a.last_access))?;
    stmt.raw_bind_parameter(at + 19, api_fact(|a| a.free))?;
    stmt.raw_bind_parameter(at + 20, api_fact(|a| a.max_idle))?;
    stmt.raw_bind_parameter(at + 21, flag_list(b.flags, u8::MAX))?;
    Ok(())
}

fn threshold_json(t: Option<super::TimeThreshold>) -> Value {
    t.map_or(Value::Null, |t| json!({ "value_ns": t.value_ns, "percent": t.percent }))
}

fn options_json(o: &Options) -> Value {
    json!({
        "idle_threshold": o.idle_threshold,
        "mem_size": o.mem_size,
        "lazy_used": threshold_json(o.lazy_used),
        "delayed_free": threshold_json(o.delayed_free),
        "long_idle": threshold_json(o.long_idle),
    })
}

/// Blocks and bytes per flag, in [`FLAG_NAMES`] order.
fn totals(report: &Report) -> [(u64, u64); 6] {
    let mut out = [(0u64, 0u64); 6];
    for b in report.blocks.iter().filter(|b| b.flags != 0) {
        for (i, (flag, _)) in FLAG_NAMES.iter().enumerate() {
            if b.flags & flag != 0 {
                out[i].0 += 1;
                out[i].1 += b.size;
            }
        }
    }
    out
}

/// The `n` largest flagged blocks, largest first (ties: earliest allocated), and how many
/// blocks are flagged in all.
fn top(report: &Report, n: usize) -> (Vec<&Block>, usize) {
    let mut flagged: Vec<&Block> = report.blocks.iter().filter(|b| b.flags != 0).collect();
    let all = flagged.len();
    let key = |b: &&Block| (std::cmp::Reverse(b.size), b.malloc_ns);
    if flagged.len() > n && n > 0 {
        flagged.select_nth_unstable_by_key(n - 1, key);
    }
    flagged.truncate(n);
    flagged.sort_by_key(key);
    (flagged, all)
}

/// How each time-based flag was asked for, or how to ask for it.
fn time_rule(o: &Options, flag: &str) -> String {
    let (t, what, option) = match flag {
        "lazy_used" => (o.lazy_used, "first access more than", "--lazy-used"),
        "delayed_free" => (o.delayed_free, "freed more than", "--delayed-free"),
        _ => (o.long_idle, "an access gap of more than", "--long-idle"),
    };
    match t {
        Some(t) if flag == "delayed_free" => format!("{what} {t} after the last access"),
        Some(t) if flag == "lazy_used" => format!("{what} {t} after the allocation"),
        Some(t) => format!("{what} {t}"),
        None => format!("off (turn on with {option} TIME or PERCENT, e.g. 5ms or 20%)"),
    }
}

/// The summary of one DB.
pub fn text(report: &Report, path: &Path, device: &str) -> String {
    let o = &report.options;
    let s = &report.stats;
    let mut out = String::new();
    let _ = writeln!(out, "device {device}: {}", path.display());
    if let (Some(start), Some(end)) = (report.start_ns, report.end_ns) {
        let _ = writeln!(out, "  trace: {} long", human_ns(end - start));
    }
    let accessed = report.blocks.iter().filter(|b| b.accesses > 0).count();
    let _ = writeln!(
        out,
        "  inefficient memory: {accessed} of {} blocks accessed ({} accesses), {} ops, {} process{}",
        s.blocks,
        s.accesses,
        s.ops,
        s.processes,
        if s.processes == 1 { "" } else { "es" }
    );
    if s.accesses == 0 {
        let _ = writeln!(
            out,
            "  no ACCESS row resolves to a block: neither definition can flag anything in this trace \
             (ACCESS rows name the blocks that copies, sets and kernels used)"
        );
    }
    let totals = totals(report);
    let mem =
        if o.mem_size > 0 { format!(", blocks of {} or more", human_bytes(o.mem_size as i64)) } else { String::new() };
    let _ = writeln!(
        out,
        "  msMemScope's definitions (API index per process; PTA caching and ATB pools; idle threshold {} APIs{mem}):",
        o.idle_threshold
    );
    for (i, (_, name)) in FLAG_NAMES.iter().enumerate() {
        if i == 3 {
            let _ = writeln!(out, "  Insight's time-based flags (every block{mem}):");
        }
        let (blocks, bytes) = totals[i];
        let amount =
            format!("{blocks:>6} block{}  {:>10}", if blocks == 1 { " " } else { "s" }, human_bytes(bytes as i64));
        let rule = if i >= 3 { format!("  {}", time_rule(o, name)) } else { String::new() };
        let _ = writeln!(out, "    {name:<20}{amount}{rule}");
    }
    let (top, flagged) = top(report, TOP_BLOCKS);
    if !top.is_empty() {
        let _ = writeln!(out, "  largest flagged blocks:");
        for b in &top {
            let owner = Some(report.owner(b)).filter(|o| !o.is_empty()).unwrap_or("(no owner)");
            let mut facts = Vec::new();
            if let Some(first) = b.first_access_ns {
                facts.push(format!("first access after {}", human_ns(first - b.malloc_ns)));
            }
            if let Some(idle) = b.max_idle_ns {
                facts.push(format!("longest idle {}", human_ns(idle)));
            }
            if let Some(last) = b.last_access_ns {
                let after = if b.end == End::Live { "live at the end" } else { "freed" };
                facts.push(format!("{after} {} after the last access", human_ns(b.end_ns - last)));
            }
            let _ = writeln!(
                out,
                "    {} {:>10}  {} {}  {}  ({})",
                ptr_text(b.ptr),
                human_bytes(b.size as i64),
                report.event_type(b),
                printable(owner),
                flag_list(b.flags, u8::MAX),
                facts.join(", ")
            );
        }
        if flagged > top.len() {
            let _ = writeln!(out, "    ... {} more in table {INEFFICIENT_TABLE}", flagged - top.len());
        }
    }
    let mut notes = Vec::new();
    if s.unresolved_accesses > 0 {
        notes.push(format!(
            "{} accesses at no live block (memory from before the trace, or host buffers)",
            s.unresolved_accesses
        ));
    }
    if s.accesses > 0 && s.ops == 0 {
        notes.push("no OP_LAUNCH rows: the API index counts memory events only".to_owned());
    }
    if s.below_mem_size > 0 {
        notes.push(format!("{} flagged blocks smaller than --mem-size not counted", s.below_mem_size));
    }
    if s.unreadable > 0 {
        notes.push(format!("{} rows with an unreadable Attr or Ptr skipped", s.unreadable));
    }
    if !notes.is_empty() {
        let _ = writeln!(out, "  notes: {}", notes.join("; "));
    }
    out
}

/// One DB's result for `--json`: the options, per-flag totals, and the largest flagged blocks
/// (`flagged_blocks` says how many there are; table ms_inefficient has them all).
pub fn json(report: &Report, path: &Path, device: &str) -> Value {
    let (top, flagged) = top(report, TOP_JSON_BLOCKS);
    let totals = totals(report);
    let types: Vec<Value> = FLAG_NAMES
        .iter()
        .enumerate()
        .map(|(i, (flag, name))| {
            let definition = if flag & OP_INDEX_FLAGS != 0 { "op-index" } else { "time" };
            json!({ "type": name, "definition": definition, "blocks": totals[i].0, "bytes": totals[i].1 })
        })
        .collect();
    let blocks: Vec<Value> = top
        .into_iter()
        .map(|b| {
            let api = b.api.as_ref();
            json!({
                "malloc_id": b.malloc_id,
                "pid": b.pid,
                "event_type": report.event_type(b),
                "ptr": ptr_text(b.ptr),
                "allocation_id": b.allocation_id.as_deref(),
                "size": b.size,
                "owner": Some(report.owner(b)).filter(|o| !o.is_empty()),
                "flags": flag_list(b.flags, u8::MAX).split(',').collect::<Vec<_>>(),
                "malloc_ns": b.malloc_ns,
                "first_access_ns": b.first_access_ns,
                "last_access_ns": b.last_access_ns,
                "free_ns": b.end_ns,
                "live_at_end": b.end == End::Live,
                "max_idle_ns": b.max_idle_ns,
                "malloc_api": api.map(|a| a.malloc),
                "first_access_api": api.and_then(|a| a.first_access),
                "last_access_api": api.and_then(|a| a.last_access),
                "free_api": api.and_then(|a| a.free),
                "max_idle_api": api.and_then(|a| a.max_idle),
            })
        })
        .collect();
    json!({
        "db": path.display().to_string(),
        "device": device,
        "analysis": "inefficient",
        "options": options_json(&report.options),
        "types": types,
        "flagged_blocks": flagged,
        "blocks": blocks,
        "stats": report.stats,
    })
}

#[cfg(test)]
mod tests {
    use rusqlite::Connection;

    use super::*;
    use crate::analysis::inefficient::scenario::{small_trace, Act, Trace, A, B, C};
    use crate::analysis::inefficient::{analyse, TimeThreshold};
    use crate::store::Attr;
    use Act::{Free, Malloc, Read};

    /// The DB at `path`, opened as `analyze` opens it to write its results.
    fn open(path: &Path) -> DumpDb {
        DumpDb::open(path, true).unwrap()
    }

    fn dump_rows(path: &Path) -> Vec<(i64, String, String)> {
        let conn = Connection::open(path).unwrap();
        let mut stmt = conn.prepare("SELECT rowid, \"Event\", \"Attr\" FROM memscope_dump ORDER BY rowid").unwrap();
        stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?))).unwrap().map(Result::unwrap).collect()
    }

    fn attr_of(path: &Path, ptr: u64) -> String {
        let conn = Connection::open(path).unwrap();
        conn.query_row(
            "SELECT \"Attr\" FROM memscope_dump WHERE \"Event\" = 'MALLOC' AND \"Ptr\" = ?1",
            [ptr_text(ptr)],
            |r| r.get(0),
        )
        .unwrap()
    }

    fn idle_1us() -> Options {
        Options { long_idle: Some(TimeThreshold { value_ns: Some(1_000), percent: None }), ..Options::default() }
    }

    #[test]
    fn flags_go_into_the_malloc_rows_in_place_and_nothing_else_changes() {
        let path = small_trace("out-inplace");
        let before = dump_rows(&path);
        let report = analyse(&open(&path), &idle_1us()).unwrap();
        let w = store(&open(&path), &report, 7).unwrap();
        assert_eq!(w, Written { set: 1, removed: 0, table_rows: 3 });
        let after = dump_rows(&path);
        assert_eq!(before.len(), after.len());
        let b_attr = attr_of(&path, B);
        for (old, new) in before.iter().zip(&after) {
            if new.2 == b_attr {
                // Only msMemScope's types go into Attr; long_idle is Insight's and stays in the table.
                let want = format!("{},\"inefficient_type\":\"early_allocation\"}}", old.2.trim_end_matches('}'));
                assert_eq!(new.2, want);
            } else {
                assert_eq!(old, new, "row {} changed", old.0);
            }
        }
        let conn = Connection::open(&path).unwrap();
        type TableRow = (String, i64, String, Option<i64>, Option<i64>, i64, String);
        let rows: Vec<TableRow> = conn
            .prepare(
                "SELECT ptr, size, owner, first_access_api, max_idle_ns, live_at_end, flags \
                 FROM ms_inefficient ORDER BY malloc_ns",
            )
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?, r.get(6)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[2].0, ptr_text(B));
        assert_eq!((rows[0].6.as_str(), rows[1].6.as_str()), ("", ""));
        assert_eq!((rows[2].1, rows[2].2.as_str(), rows[2].3, rows[2].5), (1 << 20, "PTA@test", Some(4), 0));
        assert_eq!(rows[2].6, "early_allocation,long_idle");
        assert!(rows[2].4.unwrap() > 5_000);
        let meta: String =
            conn.query_row("SELECT value FROM ms_meta WHERE key = 'inefficient_at'", [], |r| r.get(0)).unwrap();
        assert_eq!(meta, "7");
    }

    #[test]
    fn reruns_converge_and_stale_values_are_removed() {
        let path = small_trace("out-rerun");
        let original = dump_rows(&path);
        // A value a previous tool left on a block that is not inefficient, and a wrong one on B.
        let conn = Connection::open(&path).unwrap();
        for (ptr, value) in [(C, "late_deallocation"), (B, "temporary_idleness")] {
            conn.execute(
                "UPDATE memscope_dump SET Attr = json_set(Attr, '$.inefficient_type', ?1) WHERE Event = 'MALLOC' AND Ptr = ?2",
                params![value, ptr_text(ptr)],
            )
            .unwrap();
        }
        let w = store(&open(&path), &analyse(&open(&path), &Options::default()).unwrap(), 1).unwrap();
        assert_eq!((w.set, w.removed), (1, 1));
        assert_eq!(attr_of(&path, B).matches("inefficient_type").count(), 1);
        assert!(attr_of(&path, B).ends_with(",\"inefficient_type\":\"early_allocation\"}"));
        let first = dump_rows(&path);
        // The second run finds everything right and touches no row.
        let w = store(&open(&path), &analyse(&open(&path), &Options::default()).unwrap(), 2).unwrap();
        assert_eq!((w.set, w.removed), (0, 0));
        assert_eq!(dump_rows(&path), first);
        // With a threshold nothing meets, B's value goes and every row is back as traced.
        let big = Options { mem_size: 1 << 30, ..Options::default() };
        let w = store(&open(&path), &analyse(&open(&path), &big).unwrap(), 3).unwrap();
        assert_eq!((w.set, w.removed), (0, 1));
        assert_eq!(dump_rows(&path), original);
        let conn = Connection::open(&path).unwrap();
        let metas: i64 =
            conn.query_row("SELECT count(*) FROM ms_meta WHERE key LIKE 'inefficient_%'", [], |r| r.get(0)).unwrap();
        assert_eq!(metas, 2, "inefficient_at and inefficient_options, once each");
    }

    #[test]
    fn the_table_holds_every_accessed_block_once() {
        // 150 blocks (two full insert batches and a tail): block k is read k % 3 + 1 times, and
        // every tenth is never read.
        let mut t = Trace::new("out-table");
        let ptr = |k: u64| 0x10_0000 + k * 0x100;
        for k in 0..150 {
            t.op(&[Malloc(ptr(k), 0x100)]);
            if k % 10 != 0 {
                for _ in 0..k % 3 + 1 {
                    t.op(&[Read(ptr(k))]);
                }
            }
            t.op(&[Free(ptr(k))]);
        }
        let path = t.finish();
        let w = store(&open(&path), &analyse(&open(&path), &Options::default()).unwrap(), 1).unwrap();
        assert_eq!(w.table_rows, 135);
        let conn = Connection::open(&path).unwrap();
        let got: Vec<(String, i64)> = conn
            .prepare("SELECT ptr, accesses FROM ms_inefficient ORDER BY malloc_id")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        let want: Vec<(String, i64)> =
            (0..150).filter(|k| k % 10 != 0).map(|k| (ptr_text(ptr(k)), (k % 3 + 1) as i64)).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn a_failed_write_changes_nothing() {
        let path = small_trace("out-rollback");
        let before = dump_rows(&path);
        let conn = Connection::open(&path).unwrap();
        conn.execute_batch("CREATE TRIGGER no_meta BEFORE INSERT ON ms_meta BEGIN SELECT RAISE(ABORT, 'no'); END")
            .unwrap();
        let err = store(&open(&path), &analyse(&open(&path), &Options::default()).unwrap(), 1).unwrap_err();
        assert!(matches!(err, AnalysisError::Write { .. }), "{err}");
        assert!(err.to_string().contains("nothing was changed"), "{err}");
        assert_eq!(dump_rows(&path), before, "the Attr updates were rolled back");
        let tables: i64 = conn
            .query_row("SELECT count(*) FROM sqlite_master WHERE name = 'ms_inefficient'", [], |r| r.get(0))
            .unwrap();
        assert_eq!(tables, 0);
    }

    #[test]
    fn a_dump_without_accesses_says_so() {
        let mut t = Trace::new("out-noaccess");
        t.op(&[Malloc(A, 64)]);
        t.op(&[Free(A)]);
        let path = t.finish();
        let report = analyse(&open(&path), &Options::default()).unwrap();
        let text = text(&report, &path, "0");
        assert!(text.contains("no ACCESS row resolves to a block"), "{text}");
        let w = store(&open(&path), &report, 1).unwrap();
        assert_eq!(w, Written::default());
    }

    #[test]
    fn the_summary_counts_bytes_per_type_and_names_owners() {
        let path = small_trace("out-text");
        let report = analyse(&open(&path), &idle_1us()).unwrap();
        let text = text(&report, &path, "0");
        assert!(text.contains("early_allocation         1 block      1.0 MiB"), "{text}");
        assert!(text.contains("late_deallocation        0 blocks         0 B"), "{text}");
        assert!(
            text.contains("long_idle                1 block      1.0 MiB  an access gap of more than 1.000 us"),
            "{text}"
        );
        assert!(
            text.contains("lazy_used                0 blocks         0 B  off (turn on with --lazy-used"),
            "{text}"
        );
        assert!(text.contains("0x0000000000002000    1.0 MiB  PTA PTA@test  early_allocation,long_idle"), "{text}");
        let v = json(&report, &path, "0");
        assert_eq!(v["analysis"], "inefficient");
        assert_eq!(v["types"][0]["blocks"], 1);
        assert_eq!(v["blocks"][0]["flags"], serde_json::json!(["early_allocation", "long_idle"]));
        assert_eq!(v["blocks"][0]["ptr"], "0x0000000000002000");
        assert_eq!(v["options"]["long_idle"]["value_ns"], 1000);
    }

    /// `cargo test --release -p memscope-user million_rows -- --ignored --nocapture`: rows per
    /// second of the analysis and of the write. `MEMSCOPE_BENCH_ROWS` (default 1M) sets the size;
    /// `MEMSCOPE_BENCH_EARLY_EVERY` (default 100) makes every Nth op's output early_allocation
    /// (1: every block, the write's worst case: each flagged MALLOC row is rewritten in place).
    #[test]
    #[ignore = "a timing benchmark, run by hand with --release (see docs/benchmarks.md)"]
    fn million_rows_timing() {
        let env = |name: &str, default: usize| std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default);
        let (rows, every) = (env("MEMSCOPE_BENCH_ROWS", 1_000_000), env("MEMSCOPE_BENCH_EARLY_EVERY", 100).max(1));
        let path = crate::analysis::testdb::dir("ineff-bench").join("memscope_dump_1.db");
        let conn = Connection::open(&path).unwrap();
        conn.execute_batch(&crate::store::schema::create_dump_table()).unwrap();
        conn.execute_batch("BEGIN").unwrap();
        let t0 = std::time::Instant::now();
        let mut early = 0;
        {
            let mut insert = conn
                .prepare("INSERT INTO memscope_dump VALUES (?1, ?2, ?3, 'aten::add', ?4, 7, 7, '0', ?5, ?6, '', '')")
                .unwrap();
            let (mut id, mut ts) = (0i64, 1_000_000_000i64);
            let mut row = |event: &str, ty: &str, ptr: Option<u64>, attr: &Attr| {
                id += 1;
                ts += 37;
                let ptr = ptr.map_or("N/A".to_owned(), ptr_text);
                insert.execute(params![id, event, ty, ts, ptr, attr.to_json()]).unwrap();
                id as usize
            };
            let access = |p: u64| Attr::new().addr("addr", p).with("size", 512u64).with("type", "PTA");
            let block = |p: u64, n: u64| {
                Attr::new()
                    .addr("addr", p)
                    .with("size", 512u64)
                    .with("allocation_id", n)
                    .with("used", 1024u64)
                    .with("total", 1u64 << 30)
                    .with("pool", "caching")
                    .with("owner", "PTA@ops@aten")
            };
            let free = |p: u64| Attr::new().addr("addr", p).with("size", 512u64).with("pool", "caching");
            // Per op: START; the read and free of an earlier op's output; MALLOC and WRITE of its
            // own output; a scratch block allocated, written and freed; a read of a weight; a
            // kernel launch; END. An early output is not written in its op and first read two
            // ops later, after the next op's scratch free.
            let weight = 0x7000_0000u64;
            let scratch = 0x6000_0000u64;
            let chain = |i: usize| 0x1_0000_0000 + i as u64 * 0x1000;
            let mut due: std::collections::HashMap<usize, Vec<(u64, bool)>> = Default::default();
            let mut last = row("MALLOC", "PTA", Some(weight), &block(weight, 1));
            let mut i = 0;
            while last + 12 < rows {
                row("OP_LAUNCH", "ATEN_START", None, &Attr::new());
                for (p, is_early) in due.remove(&i).unwrap_or_default() {
                    row("ACCESS", "READ", Some(p), &access(p));
                    row("FREE", "PTA", Some(p), &free(p));
                    early += usize::from(is_early);
                }
                let p = chain(i);
                row("MALLOC", "PTA", Some(p), &block(p, 2 * i as u64 + 2));
                if i % every == every - 1 && i > 0 {
                    due.entry(i + 2).or_default().push((p, true));
                } else {
                    row("ACCESS", "WRITE", Some(p), &access(p));
                    due.entry(i + 1).or_default().push((p, false));
                }
                row("MALLOC", "PTA", Some(scratch), &block(scratch, 2 * i as u64 + 3));
                row("ACCESS", "WRITE", Some(scratch), &access(scratch));
                row("FREE", "PTA", Some(scratch), &free(scratch));
                row("ACCESS", "READ", Some(weight + 64), &access(weight + 64));
                row("KERNEL_LAUNCH", "KERNEL_LAUNCH", None, &Attr::new().addr("streamId", 1));
                last = row("OP_LAUNCH", "ATEN_END", None, &Attr::new());
                i += 1;
            }
        }
        conn.execute_batch("COMMIT").unwrap();
        let n: i64 = conn.query_row("SELECT count(*) FROM memscope_dump", [], |r| r.get(0)).unwrap();
        eprintln!("generated {n} rows in {:.1} s", t0.elapsed().as_secs_f64());
        drop(conn);
        let options = Options { long_idle: Some("10us".parse().unwrap()), ..Options::default() };
        let t1 = std::time::Instant::now();
        let report = analyse(&open(&path), &options).unwrap();
        let analysed = t1.elapsed().as_secs_f64();
        let t2 = std::time::Instant::now();
        let w = store(&open(&path), &report, 1).unwrap();
        let written = t2.elapsed().as_secs_f64();
        eprintln!(
            "analyse: {n} rows in {analysed:.2} s = {:.0} rows/s; write: {} MALLOC rows set, {} table rows, in \
             {written:.2} s; analyse + write: {:.2} s = {:.0} rows/s",
            n as f64 / analysed,
            w.set,
            w.table_rows,
            analysed + written,
            n as f64 / (analysed + written)
        );
        assert_eq!(w.set, early, "exactly the outputs built early");
        assert_eq!(report.stats.unresolved_accesses, 0);
    }
}
