//! The one pass over `memscope_dump` behind both definitions: blocks paired with the shared
//! key of [`crate::analysis::blocks`], each ACCESS resolved to the live block that holds its
//! address, and per process the API index msMemScope counts.

use std::collections::BTreeMap;

use foldhash::{HashMap, HashMapExt};

use super::*;
use crate::analysis::attr::attr_fields;
use crate::analysis::blocks::{parse_ptr, BlockKey, Bounds, EventTypes, Family, FreeMark, Names, ATB};
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
    struct Fields { addr, size, owner, pool, allocation_id, shadow, unmatched, inefficient_type }
}

pub(super) struct Replay {
    options: Options,
    /// Live blocks by slot (slots of ended blocks are reused), with their allocation number.
    slots: Vec<Option<(u64, Block)>>,
    free_slots: Vec<u32>,
    /// Ended blocks that were accessed, with their allocation number.
    ended: Vec<(u64, Block)>,
    live: HashMap<BlockKey, u32>,
    /// Live blocks by (process, start), for finding the block that holds an address: pool blocks
    /// first (they lie inside device segments), then device and host blocks.
    pool_index: BTreeMap<(i64, u64), u32>,
    other_index: BTreeMap<(i64, u64), u32>,
    apis: HashMap<(i64, OpFamily), ApiState>,
    /// Owner names; 0 is "no owner".
    owners: Names,
    event_types: EventTypes,
    existing: Vec<(i64, Box<str>)>,
    pids: foldhash::HashSet<i64>,
    /// `first` and `last`: every row of the events read.
    bounds: Bounds,
    stats: Stats,
}

impl Replay {
    pub(super) fn new(options: Options) -> Self {
        Self {
            options,
            slots: Vec::new(),
            free_slots: Vec::new(),
            ended: Vec::new(),
            live: HashMap::new(),
            pool_index: BTreeMap::new(),
            other_index: BTreeMap::new(),
            apis: HashMap::new(),
            owners: Names::starting_with(""),
            event_types: EventTypes::default(),
            existing: Vec::new(),
            pids: Default::default(),
            bounds: Bounds::default(),
            stats: Stats::default(),
        }
    }

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

    pub(super) fn apply(&mut self, row: DumpRow<'_>) {
        self.stats.rows += 1;
        match Event::parse(row.event) {
            Some(Event::Malloc) => self.malloc(&row),
            Some(Event::Free) => self.free(&row),
            Some(Event::Access) => self.access(&row),
            Some(Event::OpLaunch) => self.op(&row),
            Some(Event::System) => self.bounds.system(row.event_type, row.ts),
            _ => return,
        }
        self.bounds.seen(row.ts);
    }

    fn fields<'a>(&mut self, attr: &'a str) -> Option<Fields<'a>> {
        let parsed = Fields::parse(attr);
        if parsed.is_none() {
            self.stats.unreadable += 1;
        }
        parsed
    }

    fn malloc(&mut self, row: &DumpRow<'_>) {
        let Some(f) = self.fields(row.attr) else { return };
        if let Some(old) = f.inefficient_type.as_deref() {
            self.existing.push((row.rowid, old.into()));
        }
        let Some(block_family) = Family::of(row.event_type) else { return };
        let Some(ptr) = parse_ptr(row.ptr).or_else(|| f.addr.as_deref().and_then(parse_ptr)) else {
            self.stats.unreadable += 1;
            return;
        };
        let Some(size) = f.size.as_deref().and_then(|s| s.trim().parse::<u64>().ok()).filter(|&s| s > 0) else {
            self.stats.no_size += 1;
            return;
        };
        let key = self.event_types.key(row, ptr);
        let ty = key.event_type;
        if let Some(old) = self.live.remove(&key) {
            self.stats.reallocs += 1;
            self.close(old, row.ts, End::Realloc);
        }
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
            event_type: ty,
            family: block_family,
            pool: f.pool.as_deref().map(Into::into),
            ptr,
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
        self.live.insert(key, idx);
        self.index_of(block_family).insert((row.pid, ptr), idx);
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

    fn free(&mut self, row: &DumpRow<'_>) {
        let Some(f) = self.fields(row.attr) else { return };
        if Family::of(row.event_type).is_none() {
            return;
        }
        let Some(ptr) = parse_ptr(row.ptr).or_else(|| f.addr.as_deref().and_then(parse_ptr)) else {
            self.stats.unreadable += 1;
            return;
        };
        let key = self.event_types.key(row, ptr);
        let mark = FreeMark::of(f.shadow.as_deref(), f.unmatched.as_deref());
        if mark == FreeMark::Shadow {
            // Written when the trace stopped for blocks still live; msMemScope hands its shadow
            // frees to no analyzer, so they end the block's time but are no FREE API.
            self.stats.shadow_frees += 1;
            if let Some(idx) = self.live.remove(&key) {
                self.close(idx, row.ts, End::Live);
            }
            return;
        }
        let found = if mark == FreeMark::Unmatched {
            self.stats.unmatched_frees += 1;
            None
        } else {
            let found = self.live.remove(&key);
            self.stats.orphan_frees += u64::from(found.is_none());
            found
        };
        let Some(idx) = found else {
            // A block from before the trace was freed: still a FREE API for the others.
            if let Some(family) = op_family(row.event_type, f.pool.as_deref()) {
                self.api(row.pid, family).memory_event(false, true);
            }
            return;
        };
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
            None => self.fields(row.attr).and_then(|f| f.addr.as_deref().and_then(parse_ptr)),
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

    pub(super) fn finish(mut self) -> Report {
        let end_ns = self.bounds.end_ns();
        let live: Vec<u32> = self.live.drain().map(|(_, idx)| idx).collect();
        for idx in live {
            let (seq, mut b) = self.slots[idx as usize].take().expect("a live block's slot");
            b.end_ns = end_ns.unwrap_or(b.malloc_ns).max(b.malloc_ns);
            b.end = End::Live;
            if b.accesses > 0 {
                self.ended.push((seq, b));
            }
        }
        self.ended.sort_unstable_by_key(|(seq, _)| *seq);
        let mut blocks: Vec<Block> = self.ended.into_iter().map(|(_, b)| b).collect();
        let o = &self.options;
        for b in &mut blocks {
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
                self.stats.below_mem_size += 1;
            }
        }
        self.stats.processes = self.pids.len() as u64;
        Report {
            options: self.options,
            blocks,
            owners: self.owners.into_names(),
            event_types: self.event_types.into_names(),
            existing: self.existing,
            start_ns: self.bounds.start_ns(),
            end_ns,
            stats: self.stats,
        }
    }
}
