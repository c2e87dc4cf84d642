//! Which management library answers for a traced process, and where the helper that loads it
//! is. The library is looked for beside the driver library the process maps (through
//! `/proc/PID/root`, so a job in a container is answered by the library of its own image, which
//! matches its driver's version), then where the vendors install it; `--driver-lib` names it.

use std::path::{Path, PathBuf};

use memscope_driver::SourceKind;

/// The helper's file name, looked for beside the tracer's own binary, then on `PATH`.
pub const HELPER: &str = "memscope-driver-query";

/// Where the Ascend driver package and the DCMI package put libdcmi.so.
const DCMI_PLACES: [&str; 3] = [
    "/usr/local/dcmi/libdcmi.so",
    "/usr/local/Ascend/driver/lib64/driver/libdcmi.so",
    "/usr/local/Ascend/driver/lib64/libdcmi.so",
];
const NVML_NAME: &str = "libnvidia-ml.so.1";

/// A library to load and what it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Library {
    pub kind: SourceKind,
    pub path: PathBuf,
    /// The job whose files chose it (its maps, its root): the helper runs as that job's user, so
    /// a library a job planted beside its own driver runs with the job's rights, never root's.
    /// `None` for `--driver-lib`, which the operator named.
    pub chosen_by: Option<u32>,
}

/// A process's user, group and supplementary groups, from `/proc/PID/status`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Credentials {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
}

/// The real ids of a `/proc/PID/status` text.
pub fn credentials(status: &str) -> Option<Credentials> {
    let field = |name: &str| status.lines().find_map(|l| l.strip_prefix(name)).map(str::split_whitespace);
    let uid = field("Uid:")?.next()?.parse().ok()?;
    let gid = field("Gid:")?.next()?.parse().ok()?;
    let groups = field("Groups:").map(|g| g.filter_map(|v| v.parse().ok()).collect()).unwrap_or_default();
    Some(Credentials { uid, gid, groups })
}

/// What a library file is, by its name.
pub fn kind_of(path: &Path) -> Option<SourceKind> {
    let name = path.file_name()?.to_str()?;
    if name.starts_with("libdcmi") {
        Some(SourceKind::Dcmi)
    } else if name.starts_with("libnvidia-ml") {
        Some(SourceKind::Nvml)
    } else {
        None
    }
}

/// The files a process maps (its `/proc/PID/maps` text), once each.
fn mapped(maps: &str) -> Vec<&str> {
    let mut files: Vec<&str> =
        maps.lines().filter_map(|l| l.split_whitespace().nth(5)).filter(|p| p.starts_with('/')).collect();
    files.dedup();
    files
}

/// Candidates, best first, for a process whose maps are `maps` and whose root is `root`
/// (`/proc/PID/root`); `exists` says whether a path is there.
pub fn candidates(maps: &str, root: &Path, exists: impl Fn(&Path) -> bool) -> Vec<Library> {
    let files = mapped(maps);
    let in_root = |p: &str| root.join(p.trim_start_matches('/'));
    let dir_of = |suffix: &str| {
        files
            .iter()
            .find(|f| f.rsplit('/').next().is_some_and(|n| n.starts_with(suffix)))
            .and_then(|f| Path::new(f).parent())
    };
    let mut out = Vec::new();
    if let Some(dir) = dir_of("libascend_hal.so") {
        let mut places = vec![in_root(&dir.join("libdcmi.so").to_string_lossy())];
        places.extend(DCMI_PLACES.iter().map(|p| in_root(p)));
        places.extend(DCMI_PLACES.iter().map(PathBuf::from));
        let found = places.into_iter().filter(|p| exists(p));
        out.extend(found.map(|path| Library { kind: SourceKind::Dcmi, path, chosen_by: None }));
    }
    if let Some(dir) = dir_of("libcuda.so") {
        let beside = in_root(&dir.join(NVML_NAME).to_string_lossy());
        if exists(&beside) {
            out.push(Library { kind: SourceKind::Nvml, path: beside, chosen_by: None });
        }
        // The dynamic linker's search, in the helper.
        out.push(Library { kind: SourceKind::Nvml, path: PathBuf::from(NVML_NAME), chosen_by: None });
    }
    out.dedup();
    out
}

/// The library for `pid`, from its maps now; `None` while it maps no driver library.
pub fn library_for(pid: u32) -> Option<Library> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    let found = candidates(&maps, &PathBuf::from(format!("/proc/{pid}/root")), |p| p.exists()).into_iter().next()?;
    Some(Library { chosen_by: Some(pid), ..found })
}

/// The helper binary: beside our own, else on `PATH`.
pub fn helper() -> Option<PathBuf> {
    let beside = std::env::current_exe().ok()?.parent()?.join(HELPER);
    if beside.is_file() {
        return Some(beside);
    }
    std::env::split_paths(&std::env::var_os("PATH")?).map(|d| d.join(HELPER)).find(|p| p.is_file())
}

/// The variable through which a job sees only some devices, renumbered in its order: CUDA's
/// for NVML's indices, the Ascend runtime's for DCMI's logical ids (`aclrtSetDevice(0)` under
/// `ASCEND_RT_VISIBLE_DEVICES=4,5` is logical device 4).
pub fn visible_var(kind: SourceKind) -> &'static str {
    match kind {
        SourceKind::Nvml => "CUDA_VISIBLE_DEVICES",
        SourceKind::Dcmi => "ASCEND_RT_VISIBLE_DEVICES",
    }
}

