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
//!   (`probes --lib --arch`, which attaches nothing, reads another architecture's files instead.)
//!
//! Accepted files are mapped read-only, not read: the parsers touch only the headers and tables
//! they need, so a large library costs address space, not memory. A mapped file that shrinks
//! under the mapping makes the next access to a page past its new end a SIGBUS, which would kill
//! the tracer; the target can do that to a library of its own (or a file its maps name) at any
//! time. So a mapping is held only under a read lease (`F_SETLEASE`, `F_RDLCK`; root has
//! `CAP_LEASE`, and anyone may lease a file they own):
//! - while it is held, whoever truncates the file or opens it for writing waits in the kernel
//!   until the lease is given back, which is when the [`Mapped`] is dropped (after the parse,
//!   milliseconds). The kernel takes a lease back itself after `/proc/sys/fs/lease-break-time`
//!   (45 s by default), so only a parse longer than that could still see the file shrink;
//! - a file open for writing now cannot be leased (`EAGAIN`) and is refused: it is being
//!   written, so its symbols are not to be trusted either (on NFS and SMB, whose clients say
//!   `EAGAIN` whenever the server holds back a delegation, it is copied as below instead);
//! - the break is announced by SIGIO, whose default action would end the tracer: a no-op
//!   handler is installed before the first lease (a handler, not `SIG_IGN`, so that a program
//!   launched by the tracer does not inherit an ignored SIGIO).
//!
//! Where no lease can be had for another reason (a file system without leases, such as NFS; an
//! unprivileged user and a file of someone else's), the file is read with `pread` into memory
//! instead, up to [`MAX_COPY_BYTES`]: a file that shrinks then gives a short read, an error,
//! never a fault. Larger ones are refused. Reading everything through `pread` (object's
//! `ReadCache`) was the other way: it would need every parser generic over the reader, and it
//! reads each section it touches into memory, which for the DWARF of a large debug file is
//! gigabytes where a mapping costs page cache.

use std::fs::File;
use std::io::Read as _;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use thiserror::Error;

use super::usdt_args::Arch;

/// The largest file accepted as a library (2 GiB).
pub const MAX_LIBRARY_BYTES: u64 = 2 << 30;
/// The largest file accepted as a separate debug file (8 GiB): DWARF of a large C++ library can
/// be several times the library's size.
pub const MAX_DEBUG_FILE_BYTES: u64 = 8 << 30;
/// The largest file copied into memory where it cannot be leased (512 MiB): five times
/// torch_npu 2.14's `libtorch_npu.so` (97 MB), the largest real candidate, and a passing cost
/// (freed when the parse is done).
pub const MAX_COPY_BYTES: u64 = 512 << 20;

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
    #[error("{path} is {found}, not a 64-bit {expected} ELF file (the architecture read here; `probes --lib PATH --arch ARCH` checks another's files)")]
    WrongMachine { path: PathBuf, found: String, expected: &'static str },
    #[error("{path} is open for writing by another process, so it is not read (it may change under the tracer); trace again once it is written")]
    BeingWritten { path: PathBuf },
    #[error("{path} cannot be leased against truncation, and at {size} bytes it is over the {limit}-byte limit for reading it into memory instead; it is not read")]
    NoLease { path: PathBuf, size: u64, limit: u64, source: std::io::Error },
    #[error("cannot read {path}")]
    Read { path: PathBuf, source: std::io::Error },
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

/// A file's bytes, mapped read-only under a read lease, or copied (see the module doc).
pub struct Mapped {
    bytes: Bytes,
    /// Holds the lease; declared after `bytes`, so the mapping goes first.
    _leased: Option<File>,
}

enum Bytes {
    Empty,
    Map(memmap2::Mmap),
    Copy(Vec<u8>),
}

impl std::ops::Deref for Mapped {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.bytes {
            Bytes::Empty => &[],
            Bytes::Map(map) => map,
            Bytes::Copy(bytes) => bytes,
        }
    }
}

impl Mapped {
    /// Whether the bytes are a leased mapping (not a copy).
    #[cfg(test)]
    pub fn is_leased(&self) -> bool {
        self._leased.is_some()
    }
}

extern "C" fn on_lease_break(_: libc::c_int) {}

/// Keeps SIGIO, which announces a lease break, from ending the process (once, and only where
/// nothing else handles it).
fn survive_lease_breaks() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: sigaction with a valid, async-signal-safe (empty) handler; the old action is
        // read first so that a handler someone else installed is kept.
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGIO, std::ptr::null(), &mut old) != 0 || old.sa_sigaction != libc::SIG_DFL {
                return;
            }
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_lease_break as extern "C" fn(libc::c_int) as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(libc::SIGIO, &action, std::ptr::null_mut());
        }
    });
}

