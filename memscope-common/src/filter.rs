//! Which processes the daemon traces, decided in the kernel at a process's first probed call
//! (`memscope-bpf daemon`): processes are admitted on first sight unless a deny rule or the
//! cgroup allow list says otherwise, so a job started after the daemon is traced from its very
//! first allocation, with no round trip to userspace in between.
//!
//! - Command names (an allow list, `--comm`, and a deny list, `--exclude-comm`) are checked
//!   where the kernel knows the process's own name: at `exec` (the new image's name, before any
//!   thread renames itself) and, for processes already running when the daemon starts, by
//!   userspace from `/proc/PID/comm`. The verdict is cached per process, and a denied process's
//!   children inherit it at fork (they have its name until they exec).
//! - Cgroups (`--cgroup`, `--exclude-cgroup`) are checked at the first call: a rule is a cgroup
//!   v2 directory's id and its depth, and a process is inside when its ancestor at that depth is
//!   that cgroup.
//! - Pids (`--pid`) are checked at the first call too; a process forked by an allowed one is
//!   allowed, as a denied one's child is denied.

/// Command names compared by the kernel: `TASK_COMM_LEN`, the name cut to 15 bytes and a NUL.
pub const COMM_LEN: usize = 16;

/// Cgroup allow rules the kernel checks, at most.
pub const MAX_CGROUP_RULES: u32 = 8;

/// Indexes of the kernel's `RULE_COUNTS` array: how many rules of each list are in use (0: the
/// list is not checked). A map, not constants, so that SIGHUP can change them.
pub mod count {
    pub const ALLOW_CGROUPS: u32 = 0;
    pub const DENY_CGROUPS: u32 = 1;
    pub const ALLOW_COMMS: u32 = 2;
    pub const ALLOW_PIDS: u32 = 3;
    /// Entries of the array.
    pub const LEN: u32 = 4;
}

/// One `--cgroup` rule: processes whose cgroup at `level` (the root is 0) has id `id` (the
/// directory's inode number in cgroup v2).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CgroupRule {
    pub id: u64,
    pub level: u32,
    pub _pad: u32,
}

const _: () = assert!(core::mem::size_of::<CgroupRule>() == 16);

/// A command name as the kernel keeps it: cut to 15 bytes and NUL-padded.
pub fn comm_key(name: &[u8]) -> [u8; COMM_LEN] {
    let mut key = [0u8; COMM_LEN];
    let n = name.len().min(COMM_LEN - 1);
    key[..n].copy_from_slice(&name[..n]);
    key
}
