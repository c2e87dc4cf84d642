//! Call stacks as PyTorch's snapshot frames (`{filename, line, name}`, innermost first): the
//! native frames of a row's `Call Stack(C)` (the traced call and the runtime under it), then its
//! `Call Stack(Python)` frames (the Python code that made the call), as PyTorch records C++ and
//! Python frames of one allocation in one list. Read in one pass over the rows that have a stack,
//! each distinct stack text parsed once.

use std::collections::HashMap;

use serde::Serialize;

use crate::analysis::db::DumpDb;
use crate::analysis::steps::clean_stack;
use crate::analysis::AnalysisError;

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Frame {
    pub filename: String,
    pub line: u64,
    pub name: String,
}

/// `PATH(FUNCTION+0xOFF) [0xADDR] FILE:LINE`, `PATH(FUNCTION) [0xADDR] FILE:LINE (inlined)`,
/// `PATH(+0xOFF) [0xADDR]`, `[0xADDR]` (docs/db-schema.md); `...` lines say why a stack stops.
fn native(line: &str) -> Option<Frame> {
    let line = line.trim();
    if line.is_empty() || line.starts_with("...") {
        return None;
    }
    if let Some(addr) = line.strip_prefix('[') {
        let name = addr.split(']').next().unwrap_or(addr);
        return Some(Frame { filename: "??".into(), line: 0, name: name.to_owned() });
    }
    let (head, tail) = line.split_once(" [").unwrap_or((line, ""));
    let (path, function) = match head.split_once('(') {
        Some((path, rest)) => (path, rest.trim_end_matches(')')),
        None => ("??", head),
    };
    let name = function.split("+0x").next().filter(|n| !n.is_empty()).unwrap_or(function);
    let source = tail.split_once("] ").map(|(_, s)| s.trim_end_matches(" (inlined)"));
    let (filename, line) = match source.and_then(|s| s.rsplit_once(':')) {
        Some((file, n)) if n.parse::<u64>().is_ok() => (file.to_owned(), n.parse().unwrap_or(0)),
        _ => (path.to_owned(), 0),
    };
    Some(Frame { filename, line, name: name.to_owned() })
}

/// `FILE(LINE): FUNCTION`; `?` for a frame whose code could not be read.
fn python(line: &str) -> Option<Frame> {
    let line = line.trim();
    if line.is_empty() {
        return None;
    }
    let parsed = line.split_once("): ").and_then(|(place, name)| {
        let (file, n) = place.rsplit_once('(')?;
        Some(Frame { filename: file.to_owned(), line: n.parse().ok()?, name: name.to_owned() })
    });
    Some(parsed.unwrap_or_else(|| Frame { filename: "??".into(), line: 0, name: line.to_owned() }))
}

/// A row's frames from its two stack columns.
pub fn parse(c_stack: &str, python_stack: &str) -> Vec<Frame> {
    let c = clean_stack(c_stack);
    let py = clean_stack(python_stack);
    c.lines().filter_map(native).chain(py.lines().filter_map(python)).collect()
}

/// The frames of every MALLOC and FREE row that has a stack, by rowid.
#[derive(Default)]
pub struct Stacks {
    by_row: HashMap<i64, u32>,
    stacks: Vec<Vec<Frame>>,
}

impl Stacks {
    pub fn read(db: &DumpDb) -> Result<Self, AnalysisError> {
        let mut out = Self::default();
        if !db.missing_columns(&["Call Stack(C)", "Call Stack(Python)"])?.is_empty() {
            return Ok(out);
        }
        let read = |source| AnalysisError::Read { path: db.path().to_owned(), source };
        let sql = format!(
            "SELECT rowid, \"Call Stack(C)\", \"Call Stack(Python)\" FROM \"{}\" WHERE Event IN ('MALLOC', 'FREE') \
             AND (length(\"Call Stack(C)\") > 3 OR length(\"Call Stack(Python)\") > 3)",
            db.table()
        );
        let mut stmt = db.conn().prepare(&sql).map_err(read)?;
        let mut rows = stmt.query([]).map_err(read)?;
        let mut seen: HashMap<(String, String), u32> = HashMap::new();
        while let Some(row) = rows.next().map_err(read)? {
            let rowid: i64 = row.get(0).map_err(read)?;
            let text = |i| row.get::<_, Option<String>>(i).map(Option::unwrap_or_default);
            let key = (text(1).map_err(read)?, text(2).map_err(read)?);
            let next = out.stacks.len() as u32;
            let id = *seen.entry(key).or_insert_with_key(|(c, py)| {
                out.stacks.push(parse(c, py));
                next
            });
            out.by_row.insert(rowid, id);
        }
        Ok(out)
    }

    /// The frames of a row (none when it has no stack).
    pub fn of(&self, rowid: i64) -> Vec<Frame> {
        self.by_row.get(&rowid).map(|&i| self.stacks[i as usize].clone()).unwrap_or_default()
    }

    pub fn is_empty(&self) -> bool {
        self.by_row.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn native_and_python_lines_become_frames_innermost_first() {
        let c = "/opt/lib/libascendcl.so(aclrtMalloc+0x1c) [0x7f00001c] /src/acl.c:41\n\
                 /opt/lib/libx.so(inner) [0x7f000200] /src/x.h:7 (inlined)\n\
                 /opt/lib/libx.so(+0x99) [0x7f000299]\n\
                 [0xdeadbeef]\n\
                 ... (cut at the depth asked for: 4)";
        let py = "\"train.py(52): Model.forward\n?\"";
        let frames = parse(c, py);
        let f = |filename: &str, line, name: &str| Frame { filename: filename.into(), line, name: name.into() };
        assert_eq!(
            frames,
            [
                f("/src/acl.c", 41, "aclrtMalloc"),
                f("/src/x.h", 7, "inner"),
                f("/opt/lib/libx.so", 0, "+0x99"),
                f("??", 0, "0xdeadbeef"),
                f("train.py", 52, "Model.forward"),
                f("??", 0, "?"),
            ]
        );
        assert!(parse("NA", "NA").is_empty());
    }
}
