//! Ring records to events, one record at a time: each record's bytes decoded ([`super::super::raw`]),
//! a call joined to the buffer its entry copied and to its thread's stacks ([`super::thread_stacks`]),
//! its times made wall-clock ([`super::clock`]) and its API's meaning applied
//! ([`crate::apis`]). The ring's consumer in the binary feeds each sample here; so does the
//! consumer benchmark, with records that did not come from a ring.

use std::collections::HashMap;

use memscope_common::record::RecordKind;
use memscope_common::sampling::WINDOW_ONLY;

use super::callers::Callers;
use super::clock::Clock;
use super::thread_stacks::ThreadStacks;
use crate::apis::libraries::Library;
use crate::apis::Api;
use crate::model::{Call, Event, EventKind};
use crate::raw::{self as decode, RawBlob, RawCall, Record};
use crate::stacks::capture::{CaptureStats, DebugFinder};
use crate::stacks::{StackId, NO_STACK};

/// Counts of what the consumer saw.
#[derive(Clone, Copy, Debug, Default)]
pub struct ConsumerStats {
    pub records: u64,
    pub undecodable: u64,
    /// Calls whose cookie names no API of this build.
    pub unknown_api: u64,
}

/// Ring records to events, one record at a time: what the consumer does with each sample, also
/// used to replay records that did not come from a ring (`bench-consumer`).
pub struct Decoder {
    clock: Clock,
    /// Buffers copied at a call's entry, waiting for the call's record on the same thread
    /// (looked up for every record, hence the fast hash).
    blobs: HashMap<u32, RawBlob, foldhash::fast::RandomState>,
    stacks: ThreadStacks,
    callers: Callers,
    /// Processes seen replacing their image, until the session takes them.
    execs: Vec<u32>,
    /// Processes whose dynamic linker reported a change, until the daemon or session takes them.
    loads: Vec<u32>,
    /// The kernel's sampling interval in bytes (0: every call recorded).
    sample_bytes: u64,
}

impl Decoder {
    pub fn new(clock: Clock) -> Self {
        Self {
            clock,
            blobs: HashMap::default(),
            stacks: ThreadStacks::default(),
            callers: Callers::default(),
            execs: Vec::new(),
            loads: Vec::new(),
            sample_bytes: 0,
        }
    }

    /// The kernel samples allocations with this mean interval (`--sample-bytes`): a sampled
    /// call's weight is a multiple of it.
    pub fn set_sample_bytes(&mut self, bytes: u64) {
        self.sample_bytes = bytes;
    }

    pub fn stack_stats(&self) -> CaptureStats {
        self.stacks.stats()
    }

    /// Frames to keep of an unwound stack window (`--call-stack c:N`).
    pub fn set_stack_depth(&mut self, depth: u32) {
        self.stacks.depth = depth as usize;
    }

    pub fn set_python(&mut self, pid: u32, layout: &'static crate::stacks::python::Layout) {
        self.stacks.set_python(pid, layout);
    }

    /// How a stripped file's debug file is found, for its stacks' symbols.
    pub fn set_debug_finder(&mut self, finder: DebugFinder) {
        self.stacks.set_debug_finder(finder);
    }

