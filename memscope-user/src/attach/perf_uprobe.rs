//! Attaching a loaded uprobe program at a file offset with a USDT semaphore counter and a cookie,
//! through raw `perf_event_open` and `BPF_LINK_CREATE`, because aya 0.14 has no API for the
//! uprobe's `ref_ctr_offset`.
//!
//! Why the kernel's reference counter rather than writing the semaphore ourselves: with
//! `ref_ctr_offset` the kernel raises the counter in every process that maps the file, including
//! processes started after the attach, and lowers it again when the probe goes away, which
//! happens when its file descriptors close, so also when the tracer is killed with SIGKILL. A
//! tracer that pokes `/proc/PID/mem` covers only the processes it knows, races their start-up,
//! and leaves the counter raised (the probe's argument marshalling switched on for good) if it
//! dies.
//!
//! Why a link with a cookie rather than `PERF_EVENT_IOC_SET_BPF`: the USDT program finds the
//! site's argument spec through `bpf_get_attach_cookie`, and only `BPF_LINK_CREATE` carries a
//! cookie for perf-event attachments. Without it the program would read every site with the
//! wrong spec, so a kernel without it is an error, never a silent fallback.

// Outside tests nothing calls this yet: the USDT attach path in the loader is the next step.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use thiserror::Error;

const UPROBE_PMU: &str = "/sys/bus/event_source/devices/uprobe";

/// `struct perf_event_attr` up to `PERF_ATTR_SIZE_VER5`; later fields are left to the kernel's
/// zero default, which its size check allows.
#[repr(C)]
#[derive(Default)]
struct PerfEventAttr {
    type_: u32,
    size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    /// The bitfield word (`disabled`, `inherit`, ...): all zero, so the event starts enabled.
    flags: u64,
    wakeup_events: u32,
    bp_type: u32,
    /// `uprobe_path`: pointer to the NUL-terminated file path.
    config1: u64,
    /// `probe_offset`: file offset of the probed instruction.
    config2: u64,
    branch_sample_type: u64,
    sample_regs_user: u64,
    sample_stack_user: u32,
    clockid: i32,
    sample_regs_intr: u64,
    aux_watermark: u32,
    sample_max_stack: u16,
    reserved_2: u16,
}

const PERF_ATTR_SIZE_VER5: u32 = 112;
const _: () = assert!(std::mem::size_of::<PerfEventAttr>() == PERF_ATTR_SIZE_VER5 as usize);

const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 1 << 3;
/// `_IO('$', 0)`.
const PERF_EVENT_IOC_ENABLE: libc::c_ulong = 0x2400;

/// The `link_create` member of `union bpf_attr` for a perf-event target.
#[repr(C)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
    /// `perf_event.bpf_cookie`, the first member of the per-target union.
    bpf_cookie: u64,
    /// The rest of the largest union member; must be zero.
    _rest: [u64; 4],
}

const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_PERF_EVENT: u32 = 41;

#[derive(Debug, Error)]
pub enum PerfUprobeError {
    #[error("cannot read {path} (perf uprobes need Linux >= 4.17 with CONFIG_UPROBE_EVENTS)")]
    NoUprobePmu { path: PathBuf, source: io::Error },
    #[error("cannot parse {path}: {text:?}")]
    BadPmuFile { path: PathBuf, text: String },
    #[error(
        "this kernel lacks uprobe ref_ctr_offset support (Linux >= 4.20), which USDT semaphores need: \
         {path} is missing"
    )]
    RefCtrUnsupported { path: PathBuf },
    #[error("semaphore offset {offset:#x} does not fit in the kernel's {bits}-bit ref_ctr_offset field")]
    RefCtrTooLarge { offset: u64, bits: u32 },
    #[error("pid {0} is out of range")]
    BadPid(u32),
    #[error("library path {0:?} contains a NUL byte")]
    PathHasNul(PathBuf),
    #[error("perf_event_open for a uprobe at {path}:{offset:#x} (semaphore offset {ref_ctr_offset:?}) failed")]
    PerfEventOpen { path: PathBuf, offset: u64, ref_ctr_offset: Option<u64>, source: io::Error },
    #[error(
        "BPF_LINK_CREATE for the uprobe at {path}:{offset:#x} failed (BPF cookies on perf events need \
         Linux >= 5.15, and PERF_EVENT_IOC_SET_BPF is not used instead because it would drop the cookie)"
    )]
    LinkCreate { path: PathBuf, offset: u64, source: io::Error },
    #[error("enabling the uprobe at {path}:{offset:#x} failed")]
    Enable { path: PathBuf, offset: u64, source: io::Error },
}

