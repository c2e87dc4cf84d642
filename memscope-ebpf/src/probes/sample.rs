//! Sampling by bytes (`memscope-bpf daemon --sample-bytes`) and the exact counters kept beside
//! it: the kernel half of `memscope_common::sampling`.
//!
//! A sampled API's call is decided at entry, from the bytes it asks for, so that a call not
//! recorded pays for no stack capture either; at return it is counted in any case. Counting
//! needs each block's size at its free (pool frees carry none), so every block of a sampled API
//! is kept in [`BLOCKS`] until then; the verdict kept with it says whether the free is recorded.
//!
//! Unless every call is sent anyway ([`window_all`], the daemon's flight recorder): then
//! userspace sees every block and counts them itself, so the kernel keeps nothing. The block
//! map was most of a sampled call's cost here (an insert took ~500 ns of the ~1.2 µs an
//! allocation's return probe ran, measured with `kernel.bpf_stats_enabled` on the pool loop),
//! more than the record it saved.
//! The counters are shared by every CPU, so they are updated with atomic adds and the peak with
//! a compare-and-swap: a per-CPU copy would sum to the right live bytes but never to the peak.

use aya_ebpf::{
    bindings::{BPF_F_NO_COMMON_LRU, BPF_NOEXIST},
    helpers::bpf_get_prandom_u32,
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray},
    Global,
};
use memscope_common::{
    record::MAX_ARGS,
    sampling::{weigh, BlockKey, CountedBlock, CounterKey, Counters, GAP_TABLE_LEN, SKIP, UNJUDGED},
    spec::{sample_kind, value_at, SampleRule, MAX_FIELDS},
};

/// The mean gap between sample points in bytes; 0 records every call (`trace`).
#[no_mangle]
static SAMPLE_INTERVAL: Global<u64> = Global::new(0);

/// 1: the calls sampling leaves out are sent all the same, marked
/// [`memscope_common::sampling::WINDOW_ONLY`], for the daemon's flight recorder.
#[no_mangle]
static WINDOW_ALL: Global<u8> = Global::new(0);

/// Exponential gaps with the interval's mean, filled by userspace before anything is attached.
#[map]
static GAPS: Array<u64> = Array::with_max_entries(GAP_TABLE_LEN, 0);

/// Bytes to this CPU's next sample point (0: none drawn yet).
#[map]
static COUNTDOWN: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// Every live block of a sampled API, until its free. Sized by userspace (`--max-blocks`) and
/// LRU: the blocks of a process that exited are the ones to lose. Per-CPU LRU lists: the shared
/// list's lock is taken by every insert, on the allocation path of every traced thread.
#[map]
pub static BLOCKS: LruHashMap<BlockKey, CountedBlock> = LruHashMap::with_max_entries(1, BPF_F_NO_COMMON_LRU);

/// The exact counters, by process, device and class; userspace removes a process's at its exit.
#[map]
pub static COUNTERS: HashMap<CounterKey, Counters> = HashMap::with_max_entries(4096, 0);

pub fn enabled() -> bool {
    SAMPLE_INTERVAL.load() != 0
}

/// Whether a call sampling left out is sent for the flight recorder's window.
pub fn window_all() -> bool {
    WINDOW_ALL.load() != 0
}

/// A rule's value: an argument, a field read that succeeded, or the return value.
#[inline(always)]
fn value(at: [u8; 2], args: &[u64; MAX_ARGS], fields: &[u64; MAX_FIELDS], fields_ok: u32, ret: u64) -> Option<u64> {
    const _: () = assert!(MAX_FIELDS == 4, "one arm per field below");
    let i = at[1] as usize;
    match at[0] {
        // A match per index, as `nonzero_arg`: constant offsets need no bounds tracking.
        value_at::ARG => match i {
            0 => Some(args[0]),
            1 => Some(args[1]),
            2 => Some(args[2]),
            3 => Some(args[3]),
            4 => Some(args[4]),
            5 => Some(args[5]),
            _ => None,
        },
        value_at::FIELD => {
            let value = match i {
                0 => fields[0],
                1 => fields[1],
                2 => fields[2],
                3 => fields[3],
                _ => return None,
            };
            (fields_ok & (1 << i) != 0).then_some(value)
        }
        value_at::RET => Some(ret),
        _ => None,
    }
}

