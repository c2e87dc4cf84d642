//! The daemon's filters as the kernel checks them (`memscope_common::filter`): `--cgroup` paths
//! turned into (id, depth) rules of the cgroup v2 tree, `--comm` and `--exclude-comm` names cut
//! as the kernel cuts them, and the running processes those names deny (the kernel only sees
//! names at exec).

use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

use memscope_common::filter::{comm_key, CgroupRule, COMM_LEN, MAX_CGROUP_RULES};

#[derive(Debug, thiserror::Error)]
pub enum RuleError {
    #[error("--cgroup needs the cgroup v2 (unified) hierarchy, and /proc/self/mountinfo has no cgroup2 mount: mount it (`mount -t cgroup2 none /sys/fs/cgroup`) or trace without --cgroup")]
    NoCgroup2,
    #[error(
        "--cgroup {path}: {reason} (give a folder of the cgroup v2 tree, as /kubepods.slice or {mount}/kubepods.slice)"
    )]
    BadCgroup { path: PathBuf, mount: PathBuf, reason: String },
    #[error("{flag} given {count} times; the kernel checks at most {MAX_CGROUP_RULES}: give a common parent instead")]
    TooMany { flag: &'static str, count: usize },
    #[error("--pid {0}: no such process (give a running process's id, as `pgrep -f train.py` finds it)")]
    NoProcess(u32),
    #[error("--pid and --exclude-pid both name {0}: a process is either traced or not")]
    PidBothWays(u32),
    #[error("{0} is given an empty name: give a command name as /proc/PID/comm shows it")]
    EmptyComm(&'static str),
    #[error("--comm and --exclude-comm both name `{0}`: a name is either traced or not")]
    BothWays(String),
    #[error("{flag} given {count} names; the kernel checks at most {MAX_COMM_RULES}")]
    TooManyNames { flag: &'static str, count: usize },
}

/// Where the cgroup v2 hierarchy is mounted, from a `mountinfo` text.
fn cgroup2_mount(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        // ID PARENT MAJ:MIN ROOT MOUNT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER
        let (left, right) = line.split_once(" - ")?;
        let fstype = right.split_ascii_whitespace().next()?;
        (fstype == "cgroup2").then(|| left.split_ascii_whitespace().nth(4).map(PathBuf::from))?
    })
}

/// Where the cgroup v2 hierarchy is mounted here, if it is.
pub fn cgroup2_mount_now() -> Option<PathBuf> {
    cgroup2_mount(&std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default())
}

/// A `--cgroup` rule: `path` is a folder under the cgroup v2 mount, given either inside the
/// hierarchy (`/kubepods.slice`, as `/proc/PID/cgroup` shows it) or as a full path.
pub fn cgroup_rule(path: &Path) -> Result<CgroupRule, RuleError> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mount = cgroup2_mount(&mountinfo).ok_or(RuleError::NoCgroup2)?;
    cgroup_rule_under(&mount, path)
}

fn cgroup_rule_under(mount: &Path, path: &Path) -> Result<CgroupRule, RuleError> {
    let bad = |reason: String| RuleError::BadCgroup { path: path.to_owned(), mount: mount.to_owned(), reason };
    let inside = match path.strip_prefix(mount) {
        Ok(inside) => inside.to_owned(),
        Err(_) => path.strip_prefix("/").unwrap_or(path).to_owned(),
    };
    if inside.components().any(|c| !matches!(c, Component::Normal(_))) {
        return Err(bad("`.` and `..` are not allowed".into()));
    }
    let full = mount.join(&inside);
    let meta = std::fs::metadata(&full).map_err(|e| bad(format!("{}: {e}", full.display())))?;
    if !meta.is_dir() {
        return Err(bad(format!("{} is not a folder", full.display())));
    }
    // The kernel's ancestor at level 0 is the root; each folder below adds one.
    let level = inside.components().count() as u32;
    // In cgroup v2 a cgroup's id is its folder's inode number.
    Ok(CgroupRule { id: meta.ino(), level, _pad: 0 })
}

/// Every `--cgroup` (or `--exclude-cgroup`: `flag`), checked.
pub fn cgroup_rules(flag: &'static str, paths: &[PathBuf]) -> Result<Vec<CgroupRule>, RuleError> {
    if paths.len() > MAX_CGROUP_RULES as usize {
        return Err(RuleError::TooMany { flag, count: paths.len() });
    }
    paths.iter().map(|p| cgroup_rule(p)).collect()
}

/// `--pid`: each a running process, none also excluded.
pub fn pid_rules(pids: &[u32], excluded: &[u32]) -> Result<Vec<u32>, RuleError> {
    for pid in pids {
        if excluded.contains(pid) {
            return Err(RuleError::PidBothWays(*pid));
        }
        if *pid == 0 || !Path::new(&format!("/proc/{pid}")).exists() {
            return Err(RuleError::NoProcess(*pid));
        }
    }
    Ok(pids.to_vec())
}

/// The most names each of `--comm` and `--exclude-comm` may give (the kernel maps' size).
pub const MAX_COMM_RULES: usize = 64;

