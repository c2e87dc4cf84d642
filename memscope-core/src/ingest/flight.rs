//! The OOM flight recorder's window: a job's recent rows kept in memory, bounded, so that when
//! something goes wrong (an allocation fails for want of memory, a degradation verdict, a
//! request) a DB holding the full detail of the moments before can be written at once, though
//! the job's own DB is sampled.
//!
//! A window of the last N rows alone would not do: the OOM forensics rebuild the pool's and the
//! device's state from every block still live at the failure, and the weights loaded at the
//! start are as live as the activations of the last step. So a block's MALLOC that leaves the
//! recent rows while the block is still live is *held* (with the owner changes made to it since)
//! until its FREE comes: the window's DB has every live block and the last N rows, which is what
//! the forensics read. A FREE of a held block drops both rows: the window then has neither.
//!
//! Blocks are paired as the rows are in the DB (a MALLOC opens the block of its process, kind
//! and address, the next FREE of that key closes it: `analysis::blocks`), on the rows' own
//! facts ([`block_of`]). Bounds: `recent` rows and `held` blocks (past it the oldest held are
//! dropped and counted, and the DB says so); stacks are kept once each, as the job's DB keeps
//! them.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

/// Every row looks one up: the fast hash, as the model's tables have.
type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

use crate::model::{DeviceKey, Event, EventKind, Output, Tracker};
use crate::stacks::{Stack, StackId, NO_STACK};
use crate::store::{DriverRow, Retag, StoreError, Writer};
use crate::vocab::EventType;

/// The most heap bytes a window takes per recent row, measured (`tests/flight_memory.rs`):
/// docs/metrics.md states it, the daemon's memory test adds it up.
pub const ROW_BYTES: u64 = 320;
/// ... per block it holds past the recent rows.
pub const BLOCK_BYTES: u64 = 320;
/// ... per live block a [`Feed`]'s own tracker follows (a sampled job's every block).
pub const TRACKED_BYTES: u64 = 320;

/// How much a window keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Rows of any kind, the most recent.
    pub recent: usize,
    /// Live blocks whose MALLOC left the recent rows.
    pub held: usize,
}

/// A block as the DB's rows name it: (process, `Event Type`, address).
pub type BlockId = (u32, EventType, u64);

/// Whether a row opens or closes a block, and which (shadow FREEs, written at a stop for live
/// blocks, close nothing).
pub fn block_of(output: &Output) -> Option<(bool, BlockId)> {
    Some(match output {
        Output::Malloc { site, space, ptr, .. } => (true, (site.pid, space.event_type(), *ptr)),
        Output::Free { site, space, ptr, shadow: false, .. } => (false, (site.pid, space.event_type(), *ptr)),
        Output::PoolMalloc { site, ptr, .. } => (true, (site.pid, EventType::Pta, *ptr)),
        Output::PoolFree { site, ptr, shadow: false, .. } => (false, (site.pid, EventType::Pta, *ptr)),
        _ => return None,
    })
}

/// The block an owner change is for.
fn retagged(output: &Output) -> Option<BlockId> {
    match output {
        Output::Retag { pid, event_type, ptr, .. } => Some((*pid, *event_type, *ptr)),
        _ => None,
    }
}

/// A row and its call's stacks.
#[derive(Clone, Debug)]
struct Entry {
    seq: u64,
    output: Output,
    stacks: (StackId, StackId),
}

/// A held block: its MALLOC's slot and those of the owner changes made to it since (most have
/// none: no allocation for them).
#[derive(Clone, Debug)]
struct Held {
    seq: u64,
    malloc: u32,
    retags: Vec<u32>,
}

impl Held {
    fn slots(&self) -> impl Iterator<Item = u32> + '_ {
        std::iter::once(self.malloc).chain(self.retags.iter().copied())
    }
}

/// The rows, each in a slot of its own from its push until it is dropped: rows are 200 bytes,
/// and the recent queue and the held table then move slot numbers rather than rows.
#[derive(Clone, Default)]
struct Slab {
    slots: Vec<Option<Entry>>,
    free: Vec<u32>,
}