    /// The traced processes that replaced their image since the last call (their interpreter
    /// must be looked for again).
    pub fn take_execs(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.execs)
    }

    /// The processes whose dynamic linker loaded or unloaded objects since the last call, in
    /// the order reported, repeats included (their mappings are to be read again).
    pub fn take_loads(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.loads)
    }

    /// Decodes one record; the event it makes, if any, goes to `sink`.
    pub fn feed(&mut self, bytes: &[u8], stats: &mut ConsumerStats, sink: &mut impl FnMut(Event)) {
        stats.records += 1;
        let Ok(kind) = decode::kind(bytes) else {
            stats.undecodable += 1;
            return;
        };
        if kind == RecordKind::StackWindow {
            match decode::stack_window(bytes) {
                Ok(w) => {
                    if let Some(stack) = self.stacks.on_window(&w) {
                        let wall_ns = self.clock.to_wall(w.entry_mono_ns);
                        sink(Event { wall_ns, pid: w.tgid, tid: w.tid, kind: EventKind::Stack(Box::new(stack)) });
                    }
                }
                Err(_) => stats.undecodable += 1,
            }
            return;
        }
        let event = if matches!(kind, RecordKind::Call | RecordKind::CallText) {
            // Almost every record: straight to the call, whose event reads it by reference.
            let Ok(mut call) = decode::decode_call(kind, bytes) else {
                stats.undecodable += 1;
                return;
            };
            if !self.blobs.is_empty() {
                self.join_blob(&mut call);
            }
            let stacks = if self.stacks.is_empty() {
                (NO_STACK, NO_STACK)
            } else {
                (self.stacks.of_call(&call), self.stacks.py_of_call(&call))
            };
            let caller = self.caller(&call);
            call_event(&call, self.clock, stacks, self.sample_bytes, caller)
        } else {
            match decode::decode(bytes) {
                Ok(Record::Blob(blob)) => {
                    self.blobs.insert(blob.tid, blob);
                    return;
                }
                Ok(Record::PyStack(raw)) => {
                    if let Some((id, text)) = self.stacks.on_py_stack(&raw) {
                        let wall_ns = self.clock.to_wall(raw.entry_mono_ns);
                        sink(Event { wall_ns, pid: raw.tgid, tid: raw.tid, kind: EventKind::PyStack { id, text } });
                    }
                    return;
                }
                Ok(Record::PySample(raw)) => {
                    let frames = self.stacks.on_py_sample(&raw);
                    if !frames.is_empty() {
                        let wall_ns = self.clock.to_wall(raw.entry_mono_ns);
                        sink(Event { wall_ns, pid: raw.tgid, tid: raw.tid, kind: EventKind::PySample(frames) });
                    }
                    return;
                }
                Ok(Record::Stack(raw)) => {
                    if let Some(stack) = self.stacks.on_stack(&raw) {
                        let wall_ns = self.clock.to_wall(raw.entry_mono_ns);
                        sink(Event { wall_ns, pid: raw.tgid, tid: raw.tid, kind: EventKind::Stack(Box::new(stack)) });
                    }
                    return;
                }
                Ok(record @ Record::Exit { tgid, .. }) => {
                    self.stacks.process_exited(tgid);
                    self.callers.process_exited(tgid);
                    to_event(record, self.clock)
                }
                Ok(Record::Exec { tgid, .. }) => {
                    // Its old image's stacks are all normalized (their records came first); the
                    // new one's mappings and interpreter are learnt afresh.
                    self.stacks.process_exited(tgid);
                    self.callers.process_exited(tgid);
                    self.execs.push(tgid);
                    return;
                }
                Ok(Record::Loaded { tgid, .. }) => {
                    self.loads.push(tgid);
                    return;
                }
                Ok(record) => to_event(record, self.clock),
                Err(_) => {
                    stats.undecodable += 1;
                    return;
                }
            }
        };
        match event {
            Some(event) => sink(event),
            None => stats.unknown_api += 1,
        }
    }

    /// The library that made the call, for an API whose spec reads its caller's address.
    fn caller(&mut self, call: &RawCall) -> Option<Library> {
        let addr = crate::apis::caller_address(Api::from_spec_id(call.spec_id)?, call)?;
        self.callers.library(call.tgid, addr)
    }

    /// Gives a call the buffer its thread's last blob record copied, when that was the same
    /// call's (a blob whose call was not recorded is dropped with the next call).
    fn join_blob(&mut self, call: &mut RawCall) {
        if let Some(blob) = self.blobs.remove(&call.tid) {
            if blob.spec_id == call.spec_id {
                call.blob = Some(blob.data);
            }
        }
    }
}

