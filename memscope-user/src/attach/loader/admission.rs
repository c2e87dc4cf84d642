//! The daemon's rules in the kernel's maps (`memscope-ebpf/src/filter.rs`): written at the
//! load and again on SIGHUP, and the verdicts userspace gives running processes.

use std::collections::HashSet;

use aya::maps::{Array, HashMap as BpfHashMap, MapError};
use aya::Ebpf;
use memscope_common::filter::{count, CgroupRule, COMM_LEN, MAX_CGROUP_RULES};

use super::{LoadError, Tracer};

/// What the kernel checks before it traces a process it has not seen (the daemon).
#[derive(Clone, Debug, Default)]
pub struct Admission {
    /// `--cgroup`: a process must be inside one of these (none: anywhere).
    pub cgroups: Vec<CgroupRule>,
    /// `--exclude-comm`: names denied at exec.
    pub deny_comms: Vec<[u8; COMM_LEN]>,
    /// `--comm`: the names a process must exec under (none: any name).
    pub allow_comms: Vec<[u8; COMM_LEN]>,
    /// `--exclude-cgroup`: a process inside one of these is never traced.
    pub deny_cgroups: Vec<CgroupRule>,
    /// `--pid`: only these processes and their children (none: any process).
    pub allow_pids: Vec<u32>,
    /// `--exclude-pid`: never these (denied by userspace, not checked by the kernel).
    pub deny_pids: Vec<u32>,
}

impl Admission {
    /// Whether any rule is about names.
    pub fn has_name_rules(&self) -> bool {
        !self.deny_comms.is_empty() || !self.allow_comms.is_empty()
    }
}

impl Tracer {
    /// The daemon: never traces process `pid` (`--exclude-pid`, or a running process whose name
    /// a rule denies), until it execs a new image; one traced already stops being traced.
    pub fn deny_process(&mut self, pid: u32) -> Result<(), LoadError> {
        {
            let map = self.ebpf.map_mut("TRACED").ok_or(LoadError::Missing("TRACED"))?;
            let mut traced: BpfHashMap<_, u32, u32> =
                BpfHashMap::try_from(map).map_err(|source| LoadError::Map { name: "TRACED", source })?;
            // Not traced yet is the usual case.
            let _ = traced.remove(&pid);
        }
        let map = self.ebpf.map_mut("DENIED").ok_or(LoadError::Missing("DENIED"))?;
        let mut denied: BpfHashMap<_, u32, u32> =
            BpfHashMap::try_from(map).map_err(|source| LoadError::Map { name: "DENIED", source })?;
        denied.insert(pid, 1, 0).map_err(|source| LoadError::Map { name: "DENIED", source })
    }

    /// Replaces the daemon's rules (SIGHUP). `allowed_pids`: the running processes `--pid`
    /// allows, with their descendants. What the kernel has already judged stays judged: the
    /// caller re-judges the running processes ([`Self::deny_process`], [`Self::undeny_process`]).
    pub fn set_rules(&mut self, admission: &Admission, allowed_pids: &[u32]) -> Result<(), LoadError> {
        write_rules(&mut self.ebpf, admission, allowed_pids)
    }

    /// Lets the rules judge `pid` afresh at its next call (new rules no longer deny it).
    pub fn undeny_process(&mut self, pid: u32) -> Result<(), LoadError> {
        let map = self.ebpf.map_mut("DENIED").ok_or(LoadError::Missing("DENIED"))?;
        let mut denied: BpfHashMap<_, u32, u32> =
            BpfHashMap::try_from(map).map_err(|source| LoadError::Map { name: "DENIED", source })?;
        // Not denied is the usual case (the kernel's delete of a missing key is an error).
        if matches!(denied.get(&pid, 0), Err(MapError::KeyNotFound)) {
            return Ok(());
        }
        denied.remove(&pid).map_err(|source| LoadError::Map { name: "DENIED", source })
    }
}

/// Writes the daemon's rules into the kernel's maps, replacing what they held:
/// `allowed_pids` are the processes `--pid` allows (those given and, on SIGHUP, the running
/// processes below them). A rule the kernel cannot hold is refused before anything is written.
pub(super) fn write_rules(ebpf: &mut Ebpf, admission: &Admission, allowed_pids: &[u32]) -> Result<(), LoadError> {
    let most = admission.cgroups.len().max(admission.deny_cgroups.len()) as u32;
    if most > MAX_CGROUP_RULES {
        return Err(LoadError::TooManyCgroups(most));
    }
    for (name, list) in [("ALLOW_CGROUPS", &admission.cgroups), ("DENY_CGROUPS", &admission.deny_cgroups)] {
        let map = ebpf.map_mut(name).ok_or(LoadError::Missing(name))?;
        let mut rules: Array<_, CgroupRule> = Array::try_from(map).map_err(|source| LoadError::Map { name, source })?;
        for (i, rule) in list.iter().enumerate() {
            rules.set(i as u32, rule, 0).map_err(|source| LoadError::Map { name, source })?;
        }
    }
    for (name, list) in [("DENY_COMM", &admission.deny_comms), ("ALLOW_COMM", &admission.allow_comms)] {
        replace_keys(ebpf, name, list)?;
    }
    replace_keys(ebpf, "ALLOW_PIDS", allowed_pids)?;
    // The counts last: a list is checked only once its entries are in place.
    let name = "RULE_COUNTS";
    let map = ebpf.map_mut(name).ok_or(LoadError::Missing(name))?;
    let mut counts: Array<_, u32> = Array::try_from(map).map_err(|source| LoadError::Map { name, source })?;
    for (at, n) in [
        (count::ALLOW_CGROUPS, admission.cgroups.len()),
        (count::DENY_CGROUPS, admission.deny_cgroups.len()),
        (count::ALLOW_COMMS, admission.allow_comms.len()),
        (count::ALLOW_PIDS, admission.allow_pids.len()),
    ] {
        counts.set(at, n as u32, 0).map_err(|source| LoadError::Map { name, source })?;
    }
    Ok(())
}

/// Makes a set-like hash map (`key -> 1`) hold exactly `keys`: the new ones added first, then
/// the others removed, so that a key in both is never missing meanwhile.
fn replace_keys<K: aya::Pod + Eq + std::hash::Hash>(
    ebpf: &mut Ebpf,
    name: &'static str,
    keys: &[K],
) -> Result<(), LoadError> {
    let map = ebpf.map_mut(name).ok_or(LoadError::Missing(name))?;
    let mut set: BpfHashMap<_, K, u32> = BpfHashMap::try_from(map).map_err(|source| LoadError::Map { name, source })?;
    for key in keys {
        set.insert(key, 1, 0).map_err(|source| LoadError::Map { name, source })?;
    }
    let wanted: HashSet<&K> = keys.iter().collect();
    let stale: Vec<K> = set.keys().filter_map(Result::ok).filter(|k| !wanted.contains(k)).collect();
    for key in stale {
        let _ = set.remove(&key);
    }
    Ok(())
}
