//! MindStudio Insight's import rules applied to a DB the tracer wrote: the file's name, mode and
//! owner, SQLite's integrity, the columns, and what its importer and decomposition view need
//! of the rows.

use std::collections::HashMap;
use std::path::Path;

use crate::environment::expected_owner;
use crate::readers::{read_db, DbRow, CSV_HEADER};

/// Event Types Insight's decomposition request accepts (its `MemScopeDefs.h`), plus `HOST`
/// (CPU tensors, as msMemScope writes them): Insight imports `HOST` blocks into its curve but its
/// decomposition view rejects the type, so a file's `HOST` rows are shown there as nothing.
pub const INSIGHT_BLOCK_TYPES: [&str; 7] = ["PTA", "MINDSPORE", "ATB", "HAL", "PTA_WORKSPACE", "HOST_PINNED", "HOST"];
/// Block types whose MALLOC Insight's decomposition tree needs an `owner` for.
const OWNED_TYPES: [&str; 4] = ["HAL", "PTA", "PTA_WORKSPACE", "HOST_PINNED"];
/// Whether `name` is what Insight's importer looks for: `^(memscope|leaks)_dump_\d+\.db$`.
pub fn insight_file_name(name: &str) -> bool {
    let digits = name.strip_prefix("memscope_dump_").or_else(|| name.strip_prefix("leaks_dump_"));
    digits.and_then(|d| d.strip_suffix(".db")).is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
}
/// Mode and owner of a file or folder of a run: 0600 files, 0700 folders, never world-writable,
/// owned by `owner`.
pub fn assert_private(path: &Path, owner: (u32, u32)) {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mode = m.mode() & 0o7777;
    let want = if m.is_dir() { 0o700 } else { 0o600 };
    assert_eq!(mode, want, "{} has mode {mode:o}, not {want:o}", path.display());
    assert_eq!(mode & 0o002, 0, "{} is world-writable", path.display());
    assert_eq!((m.uid(), m.gid()), owner, "{} is not owned by the expected user", path.display());
}
/// Applies MindStudio Insight's import rules (shared/reference/stacks-daemon-exports.md §6: its
/// MemScope parser and database code) to one DB the tracer wrote, expecting `owner` to own it.
pub fn insight_rules_for(db: &Path, owner: (u32, u32)) {
    let shown = db.display();
    let name = db.file_name().unwrap().to_string_lossy();
    assert!(insight_file_name(&name), "Insight does not import a file named {name}");
    // The file, every file beside it (-wal, -shm), its dump/ and device_<id>/ folders.
    let dir = db.parent().unwrap();
    for entry in std::fs::read_dir(dir).unwrap() {
        assert_private(&entry.unwrap().path(), owner);
    }
    for folder in db.ancestors().skip(1).take(3) {
        assert_private(folder, owner);
    }
    let conn = rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
    // The tracer writes memscope_dump's B-tree pages itself: SQLite's own check of the file's
    // structure (every page, key order, free space, freelist) must find nothing.
    let integrity: Vec<String> = conn
        .prepare("PRAGMA integrity_check")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(integrity, ["ok"], "{shown}: SQLite finds the file damaged");
    let columns: Vec<String> = conn
        .prepare("SELECT name FROM pragma_table_info('memscope_dump') ORDER BY cid")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(columns, CSV_HEADER.split(',').collect::<Vec<_>>(), "{shown}: Insight reads the columns by position");
    let rows = read_db(db, "") /* every Attr value a string, or it panics */;
    // Insight reads only rows with a device.
    let placed: Vec<&DbRow> = rows.iter().filter(|r| !matches!(r.device.as_str(), "N/A" | "" | "host")).collect();
    assert!(
        placed.iter().any(|r| r.device.parse::<u32>().is_ok() || r.device == "cpu"),
        "{shown}: no row with a device (Insight: \"No memory events could be found\")"
    );
    let (min, max) = (placed.iter().map(|r| r.ts).min().unwrap(), placed.iter().map(|r| r.ts).max().unwrap());
    assert!(min > 0 && max > min, "{shown}: timestamps {min}..{max}");
    let mut mallocs: HashMap<&str, &DbRow> = HashMap::new();
    for r in rows.iter().filter(|r| r.event == "MALLOC" || r.event == "FREE") {
        assert!(INSIGHT_BLOCK_TYPES.contains(&r.event_type.as_str()), "{shown}: Event Type Insight rejects: {r:?}");
        assert!(r.attr_u64("size").is_some_and(|s| s > 0), "{shown}: Insight skips a block of no size: {r:?}");
        if r.event == "MALLOC" {
            let id = r.attr.get("allocation_id").unwrap_or_else(|| panic!("{shown}: MALLOC without id: {r:?}"));
            if let Some(other) = mallocs.insert(id, r) {
                panic!("{shown}: allocation_id {id} names two blocks (Insight merges them):\n  {other:?}\n  {r:?}");
            }
            if OWNED_TYPES.contains(&r.event_type.as_str()) {
                assert!(
                    r.attr.get("owner").is_some_and(|o| !o.is_empty()),
                    "{shown}: the decomposition tree leaves out a block without an owner: {r:?}"
                );
            }
        }
    }
    let named = |r: &DbRow, key: &str| -> Option<u64> { r.attr.get(key).map(|_| r.attr_u64(key).unwrap()) };
    for r in &rows {
        let listing = matches!(r.event_type.as_str(), "OOM_RECENT_ALLOC" | "OOM_TOP_ALLOC");
        if !(r.event == "FREE" || r.event == "ACCESS" || listing) {
            continue;
        }
        let id = r.attr.get("allocation_id").unwrap_or_else(|| panic!("{shown}: no allocation_id: {r:?}"));
        let m = mallocs.get(id.as_str()).unwrap_or_else(|| panic!("{shown}: allocation_id {id} has no MALLOC: {r:?}"));
        let block = match r.event.as_str() {
            "FREE" => {
                assert_eq!(r.event_type, m.event_type, "{shown}: FREE and MALLOC of another type: {r:?} {m:?}");
                r.ptr_value()
            }
            "ACCESS" => named(r, "block"),
            _ => named(r, "ptr"),
        };
        assert_eq!(block, m.ptr_value(), "{shown}: {r:?} names another block than its MALLOC {m:?}");
    }
}
/// [`insight_rules_for`] with the owner the tests expect ([`expected_owner`]).
pub fn insight_rules(db: &Path) {
    insight_rules_for(db, expected_owner());
}
