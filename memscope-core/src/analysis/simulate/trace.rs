//! What a replay takes from a trace: per process, in time order, the caching allocator's
//! requests (the size asked for and the stream), their frees, the `empty_cache()` calls, and the
//! other device memory the process held; and the segments the allocator really took and gave
//! back, to check the model against.
//!
//! `empty_cache()` is not probed, so it is read from the rows: segments freed on a thread and
//! not followed, on that thread, by the allocator's next block. Segments freed just before a
//! block on the same thread were freed inside that allocation (a retry after the device refused
//! a segment, or the garbage collector, which needs a per-process fraction) when the device
//! refused one there or a fraction is set; otherwise they were an `empty_cache()` right before
//! the allocation.

use foldhash::HashMap;

use crate::analysis::attr::attr_fields;
use crate::analysis::db::{DumpRow, Selection};
use crate::analysis::incidents::Tracker;
use crate::analysis::pass::Consumer;
use crate::analysis::pool::{parse_number, Memory, PoolKind};
use crate::vocab::{Event, EventType};

use super::allocator::SegmentStep;

attr_fields! {
    struct Fields { size, req_size, stream, pool, shadow, unmatched, segment, vmm, func, stream_uses, site }
}

/// One thing the job did to its allocator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// A block of `req` bytes on `stream`; `ptr` is the recorded block's address, by which its
    /// free finds it. `rounded`: the trace had only the block's size (already padded and rounded
    /// by the allocator), not the request. `block`: the block's size as recorded (0: unknown).
    Alloc {
        req: u64,
        stream: u64,
        ptr: u64,
        rounded: bool,
        block: u64,
    },
    /// A request the allocator refused: replayed as a block given back at once.
    Refused {
        req: u64,
        stream: u64,
    },
    Free {
        ptr: u64,
    },
    EmptyCache,
    /// Device memory held outside the caching allocator changed by this many bytes.
    Other(i64),
    /// A segment step the allocator really made (the recorded curve; the model makes its own).
    Recorded(SegmentStep),
    /// Nothing (a tentative `empty_cache()` that turned out to be inside an allocation).
    None,
}

#[derive(Clone, Copy, Debug)]
pub struct Timed {
    pub ts: i64,
    pub pid: i64,
    pub step: Step,
    /// The job's line that made the request (`Trace::sites`; 0: not known).
    pub site: u32,
}

/// A recorded segment step with its address (for the model's tie-breaks).
#[derive(Clone, Copy, Debug)]
pub struct Recorded {
    pub step: SegmentStep,
    pub ptr: u64,
    /// Which allocator call it was made in (the count of block rows before it): pages mapped
    /// in one call are one mapping ([`super::canonical`]).
    pub call: u64,
}

#[derive(Default)]
pub struct Trace {
    pub steps: Vec<Timed>,
    /// The sites the requests name (Attr `site`), each once; index 0 is "not known".
    pub sites: Vec<String>,
    /// Per process, the segment steps as the allocator made them.
    pub segments: HashMap<i64, Vec<Recorded>>,
    /// Frees of blocks still marked on another stream: the allocator gave them back later, when
    /// that stream's work completed, which the trace does not show.
    pub deferred_frees: u64,
    /// Requests whose `req_size` the trace lacked (their rounded size was replayed).
    pub sizes_only: u64,
    pub streams_unknown: u64,
}

impl Trace {
    /// Whether the caching allocator was asked for anything.
    pub fn has_requests(&self) -> bool {
        self.steps.iter().any(|t| matches!(t.step, Step::Alloc { .. } | Step::Refused { .. }))
    }
}

/// Segments freed on one thread since its last block row.
struct Freeing {
    marker: usize,
    refused: bool,
}

/// Reads the rows into a [`Trace`].
pub(crate) struct Reader {
    trace: Trace,
    fraction_set: bool,
    /// Live recorded segments: (pid, ptr) → (size, mapped page).
    live_segments: HashMap<(i64, u64), (u64, bool)>,
    /// Live device blocks outside the pool: (pid, ptr) → size.
    live_other: HashMap<(i64, u64), u64>,
    freeing: HashMap<(i64, i64), Freeing>,
    /// Block rows seen per process.
    calls: HashMap<i64, u64>,
    site_ids: HashMap<String, u32>,
}

impl Reader {
    /// `fraction_set`: the run had a per-process fraction, so segments freed inside an
    /// allocation may be the garbage collector's.
    pub(crate) fn new(fraction_set: bool) -> Self {
        Self {
            trace: Trace::default(),
            fraction_set,
            live_segments: HashMap::default(),
            live_other: HashMap::default(),
            freeing: HashMap::default(),
            calls: HashMap::default(),
            site_ids: HashMap::default(),
        }
    }

    pub(crate) fn finish(self) -> Trace {
        self.trace
    }

    fn push(&mut self, row: &DumpRow<'_>, step: Step) -> usize {
        self.trace.steps.push(Timed { ts: row.ts, pid: row.pid, step, site: 0 });
        self.trace.steps.len() - 1
    }

    /// The index of a request's site in `Trace::sites`.
    fn site(&mut self, site: Option<&str>) -> u32 {
        let Some(site) = site.filter(|s| !s.is_empty()) else { return 0 };
        // Looked up before anything is allocated: most requests come from lines seen before.
        if let Some(&id) = self.site_ids.get(site) {
            return id;
        }
        if self.trace.sites.is_empty() {
            self.trace.sites.push(String::new());
        }
        let id = self.trace.sites.len() as u32;
        self.trace.sites.push(site.to_owned());
        self.site_ids.insert(site.to_owned(), id);
        id
    }

