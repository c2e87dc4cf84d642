//! Opening the files a user names as input: regular files only, never blocking.
//!
//! A FIFO named as a DB (`mkfifo f.db; analyze f.db`) blocked every offline verb forever in its
//! first read, and a device node would be read without end. Every input is therefore opened
//! non-blocking and checked to be a regular file before a byte is read; anything else is one
//! error that says what the path is.

use std::fs::File;
use std::io::{self, Read as _};
use std::os::unix::fs::{FileTypeExt as _, OpenOptionsExt as _};
use std::path::Path;

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
