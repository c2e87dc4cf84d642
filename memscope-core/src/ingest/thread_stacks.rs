//! Stack records joined to their calls: each thread's stack of its open outermost traced call,
//! given to that call and to every call nested in it (their records come first, at their
//! returns), and new stacks normalized while their process lives
//! ([`crate::stacks::capture`]); with `--unwind dwarf`, the stack windows unwound first
//! ([`crate::stacks::unwind`]), straight from the ring's bytes.
//!
//! Finding a stripped file's debug file is the binary's (it knows `--debug-dir` and reads ELF
//! notes the way its attach code does): it hands a [`DebugFinder`] in.

use std::collections::HashMap;

use memscope_common::python::{PY_AT_DEPTH, PY_MAIN_THREAD, PY_NO_THREAD, PY_READ_FAILED, PY_THREADS_BOUND};
use memscope_common::record::{STACK_AT_DEPTH, STACK_FAILED, WINDOW_FAILED};

use crate::raw::{RawCall, RawPyStack, RawStack, StackWindowView};
use crate::stacks::capture::{Capture, CaptureStats, DebugFinder, RawStack as Captured};
use crate::stacks::python::Resolver;
use crate::stacks::unwind::{Unwinder, Window};
use crate::stacks::{Stack, StackId, NO_STACK};

/// One process's Python stacks by their frames as read (code object, instruction).
type PyIds = HashMap<Box<[(u64, u64)]>, StackId, foldhash::fast::RandomState>;

#[derive(Default)]
pub struct ThreadStacks {
    capture: Capture,
    /// `--unwind dwarf`'s stack windows, unwound as they arrive (while their process lives).
    unwinder: Unwinder,
    /// Frames to keep of an unwound window (`--call-stack c:N`).
    pub depth: usize,
    /// Python frames to text, and each text's id (they are few: one per place that allocates).
    py: Resolver,
    /// By process, then by its frames as read (code object, instruction): a stack seen before
    /// is found without reading or formatting anything.
    /// (and by whether they are the main thread's, lent to a thread that ran no Python).
    py_ids: HashMap<(u32, bool), PyIds, foldhash::fast::RandomState>,
    py_count: StackId,
    /// As `open`, for Python stacks.
    py_open: HashMap<u32, (u64, StackId), foldhash::fast::RandomState>,
    /// By thread: the entry time of its open outermost call, and that call's stack.
    open: HashMap<u32, (u64, StackId), foldhash::fast::RandomState>,
}

impl ThreadStacks {
    /// A stack record: the thread's outermost call has begun. Returns the stack when it is new
    /// (the store must have it before the first row that refers to it).
    pub fn on_stack(&mut self, raw: &RawStack) -> Option<Stack> {
        let (id, new) = self.capture.stack(&Captured {
            pid: raw.tgid,
            return_address: raw.return_address,
            ips: &raw.ips,
            at_depth: raw.flags & STACK_AT_DEPTH != 0,
            failed: raw.flags & STACK_FAILED != 0,
        });
        self.open.insert(raw.tid, (raw.entry_mono_ns, id));
        new
    }

    /// A stack window record (`--unwind dwarf`): unwound here, then as [`Self::on_stack`].
    pub fn on_window(&mut self, w: &StackWindowView<'_>) -> Option<Stack> {
        let window = Window { pid: w.tgid, ip: w.ip, sp: w.sp, fp: w.fp, lr: w.lr, data: w.data };
        let depth = if self.depth == 0 { crate::stacks::spec::DEFAULT_DEPTH as usize } else { self.depth };
        let unwound =
            if w.flags & WINDOW_FAILED != 0 { Default::default() } else { self.unwinder.unwind(&window, depth) };
        let (id, new) = self.capture.stack(&Captured {
            pid: w.tgid,
            return_address: 0,
            ips: &unwound.ips,
            at_depth: !unwound.complete && unwound.ips.len() >= depth,
            failed: unwound.ips.is_empty(),
        });
        self.open.insert(w.tid, (w.entry_mono_ns, id));
        new
    }