/// An attached uprobe. Dropping it closes the link, then the perf event: the kernel then removes
/// the breakpoint and lowers the semaphore in every process it raised it in. The field order is
/// the drop order, detaching the program before the event goes.
#[derive(Debug)]
pub struct RefCtrProbe {
    link: OwnedFd,
    perf: OwnedFd,
}

#[cfg_attr(not(test), expect(dead_code, reason = "the descriptors are held, not used; tests inspect them"))]
impl RefCtrProbe {
    pub fn perf_fd(&self) -> BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(&self.perf)
    }

    pub fn link_fd(&self) -> BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(&self.link)
    }
}

/// Whether the kernel can keep USDT semaphores for uprobes (`ref_ctr_offset`, Linux 4.20).
pub fn ref_ctr_supported() -> bool {
    Path::new(UPROBE_PMU).join("format/ref_ctr_offset").exists()
}

/// Attaches `prog` (a loaded uprobe program, e.g. aya's `UProbe::fd()`) at `offset` in the file
/// `path`, with `cookie` for `bpf_get_attach_cookie`. With `ref_ctr_offset` (the semaphore's
/// file offset) the kernel counts the probe in that semaphore. `pid` limits the probe to one
/// process; `None` probes every process that maps the file, now or later.
pub fn attach_uprobe(
    prog: BorrowedFd<'_>,
    path: &Path,
    offset: u64,
    ref_ctr_offset: Option<u64>,
    pid: Option<u32>,
    cookie: u64,
) -> Result<RefCtrProbe, PerfUprobeError> {
    let perf = open_uprobe(path, offset, ref_ctr_offset, pid)?;
    let attr = LinkCreateAttr {
        prog_fd: prog.as_raw_fd() as u32,
        target_fd: perf.as_raw_fd() as u32,
        attach_type: BPF_PERF_EVENT,
        flags: 0,
        bpf_cookie: cookie,
        _rest: [0; 4],
    };
    // SAFETY: `attr` is a valid, fully initialised `link_create` attribute of the size passed;
    // the kernel only reads it.
    let fd = unsafe {
        libc::syscall(libc::SYS_bpf, BPF_LINK_CREATE, &attr as *const LinkCreateAttr, std::mem::size_of_val(&attr))
    };
    if fd < 0 {
        // `perf` is dropped here, which unregisters the uprobe and lowers the semaphore again.
        return Err(PerfUprobeError::LinkCreate { path: path.to_owned(), offset, source: io::Error::last_os_error() });
    }
    // SAFETY: a non-negative return of BPF_LINK_CREATE is a new file descriptor we own.
    let link = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    // The event is created enabled; this is for kernels or future flags that start it disabled,
    // and costs one syscall.
    // SAFETY: plain ioctl on a perf event fd we own, no pointer argument.
    if unsafe { libc::ioctl(perf.as_raw_fd(), PERF_EVENT_IOC_ENABLE as _, 0) } < 0 {
        return Err(PerfUprobeError::Enable { path: path.to_owned(), offset, source: io::Error::last_os_error() });
    }
    Ok(RefCtrProbe { link, perf })
}

