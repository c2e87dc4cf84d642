//! The one pass over `memscope_dump` behind both definitions: blocks paired by the shared
//! [`BlockReplay`] (a `shadow` FREE ends its block's time here), each ACCESS resolved to the
//! live block that holds its address, and per process the API index msMemScope counts.

use std::collections::BTreeMap;

use foldhash::{HashMap, HashMapExt};

use super::*;
use crate::analysis::attr::attr_fields;
use crate::analysis::blocks::{block_attr, parse_ptr, BlockHooks, BlockKey, BlockReplay, Bounds, Family, Names, ATB};
use crate::analysis::db::DumpRow;
use crate::vocab::{Event, EventType};

/// The op family of a block: PTA blocks of the caching pool (a PTA row without `pool`, as
/// msMemScope writes them, counts as caching: it writes workspace blocks as PTA too since
/// f963bc8 and its DBs cannot tell them apart) and ATB blocks.
fn op_family(event_type: &str, pool: Option<&str>) -> Option<OpFamily> {
    if event_type == EventType::Pta.as_str() {
        (pool != Some("workspace")).then_some(OpFamily::Aten)
    } else {
        (event_type == ATB).then_some(OpFamily::Atb)
    }
}

/// One process's API index for one op family, as msMemScope's `PidState`. Its list of the
/// current API's events only matters for whether it held a MALLOC and a FREE, so two bits stand
/// for it.
#[derive(Clone, Copy, Debug, Default)]
struct ApiState {
    api: u64,
    /// The newest API that held a MALLOC / a FREE (`mallocApiTmpId`, `freeApiTmpId`).
    malloc_api: Option<u64>,
    free_api: Option<u64>,
    in_op: bool,
    pending_malloc: bool,
    pending_free: bool,
}

impl ApiState {
    /// A MALLOC, FREE or ACCESS: inside an op it belongs to the op's API; outside one it is an
    /// API of its own, classified at once. Returns its API index.
    fn memory_event(&mut self, malloc: bool, free: bool) -> u64 {
        self.pending_malloc |= malloc;
        self.pending_free |= free;
        if !self.in_op {
            self.api += 1;
            self.classify();
        }
        self.api
    }

    fn op_start(&mut self) {
        self.in_op = true;
        self.api += 1;
    }

    fn op_end(&mut self) {
        self.in_op = false;
        self.classify();
    }

    fn classify(&mut self) {
        if self.pending_malloc {
            self.malloc_api = Some(self.api);
        }
        if self.pending_free {
            self.free_api = Some(self.api);
        }
        self.pending_malloc = false;
        self.pending_free = false;
    }
}

attr_fields! {
    /// The Attr keys this analysis reads.
    struct Fields { addr, size, weight, owner, pool, allocation_id, shadow, unmatched, inefficient_type }
}
block_attr!(Fields);

/// The pass: [`BlockReplay`] pairs MALLOC and FREE (with a `shadow` FREE ending its block's
/// time), [`State`] keeps what both definitions need of each block and resolves the rest.
pub(super) struct Replay {
    blocks: BlockReplay<u32>,
    state: State,
}

/// Everything but the pairing. A live block is its slot number here; the replay's map holds it.
struct State {
    options: Options,
    /// Live blocks by slot (slots of ended blocks are reused), with their allocation number.
    slots: Vec<Option<(u64, Block)>>,
    free_slots: Vec<u32>,
    /// Ended blocks that were accessed, with their allocation number.
    ended: Vec<(u64, Block)>,
    /// Live blocks by (process, start), for finding the block that holds an address: pool blocks
    /// first (they lie inside device segments), then device and host blocks.
    pool_index: BTreeMap<(i64, u64), u32>,
    other_index: BTreeMap<(i64, u64), u32>,
    apis: HashMap<(i64, OpFamily), ApiState>,
    /// Owner names; 0 is "no owner".
    owners: Names,
    existing: Vec<(i64, Box<str>)>,
    pids: foldhash::HashSet<i64>,
    /// `first` and `last`: every row of the events read.
    bounds: Bounds,
    stats: Stats,
}