    /// A Python sample's functions, outermost first; empty when none can be named, and for a
    /// stack read only in part (a failed read, or cut at the depth), whose outermost frames are
    /// missing: it would end the intervals of the frames it lacks.
    pub fn on_py_sample(&mut self, raw: &RawPyStack) -> Vec<crate::ingest::py_trace::PyFunction> {
        if raw.flags & (PY_READ_FAILED | PY_AT_DEPTH) != 0 {
            return Vec::new();
        }
        let mut functions = self.py.functions(raw.tgid, &raw.frames);
        functions.reverse();
        functions.into_iter().map(|(code, info)| crate::ingest::py_trace::PyFunction { code, info }).collect()
    }

    /// A Python stack record: a stack seen before (same process, same code objects and
    /// instructions) is its id at once; a new one is resolved to text now (its code objects are
    /// read from the live process). Returns the id and the text when the stack is new.
    pub fn on_py_stack(&mut self, raw: &RawPyStack) -> Option<(StackId, Box<str>)> {
        let stats = &mut self.capture.stats;
        stats.py_stacks += 1;
        stats.py_at_depth += u64::from(raw.flags & PY_AT_DEPTH != 0);
        // A thread past the bound may well run Python: counted as that, not as "no Python".
        stats.py_no_thread += u64::from(raw.flags & (PY_NO_THREAD | PY_THREADS_BOUND) == PY_NO_THREAD);
        stats.py_read_failed += u64::from(raw.flags & PY_READ_FAILED != 0);
        stats.py_threads_bound += u64::from(raw.flags & PY_THREADS_BOUND != 0);
        let lent = raw.flags & PY_MAIN_THREAD != 0;
        stats.py_main_thread += u64::from(lent);
        if raw.frames.is_empty() {
            self.py_open.remove(&raw.tid);
            return None;
        }
        if let Some(&id) = self.py_ids.get(&(raw.tgid, lent)).and_then(|m| m.get(raw.frames.as_slice())) {
            self.py_open.insert(raw.tid, (raw.entry_mono_ns, id));
            return None;
        }
        let text = self.py.text(raw.tgid, &raw.frames);
        if text.is_empty() {
            self.py_open.remove(&raw.tid);
            return None;
        }
        // Said in the text itself, where readers of the column see it; no frame line parses so.
        let text = if lent { format!("{}\n{text}", crate::infer::MAIN_THREAD_LINE) } else { text };
        self.py_count += 1;
        let id = self.py_count;
        self.py_ids.entry((raw.tgid, lent)).or_default().insert(raw.frames.as_slice().into(), id);
        self.capture.stats.py_unique += 1;
        self.py_open.insert(raw.tid, (raw.entry_mono_ns, id));
        Some((id, text.into()))
    }

    /// A call's Python stack, as [`Self::of_call`] for native ones.
    pub fn py_of_call(&mut self, call: &RawCall) -> StackId {
        let Some(&(entry, id)) = self.py_open.get(&call.tid) else { return NO_STACK };
        if call.entry_mono_ns == entry {
            self.py_open.remove(&call.tid);
        }
        if call.entry_mono_ns >= entry {
            id
        } else {
            NO_STACK
        }
    }

    /// The session found a process's interpreter: its layout, for resolving its frames.
    pub fn set_python(&mut self, pid: u32, layout: &'static crate::stacks::python::Layout) {
        self.py.set_layout(pid, layout);
    }

    /// The stack of a call: its thread's open outermost call's, when the call began inside it
    /// (or is it: then the thread has no open call any more).
    pub fn of_call(&mut self, call: &RawCall) -> StackId {
        let Some(&(entry, id)) = self.open.get(&call.tid) else { return NO_STACK };
        if call.entry_mono_ns == entry {
            self.open.remove(&call.tid);
            id
        } else if call.entry_mono_ns > entry {
            id
        } else {
            NO_STACK
        }
    }

    /// Stripped files are symbolized from the debug files `finder` finds.
    pub fn set_debug_finder(&mut self, finder: DebugFinder) {
        self.capture.set_debug_finder(finder);
    }

    /// A process exited or replaced its image: its stacks are all normalized (its records came
    /// before this one), and what was learnt of its image is dropped.
    pub fn process_exited(&mut self, pid: u32) {
        self.capture.process_exited(pid);
        self.py_ids.retain(|(p, _), _| *p != pid);
        self.unwinder.process_exited(pid);
        self.py.process_exited(pid);
    }

    pub fn is_empty(&self) -> bool {
        self.open.is_empty() && self.py_open.is_empty()
    }

    pub fn stats(&self) -> CaptureStats {
        self.capture.stats
    }
}