/// Opens the uprobe perf event alone (no program). The kernel registers the uprobe, and raises
/// the semaphore, when this returns; closing the fd undoes both.
pub(crate) fn open_uprobe(
    path: &Path,
    offset: u64,
    ref_ctr_offset: Option<u64>,
    pid: Option<u32>,
) -> Result<OwnedFd, PerfUprobeError> {
    let pmu = Path::new(UPROBE_PMU);
    let type_ = pmu_type(&pmu.join("type"))?;
    let config = match ref_ctr_offset {
        None => 0,
        Some(ref_ctr) => {
            let format = pmu.join("format/ref_ctr_offset");
            let text = match std::fs::read_to_string(&format) {
                Ok(text) => text,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    return Err(PerfUprobeError::RefCtrUnsupported { path: format })
                }
                Err(source) => return Err(PerfUprobeError::NoUprobePmu { path: format, source }),
            };
            ref_ctr_config(ref_ctr, &text).map_err(|e| e.with_path(format))?
        }
    };
    let c_path = CString::new(path.as_os_str().as_bytes()).map_err(|_| PerfUprobeError::PathHasNul(path.to_owned()))?;
    let pid = match pid {
        None => -1,
        Some(p) => libc::pid_t::try_from(p).map_err(|_| PerfUprobeError::BadPid(p))?,
    };
    // A pid-wide event follows the process on every CPU; a system-wide one must name a CPU, and
    // for uprobes that choice only affects where the perf side counts (the program runs on
    // whichever CPU hits the probe).
    let cpu: libc::c_int = if pid == -1 { 0 } else { -1 };
    let attr = PerfEventAttr {
        type_,
        size: PERF_ATTR_SIZE_VER5,
        config,
        config1: c_path.as_ptr() as u64,
        config2: offset,
        ..PerfEventAttr::default()
    };
    // SAFETY: `attr` is a valid VER5 attribute; `config1` points at `c_path`, which outlives the
    // call. The kernel only reads them.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            &attr as *const PerfEventAttr,
            pid,
            cpu,
            -1 as libc::c_int,
            PERF_FLAG_FD_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(PerfUprobeError::PerfEventOpen {
            path: path.to_owned(),
            offset,
            ref_ctr_offset,
            source: io::Error::last_os_error(),
        });
    }
    // SAFETY: a non-negative return of perf_event_open is a new file descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn pmu_type(path: &Path) -> Result<u32, PerfUprobeError> {
    let text = std::fs::read_to_string(path)
        .map_err(|source| PerfUprobeError::NoUprobePmu { path: path.to_owned(), source })?;
    text.trim().parse().map_err(|_| PerfUprobeError::BadPmuFile { path: path.to_owned(), text })
}

/// Why a PMU format line did not give a usable config field, before the file's path is known.
#[derive(Debug, PartialEq, Eq)]
enum FormatError {
    Unparsable(String),
    TooLarge { offset: u64, bits: u32 },
}

impl FormatError {
    fn with_path(self, path: PathBuf) -> PerfUprobeError {
        match self {
            Self::Unparsable(text) => PerfUprobeError::BadPmuFile { path, text },
            Self::TooLarge { offset, bits } => PerfUprobeError::RefCtrTooLarge { offset, bits },
        }
    }
}

/// Places `ref_ctr` in `config` as the PMU's format file says (`config:32-63` on every kernel so
/// far). Read rather than hard-coded because the format files are the kernel's stated ABI for
/// these bits.
fn ref_ctr_config(ref_ctr: u64, format: &str) -> Result<u64, FormatError> {
    let (lo, hi) = parse_format(format).ok_or_else(|| FormatError::Unparsable(format.to_owned()))?;
    let bits = hi - lo + 1;
    if bits < 64 && ref_ctr >> bits != 0 {
        return Err(FormatError::TooLarge { offset: ref_ctr, bits });
    }
    Ok(ref_ctr << lo)
}