impl Replay {
    pub(super) fn new(options: Options) -> Self {
        let state = State {
            options,
            slots: Vec::new(),
            free_slots: Vec::new(),
            ended: Vec::new(),
            pool_index: BTreeMap::new(),
            other_index: BTreeMap::new(),
            apis: HashMap::new(),
            owners: Names::starting_with(""),
            existing: Vec::new(),
            pids: Default::default(),
            bounds: Bounds::default(),
            stats: Stats::default(),
        };
        Self { blocks: BlockReplay::default(), state }
    }

    pub(super) fn apply(&mut self, row: DumpRow<'_>) {
        let state = &mut self.state;
        state.stats.rows += 1;
        match Event::parse(row.event) {
            Some(Event::Malloc | Event::Free) => self.blocks.apply(state, &row),
            Some(Event::Access) => state.access(&row),
            Some(Event::OpLaunch) => state.op(&row),
            Some(Event::System) => state.bounds.system(row.event_type, row.ts),
            _ => return,
        }
        state.bounds.seen(row.ts);
    }
}

impl BlockHooks for State {
    type Block = u32;
    type Attr<'a> = Fields<'a>;

    // msMemScope hands its shadow frees to no analyzer, so they are no FREE API; but they end
    // the block's time.
    const SHADOW_ENDS_BLOCK: bool = true;
    // A finding is about one block: its own size, not what a sample of it stands for.
    const WEIGHTED: bool = false;

    fn not_a_block(&mut self, row: &DumpRow<'_>) {
        match Fields::parse(row.attr) {
            Some(f) => self.malloc_read(row, &f),
            None => self.stats.unreadable += 1,
        }
    }
    fn malloc_read(&mut self, row: &DumpRow<'_>, f: &Fields<'_>) {
        if let (Some(old), Some(Event::Malloc)) = (f.inefficient_type.as_deref(), Event::parse(row.event)) {
            self.existing.push((row.rowid, old.into()));
        }
    }
    fn unreadable(&mut self) {
        self.stats.unreadable += 1;
    }
    fn shadow_free(&mut self) {
        self.stats.shadow_frees += 1;
    }
    fn shadow_end(&mut self, row: &DumpRow<'_>, _: BlockKey, idx: u32) {
        self.close(idx, row.ts, End::Live);
    }
    fn unmatched_free(&mut self, row: &DumpRow<'_>, f: &Fields<'_>) {
        self.stats.unmatched_frees += 1;
        self.untraced_free(row, f);
    }
    fn orphan_free(&mut self, row: &DumpRow<'_>, f: &Fields<'_>) {
        self.stats.orphan_frees += 1;
        self.untraced_free(row, f);
    }
    fn no_size(&mut self) {
        self.stats.no_size += 1;
    }
    fn open(&mut self, row: &DumpRow<'_>, key: BlockKey, family: Family, _: &str, size: i64, f: &Fields<'_>) -> u32 {
        self.open_block(row, key, family, size as u64, f)
    }
    fn realloc(&mut self, row: &DumpRow<'_>, _: BlockKey, old: u32) {
        self.stats.reallocs += 1;
        self.close(old, row.ts, End::Realloc);
    }
    fn free(&mut self, row: &DumpRow<'_>, _: BlockKey, idx: u32, _: &Fields<'_>) {
        self.freed(row, idx);
    }
}

impl State {
    fn owner(&mut self, owner: Option<&str>) -> u32 {
        owner.filter(|o| !o.is_empty()).map_or(0, |o| self.owners.id(o))
    }

    /// A live block.
    fn block(&mut self, idx: u32) -> &mut Block {
        &mut self.slots[idx as usize].as_mut().expect("a live block's slot").1
    }

    fn api(&mut self, pid: i64, family: OpFamily) -> &mut ApiState {
        self.apis.entry((pid, family)).or_default()
    }

