//! A trace's call sequence for `compare --level`: its operators or its kernels in time order,
//! each with the memory delta msMemScope's compare gives a call (reference §4.3, "Comparison").
//!
//! **Operators** are the `OP_LAUNCH` ends (`ATEN_END`, `ATB_END`): msMemScope diffs the end
//! sequence, where a nested operator comes before the one that called it. Our ends are written
//! with `Name` `N/A` (the markers' `op_end` carries no name), so each end takes the name of the
//! start it closes: starts are stacked per thread and per family (aten, ATB), and an end pops the
//! innermost open one. An end that does name its operator (msMemScope's files) closes that
//! operator's innermost start instead, as the tracer does. Taking the start sequence instead
//! would be simpler but orders nested operators differently from msMemScope's.
//!
//! **Kernels** are the `KERNEL_LAUNCH` rows, named by their `Name`.
//!
//! **Memory delta.** As msMemScope: the size of the next caching-allocator event after the call,
//! positive for a `MALLOC` and negative for a `FREE` (`PTA` rows of the caching pool, and
//! MindSpore's `MINDSPORE`; workspace blocks are operator scratch, not tensors). The event must
//! come before that process's next call at the same level, so no event is counted twice; a call
//! with none has delta 0. Events are matched per process, not per thread: with torch_npu's task
//! queue, kernels are launched from a thread other than the one that allocates. Shadow frees (the
//! blocks still live when the trace stopped) are no event.

use std::collections::HashMap;

use super::attr::attr_fields;
use super::db::{DumpDb, DumpRow, Fed};
use super::AnalysisError;
use crate::vocab::{Event, EventType};

/// Which calls are compared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    /// Operators: `OP_LAUNCH` ends (`ATEN_END`, `ATB_END`), named by their starts.
    Op,
    /// Kernels: `KERNEL_LAUNCH` rows.
    Kernel,
}

impl Level {
    /// The call, in one word, for reports.
    pub fn noun(self) -> &'static str {
        match self {
            Self::Op => "op",
            Self::Kernel => "kernel",
        }
    }

    fn event(self) -> &'static str {
        match self {
            Self::Op => Event::OpLaunch.as_str(),
            Self::Kernel => Event::KernelLaunch.as_str(),
        }
    }
}

/// One call: its name (an index into [`Calls::names`]) and its memory delta in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Call {
    pub name: u32,
    pub ts: i64,
    pub delta: i64,
}

/// A trace's calls in time order.
#[derive(Debug, Default)]
pub struct Calls {
    pub names: Vec<Box<str>>,
    pub calls: Vec<Call>,
    /// Operator ends with no open start on their thread (the trace began inside the operator).
    pub unpaired_ends: u64,
    /// Caching-allocator events that gave a call its delta, and those after no call.
    pub attributed: u64,
    pub unattributed: u64,
}

impl Calls {
    pub fn name(&self, call: &Call) -> &str {
        &self.names[call.name as usize]
    }
}

/// What an empty name reads as (the DB's own placeholder).
const NO_NAME: &str = "N/A";

attr_fields! {
    /// The Attr keys the delta needs.
    struct Fields { size, pool, shadow }
}

/// Builds [`Calls`] from rows in time order.
pub struct Sequencer {
    level: Level,
    out: Calls,
    ids: HashMap<Box<str>, u32>,
    /// Open operator starts per (process, thread, is ATB): names, innermost last.
    open: HashMap<(i64, i64, bool), Vec<u32>>,
    /// Per process, its latest call while it has no delta yet.
    waiting: HashMap<i64, usize>,
}

impl Sequencer {
    pub fn new(level: Level) -> Self {
        Self { level, out: Calls::default(), ids: HashMap::new(), open: HashMap::new(), waiting: HashMap::new() }
    }

    fn intern(&mut self, name: &str) -> u32 {
        let name = if name.is_empty() { NO_NAME } else { name };
        if let Some(&id) = self.ids.get(name) {
            return id;
        }
        let id = self.out.names.len() as u32;
        self.out.names.push(name.into());
        self.ids.insert(name.into(), id);
        id
    }

