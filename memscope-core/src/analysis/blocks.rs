//! The MALLOC/FREE block replay the analyses share: how a block is keyed, which FREEs close one,
//! the interners for `Event Type` and owner names, and the trace's time bounds.
//!
//! docs/db-schema.md (under `ms_decompose`, "Blocks are rebuilt as Insight does") is the rule: a `MALLOC` with a
//! positive `size` opens the block keyed by (`Process Id`, `Event Type`, `Ptr`, or the Attr's
//! `addr` when `Ptr` is no address); the next `FREE` of that key closes it; a `FREE` marked
//! `unmatched` (its block predates the trace) closes nothing; a `FREE` marked `shadow` (written at
//! the stop for a block still live) is no free; a `MALLOC` at a key already live ends the earlier
//! block there. A row with no address is unreadable, whatever its marks.
//!
//! [`BlockReplay`] applies that rule row by row and hands each analysis's own metrics to its
//! [`BlockHooks`]: decompose's owner steps, the step timeline's block ends, inefficient's accesses
//! and API index (for it a shadow FREE ends the block's time: [`BlockHooks::SHADOW_ENDS_BLOCK`]).
//! The pool model (`pool.rs`, behind fragmentation, oom and advise) keeps blocks inside pool
//! segments by address instead, and shares [`FreeMark`], [`Bounds`] and the owner default here.
//!
//! Millions of rows go through here: the live map is a foldhash map, the Attr is read by the
//! borrowed fast path of [`super::attr`], and a row allocates nothing unless it names an owner
//! or an `Event Type` for the first time.

use foldhash::HashMap;

use super::db::DumpRow;
use crate::vocab::{Event, EventType};

/// msMemScope's ATB pool `Event Type` (its DBs only: our tracer writes ATB workspaces as PTA
/// blocks, so the vocabulary has no such value).
pub const ATB: &str = "ATB";

/// The owner recorded for blocks whose MALLOC named none.
pub const UNKNOWN_OWNER: &str = "UNKNOWN";

/// Which memory a block is, so that nested memory is never summed twice: pool blocks (`PTA`) live
/// inside device segments the runtime took (`HAL`), and host memory is separate. Each family is
/// its own tree.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    /// Device memory the runtime or driver handed out: the device's real footprint.
    Hal,
    /// Framework pool blocks (torch_npu's caching and workspace allocators; also msMemScope's
    /// ATB and MindSpore pools, which Insight groups with them).
    Pta,
    /// Host memory taken through the runtime.
    Host,
}

impl Family {
    pub const ALL: [Family; 3] = [Family::Hal, Family::Pta, Family::Host];

