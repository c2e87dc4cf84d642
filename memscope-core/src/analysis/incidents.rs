//! OOM incidents followed through the pool replay: each failed allocation (an OOM_TRIGGER row)
//! with the failing process's memory at that instant, taken from the pool model
//! ([`super::pool`]), and its verdict. The fragmentation replay feeds the rows to a `Tracker`;
//! `oom` reports and stores what it found.
//!
//! One failure of torch_npu's allocator writes several OOM_TRIGGER rows: one per runtime request
//! that failed inside its call (a segment, then the retries after freeing its cache), then its
//! own give-up. They are one incident: the runtime refusals of a thread are held until that
//! thread's next pool row says what became of them (the allocator gave up, or recovered and
//! handed out the block), or until another row shows they came from outside the allocator.
//!
//! PyTorch's CUDA allocator writes no give-up of its own (its `pytorch:malloc` probe fires only
//! on success), but its refusals say they were taking one of its segments (`segment` on the
//! OOM_TRIGGER row): refusals of that kind that the allocator did not recover from are its
//! give-up, the last one standing for the incident and the others its attempts.

use foldhash::{HashMap, HashMapExt};
use serde::Serialize;

use super::db::DumpRow;
use super::pool::{parse_number, Fields, Live, PoolKind, Pools, Reason, Sample};
use crate::units::human_bytes;
use crate::vocab::EventType;

/// The owner recorded for blocks whose MALLOC named none (as `ms_decompose` names them).
pub use super::blocks::UNKNOWN_OWNER;

/// msMemScope's default K for `oom` (`--analysis oom:K`, 1..=1000).
pub const DEFAULT_TOP_K: usize = 10;

/// Incidents beyond this are counted, not captured (each capture walks the live blocks).
const MAX_CAPTURED: usize = 10_000;

/// Which layer failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Level {
    /// torch_npu's allocator gave up (after its own retries).
    Allocator,
    /// The runtime returned ACL_ERROR_RT_MEMORY_ALLOCATION (cudaErrorMemoryAllocation).
    Runtime,
    /// The driver returned DRV_ERROR_OUT_OF_MEMORY (CUDA_ERROR_OUT_OF_MEMORY).
    Driver,
}

impl Level {
    fn of(name: &str, func: Option<&str>) -> Self {
        let f = func.filter(|f| !f.is_empty()).unwrap_or(name);
        if Tracker::is_allocator(name, func) {
            Self::Allocator
        } else if f.starts_with("hal") || f.starts_with("cuMem") {
            Self::Driver
        } else {
            Self::Runtime
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Allocator => "allocator",
            Self::Runtime => "runtime",
            Self::Driver => "driver",
        }
    }
}

/// What the failure was, in one word (`ms_oom.verdict`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Reserved but unused memory covered the request; no free piece was big enough.
    Fragmentation,
    /// Reserved but unused memory did not cover the request: the memory is really in use.
    Full,
    /// The allocator refused without asking the runtime (its memory fraction).
    Limit,
    /// A cached free piece was big enough, but the allocator could not use it for this request.
    CachedUnusable,
    /// A runtime/driver refusal inside the allocator, which then freed its cache and succeeded.
    Recovered,
    /// The runtime or driver refused a request made outside the caching allocator.
    DeviceFull,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Fragmentation => "fragmentation",
            Self::Full => "full",
            Self::Limit => "limit",
            Self::CachedUnusable => "cached_unusable",
            Self::Recovered => "recovered",
            Self::DeviceFull => "device_full",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Attempt {
    pub ts_ns: i64,
    pub func: String,
    pub req_size: Option<u64>,
}

/// A live block at the failure.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct BlockInfo {
    /// `PTA` (a pool block) or `HAL` (device memory outside the pools).
    pub kind: &'static str,
    pub pool: Option<&'static str>,
    pub ptr: String,
    pub size: u64,
    pub ts_ns: i64,
    pub owner: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct OwnerBytes {
    pub owner: String,
    pub bytes: u64,
    pub blocks: u64,
}

/// The failing process's memory at the failure.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct State {
    /// The caching pool (reserved: its segments; allocated: its live blocks).
    pub reserved: u64,
    pub allocated: u64,
    pub unused: u64,
    pub largest_free: Option<u64>,
    pub free_pieces: u64,
    pub holes: u64,
    /// Live `HAL` bytes of this process, and of every process in the DB.
    pub process_device: u64,
    pub device_used: u64,
    /// The device's memory, when the trace records it (msMemScope's START_TRACE `total`).
    pub capacity: Option<u64>,
    /// Whether the pool's segments were seen being allocated (so the runtime layer is traced).
    pub segments_seen: bool,
    pub owners: Vec<OwnerBytes>,
    pub recent: Vec<BlockInfo>,
    pub largest: Vec<BlockInfo>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// A runtime/driver refusal waiting for its thread's next pool row.
    Pending,
    /// Folded into the allocator's incident.
    Absorbed,
    Final,
}

