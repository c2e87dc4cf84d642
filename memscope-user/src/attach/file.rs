//! Opening the files a traced process names (its maps, its `ASCEND_HOME_PATH`, a library's debug
//! link) without trusting them.
//!
//! The tracer runs as root and these paths are the target's to choose, so a candidate is checked
//! before any of its bytes is used:
//! - it must be a regular file: a FIFO would block a read for ever and a device such as
//!   `/dev/zero` never ends. The type is checked with `stat` before opening and again with
//!   `fstat` on the descriptor, which is opened `O_NONBLOCK` so that a FIFO swapped in between
//!   cannot hang the open itself;
//! - it must be at most [`MAX_LIBRARY_BYTES`] ([`MAX_DEBUG_FILE_BYTES`] for a debug file): the
//!   largest real candidates (torch_npu) are well below, and a larger file is not a library;
//! - an ELF candidate must be a 64-bit ELF of this machine (`e_machine` of the architecture the
//!   tracer runs on, the only one whose calling convention its probes decode): an aarch64 or
//!   i386 copy named like a runtime library would otherwise be probed at meaningless offsets.
//!
//! Accepted files are mapped read-only, not read: the parsers touch only the headers and tables
//! they need, so a large library costs address space, not memory. A file truncated while mapped
//! would fault on access; that needs the target to truncate a library it maps itself.

use std::fs::File;
use std::io::Read as _;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use thiserror::Error;

/// The largest file accepted as a library (2 GiB).
pub const MAX_LIBRARY_BYTES: u64 = 2 << 30;
/// The largest file accepted as a separate debug file (8 GiB): DWARF of a large C++ library can
/// be several times the library's size.
pub const MAX_DEBUG_FILE_BYTES: u64 = 8 << 30;

#[derive(Debug, Error)]
pub enum FileError {
    #[error("cannot open {path}")]
    Open { path: PathBuf, source: std::io::Error },
    #[error("{path} is not a regular file (it is {kind})")]
    NotRegular { path: PathBuf, kind: &'static str },
    #[error("{path} is {size} bytes, over the {limit}-byte limit for a candidate file; it is not read")]
    TooLarge { path: PathBuf, size: u64, limit: u64 },
    #[error("{path} is not an ELF file")]
    NotElf { path: PathBuf },
    #[error("{path} is {found}, not a 64-bit {expected} ELF file (the architecture traced here)")]
    WrongMachine { path: PathBuf, found: String, expected: &'static str },
}

/// What a file type that is not a regular file is, in words.
fn kind_of(file_type: std::fs::FileType) -> Option<&'static str> {
    if file_type.is_file() {
        None
    } else if file_type.is_dir() {
        Some("a folder")
    } else if file_type.is_fifo() {
        Some("a FIFO")
    } else if file_type.is_char_device() {
        Some("a character device")
    } else if file_type.is_block_device() {
        Some("a block device")
    } else if file_type.is_socket() {
        Some("a socket")
    } else {
        Some("not a file")
    }
}

/// Whether `path` (symlinks followed) is a regular file, as a reason when it is not.
pub fn check_regular(path: &Path) -> Result<std::fs::Metadata, FileError> {
    let meta = std::fs::metadata(path).map_err(|source| FileError::Open { path: path.to_owned(), source })?;
    match kind_of(meta.file_type()) {
        None => Ok(meta),
        Some(kind) => Err(FileError::NotRegular { path: path.to_owned(), kind }),
    }
}

/// Opens a regular file of at most `limit` bytes; returns it with its size.
pub fn open_regular(path: &Path, limit: u64) -> Result<(File, u64), FileError> {
    check_regular(path)?;
    let open_err = |source| FileError::Open { path: path.to_owned(), source };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
        .open(path)
        .map_err(open_err)?;
    // The path may name something else by now: what counts is what was opened.
    let meta = file.metadata().map_err(open_err)?;
    if let Some(kind) = kind_of(meta.file_type()) {
        return Err(FileError::NotRegular { path: path.to_owned(), kind });
    }
    if meta.len() > limit {
        return Err(FileError::TooLarge { path: path.to_owned(), size: meta.len(), limit });
    }
    Ok((file, meta.len()))
}

/// A file's bytes, mapped read-only (empty files have no mapping).
pub struct Mapped {
    map: Option<memmap2::Mmap>,
}

impl std::ops::Deref for Mapped {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.map.as_deref().unwrap_or_default()
    }
}

/// Maps a regular file of at most `limit` bytes.
pub fn map(path: &Path, limit: u64) -> Result<Mapped, FileError> {
    let (file, size) = open_regular(path, limit)?;
    if size == 0 {
        return Ok(Mapped { map: None });
    }
    // SAFETY: a read-only private mapping; see the module doc for a file truncated meanwhile.
    let map =
        unsafe { memmap2::Mmap::map(&file) }.map_err(|source| FileError::Open { path: path.to_owned(), source })?;
    Ok(Mapped { map: Some(map) })
}

/// A candidate library: a regular file of at most [`MAX_LIBRARY_BYTES`], an ELF of this machine.
pub fn map_library(path: &Path) -> Result<Mapped, FileError> {
    let data = map(path, MAX_LIBRARY_BYTES)?;
    check_elf(path, &data)?;
    Ok(data)
}