/// A decoded call as a model event; `None` for an API this build does not know.
#[inline]
fn call_event(
    raw: &RawCall,
    clock: Clock,
    (stack, py_stack): (StackId, StackId),
    interval: u64,
    caller: Option<Library>,
) -> Option<Event> {
    let api = Api::from_spec_id(raw.spec_id)?;
    let def = api.def();
    // A function without a status (void, or a pointer result) never fails by its return.
    let status = if def.spec.ret_kind == memscope_common::spec::ret_kind::NONE { 0 } else { raw.status() };
    Some(Event {
        wall_ns: clock.to_wall(raw.return_mono_ns),
        pid: raw.tgid,
        tid: raw.tid,
        kind: EventKind::Call(Call {
            api,
            entry_wall_ns: clock.to_wall(raw.entry_mono_ns),
            status,
            out_of_memory: status != 0 && (def.out_of_memory)(status),
            outer: raw.outer_spec.and_then(Api::from_spec_id),
            thread_device: raw.thread_device,
            op: (def.decode)(raw),
            stack,
            py_stack,
            sample_weight: (raw.points > 0 && raw.points != WINDOW_ONLY && interval > 0)
                .then(|| u64::from(raw.points) * interval),
            window_only: raw.points == WINDOW_ONLY,
            caller,
        }),
    })
}

