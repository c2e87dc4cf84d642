//! Checks made before touching the kernel, each failing with one sentence that names the problem
//! and the fix. They exist because the raw failures (EPERM from bpf(2), ENOENT from
//! perf_event_open) say neither.

use std::path::{Path, PathBuf};

use thiserror::Error;

#[derive(Debug, Error)]
pub enum PreflightError {
    #[error(
        "loading eBPF programs needs root, or the CAP_BPF, CAP_PERFMON and CAP_SYS_PTRACE capabilities; \
         run it with sudo"
    )]
    NotPrivileged,
    #[error("no process with pid {0}; check the pid (`ps -p {0}`), or launch the program under the tracer: `memscope-bpf trace -- <command>`")]
    NoSuchProcess(u32),
    #[error("process {0} has exited (a zombie its parent has not reaped yet): there is nothing left to trace")]
    Exited(u32),
    #[error("this kernel has no uprobe support ({0} is missing); memscope-bpf needs a kernel built with CONFIG_UPROBE_EVENTS=y")]
    NoUprobes(PathBuf),
    #[error(
        "no accelerator library found {where_}: looked for the Ascend runtime (libascendcl.so, libacl_rt.so, \
         libacl_rt_impl.so) and NVIDIA's (libcudart.so, libcuda.so, libc10_cuda.so); pass --lib with the library \
         (a PyTorch job launched through a script or torchrun: --lib .../site-packages/torch/lib/libc10_cuda.so), set \
         ASCEND_HOME_PATH, or attach with --pid once the job has initialised its device"
    )]
    NoLibrary { where_: String },
    #[error("output folder {path} is not writable ({reason}); pass --output with a folder you can write to")]
    OutputNotWritable { path: PathBuf, reason: String },
    #[error(
        "the daemon lacks {}: run it as root, or grant every capability docs/deploy/README.md lists \
         (CAP_BPF, CAP_PERFMON, CAP_SYS_PTRACE, CAP_DAC_READ_SEARCH), e.g. in the DaemonSet's \
         securityContext.capabilities.add",
        .0.join("; ")
    )]
    MissingCaps(Vec<String>),
}

const CAP_DAC_READ_SEARCH: u32 = 2;
const CAP_SYS_PTRACE: u32 = 19;
const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

/// The effective capability mask from a `/proc/PID/status` text.
pub fn effective_caps(status: &str) -> Option<u64> {
    let hex = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?.trim();
    u64::from_str_radix(hex, 16).ok()
}

/// Whether a capability mask is enough to load and attach our programs.
pub fn caps_suffice(caps: u64) -> bool {
    let has = |bit: u32| caps & (1 << bit) != 0;
    has(CAP_SYS_ADMIN) || (has(CAP_BPF) && has(CAP_PERFMON))
}

pub fn check_privileges() -> Result<(), PreflightError> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    match effective_caps(&status) {
        Some(caps) if caps_suffice(caps) => Ok(()),
        _ => Err(PreflightError::NotPrivileged),
    }
}

/// What the daemon needs each capability for, as the caps test found them (docs/deploy).
const DAEMON_CAPS: [(u32, &str, &str); 4] = [
    (CAP_BPF, "CAP_BPF", "to load the eBPF programs and make their maps"),
    (CAP_PERFMON, "CAP_PERFMON", "to load tracing programs and attach the uprobes and process tracepoints"),
    (
        CAP_SYS_PTRACE,
        "CAP_SYS_PTRACE",
        "to read other users' /proc/PID/maps, environ and root, where jobs' libraries are found",
    ),
    (
        CAP_DAC_READ_SEARCH,
        "CAP_DAC_READ_SEARCH",
        "to read tracefs (/sys/kernel/tracing is mode 0700) for the tracepoints' layout",
    ),
];

/// The daemon's capabilities missing from a mask, each with what it is for. CAP_SYS_ADMIN
/// stands for CAP_BPF and CAP_PERFMON, as the kernel lets it.
pub fn missing_daemon_caps(caps: u64) -> Vec<String> {
    let has = |bit: u32| caps & (1 << bit) != 0;
    let held = |bit: u32| has(bit) || (has(CAP_SYS_ADMIN) && matches!(bit, CAP_BPF | CAP_PERFMON));
    DAEMON_CAPS.iter().filter(|(bit, ..)| !held(*bit)).map(|(_, name, why)| format!("{name} ({why})")).collect()
}

/// The daemon's check: every capability it needs, named when missing. `MEMSCOPE_SKIP_CAP_CHECK`
/// (for the caps test only, which shows what each missing one breaks) skips it.
pub fn check_daemon_caps() -> Result<(), PreflightError> {
    if std::env::var_os("MEMSCOPE_SKIP_CAP_CHECK").is_some() {
        return Ok(());
    }
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let missing = missing_daemon_caps(effective_caps(&status).unwrap_or(0));
    if missing.is_empty() {
        Ok(())
    } else {
        Err(PreflightError::MissingCaps(missing))
    }
}

pub fn check_uprobes() -> Result<(), PreflightError> {
    check_uprobes_in(Path::new("/"))
}

/// The uprobe PMU (what perf_event_open attaches through) or the tracefs interface, under `root`.
fn check_uprobes_in(root: &Path) -> Result<(), PreflightError> {
    let pmu = root.join("sys/bus/event_source/devices/uprobe");
    if pmu.exists() || root.join("sys/kernel/tracing/uprobe_events").exists() {
        Ok(())
    } else {
        Err(PreflightError::NoUprobes(pmu))
    }
}