fn gap() -> u64 {
    // SAFETY: helper without arguments.
    let i = unsafe { bpf_get_prandom_u32() } & (GAP_TABLE_LEN - 1);
    GAPS.get(i).copied().unwrap_or(1)
}

/// Whether a call with this verdict gets its stacks captured: a sampled-out call's are not
/// worth their cost, nor an unjudged free's (most frees are of blocks sampling left out).
pub fn wants_stacks(verdict: u32) -> bool {
    verdict != SKIP && verdict != UNJUDGED
}

/// The verdict at a sampled API's entry, kept in its open slot: 0 (recorded in full), the
/// sample points in its bytes, [`SKIP`], or for a free under [`window_all`], [`UNJUDGED`]. A free is counted here, while its block's key is at
/// hand.
#[inline(always)]
pub fn at_entry(rule: &SampleRule, tgid: u32, args: &[u64; MAX_ARGS], fields: &[u64; MAX_FIELDS], ok: u32) -> u32 {
    if rule.kind == sample_kind::NONE || !enabled() {
        return 0;
    }
    if rule.kind == sample_kind::FREE {
        if window_all() {
            return UNJUDGED;
        }
        return match value(rule.ptr, args, fields, ok, 0) {
            Some(ptr) if ptr != 0 => free(tgid, ptr, rule.class),
            _ => SKIP,
        };
    }
    let Some(request) = value(rule.request, args, fields, ok, 0) else { return 0 };
    let interval = SAMPLE_INTERVAL.load();
    let Some(countdown) = COUNTDOWN.get_ptr_mut(0) else { return 0 };
    // SAFETY: this CPU's slot; a probe runs to its end on one CPU.
    let weight = weigh(unsafe { &mut *countdown }, request, interval, gap);
    if weight == 0 {
        SKIP
    } else if request >= interval {
        0
    } else {
        (weight / interval) as u32
    }
}

/// Counts a returning call of a sampled API; whether its record is sent. An allocation that
/// failed (no address) is always recorded: out-of-memory is never sampled out.
#[inline(always)]
pub fn at_exit(rule: &SampleRule, verdict: u32, pid_tgid: u64, values: Values<'_>, thread_device: i32) -> bool {
    if rule.kind == sample_kind::NONE || !enabled() {
        return true;
    }
    if rule.kind == sample_kind::FREE {
        return verdict != SKIP;
    }
    let Values { args, fields, ok, ret } = values;
    let ptr = value(rule.ptr, args, fields, ok, ret).unwrap_or(0);
    if ptr == 0 {
        return true;
    }
    let size = value(rule.size, args, fields, ok, ret).or_else(|| value(rule.request, args, fields, ok, ret));
    let device = match value(rule.device, args, fields, ok, ret) {
        Some(d) => d as i32,
        None if rule.device_else[0] == value_at::THREAD_DEVICE => thread_device,
        None => value(rule.device_else, args, fields, ok, ret).map_or(-1, |d| d as i32),
    };
    if window_all() {
        // Userspace follows every block (see the module's doc).
        return verdict != SKIP;
    }
    let tgid = (pid_tgid >> 32) as u32;
    let key = BlockKey { tgid, _pad: 0, ptr };
    let recorded = u8::from(verdict != SKIP);
    let block = CountedBlock { size: size.unwrap_or(0), device, class: rule.class, recorded, _pad: 0 };
    // One hash operation in the usual case; only an address already held is looked up.
    if BLOCKS.insert(&key, &block, BPF_NOEXIST.into()).is_err() {
        // SAFETY: a plain value copied out of the map.
        if let Some(old) = unsafe { BLOCKS.get(&key) }.copied() {
            // An address handed out again before its free was seen: that block is gone.
            count(tgid, old.device, old.class, old.size, false);
        }
        let _ = BLOCKS.insert(&key, &block, 0);
    }
    count(tgid, device, rule.class, block.size, true);
    verdict != SKIP
}

/// A call's values at return, bundled: BPF functions take five arguments at most.
#[derive(Clone, Copy)]
pub struct Values<'a> {
    pub args: &'a [u64; MAX_ARGS],
    pub fields: &'a [u64; MAX_FIELDS],
    pub ok: u32,
    pub ret: u64,
}

