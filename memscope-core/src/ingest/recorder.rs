//! Events to rows: each event goes through the model, and each fact it adds goes to the store
//! as a row (or as an owner change of an earlier row). The trace loop and the consumer benchmark
//! (`bench-consumer`) both feed events here, so the benchmark times the trace's own path.

use std::collections::BTreeSet;

use thiserror::Error;

use super::flight::Window;
use super::live::LiveView;
use super::py_trace::Builder as PyTraceBuilder;
use crate::model::{Event, EventKind, Output, Tracker};
use crate::stacks::{StackId, NO_STACK};
use crate::store::{Retag, StoreError, Writer};

/// A write that failed: the trace, or the daemon's job, stops on the first.
#[derive(Debug, Error)]
#[error("{what}")]
pub struct WriteFailed {
    /// What it ended ("the trace stopped"), or what was being written ("cannot commit the OOM's
    /// rows"); the store's error then says what could not be written and why.
    pub what: &'static str,
    #[source]
    pub source: StoreError,
}

impl WriteFailed {
    pub fn trace(source: StoreError) -> Self {
        Self { what: "the trace stopped", source }
    }
}

pub struct Recorder {
    pub tracker: Tracker,
    pub store: Writer,
    pub outputs: Vec<Output>,
    pub calls: u64,
    pub markers: u64,
    /// Processes forked by the traced ones and still running.
    pub children: BTreeSet<u32>,
    /// The first write error; the trace stops on it.
    pub error: Option<WriteFailed>,
    /// The daemon's live view of the job (owners, steps), fed the same facts as the store.
    pub live: Option<LiveView>,
    /// Whether rows carry their Python stack's text (`--call-stack python`). Without it the
    /// stacks are still read, for the owner rules, steps and sites, and written once each to
    /// `ms_py_stacks`, which MALLOC rows name (`Attr.py_stack`).
    pub python_column: bool,
    /// Whether a pid that a fork record names is a process (not a thread) still running: the
    /// binary's look at `/proc`, so that only processes are kept as children to rescan.
    is_running_process: fn(u32) -> bool,
    /// `--python-trace`: the function intervals being built from the samples.
    pub py_trace: Option<PyTraceBuilder>,
    /// The daemon's flight recorder: the job's recent rows, every live block's kept.
    pub window: Option<Window>,
}

impl Recorder {
    pub fn new(tracker: Tracker, store: Writer, is_running_process: fn(u32) -> bool) -> Self {
        Self {
            tracker,
            store,
            outputs: Vec::new(),
            calls: 0,
            markers: 0,
            children: BTreeSet::new(),
            error: None,
            live: None,
            python_column: true,
            is_running_process,
            py_trace: None,
            window: None,
        }
    }

    /// Hands closed intervals to the store.
    fn write_py_trace(&mut self, rows: Vec<crate::store::py_trace::PyTraceRow>) {
        if rows.is_empty() {
            return;
        }
        if let Err(e) = self.store.add_py_trace(rows) {
            self.error.get_or_insert(WriteFailed::trace(e));
        }
    }

    /// The trace stops: every function still open ends.
    pub fn finish_py_trace(&mut self) {
        let mut rows = Vec::new();
        if let Some(b) = &mut self.py_trace {
            b.close(None, &mut rows);
        }
        self.write_py_trace(rows);
    }

    #[inline]
    pub fn on_event(&mut self, event: Event) {
        match &event.kind {
            EventKind::Call(_) => self.calls += 1,
            // The fork tracepoint also sees new threads; only processes have maps to rescan.
            EventKind::Fork { child } if (self.is_running_process)(*child) => {
                self.children.insert(*child);
            }
            EventKind::Fork { .. } => {}
            EventKind::Exit => {
                self.children.remove(&event.pid);
                let mut rows = Vec::new();
                if let Some(b) = &mut self.py_trace {
                    b.close(Some(event.pid), &mut rows);
                }
                self.write_py_trace(rows);
            }
            EventKind::PySample(frames) => {
                let mut rows = Vec::new();
                if let Some(b) = &mut self.py_trace {
                    b.sample(event.pid, event.tid, event.wall_ns, frames, &mut rows);
                }
                self.write_py_trace(rows);
                return;
            }
            EventKind::Marker(_) => self.markers += 1,
            EventKind::PyStack { .. } => {
                let EventKind::PyStack { id, text } = event.kind else { unreachable!("matched above") };
                self.tracker.learn_py_stack(id, &text);
                if let Some(w) = &mut self.window {
                    w.add_py_stack(id, &text);
                }
                // Kept whether or not the rows carry the column: `ms_py_stacks` has each once.
                if let Err(e) = self.store.add_py_stack(id, text) {
                    self.error.get_or_insert(WriteFailed::trace(e));
                }
                return;
            }
            EventKind::Stack(_) => {
                let EventKind::Stack(stack) = event.kind else { unreachable!("matched above") };
                if let Some(w) = &mut self.window {
                    w.add_stack(&stack);
                }
                if let Err(e) = self.store.add_stack(stack) {
                    self.error.get_or_insert(WriteFailed::trace(e));
                }
                return;
            }
        }
        let stacks = match &event.kind {
            EventKind::Call(call) => (call.stack, if self.python_column { call.py_stack } else { NO_STACK }),
            _ => (NO_STACK, NO_STACK),
        };
        self.tracker.apply(event, &mut self.outputs);
        self.flush_outputs(stacks);
    }

    /// Forgets the live blocks of the sampled APIs at `wall_ns` (a window of the daemon's
    /// closed: [`Tracker::forget_sampled`]) and writes their implied FREEs; returns how many.
    pub fn forget_sampled(&mut self, wall_ns: u64) -> usize {
        let forgotten = self.tracker.forget_sampled(wall_ns, &mut self.outputs);
        self.flush_outputs((NO_STACK, NO_STACK));
        forgotten
    }

    /// Writes the facts of the last event, with its call's stack; the list keeps its capacity
    /// for the next one.
    fn flush_outputs(&mut self, stacks: (StackId, StackId)) {
        if let Some(live) = &mut self.live {
            // Before the store takes a retag's owner.
            self.outputs.iter().for_each(|o| live.observe(o));
            live.settle();
        }
        if let Some(window) = &mut self.window {
            // Before the store takes a retag's owner too.
            self.outputs.iter().for_each(|o| window.push(o, stacks));
        }
        // After the first error nothing more is written: the trace stops on it.
        let writing = if self.error.is_none() { self.outputs.len() } else { 0 };
        for output in &mut self.outputs[..writing] {
            let written = match output {
                Output::Retag { device, pid, event_type, ptr, owner, by } => {
                    let owner = std::mem::take(owner);
                    let (device, pid, event_type, ptr, by) = (*device, *pid, *event_type, *ptr, *by);
                    self.store.retag(Retag { device, pid, event_type, ptr, owner, by })
                }
                output => self.store.write_output(output, stacks),
            };
            if let Err(e) = written {
                self.error = Some(WriteFailed::trace(e));
                break;
            }
        }
        self.outputs.clear();
    }
}