    fn call(&mut self, row: &DumpRow<'_>, name: u32) {
        self.waiting.insert(row.pid, self.out.calls.len());
        self.out.calls.push(Call { name, ts: row.ts, delta: 0 });
    }

    pub fn apply(&mut self, row: DumpRow<'_>) {
        match (Event::parse(row.event), self.level) {
            (Some(Event::KernelLaunch), Level::Kernel) => {
                let name = self.intern(row.name);
                self.call(&row, name);
            }
            (Some(Event::OpLaunch), Level::Op) => self.op(&row),
            (Some(Event::Malloc | Event::Free), _)
                if matches!(EventType::parse(row.event_type), Some(EventType::Pta | EventType::Mindspore)) =>
            {
                self.memory(&row)
            }
            _ => {}
        }
    }

    fn op(&mut self, row: &DumpRow<'_>) {
        let (atb, start) = match EventType::parse(row.event_type) {
            Some(EventType::AtenStart) => (false, true),
            Some(EventType::AtenEnd) => (false, false),
            Some(EventType::AtbStart) => (true, true),
            Some(EventType::AtbEnd) => (true, false),
            _ => return,
        };
        let key = (row.pid, row.tid, atb);
        let named = !row.name.is_empty() && row.name != NO_NAME;
        if start {
            let name = self.intern(row.name);
            self.open.entry(key).or_default().push(name);
            return;
        }
        let stack = self.open.entry(key).or_default();
        let from_start = if named {
            let id = self.ids.get(row.name).copied();
            match stack.iter().rposition(|n| Some(*n) == id) {
                Some(i) => stack.drain(i..).next(),
                None => None,
            }
        } else {
            stack.pop()
        };
        let name = match from_start {
            Some(id) => id,
            None => {
                self.out.unpaired_ends += 1;
                self.intern(row.name)
            }
        };
        self.call(row, name);
    }

    fn memory(&mut self, row: &DumpRow<'_>) {
        let fields = Fields::parse(row.attr).unwrap_or_default();
        if fields.pool.as_deref() == Some("workspace") || fields.shadow.as_deref() == Some("true") {
            return;
        }
        let Some(size) = fields.size.and_then(|s| s.trim().parse::<i64>().ok()) else { return };
        match self.waiting.remove(&row.pid) {
            Some(i) => {
                self.out.calls[i].delta = if row.event == Event::Free.as_str() { -size } else { size };
                self.out.attributed += 1;
            }
            None => self.out.unattributed += 1,
        }
    }

    pub fn finish(self) -> Calls {
        self.out
    }
}

