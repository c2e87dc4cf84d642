//! Where a run's files go, following msMemScope's layout so tools that walk it find them:
//!
//! ```text
//! <output>/memscope_<pid>_<YYYYmmddHHMMSS>_ascend/
//!     device_<id>/dump/memscope_dump_<YYYYmmddHHMMSS>.db|.csv
//!     device_cpu/dump/...        host memory
//!     device_unknown/dump/...    device memory whose device the trace could not learn
//! ```
//!
//! Insight only accepts files named `memscope_dump_<digits>.db`, so the stamp is digits only.

use std::fs;
use std::path::{Path, PathBuf};

use super::StoreError;
use crate::model::DeviceKey;

#[derive(Clone, Debug)]
pub struct RunLayout {
    root: PathBuf,
    stamp: String,
}

/// Local time as `YYYYmmddHHMMSS`.
pub fn local_stamp(wall_secs: i64) -> String {
    let t: libc::time_t = wall_secs;
    // SAFETY: zeroed tm is a valid out-parameter for localtime_r.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    // SAFETY: both pointers are valid for the call.
    unsafe { libc::localtime_r(&t, &mut tm) };
    format!(
        "{:04}{:02}{:02}{:02}{:02}{:02}",
        tm.tm_year + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec
    )
}

/// Checks that `dir` can hold output, creating it if needed.
pub fn ensure_writable(dir: &Path) -> Result<(), StoreError> {
    fs::create_dir_all(dir).map_err(|source| StoreError::Io { path: dir.to_owned(), source })?;
    let probe = dir.join(format!(".memscope-write-test-{}", std::process::id()));
    fs::write(&probe, b"").map_err(|source| StoreError::Io { path: dir.to_owned(), source })?;
    let _ = fs::remove_file(&probe);
    Ok(())
}

impl RunLayout {
    /// Creates the run folder under `output`. A second run in the same second gets a suffix
    /// rather than mixing its files into the first one's.
    pub fn create(output: &Path, pid: u32, wall_secs: i64) -> Result<Self, StoreError> {
        ensure_writable(output)?;
        let stamp = local_stamp(wall_secs);
        let base = format!("memscope_{pid}_{stamp}_ascend");
        let mut root = output.join(&base);
        let mut n = 1;
        loop {
            match fs::create_dir(&root) {
                Ok(()) => break,
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    n += 1;
                    root = output.join(format!("{base}_{n}"));
                }
                Err(source) => return Err(StoreError::Io { path: root, source }),
            }
        }
        Ok(Self { root, stamp })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn device_dir(&self, device: DeviceKey) -> PathBuf {
        let name = match device {
            DeviceKey::Npu(n) => format!("device_{n}"),
            DeviceKey::Cpu => "device_cpu".to_owned(),
            DeviceKey::Unknown => "device_unknown".to_owned(),
        };
        self.root.join(name)
    }

    pub fn dump_dir(&self, device: DeviceKey) -> PathBuf {
        self.device_dir(device).join("dump")
    }

    pub fn dump_file(&self, device: DeviceKey, ext: &str) -> PathBuf {
        self.dump_dir(device).join(format!("memscope_dump_{}.{ext}", self.stamp))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_match_what_insight_accepts() {
        let tmp = std::env::temp_dir().join(format!("memscope-layout-{}", std::process::id()));
        let layout = RunLayout::create(&tmp, 42, 1_700_000_000).unwrap();
        let file = layout.dump_file(DeviceKey::Npu(1), "db");
        let name = file.file_name().unwrap().to_str().unwrap();
        // Insight: ^(memscope|leaks)_dump_\d+\.db$
        let digits = name.strip_prefix("memscope_dump_").unwrap().strip_suffix(".db").unwrap();
        assert_eq!(digits.len(), 14);
        assert!(digits.bytes().all(|b| b.is_ascii_digit()), "{name}");
        assert!(file.to_str().unwrap().contains("/device_1/dump/"));
        let again = RunLayout::create(&tmp, 42, 1_700_000_000).unwrap();
        assert_ne!(again.root(), layout.root(), "a second run must not reuse the folder");
        fs::remove_dir_all(&tmp).unwrap();
    }
}