    /// A block row of the caching pool on this thread ends its run of segment frees: inside the
    /// allocation when the device refused a segment there or a fraction was set.
    fn settle(&mut self, row: &DumpRow<'_>, allocation: bool) {
        if let Some(f) = self.freeing.remove(&(row.pid, row.tid)) {
            if allocation && (f.refused || self.fraction_set) {
                self.trace.steps[f.marker].step = Step::None;
            }
        }
    }

    fn device_row(&mut self, row: &DumpRow<'_>, a: &Fields<'_>, ptr: u64, free: bool) {
        let key = (row.pid, ptr);
        let size = a.size.as_deref().and_then(parse_number).unwrap_or(0);
        if !free {
            if a.segment.as_deref() == Some("caching") {
                let mapped = a.vmm.as_deref() == Some("true");
                self.live_segments.insert(key, (size, mapped));
                let step = if mapped { SegmentStep::Map(size) } else { SegmentStep::Alloc(size) };
                self.record(row.pid, step, ptr);
                self.push(row, Step::Recorded(step));
            } else {
                self.live_other.insert(key, size);
                self.push(row, Step::Other(size as i64));
            }
            return;
        }
        if let Some((size, mapped)) = self.live_segments.remove(&key) {
            let step = if mapped { SegmentStep::Unmap(size) } else { SegmentStep::Free(size) };
            self.record(row.pid, step, ptr);
            self.push(row, Step::Recorded(step));
            if !self.freeing.contains_key(&(row.pid, row.tid)) {
                let marker = self.push(row, Step::EmptyCache);
                self.freeing.insert((row.pid, row.tid), Freeing { marker, refused: false });
            }
        } else if let Some(size) = self.live_other.remove(&key) {
            self.push(row, Step::Other(-(size as i64)));
        }
    }

    fn record(&mut self, pid: i64, step: SegmentStep, ptr: u64) {
        let call = self.calls.get(&pid).copied().unwrap_or(0);
        self.trace.segments.entry(pid).or_default().push(Recorded { step, ptr, call });
    }

    fn block_row(&mut self, row: &DumpRow<'_>, a: &Fields<'_>, ptr: u64, free: bool) {
        self.settle(row, !free);
        *self.calls.entry(row.pid).or_default() += 1;
        if free {
            if a.stream_uses.as_deref().is_some_and(|n| n != "0") {
                self.trace.deferred_frees += 1;
            }
            self.push(row, Step::Free { ptr });
            return;
        }
        let req = a.req_size.as_deref().and_then(parse_number);
        let rounded = req.is_none();
        self.trace.sizes_only += u64::from(rounded);
        let Some(req) = req.or_else(|| a.size.as_deref().and_then(parse_number)) else { return };
        let stream = a.stream.as_deref().and_then(parse_number);
        if stream.is_none() {
            self.trace.streams_unknown += 1;
        }
        let block = a.size.as_deref().and_then(parse_number).unwrap_or(0);
        let at = self.push(row, Step::Alloc { req, stream: stream.unwrap_or(0), ptr, rounded, block });
        self.trace.steps[at].site = self.site(a.site.as_deref());
    }

    fn oom_row(&mut self, row: &DumpRow<'_>, a: &Fields<'_>) {
        if EventType::parse(row.event_type) != Some(EventType::OomTrigger) {
            return;
        }
        if Tracker::is_allocator(row.name, a.func.as_deref()) {
            self.settle(row, true);
            let req = a.req_size.as_deref().and_then(parse_number).unwrap_or(0);
            let at = self.push(row, Step::Refused { req, stream: 0 });
            self.trace.steps[at].site = self.site(a.site.as_deref());
        } else if a.segment.as_deref() == Some("caching") {
            if let Some(f) = self.freeing.get_mut(&(row.pid, row.tid)) {
                f.refused = true;
            } else {
                let marker = self.push(row, Step::None);
                self.freeing.insert((row.pid, row.tid), Freeing { marker, refused: true });
            }
        }
    }
}

impl Consumer for Reader {
    fn selection(&self) -> Selection<'static> {
        const EVENTS: &[&str] = &[Event::Malloc.as_str(), Event::Free.as_str(), Event::OomDetail.as_str()];
        Selection { events: EVENTS, name: true, thread: true }
    }

    fn row(&mut self, row: DumpRow<'_>) {
        let Some(a) = Fields::parse(row.attr) else { return };
        let event = Event::parse(row.event);
        if event == Some(Event::OomDetail) {
            return self.oom_row(&row, &a);
        }
        let free = event == Some(Event::Free);
        if free && (a.shadow.as_deref() == Some("true") || a.unmatched.as_deref() == Some("true")) {
            return;
        }
        let Some(ptr) = parse_number(row.ptr) else { return };
        match Memory::of(row.event_type, a.pool.as_deref()) {
            Memory::Device => self.device_row(&row, &a, ptr, free),
            Memory::Pool(PoolKind::Caching) => self.block_row(&row, &a, ptr, free),
            Memory::Pool(_) | Memory::Host => {}
        }
    }

    fn restart(&mut self) {
        *self = Self::new(self.fraction_set);
    }
}