impl Slab {
    fn put(&mut self, entry: Entry) -> u32 {
        match self.free.pop() {
            Some(i) => {
                self.slots[i as usize] = Some(entry);
                i
            }
            None => {
                self.slots.push(Some(entry));
                (self.slots.len() - 1) as u32
            }
        }
    }

    fn get(&self, i: u32) -> &Entry {
        self.slots[i as usize].as_ref().expect("a slot in use")
    }

    fn drop_row(&mut self, i: u32) {
        self.slots[i as usize] = None;
        self.free.push(i);
    }
}

/// What the window dropped, for the DB to say.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Dropped {
    /// Rows older than the recent ones that were not live blocks.
    pub rows: u64,
    /// Live blocks dropped past the `held` bound: the DB lacks them.
    pub held: u64,
}

#[derive(Clone)]
pub struct Window {
    limits: Limits,
    next: u64,
    rows: Slab,
    /// The recent rows' slots, oldest first.
    recent: VecDeque<u32>,
    held: Map<BlockId, Held>,
    /// The held blocks in the order they were held, which is their MALLOCs' order (rows leave
    /// the recent ones first in, first out): the oldest is dropped first. Entries of blocks no
    /// longer held are skipped when they come to the front, and cleared out when they are
    /// as many as the held blocks.
    held_order: VecDeque<(u64, BlockId)>,
    /// The live blocks of the recent rows: their MALLOC's sequence number.
    live: Map<BlockId, u64>,
    stacks: Vec<Stack>,
    py_stacks: Vec<(StackId, Box<str>)>,
    /// The driver's first reading of each device (its capacity goes on `START_TRACE`, as in the
    /// job's DB) and its latest.
    driver: BTreeMap<(DeviceKey, bool), DriverRow>,
    dropped: Dropped,
}