    fn open_block(&mut self, row: &DumpRow<'_>, key: BlockKey, block_family: Family, size: u64, f: &Fields<'_>) -> u32 {
        self.pids.insert(row.pid);
        let family = op_family(row.event_type, f.pool.as_deref());
        let api = family.map(|family| ApiFacts {
            family,
            malloc: self.api(row.pid, family).memory_event(true, false),
            first_access: None,
            last_access: None,
            free: None,
            max_idle: None,
            last_was_access: false,
        });
        let owner = self.owner(f.owner.as_deref());
        let block = Block {
            malloc_rowid: row.rowid,
            malloc_id: row.id,
            pid: row.pid,
            event_type: key.event_type,
            family: block_family,
            pool: f.pool.as_deref().map(Into::into),
            ptr: key.ptr,
            size,
            allocation_id: f.allocation_id.as_deref().map(Into::into),
            owner,
            malloc_ns: row.ts,
            end_ns: row.ts,
            end: End::Live,
            accesses: 0,
            first_access_ns: None,
            last_access_ns: None,
            max_idle_ns: None,
            api,
            flags: 0,
        };
        let slot = Some((self.stats.blocks, block));
        let idx = match self.free_slots.pop() {
            Some(idx) => {
                self.slots[idx as usize] = slot;
                idx
            }
            None => {
                self.slots.push(slot);
                (self.slots.len() - 1) as u32
            }
        };
        self.stats.blocks += 1;
        self.stats.op_index_blocks += u64::from(family.is_some());
        self.index_of(block_family).insert((row.pid, key.ptr), idx);
        idx
    }

    fn index_of(&mut self, family: Family) -> &mut BTreeMap<(i64, u64), u32> {
        if family == Family::Pta {
            &mut self.pool_index
        } else {
            &mut self.other_index
        }
    }

    /// Ends a block's life (its FREE, a shadow FREE, or a MALLOC over it). No access can reach
    /// it any more, so only an accessed block is kept.
    fn close(&mut self, idx: u32, ts: i64, end: End) {
        let (seq, mut b) = self.slots[idx as usize].take().expect("a live block's slot");
        self.free_slots.push(idx);
        b.end_ns = ts;
        b.end = end;
        let index = self.index_of(b.family);
        if index.get(&(b.pid, b.ptr)) == Some(&idx) {
            index.remove(&(b.pid, b.ptr));
        }
        if b.accesses > 0 {
            self.ended.push((seq, b));
        }
    }

    /// A FREE of a block from before the trace, or of none the trace saw: still a FREE API for
    /// the others.
    fn untraced_free(&mut self, row: &DumpRow<'_>, f: &Fields<'_>) {
        if let Some(family) = op_family(row.event_type, f.pool.as_deref()) {
            self.api(row.pid, family).memory_event(false, true);
        }
    }

    /// The FREE of a live block.
    fn freed(&mut self, row: &DumpRow<'_>, idx: u32) {
        if let Some(family) = self.block(idx).api.map(|a| a.family) {
            let st = {
                let s = self.api(row.pid, family);
                s.memory_event(false, true);
                *s
            };
            let b = self.block(idx);
            let facts = b.api.as_mut().expect("family came from it");
            facts.free = Some(st.api);
            // late_deallocation: the event before this FREE was an access, in an earlier API, and
            // an API after it allocated: the block could have been freed before that allocation.
            if facts.last_was_access {
                let la = facts.last_access.expect("set with last_was_access");
                if la != st.api && st.malloc_api.is_some_and(|m| la < m && st.api > m) {
                    b.flags |= LATE_DEALLOCATION;
                }
            }
            facts.last_was_access = false;
        }
        self.close(idx, row.ts, End::Free);
    }

    /// The live block holding `addr`: a pool block if one does, else a device or host block.
    fn resolve(&self, pid: i64, addr: u64) -> Option<u32> {
        for index in [&self.pool_index, &self.other_index] {
            if let Some((_, &idx)) = index.range((pid, 0)..=(pid, addr)).next_back() {
                let b = &self.slots[idx as usize].as_ref().expect("a live block's slot").1;
                if addr < b.ptr.saturating_add(b.size) {
                    return Some(idx);
                }
            }
        }
        None
    }

