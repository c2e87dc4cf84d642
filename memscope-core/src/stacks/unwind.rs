//! `--unwind dwarf`: the stack window and registers a probe copied at the entry of a thread's
//! outermost traced call, unwound here from the mapped files' `.eh_frame` with framehop (which
//! falls back to frame pointers where a function has no unwind information), as
//! `perf --call-graph dwarf` does. This recovers the frames a frame-pointer walk loses in
//! libraries built without frame pointers (CANN and torch_npu are built with `-O2`).
//!
//! Unwinding needs the process's mappings (which file holds each address, and where it is
//! loaded), so it runs as the records are drained, while the process lives; each process's
//! modules are built once from `/proc/PID/maps` and rebuilt when an address falls in none of
//! them (a library loaded since). Each file's unwind sections are read once and shared.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use foldhash::HashMap;
use framehop::{ExplicitModuleSectionInfo, FrameAddress, Module, Unwinder as _};
use object::{Object, ObjectSection, ObjectSegment};

#[cfg(target_arch = "aarch64")]
use framehop::aarch64::{CacheAarch64 as Cache, UnwindRegsAarch64, UnwinderAarch64 as ArchUnwinder};
#[cfg(not(target_arch = "aarch64"))]
use framehop::x86_64::{CacheX86_64 as Cache, UnwindRegsX86_64, UnwinderX86_64 as ArchUnwinder};

/// What a probe copied.
#[derive(Clone, Copy, Debug)]
pub struct Window<'a> {
    pub pid: u32,
    pub ip: u64,
    pub sp: u64,
    pub fp: u64,
    pub lr: u64,
    /// The stack from `sp` up.
    pub data: &'a [u8],
}

/// An unwound stack: instruction pointers, innermost first (the entry, then return addresses).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Unwound {
    pub ips: Vec<u64>,
    /// The unwinder reached the stack's end (rather than running out of window or rules).
    pub complete: bool,
}

type Data = Arc<[u8]>;

/// A file's unwind sections, as stated in the file (ELF's base address is 0).
struct Sections {
    info: ExplicitModuleSectionInfo<Data>,
    /// (file offset, file size, address) of each executable loadable segment.
    segments: Vec<(u64, u64, u64)>,
}

struct Process {
    unwinder: ArchUnwinder<Data>,
    cache: Cache,
    ranges: Vec<Range<u64>>,
}

#[derive(Default)]
pub struct Unwinder {
    processes: HashMap<u32, Process>,
    files: HashMap<PathBuf, Option<Arc<Sections>>>,
}

fn section(file: &object::File<'_>, name: &str) -> (Option<Range<u64>>, Option<Data>) {
    match file.section_by_name(name) {
        Some(s) => (Some(s.address()..s.address() + s.size()), s.data().ok().map(Data::from)),
        None => (None, None),
    }
}

fn read_sections(path: &Path) -> Option<Sections> {
    let bytes = std::fs::read(path).ok()?;
    let file = object::File::parse(&*bytes).ok()?;
    let (text_svma, text) = section(&file, ".text");
    let (eh_frame_svma, eh_frame) = section(&file, ".eh_frame");
    let (eh_frame_hdr_svma, eh_frame_hdr) = section(&file, ".eh_frame_hdr");
    let (_, debug_frame) = section(&file, ".debug_frame");
    let (got_svma, _) = section(&file, ".got");
    let info = ExplicitModuleSectionInfo {
        base_svma: 0,
        text_svma,
        text,
        got_svma,
        eh_frame_svma,
        eh_frame,
        eh_frame_hdr_svma,
        eh_frame_hdr,
        debug_frame,
        ..Default::default()
    };
    let segments = file
        .segments()
        .filter(|s| matches!(s.flags(), object::SegmentFlags::Elf { p_flags } if p_flags & object::elf::PF_X != 0))
        .map(|s| {
            let (offset, size) = s.file_range();
            (offset, size, s.address())
        })
        .collect();
    Some(Sections { info, segments })
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(size).ok().filter(|s| s.is_power_of_two()).unwrap_or(4096)
}

/// `/proc/PID/maps`' executable file mappings: (range, file offset, path).
pub fn executable_mappings(pid: u32) -> Vec<(Range<u64>, u64, PathBuf)> {
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/maps")) else { return Vec::new() };
    text.lines()
        .filter_map(|line| {
            let mut f = line.split_whitespace();
            let (range, perms, offset) = (f.next()?, f.next()?, f.next()?);
            let path = f.nth(2)?;
            if !perms.contains('x') || !path.starts_with('/') {
                return None;
            }
            let (start, end) = range.split_once('-')?;
            let range = u64::from_str_radix(start, 16).ok()?..u64::from_str_radix(end, 16).ok()?;
            Some((range, u64::from_str_radix(offset, 16).ok()?, PathBuf::from(path)))
        })
        .collect()
}

impl Unwinder {
    fn sections(&mut self, path: &Path) -> Option<Arc<Sections>> {
        self.files.entry(path.to_owned()).or_insert_with(|| read_sections(path).map(Arc::new)).clone()
    }