fn free(tgid: u32, ptr: u64, class: u8) -> u32 {
    let key = BlockKey { tgid, _pad: 0, ptr };
    // SAFETY: a plain value copied out of the map.
    let Some(block) = (unsafe { BLOCKS.get(&key) }).copied() else {
        if let Some(c) = counters(tgid, -1, class) {
            // SAFETY: a map value; every writer adds atomically.
            unsafe { add(&raw mut (*c).untracked_frees, 1) };
        }
        return SKIP;
    };
    let _ = BLOCKS.remove(&key);
    count(tgid, block.device, block.class, block.size, false);
    if block.recorded == 1 {
        0
    } else {
        SKIP
    }
}

fn counters(tgid: u32, device: i32, class: u8) -> Option<*mut Counters> {
    let key = CounterKey { tgid, device, class: u32::from(class), _pad: 0 };
    if let Some(c) = COUNTERS.get_ptr_mut(&key) {
        return Some(c);
    }
    // Another CPU may have created it meanwhile: then this insert fails and the lookup finds it.
    let _ = COUNTERS.insert(&key, &Counters::default(), BPF_NOEXIST.into());
    COUNTERS.get_ptr_mut(&key)
}

/// Adds `n` to `*at` atomically (its result is not the value before on BPF: see [`count`]).
///
/// # Safety
/// `at` points into a map value that lives as long as the program runs.
#[cfg(target_arch = "bpf")]
unsafe fn add(at: *mut u64, n: u64) {
    use core::intrinsics::{atomic_xadd, AtomicOrdering};
    // SAFETY: per the caller; 8-byte aligned (the map value is).
    unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(at, n) };
}

/// Replaces `*at` by `new` if it is `old`; the value found.
///
/// # Safety
/// As [`add`].
#[cfg(target_arch = "bpf")]
unsafe fn swap_if(at: *mut u64, old: u64, new: u64) -> u64 {
    use core::intrinsics::{atomic_cxchg, AtomicOrdering};
    // SAFETY: as `add`.
    unsafe { atomic_cxchg::<u64, { AtomicOrdering::Relaxed }, { AtomicOrdering::Relaxed }>(at, old, new) }.0
}

// A host build (clippy on the workspace) has the atomics of `core`.
#[cfg(not(target_arch = "bpf"))]
unsafe fn add(at: *mut u64, n: u64) {
    // SAFETY: as above.
    unsafe { core::sync::atomic::AtomicU64::from_ptr(at) }.fetch_add(n, core::sync::atomic::Ordering::Relaxed);
}

#[cfg(not(target_arch = "bpf"))]
unsafe fn swap_if(at: *mut u64, old: u64, new: u64) -> u64 {
    use core::sync::atomic::{AtomicU64, Ordering::Relaxed};
    // SAFETY: as above.
    unsafe { AtomicU64::from_ptr(at) }.compare_exchange(old, new, Relaxed, Relaxed).unwrap_or_else(|v| v)
}

fn count(tgid: u32, device: i32, class: u8, size: u64, alloc: bool) {
    let Some(c) = counters(tgid, device, class) else { return };
    // SAFETY: a map value; every writer goes through atomics.
    unsafe {
        if !alloc {
            add(&raw mut (*c).live, size.wrapping_neg());
            add(&raw mut (*c).frees, 1);
            return;
        }
        add(&raw mut (*c).allocs, 1);
        // The new live bytes, for the peak: LLVM lowers a 64-bit fetch-add whose result is used
        // to a plain atomic add here (checked with llvm-objdump), so the sum comes from a
        // compare-and-swap instead. Should it lose 8 races in a row, the add still happens and
        // only this allocation's peak check is skipped.
        let live_at = &raw mut (*c).live;
        let mut live = 0;
        for _ in 0..8 {
            let before = core::ptr::read_volatile(live_at);
            if swap_if(live_at, before, before.wrapping_add(size)) == before {
                live = before.wrapping_add(size);
                break;
            }
        }
        if live == 0 {
            add(live_at, size);
            return;
        }
        let peak = &raw mut (*c).peak;
        let mut seen = core::ptr::read_volatile(peak);
        // Bounded for the verifier; losing four races in a row to larger values leaves a peak
        // no smaller than theirs.
        for _ in 0..4 {
            if live <= seen {
                break;
            }
            let found = swap_if(peak, seen, live);
            if found == seen {
                break;
            }
            seen = found;
        }
    }
}