#[derive(Clone, Debug, Serialize)]
pub struct Incident {
    /// 1-based, in time order, per DB.
    pub number: usize,
    pub ts_ns: i64,
    pub pid: i64,
    pub tid: i64,
    pub func: String,
    pub level: Level,
    pub req_size: Option<u64>,
    pub status: Option<String>,
    /// The runtime/driver refusals inside the allocator's call before it gave up.
    pub attempts: Vec<Attempt>,
    pub state: State,
    pub verdict: Verdict,
    /// The verdict in plain words, with what to try.
    pub explanation: String,
    /// The tracer's online OOM_RECENT_ALLOC / OOM_TOP_ALLOC rows after this failure, and how many
    /// of the blocks they name are live in the replay.
    pub online_listed: u64,
    pub online_live: u64,
    #[serde(skip)]
    stage: Stage,
    #[serde(skip)]
    sample: Sample,
    /// A refusal of a segment the caching pool was taking (`segment: caching` on its row).
    #[serde(skip)]
    in_pool: bool,
}

/// Follows OOM_TRIGGER rows through a replay.
pub(crate) struct Tracker {
    k: usize,
    all: Vec<Incident>,
    pending: HashMap<(i64, i64), Vec<usize>>,
    last_of_pid: HashMap<i64, usize>,
    pub incidents: Vec<Incident>,
    pub uncaptured: u64,
}

impl Default for Tracker {
    fn default() -> Self {
        Self::new(DEFAULT_TOP_K)
    }
}

impl Tracker {
    pub fn new(k: usize) -> Self {
        Self {
            k,
            all: Vec::new(),
            pending: HashMap::new(),
            last_of_pid: HashMap::new(),
            incidents: Vec::new(),
            uncaptured: 0,
        }
    }

    /// torch_npu's pool allocators (the give-up after retries), as the tracer names them.
    pub fn is_allocator(name: &str, func: Option<&str>) -> bool {
        [Some(name), func].into_iter().flatten().any(|f| {
            f.contains("Allocator::") || f == "MallocBlock" || f == "allocate_workspace" || f.starts_with("mstxMem")
        })
    }

    fn settle(&mut self, key: (i64, i64), verdict: Option<Verdict>) {
        let pending = self.pending.remove(&key).unwrap_or_default();
        if verdict.is_none() && !pending.is_empty() && pending.iter().all(|&i| self.all[i].in_pool) {
            return self.gave_up(&pending);
        }
        for i in pending {
            let inc = &mut self.all[i];
            inc.stage = Stage::Final;
            match verdict {
                Some(v) => {
                    inc.verdict = v;
                    inc.explanation = explain(inc);
                }
                None => classify(inc),
            }
        }
    }

    /// The caching pool's refusals it did not recover from, as its give-up: the last one, with
    /// the others as its attempts.
    fn gave_up(&mut self, pending: &[usize]) {
        let (&last, earlier) = pending.split_last().expect("called with refusals");
        let mut attempts = Vec::new();
        for &i in earlier {
            let a = &mut self.all[i];
            a.stage = Stage::Absorbed;
            attempts.push(Attempt { ts_ns: a.ts_ns, func: a.func.clone(), req_size: a.req_size });
        }
        let inc = &mut self.all[last];
        inc.level = Level::Allocator;
        inc.attempts = attempts;
        inc.stage = Stage::Final;
        classify(inc);
    }

    /// A HAL row on a thread: freeing cached segments and taking new ones is what the allocator
    /// does between a refusal and its outcome; any other device allocation ends the wait.
    pub fn memory_row(&mut self, key: (i64, i64), inside_allocator: bool) {
        if !inside_allocator && self.pending.contains_key(&key) {
            self.settle(key, None);
        }
    }

    /// A pool row on a thread: a MALLOC means the allocator recovered from the refusals before it.
    pub fn pool_row(&mut self, key: (i64, i64), malloc: bool) {
        if self.pending.contains_key(&key) {
            self.settle(key, malloc.then_some(Verdict::Recovered));
        }
    }
}

fn block_info(pools: &Pools, ptr: u64, live: &Live, kind: &'static str) -> BlockInfo {
    BlockInfo {
        kind,
        pool: live.pool.map(|p| match p {
            PoolKind::Caching => "caching",
            PoolKind::Workspace => "workspace",
            PoolKind::Other => "other",
        }),
        ptr: format!("0x{ptr:016x}"),
        size: live.size,
        ts_ns: live.ts,
        owner: pools.owners.name(live.owner).to_string(),
    }
}

