//! All the probes of one program in one library as a single link: `BPF_LINK_CREATE` with
//! `BPF_TRACE_UPROBE_MULTI` (Linux 6.6), one cookie per offset.
//!
//! Why: the kernel makes every uprobe perf event wait for an RCU grace period when it closes
//! (`uprobe_unregister_sync`), about 0.11 s each here, one after another, so a trace of 171
//! probes (342 events) took 37 s to detach. A multi link unregisters all its offsets and then
//! waits once. Attaching is faster too: one syscall per library and program instead of a
//! `perf_event_open` and a `BPF_LINK_CREATE` per probe.
//!
//! A program must be loaded for that attach type (its `bpf_get_attach_cookie` reads the multi
//! link's per-offset cookie), which aya 0.14 cannot do. [`MultiPrograms::load`] therefore loads
//! a second copy of `call_enter` and `call_exit` from the same object with `aya-obj`, relocated
//! against the maps aya created, so both copies share every map and global. Where the kernel
//! refuses the program type or the link, the loader keeps aya's per-probe links. The copies
//! are loaded with the object's BTF and function info, as aya loads its own: the Python walk's
//! `bpf_loop` callbacks are refused without them.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use aya::maps::Map;
use aya::Ebpf;
use aya_obj::Object;
use thiserror::Error;

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_BTF_LOAD: libc::c_long = 18;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_PROG_TYPE_KPROBE: u32 = 2;
const BPF_TRACE_UPROBE_MULTI: u32 = 48;
const BPF_F_UPROBE_MULTI_RETURN: u32 = 1;

