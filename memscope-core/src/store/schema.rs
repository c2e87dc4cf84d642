//! Table definitions. `memscope_dump` is msMemScope's table, byte for byte: Insight reads its
//! columns by position. Our own tables carry an `ms_` prefix and never use the names Insight
//! creates in the file itself (`memory_allocation`, `memory_block`, `status_info`).

/// Version of our own tables (`ms_meta.schema_version`); bump on any change to them.
pub const SCHEMA_VERSION: u32 = 4;

pub const DUMP_TABLE: &str = "memscope_dump";
/// Frees of blocks the trace never saw allocated, in `memscope_dump`'s columns: kept out of
/// Insight's table, which would pair them with unrelated blocks or count blocks of size 0.
pub const UNTRACKED_FREES_TABLE: &str = "ms_untracked_frees";

/// The 12 columns of `memscope_dump`, in order, with their SQLite types.
pub const DUMP_COLUMNS: [(&str, &str); 12] = [
    ("ID", "INTEGER"),
    ("Event", "TEXT"),
    ("Event Type", "TEXT"),
    ("Name", "TEXT"),
    ("Timestamp(ns)", "INTEGER"),
    ("Process Id", "INTEGER"),
    ("Thread Id", "INTEGER"),
    ("Device Id", "TEXT"),
    ("Ptr", "TEXT"),
    ("Attr", "TEXT"),
    ("Call Stack(Python)", "TEXT"),
    ("Call Stack(C)", "TEXT"),
];

/// Tables Insight adds to an imported DB; creating them ourselves would break its import.
#[cfg(any(test, feature = "testing"))]
pub const INSIGHT_OWNED_TABLES: [&str; 3] = ["memory_allocation", "memory_block", "status_info"];

pub fn create_dump_table() -> String {
    create_rows_table(DUMP_TABLE)
}

/// A table with `memscope_dump`'s columns.
pub fn create_rows_table(table: &str) -> String {
    let columns: Vec<String> = DUMP_COLUMNS.iter().map(|(name, ty)| format!("\"{name}\" {ty}")).collect();
    format!("CREATE TABLE IF NOT EXISTS {table} ({})", columns.join(", "))
}

/// Our own tables (documented in docs/db-schema.md).
pub const OWN_TABLES: &str = "
CREATE TABLE IF NOT EXISTS ms_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS ms_probes (
    library TEXT NOT NULL, symbol TEXT NOT NULL, api TEXT NOT NULL,
    file_offset INTEGER NOT NULL, source TEXT NOT NULL, attached_ns INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS ms_lost (cpu INTEGER PRIMARY KEY, lost INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS ms_driver (
    ts_ns INTEGER NOT NULL, pid INTEGER, process_used INTEGER, device_used INTEGER,
    device_total INTEGER, source TEXT NOT NULL);
";

/// The trace's native stacks, when it has any (`trace --call-stack c`): one row per stack, and
/// one per function of each frame (docs/db-schema.md).
pub const STACK_TABLES: &str = "
CREATE TABLE IF NOT EXISTS ms_stacks (
    id INTEGER PRIMARY KEY, pid INTEGER NOT NULL, cut TEXT NOT NULL, frames INTEGER NOT NULL,
    text TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS ms_frames (
    stack_id INTEGER NOT NULL, frame INTEGER NOT NULL, depth INTEGER NOT NULL, addr INTEGER NOT NULL,
    path TEXT, build_id TEXT, file_offset INTEGER, symbol TEXT, symbol_offset INTEGER, file TEXT,
    line INTEGER, inlined INTEGER NOT NULL, status TEXT NOT NULL,
    PRIMARY KEY (stack_id, frame, depth));
";

/// The trace's Python stacks, when it read any (the owner rules, sites, `--call-stack python`):
/// one row per distinct stack, which MALLOC rows name by `Attr.py_stack` (docs/db-schema.md).
pub const PY_STACK_TABLE: &str = "
CREATE TABLE IF NOT EXISTS ms_py_stacks (id INTEGER PRIMARY KEY, text TEXT NOT NULL);
";

/// The CSV header of the dump, as msMemScope writes it.
pub fn csv_header() -> String {
    DUMP_COLUMNS.iter().map(|(name, _)| *name).collect::<Vec<_>>().join(",")
}