    fn access(&mut self, row: &DumpRow<'_>) {
        let addr = match parse_ptr(row.ptr) {
            Some(a) => Some(a),
            None => match Fields::parse(row.attr) {
                Some(f) => f.addr.as_deref().and_then(parse_ptr),
                None => {
                    self.stats.unreadable += 1;
                    None
                }
            },
        };
        let Some(idx) = addr.and_then(|a| self.resolve(row.pid, a)) else {
            self.stats.unresolved_accesses += 1;
            return;
        };
        self.stats.accesses += 1;
        let b = self.block(idx);
        b.accesses += 1;
        if let Some(prev) = b.last_access_ns {
            let gap = row.ts - prev;
            b.max_idle_ns = Some(b.max_idle_ns.map_or(gap, |m| m.max(gap)));
        }
        b.first_access_ns.get_or_insert(row.ts);
        b.last_access_ns = Some(row.ts);
        let Some(family) = b.api.map(|a| a.family) else { return };
        let st = {
            let s = self.apis.entry((row.pid, family)).or_default();
            s.memory_event(false, false);
            *s
        };
        let threshold = self.options.idle_threshold;
        let b = self.block(idx);
        let facts = b.api.as_mut().expect("family came from it");
        let api = st.api;
        // temporary_idleness: this access and the one before it are too many APIs apart.
        if facts.last_was_access {
            let prev = facts.last_access.expect("set with last_was_access");
            if api > prev {
                let gap = api - prev;
                facts.max_idle = Some(facts.max_idle.map_or(gap, |m| m.max(gap)));
                if gap > threshold {
                    b.flags |= TEMPORARY_IDLENESS;
                }
            }
        }
        if facts.first_access.is_none() && api != facts.malloc {
            facts.first_access = Some(api);
        }
        facts.last_access = Some(api);
        facts.last_was_access = true;
        // early_allocation: a FREE API lies strictly between the MALLOC's and the first access's,
        // so the block could have been allocated after that free and reused its memory. Checked
        // at every access with the newest FREE API, as msMemScope does.
        if let (Some(free), Some(first)) = (st.free_api, facts.first_access) {
            if facts.malloc != free && first > free && facts.malloc < free {
                b.flags |= EARLY_ALLOCATION;
            }
        }
    }

    fn op(&mut self, row: &DumpRow<'_>) {
        let (family, start) = match EventType::parse(row.event_type) {
            Some(EventType::AtenStart) => (OpFamily::Aten, true),
            Some(EventType::AtenEnd) => (OpFamily::Aten, false),
            Some(EventType::AtbStart) => (OpFamily::Atb, true),
            Some(EventType::AtbEnd) => (OpFamily::Atb, false),
            _ => return,
        };
        let st = self.api(row.pid, family);
        if start {
            st.op_start();
            self.stats.ops += 1;
        } else {
            st.op_end();
        }
    }
}

impl Replay {
    pub(super) fn finish(self) -> Report {
        let Self { mut blocks, state: mut st } = self;
        let end_ns = st.bounds.end_ns();
        for (_, idx) in blocks.drain() {
            let (seq, mut b) = st.slots[idx as usize].take().expect("a live block's slot");
            b.end_ns = end_ns.unwrap_or(b.malloc_ns).max(b.malloc_ns);
            b.end = End::Live;
            if b.accesses > 0 {
                st.ended.push((seq, b));
            }
        }
        st.ended.sort_unstable_by_key(|(seq, _)| *seq);
        let mut ended: Vec<Block> = st.ended.into_iter().map(|(_, b)| b).collect();
        for b in &mut ended {
            judge_by_time(b, &st.options, &mut st.stats);
        }
        st.stats.processes = st.pids.len() as u64;
        Report {
            options: st.options,
            blocks: ended,
            owners: st.owners.into_names(),
            event_types: blocks.into_event_types(),
            existing: st.existing,
            start_ns: st.bounds.start_ns(),
            end_ns,
            stats: st.stats,
        }
    }
}

/// Insight's definitions, on the ended block's times; then `--mem-size` for both.
fn judge_by_time(b: &mut Block, o: &Options, stats: &mut Stats) {
    let life = b.end_ns - b.malloc_ns;
    // Insight's conditions: an access after the allocation instant, then the threshold.
    if let (Some(t), Some(first)) = (o.lazy_used, b.first_access_ns) {
        if first > b.malloc_ns && t.exceeded(first - b.malloc_ns, life) {
            b.flags |= LAZY_USED;
        }
    }
    if let (Some(t), Some(last)) = (o.delayed_free, b.last_access_ns) {
        if last > b.malloc_ns && t.exceeded(b.end_ns - last, life) {
            b.flags |= DELAYED_FREE;
        }
    }
    if let (Some(t), Some(idle)) = (o.long_idle, b.max_idle_ns) {
        if t.exceeded(idle, life) {
            b.flags |= LONG_IDLE;
        }
    }
    if b.flags != 0 && b.size < o.mem_size {
        b.flags = 0;
        stats.below_mem_size += 1;
    }
}