/// The process's memory now: pool counters, device bytes, owners, and the top-K live blocks.
fn state(pools: &Pools, pid: i64, k: usize) -> State {
    let device_used = pools.procs.values().map(|p| p.hal_bytes).sum();
    let mut s = State { device_used, capacity: pools.capacity, ..State::default() };
    let Some(proc) = pools.procs.get(&pid) else { return s };
    s.reserved = proc.reserved();
    s.allocated = proc.allocated;
    s.unused = s.reserved.saturating_sub(s.allocated);
    s.largest_free = proc.largest_free();
    s.segments_seen = s.largest_free.is_some();
    s.free_pieces = proc.free_pieces();
    s.holes = proc.holes();
    s.process_device = proc.hal_bytes;
    // Pool blocks, and device memory that is not a pool's segment (whose bytes are the blocks).
    let live: Vec<(u64, &Live, &'static str)> = proc
        .blocks
        .iter()
        .map(|(&p, b)| (p, b, EventType::Pta.as_str()))
        .chain(proc.hal.iter().filter(|(_, b)| b.segment.is_none()).map(|(&p, b)| (p, b, EventType::Hal.as_str())))
        .collect();
    let mut owners: HashMap<u32, (u64, u64)> = HashMap::new();
    for (_, b, _) in &live {
        let o = owners.entry(b.owner).or_default();
        o.0 += b.size;
        o.1 += 1;
    }
    let mut owners: Vec<OwnerBytes> = owners
        .into_iter()
        .map(|(id, (bytes, blocks))| OwnerBytes { owner: pools.owners.name(id).to_string(), bytes, blocks })
        .collect();
    owners.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.owner.cmp(&b.owner)));
    owners.truncate(k);
    s.owners = owners;
    let mut by_time = live.clone();
    by_time.sort_by(|a, b| b.1.ts.cmp(&a.1.ts).then(b.0.cmp(&a.0)));
    s.recent = by_time.iter().take(k).map(|(p, b, kind)| block_info(pools, *p, b, kind)).collect();
    let mut by_size = live;
    by_size.sort_by(|a, b| b.1.size.cmp(&a.1.size).then(a.0.cmp(&b.0)));
    s.largest = by_size.iter().take(k).map(|(p, b, kind)| block_info(pools, *p, b, kind)).collect();
    s
}

/// An OOM_TRIGGER row: captures the state and starts (or, for the allocator's give-up, ends) an
/// incident.
pub(crate) fn capture(tracker: &mut Tracker, pools: &Pools, row: &DumpRow<'_>, attr: &Fields<'_>) {
    if tracker.all.len() >= MAX_CAPTURED {
        tracker.uncaptured += 1;
        return;
    }
    let level = Level::of(row.name, attr.func.as_deref());
    let func = attr.func.as_deref().filter(|f| !f.is_empty()).unwrap_or(row.name).to_owned();
    let k = tracker.k;
    let mut inc = Incident {
        number: 0,
        ts_ns: row.ts,
        pid: row.pid,
        tid: row.tid,
        func,
        level,
        req_size: Fields::number(&attr.req_size),
        status: attr.status.as_deref().map(str::to_owned),
        attempts: Vec::new(),
        state: state(pools, row.pid, k),
        verdict: Verdict::Full,
        explanation: String::new(),
        online_listed: 0,
        online_live: 0,
        stage: Stage::Pending,
        sample: pools.sample(row.ts, Reason::Oom),
        in_pool: attr.segment.as_deref() == Some("caching"),
    };
    let key = (row.pid, row.tid);
    let index = tracker.all.len();
    if level == Level::Allocator {
        for i in tracker.pending.remove(&key).unwrap_or_default() {
            let a = &mut tracker.all[i];
            a.stage = Stage::Absorbed;
            inc.attempts.push(Attempt { ts_ns: a.ts_ns, func: a.func.clone(), req_size: a.req_size });
        }
        inc.stage = Stage::Final;
        classify(&mut inc);
    } else {
        tracker.pending.entry(key).or_default().push(index);
    }
    tracker.all.push(inc);
    tracker.last_of_pid.insert(row.pid, index);
}

/// An OOM_RECENT_ALLOC / OOM_TOP_ALLOC row of the tracer: is the block it names live here?
pub(crate) fn cross_check(tracker: &mut Tracker, pools: &Pools, row: &DumpRow<'_>, attr: &Fields<'_>) {
    if !matches!(EventType::parse(row.event_type), Some(EventType::OomRecentAlloc | EventType::OomTopAlloc)) {
        return;
    }
    let Some(&index) = tracker.last_of_pid.get(&row.pid) else { return };
    let ptr = attr.ptr.as_deref().and_then(parse_number).or_else(|| parse_number(row.ptr));
    let live = ptr.is_some_and(|p| {
        pools.procs.get(&row.pid).is_some_and(|proc| proc.blocks.contains_key(&p) || proc.hal.contains_key(&p))
    });
    let inc = &mut tracker.all[index];
    inc.online_listed += 1;
    inc.online_live += u64::from(live);
}

