//! Where a run's files go, following msMemScope's layout so tools that walk it find them:
//!
//! ```text
//! <output>/memscope_<pid>_<YYYYmmddHHMMSS>_ascend/
//!     device_<id>/dump/memscope_dump_<YYYYmmddHHMMSS>.db|.csv
//!     device_cpu/dump/...        host memory
//!     unknown_device_<YYYYmmddHHMMSS>.db|.csv   calls whose device the trace could not learn
//! ```
//!
//! Insight only accepts files named `memscope_dump_<digits>.db`, so the stamp is digits only. It
//! also ignores every row whose `Device Id` is `N/A`, and says "No memory events could be found"
//! of a file holding only such rows: calls of a thread whose device is unknown therefore go to a
//! run-level file under another name, never to a device file Insight cannot open.
//!
//! Folders are 0700 and files 0600, handed to the `sudo` user when there is one ([`Owner`]).

use std::fs;
use std::path::{Path, PathBuf};

pub use super::owner::Owner;
use super::StoreError;
use crate::model::DeviceKey;

#[derive(Clone, Debug)]
pub struct RunLayout {
    root: PathBuf,
    stamp: String,
    owner: Owner,
}

/// Local time as `YYYYmmddHHMMSS`.
pub fn local_stamp(wall_secs: i64) -> String {
    let t = wall_secs;
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

/// Checks that `dir` can hold output, creating it if needed (0700, for the `sudo` user).
pub fn ensure_writable(dir: &Path) -> Result<(), StoreError> {
    let io = |source| StoreError::Io { path: dir.to_owned(), source };
    crate::files::refuse_planted_symlink(dir).map_err(io)?;
    Owner::from_env().create_dir_all(dir).map_err(io)?;
    let (probe, _) = crate::files::create_temp_beside(&dir.join(".memscope-write-test")).map_err(io)?;
    let _ = fs::remove_file(&probe);
    Ok(())
}

impl RunLayout {
    /// Creates the run folder under `output`, `memscope_<pid>_<time>_<backend>` (see
    /// `apis::Backend::folder_suffix`). A second run in the same second gets a suffix rather
    /// than mixing its files into the first one's.
    pub fn create(output: &Path, pid: u32, wall_secs: i64, backend: &str) -> Result<Self, StoreError> {
        Self::create_for(output, pid, wall_secs, backend, Owner::from_env())
    }

    /// As [`Self::create`], with the files handed to `owner`.
    pub fn create_for(
        output: &Path,
        pid: u32,
        wall_secs: i64,
        backend: &str,
        owner: Owner,
    ) -> Result<Self, StoreError> {
        ensure_writable(output)?;
        let stamp = local_stamp(wall_secs);
        let base = format!("memscope_{pid}_{stamp}_{backend}");
        let mut root = output.join(&base);
        let mut n = 1;
        loop {
            match owner.create_dir(&root) {
                Ok(()) => break,
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    n += 1;
                    root = output.join(format!("{base}_{n}"));
                }
                Err(source) => return Err(StoreError::Io { path: root, source }),
            }
        }
        Ok(Self { root, stamp, owner })
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

    /// The folder of `device`'s file; the run folder itself for the unknown device.
    pub fn dump_dir(&self, device: DeviceKey) -> PathBuf {
        match device {
            DeviceKey::Unknown => self.root.clone(),
            _ => self.device_dir(device).join("dump"),
        }
    }

    pub fn dump_file(&self, device: DeviceKey, ext: &str) -> PathBuf {
        let name = match device {
            DeviceKey::Unknown => "unknown_device",
            _ => "memscope_dump",
        };
        self.dump_dir(device).join(format!("{name}_{}.{ext}", self.stamp))
    }

    /// Creates `device`'s folder (0700, for the owner).
    pub fn create_dump_dir(&self, device: DeviceKey) -> Result<PathBuf, StoreError> {
        let dir = self.dump_dir(device);
        self.owner.create_dir_all(&dir).map_err(|source| StoreError::Io { path: dir.clone(), source })?;
        Ok(dir)
    }

    /// Creates an empty file of the run (0600, for the owner).
    pub fn create_file(&self, path: &Path) -> Result<fs::File, StoreError> {
        self.owner.create_file(path).map_err(|source| StoreError::Io { path: path.to_owned(), source })
    }

    pub fn owner(&self) -> Owner {
        self.owner
    }

    /// Sets the modes and owner of everything in the run folder, whoever created it.
    pub fn hand_over(&self) -> Result<(), StoreError> {
        self.owner.hand_over_tree(&self.root).map_err(|source| StoreError::Io { path: self.root.clone(), source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_match_what_insight_accepts() {
        let tmp = std::env::temp_dir().join(format!("memscope-layout-{}", std::process::id()));
        let layout = RunLayout::create(&tmp, 42, 1_700_000_000, "ascend").unwrap();
        let file = layout.dump_file(DeviceKey::Npu(1), "db");
        let name = file.file_name().unwrap().to_str().unwrap();
        // Insight: ^(memscope|leaks)_dump_\d+\.db$
        let digits = name.strip_prefix("memscope_dump_").unwrap().strip_suffix(".db").unwrap();
        assert_eq!(digits.len(), 14);
        assert!(digits.bytes().all(|b| b.is_ascii_digit()), "{name}");
        assert!(file.to_str().unwrap().contains("/device_1/dump/"));
        let unknown = layout.dump_file(DeviceKey::Unknown, "db");
        assert_eq!(unknown.parent(), Some(layout.root()), "a run-level file, not a device folder");
        let name = unknown.file_name().unwrap().to_str().unwrap();
        assert!(
            !name.starts_with("memscope_dump_") && !name.starts_with("leaks_dump_"),
            "Insight must not pick it: {name}"
        );
        let again = RunLayout::create(&tmp, 42, 1_700_000_000, "ascend").unwrap();
        assert_ne!(again.root(), layout.root(), "a second run must not reuse the folder");
        fs::remove_dir_all(&tmp).unwrap();
    }
}
