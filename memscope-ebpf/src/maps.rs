//! Maps shared by the probes and userspace, and the one way records leave the kernel.

use aya_ebpf::{
    bindings::{BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP},
    helpers::bpf_ktime_get_ns,
    macros::map,
    maps::{ring_buf::RingBufEntry, Array, HashMap, LruHashMap, PerCpuArray, RingBuf},
    Global,
};
use memscope_common::filter::{CgroupRule, COMM_LEN, MAX_CGROUP_RULES};
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

/// Whether every process that calls a probed function is traced unless a rule denies it
/// (`memscope-bpf daemon`; see `memscope_common::filter`).
#[no_mangle]
static ADMIT_ANY: Global<u32> = Global::new(0);

pub fn admit_any() -> bool {
    ADMIT_ANY.load() != 0
}

/// Processes the daemon does not trace: denied by name at exec or by userspace (its scan of the
/// processes already running, `--exclude-pid`), or outside every `--cgroup`. LRU: an entry of a
/// process that is gone is the one to lose.
#[map]
pub static DENIED: LruHashMap<u32, u32> = LruHashMap::with_max_entries(16384, 0);

/// Command names (`--exclude-comm`) checked at exec.
#[map]
pub static DENY_COMM: HashMap<[u8; COMM_LEN], u32> = HashMap::with_max_entries(64, 0);

/// Command names (`--comm`) a process must exec under to be traced, when
/// [`ALLOW_COMM_RULES`] says there are any.
#[map]
pub static ALLOW_COMM: HashMap<[u8; COMM_LEN], u32> = HashMap::with_max_entries(64, 0);

#[no_mangle]
static ALLOW_COMM_RULES: Global<u32> = Global::new(0);

/// `--cgroup` rules; the first [`CGROUP_RULES`] entries are in use (none: every cgroup).
#[map]
static ALLOW_CGROUPS: Array<CgroupRule> = Array::with_max_entries(MAX_CGROUP_RULES, 0);

#[no_mangle]
static CGROUP_RULES: Global<u32> = Global::new(0);

/// [`is_traced`], and in the daemon the admission of a process seen for the first time: the
/// probes that make rows call this, the lifecycle tracepoints only [`is_traced`].
pub fn admits(tgid: u32) -> bool {
    if is_traced(tgid) {
        return true;
    }
    // SAFETY: the value is a plain u32 that is only read.
    if !admit_any() || unsafe { DENIED.get(tgid) }.is_some() {
        return false;
    }
    let admitted = in_allowed_cgroup();
    // A full map leaves the verdict to the next call; never a reason to drop this one.
    let _ = if admitted { TRACED.insert(tgid, 1, 0) } else { DENIED.insert(tgid, 1, 0) };
    admitted
}

/// Whether [`admits`] would trace the calling process, without deciding anything for one not
/// seen yet: the dynamic linker's hook and exec fire in every process on the node, and must not
/// make one a job nor deny it before its first call does.
pub fn would_admit(tgid: u32) -> bool {
    if is_traced(tgid) {
        return true;
    }
    // SAFETY: the value is a plain u32 that is only read.
    admit_any() && unsafe { DENIED.get(tgid) }.is_none() && in_allowed_cgroup()
}

fn in_allowed_cgroup() -> bool {
    let rules = CGROUP_RULES.load();
    if rules == 0 {
        return true;
    }
    for i in 0..MAX_CGROUP_RULES {
        if i >= rules {
            break;
        }
        let Some(rule) = ALLOW_CGROUPS.get(i) else { break };
        // SAFETY: helper with a plain integer argument; 0 for a level below the task's own.
        let id = unsafe { aya_ebpf::helpers::generated::bpf_get_current_ancestor_cgroup_id(rule.level as i32) };
        if id == rule.id {
            return true;
        }
    }
    false
}

/// At exec, in the daemon: a process whose new image has a denied name, or a name outside the
/// allowed ones, stops being traced.
pub fn deny_by_comm(tgid: u32) {
    if !admit_any() {
        return;
    }
    let Ok(comm) = aya_ebpf::helpers::bpf_get_current_comm() else { return };
    // SAFETY: the values are plain u32s that are only read.
    let denied = unsafe { DENY_COMM.get(&comm) }.is_some()
        || (ALLOW_COMM_RULES.load() != 0 && unsafe { ALLOW_COMM.get(&comm) }.is_none());
    if denied {
        let _ = TRACED.remove(tgid);
        let _ = DENIED.insert(tgid, 1, 0);
    } else {
        // A name denied before the exec no longer applies.
        let _ = DENIED.remove(tgid);
    }
}

/// At fork, in the daemon: the child of a denied process is denied too (it has its parent's
/// name until it execs, when its own is judged). Without this it would be a process not seen
/// yet, admitted at its first call. A new thread lands here too; its key is removed at its exit.
pub fn inherit_denial(parent: u32, child: u32) {
    // SAFETY: the value is a plain u32 that is only read.
    if admit_any() && unsafe { DENIED.get(parent) }.is_some() {
        let _ = DENIED.insert(child, 1, 0);
    }
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
