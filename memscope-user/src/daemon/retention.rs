//! The daemon's disk: finished jobs' run folders removed when older than `--retention`, and the
//! oldest of them first while everything under OUTPUT is over `--max-db`.
//!
//! Only folders named as run folders are touched (`memscope_<pid>_<time>_ascend`, with an
//! optional `_<n>`), in OUTPUT and in OUTPUT/flight (the flight recordings, named with their
//! reason: `..._ascend_oom`), so an operator's other files in OUTPUT are never removed; folders
//! of an earlier daemon run count as finished. A folder's age is that of its newest file (the job's
//! last write). A running job's folder is never removed: when running jobs alone are over the
//! cap the sweep says so, and the daemon warns.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

/// `--max-db` and `--retention`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Limits {
    pub max_bytes: Option<u64>,
    pub retention: Option<Duration>,
}

impl Limits {
    pub fn any(&self) -> bool {
        self.max_bytes.is_some() || self.retention.is_some()
    }
}

/// What one sweep did.
#[derive(Debug, Default)]
pub struct Swept {
    /// Folders removed, and why.
    pub removed: Vec<(PathBuf, &'static str)>,
    /// Bytes on disk under the run folders afterwards.
    pub bytes: u64,
    /// Still over `--max-db` with only running jobs' folders left.
    pub over_cap: bool,
}

struct Folder {
    path: PathBuf,
    bytes: u64,
    newest: SystemTime,
}

/// Whether a name is a run folder's (`RunLayout`'s naming).
fn is_run_folder(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("memscope_") else { return false };
    let mut parts = rest.split('_');
    let digits = |p: Option<&str>| p.is_some_and(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
    digits(parts.next()) && digits(parts.next()) && matches!(parts.next(), Some("ascend" | "cuda")) && {
        let mut next = parts.next();
        if matches!(next, Some("oom" | "degradation" | "request")) {
            next = parts.next();
        }
        match next {
            None => true,
            n => digits(n) && parts.next().is_none(),
        }
    }
}

/// Bytes on disk and the newest modification time under `dir`.
fn measure(dir: &Path) -> (u64, SystemTime) {
    use std::os::unix::fs::MetadataExt;
    let mut bytes = 0;
    let mut newest = std::fs::metadata(dir).and_then(|m| m.modified()).unwrap_or(SystemTime::UNIX_EPOCH);
    let mut stack = vec![dir.to_owned()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for entry in entries.filter_map(Result::ok) {
            let Ok(meta) = entry.metadata() else { continue };
            if meta.is_dir() {
                stack.push(entry.path());
            }
            bytes += meta.blocks() * 512;
            if let Ok(m) = meta.modified() {
                newest = newest.max(m);
            }
        }
    }
    (bytes, newest)
}

fn run_folders(output: &Path) -> Vec<Folder> {
    let read = |dir: &Path| std::fs::read_dir(dir).into_iter().flatten();
    read(output)
        .chain(read(&output.join("flight")))
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()) && e.file_name().to_str().is_some_and(is_run_folder))
        .map(|e| {
            let (bytes, newest) = measure(&e.path());
            Folder { path: e.path(), bytes, newest }
        })
        .collect()
}

/// Applies the limits to OUTPUT's run folders; `running` are the open jobs' folders.
pub fn sweep(output: &Path, running: &[PathBuf], limits: Limits, now: SystemTime) -> Swept {
    let mut folders = run_folders(output);
    // Oldest first: the order both rules remove in.
    folders.sort_by_key(|f| f.newest);
    let mut swept = Swept::default();
    let mut kept = Vec::new();
    for folder in folders {
        let finished = !running.contains(&folder.path);
        let expired = limits.retention.is_some_and(|r| now.duration_since(folder.newest).is_ok_and(|age| age > r));
        if finished && expired && remove(&folder.path) {
            swept.removed.push((folder.path, "older than --retention"));
        } else {
            kept.push(folder);
        }
    }
    let mut total: u64 = kept.iter().map(|f| f.bytes).sum();
    if let Some(cap) = limits.max_bytes {
        for folder in &kept {
            if total <= cap {
                break;
            }
            if !running.contains(&folder.path) && remove(&folder.path) {
                total -= folder.bytes;
                swept.removed.push((folder.path.clone(), "over --max-db"));
            }
        }
        swept.over_cap = total > cap;
    }
    swept.bytes = total;
    swept
}