pub fn check_pid(pid: u32) -> Result<(), PreflightError> {
    // A thread id also has a /proc entry; only a thread-group leader is a process.
    let status =
        std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(|_| PreflightError::NoSuchProcess(pid))?;
    let tgid = status.lines().find_map(|l| l.strip_prefix("Tgid:")).map(str::trim);
    if pid == 0 || tgid != Some(&pid.to_string()) {
        return Err(PreflightError::NoSuchProcess(pid));
    }
    if crate::capture::procs::liveness(pid) == crate::capture::procs::Liveness::Exited {
        return Err(PreflightError::Exited(pid));
    }
    Ok(())
}

pub fn check_output(dir: &Path) -> Result<(), PreflightError> {
    memscope_core::store::layout::ensure_writable(dir).map_err(|e| PreflightError::OutputNotWritable {
        path: dir.to_owned(),
        reason: match e {
            memscope_core::store::StoreError::Io { source, .. } => source.to_string(),
            other => other.to_string(),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capability_rules() {
        assert!(caps_suffice(1 << CAP_SYS_ADMIN));
        assert!(caps_suffice((1 << CAP_BPF) | (1 << CAP_PERFMON)));
        assert!(!caps_suffice(1 << CAP_BPF));
        assert!(!caps_suffice(0));
        assert_eq!(effective_caps("Name:\tx\nCapEff:\t000001ffffffffff\n"), Some(0x1ff_ffff_ffff));
        assert_eq!(effective_caps("CapEff:\t0000000000000000\n").map(caps_suffice), Some(false));
    }

    #[test]
    fn the_daemons_missing_capabilities_are_named() {
        let all = (1 << CAP_BPF) | (1 << CAP_PERFMON) | (1 << CAP_SYS_PTRACE) | (1 << CAP_DAC_READ_SEARCH);
        assert!(missing_daemon_caps(all).is_empty());
        assert!(missing_daemon_caps(u64::MAX).is_empty());
        let missing = missing_daemon_caps(all & !(1 << CAP_SYS_PTRACE));
        assert_eq!(missing.len(), 1);
        assert!(missing[0].starts_with("CAP_SYS_PTRACE (") && missing[0].contains("maps"), "{missing:?}");
        // CAP_SYS_ADMIN stands for the two BPF ones, not for the others.
        let admin = (1 << CAP_SYS_ADMIN) | (1 << CAP_SYS_PTRACE);
        let missing = missing_daemon_caps(admin);
        assert_eq!(missing.len(), 1, "{missing:?}");
        assert!(missing[0].starts_with("CAP_DAC_READ_SEARCH"));
        let text = PreflightError::MissingCaps(missing_daemon_caps(0)).to_string();
        assert!(text.contains("CAP_BPF (") && text.contains("run it as root"), "{text}");
    }

    /// The DaemonSet and the deployment notes grant exactly the capabilities checked here.
    #[test]
    fn the_daemonset_adds_exactly_the_daemons_capabilities() {
        let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/deploy");
        let manifest = std::fs::read_to_string(deploy.join("daemonset.yaml")).unwrap();
        let add = manifest.lines().find_map(|l| l.trim().strip_prefix("add:")).expect("capabilities.add");
        let mut granted: Vec<String> = add
            .trim()
            .trim_matches(['[', ']'])
            .split(',')
            .map(|c| format!("CAP_{}", c.trim().trim_matches('"')))
            .collect();
        let mut checked: Vec<String> = DAEMON_CAPS.iter().map(|(_, name, _)| (*name).to_owned()).collect();
        granted.sort();
        checked.sort();
        assert_eq!(granted, checked);
        assert!(manifest.contains(r#"drop: ["ALL"]"#) && manifest.contains("hostPID: true"));
        let readme = std::fs::read_to_string(deploy.join("README.md")).unwrap();
        for name in &checked {
            assert!(readme.contains(&format!("| `{name}` |")), "README.md does not say why {name}");
        }
    }

    #[test]
    fn pid_checks() {
        assert!(check_pid(std::process::id()).is_ok());
        assert!(matches!(check_pid(0), Err(PreflightError::NoSuchProcess(0))));
        // pid_max is at most 2^22, so this pid cannot exist.
        assert!(matches!(check_pid(u32::MAX - 1), Err(PreflightError::NoSuchProcess(_))));
    }

    #[test]
    fn kernel_without_uprobes_is_named() {
        let empty = std::env::temp_dir().join(format!("memscope-noprobes-{}", std::process::id()));
        std::fs::create_dir_all(&empty).unwrap();
        let err = check_uprobes_in(&empty).unwrap_err();
        assert!(err.to_string().contains("CONFIG_UPROBE_EVENTS"), "{err}");
        std::fs::create_dir_all(empty.join("sys/bus/event_source/devices/uprobe")).unwrap();
        assert!(check_uprobes_in(&empty).is_ok());
        std::fs::remove_dir_all(&empty).unwrap();
    }

    #[test]
    fn output_that_is_a_file_is_refused_with_the_fix() {
        let file = std::env::temp_dir().join(format!("memscope-preflight-{}", std::process::id()));
        std::fs::write(&file, b"").unwrap();
        let err = check_output(&file).unwrap_err();
        assert!(err.to_string().contains("--output"), "{err}");
        std::fs::remove_file(&file).unwrap();
    }
}