impl Window {
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            next: 0,
            recent: VecDeque::with_capacity(limits.recent.saturating_add(1)),
            // Their bounds at once: doubling as they fill would leave up to half of them slack,
            // and the pages untouched are not resident.
            rows: Slab {
                slots: Vec::with_capacity(limits.recent.saturating_add(limits.held).saturating_add(1)),
                free: Vec::new(),
            },
            held: Map::default(),
            held_order: VecDeque::new(),
            live: Map::default(),
            stacks: Vec::new(),
            py_stacks: Vec::new(),
            driver: BTreeMap::new(),
            dropped: Dropped::default(),
        }
    }

    pub fn add_stack(&mut self, stack: &Stack) {
        self.stacks.push(stack.clone());
    }

    pub fn add_py_stack(&mut self, id: StackId, text: &str) {
        self.py_stacks.push((id, text.into()));
    }

    /// One of the driver's readings for the job.
    pub fn add_driver(&mut self, row: &DriverRow) {
        self.driver.entry((row.device, false)).or_insert_with(|| row.clone());
        self.driver.insert((row.device, true), row.clone());
    }

    /// One row, in the order the job's DB gets them.
    pub fn push(&mut self, output: &Output, stacks: (StackId, StackId)) {
        self.push_owned(output.clone(), stacks);
    }

    /// [`Self::push`] of a row the caller has no more use for.
    pub fn push_owned(&mut self, output: Output, stacks: (StackId, StackId)) {
        let seq = self.next;
        self.next += 1;
        match block_of(&output) {
            Some((true, id)) => {
                self.live.insert(id, seq);
                // A MALLOC over a held block's address: the held one ended unseen.
                self.unhold(&id);
            }
            Some((false, id)) => {
                if self.live.remove(&id).is_none() && self.unhold(&id) {
                    // Its MALLOC was held: the window keeps neither row.
                    return;
                }
            }
            None => {
                if let Some(id) = retagged(&output) {
                    if !self.live.contains_key(&id) && self.held.contains_key(&id) {
                        let slot = self.rows.put(Entry { seq, output, stacks });
                        self.held.get_mut(&id).expect("checked").retags.push(slot);
                        return;
                    }
                }
            }
        }
        let slot = self.rows.put(Entry { seq, output, stacks });
        self.recent.push_back(slot);
        while self.recent.len() > self.limits.recent {
            let old = self.recent.pop_front().expect("longer than the bound");
            self.evict(old);
        }
    }

    /// A row leaves the recent ones: a live block's MALLOC (and an owner change of a held
    /// block) is held, anything else dropped.
    fn evict(&mut self, slot: u32) {
        let entry = self.rows.get(slot);
        let seq = entry.seq;
        match block_of(&entry.output) {
            Some((true, id)) if self.live.get(&id) == Some(&seq) => {
                self.live.remove(&id);
                self.held_order.push_back((seq, id));
                self.held.insert(id, Held { seq, malloc: slot, retags: Vec::new() });
                if self.held.len() > self.limits.held {
                    self.drop_oldest_held();
                }
            }
            _ => match retagged(&entry.output).and_then(|id| self.held.get_mut(&id)) {
                Some(h) => h.retags.push(slot),
                None => {
                    self.rows.drop_row(slot);
                    self.dropped.rows += 1;
                }
            },
        }
    }

    fn drop_oldest_held(&mut self) {
        while let Some((seq, id)) = self.held_order.pop_front() {
            if self.held.get(&id).is_some_and(|h| h.seq == seq) {
                self.unhold(&id);
                self.dropped.held += 1;
                return;
            }
        }
    }

    /// Drops a held block and its rows; whether there was one.
    fn unhold(&mut self, id: &BlockId) -> bool {
        let Some(h) = self.held.remove(id) else { return false };
        for slot in h.slots() {
            self.rows.drop_row(slot);
        }
        if self.held_order.len() > 2 * self.held.len() + 64 {
            let held = &self.held;
            self.held_order.retain(|(seq, id)| held.get(id).is_some_and(|h| h.seq == *seq));
        }
        true
    }

    pub fn dropped(&self) -> Dropped {
        self.dropped
    }

    /// Rows now kept: recent, and held (with their owner changes).
    pub fn len(&self) -> (usize, usize) {
        (self.recent.len(), self.held.values().map(|h| 1 + h.retags.len()).sum())
    }

    pub fn is_empty(&self) -> bool {
        self.recent.is_empty() && self.held.is_empty()
    }

    /// The rows in the order the window's DB gets them: the held blocks' oldest first, then the
    /// recent ones.
    fn ordered(&self) -> impl Iterator<Item = &Entry> {
        let mut held: Vec<&Held> = self.held.values().collect();
        held.sort_by_key(|h| h.seq);
        let held: Vec<u32> = held.into_iter().flat_map(Held::slots).collect();
        held.into_iter().chain(self.recent.iter().copied()).map(|slot| self.rows.get(slot))
    }

    /// The earliest instant of a row kept (the window's DB starts there).
    pub fn start_ns(&self) -> Option<u64> {
        self.ordered().filter_map(|e| wall_ns(&e.output)).min()
    }

    /// Writes the window to `store`: the stacks, then the held blocks oldest first, then the
    /// recent rows in order.
    pub fn write(&self, store: &mut Writer) -> Result<(), StoreError> {
        for stack in &self.stacks {
            store.add_stack(Box::new(stack.clone()))?;
        }
        for (id, text) in &self.py_stacks {
            store.add_py_stack(*id, text.clone())?;
        }
        store.add_driver(self.driver.values().cloned().collect())?;
        for entry in self.ordered() {
            match &entry.output {
                Output::Retag { device, pid, event_type, ptr, owner, by } => store.retag(Retag {
                    device: *device,
                    pid: *pid,
                    event_type: *event_type,
                    ptr: *ptr,
                    owner: owner.clone(),
                    by: *by,
                })?,
                output => store.write_output(output, entry.stacks)?,
            }
        }
        Ok(())
    }
}