/// Takes a read lease on `file`.
fn lease(file: &File) -> std::io::Result<()> {
    survive_lease_breaks();
    // SAFETY: fcntl on a descriptor we own; F_SETLEASE takes an int argument.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETLEASE, libc::F_RDLCK) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Whether `file` is on NFS or SMB, whose clients answer a lease request with `EAGAIN` whenever
/// the server has granted no delegation (oplock), writers or not: there it means "no lease".
fn on_network_file_system(file: &File) -> bool {
    const NFS: i64 = 0x6969;
    const SMB: i64 = 0x517b;
    const CIFS: i64 = 0xff53_4d42;
    const SMB2: i64 = 0xfe53_4d42;
    // SAFETY: statfs is plain data, for which all-zero bytes are valid.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: fstatfs on a descriptor we own, into a struct of the right type.
    if unsafe { libc::fstatfs(file.as_raw_fd(), &mut fs) } != 0 {
        return false;
    }
    #[allow(clippy::unnecessary_cast, reason = "f_type's width differs between architectures")]
    let kind = fs.f_type as i64;
    matches!(kind, NFS | SMB | CIFS | SMB2)
}

/// Maps a regular file of at most `limit` bytes, under a read lease (or copies it, see the
/// module doc).
pub fn map(path: &Path, limit: u64) -> Result<Mapped, FileError> {
    let (file, _) = open_regular(path, limit)?;
    let leased = match lease(&file) {
        Ok(()) => true,
        Err(e) if e.raw_os_error() == Some(libc::EAGAIN) && !on_network_file_system(&file) => {
            return Err(FileError::BeingWritten { path: path.to_owned() })
        }
        Err(source) => {
            let size = file.metadata().map_err(|source| FileError::Read { path: path.to_owned(), source })?.len();
            if size > MAX_COPY_BYTES {
                return Err(FileError::NoLease { path: path.to_owned(), size, limit: MAX_COPY_BYTES, source });
            }
            false
        }
    };
    // The size that counts is the one under the lease: the file may have shrunk before it.
    let read_err = |source| FileError::Read { path: path.to_owned(), source };
    let size = file.metadata().map_err(read_err)?.len();
    if size == 0 {
        return Ok(Mapped { bytes: Bytes::Empty, _leased: None });
    }
    if !leased {
        let mut bytes = vec![0u8; usize::try_from(size).unwrap_or(usize::MAX)];
        // A file that shrank meanwhile ends the read early: an error, not a fault.
        file.read_exact_at(&mut bytes, 0).map_err(read_err)?;
        return Ok(Mapped { bytes: Bytes::Copy(bytes), _leased: None });
    }
    // SAFETY: a read-only private mapping of a file under a read lease: no one can shrink it
    // before the lease is given back, which is after the mapping is gone (see `Mapped`).
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(read_err)?;
    Ok(Mapped { bytes: Bytes::Map(map), _leased: Some(file) })
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

/// The ELF machine of the architecture whose files are read (with its name): the host's, but
/// under `probes --lib --arch` ([`Arch::of_files`]).
fn files_machine() -> (u16, &'static str) {
    match Arch::of_files() {
        Some(Arch::Aarch64) => (EM_AARCH64, "aarch64"),
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
    let (want, expected) = files_machine();
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
        let (host, _) = files_machine();
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

    /// Truncates `path` from another thread; returns when the truncation returned, seen from here.
    fn truncate_in_background(path: &Path) -> std::sync::mpsc::Receiver<std::time::Instant> {
        let (tx, rx) = std::sync::mpsc::channel();
        let path = path.to_owned();
        std::thread::spawn(move || {
            // As a target would: open for writing with O_TRUNC (a lease break, like truncate(2)).
            let file = std::fs::OpenOptions::new().write(true).truncate(true).open(&path).unwrap();
            drop(file);
            let _ = tx.send(std::time::Instant::now());
        });
        rx
    }

    #[test]
    fn a_library_truncated_while_parsed_neither_faults_nor_changes_under_the_parser() {
        let dir = scratch("truncate");
        let lib = dir.join("libascendcl.so.9");
        // A real ELF with a .symtab near its end: the parse touches the last pages.
        let original = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        std::fs::write(&lib, &original).unwrap();
        let data = map_library(&lib).unwrap();
        let truncated = truncate_in_background(&lib);
        // Time for the truncation to run (it would, at once, without the lease).
        std::thread::sleep(std::time::Duration::from_millis(300));
        let wanted: std::collections::HashSet<String> = ["main".to_owned()].into();
        let symbols =
            crate::attach::elf::ElfSymbols::parse(&data, &wanted.into()).expect("the parse sees the whole file");
        assert!(symbols.get("main").is_some());
        // Every byte, last page included, is still the file's (a fault here would be a SIGBUS).
        assert!(*data == original[..], "the bytes changed under the parser");
        if data.is_leased() {
            assert!(truncated.try_recv().is_err(), "the truncation waits while the file is leased");
        } else {
            println!("note: {} could not be leased here; it was read into memory", lib.display());
        }
        let released = std::time::Instant::now();
        drop(data);
        let done = truncated.recv_timeout(std::time::Duration::from_secs(10)).expect("the truncation goes on");
        assert!(done >= released, "the truncation finished only once the mapping was given back");
        assert_eq!(std::fs::metadata(&lib).unwrap().len(), 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_library_open_for_writing_is_refused_where_leases_are_had() {
        let dir = scratch("writer");
        let lib = dir.join("libascendcl.so.9");
        std::fs::copy(std::env::current_exe().unwrap(), &lib).unwrap();
        // Ground truth for whether this file system and user can lease at all: the kernel.
        let probe = File::open(&lib).unwrap();
        if let Err(e) = lease(&probe) {
            println!("SKIPPED: no read lease on {} ({e}); such files are copied, not mapped", lib.display());
            return;
        }
        drop(probe);
        let writer = std::fs::OpenOptions::new().append(true).open(&lib).unwrap();
        let err = map_library(&lib).err().expect("refused while open for writing");
        assert!(matches!(err, FileError::BeingWritten { .. }), "{err}");
        assert!(err.to_string().contains("open for writing"), "{err}");
        drop(writer);
        assert!(map_library(&lib).unwrap().is_leased(), "accepted once the writer is gone");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Drops CAP_LEASE from this thread's effective set (capabilities are per thread), so that
    /// a file of another user cannot be leased from it, as for an unprivileged tracer.
    fn drop_cap_lease_in_this_thread() -> bool {
        const CAP_LEASE: u32 = 28;
        #[repr(C)]
        struct Header {
            version: u32,
            pid: i32,
        }
        #[repr(C)]
        #[derive(Clone, Copy, Default)]
        struct Data {
            effective: u32,
            permitted: u32,
            inheritable: u32,
        }
        let mut header = Header { version: 0x2008_0522, pid: 0 };
        let mut data = [Data::default(); 2];
        // SAFETY: capget/capset (version 3: two data words) on the calling thread.
        unsafe {
            if libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) != 0 {
                return false;
            }
            data[0].effective &= !(1 << CAP_LEASE);
            libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) == 0
        }
    }

    #[test]
    fn a_file_that_cannot_be_leased_is_read_into_memory_and_a_large_one_refused() {
        // SAFETY: no arguments.
        if unsafe { libc::geteuid() } != 0 {
            println!("SKIPPED: needs root, to hand a file to another user and drop CAP_LEASE");
            return;
        }
        let dir = scratch("nolease");
        let lib = dir.join("libascendcl.so.9");
        let original = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        std::fs::write(&lib, &original).unwrap();
        let big = dir.join("libascend_hal.so");
        File::create(&big).unwrap().set_len(MAX_COPY_BYTES + 1).unwrap();
        for f in [&lib, &big] {
            std::os::unix::fs::chown(f, Some(65534), Some(65534)).unwrap();
        }
        let (lib2, big2) = (lib.clone(), big.clone());
        std::thread::spawn(move || {
            assert!(drop_cap_lease_in_this_thread(), "capset");
            // Ground truth that this thread cannot lease it: the kernel says so.
            assert!(lease(&File::open(&lib2).unwrap()).is_err(), "a lease without CAP_LEASE on another's file");
            let data = map_library(&lib2).unwrap();
            assert!(!data.is_leased());
            // A copy: whatever happens to the file now, the bytes stay.
            std::fs::OpenOptions::new().write(true).truncate(true).open(&lib2).unwrap();
            assert!(*data == original[..]);
            let wanted: std::collections::HashSet<String> = ["main".to_owned()].into();
            assert!(crate::attach::elf::ElfSymbols::parse(&data, &wanted.into()).unwrap().get("main").is_some());
            let err = map(&big2, MAX_LIBRARY_BYTES).err().expect("too large to copy");
            assert!(matches!(err, FileError::NoLease { size, .. } if size == MAX_COPY_BYTES + 1), "{err}");
        })
        .join()
        .unwrap();
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