    /// The family of an `Event Type`; `None` for types that are not memory blocks.
    pub fn of(event_type: &str) -> Option<Self> {
        match EventType::parse(event_type) {
            Some(EventType::Hal) => Some(Self::Hal),
            Some(EventType::Pta | EventType::PtaWorkspace | EventType::Mindspore) => Some(Self::Pta),
            Some(EventType::Host | EventType::HostPinned) => Some(Self::Host),
            None if event_type == ATB => Some(Self::Pta),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Hal => EventType::Hal.as_str(),
            Self::Pta => EventType::Pta.as_str(),
            Self::Host => EventType::Host.as_str(),
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

/// `0x...` (msMemScope since 2025-09) or decimal (older files).
pub fn parse_ptr(ptr: &str) -> Option<u64> {
    match ptr.strip_prefix("0x").or_else(|| ptr.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => ptr.parse().ok(),
    }
}

/// A block's identity as Insight pairs MALLOC and FREE: process, `Event Type` (interned by
/// [`EventTypes`]), `Ptr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockKey {
    pub pid: i64,
    pub event_type: u16,
    pub ptr: u64,
}

/// The `Event Type` values met, numbered in order of appearance. A trace has a handful, so a
/// linear search beats hashing the row's text.
#[derive(Clone, Debug, Default)]
pub struct EventTypes(Vec<Box<str>>);

impl EventTypes {
    pub fn id(&mut self, event_type: &str) -> u16 {
        match self.0.iter().position(|t| &**t == event_type) {
            Some(i) => i as u16,
            None => {
                self.0.push(event_type.into());
                (self.0.len() - 1) as u16
            }
        }
    }

    pub fn key(&mut self, row: &DumpRow<'_>, ptr: u64) -> BlockKey {
        BlockKey { pid: row.pid, event_type: self.id(row.event_type), ptr }
    }

    pub fn into_names(self) -> Vec<Box<str>> {
        self.0
    }
}

/// Names (owners) numbered in order of appearance; lookups borrow the row's text, so only a new
/// name allocates.
#[derive(Clone, Debug, Default)]
pub struct Names {
    ids: HashMap<Box<str>, u32>,
    names: Vec<Box<str>>,
}

impl Names {
    /// Starts with `first` as name 0 (inefficient's "no owner").
    pub fn starting_with(first: &str) -> Self {
        let mut names = Self::default();
        names.names.push(first.into());
        names
    }

    /// The name's number, assigned at its first use. `first` of [`Self::starting_with`] is only
    /// a placeholder: looking it up adds it again.
    pub fn id(&mut self, name: &str) -> u32 {
        if let Some(&id) = self.ids.get(name) {
            return id;
        }
        let id = self.names.len() as u32;
        self.names.push(name.into());
        self.ids.insert(name.into(), id);
        id
    }

    pub fn name(&self, id: u32) -> &str {
        &self.names[id as usize]
    }

    pub fn into_names(self) -> Vec<Box<str>> {
        self.names
    }
}

/// Owners per family, numbered across families (a slot is one (family, owner)), as the owner
/// trees and the step timeline count live bytes.
#[derive(Clone, Debug, Default)]
pub struct OwnerSlots {
    slot_of: [HashMap<Box<str>, u32>; 3],
    slots: Vec<(Family, Box<str>)>,
}

impl OwnerSlots {
    /// The slot of `owner` in `family`, and whether it is new.
    pub fn slot(&mut self, family: Family, owner: &str) -> (u32, bool) {
        if let Some(&slot) = self.slot_of[family.index()].get(owner) {
            return (slot, false);
        }
        let slot = self.slots.len() as u32;
        self.slots.push((family, owner.into()));
        self.slot_of[family.index()].insert(owner.into(), slot);
        (slot, true)
    }

    pub fn get(&self, slot: u32) -> (Family, &str) {
        let (family, owner) = &self.slots[slot as usize];
        (*family, owner)
    }

    pub fn family(&self, slot: u32) -> Family {
        self.slots[slot as usize].0
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
}

/// What a FREE row says of itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FreeMark {
    /// A free of a block the trace saw (or should have seen) allocated.
    Plain,
    /// Written at the stop for a block still live: the block was never freed.
    Shadow,
    /// Its block was allocated before the trace: there is nothing to close.
    Unmatched,
}

impl FreeMark {
    /// From the FREE's `shadow` and `unmatched` Attr values (`"true"` marks it; `shadow` wins).
    pub fn of(shadow: Option<&str>, unmatched: Option<&str>) -> Self {
        if shadow == Some("true") {
            Self::Shadow
        } else if unmatched == Some("true") {
            Self::Unmatched
        } else {
            Self::Plain
        }
    }
}

/// The trace's time bounds: `START_TRACE` and `STOP_TRACE` when the rows have them, else the
/// first and last rows the analysis counts (each says which rows those are).
#[derive(Clone, Copy, Debug, Default)]
pub struct Bounds {
    pub start: Option<i64>,
    pub stop: Option<i64>,
    pub first: Option<i64>,
    pub last: Option<i64>,
}

impl Bounds {
    /// A `SYSTEM` row: the first `START_TRACE` and the last `STOP_TRACE` are kept.
    pub fn system(&mut self, event_type: &str, ts: i64) {
        match EventType::parse(event_type) {
            Some(EventType::StartTrace) => {
                self.start.get_or_insert(ts);
            }
            Some(EventType::StopTrace) => self.stop = Some(ts),
            _ => {}
        }
    }

    /// A row that counts towards the first and last instants.
    pub fn seen(&mut self, ts: i64) {
        self.first.get_or_insert(ts);
        self.last = Some(ts);
    }

    /// `START_TRACE`'s timestamp, else the first counted row's.
    pub fn start_ns(&self) -> Option<i64> {
        self.start.or(self.first)
    }

    /// `STOP_TRACE`'s timestamp, else the last counted row's.
    pub fn end_ns(&self) -> Option<i64> {
        self.stop.or(self.last)
    }
}

/// The Attr values the replay itself reads; each analysis's `attr_fields!` struct gives them
/// with whatever else it needs.
pub trait BlockAttr<'a>: Sized + Default {
    fn parse(text: &'a str) -> Option<Self>;
    fn addr(&self) -> Option<&str>;
    fn size(&self) -> Option<&str>;
    /// The bytes a sampled block stands for (`daemon --sample-bytes`), in place of its size in
    /// totals.
    fn weight(&self) -> Option<&str>;
    fn owner(&self) -> Option<&str>;
    fn shadow(&self) -> Option<&str>;
    fn unmatched(&self) -> Option<&str>;
}

/// Implements [`BlockAttr`] for an `attr_fields!` struct with `addr`, `size`, `weight`, `owner`,
/// `shadow` and `unmatched` fields.
macro_rules! block_attr {
    ($name:ident) => {
        impl<'a> $crate::analysis::blocks::BlockAttr<'a> for $name<'a> {
            fn parse(text: &'a str) -> Option<Self> {
                $name::parse(text)
            }
            fn addr(&self) -> Option<&str> {
                self.addr.as_deref()
            }
            fn size(&self) -> Option<&str> {
                self.size.as_deref()
            }
            fn weight(&self) -> Option<&str> {
                self.weight.as_deref()
            }
            fn owner(&self) -> Option<&str> {
                self.owner.as_deref()
            }
            fn shadow(&self) -> Option<&str> {
                self.shadow.as_deref()
            }
            fn unmatched(&self) -> Option<&str> {
                self.unmatched.as_deref()
            }
        }
    };
}
pub(crate) use block_attr;

/// An analysis's own metrics on the blocks [`BlockReplay`] pairs. The counters default to
/// nothing, for analyses that do not report them; every hook gets the row it is about.
pub trait BlockHooks {
    /// What the analysis keeps of a live block (small: it is copied into and out of the map).
    type Block: Copy;
    type Attr<'a>: BlockAttr<'a>;