/// The calls of one DB at `level`; a DB with none is an error that says how to record them.
pub fn read(db: &DumpDb, level: Level) -> Result<Calls, AnalysisError> {
    let mut seq = Sequencer::new(level);
    db.for_each_named_row(&[level.event(), Event::Malloc.as_str(), Event::Free.as_str()], |fed| match fed {
        Fed::Row(row) => seq.apply(row),
        Fed::Restart => seq = Sequencer::new(level),
    })?;
    let calls = seq.finish();
    if calls.calls.is_empty() {
        let path = db.path().to_owned();
        return Err(match level {
            Level::Op => AnalysisError::NoOps { path },
            Level::Kernel => AnalysisError::NoKernels { path },
        });
    }
    Ok(calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row<'a>(event: &'a str, event_type: &'a str, name: &'a str, ts: i64, tid: i64, attr: &'a str) -> DumpRow<'a> {
        DumpRow { rowid: 0, id: 0, event, event_type, name, ts, pid: 1, tid, ptr: "", attr }
    }

    fn named(calls: &Calls) -> Vec<(&str, i64)> {
        calls.calls.iter().map(|c| (calls.name(c), c.delta)).collect()
    }

    #[test]
    fn ends_take_their_starts_names_per_thread_innermost_first() {
        let mut s = Sequencer::new(Level::Op);
        s.apply(row("OP_LAUNCH", "ATEN_START", "aten.linear.default", 1, 7, ""));
        s.apply(row("OP_LAUNCH", "ATEN_START", "aten.add.Tensor", 2, 8, "")); // another thread
        s.apply(row("OP_LAUNCH", "ATEN_START", "aten.mm.default", 3, 7, ""));
        s.apply(row("OP_LAUNCH", "ATEN_END", "N/A", 4, 7, "")); // mm
        s.apply(row("OP_LAUNCH", "ATEN_END", "N/A", 5, 8, "")); // add, on its own thread
        s.apply(row("OP_LAUNCH", "ATEN_END", "N/A", 6, 7, "")); // linear
        s.apply(row("OP_LAUNCH", "ATEN_END", "N/A", 7, 7, "")); // nothing open
                                                                // msMemScope's named ends close their own start, even past an unclosed inner one.
        s.apply(row("OP_LAUNCH", "ATB_START", "LinearOp", 8, 7, ""));
        s.apply(row("OP_LAUNCH", "ATB_START", "ElewiseOp", 9, 7, ""));
        s.apply(row("OP_LAUNCH", "ATB_END", "LinearOp", 10, 7, ""));
        s.apply(row("OP_LAUNCH", "ATB_END", "N/A", 11, 7, "")); // both were closed
        let calls = s.finish();
        let names: Vec<&str> = calls.calls.iter().map(|c| calls.name(c)).collect();
        assert_eq!(names, ["aten.mm.default", "aten.add.Tensor", "aten.linear.default", "N/A", "LinearOp", "N/A"]);
        assert_eq!(calls.unpaired_ends, 2);
    }

    #[test]
    fn a_call_gets_the_next_caching_pool_event_before_the_next_call() {
        let malloc = r#"{"size":"4096","pool":"caching"}"#;
        let mut s = Sequencer::new(Level::Kernel);
        s.apply(row("MALLOC", "PTA", "", 1, 1, malloc)); // before any call
        s.apply(row("KERNEL_LAUNCH", "KERNEL_LAUNCH", "MatMul", 2, 1, ""));
        s.apply(row("MALLOC", "PTA", "", 3, 1, r#"{"size":"512","pool":"workspace"}"#)); // scratch
        s.apply(row("MALLOC", "HAL", "", 4, 1, r#"{"size":"999"}"#)); // not the pool
        s.apply(row("MALLOC", "PTA", "", 5, 2, malloc)); // another thread of the process
        s.apply(row("FREE", "PTA", "", 6, 1, r#"{"size":"100"}"#)); // already given
        s.apply(row("KERNEL_LAUNCH", "KERNEL_LAUNCH", "Add", 7, 1, ""));
        s.apply(row("FREE", "PTA", "", 8, 1, r#"{"size":"2048","pool":"caching"}"#));
        s.apply(row("KERNEL_LAUNCH", "KERNEL_LAUNCH", "Add", 9, 1, ""));
        s.apply(row("KERNEL_LAUNCH", "KERNEL_LAUNCH", "Relu", 10, 1, ""));
        s.apply(row("FREE", "PTA", "", 11, 1, r#"{"size":"8","shadow":"true"}"#)); // the stop's
        s.apply(row("OP_LAUNCH", "ATEN_END", "", 12, 1, "")); // another level
        let calls = s.finish();
        assert_eq!(named(&calls), [("MatMul", 4096), ("Add", -2048), ("Add", 0), ("Relu", 0)]);
        assert_eq!((calls.attributed, calls.unattributed), (2, 2));
        assert_eq!(calls.names.len(), 3, "names are interned");
    }

    #[test]
    fn processes_are_attributed_separately() {
        let mut s = Sequencer::new(Level::Kernel);
        let launch = |pid| DumpRow { pid, ..row("KERNEL_LAUNCH", "KERNEL_LAUNCH", "K", 1, 1, "") };
        let malloc = |pid, attr| DumpRow { pid, ..row("MALLOC", "PTA", "", 2, 1, attr) };
        s.apply(launch(10));
        s.apply(launch(20));
        s.apply(malloc(10, r#"{"size":"1"}"#));
        s.apply(malloc(20, r#"{"size":"2"}"#));
        assert_eq!(named(&s.finish()), [("K", 1), ("K", 2)]);
    }
}
