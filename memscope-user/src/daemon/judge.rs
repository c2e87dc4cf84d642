//! The rules applied by userspace to the processes running when they change (the start,
//! SIGHUP): the kernel judges a process once, at its first call or its exec, and caches the
//! verdict, so new rules reach the processes already judged only through here. Each rule is
//! checked as the kernel checks it: the name the process has now, its cgroup v2 ancestors by
//! folder inode and depth, and for `--pid` whether the process or one of its ancestors was
//! given (the kernel lets a given process's children inherit the allowance at fork).

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use memscope_common::filter::{comm_key, CgroupRule};

use crate::attach::loader::Admission;

/// Why the rules deny a running process: the flag that does. `mount` is the cgroup v2 mount
/// (`None`: the cgroup rules are left to the kernel); `allowed_tree` is [`allowed_tree`]'s.
pub fn denied_by(
    pid: u32,
    admission: &Admission,
    mount: Option<&Path>,
    allowed_tree: &HashSet<u32>,
) -> Option<&'static str> {
    if admission.deny_pids.contains(&pid) {
        return Some("--exclude-pid");
    }
    let comm = crate::metrics::comm_of(pid);
    if !comm.is_empty() {
        let key = comm_key(comm.as_bytes());
        if admission.deny_comms.contains(&key) {
            return Some("--exclude-comm");
        }
        if !admission.allow_comms.is_empty() && !admission.allow_comms.contains(&key) {
            return Some("--comm");
        }
    }
    if !admission.allow_pids.is_empty() && !allowed_tree.contains(&pid) {
        return Some("--pid");
    }
    if admission.cgroups.is_empty() && admission.deny_cgroups.is_empty() {
        return None;
    }
    // A process whose cgroup cannot be read (gone, a kernel thread) is left to the kernel.
    let ancestors = cgroup_ancestors(pid, mount?)?;
    if admission.deny_cgroups.iter().any(|r| inside(&ancestors, r)) {
        return Some("--exclude-cgroup");
    }
    if !admission.cgroups.is_empty() && !admission.cgroups.iter().any(|r| inside(&ancestors, r)) {
        return Some("--cgroup");
    }
    None
}

/// The running processes that `--pid` allows: those given, and every process below one of
/// them in the process tree (empty when `--pid` is not given: the caller checks that first).
pub fn allowed_tree(admission: &Admission, pids: &[u32]) -> HashSet<u32> {
    let given: HashSet<u32> = admission.allow_pids.iter().copied().collect();
    pids.iter().copied().filter(|pid| lineage(*pid).iter().any(|p| given.contains(p))).collect()
}

/// A process and its ancestors, from /proc (stopping at pid 1 or a process gone).
fn lineage(pid: u32) -> Vec<u32> {
    let mut chain = vec![pid];
    let mut at = pid;
    while at > 1 && chain.len() < 4096 {
        let Some(parent) = parent_of(at) else { break };
        chain.push(parent);
        at = parent;
    }
    chain
}

/// The parent pid, from `/proc/PID/stat` (after the command name, which may hold anything).
fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.split_ascii_whitespace().nth(1)?.parse().ok()
}

/// The (inode, depth) of each folder on the process's cgroup v2 path, the root at depth 0.
fn cgroup_ancestors(pid: u32, mount: &Path) -> Option<Vec<(u64, u32)>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let path = text.lines().find_map(|l| l.strip_prefix("0::"))?;
    let mut folder = PathBuf::from(mount);
    let mut found = vec![(std::fs::metadata(&folder).ok()?.ino(), 0)];
    for (depth, part) in path.split('/').filter(|p| !p.is_empty()).enumerate() {
        folder.push(part);
        found.push((std::fs::metadata(&folder).ok()?.ino(), depth as u32 + 1));
    }
    Some(found)
}

fn inside(ancestors: &[(u64, u32)], rule: &CgroupRule) -> bool {
    ancestors.iter().any(|(ino, depth)| *ino == rule.id && *depth == rule.level)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn own() -> u32 {
        std::process::id()
    }

    #[test]
    fn names_and_pids_are_judged_as_the_kernel_judges_them() {
        let comm = comm_key(crate::metrics::comm_of(own()).as_bytes());
        let none = HashSet::new();
        let judge = |a: &Admission, tree: &HashSet<u32>| denied_by(own(), a, None, tree);
        assert_eq!(judge(&Admission::default(), &none), None);
        assert_eq!(judge(&Admission { deny_comms: vec![comm], ..Admission::default() }, &none), Some("--exclude-comm"));
        assert_eq!(
            judge(&Admission { allow_comms: vec![comm_key(b"other")], ..Admission::default() }, &none),
            Some("--comm")
        );
        assert_eq!(judge(&Admission { deny_pids: vec![own()], ..Admission::default() }, &none), Some("--exclude-pid"));
        // --pid: this process is below its parent, so giving the parent allows it.
        let parent = Admission { allow_pids: vec![std::os::unix::process::parent_id()], ..Admission::default() };
        let tree = allowed_tree(&parent, &[own(), 1]);
        assert!(tree.contains(&own()) && !tree.contains(&1), "{tree:?}");
        assert_eq!(judge(&parent, &tree), None);
        assert_eq!(judge(&parent, &none), Some("--pid"));
    }

    #[test]
    fn cgroups_are_judged_by_the_folders_on_the_path() {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let Some(mount) = mountinfo.lines().find_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            right.starts_with("cgroup2 ").then(|| left.split(' ').nth(4).map(PathBuf::from))?
        }) else {
            eprintln!("SKIPPED: no cgroup2 mount here");
            return;
        };
        let ancestors = cgroup_ancestors(own(), &mount).expect("this process's cgroup");
        let (ino, depth) = *ancestors.last().unwrap();
        let mine = CgroupRule { id: ino, level: depth, _pad: 0 };
        let elsewhere = CgroupRule { id: ino, level: depth + 1, _pad: 0 };
        let judge = |a: Admission| denied_by(own(), &a, Some(&mount), &HashSet::new());
        assert_eq!(judge(Admission { cgroups: vec![mine], ..Admission::default() }), None);
        assert_eq!(judge(Admission { cgroups: vec![elsewhere], ..Admission::default() }), Some("--cgroup"));
        // The root folder holds everything; an exclusion wins over an allowance.
        let root = CgroupRule { id: ancestors[0].0, level: 0, _pad: 0 };
        assert_eq!(
            judge(Admission { cgroups: vec![root], deny_cgroups: vec![mine], ..Admission::default() }),
            Some("--exclude-cgroup")
        );
    }
}