    fn load(&mut self, pid: u32) -> Process {
        let mut unwinder = ArchUnwinder::new();
        let mut ranges = Vec::new();
        for (range, offset, path) in executable_mappings(pid) {
            let Some(sections) = self.sections(&path) else { continue };
            // The executable segment this mapping holds gives the module's load address. The
            // mapping starts at the page of the segment's offset, which may lie before it (and
            // inside the segment before, when the linker packs them).
            let page = |o: u64| o & !(page_size() - 1);
            let Some(&(seg_offset, _, seg_addr)) =
                sections.segments.iter().find(|(o, size, _)| page(*o) <= offset && offset < o + size)
            else {
                continue;
            };
            let base_avma = range.start.wrapping_sub(seg_addr.wrapping_add(offset).wrapping_sub(seg_offset));
            let name = path.display().to_string();
            unwinder.add_module(Module::new(name, range.clone(), base_avma, sections.info.clone()));
            ranges.push(range);
        }
        Process { unwinder, cache: Cache::new(), ranges }
    }

    /// Unwinds a window, at most `depth` frames.
    pub fn unwind(&mut self, w: &Window<'_>, depth: usize) -> Unwound {
        let known = self.processes.get(&w.pid).is_some_and(|p| p.ranges.iter().any(|r| r.contains(&w.ip)));
        if !known {
            let process = self.load(w.pid);
            self.processes.insert(w.pid, process);
        }
        let process = self.processes.get_mut(&w.pid).expect("loaded above");
        let mut read_stack = |addr: u64| {
            let at = addr.checked_sub(w.sp).ok_or(())? as usize;
            let bytes = w.data.get(at..at + 8).ok_or(())?;
            Ok(u64::from_ne_bytes(bytes.try_into().map_err(|_| ())?))
        };
        #[cfg(not(target_arch = "aarch64"))]
        let regs = UnwindRegsX86_64::new(w.ip, w.sp, w.fp);
        #[cfg(target_arch = "aarch64")]
        let regs = UnwindRegsAarch64::new(w.lr, w.sp, w.fp);
        let mut frames = process.unwinder.iter_frames(w.ip, regs, &mut process.cache, &mut read_stack);
        let mut out = Unwound::default();
        while out.ips.len() < depth {
            match frames.next() {
                Ok(Some(FrameAddress::InstructionPointer(ip))) => out.ips.push(ip),
                Ok(Some(FrameAddress::ReturnAddress(ra))) => out.ips.push(ra.get()),
                Ok(None) => {
                    out.complete = true;
                    break;
                }
                Err(_) => break,
            }
        }
        out
    }

    /// Forgets a process's modules (it exited).
    pub fn process_exited(&mut self, pid: u32) {
        self.processes.remove(&pid);
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    //! This thread's own stack, copied as the probe copies a traced thread's: the functions that
    //! called the copying one are known by construction, and the symbolizer names them.

    use super::*;
    use crate::stacks::capture::{Capture, RawStack};
    use crate::stacks::symbolize::{Resolved, Symbolizer};

    /// (ip, sp, bp) here, and up to 64 KiB of stack above sp (frames of unoptimized code are large).
    #[inline(never)]
    fn copy_own_stack() -> (u64, u64, u64, Vec<u8>) {
        let (ip, sp, bp): (u64, u64, u64);
        // SAFETY: reads three registers into locals; touches no memory.
        unsafe {
            std::arch::asm!("lea {ip}, [rip]", "mov {sp}, rsp", "mov {bp}, rbp", ip = out(reg) ip, sp = out(reg) sp, bp = out(reg) bp);
        }
        // As the probe does: the most of the stack above sp that is mapped, read without faulting
        // (a new thread's stack may end a few KiB above).
        let pid = std::process::id();
        let data = [65536, 32768, 16384, 8192, 4096]
            .into_iter()
            .find_map(|len| crate::stacks::python::read_remote(pid, sp, len))
            .expect("4 KiB of this thread's stack");
        (ip, sp, bp, std::hint::black_box(data))
    }

    #[inline(never)]
    fn unwind_from_here_the_middle() -> Unwound {
        let (ip, sp, fp, data) = copy_own_stack();
        let w = Window { pid: std::process::id(), ip, sp, fp, lr: 0, data: &data };
        std::hint::black_box(Unwinder::default().unwind(&w, 50))
    }

    #[inline(never)]
    fn unwind_from_here_the_outer() -> Unwound {
        std::hint::black_box(unwind_from_here_the_middle())
    }

    #[test]
    fn a_copied_stack_unwinds_to_the_functions_that_called_the_copy() {
        let unwound = unwind_from_here_the_outer();
        assert!(unwound.ips.len() >= 3, "{unwound:?}");
        let (_, stack) = Capture::default().stack(&RawStack {
            pid: std::process::id(),
            return_address: 0,
            ips: &unwound.ips,
            at_depth: false,
            failed: false,
        });
        let stack = stack.expect("new");
        let names: Vec<String> = Symbolizer::new(&[])
            .frames(&stack.frames)
            .into_iter()
            .filter_map(|r| match r {
                Resolved::Symbols(s) => s.last().map(|s| s.name.clone()),
                _ => None,
            })
            .collect();
        let at =
            |name: &str| names.iter().position(|n| n.ends_with(name)).unwrap_or_else(|| panic!("{name} in {names:?}"));
        assert!(at("copy_own_stack") < at("unwind_from_here_the_middle"), "{names:?}");
        assert!(at("unwind_from_here_the_middle") < at("unwind_from_here_the_outer"), "{names:?}");
        assert!(at("unwind_from_here_the_outer") < at("a_copied_stack_unwinds_to_the_functions_that_called_the_copy"));
    }
}