fn remove(path: &Path) -> bool {
    match std::fs::remove_dir_all(path) {
        Ok(()) => true,
        Err(e) => {
            crate::terminal::say::say!("memscope-bpf: warning: cannot remove {}: {e}", path.display());
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn folder(output: &Path, name: &str, bytes: usize, age: Duration) -> PathBuf {
        let dir = output.join(name).join("device_0").join("dump");
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("memscope_dump_1.db");
        std::fs::write(&file, vec![1u8; bytes]).unwrap();
        let when = SystemTime::now() - age;
        std::fs::File::options().write(true).open(&file).unwrap().set_modified(when).unwrap();
        for d in [dir.as_path(), dir.parent().unwrap(), &output.join(name)] {
            std::fs::File::open(d).unwrap().set_modified(when).unwrap();
        }
        output.join(name)
    }

    #[test]
    fn only_run_folder_names_are_touched() {
        assert!(is_run_folder("memscope_4242_20261203114938_ascend"));
        assert!(is_run_folder("memscope_4242_20261203114938_ascend_2"));
        assert!(is_run_folder("memscope_4242_20261203114938_cuda"));
        assert!(is_run_folder("memscope_4242_20261203114938_ascend_oom"));
        assert!(is_run_folder("memscope_4242_20261203114938_cuda_request_2"));
        for name in [
            "memscope_4242_ascend",
            "memscope_x_1_ascend",
            "memscope_1_2_ascend_",
            "notes",
            "memscope_1_2_ascend_2_3",
            "memscope_1_2_ascend_oops",
        ] {
            assert!(!is_run_folder(name), "{name}");
        }
    }

    #[test]
    fn retention_removes_finished_folders_past_their_age() {
        let out = tempfile::tempdir().unwrap();
        let old = folder(out.path(), "memscope_1_20260101000000_ascend", 4096, Duration::from_secs(3600));
        let running = folder(out.path(), "memscope_2_20260101000000_ascend", 4096, Duration::from_secs(3600));
        let young = folder(out.path(), "memscope_3_20260101000000_ascend", 4096, Duration::from_secs(1));
        let flight =
            folder(&out.path().join("flight"), "memscope_1_20260101000000_ascend_oom", 4096, Duration::from_secs(3600));
        let other = out.path().join("keep_me");
        std::fs::create_dir(&other).unwrap();
        std::fs::File::open(&other).unwrap().set_modified(SystemTime::now() - Duration::from_secs(7200)).unwrap();
        let limits = Limits { retention: Some(Duration::from_secs(600)), max_bytes: None };
        let swept = sweep(out.path(), std::slice::from_ref(&running), limits, SystemTime::now());
        let mut removed: Vec<PathBuf> = swept.removed.iter().map(|(p, _)| p.clone()).collect();
        removed.sort();
        assert_eq!(removed, vec![flight.clone(), old.clone()], "a flight recording is a finished folder too");
        assert!(!old.exists() && running.exists() && young.exists() && other.exists());
    }

    #[test]
    fn the_cap_removes_the_oldest_finished_folders_first() {
        let out = tempfile::tempdir().unwrap();
        let names = ["memscope_1_1_ascend", "memscope_2_1_ascend", "memscope_3_1_ascend", "memscope_4_1_ascend"];
        let dirs: Vec<PathBuf> = names
            .iter()
            .enumerate()
            .map(|(i, n)| folder(out.path(), n, 64 << 10, Duration::from_secs(100 - i as u64 * 10)))
            .collect();
        let each = measure(&dirs[0]).0;
        // The oldest is running: kept; the next two go; two folders fit the cap.
        let limits = Limits { max_bytes: Some(2 * each + each / 2), retention: None };
        let swept = sweep(out.path(), std::slice::from_ref(&dirs[0]), limits, SystemTime::now());
        let removed: Vec<PathBuf> = swept.removed.iter().map(|(p, _)| p.clone()).collect();
        assert_eq!(removed, vec![dirs[1].clone(), dirs[2].clone()]);
        assert!(!swept.over_cap && swept.bytes == 2 * each);
        // Running jobs alone over the cap: nothing of theirs is removed, and the sweep says so.
        let limits = Limits { max_bytes: Some(each / 2), retention: None };
        let swept = sweep(out.path(), &[dirs[0].clone(), dirs[3].clone()], limits, SystemTime::now());
        assert!(swept.removed.is_empty() && swept.over_cap);
    }
}