#[derive(Debug, Error)]
pub enum MultiError {
    #[error("cannot parse the eBPF object again: {0}")]
    Parse(String),
    #[error("the eBPF object has no program `{0}`")]
    NoProgram(&'static str),
    #[error("the loaded eBPF object has no map `{0}` of a supported type")]
    NoMap(String),
    #[error("cannot relocate `{name}`: {why}")]
    Relocate { name: &'static str, why: String },
    #[error("the kernel refused `{name}` as a multi-uprobe program (Linux >= 6.6 needed)")]
    Load { name: &'static str, source: io::Error },
    #[error("library path {0:?} contains a NUL byte")]
    PathHasNul(PathBuf),
    #[error("BPF_LINK_CREATE (uprobe multi, {count} offsets) on {path} failed")]
    Link { path: PathBuf, count: usize, source: io::Error },
}

/// `call_enter`, `call_exit`, `usdt_hit` and `objects_changed` loaded for
/// `BPF_TRACE_UPROBE_MULTI`.
pub struct MultiPrograms {
    pub enter: OwnedFd,
    pub exit: OwnedFd,
    pub usdt: OwnedFd,
    pub linker: OwnedFd,
}

/// `union bpf_attr` for `BPF_PROG_LOAD`, up to `expected_attach_type`.
#[repr(C)]
#[derive(Default)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
    prog_btf_fd: u32,
    func_info_rec_size: u32,
    func_info: u64,
    func_info_cnt: u32,
    line_info_rec_size: u32,
    line_info: u64,
    line_info_cnt: u32,
    attach_btf_id: u32,
}

/// `union bpf_attr` for `BPF_BTF_LOAD`.
#[repr(C)]
#[derive(Default)]
struct BtfLoadAttr {
    btf: u64,
    btf_log_buf: u64,
    btf_size: u32,
    btf_log_size: u32,
    btf_log_level: u32,
    _pad: u32,
}

/// Loads the object's BTF, fixed up for this kernel as aya fixes up its own; `None` where there
/// is none or the kernel refuses it (the copies are then loaded without function info).
fn load_btf(obj: &mut Object) -> Option<OwnedFd> {
    let features = aya::features().btf()?;
    let bytes = obj.fixup_and_sanitize_btf(features).ok()??.to_bytes();
    let attr = BtfLoadAttr { btf: bytes.as_ptr() as u64, btf_size: bytes.len() as u32, ..BtfLoadAttr::default() };
    // SAFETY: a valid BPF_BTF_LOAD attribute of the size passed; `bytes` outlives the call.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_BTF_LOAD, &attr as *const BtfLoadAttr, size_of_val(&attr)) };
    // SAFETY: a non-negative return is a new file descriptor we own.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// The `link_create` member of `union bpf_attr` with its `uprobe_multi` part.
#[repr(C)]
struct UprobeMultiAttr {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
    path: u64,
    offsets: u64,
    ref_ctr_offsets: u64,
    cookies: u64,
    cnt: u32,
    multi_flags: u32,
    pid: u32,
    _pad: u32,
}

/// The fd of a map aya created (only the kinds our object declares, globals included).
fn map_fd(map: &Map) -> Option<RawFd> {
    let data = match map {
        // Every kind the probes declare or may come to (a kind left out here makes every trace
        // fall back to perf-event links, which the privileged tests check against).
        Map::Array(d)
        | Map::PerCpuArray(d)
        | Map::HashMap(d)
        | Map::LruHashMap(d)
        | Map::PerCpuHashMap(d)
        | Map::PerCpuLruHashMap(d)
        | Map::RingBuf(d)
        | Map::StackTraceMap(d)
        | Map::Queue(d)
        | Map::Stack(d)
        | Map::BloomFilter(d)
        | Map::LpmTrie(d)
        | Map::ProgramArray(d)
        | Map::PerfEventArray(d) => d,
        _ => return None,
    };
    Some(data.fd().as_fd().as_raw_fd())
}

impl MultiPrograms {
    /// Loads the second copies. `object` is the ELF aya loaded into `ebpf`.
    pub fn load(object: &[u8], ebpf: &Ebpf) -> Result<Self, MultiError> {
        let mut obj = Object::parse(object).map_err(|e| MultiError::Parse(e.to_string()))?;
        let mut fds = Vec::new();
        for name in obj.maps.keys() {
            let fd = ebpf.map(name).and_then(map_fd).ok_or_else(|| MultiError::NoMap(name.clone()))?;
            fds.push((name.clone(), fd));
        }
        let text: std::collections::HashSet<usize> = obj.functions.keys().map(|(section, _)| *section).collect();
        let maps = obj.maps.clone();
        obj.relocate_maps(fds.iter().map(|(n, fd)| (n.as_str(), *fd, &maps[n])), &text)
            .map_err(|e| MultiError::Relocate { name: "maps", why: e.to_string() })?;
        obj.relocate_calls(&text).map_err(|e| MultiError::Relocate { name: "calls", why: e.to_string() })?;
        let btf = load_btf(&mut obj);
        let btf = btf.as_ref().map(AsFd::as_fd);
        Ok(Self {
            enter: load_one(&obj, btf, "call_enter", "call_enter_um")?,
            exit: load_one(&obj, btf, "call_exit", "call_exit_um")?,
            usdt: load_one(&obj, btf, "usdt_hit", "usdt_hit_um")?,
            linker: load_one(&obj, btf, "objects_changed", "objs_changed_um")?,
        })
    }
}

fn load_one(
    obj: &Object,
    btf: Option<BorrowedFd<'_>>,
    name: &'static str,
    kernel_name: &str,
) -> Result<OwnedFd, MultiError> {
    let prog = obj.programs.get(name).ok_or(MultiError::NoProgram(name))?;
    let function = obj.functions.get(&prog.function_key()).ok_or(MultiError::NoProgram(name))?;
    let insns = &function.instructions;
    let (func_info, line_info) = (function.func_info.func_info_bytes(), function.line_info.line_info_bytes());
    // The object's BTF and the function's records, or nothing of either.
    let (prog_btf_fd, func_info_rec_size, func_info_at, func_info_cnt, line_info_rec_size, line_info_at, line_info_cnt) =
        match btf.filter(|_| function.func_info.num_info > 0) {
            Some(fd) => (
                fd.as_raw_fd() as u32,
                size_of::<aya_obj::generated::bpf_func_info>() as u32,
                func_info.as_ptr() as u64,
                function.func_info.num_info,
                size_of::<aya_obj::generated::bpf_line_info>() as u32,
                line_info.as_ptr() as u64,
                function.line_info.num_info,
            ),
            None => (0, 0, 0, 0, 0, 0, 0),
        };
    let mut prog_name = [0u8; 16];
    prog_name[..kernel_name.len()].copy_from_slice(kernel_name.as_bytes());
    let mut log = vec![0u8; 1 << 16];
    let attr = ProgLoadAttr {
        prog_type: BPF_PROG_TYPE_KPROBE,
        insn_cnt: insns.len() as u32,
        insns: insns.as_ptr() as u64,
        license: prog.license.as_ptr() as u64,
        log_level: 0,
        log_size: 0,
        log_buf: 0,
        prog_name,
        expected_attach_type: BPF_TRACE_UPROBE_MULTI,
        prog_btf_fd,
        func_info_rec_size,
        func_info: func_info_at,
        func_info_cnt,
        line_info_rec_size,
        line_info: line_info_at,
        line_info_cnt,
        ..ProgLoadAttr::default()
    };
    // SAFETY: `attr` is a valid, fully initialised BPF_PROG_LOAD attribute of the size passed;
    // its pointers (instructions, license) outlive the call, and the kernel only reads them.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_PROG_LOAD, &attr as *const ProgLoadAttr, size_of_val(&attr)) };
    if fd < 0 {
        let source = io::Error::last_os_error();
        // Again with the verifier's log, so the error says why.
        let attr = ProgLoadAttr { log_level: 1, log_size: log.len() as u32, log_buf: log.as_mut_ptr() as u64, ..attr };
        // SAFETY: as above; `log` is writable for `log_size` bytes.
        unsafe { libc::syscall(libc::SYS_bpf, BPF_PROG_LOAD, &attr as *const ProgLoadAttr, size_of_val(&attr)) };
        let text = String::from_utf8_lossy(&log);
        let tail: String = text.trim_end_matches('\0').lines().rev().take(3).collect::<Vec<_>>().join(" | ");
        return Err(MultiError::Load { name, source: io::Error::new(source.kind(), format!("{source}; {tail}")) });
    }
    // SAFETY: a non-negative return of BPF_PROG_LOAD is a new file descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Attaches `prog` (one of [`MultiPrograms`]) at every offset of `path`, each with its cookie
/// and, for USDT sites, the file offset of its semaphore (0: none), which the kernel then
/// raises and lowers as the perf-event path does; `ret` makes them return probes. `pid` limits
/// them to one process.
pub fn attach(
    prog: BorrowedFd<'_>,
    path: &Path,
    offsets: &[u64],
    cookies: &[u64],
    ref_ctr_offsets: Option<&[u64]>,
    ret: bool,
    pid: Option<u32>,
) -> Result<OwnedFd, MultiError> {
    assert_eq!(offsets.len(), cookies.len(), "one cookie per offset");
    assert!(ref_ctr_offsets.is_none_or(|r| r.len() == offsets.len()), "one semaphore offset per offset");
    let c_path = CString::new(path.as_os_str().as_bytes()).map_err(|_| MultiError::PathHasNul(path.to_owned()))?;
    let attr = UprobeMultiAttr {
        prog_fd: prog.as_raw_fd() as u32,
        target_fd: 0,
        attach_type: BPF_TRACE_UPROBE_MULTI,
        flags: 0,
        path: c_path.as_ptr() as u64,
        offsets: offsets.as_ptr() as u64,
        ref_ctr_offsets: ref_ctr_offsets.map_or(0, |r| r.as_ptr() as u64),
        cookies: cookies.as_ptr() as u64,
        cnt: offsets.len() as u32,
        multi_flags: if ret { BPF_F_UPROBE_MULTI_RETURN } else { 0 },
        pid: pid.unwrap_or(0),
        _pad: 0,
    };
    // SAFETY: `attr` is a valid `link_create` attribute; the path, offsets and cookies it points
    // at outlive the call and hold `cnt` entries; the kernel only reads them.
    let fd =
        unsafe { libc::syscall(libc::SYS_bpf, BPF_LINK_CREATE, &attr as *const UprobeMultiAttr, size_of_val(&attr)) };
    if fd < 0 {
        return Err(MultiError::Link {
            path: path.to_owned(),
            count: offsets.len(),
            source: io::Error::last_os_error(),
        });
    }
    // SAFETY: a non-negative return of BPF_LINK_CREATE is a new file descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::offset_of;

    #[test]
    fn attr_layouts_match_the_kernel_abi() {
        // include/uapi/linux/bpf.h
        assert_eq!(offset_of!(ProgLoadAttr, log_buf), 32);
        assert_eq!(offset_of!(ProgLoadAttr, prog_name), 48);
        assert_eq!(offset_of!(ProgLoadAttr, expected_attach_type), 68);
        assert_eq!(offset_of!(UprobeMultiAttr, path), 16);
        assert_eq!(offset_of!(UprobeMultiAttr, cookies), 40);
        assert_eq!(offset_of!(UprobeMultiAttr, cnt), 48);
        assert_eq!(offset_of!(UprobeMultiAttr, pid), 56);
    }
}
