//! Which library files the daemon probes: what every process on the node maps, and the runtime
//! folders its `ASCEND_HOME_PATH`/`ATB_HOME_PATH` name (so a library a job dlopens later is
//! probed before its first call).
//!
//! A uprobe is on a file (inode), not on a process: one attach serves every process that maps
//! the file, now or later, and the kernel admits processes on their own (`filter`). So discovery
//! only has to find files not probed yet, and most scans find none: on a node whose jobs share
//! one CANN install the first job's scan probes every later job's libraries too. A container
//! with its own copy has another inode, found through its `/proc/PID/root`, and gets its own
//! attach.
//!
//! Processes are found as they change, not by polling: the kernel reports each exec of a
//! process the rules would trace (`sched_process_exec`), and each change to such a process's
//! loaded objects through the dynamic linker's hook (`attach::linker`: the libraries a program
//! starts with, every `dlopen`), and the daemon reads that process's mappings then, hooking its
//! linker first if it is a file not hooked yet (so nothing it loads falls between the read and
//! the hook). A library a job dlopens is probed before its first call into it, a few
//! milliseconds after the load. /proc is listed only at the start and every 30 s after, for
//! what records lost in a full ring would miss; a process whose linker cannot be hooked is
//! looked at every second for its first minute, as every process was before the hook.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::time::{Duration, Instant};

use crate::attach::libs::{self, Library};

/// How often every process is looked at all the same.
const SWEEP_EVERY: Duration = Duration::from_secs(30);
/// How long a process whose linker has no hook is looked at every second.
const YOUNG_FOR: Duration = Duration::from_secs(60);
/// How often such a process is looked at meanwhile.
const UNHOOKED_EVERY: Duration = Duration::from_secs(1);

/// The numeric entries of /proc: every process (threads are not listed).
pub fn all_pids() -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(Result::ok).filter_map(|e| e.file_name().to_str()?.parse().ok()).collect()
}

/// When processes were looked at, and which of them are polled.
#[derive(Default)]
pub struct Discovery {
    /// When each process was last looked at.
    looked: HashMap<u32, Instant>,
    /// Processes whose linker could not be hooked, from when they were first seen.
    unhooked: HashMap<u32, Instant>,
    /// The last listing of /proc (`None`: not yet).
    swept: Option<Instant>,
}

impl Discovery {
    /// The processes due a look now, each once: those the kernel reported, unhooked young ones
    /// not looked at for a second, and at each sweep every process not looked at for
    /// [`SWEEP_EVERY`] (the first call's sweep is every process). A sweep forgets the
    /// processes gone.
    pub fn due(&mut self, reported: impl IntoIterator<Item = u32>, now: Instant) -> Vec<u32> {
        let own = std::process::id();
        let mut due: HashSet<u32> = reported.into_iter().filter(|p| *p != own).collect();
        self.unhooked.retain(|_, first| now.duration_since(*first) < YOUNG_FOR);
        for pid in self.unhooked.keys() {
            if self.looked.get(pid).is_none_or(|at| now.duration_since(*at) >= UNHOOKED_EVERY) {
                due.insert(*pid);
            }
        }
        if self.swept.is_none_or(|at| now.duration_since(at) >= SWEEP_EVERY) {
            self.swept = Some(now);
            let pids: HashSet<u32> = all_pids().into_iter().filter(|p| *p != own).collect();
            self.looked.retain(|pid, _| pids.contains(pid));
            self.unhooked.retain(|pid, _| pids.contains(pid));
            for pid in pids {
                if self.looked.get(&pid).is_none_or(|at| now.duration_since(*at) >= SWEEP_EVERY) {
                    due.insert(pid);
                }
            }
        }
        for pid in &due {
            self.looked.insert(*pid, now);
        }
        let mut due: Vec<u32> = due.into_iter().collect();
        due.sort_unstable();
        due
    }

    /// `pid`'s linker could not be hooked: it is polled while young (from its first look).
    pub fn unhooked(&mut self, pid: u32, now: Instant) {
        self.unhooked.entry(pid).or_insert(now);
    }
}

/// The libraries process `pid` maps, and those in the runtime folders of its environment, that
/// `known` does not know, with their dependencies, and the pid whose view of the files they
/// were found through. Kernel threads and processes gone meanwhile give none. Known files are
/// left out before their dependencies are looked for, which means reading each file's ELF
/// headers: most scans find nothing new and read no library.
pub fn libraries_of(pid: u32, known: impl Fn(&Library) -> bool) -> Vec<(Option<u32>, Library)> {
    let mut found = libs::from_maps(pid).unwrap_or_default();
    if let Ok(env) = libs::process_env(pid) {
        found.extend(libs::from_env(&env, Path::new(&format!("/proc/{pid}/root")), false));
    }
    found.retain(|l| !known(l));
    if found.is_empty() {
        return Vec::new();
    }
    libs::with_dependencies(found).into_iter().filter(|l| !known(l)).map(|l| (Some(pid), l)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_call_sweeps_every_process_and_later_ones_only_the_reported() {
        let mut d = Discovery::default();
        let now = Instant::now();
        let first = d.due([], now);
        // This test's process is the daemon's own stand-in: left out; its parent is not.
        assert!(!first.contains(&std::process::id()));
        let parent = std::os::unix::process::parent_id();
        assert!(first.contains(&parent), "{first:?}");
        // Until the next sweep only what the kernel reports is looked at, each once.
        let soon = now + Duration::from_secs(1);
        assert_eq!(d.due([parent, parent, std::process::id()], soon), vec![parent]);
        assert!(d.due([], soon).is_empty());
        // A sweep looks at the processes not looked at since the last one.
        let later = now + SWEEP_EVERY;
        assert!(!d.due([], later).contains(&parent), "looked at a second in: not due at this sweep");
        assert!(d.due([], later + SWEEP_EVERY).contains(&parent));
    }

    #[test]
    fn an_unhooked_process_is_polled_every_second_while_young() {
        let mut d = Discovery::default();
        let now = Instant::now();
        let parent = std::os::unix::process::parent_id();
        d.due([], now);
        d.unhooked(parent, now);
        assert!(!d.due([], now + Duration::from_millis(500)).contains(&parent));
        assert!(d.due([], now + Duration::from_secs(1)).contains(&parent));
        assert!(d.due([], now + Duration::from_secs(2)).contains(&parent));
        // Past its first minute only the sweeps look at it (none due at this instant).
        let old = now + YOUNG_FOR + Duration::from_secs(1);
        d.swept = Some(old);
        assert!(!d.due([], old).contains(&parent));
    }

    #[test]
    fn gone_processes_are_forgotten_at_a_sweep() {
        let mut d = Discovery::default();
        let now = Instant::now();
        d.looked.insert(u32::MAX - 1, now);
        d.unhooked(u32::MAX - 1, now);
        d.due([], now);
        assert!(!d.looked.contains_key(&(u32::MAX - 1)));
        assert!(!d.unhooked.contains_key(&(u32::MAX - 1)));
    }

    #[test]
    fn a_process_without_runtime_libraries_gives_none() {
        // This test binary maps no Ascend library and its environment names none.
        let env_home = std::env::var_os("ASCEND_HOME_PATH");
        if env_home.is_none() {
            assert!(libraries_of(std::process::id(), |_| false).is_empty());
        }
        assert!(libraries_of(u32::MAX - 1, |_| false).is_empty());
    }
}
