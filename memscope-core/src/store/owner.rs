//! Who may read a run's files, and who owns them.
//!
//! A trace holds heap addresses, the command line and the job's allocator settings, so its
//! folders are created 0700 and its files 0600, whatever the umask. The tracer runs as root;
//! under `sudo` the user who asked for the trace must own the result, or MindStudio Insight
//! refuses to open it ("The path's owner is not current user"): with `SUDO_UID`/`SUDO_GID` set,
//! every folder and file of the run is handed to that user as it is created, and once more at
//! the end ([`Owner::hand_over_tree`]). SQLite creates its `-wal` and `-shm` files with the mode
//! and (when run as root) the owner of the database file, so a DB created here brings them along.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

pub const DIR_MODE: u32 = 0o700;
pub const FILE_MODE: u32 = 0o600;

/// The user and group a run's files are handed to, if not the tracer's own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Owner {
    ids: Option<(u32, u32)>,
}

impl Owner {
    /// `SUDO_UID`/`SUDO_GID` when both are set and valid (as `sudo` sets them), else the tracer's
    /// own user.
    pub fn from_env() -> Self {
        let id = |name| std::env::var(name).ok().and_then(|v| v.trim().parse::<u32>().ok());
        Self::from_ids(id("SUDO_UID"), id("SUDO_GID"))
    }

    pub fn from_ids(uid: Option<u32>, gid: Option<u32>) -> Self {
        Self { ids: uid.zip(gid) }
    }

    /// Gives `path` to the owner (nothing to do without one).
    fn chown(self, path: &Path) -> io::Result<()> {
        match self.ids {
            Some((uid, gid)) => std::os::unix::fs::lchown(path, Some(uid), Some(gid)),
            None => Ok(()),
        }
    }

    /// Creates `dir` 0700 with its missing parents (each 0700 too), handing each one created to
    /// the owner; folders that already exist are left as they are.
    pub fn create_dir_all(self, dir: &Path) -> io::Result<()> {
        if dir.is_dir() {
            return Ok(());
        }
        if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            self.create_dir_all(parent)?;
        }
        match self.create_dir(dir) {
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && dir.is_dir() => Ok(()),
            other => other,
        }
    }

    /// Creates one folder, 0700, for the owner; fails if it exists.
    pub fn create_dir(self, dir: &Path) -> io::Result<()> {
        fs::DirBuilder::new().mode(DIR_MODE).create(dir)?;
        // The umask may have taken bits away; the mode is exact either way.
        fs::set_permissions(dir, fs::Permissions::from_mode(DIR_MODE))?;
        self.chown(dir)
    }

    /// Creates (or empties) a file, 0600, for the owner.
    pub fn create_file(self, path: &Path) -> io::Result<File> {
        let file = OpenOptions::new().write(true).create(true).truncate(true).mode(FILE_MODE).open(path)?;
        file.set_permissions(fs::Permissions::from_mode(FILE_MODE))?;
        self.chown(path)?;
        Ok(file)
    }

    /// Sets the modes and owner of `root` and everything under it: folders 0700, files 0600.
    /// Links are not followed.
    pub fn hand_over_tree(self, root: &Path) -> io::Result<()> {
        let meta = fs::symlink_metadata(root)?;
        if meta.file_type().is_symlink() {
            return Ok(());
        }
        let mode = if meta.is_dir() { DIR_MODE } else { FILE_MODE };
        if meta.permissions().mode() & 0o7777 != mode {
            fs::set_permissions(root, fs::Permissions::from_mode(mode))?;
        }
        self.chown(root)?;
        if meta.is_dir() {
            for entry in fs::read_dir(root)? {
                self.hand_over_tree(&entry?.path())?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn tmp(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("memscope-owner-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    fn mode(path: &Path) -> u32 {
        fs::symlink_metadata(path).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn folders_are_0700_and_files_0600_whatever_the_umask() {
        let root = tmp("modes");
        // SAFETY: umask(2) only swaps the process's mask; restored below.
        let old = unsafe { libc::umask(0) };
        let owner = Owner::default();
        let made = owner.create_dir_all(&root.join("a/b")).and_then(|()| owner.create_file(&root.join("a/b/f.db")));
        // SAFETY: as above.
        unsafe { libc::umask(old) };
        made.unwrap();
        for dir in [&root, &root.join("a"), &root.join("a/b")] {
            assert_eq!(mode(dir), DIR_MODE, "{}", dir.display());
        }
        assert_eq!(mode(&root.join("a/b/f.db")), FILE_MODE);
        // A file some other code created loosely is tightened by the final sweep.
        let loose = root.join("a/loose");
        fs::write(&loose, b"x").unwrap();
        fs::set_permissions(&loose, fs::Permissions::from_mode(0o666)).unwrap();
        owner.hand_over_tree(&root).unwrap();
        assert_eq!(mode(&loose), FILE_MODE);
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn sudo_ids_are_read_only_when_both_are_set() {
        assert_eq!(Owner::from_ids(Some(1000), Some(1000)).ids, Some((1000, 1000)));
        assert_eq!(Owner::from_ids(Some(1000), None).ids, None);
    }

    #[test]
    fn everything_is_handed_to_the_sudo_user() {
        // SAFETY: no arguments.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIPPED: handing files to another user needs root");
            return;
        }
        let root = tmp("chown");
        let owner = Owner::from_ids(Some(65534), Some(65534));
        owner.create_dir_all(&root.join("d")).unwrap();
        owner.create_file(&root.join("d/f")).unwrap();
        fs::write(root.join("d/later"), b"x").unwrap();
        owner.hand_over_tree(&root).unwrap();
        for p in [root.clone(), root.join("d"), root.join("d/f"), root.join("d/later")] {
            let m = fs::metadata(&p).unwrap();
            assert_eq!((m.uid(), m.gid()), (65534, 65534), "{}", p.display());
        }
        fs::remove_dir_all(&root).unwrap();
    }
}