/// The job's device ordinal for each of the management library's device ids: the job's
/// [`visible_var`], when it lists ids, renumbers the devices it sees in its order; without it
/// (or with CUDA's UUIDs, which are not mapped here) the ordinal is the id.
pub fn visible_ordinals(environ: &[u8], kind: SourceKind) -> Option<Vec<u32>> {
    let prefix = format!("{}=", visible_var(kind));
    let value = environ.split(|b| *b == 0).find_map(|kv| kv.strip_prefix(prefix.as_bytes()))?;
    let text = std::str::from_utf8(value).ok()?;
    text.split(',').map(|s| s.trim().parse::<u32>().ok()).collect()
}

/// The ordinal the job knows device `index` by, given [`visible_ordinals`]; `None` when the
/// job cannot see it.
pub fn ordinal(visible: Option<&[u32]>, index: u32) -> Option<u32> {
    match visible {
        None => Some(index),
        Some(list) => list.iter().position(|&i| i == index).map(|p| p as u32),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
7f0000000000-7f0000001000 r-xp 00000000 08:01 1 /opt/job/lib/libascendcl.so
7f0000002000-7f0000003000 r-xp 00000000 08:01 2 /usr/local/Ascend/driver/lib64/driver/libascend_hal.so
7f0000004000-7f0000005000 r-xp 00000000 08:01 3 /usr/lib/x86_64-linux-gnu/libcuda.so.550.54
7f0000006000-7f0000007000 rw-p 00000000 00:00 0 [heap]
";

    #[test]
    fn the_library_beside_the_mapped_driver_comes_first_through_the_process_root() {
        let root = Path::new("/proc/42/root");
        let all = candidates(MAPS, root, |_| true);
        assert_eq!(all[0].path, Path::new("/proc/42/root/usr/local/Ascend/driver/lib64/driver/libdcmi.so"));
        assert_eq!(all[0].kind, SourceKind::Dcmi);
        let nvml: Vec<&Library> = all.iter().filter(|l| l.kind == SourceKind::Nvml).collect();
        assert_eq!(nvml[0].path, Path::new("/proc/42/root/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"));
        assert_eq!(nvml.last().unwrap().path, Path::new(NVML_NAME), "the linker's search comes last");
        // Nothing on disk: no DCMI at all (it has no place the linker finds by itself).
        let none = candidates(MAPS, root, |_| false);
        assert!(none.iter().all(|l| l.kind == SourceKind::Nvml));
        assert!(candidates("", root, |_| true).is_empty(), "no driver mapped yet");
    }

    #[test]
    fn a_jobs_credentials_are_its_real_ids_and_groups() {
        let status = "Name:\tpython3\nUid:\t1000\t1000\t1000\t1000\nGid:\t1001\t0\t0\t0\nGroups:\t44 1001 \n";
        assert_eq!(credentials(status), Some(Credentials { uid: 1000, gid: 1001, groups: vec![44, 1001] }));
        let none = "Uid:\t0\t0\t0\t0\nGid:\t0\t0\t0\t0\nGroups:\t\n";
        assert_eq!(credentials(none), Some(Credentials { uid: 0, gid: 0, groups: vec![] }));
        assert_eq!(credentials("Name:\tx\n"), None);
    }

    #[test]
    fn visible_devices_renumber_nvml_indices_and_dcmi_logical_ids() {
        let env = b"PATH=/bin\0CUDA_VISIBLE_DEVICES=3,1\0HOME=/root\0ASCEND_RT_VISIBLE_DEVICES=4, 5\0";
        let visible = visible_ordinals(env, SourceKind::Nvml);
        assert_eq!(visible.as_deref(), Some(&[3, 1][..]));
        assert_eq!(ordinal(visible.as_deref(), 1), Some(1));
        assert_eq!(ordinal(visible.as_deref(), 3), Some(0));
        assert_eq!(ordinal(visible.as_deref(), 0), None, "hidden from the job");
        assert_eq!(ordinal(None, 2), Some(2));
        assert_eq!(
            visible_ordinals(b"CUDA_VISIBLE_DEVICES=GPU-8f2c\0", SourceKind::Nvml),
            None,
            "UUIDs are not mapped"
        );
        let npu = visible_ordinals(env, SourceKind::Dcmi);
        assert_eq!(npu.as_deref(), Some(&[4, 5][..]));
        assert_eq!((ordinal(npu.as_deref(), 5), ordinal(npu.as_deref(), 0)), (Some(1), None));
        assert_eq!(visible_ordinals(b"ASCEND_RT_VISIBLE_DEVICES_X=1\0", SourceKind::Dcmi), None);
        assert_eq!(kind_of(Path::new("/x/libnvidia-ml.so.1")), Some(SourceKind::Nvml));
        assert_eq!(kind_of(Path::new("libdcmi.so")), Some(SourceKind::Dcmi));
        assert_eq!(kind_of(Path::new("libfoo.so")), None);
    }
}