/// The end of the trace: refusals still waiting came from outside the allocator. Final incidents
/// are numbered in time order, and their samples join the fragmentation samples.
pub(crate) fn finish(tracker: &mut Tracker) {
    let keys: Vec<(i64, i64)> = tracker.pending.keys().copied().collect();
    for key in keys {
        tracker.settle(key, None);
    }
    let mut done: Vec<Incident> =
        std::mem::take(&mut tracker.all).into_iter().filter(|i| i.stage == Stage::Final).collect();
    done.sort_by_key(|i| i.ts_ns);
    for (n, inc) in done.iter_mut().enumerate() {
        inc.number = n + 1;
    }
    tracker.incidents = done;
}

/// The samples of the incidents that were real failures (not recoveries).
pub(crate) fn samples(incidents: &[Incident]) -> impl Iterator<Item = Sample> + '_ {
    incidents.iter().filter(|i| i.verdict != Verdict::Recovered).map(|i| i.sample)
}

fn classify(inc: &mut Incident) {
    let s = &inc.state;
    let req = inc.req_size.unwrap_or(0);
    inc.verdict = if inc.level != Level::Allocator {
        Verdict::DeviceFull
    } else if s.reserved == 0 && s.allocated == 0 {
        Verdict::Full
    } else if s.largest_free.is_some_and(|l| l >= req) {
        Verdict::CachedUnusable
    } else if s.unused >= req {
        Verdict::Fragmentation
    } else if inc.attempts.is_empty() && s.segments_seen {
        Verdict::Limit
    } else {
        Verdict::Full
    };
    inc.explanation = explain(inc);
}

fn owners_text(owners: &[OwnerBytes], n: usize) -> String {
    let list: Vec<String> =
        owners.iter().take(n).map(|o| format!("{} ({})", o.owner, human_bytes(o.bytes as i64))).collect();
    if list.is_empty() {
        "no live blocks".to_owned()
    } else {
        list.join(", ")
    }
}

/// The verdict in plain words.
fn explain(inc: &Incident) -> String {
    let s = &inc.state;
    let b = |v: u64| human_bytes(v as i64);
    let req = inc.req_size.map_or_else(|| "an unknown size".to_owned(), b);
    match inc.verdict {
        Verdict::Fragmentation => {
            let piece = match s.largest_free {
                Some(l) => format!("the largest free piece is {} < {req} requested", b(l)),
                None => "no free piece was big enough (the trace has no segment rows to say how big they were)".into(),
            };
            format!(
                "fragmentation: {} reserved but unused, {piece} → try expandable_segments:True in PYTORCH_NPU_ALLOC_CONF (PYTORCH_CUDA_ALLOC_CONF on CUDA) \
                 (or max_split_size_mb, so that big cached blocks are not split for small ones)",
                b(s.unused)
            )
        }
        Verdict::Full => format!(
            "genuinely full: only {} reserved but unused for {req} requested; the owners {} hold the most \
             → free or shrink what they hold (smaller batch, activation checkpointing, offloading)",
            b(s.unused),
            owners_text(&s.owners, 3)
        ),
        Verdict::Limit => format!(
            "the allocator refused {req} without asking the runtime for more: its own limit \
             (torch_npu.npu.set_per_process_memory_fraction) was reached at {} reserved ({} unused); \
             raise the fraction or hold less (owners: {})",
            b(s.reserved),
            b(s.unused),
            owners_text(&s.owners, 3)
        ),
        Verdict::CachedUnusable => format!(
            "a cached free piece of {} ≥ {req} existed but the allocator could not use it for this request (it \
             belongs to another stream or to the small-block pool, or max_split_size_mb keeps it for big requests)",
            s.largest_free.map_or_else(|| "?".into(), b)
        ),
        Verdict::Recovered => format!(
            "the runtime refused {req}; the allocator freed cached memory and retried successfully \
             (reserved {} at the refusal): the pool is at the device's limit",
            b(s.reserved)
        ),
        Verdict::DeviceFull => {
            let pool = if s.reserved > 0 {
                format!("; its caching pool held {} reserved, {} of it unused", b(s.reserved), b(s.unused))
            } else {
                String::new()
            };
            format!(
                "the {} refused {req} outside the caching allocator while this process held {} of device memory \
                 (all traced processes: {}){pool}; owners: {}",
                inc.level.as_str(),
                b(s.process_device),
                b(s.device_used),
                owners_text(&s.owners, 3)
            )
        }
    }
}