/// A candidate debug file: as [`map_library`], up to [`MAX_DEBUG_FILE_BYTES`].
pub fn map_debug_file(path: &Path) -> Result<Mapped, FileError> {
    let data = map(path, MAX_DEBUG_FILE_BYTES)?;
    check_elf(path, &data)?;
    Ok(data)
}

/// The CRC-32 of a whole debug-file candidate, read in pieces (its pages never all stay resident).
pub fn crc32(path: &Path) -> Result<u32, FileError> {
    let (mut file, _) = open_regular(path, MAX_DEBUG_FILE_BYTES)?;
    let mut hasher = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match file.read(&mut buf) {
            Ok(0) => return Ok(hasher.finalize()),
            Ok(n) => hasher.update(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(source) => return Err(FileError::Open { path: path.to_owned(), source }),
        }
    }
}

const EM_386: u16 = 3;
const EM_ARM: u16 = 40;
const EM_X86_64: u16 = 62;
const EM_AARCH64: u16 = 183;
const EM_RISCV: u16 = 243;

/// The ELF machine of the architecture this binary runs on (with its name).
fn host_machine() -> (u16, &'static str) {
    match std::env::consts::ARCH {
        "aarch64" => (EM_AARCH64, "aarch64"),
        _ => (EM_X86_64, "x86-64"),
    }
}

fn machine_name(machine: u16) -> String {
    match machine {
        EM_386 => "i386".into(),
        EM_ARM => "arm".into(),
        EM_X86_64 => "x86-64".into(),
        EM_AARCH64 => "aarch64".into(),
        EM_RISCV => "riscv".into(),
        other => format!("machine {other}"),
    }
}

/// Refuses what is not a 64-bit little-endian ELF of this machine, from its first 20 bytes.
pub fn check_elf(path: &Path, data: &[u8]) -> Result<(), FileError> {
    if data.len() < 20 || !data.starts_with(b"\x7fELF") {
        return Err(FileError::NotElf { path: path.to_owned() });
    }
    let (class, little) = (data[4], data[5] == 1);
    let machine =
        if little { u16::from_le_bytes([data[18], data[19]]) } else { u16::from_be_bytes([data[18], data[19]]) };
    let (want, expected) = host_machine();
    if class == 2 && little && machine == want {
        return Ok(());
    }
    let bits = if class == 1 { "a 32-bit" } else { "a 64-bit" };
    let endian = if little { "" } else { " big-endian" };
    let found = format!("{bits}{endian} {} ELF file", machine_name(machine));
    Err(FileError::WrongMachine { path: path.to_owned(), found, expected })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("memscope-file-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// An ELF header with the given class, data encoding and machine (the rest zero).
    fn header(class: u8, data: u8, machine: u16) -> Vec<u8> {
        let mut h = vec![0u8; 64];
        h[..4].copy_from_slice(b"\x7fELF");
        h[4] = class;
        h[5] = data;
        h[6] = 1;
        let m = if data == 1 { machine.to_le_bytes() } else { machine.to_be_bytes() };
        h[18..20].copy_from_slice(&m);
        h
    }

    #[test]
    fn this_test_binary_is_accepted() {
        let exe = std::env::current_exe().unwrap();
        let data = map_library(&exe).unwrap();
        assert_eq!(&data[..4], b"\x7fELF");
    }

    #[test]
    fn other_machines_and_non_elf_files_are_refused() {
        let (host, _) = host_machine();
        let other = if host == EM_X86_64 { EM_AARCH64 } else { EM_X86_64 };
        let p = Path::new("libascendcl.so");
        assert!(check_elf(p, &header(2, 1, host)).is_ok());
        let err = check_elf(p, &header(2, 1, other)).unwrap_err();
        assert!(matches!(err, FileError::WrongMachine { .. }), "{err}");
        let err = check_elf(p, &header(1, 1, EM_386)).unwrap_err().to_string();
        assert!(err.contains("32-bit i386"), "{err}");
        assert!(matches!(check_elf(p, b"garbage that is long enough"), Err(FileError::NotElf { .. })));
        assert!(matches!(check_elf(p, b"\x7fELF"), Err(FileError::NotElf { .. })));
    }

    #[test]
    fn a_fifo_is_refused_without_blocking() {
        let dir = scratch("fifo");
        let fifo = dir.join("libascendcl.so.9");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        // No writer ever opens it: a blocking open would never return.
        let err = map_library(&fifo).err().unwrap();
        assert!(matches!(err, FileError::NotRegular { kind: "a FIFO", .. }), "{err}");
        let err = open_regular(Path::new("/dev/zero"), MAX_LIBRARY_BYTES).unwrap_err();
        assert_eq!(err.to_string(), "/dev/zero is not a regular file (it is a character device)");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_file_over_the_limit_is_refused_before_reading() {
        let dir = scratch("big");
        let big = dir.join("libascendcl.so.9");
        // Sparse: the size without the disk space.
        File::create(&big).unwrap().set_len(MAX_LIBRARY_BYTES + 1).unwrap();
        let err = map_library(&big).err().unwrap();
        assert!(matches!(err, FileError::TooLarge { size, .. } if size == MAX_LIBRARY_BYTES + 1), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn crc_of_a_file_is_the_crc_of_its_bytes() {
        let dir = scratch("crc");
        let f = dir.join("x.debug");
        let bytes: Vec<u8> = (0..200_000u32).map(|i| (i * 7) as u8).collect();
        std::fs::write(&f, &bytes).unwrap();
        assert_eq!(crc32(&f).unwrap(), crc32fast::hash(&bytes));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