/// `config:LO-HI` or `config:BIT` → the bit range. Fields in `config1`/`config2` are not
/// something this code could fill, so they do not parse.
fn parse_format(text: &str) -> Option<(u32, u32)> {
    let range = text.trim().strip_prefix("config:")?;
    let (lo, hi) = match range.split_once('-') {
        Some((lo, hi)) => (lo.parse().ok()?, hi.parse().ok()?),
        None => {
            let bit = range.parse().ok()?;
            (bit, bit)
        }
    };
    (lo <= hi && hi < 64).then_some((lo, hi))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::offset_of;

    #[test]
    fn attr_layouts_match_the_kernel_abi() {
        // include/uapi/linux/perf_event.h
        assert_eq!(offset_of!(PerfEventAttr, config), 8);
        assert_eq!(offset_of!(PerfEventAttr, flags), 40);
        assert_eq!(offset_of!(PerfEventAttr, config1), 56);
        assert_eq!(offset_of!(PerfEventAttr, config2), 64);
        assert_eq!(offset_of!(PerfEventAttr, sample_max_stack), 108);
        // include/uapi/linux/bpf.h, link_create
        assert_eq!(offset_of!(LinkCreateAttr, attach_type), 8);
        assert_eq!(offset_of!(LinkCreateAttr, bpf_cookie), 16);
    }

    #[test]
    fn format_files_parse() {
        assert_eq!(parse_format("config:32-63\n"), Some((32, 63)));
        assert_eq!(parse_format("config:0"), Some((0, 0)));
        assert_eq!(parse_format("config1:0-63"), None);
        assert_eq!(parse_format("config:63-32"), None);
        assert_eq!(parse_format("config:32-64"), None);
        assert_eq!(parse_format("config:x"), None);
        assert_eq!(parse_format(""), None);
        assert_eq!(ref_ctr_config(0x2010, "config:32-63"), Ok(0x2010 << 32));
        assert_eq!(ref_ctr_config(1 << 32, "config:32-63"), Err(FormatError::TooLarge { offset: 1 << 32, bits: 32 }));
        assert_eq!(ref_ctr_config(u64::MAX, "config:0-63"), Ok(u64::MAX));
        assert!(matches!(ref_ctr_config(1, "config2:0-31"), Err(FormatError::Unparsable(_))));
    }

    #[test]
    fn errors_are_reported_not_panicked() {
        let devnull = std::fs::File::open("/dev/null").unwrap();
        let fd = std::os::fd::AsFd::as_fd(&devnull);
        let err = attach_uprobe(fd, Path::new("a\0b"), 0, None, None, 0).unwrap_err();
        // On a kernel without the uprobe PMU the PMU error comes first.
        assert!(matches!(err, PerfUprobeError::PathHasNul(_) | PerfUprobeError::NoUprobePmu { .. }), "{err}");
        let err = attach_uprobe(fd, Path::new("/nonexistent/memscope"), 0, None, Some(u32::MAX), 0).unwrap_err();
        assert!(matches!(err, PerfUprobeError::BadPid(_) | PerfUprobeError::NoUprobePmu { .. }), "{err}");
        // Unprivileged: EACCES/EPERM; root: ENOENT. Either way an error naming the file.
        let err = attach_uprobe(fd, Path::new("/nonexistent/memscope"), 0, None, None, 0).unwrap_err();
        assert!(!err.to_string().is_empty());
        let _ = ref_ctr_supported();
    }

    /// A running fixture process whose semaphore can be read through `/proc/PID/mem`.
    struct Target {
        child: std::process::Child,
        mem: std::fs::File,
        sema_addr: u64,
    }

    impl Target {
        fn spawn(path: &Path) -> Self {
            use std::io::BufRead;
            let mut child =
                std::process::Command::new(path).arg("30").stdout(std::process::Stdio::piped()).spawn().unwrap();
            let mut line = String::new();
            std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
            let sema_addr = u64::from_str_radix(line.trim().trim_start_matches("0x"), 16).unwrap();
            let mem = std::fs::File::open(format!("/proc/{}/mem", child.id())).unwrap();
            Self { child, mem, sema_addr }
        }

        fn pid(&self) -> u32 {
            self.child.id()
        }

        fn sema(&self) -> u16 {
            use std::os::unix::fs::FileExt;
            let mut b = [0u8; 2];
            self.mem.read_exact_at(&mut b, self.sema_addr).unwrap();
            u16::from_ne_bytes(b)
        }

        fn wait_for(&self, want: u16, what: &str) {
            let start = std::time::Instant::now();
            while self.sema() != want {
                assert!(start.elapsed().as_secs() < 3, "{what}: semaphore is {}, want {want}", self.sema());
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            println!("pid {}: {what}: semaphore = {want}", self.pid());
        }
    }

    impl Drop for Target {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    /// End-to-end checks against the running kernel, on the fixture of `usdt_notes`: the
    /// semaphore goes 0 → 1 → 0 with a bare perf event (pid-wide and system-wide), in a process
    /// started after a system-wide attach too, and when the attaching process is SIGKILLed; a
    /// failed link leaves nothing behind; a BPF program attached through the link sees the cookie.
    #[test]
    #[ignore = "needs root and BPF; run by xtask's privileged tier"]
    fn semaphore_and_cookie_on_a_live_process() {
        use super::super::usdt_notes::{read_notes, tests::compile_fixture};
        use std::io::BufRead;
        use std::time::{Duration, Instant};

        assert!(ref_ctr_supported(), "kernel without uprobe ref_ctr_offset support");
        let fixture = compile_fixture("live", &["-O2"]).expect("a C compiler for the fixture");
        let data = std::fs::read(&fixture.path).unwrap();
        let alloc = read_notes(&data).unwrap().into_iter().find(|n| n.name == "alloc").unwrap();
        let sema_off = alloc.semaphore_offset.unwrap();

        let target = Target::spawn(&fixture.path);
        let pid = target.pid();
        target.wait_for(0, "before attach");

        for pid_filter in [Some(pid), None] {
            let event = open_uprobe(&fixture.path, alloc.file_offset, Some(sema_off), pid_filter).unwrap();
            target.wait_for(1, &format!("perf event open, pid filter {pid_filter:?}"));
            if pid_filter.is_none() {
                let later = Target::spawn(&fixture.path);
                later.wait_for(1, "started after a system-wide attach");
                drop(event);
                later.wait_for(0, "perf event closed");
            } else {
                drop(event);
            }
            target.wait_for(0, &format!("perf event closed, pid filter {pid_filter:?}"));
        }

        // The kernel lowers the counter when a SIGKILLed tracer's fds are closed.
        let mut helper = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["attach::perf_uprobe::tests::sigkill_helper", "--exact", "--ignored", "--nocapture"])
            .env(HELPER_ENV, format!("{}:{}:{}", alloc.file_offset, sema_off, fixture.path.display()))
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = std::io::BufReader::new(helper.stdout.take().unwrap());
        let mut line = String::new();
        while !line.starts_with("attached") {
            line.clear();
            assert!(out.read_line(&mut line).unwrap() > 0, "the helper exited before attaching");
        }
        target.wait_for(1, "attached by a helper process");
        helper.kill().unwrap(); // SIGKILL
        helper.wait().unwrap();
        target.wait_for(0, "helper SIGKILLed");

        // A failed link (the "program" is not a BPF fd) must not leave the uprobe behind.
        let devnull = std::fs::File::open("/dev/null").unwrap();
        let err = attach_uprobe(
            std::os::fd::AsFd::as_fd(&devnull),
            &fixture.path,
            alloc.file_offset,
            Some(sema_off),
            Some(pid),
            1,
        )
        .unwrap_err();
        assert!(matches!(err, PerfUprobeError::LinkCreate { .. }), "{err}");
        println!("{err}");
        target.wait_for(0, "after a failed link");

        let bpf = bpf::CookieProgram::load();
        for (cookie, pid_filter) in [(0x00c0_ffee_1234_5678u64, Some(pid)), (0x42, None)] {
            let probe =
                attach_uprobe(bpf.prog_fd(), &fixture.path, alloc.file_offset, Some(sema_off), pid_filter, cookie)
                    .unwrap();
            target.wait_for(1, &format!("linked, pid filter {pid_filter:?}"));
            let fdinfo =
                |fd: BorrowedFd<'_>| std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd())).unwrap();
            assert!(fdinfo(probe.link_fd()).contains("link_type:\tperf"), "{}", fdinfo(probe.link_fd()));
            let perf_target = std::fs::read_link(format!("/proc/self/fd/{}", probe.perf_fd().as_raw_fd())).unwrap();
            assert!(perf_target.to_string_lossy().contains("perf_event"), "{perf_target:?}");
            let start = Instant::now();
            while bpf.seen() != cookie {
                assert!(start.elapsed() < Duration::from_secs(3), "program saw {:#x}, want {cookie:#x}", bpf.seen());
                std::thread::sleep(Duration::from_millis(5));
            }
            println!("program saw cookie {cookie:#x}");
            drop(probe);
            target.wait_for(0, &format!("link dropped, pid filter {pid_filter:?}"));
        }
        // Without a semaphore the same attach works and leaves the counter alone.
        let probe = attach_uprobe(bpf.prog_fd(), &fixture.path, alloc.file_offset, None, Some(pid), 7).unwrap();
        let start = Instant::now();
        while bpf.seen() != 7 {
            assert!(start.elapsed() < Duration::from_secs(3), "program saw {:#x}, want 7", bpf.seen());
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(target.sema(), 0);
        drop(probe);
    }

    const HELPER_ENV: &str = "MEMSCOPE_TEST_SIGKILL_HELPER";

    /// Run by [`semaphore_and_cookie_on_a_live_process`] in a child process: attaches
    /// system-wide, says so, and waits to be killed. Does nothing when run on its own.
    #[test]
    #[ignore = "needs root and BPF; run by xtask's privileged tier"]
    fn sigkill_helper() {
        let Ok(spec) = std::env::var(HELPER_ENV) else { return };
        let mut parts = spec.splitn(3, ':');
        let offset: u64 = parts.next().unwrap().parse().unwrap();
        let sema: u64 = parts.next().unwrap().parse().unwrap();
        let path = PathBuf::from(parts.next().unwrap());
        let _event = open_uprobe(&path, offset, Some(sema), None).unwrap();
        println!("attached");
        std::thread::sleep(std::time::Duration::from_secs(30));
    }

    /// A hand-assembled uprobe program that stores its attach cookie in an array map: enough BPF
    /// to prove the link carried the cookie without building an eBPF object.
    mod bpf {
        use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};

        pub struct CookieProgram {
            map: OwnedFd,
            prog: OwnedFd,
        }

        fn bpf(cmd: libc::c_long, attr: &mut [u64; 16]) -> libc::c_long {
            // SAFETY: a zero-padded 128-byte attribute; the kernel reads (and for lookups
            // writes through pointers we set) only what the command defines.
            unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), 128usize) }
        }

        /// One instruction: opcode, dst | src << 4, offset, immediate.
        fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> u64 {
            let mut b = [0u8; 8];
            b[0] = code;
            b[1] = dst | (src << 4);
            b[2..4].copy_from_slice(&off.to_le_bytes());
            b[4..8].copy_from_slice(&imm.to_le_bytes());
            u64::from_le_bytes(b)
        }

        impl CookieProgram {
            pub fn load() -> Self {
                // BPF_MAP_CREATE: array, 4-byte key, 8-byte value, 1 entry.
                let mut attr = [0u64; 16];
                attr[0] = 2 | (4 << 32);
                attr[1] = 8 | (1 << 32);
                let map = bpf(0, &mut attr);
                assert!(map >= 0, "BPF_MAP_CREATE: {}", std::io::Error::last_os_error());
                // SAFETY: new fd from the kernel.
                let map = unsafe { OwnedFd::from_raw_fd(map as i32) };
                let fd = std::os::fd::AsRawFd::as_raw_fd(&map);
                let insns = [
                    insn(0x85, 0, 0, 0, 174),  // r0 = bpf_get_attach_cookie(ctx)
                    insn(0x7b, 10, 0, -8, 0),  // *(u64 *)(r10 - 8) = r0
                    insn(0x62, 10, 0, -12, 0), // *(u32 *)(r10 - 12) = 0
                    insn(0x18, 1, 1, 0, fd),   // r1 = map (ld_imm64, pseudo map fd)
                    insn(0, 0, 0, 0, 0),       //
                    insn(0xbf, 2, 10, 0, 0),   // r2 = r10
                    insn(0x07, 2, 0, 0, -12),  // r2 -= 12 (key)
                    insn(0xbf, 3, 10, 0, 0),   // r3 = r10
                    insn(0x07, 3, 0, 0, -8),   // r3 -= 8 (value)
                    insn(0xb7, 4, 0, 0, 0),    // r4 = BPF_ANY
                    insn(0x85, 0, 0, 0, 2),    // bpf_map_update_elem
                    insn(0xb7, 0, 0, 0, 0),    // r0 = 0
                    insn(0x95, 0, 0, 0, 0),    // exit
                ];
                let license = c"GPL";
                let mut log = vec![0u8; 64 * 1024];
                let mut attr = [0u64; 16];
                attr[0] = 2 | ((insns.len() as u64) << 32); // BPF_PROG_TYPE_KPROBE, insn_cnt
                attr[1] = insns.as_ptr() as u64;
                attr[2] = license.as_ptr() as u64;
                attr[3] = 1 | ((log.len() as u64) << 32); // log_level, log_size
                attr[4] = log.as_mut_ptr() as u64;
                let prog = bpf(5, &mut attr);
                assert!(
                    prog >= 0,
                    "BPF_PROG_LOAD: {}\n{}",
                    std::io::Error::last_os_error(),
                    String::from_utf8_lossy(&log).trim_end_matches('\0')
                );
                // SAFETY: new fd from the kernel.
                let prog = unsafe { OwnedFd::from_raw_fd(prog as i32) };
                Self { map, prog }
            }

            pub fn prog_fd(&self) -> BorrowedFd<'_> {
                self.prog.as_fd()
            }

            /// The last cookie the program stored.
            pub fn seen(&self) -> u64 {
                let key = 0u32;
                let mut value = 0u64;
                let mut attr = [0u64; 16];
                attr[0] = std::os::fd::AsRawFd::as_raw_fd(&self.map) as u64;
                attr[1] = &key as *const u32 as u64;
                attr[2] = &mut value as *mut u64 as u64;
                let rc = bpf(1, &mut attr);
                assert!(rc == 0, "BPF_MAP_LOOKUP_ELEM: {}", std::io::Error::last_os_error());
                value
            }
        }
    }
}
