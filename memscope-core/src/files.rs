//! The files a user names: inputs opened as regular files only, never blocking; outputs never
//! written through a symlink another user planted, nor through a guessable temporary name.
//!
//! A FIFO named as a DB (`mkfifo f.db; analyze f.db`) blocked every offline verb forever in its
//! first read, and a device node would be read without end. Every input is therefore opened
//! non-blocking and checked to be a regular file before a byte is read; anything else is one
//! error that says what the path is.
//!
//! Outputs are written as root into folders other users can write (`/tmp`, a shared scratch
//! folder): a temporary file there is created exclusively under a name nobody can plant in
//! advance ([`create_temp_beside`]), and a symlink owned by someone else in a sticky folder is
//! refused ([`refuse_planted_symlink`]), as the kernel's `fs.protected_symlinks` would.

use std::fs::File;
use std::io::{self, Read as _};
use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// What a path that is not a regular file is, in words.
pub fn what(kind: std::fs::FileType) -> &'static str {
    if kind.is_fifo() {
        "a FIFO (named pipe)"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_dir() {
        "a folder"
    } else {
        "not a regular file"
    }
}

/// Opens `path` for reading if it is a regular file (following symlinks); otherwise an
/// `InvalidInput` error saying what it is.
pub fn open_regular(path: &Path) -> io::Result<File> {
    // O_NONBLOCK: opening a FIFO with no writer must not wait; it changes nothing for a file.
    let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path)?;
    let kind = file.metadata()?.file_type();
    if !kind.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is {}, not a regular file", path.display(), what(kind)),
        ));
    }
    Ok(file)
}

/// The text of the regular file `path`, refused past `limit` bytes (a typo naming a large file
/// must not fill memory).
pub fn read_text(path: &Path, limit: u64) -> io::Result<String> {
    let file = open_regular(path)?;
    let mut text = String::new();
    file.take(limit + 1).read_to_string(&mut text)?;
    if text.len() as u64 > limit {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} is over {limit} bytes, more than such a file ever needs", path.display()),
        ));
    }
    Ok(text)
}

/// Refuses `path` when it is a symlink in a sticky, world-writable folder that belongs neither
/// to this process's user nor to the folder's owner: another user planted it, and following it
/// would write where they chose (`/tmp/out.html -> /etc/passwd`).
pub fn refuse_planted_symlink(path: &Path) -> io::Result<()> {
    let Ok(link) = std::fs::symlink_metadata(path) else { return Ok(()) };
    if !link.file_type().is_symlink() {
        return Ok(());
    }
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let folder = std::fs::metadata(parent)?;
    let mode = folder.permissions().mode();
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if mode & 0o1000 != 0 && mode & 0o002 != 0 && link.uid() != me && link.uid() != folder.uid() {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{} is a symlink that user {} made in the shared folder {}: not following it; name a path of your own",
                path.display(),
                link.uid(),
                parent.display()
            ),
        ));
    }
    Ok(())
}

/// Creates a new, empty file beside `target` (same folder), exclusively (`O_EXCL|O_NOFOLLOW`):
/// never through a symlink, never over an existing file, which is what makes it safe. The name
/// (pid, a counter, the clock's nanoseconds) only makes a planted clash unlikely; a clash is
/// retried under another name.
pub fn create_temp_beside(target: &Path) -> io::Result<(PathBuf, File)> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let name = target.file_name().map_or_else(|| "out".into(), |n| n.to_string_lossy().into_owned());
    let mut tries = 0;
    loop {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let unique = format!("{}-{}-{nanos:08x}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed));
        let temp = target.with_file_name(format!(".{name}.{unique}.partial"));
        match std::fs::OpenOptions::new().write(true).create_new(true).custom_flags(libc::O_NOFOLLOW).open(&temp) {
            Ok(file) => return Ok((temp, file)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && tries < 16 => tries += 1,
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fifo_a_device_and_a_folder_are_refused_at_once_and_a_file_is_read() {
        let dir = std::env::temp_dir().join(format!("memscope-files-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("f.db");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        // Would block forever before the check existed (no writer on the FIFO).
        let err = open_regular(&fifo).unwrap_err();
        assert!(err.to_string().contains("FIFO"), "{err}");
        assert!(open_regular(Path::new("/dev/zero")).unwrap_err().to_string().contains("character device"));
        assert!(open_regular(&dir).is_err());
        let file = dir.join("a.txt");
        std::fs::write(&file, "hello").unwrap();
        assert_eq!(read_text(&file, 5).unwrap(), "hello");
        assert!(read_text(&file, 4).unwrap_err().to_string().contains("over 4 bytes"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