/// A decoded record as a model event; `None` for a call of an API this build does not know.
/// Calls name no caller library: that needs the processes' mappings, which the [`Decoder`] reads.
pub fn to_event(record: Record, clock: Clock) -> Option<Event> {
    Some(match record {
        Record::Call(raw) => return call_event(&raw, clock, (NO_STACK, NO_STACK), 0, None),
        // A USDT row's hit (PyTorch's `pytorch:malloc`) is a call like any other.
        Record::Usdt(raw) if raw.probe >= crate::apis::API_PROBE_BASE => {
            return call_event(&crate::apis::usdt_call(&raw)?, clock, (NO_STACK, NO_STACK), 0, None)
        }
        Record::Usdt(raw) => Event {
            wall_ns: clock.to_wall(raw.mono_ns),
            pid: raw.tgid,
            tid: raw.tid,
            kind: EventKind::Marker(crate::apis::markers::decode(&raw)?),
        },
        // Joined to their calls by the consumer; one on its own has no call to belong to.
        Record::Blob(_) | Record::Stack(_) | Record::PyStack(_) | Record::PySample(_) => return None,
        Record::Fork { mono_ns, parent, child } => {
            Event { wall_ns: clock.to_wall(mono_ns), pid: parent, tid: parent, kind: EventKind::Fork { child } }
        }
        Record::Exit { mono_ns, tgid } => {
            Event { wall_ns: clock.to_wall(mono_ns), pid: tgid, tid: tgid, kind: EventKind::Exit }
        }
        // The consumer keeps it for the session; nothing of the model changes.
        Record::Exec { .. } | Record::Loaded { .. } => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Op, Space};

    fn raw(spec_id: u32, args: [u64; 6], ret: u64, out: Option<u64>) -> RawCall {
        RawCall {
            spec_id,
            tgid: 7,
            tid: 8,
            entry_mono_ns: 100,
            return_mono_ns: 200,
            args,
            ret,
            fields: [out, None, None, None],
            outer_spec: None,
            cfg_device: None,
            cfg_module: None,
            thread_device: Some(1),
            text: None,
            blob: None,
            points: 0,
        }
    }

    #[test]
    fn a_sampled_call_weighs_its_points_in_intervals_and_an_unsampled_one_nothing() {
        let mut r = raw(Api::C10AllocCpu as u32, [700, 0, 0, 0, 0, 0], 0x5000, None);
        r.points = 3;
        let weight = |r: &RawCall, interval| {
            let e = call_event(r, Clock::with_offset(0), (NO_STACK, NO_STACK), interval, None).unwrap();
            let EventKind::Call(c) = e.kind else { panic!() };
            c.sample_weight
        };
        assert_eq!(weight(&r, 1 << 19), Some(3 << 19));
        assert_eq!(weight(&r, 0), None, "no sampling: no weight");
        r.points = 0;
        assert_eq!(weight(&r, 1 << 19), None, "recorded in full");
        r.points = memscope_common::sampling::WINDOW_ONLY;
        let e = call_event(&r, Clock::with_offset(0), (NO_STACK, NO_STACK), 1 << 19, None).unwrap();
        let EventKind::Call(c) = e.kind else { panic!() };
        assert_eq!((c.sample_weight, c.window_only), (None, true), "left out by sampling, sent for the window");
    }

    #[test]
    fn malloc_call_becomes_a_malloc_event_in_wall_time() {
        let r = raw(Api::AclrtMallocAlign32 as u32, [0x10, 4096, 0, 0, 0, 0], 0, Some(0xabc0));
        let e = to_event(Record::Call(r), Clock::with_offset(1_000)).unwrap();
        assert_eq!((e.wall_ns, e.pid, e.tid), (1_200, 7, 8));
        let EventKind::Call(c) = e.kind else { panic!() };
        assert_eq!(c.api, Api::AclrtMallocAlign32);
        assert_eq!(c.entry_wall_ns, 1_100);
        assert_eq!(
            c.op,
            Op::Malloc {
                space: Space::Device,
                size: 4096,
                ptr: Some(0xabc0),
                policy: Some(0),
                device: None,
                module: None,
                driver: None
            }
        );
    }

    #[test]
    fn free_uses_arg0_and_host_calls_are_host() {
        let e = to_event(
            Record::Call(raw(Api::AclrtFreeHost as u32, [0x55, 0, 0, 0, 0, 0], 0, None)),
            Clock::with_offset(0),
        );
        let EventKind::Call(c) = e.unwrap().kind else { panic!() };
        assert_eq!(c.op, Op::Free { space: Space::Host, ptr: 0x55, driver: None });
    }

    #[test]
    fn map_mem_decodes_all_arguments() {
        let e = to_event(
            Record::Call(raw(Api::AclrtMapMem as u32, [0x7000, 2 << 20, 4096, 0xfeed, 0, 0], 0, None)),
            Clock::with_offset(0),
        );
        let EventKind::Call(c) = e.unwrap().kind else { panic!() };
        assert_eq!(c.op, Op::Map { va: 0x7000, size: 2 << 20, offset: 4096, handle: 0xfeed, flags: 0 });
    }

    #[test]
    fn driver_flag_gives_device_and_out_of_memory_is_per_family() {
        let mut r = raw(Api::HalMemAlloc as u32, [0x10, 4096, 3 | (1 << 10) | (3 << 56), 0, 0, 0], 6, None);
        r.outer_spec = Some(Api::AclrtMalloc as u32);
        let EventKind::Call(c) = to_event(Record::Call(r), Clock::with_offset(0)).unwrap().kind else { panic!() };
        assert!(c.out_of_memory, "DRV_ERROR_OUT_OF_MEMORY");
        assert_eq!(c.outer, Some(Api::AclrtMalloc));
        let Op::Malloc { device, module, ptr, .. } = c.op else { panic!() };
        assert_eq!((device, module, ptr), (Some(3), Some(3), None));
        // 6 from the runtime is not out of memory; 207001 is.
        let EventKind::Call(c) =
            to_event(Record::Call(raw(Api::AclrtMalloc as u32, [0; 6], 6, None)), Clock::with_offset(0)).unwrap().kind
        else {
            panic!()
        };
        assert!(!c.out_of_memory);
    }

    #[test]
    fn calls_without_a_status_never_fail_by_their_return_register() {
        // c10::alloc_cpu returns the pointer: its low half is not an error code.
        let r = raw(Api::C10AllocCpu as u32, [4096, 0, 0, 0, 0, 0], 0x7f00_1234_5678, None);
        let EventKind::Call(c) = to_event(Record::Call(r), Clock::with_offset(0)).unwrap().kind else { panic!() };
        assert_eq!(c.status, 0);
        assert!(!c.out_of_memory);
        assert!(matches!(c.op, Op::Malloc { space: Space::Cpu, size: 4096, ptr: Some(0x7f00_1234_5678), .. }));
    }

    #[test]
    fn unknown_cookie_is_dropped() {
        assert!(to_event(Record::Call(raw(250, [0; 6], 0, None)), Clock::with_offset(0)).is_none());
    }
}