/// A window fed from the events of a job the daemon samples: its own tracker sees every call,
/// each at its real size (a sampled call's weight is the sampled rows' business, and the calls
/// sampling left out come marked [`crate::model::Call::window_only`]), so the window's rows are
/// those of a full trace. A job recorded in full needs none: its recorder's rows feed its
/// window ([`crate::ingest::recorder::Recorder::window`]).
///
/// Its tracker's totals are therefore the job's exact counts, which the daemon publishes. The
/// kernel keeps no block of its own while it sends every call, so a sampled free comes unjudged:
/// the feed remembers which live blocks sampling left out and says, at their free, that the
/// job's rows skip it too.
pub struct Feed {
    tracker: Tracker,
    pub window: Window,
    outputs: Vec<Output>,
    /// Live blocks sampling left out of the job's rows.
    left_out: HashSet<BlockId, foldhash::fast::RandomState>,
}

impl Feed {
    pub fn new(limits: Limits) -> Self {
        Self { tracker: Tracker::new(), window: Window::new(limits), outputs: Vec::new(), left_out: HashSet::default() }
    }

    /// The totals of every call: a full trace's.
    pub fn tracker(&self) -> &Tracker {
        &self.tracker
    }

    /// Takes one event; whether the job's own (sampled) rows leave it out: a call sampling left
    /// out, or the free of a block it left out.
    pub fn on_event(&mut self, event: &Event) -> bool {
        match &event.kind {
            EventKind::Stack(stack) => self.window.add_stack(stack),
            EventKind::PyStack { id, text } => {
                self.tracker.learn_py_stack(*id, text);
                self.window.add_py_stack(*id, text);
            }
            EventKind::PySample(_) => {}
            kind => {
                let mut event = Event { wall_ns: event.wall_ns, pid: event.pid, tid: event.tid, kind: kind.clone() };
                let (stacks, left_out) = match &mut event.kind {
                    EventKind::Call(call) => {
                        let left_out = call.window_only;
                        call.sample_weight = None;
                        call.window_only = false;
                        // The job's rows carry no Python stack column either (`python_column`).
                        ((call.stack, NO_STACK), left_out)
                    }
                    _ => ((NO_STACK, NO_STACK), false),
                };
                self.tracker.apply(event, &mut self.outputs);
                let mut skip = left_out;
                for output in self.outputs.drain(..) {
                    match block_of(&output) {
                        Some((true, id)) if left_out => {
                            self.left_out.insert(id);
                        }
                        Some((true, id)) => {
                            self.left_out.remove(&id);
                        }
                        Some((false, id)) => skip |= self.left_out.remove(&id) || unseen_sampled(&output),
                        None => {}
                    }
                    self.window.push_owned(output, stacks);
                }
                return skip;
            }
        }
        false
    }

    /// Forgets the live blocks of the sampled APIs (a window of the daemon's closed:
    /// [`Tracker::forget_sampled`]) at `wall_ns`; returns how many.
    pub fn forget_sampled(&mut self, wall_ns: u64) -> usize {
        let forgotten = self.tracker.forget_sampled(wall_ns, &mut self.outputs);
        for output in self.outputs.drain(..) {
            self.window.push_owned(output, (NO_STACK, NO_STACK));
        }
        // Every block sampling left out is of a sampled API, so none is live now.
        self.left_out.clear();
        forgotten
    }
}

/// A free of a sampled API's block this feed never saw (born before the trace or outside the
/// daemon's windows): whether sampling would have recorded the block cannot be told, so the
/// job's sampled rows leave it out; the tracker counts it among the untracked frees.
fn unseen_sampled(output: &Output) -> bool {
    match output {
        Output::PoolFree { site, allocation_id: None, .. } | Output::Free { site, allocation_id: None, .. } => {
            site.api.sampled()
        }
        _ => false,
    }
}

