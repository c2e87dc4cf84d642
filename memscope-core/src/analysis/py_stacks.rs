//! The trace's Python stacks (`ms_py_stacks`) as paths of frames, outermost first, for the
//! decomposition by stack (`decompose::By::Stack`) that the report draws as a flame view: a
//! block's MALLOC row names its stack by `Attr.py_stack`.
//!
//! A path's levels are joined with `@`, as owner paths are, so the decomposition's one tree
//! builder nests them; an `@` inside a frame (a file name can hold one) is written `%40`.

use std::collections::HashMap;

use super::db::DumpDb;
use super::AnalysisError;
use crate::infer::Frame;

/// The node of blocks whose MALLOC names no Python stack (none was read, or the DB has none).
pub const NO_STACK: &str = "(no Python stack)";

/// A frame as a node of the flame view: `function (file:line)`; a line that is not a frame (an
/// unreadable `?`, the main thread's stack lent to a thread without Python) as it is written.
pub fn level(line: &str) -> String {
    let text = match Frame::parse(line) {
        Some(f) => format!("{} ({}:{})", f.function, f.file, f.line),
        None => line.to_owned(),
    };
    text.replace('@', "%40")
}

/// A stack's text (innermost first, one frame a line) as a path, outermost first.
pub fn path(text: &str) -> String {
    let mut levels: Vec<String> = text.lines().filter(|l| !l.is_empty()).map(level).collect();
    levels.reverse();
    if levels.is_empty() {
        return NO_STACK.to_owned();
    }
    levels.join("@")
}

/// Whether the DB has the table (a trace with Python stacks read wrote it).
pub fn present(db: &DumpDb) -> Result<bool, AnalysisError> {
    let sql = "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'ms_py_stacks'";
    let n: i64 = db
        .conn()
        .query_row(sql, [], |r| r.get(0))
        .map_err(|source| AnalysisError::Read { path: db.path().to_owned(), source })?;
    Ok(n > 0)
}

/// Each stack's path, by its id as the rows' Attr writes it; empty when the DB has no table.
pub fn paths(db: &DumpDb) -> Result<HashMap<String, String>, AnalysisError> {
    if !present(db)? {
        return Ok(HashMap::new());
    }
    let read = |source| AnalysisError::Read { path: db.path().to_owned(), source };
    let mut stmt = db.conn().prepare("SELECT id, text FROM ms_py_stacks").map_err(read)?;
    let rows = stmt.query_map([], |r| Ok((r.get::<_, i64>(0)?.to_string(), path(&r.get::<_, String>(1)?))));
    rows.and_then(Iterator::collect).map_err(read)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stack_reads_outermost_first_and_keeps_at_signs_out_of_the_levels() {
        let text = "/v/torch/nn/functional.py(2380): linear\n?\n/job/a@b/train.py(40): main";
        assert_eq!(path(text), "main (/job/a%40b/train.py:40)@?@linear (/v/torch/nn/functional.py:2380)");
        assert_eq!(path(""), NO_STACK);
    }
}
