//! The daemon's rules (`memscope_common::filter`): which processes the probes trace when every
//! process that calls a probed function may be a job. A process is judged at its first probed
//! call and the verdict is cached (`TRACED` or [`DENIED`]); names are judged at exec, where the
//! kernel knows the new image's own name; a process forked from a denied one inherits the
//! denial, and one forked from a process `--pid` names inherits the allowance (torchrun's
//! workers are its children), both until an exec judges the child's own name.

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LruHashMap},
    Global,
};
use memscope_common::filter::{count, CgroupRule, COMM_LEN, MAX_CGROUP_RULES};

use crate::maps::{is_traced, TRACED};

/// Whether every process that calls a probed function is traced unless a rule denies it
/// (`memscope-bpf daemon`).
#[no_mangle]
static ADMIT_ANY: Global<u32> = Global::new(0);

pub fn admit_any() -> bool {
    ADMIT_ANY.load() != 0
}

/// Processes the daemon does not trace: denied by name at exec or by userspace (its scan of the
/// processes already running, `--exclude-pid`), outside every `--cgroup`, inside an
/// `--exclude-cgroup`, or not among the `--pid`s. LRU: an entry of a process that is gone is
/// the one to lose.
#[map]
pub static DENIED: LruHashMap<u32, u32> = LruHashMap::with_max_entries(16384, 0);

/// Command names (`--exclude-comm`) checked at exec.
#[map]
static DENY_COMM: HashMap<[u8; COMM_LEN], u32> = HashMap::with_max_entries(64, 0);

/// Command names (`--comm`) a process must exec under to be traced, when [`RULE_COUNTS`] says
/// there are any.
#[map]
static ALLOW_COMM: HashMap<[u8; COMM_LEN], u32> = HashMap::with_max_entries(64, 0);

/// `--pid`: the processes (and their children) that may be traced, when [`RULE_COUNTS`] says
/// there are any. LRU, as [`DENIED`]: children and threads add keys.
#[map]
static ALLOW_PIDS: LruHashMap<u32, u32> = LruHashMap::with_max_entries(16384, 0);

/// `--cgroup` rules; the first `RULE_COUNTS[ALLOW_CGROUPS]` entries are in use (none: every
/// cgroup).
#[map]
static ALLOW_CGROUPS: Array<CgroupRule> = Array::with_max_entries(MAX_CGROUP_RULES, 0);

/// `--exclude-cgroup` rules, as [`ALLOW_CGROUPS`].
#[map]
static DENY_CGROUPS: Array<CgroupRule> = Array::with_max_entries(MAX_CGROUP_RULES, 0);

/// How many rules of each list are in use (`memscope_common::filter::count`), written by
/// userspace at the start and on SIGHUP.
#[map]
static RULE_COUNTS: Array<u32> = Array::with_max_entries(count::LEN, 0);

fn rules(list: u32) -> u32 {
    RULE_COUNTS.get(list).copied().unwrap_or(0)
}

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
    let admitted = passes_rules(tgid);
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
    admit_any() && unsafe { DENIED.get(tgid) }.is_none() && passes_rules(tgid)
}

/// The rules checked at the first call: pids and cgroups (names were judged at exec).
fn passes_rules(tgid: u32) -> bool {
    // SAFETY: the value is a plain u32 that is only read.
    let pid_ok = rules(count::ALLOW_PIDS) == 0 || unsafe { ALLOW_PIDS.get(tgid) }.is_some();
    let deny = rules(count::DENY_CGROUPS);
    pid_ok
        && in_cgroups(&ALLOW_CGROUPS, rules(count::ALLOW_CGROUPS), true)
        && !(deny > 0 && in_cgroups(&DENY_CGROUPS, deny, false))
}

/// Whether the calling task is inside one of the first `rules` cgroups of `list`; `none` when
/// there are none.
fn in_cgroups(list: &Array<CgroupRule>, rules: u32, none: bool) -> bool {
    if rules == 0 {
        return none;
    }
    for i in 0..MAX_CGROUP_RULES {
        if i >= rules {
            break;
        }
        let Some(rule) = list.get(i) else { break };
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
        || (rules(count::ALLOW_COMMS) != 0 && unsafe { ALLOW_COMM.get(&comm) }.is_none());
    if denied {
        let _ = TRACED.remove(tgid);
        let _ = DENIED.insert(tgid, 1, 0);
    } else {
        // A name denied before the exec no longer applies.
        let _ = DENIED.remove(tgid);
    }
}

/// At fork, in the daemon: the child of a denied process is denied too (it has its parent's
/// name until it execs, when its own is judged; without this it would be a process not seen
/// yet, admitted at its first call), and the child of a process `--pid` allows is allowed. A
/// new thread lands here too; its keys are removed at its exit ([`forget`]).
pub fn inherit(parent: u32, child: u32) {
    if !admit_any() {
        return;
    }
    // SAFETY: the values are plain u32s that are only read.
    if unsafe { DENIED.get(parent) }.is_some() {
        let _ = DENIED.insert(child, 1, 0);
    }
    if rules(count::ALLOW_PIDS) != 0 && unsafe { ALLOW_PIDS.get(parent) }.is_some() {
        let _ = ALLOW_PIDS.insert(child, 1, 0);
    }
}

/// At a task's exit, in the daemon: its pid may be reused by a process the rules judge afresh;
/// a thread's keys are the ones [`inherit`] left.
pub fn forget(tid: u32) {
    if admit_any() {
        let _ = DENIED.remove(tid);
        let _ = ALLOW_PIDS.remove(tid);
    }
}