/// A row's instant, where it has one.
fn wall_ns(output: &Output) -> Option<u64> {
    match output {
        Output::Malloc { site, .. }
        | Output::Free { site, .. }
        | Output::Failed { site, .. }
        | Output::Vmm { site, .. }
        | Output::PoolMalloc { site, .. }
        | Output::PoolFree { site, .. }
        | Output::Access { site, .. }
        | Output::AtbLaunch { site, .. }
        | Output::KernelLaunch { site, .. }
        | Output::OomBlock { site, .. } => Some(site.wall_ns),
        Output::OpAccess { wall_ns, .. }
        | Output::OpLaunch { wall_ns, .. }
        | Output::Step { wall_ns, .. }
        | Output::Mstx { wall_ns, .. } => Some(*wall_ns),
        Output::Retag { .. } => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::contract::{Analysis as _, Oom};
    use crate::analysis::db::DumpDb;
    use crate::apis::Api;
    use crate::model::testing::{call, malloc, pool_malloc, run, with_outer};
    use crate::model::{Event, Op, Pool};
    use crate::stacks::NO_STACK;
    use crate::store::{layout, Format, RunLayout, Store};

    const MIB: u64 = 1 << 20;

    fn pool_free(ptr: u64, size: u64) -> Event {
        let op = Op::PoolFree { pool: Pool::Caching, ptr: Some(ptr), handle: None, size: Some(size), device: Some(0) };
        call(Api::DeviceCachingAllocatorFree, 1, None, 0, op)
    }

    /// A pool that takes two segments, keeps a weight in each, serves `steps` short-lived
    /// activations, then fails to grow for a 40 MiB block.
    fn job(steps: u64) -> Vec<Output> {
        run(&job_events(steps)).1
    }

    fn job_events(steps: u64) -> Vec<Event> {
        let segment = |ptr| with_outer(malloc(Some(ptr), 20 * MIB, Some(0), 0), Api::DeviceCachingAllocatorMalloc);
        let mut events = vec![segment(0x1000_0000), pool_malloc(0x1000_0000, 8 * MIB, 0)];
        events.extend([segment(0x2000_0000), pool_malloc(0x2000_0000, 8 * MIB, 0)]);
        for i in 0..steps {
            let ptr = 0x1080_0000 + (i % 4) * 0x10_0000;
            events.extend([pool_malloc(ptr, MIB, 0), pool_free(ptr, MIB)]);
        }
        events.push(pool_malloc(0x2080_0000, 2 * MIB, 0));
        let refused = malloc(None, 40 * MIB, Some(0), 207_001);
        events.push(with_outer(refused, Api::DeviceCachingAllocatorMalloc));
        let failed = Op::PoolMalloc {
            pool: Pool::Caching,
            ptr: None,
            size: None,
            req: Some(40 * MIB),
            device: Some(0),
            handle: None,
            stream: None,
        };
        events.push(call(Api::DeviceCachingAllocatorMalloc, 1, Some(0), 207_001, failed));
        events
    }

    fn write(name: &str, rows: impl FnOnce(&mut Writer)) -> std::path::PathBuf {
        let out = std::env::temp_dir().join(format!("memscope-flight-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        let layout = RunLayout::create_for(&out, 100, 1_700_000_000, "ascend", layout::Owner::default()).unwrap();
        let mut store = Writer::start(Store::new(layout, Format::Db, 900, vec![]));
        rows(&mut store);
        let written = store.finish(1_000_000, vec![], vec![]).unwrap();
        written[0].path.clone()
    }

    fn forensics(path: &std::path::Path) -> serde_json::Value {
        let db = DumpDb::open_read(path).unwrap();
        serde_json::to_value(Oom::analyse(&db, &10).unwrap().incidents).unwrap()
    }

    #[test]
    fn a_window_far_shorter_than_the_job_gives_the_ooms_forensics_of_the_whole_trace() {
        let rows = job(400);
        let full = write("full", |s| rows.iter().for_each(|o| s.write_output(o, (NO_STACK, NO_STACK)).unwrap()));
        let mut window = Window::new(Limits { recent: 40, held: 100 });
        rows.iter().for_each(|o| window.push(o, (NO_STACK, NO_STACK)));
        let (recent, held) = window.len();
        assert_eq!(recent, 40);
        assert!(held >= 4, "the two segments and their weights are held: {held}");
        assert!(window.dropped().rows > 700, "{:?}", window.dropped());
        let flight = write("window", |s| window.write(s).unwrap());
        let (a, b) = (forensics(&full), forensics(&flight));
        assert_eq!(a.as_array().map(Vec::len), Some(1), "one OOM: {a:#}");
        assert_eq!(a, b, "the window's forensics are the whole trace's");
        assert!(a[0]["state"]["reserved"].as_u64() == Some(40 * MIB), "{a:#}");
    }

    #[test]
    fn a_held_block_freed_leaves_the_window_and_the_held_bound_drops_the_oldest() {
        let rows = run(&[
            malloc(Some(0x100), 64, Some(0), 0),
            malloc(Some(0x200), 64, Some(0), 0),
            malloc(Some(0x300), 64, Some(0), 0),
            crate::model::testing::free(0x100, Some(0)),
        ])
        .1;
        let mut window = Window::new(Limits { recent: 1, held: 1 });
        rows.iter().for_each(|o| window.push(o, (NO_STACK, NO_STACK)));
        // Each MALLOC is held as the next row comes, and the bound keeps one: 0x100, then
        // 0x200 dropped for the younger; 0x100's FREE is a row of a block the window no longer has.
        assert_eq!(window.dropped().held, 2);
        let held: Vec<u64> = window.held.keys().map(|k| k.2).collect();
        assert_eq!(held, [0x300]);
        let mut w2 = Window::new(Limits { recent: 1, held: 8 });
        rows.iter().for_each(|o| w2.push(o, (NO_STACK, NO_STACK)));
        let held: std::collections::BTreeSet<u64> = w2.held.keys().map(|k| k.2).collect();
        assert_eq!(held, [0x200].into(), "0x100's FREE took its held MALLOC with it");
        let recent: Vec<Option<(bool, BlockId)>> =
            w2.recent.iter().map(|slot| block_of(&w2.rows.get(*slot).output)).collect();
        assert_eq!(recent, [Some((true, (100, EventType::Hal, 0x300)))], "and left no row of its own");
    }

    /// What the daemon's sampling sends: most pool calls left out (sent for the window only),
    /// the others weighed; the runtime's calls and the failures in full.
    fn sampled(events: &[Event]) -> Vec<Event> {
        let mut n = 0;
        events
            .iter()
            .cloned()
            .map(|mut e| {
                if let EventKind::Call(c) = &mut e.kind {
                    if matches!(c.op, Op::PoolMalloc { ptr: Some(_), .. } | Op::PoolFree { .. }) {
                        n += 1;
                        if n % 7 == 0 {
                            c.sample_weight = Some(512 << 10);
                        } else {
                            c.window_only = true;
                        }
                    }
                }
                e
            })
            .collect()
    }

    #[test]
    fn a_feed_of_a_sampled_jobs_events_gives_the_window_of_a_full_trace() {
        let events = job_events(300);
        let limits = Limits { recent: 40, held: 100 };
        let mut full = Window::new(limits);
        run(&events).1.iter().for_each(|o| full.push(o, (NO_STACK, NO_STACK)));
        let mut feed = Feed::new(limits);
        sampled(&events).iter().for_each(|e| {
            feed.on_event(e);
        });
        let rows = |w: &Window| {
            let held: std::collections::BTreeMap<u64, Vec<Output>> =
                w.held.values().map(|h| (h.seq, h.slots().map(|i| w.rows.get(i).output.clone()).collect())).collect();
            (held, w.recent.iter().map(|i| w.rows.get(*i).output.clone()).collect::<Vec<_>>())
        };
        assert_eq!(rows(&feed.window), rows(&full), "every call at its real size, none weighed");
        let a = write("feed-full", |s| full.write(s).unwrap());
        let b = write("feed-sampled", |s| feed.window.write(s).unwrap());
        assert_eq!(forensics(&a), forensics(&b));
    }

    /// What the daemon sends while its flight recorder gets every call: the kernel keeps no
    /// blocks, so a free comes unjudged (unmarked) whether its block was sampled or not.
    fn unjudged(events: &[Event]) -> Vec<Event> {
        let mut events = sampled(events);
        for e in &mut events {
            if let EventKind::Call(c) = &mut e.kind {
                if matches!(c.op, Op::PoolFree { .. }) {
                    (c.window_only, c.sample_weight) = (false, None);
                }
            }
        }
        events
    }

    #[test]
    fn a_feed_between_windows_leaves_out_unseen_frees_and_forgets_what_outlived_the_drain() {
        let mut feed = Feed::new(Limits { recent: 40, held: 100 });
        // The runtime's calls are probed at all times; the pool's weight was born before the
        // window, unseen.
        let segment = with_outer(malloc(Some(0x1000_0000), 20 * MIB, Some(0), 0), Api::DeviceCachingAllocatorMalloc);
        assert!(!feed.on_event(&segment));
        // In the window: three blocks, one freed, and the weight's free; in the drain after it,
        // another block's free.
        let (a, b, c) = (0x1080_0000, 0x1100_0000, 0x1180_0000);
        let window = [pool_malloc(a, MIB, 0), pool_malloc(b, MIB, 0), pool_malloc(c, MIB, 0)];
        let frees = [pool_free(0x1000_0000, 8 * MIB), pool_free(a, MIB), pool_free(b, MIB)];
        let left_out: Vec<bool> = window.iter().chain(&frees).map(|e| feed.on_event(e)).collect();
        assert_eq!(left_out, [false, false, false, true, false, false], "only the unseen weight's free");
        assert_eq!(feed.tracker().sampled_blocks(), 1);
        assert_eq!(feed.forget_sampled(10_000_000), 1, "c outlived the drain");
        let pid = segment.pid;
        assert!(!feed.window.live.contains_key(&(pid, EventType::Pta, c)), "its implied free closed it");
        let pools: Vec<_> = feed.tracker().pools().map(|(_, s)| (s.used, s.live_blocks)).collect();
        assert_eq!(pools, [(0, 0)]);
        let devices: Vec<_> = feed.tracker().devices().map(|(_, s)| (s.used, s.untracked_frees)).collect();
        assert_eq!(devices, [(20 * MIB, 1)], "the segment stays; the weight's free is counted");
        // The next window starts clean: its blocks pair as before.
        assert!(!feed.on_event(&pool_malloc(c, MIB, 0)) && !feed.on_event(&pool_free(c, MIB)));
        assert_eq!(feed.tracker().sampled_blocks(), 0);
    }

    #[test]
    fn a_feed_leaves_out_the_frees_of_blocks_sampling_left_out_and_counts_every_block() {
        let events = job_events(300);
        let mut feed = Feed::new(Limits { recent: 40, held: 100 });
        let (mut recorded, mut passed_frees) = (std::collections::HashSet::new(), 0);
        for e in unjudged(&events) {
            let left_out = feed.on_event(&e);
            let EventKind::Call(c) = &e.kind else { continue };
            match c.op {
                Op::PoolMalloc { ptr: Some(ptr), .. } if !left_out => {
                    recorded.insert(ptr);
                }
                Op::PoolFree { ptr: Some(ptr), .. } => {
                    assert_eq!(left_out, !recorded.remove(&ptr), "the free of {ptr:#x}");
                    passed_frees += u32::from(!left_out);
                }
                _ => {}
            }
        }
        assert!(passed_frees > 10 && passed_frees < 100, "{passed_frees} frees of sampled blocks");
        let (full, _) = run(&events);
        let stats = |t: &Tracker| {
            let pools: Vec<_> = t.pools().map(|(k, s)| (k, s.used, s.peak_used, s.live_blocks)).collect();
            let devices: Vec<_> = t.devices().map(|(k, s)| (k, s.used, s.peak, s.mallocs, s.frees)).collect();
            (pools, devices)
        };
        assert_eq!(stats(feed.tracker()), stats(&full), "the feed's totals are a full trace's");
    }
}
