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
//! Processes are found by listing /proc: a new process is looked at every second for its first
//! minute (when a job imports torch and loads the runtime) and every 30 s after that. A job that
//! starts on files already probed is traced from its first call whatever the scan; only the
//! first calls of a job that brings files nobody mapped before can precede their attach.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::time::{Duration, Instant};

use crate::attach::libs::{self, Library};

/// How long a process counts as new, looked at on every scan.
const YOUNG_FOR: Duration = Duration::from_secs(60);
/// How often an older process is looked at again.
const OLD_EVERY: Duration = Duration::from_secs(30);

/// The numeric entries of /proc: every process (threads are not listed).
pub fn all_pids() -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(Result::ok).filter_map(|e| e.file_name().to_str()?.parse().ok()).collect()
}

struct Seen {
    first: Instant,
    last: Instant,
}

/// The processes looked at so far, and when.
#[derive(Default)]
pub struct Discovery {
    seen: HashMap<u32, Seen>,
}

impl Discovery {
    /// The processes due a look now: new ones, young ones, and old ones not looked at for
    /// [`OLD_EVERY`]. Forgets the processes gone since the last call.
    pub fn due(&mut self) -> Vec<u32> {
        let now = Instant::now();
        let own = std::process::id();
        let pids: HashSet<u32> = all_pids().into_iter().filter(|p| *p != own).collect();
        self.seen.retain(|pid, _| pids.contains(pid));
        let mut due = Vec::new();
        for pid in pids {
            let seen = self.seen.entry(pid).or_insert(Seen { first: now, last: now });
            let young = now.duration_since(seen.first) < YOUNG_FOR;
            if young || now.duration_since(seen.last) >= OLD_EVERY {
                seen.last = now;
                due.push(pid);
            }
        }
        due.sort_unstable();
        due
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
    fn processes_are_due_when_new_and_young() {
        let mut d = Discovery::default();
        let first = d.due();
        // This test's process is the daemon's own stand-in: left out; its parent is not.
        assert!(!first.contains(&std::process::id()));
        let parent = std::os::unix::process::parent_id();
        assert!(first.contains(&parent), "{first:?}");
        // Young: due again at once.
        assert!(d.due().contains(&parent));
        // Old: not due until OLD_EVERY has passed since the last look.
        let long_ago = Instant::now() - 2 * YOUNG_FOR;
        let recently = Instant::now() - Duration::from_secs(1);
        d.seen.insert(parent, Seen { first: long_ago, last: recently });
        assert!(!d.due().contains(&parent));
        d.seen.insert(parent, Seen { first: long_ago, last: long_ago });
        assert!(d.due().contains(&parent));
    }

    #[test]
    fn gone_processes_are_forgotten() {
        let mut d = Discovery::default();
        d.seen.insert(u32::MAX - 1, Seen { first: Instant::now(), last: Instant::now() });
        d.due();
        assert!(!d.seen.contains_key(&(u32::MAX - 1)));
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