/// The names of `flag` (`--comm` or `--exclude-comm`), as the kernel compares them (15 bytes at
/// most: longer names are cut, as the kernel cuts a process's own name).
pub fn comm_keys(flag: &'static str, names: &[String]) -> Result<Vec<[u8; COMM_LEN]>, RuleError> {
    if names.len() > MAX_COMM_RULES {
        return Err(RuleError::TooManyNames { flag, count: names.len() });
    }
    names
        .iter()
        .map(|n| if n.is_empty() { Err(RuleError::EmptyComm(flag)) } else { Ok(comm_key(n.as_bytes())) })
        .collect()
}

/// Command names as the kernel keeps them.
pub type Names = Vec<[u8; COMM_LEN]>;

/// `--comm` and `--exclude-comm` (allowed, denied), checked against each other.
pub fn name_rules(allow: &[String], deny: &[String]) -> Result<(Names, Names), RuleError> {
    let (allowed, denied) = (comm_keys("--comm", allow)?, comm_keys("--exclude-comm", deny)?);
    if let Some(i) = allowed.iter().position(|a| denied.contains(a)) {
        return Err(RuleError::BothWays(allow[i].clone()));
    }
    Ok((allowed, denied))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cgroup2_mount_is_found_among_others() {
        let text = "25 1 0:23 / /sys/fs/cgroup/systemd rw - cgroup cgroup rw,name=systemd\n\
                    30 1 0:26 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw\n";
        assert_eq!(cgroup2_mount(text), Some(PathBuf::from("/sys/fs/cgroup/unified")));
        // Optional fields before the separator do not shift the fields.
        let text = "30 1 0:26 / /sys/fs/cgroup rw shared:9 master:2 - cgroup2 cgroup2 rw\n";
        assert_eq!(cgroup2_mount(text), Some(PathBuf::from("/sys/fs/cgroup")));
        assert_eq!(cgroup2_mount("22 1 0:5 / /proc rw - proc proc rw\n"), None);
    }

    #[test]
    fn a_rule_is_the_folders_inode_at_its_depth() {
        let mount = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(mount.path().join("kube.slice/pod1")).unwrap();
        let ino = std::fs::metadata(mount.path().join("kube.slice/pod1")).unwrap().ino();
        // Inside the hierarchy or as a full path: the same rule.
        for given in [PathBuf::from("/kube.slice/pod1"), mount.path().join("kube.slice/pod1")] {
            let rule = cgroup_rule_under(mount.path(), &given).unwrap();
            assert_eq!((rule.id, rule.level), (ino, 2), "{}", given.display());
        }
        let root = cgroup_rule_under(mount.path(), Path::new("/")).unwrap();
        assert_eq!(root.level, 0);
    }

    #[test]
    fn bad_cgroups_name_the_path_and_the_fix() {
        let mount = tempfile::tempdir().unwrap();
        std::fs::write(mount.path().join("file"), "").unwrap();
        for (given, says) in [("/nope", "No such file"), ("/file", "is not a folder"), ("/a/../b", "not allowed")] {
            let err = cgroup_rule_under(mount.path(), Path::new(given)).unwrap_err().to_string();
            assert!(err.contains(given) && err.contains(says) && err.contains("give a folder"), "{err}");
        }
        let many: Vec<PathBuf> = (0..=MAX_CGROUP_RULES).map(|i| PathBuf::from(format!("/{i}"))).collect();
        let err = cgroup_rules("--exclude-cgroup", &many).unwrap_err().to_string();
        assert!(err.starts_with("--exclude-cgroup given 9 times"), "{err}");
    }

    #[test]
    fn names_are_cut_as_the_kernel_cuts_them() {
        let keys = comm_keys("--exclude-comm", &["python3.8".into(), "a_very_long_command_name".into()]).unwrap();
        assert_eq!(&keys[0][..10], b"python3.8\0");
        assert_eq!(&keys[1][..15], b"a_very_long_com");
        assert_eq!(keys[1][15], 0);
        let err = comm_keys("--comm", &[String::new()]).unwrap_err().to_string();
        assert!(err.starts_with("--comm is given an empty name"), "{err}");
        let many: Vec<String> = (0..=MAX_COMM_RULES).map(|i| format!("n{i}")).collect();
        assert!(matches!(comm_keys("--comm", &many), Err(RuleError::TooManyNames { count: 65, .. })));
    }

    #[test]
    fn a_pid_must_run_and_not_be_excluded_too() {
        let own = std::process::id();
        assert_eq!(pid_rules(&[own], &[]).unwrap(), vec![own]);
        assert!(pid_rules(&[own], &[own]).unwrap_err().to_string().contains("both name"));
        let err = pid_rules(&[u32::MAX - 1], &[]).unwrap_err().to_string();
        assert!(err.contains("no such process"), "{err}");
    }

    #[test]
    fn a_name_both_allowed_and_denied_is_refused() {
        let err = name_rules(&["a".into(), "python3".into()], &["python3".into()]).unwrap_err().to_string();
        assert!(err.contains("`python3`"), "{err}");
        assert!(name_rules(&["a".into()], &["b".into()]).is_ok());
    }
}