    /// Whether a `shadow` FREE ends its block ([`Self::shadow_end`]). For analyses of what was
    /// live at the stop (decompose, the step timeline) it does not: the block stays live to the
    /// end. For an analysis of time (inefficient) it does: the block's life ends at the shadow
    /// FREE's instant, and no later row can reach it.
    const SHADOW_ENDS_BLOCK: bool = false;

    /// Whether a sampled block opens with its `weight` (the bytes it stands for) as its size:
    /// right for totals (owners, steps), wrong for what an analysis says of one block.
    const WEIGHTED: bool = true;

    /// Whether a FREE's Attr can go unread: an analysis that needs only the marks of a FREE can
    /// tell from the text that it has none (half the rows are FREEs).
    fn skip_free_attr(&self, _attr: &str) -> bool {
        false
    }
    /// A MALLOC or FREE of an `Event Type` that is no block family: not the replay's.
    fn not_a_block(&mut self, _row: &DumpRow<'_>) {}
    /// A MALLOC whose Attr reads, before anything about it is checked.
    fn malloc_read(&mut self, _row: &DumpRow<'_>, _attr: &Self::Attr<'_>) {}
    /// A memory row whose Attr is not a JSON object, or that has no address.
    fn unreadable(&mut self) {}
    /// A `shadow` FREE (whether or not a block is live at its key).
    fn shadow_free(&mut self) {}
    /// A `shadow` FREE ended the block ([`Self::SHADOW_ENDS_BLOCK`] only).
    fn shadow_end(&mut self, _row: &DumpRow<'_>, _key: BlockKey, _block: Self::Block) {}
    fn unmatched_free(&mut self, _row: &DumpRow<'_>, _attr: &Self::Attr<'_>) {}
    /// A FREE with no live block at its key (and not marked `unmatched`).
    fn orphan_free(&mut self, _row: &DumpRow<'_>, _attr: &Self::Attr<'_>) {}
    /// A MALLOC without a positive `size`.
    fn no_size(&mut self) {}
    /// A memory row that is not a shadow FREE: the instant is part of the trace's memory.
    fn seen(&mut self, _ts: i64) {}
    /// A MALLOC of `size` bytes by `owner` (the Attr's, else [`UNKNOWN_OWNER`]) opens the block
    /// at `key`.
    fn open(
        &mut self,
        row: &DumpRow<'_>,
        key: BlockKey,
        family: Family,
        owner: &str,
        size: i64,
        attr: &Self::Attr<'_>,
    ) -> Self::Block;
    /// The block is live (after `realloc` of the one it replaced, if any).
    fn opened(&mut self, _row: &DumpRow<'_>, _block: &Self::Block) {}
    /// A MALLOC at the key of a live block: the earlier one ends at `row`.
    fn realloc(&mut self, row: &DumpRow<'_>, key: BlockKey, old: Self::Block);
    /// A FREE closed the block.
    fn free(&mut self, row: &DumpRow<'_>, key: BlockKey, block: Self::Block, attr: &Self::Attr<'_>);
}

/// The live blocks of a replay, paired by the rule of the module doc.
pub struct BlockReplay<B> {
    types: EventTypes,
    live: HashMap<BlockKey, B>,
}

impl<B> Default for BlockReplay<B> {
    fn default() -> Self {
        Self { types: EventTypes::default(), live: HashMap::default() }
    }
}

impl<B: Copy> BlockReplay<B> {
    /// Applies a `MALLOC` or `FREE` row (others are ignored) to the live blocks and the hooks.
    pub fn apply<H: BlockHooks<Block = B>>(&mut self, hooks: &mut H, row: &DumpRow<'_>) {
        let is_free = match Event::parse(row.event) {
            Some(Event::Malloc) => false,
            Some(Event::Free) => true,
            _ => return,
        };
        let Some(family) = Family::of(row.event_type) else {
            hooks.not_a_block(row);
            return;
        };
        let row_ptr = parse_ptr(row.ptr);
        let attr = if is_free && row_ptr.is_some() && hooks.skip_free_attr(row.attr) {
            H::Attr::default()
        } else {
            let Some(attr) = H::Attr::parse(row.attr) else {
                hooks.unreadable();
                return;
            };
            attr
        };
        if !is_free {
            hooks.malloc_read(row, &attr);
        }
        let mark = if is_free { FreeMark::of(attr.shadow(), attr.unmatched()) } else { FreeMark::Plain };
        if mark != FreeMark::Shadow {
            hooks.seen(row.ts);
        }
        let Some(ptr) = row_ptr.or_else(|| attr.addr().and_then(parse_ptr)) else {
            hooks.unreadable();
            return;
        };
        let key = self.types.key(row, ptr);
        match mark {
            FreeMark::Shadow => self.shadow(hooks, row, key),
            FreeMark::Unmatched => hooks.unmatched_free(row, &attr),
            FreeMark::Plain if is_free => match self.live.remove(&key) {
                Some(block) => hooks.free(row, key, block, &attr),
                None => hooks.orphan_free(row, &attr),
            },
            FreeMark::Plain => self.malloc(hooks, row, key, family, &attr),
        }
    }

    fn shadow<H: BlockHooks<Block = B>>(&mut self, hooks: &mut H, row: &DumpRow<'_>, key: BlockKey) {
        hooks.shadow_free();
        if H::SHADOW_ENDS_BLOCK {
            if let Some(block) = self.live.remove(&key) {
                hooks.shadow_end(row, key, block);
            }
        }
    }

    fn malloc<H: BlockHooks<Block = B>>(
        &mut self,
        hooks: &mut H,
        row: &DumpRow<'_>,
        key: BlockKey,
        family: Family,
        attr: &H::Attr<'_>,
    ) {
        let Some(size) = attr.size().and_then(|s| s.trim().parse::<i64>().ok()).filter(|&s| s > 0) else {
            hooks.no_size();
            return;
        };
        let weight = if H::WEIGHTED { attr.weight().and_then(|w| w.trim().parse::<i64>().ok()) } else { None };
        let size = weight.filter(|&w| w > 0).unwrap_or(size);
        let owner = attr.owner().filter(|o| !o.is_empty()).unwrap_or(UNKNOWN_OWNER);
        let block = hooks.open(row, key, family, owner, size, attr);
        if let Some(old) = self.live.insert(key, block) {
            hooks.realloc(row, key, old);
        }
        hooks.opened(row, &block);
    }

    /// The blocks still live, in no particular order; the replay is empty after.
    pub fn drain(&mut self) -> impl Iterator<Item = (BlockKey, B)> + '_ {
        self.live.drain()
    }

    pub fn live(&self) -> usize {
        self.live.len()
    }

    /// The `Event Type` names, by the numbers in [`BlockKey::event_type`].
    pub fn into_event_types(self) -> Vec<Box<str>> {
        self.types.into_names()
    }
}

#[cfg(test)]
mod tests {
    //! The rule as docs/db-schema.md states it, on rows built by hand: the expectations are the
    //! document's, not read off the code.

    use super::*;
    use crate::analysis::attr::attr_fields;

    attr_fields! {
        struct Fields { addr, size, weight, owner, shadow, unmatched }
    }
    block_attr!(Fields);

    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    struct Opened {
        owner: u32,
        size: i64,
        ts: i64,
    }

    /// Records what the replay decided, in order.
    #[derive(Default)]
    struct Log {
        owners: Names,
        events: Vec<String>,
        seen: Vec<i64>,
    }

    impl BlockHooks for Log {
        type Block = Opened;
        type Attr<'a> = Fields<'a>;

        fn unreadable(&mut self) {
            self.events.push("unreadable".into());
        }
        fn shadow_free(&mut self) {
            self.events.push("shadow".into());
        }
        fn unmatched_free(&mut self, _: &DumpRow<'_>, _: &Fields<'_>) {
            self.events.push("unmatched".into());
        }
        fn orphan_free(&mut self, _: &DumpRow<'_>, _: &Fields<'_>) {
            self.events.push("orphan".into());
        }
        fn no_size(&mut self) {
            self.events.push("no size".into());
        }
        fn seen(&mut self, ts: i64) {
            self.seen.push(ts);
        }
        fn open(
            &mut self,
            row: &DumpRow<'_>,
            _: BlockKey,
            _: Family,
            owner: &str,
            size: i64,
            _: &Fields<'_>,
        ) -> Opened {
            Opened { owner: self.owners.id(owner), size, ts: row.ts }
        }
        fn opened(&mut self, _: &DumpRow<'_>, b: &Opened) {
            self.events.push(format!("open {} {}", self.owners.name(b.owner), b.size));
        }
        fn realloc(&mut self, row: &DumpRow<'_>, key: BlockKey, old: Opened) {
            self.events.push(format!("realloc {:#x} of {} at {}", key.ptr, old.size, row.ts));
        }
        fn free(&mut self, row: &DumpRow<'_>, key: BlockKey, b: Opened, _: &Fields<'_>) {
            self.events.push(format!("free {:#x} pid {} of {} from {} at {}", key.ptr, key.pid, b.size, b.ts, row.ts));
        }
    }

    fn row<'a>(event: &'a str, event_type: &'a str, ts: i64, pid: i64, ptr: &'a str, attr: &'a str) -> DumpRow<'a> {
        DumpRow { rowid: ts, id: ts, event, event_type, ts, pid, tid: pid, ptr, attr, name: "" }
    }

    fn replay(rows: &[DumpRow<'_>]) -> (Log, usize) {
        let mut log = Log::default();
        let mut blocks = BlockReplay::default();
        for r in rows {
            blocks.apply(&mut log, r);
        }
        let live = blocks.live();
        (log, live)
    }

    #[test]
    fn a_free_closes_the_malloc_of_the_same_process_type_and_ptr() {
        let (log, live) = replay(&[
            row("MALLOC", "PTA", 1, 1, "0x10", r#"{"size":"100","owner":"PTA@w"}"#),
            row("MALLOC", "PTA_WORKSPACE", 2, 1, "0x10", r#"{"size":"20"}"#),
            row("MALLOC", "PTA", 3, 2, "0x10", r#"{"size":"40"}"#),
            row("FREE", "PTA", 4, 1, "0x10", r#"{"size":"100"}"#),
            // Decimal Ptr (older msMemScope files) is the same address.
            row("FREE", "PTA", 5, 2, "16", r#"{}"#),
        ]);
        assert_eq!(
            log.events,
            [
                "open PTA@w 100",
                "open UNKNOWN 20",
                "open UNKNOWN 40",
                "free 0x10 pid 1 of 100 from 1 at 4",
                "free 0x10 pid 2 of 40 from 3 at 5"
            ]
        );
        assert_eq!(live, 1, "the PTA_WORKSPACE block is another key: still live");
    }

    /// docs/db-schema.md: a sampled row's `weight` is the bytes it stands for in totals.
    #[test]
    fn a_sampled_malloc_opens_with_its_weight_and_an_exact_one_with_its_size() {
        let (log, _) = replay(&[
            row("MALLOC", "PTA", 1, 1, "0x10", r#"{"size":"100","weight":"524288"}"#),
            row("MALLOC", "PTA", 2, 1, "0x20", r#"{"size":"100"}"#),
            row("MALLOC", "PTA", 3, 1, "0x30", r#"{"size":"100","weight":"no"}"#),
        ]);
        assert_eq!(log.events, ["open UNKNOWN 524288", "open UNKNOWN 100", "open UNKNOWN 100"]);
    }

    #[test]
    fn a_free_without_malloc_closes_nothing() {
        let (log, live) = replay(&[
            row("MALLOC", "HAL", 1, 1, "0x1", r#"{"size":"8"}"#),
            row("FREE", "HAL", 2, 1, "0x2", r#"{}"#),
            // Same address, other layer: not this block's FREE.
            row("FREE", "PTA", 3, 1, "0x1", r#"{}"#),
        ]);
        assert_eq!(log.events, ["open UNKNOWN 8", "orphan", "orphan"]);
        assert_eq!(live, 1);
    }

    #[test]
    fn a_malloc_twice_at_one_key_ends_the_first_block() {
        let (log, live) = replay(&[
            row("MALLOC", "PTA", 1, 1, "0x5", r#"{"size":"1"}"#),
            row("MALLOC", "PTA", 2, 1, "0x5", r#"{"size":"2"}"#),
            row("FREE", "PTA", 3, 1, "0x5", r#"{}"#),
            row("FREE", "PTA", 4, 1, "0x5", r#"{}"#),
        ]);
        assert_eq!(
            log.events,
            ["open UNKNOWN 1", "realloc 0x5 of 1 at 2", "open UNKNOWN 2", "free 0x5 pid 1 of 2 from 2 at 3", "orphan"]
        );
        assert_eq!(live, 0);
    }

    #[test]
    fn shadow_frees_are_not_frees_and_unmatched_frees_close_nothing() {
        let (log, live) = replay(&[
            row("MALLOC", "HAL", 1, 1, "0x1", r#"{"size":"100"}"#),
            // Address reuse after a block from before the trace was freed: the live one stays.
            row("FREE", "HAL", 2, 1, "0x1", r#"{"unmatched":"true"}"#),
            row("SYSTEM", "STOP_TRACE", 9, 1, "N/A", r#"{}"#),
            row("FREE", "HAL", 10, 1, "0x1", r#"{"shadow":"true"}"#),
        ]);
        assert_eq!(log.events, ["open UNKNOWN 100", "unmatched", "shadow"]);
        assert_eq!(live, 1, "a block with only a shadow FREE was live at the stop");
        assert_eq!(log.seen, [1, 2], "a shadow FREE's instant is after the trace's memory");
    }

    #[test]
    fn mallocs_need_a_positive_string_size_and_rows_an_address() {
        let (log, live) = replay(&[
            row("MALLOC", "HAL", 1, 1, "0x1", r#"{"size":"0"}"#),
            row("MALLOC", "HAL", 2, 1, "0x2", r#"{"size":77}"#),
            row("MALLOC", "HAL", 3, 1, "N/A", r#"{"size":"5"}"#),
            row("MALLOC", "HAL", 4, 1, "0x4", "not json"),
            row("MALLOC", "ACCESS", 5, 1, "0x5", r#"{"size":"5"}"#),
            row("MALLOC", "HAL", 6, 1, "0x6", r#"{"size":"5","owner":""}"#),
        ]);
        assert_eq!(log.events, ["no size", "no size", "unreadable", "unreadable", "open UNKNOWN 5"]);
        assert_eq!(live, 1);
    }

    #[test]
    fn a_row_without_ptr_takes_its_attr_addr_and_one_without_either_is_unreadable_whatever_its_marks() {
        let (log, live) = replay(&[
            row("MALLOC", "HAL", 1, 1, "N/A", r#"{"size":"8","addr":"0x40"}"#),
            row("FREE", "HAL", 2, 1, "0x40", r#"{}"#),
            row("FREE", "HAL", 3, 1, "N/A", r#"{"shadow":"true"}"#),
            row("FREE", "HAL", 4, 1, "N/A", r#"{"unmatched":"true"}"#),
        ]);
        assert_eq!(log.events, ["open UNKNOWN 8", "free 0x40 pid 1 of 8 from 1 at 2", "unreadable", "unreadable"]);
        assert_eq!(live, 0);
    }

    /// The same hooks, for an analysis of time: a shadow FREE ends its block there.
    struct Timed(Log);

    impl BlockHooks for Timed {
        type Block = Opened;
        type Attr<'a> = Fields<'a>;
        const SHADOW_ENDS_BLOCK: bool = true;

        fn not_a_block(&mut self, row: &DumpRow<'_>) {
            self.0.events.push(format!("not a block: {}", row.event_type));
        }
        fn malloc_read(&mut self, row: &DumpRow<'_>, _: &Fields<'_>) {
            self.0.events.push(format!("read {}", row.ts));
        }
        fn shadow_free(&mut self) {
            self.0.shadow_free();
        }
        fn shadow_end(&mut self, row: &DumpRow<'_>, key: BlockKey, b: Opened) {
            self.0.events.push(format!("shadow end {:#x} of {} at {}", key.ptr, b.size, row.ts));
        }
        fn no_size(&mut self) {
            self.0.no_size();
        }
        fn open(&mut self, row: &DumpRow<'_>, k: BlockKey, f: Family, o: &str, size: i64, a: &Fields<'_>) -> Opened {
            self.0.open(row, k, f, o, size, a)
        }
        fn realloc(&mut self, row: &DumpRow<'_>, key: BlockKey, old: Opened) {
            self.0.realloc(row, key, old);
        }
        fn free(&mut self, row: &DumpRow<'_>, key: BlockKey, b: Opened, a: &Fields<'_>) {
            self.0.free(row, key, b, a);
        }
    }

    #[test]
    fn an_analysis_of_time_ends_a_block_at_its_shadow_free_and_sees_every_malloc_read() {
        let mut timed = Timed(Log::default());
        let mut blocks = BlockReplay::default();
        for r in [
            row("MALLOC", "HAL", 1, 1, "0x1", r#"{"size":"100"}"#),
            row("MALLOC", "HAL", 2, 1, "0x2", r#"{}"#),
            row("MALLOC", "READ", 3, 1, "0x3", r#"{"size":"5"}"#),
            row("FREE", "HAL", 9, 1, "0x1", r#"{"shadow":"true"}"#),
            row("FREE", "HAL", 10, 1, "0x1", r#"{}"#),
        ] {
            blocks.apply(&mut timed, &r);
        }
        assert_eq!(
            timed.0.events,
            ["read 1", "read 2", "no size", "not a block: READ", "shadow", "shadow end 0x1 of 100 at 9"],
            "after its shadow FREE the block is gone: the FREE after it finds nothing"
        );
        assert_eq!(blocks.live(), 0);
    }

    #[test]
    fn bounds_prefer_the_trace_rows() {
        let mut b = Bounds::default();
        assert_eq!((b.start_ns(), b.end_ns()), (None, None));
        b.seen(5);
        b.seen(7);
        assert_eq!((b.start_ns(), b.end_ns()), (Some(5), Some(7)));
        b.system("START_TRACE", 3);
        b.system("START_TRACE", 4);
        b.system("STOP_TRACE", 9);
        assert_eq!((b.start_ns(), b.end_ns()), (Some(3), Some(9)));
    }

    #[test]
    fn families_nest_pool_blocks_apart_from_device_and_host_memory() {
        assert_eq!(Family::of("HAL"), Some(Family::Hal));
        for pool in ["PTA", "PTA_WORKSPACE", "ATB", "MINDSPORE"] {
            assert_eq!(Family::of(pool), Some(Family::Pta), "{pool}");
        }
        assert_eq!(Family::of("HOST"), Some(Family::Host));
        assert_eq!(Family::of("HOST_PINNED"), Some(Family::Host));
        assert_eq!(Family::of("READ"), None);
    }
}
