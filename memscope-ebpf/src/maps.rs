//! Maps shared by the probes and userspace, and the one way records leave the kernel.

use aya_ebpf::{
    bindings::{BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP},
    helpers::bpf_ktime_get_ns,
    macros::map,
    maps::{ring_buf::RingBufEntry, Array, HashMap, PerCpuArray, RingBuf},
    Global,
};
use memscope_common::spec::{ProbeSpec, MAX_SPECS};

/// All records, for every CPU. Userspace sizes it at load time (`--ring-size`).
#[map]
pub static EVENTS: RingBuf = RingBuf::with_byte_size(16 * 1024 * 1024, 0);

/// Records that did not fit in [`EVENTS`], counted per CPU so the count needs no atomics.
#[map]
pub static DROPS: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// Processes (tgids) whose calls are recorded. Following forks also inserts new tasks (processes
/// and threads alike: the tracepoint cannot tell them apart, and thread keys are harmless).
#[map]
pub static TRACED: HashMap<u32, u32> = HashMap::with_max_entries(8192, 0);

/// The capture rules per attach cookie, written by userspace before anything is attached.
#[map]
pub static SPECS: Array<ProbeSpec> = Array::with_max_entries(MAX_SPECS, 0);

/// Wake the consumer only once this many bytes are waiting; it also drains on a timer. Waking on
/// every record costs about 1 us per event (toolchain recipe, pitfall 4).
#[no_mangle]
static WAKEUP_BYTES: Global<u64> = Global::new(1024 * 1024);

/// Past the threshold, wake at most this often per CPU. Without the limit a consumer that falls
/// behind makes every record pay a wakeup (measured: +1.3 us per event), which slows the
/// producer exactly when the consumer needs it not to.
const WAKEUP_INTERVAL_NS: u64 = 1_000_000;

/// When this CPU last forced a wakeup (ktime ns).
#[map]
static LAST_WAKEUP: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// Whether the traced set grows with fork (the default; `--no-follow` turns it off).
#[no_mangle]
static FOLLOW_FORKS: Global<u32> = Global::new(0);

pub fn follow_forks() -> bool {
    FOLLOW_FORKS.load() != 0
}

/// The process the trace started with; checked before the [`TRACED`] map because it is the one
/// almost every event comes from, and a compare is cheaper than a hash lookup.
#[no_mangle]
static TARGET_TGID: Global<u32> = Global::new(0);

pub fn is_traced(tgid: u32) -> bool {
    // SAFETY: the value is a plain u32 that is only read.
    tgid == TARGET_TGID.load() || unsafe { TRACED.get(tgid) }.is_some()
}

/// Reserves a record in the ring buffer, counting a drop when it is full.
pub fn reserve<T: 'static>() -> Option<RingBufEntry<T>> {
    let entry = EVENTS.reserve::<T>(0);
    if entry.is_none() {
        if let Some(count) = DROPS.get_ptr_mut(0) {
            // SAFETY: per-CPU slot, no concurrent writer on this CPU.
            unsafe { *count += 1 };
        }
    }
    entry
}

/// Publishes a reserved record, waking the consumer only past the threshold.
pub fn submit<T>(entry: RingBufEntry<T>) {
    let flags = if EVENTS.query(BPF_RB_AVAIL_DATA.into()) >= WAKEUP_BYTES.load() && wakeup_due() {
        BPF_RB_FORCE_WAKEUP
    } else {
        BPF_RB_NO_WAKEUP
    };
    entry.submit(flags.into());
}

/// Copies `bytes` (a record built in scratch memory, of a length known only at run time) to the
/// ring buffer, counting a drop when it is full.
pub fn output_bytes(bytes: &[u8]) {
    let flags = if EVENTS.query(BPF_RB_AVAIL_DATA.into()) >= WAKEUP_BYTES.load() && wakeup_due() {
        BPF_RB_FORCE_WAKEUP
    } else {
        BPF_RB_NO_WAKEUP
    };
    if EVENTS.output::<[u8]>(bytes, flags.into()).is_err() {
        if let Some(count) = DROPS.get_ptr_mut(0) {
            // SAFETY: per-CPU slot, no concurrent writer on this CPU.
            unsafe { *count += 1 };
        }
    }
}

/// Writes a small `record` (built on the stack) to the ring buffer.
pub fn output<T: Copy + 'static>(record: &T) {
    if let Some(mut entry) = reserve::<T>() {
        entry.write(*record);
        submit(entry);
    }
}

/// Whether this CPU may force a wakeup now (and records that it does).
fn wakeup_due() -> bool {
    let Some(last) = LAST_WAKEUP.get_ptr_mut(0) else { return true };
    // SAFETY: helper without arguments; per-CPU slot with no concurrent writer on this CPU.
    let now = unsafe { bpf_ktime_get_ns() };
    unsafe {
        if now.wrapping_sub(*last) < WAKEUP_INTERVAL_NS {
            return false;
        }
        *last = now;
    }
    true
}
