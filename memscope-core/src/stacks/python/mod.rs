//! Python stacks from outside the interpreter: finding a process's CPython (`_PyRuntime` in its
//! libpython or its executable, shared and static builds) and resolving the frames the probe
//! read (code object, instruction pointer) to `file(line): function`, msMemScope's
//! `Call Stack(Python)` lines. Code objects are read from the live process with
//! `process_vm_readv`, once each.

pub mod linetable;
pub mod offsets;

use std::path::{Path, PathBuf};

use foldhash::HashMap;
use object::{Object, ObjectSegment, ObjectSymbol};

pub use offsets::Layout;

/// A process's interpreter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Interpreter {
    /// The file that holds `_PyRuntime` (libpython, or a static python executable).
    pub path: PathBuf,
    /// 3.`minor`.
    pub minor: u32,
    /// `_PyRuntime`'s address in the process.
    pub runtime: u64,
    pub layout: &'static Layout,
    /// What the probe walks: the layout's offsets, with glibc's `struct pthread` thread-id
    /// offset found in this process for 3.9 and 3.10.
    pub walk: memscope_common::python::PyOffsets,
}

/// Why a process has no Python stacks.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FindError {
    #[error("CPython 3.{minor} ({path}): this build reads the stacks of {} only", offsets::supported())]
    Unsupported { minor: u32, path: String },
    #[error("{path} has no `_PyRuntime` symbol (stripped: install its -dbg package, or use a pyenv build)")]
    NoRuntime { path: String },
    #[error("CPython 3.{minor} ({path}): `_PyRuntime` does not start with its debug cookie; its layout is unknown")]
    BadCookie { minor: u32, path: String },
    #[error("CPython 3.{minor}: its threads' kernel ids were not found in their `struct pthread` (not glibc?)")]
    NoThreadIds { minor: u32 },
}

/// The minor version of a CPython file, from its name (`libpython3.12.so.1.0`, `python3.12`).
fn minor_of(path: &Path) -> Option<u32> {
    let name = path.file_name()?.to_str()?;
    let rest = name.strip_prefix("libpython3.").or_else(|| name.strip_prefix("python3."))?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    let tail = &rest[digits.len()..];
    let is_lib = name.starts_with("lib") && tail.starts_with(".so");
    let is_exe = !name.starts_with("lib") && (tail.is_empty() || tail == "d");
    (is_lib || is_exe).then(|| digits.parse().ok()).flatten()
}

/// Reads `len` bytes of another process's memory.
pub fn read_remote(pid: u32, addr: u64, len: usize) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; len];
    let local = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: len };
    let remote = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: len };
    // SAFETY: one local buffer of `len` bytes that we own; the remote side is checked by the kernel.
    let n = unsafe { libc::process_vm_readv(pid as libc::pid_t, &local, 1, &remote, 1, 0) };
    (n == len as isize).then_some(buf)
}

fn remote_u64(pid: u32, addr: u64) -> Option<u64> {
    read_remote(pid, addr, 8).map(|b| u64::from_ne_bytes(b.try_into().expect("8 bytes")))
}

/// `_PyRuntime`'s address in the process, from the file's symbol and where the file is loaded.
fn runtime_address(pid: u32, path: &Path, maps: &[(u64, u64, PathBuf)]) -> Result<u64, FindError> {
    let no_runtime = || FindError::NoRuntime { path: path.display().to_string() };
    let bytes = std::fs::read(path).map_err(|_| no_runtime())?;
    let file = object::File::parse(&*bytes).map_err(|_| no_runtime())?;
    let symbol =
        file.dynamic_symbols().chain(file.symbols()).find(|s| s.name() == Ok("_PyRuntime")).ok_or_else(no_runtime)?;
    if file.kind() == object::ObjectKind::Executable {
        return Ok(symbol.address());
    }
    // A shared object or PIE: its first loadable segment is mapped at the file's offset 0.
    let first_vaddr = file.segments().map(|s| s.address()).min().unwrap_or(0);
    let start = maps.iter().filter(|(_, off, p)| p == path && *off == 0).map(|(start, ..)| *start).min();
    let _ = pid;
    let start = start.ok_or_else(no_runtime)?;
    Ok(start - (first_vaddr & !0xfff) + symbol.address())
}

/// Whether an executable is a shared build's (it names libpython among its needed libraries).
fn needs_libpython(path: &Path) -> bool {
    std::fs::read(path).is_ok_and(|b| b.windows(11).any(|w| w == b"libpython3."))
}

/// The process's CPython, if it has one; `Err` when it has one whose stacks this build cannot read.
pub fn find(pid: u32) -> Result<Option<Interpreter>, FindError> {
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/maps")) else { return Ok(None) };
    let maps: Vec<(u64, u64, PathBuf)> = text
        .lines()
        .filter_map(|line| {
            let mut f = line.split_whitespace();
            let range = f.next()?;
            let offset = u64::from_str_radix(f.nth(1)?, 16).ok()?;
            let path = f.nth(2)?;
            let start = u64::from_str_radix(range.split_once('-')?.0, 16).ok()?;
            path.starts_with('/').then(|| (start, offset, PathBuf::from(path)))
        })
        .collect();
    // libpython before the executable: a shared build's executable has no `_PyRuntime`.
    let mut candidates: Vec<&PathBuf> = maps.iter().map(|(_, _, p)| p).filter(|p| minor_of(p).is_some()).collect();
    candidates.sort_by_key(|p| !p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("lib")));
    candidates.dedup();
    let Some(path) = candidates.first() else { return Ok(None) };
    let minor = minor_of(path).expect("filtered");
    if !path.file_name().is_some_and(|n| n.to_string_lossy().starts_with("lib")) && needs_libpython(path) {
        // A shared build whose libpython the loader has not mapped yet: look again later.
        return Ok(None);
    }
    let shown = path.display().to_string();
    let layout = offsets::layout(minor).ok_or_else(|| FindError::Unsupported { minor, path: shown.clone() })?;
    let runtime = runtime_address(pid, path, &maps)?;
    if minor >= 13 && read_remote(pid, runtime, 8).as_deref() != Some(&offsets::DEBUG_COOKIE[..]) {
        return Err(FindError::BadCookie { minor, path: shown });
    }
    let mut walk = layout.walk;
    if layout.frames != offsets::Frames::Interpreter {
        walk.pthread_tid = pthread_tid_offset(pid, runtime, &walk).ok_or(FindError::NoThreadIds { minor })?;
    }
    Ok(Some(Interpreter { path: (*path).clone(), minor, runtime, layout, walk }))
}

/// Where glibc's `struct pthread` keeps the kernel thread id, in this process: the first offset
/// at which every thread state's `thread_id` (its `pthread_self()`) holds one of the process's
/// thread ids. glibc moves the field between versions, and the target's glibc may not be ours.
fn pthread_tid_offset(pid: u32, runtime: u64, o: &memscope_common::python::PyOffsets) -> Option<u32> {
    let tids: Vec<u32> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .ok()?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    let interp = remote_u64(pid, runtime + u64::from(o.runtime_interpreters_head)).filter(|&p| p != 0)?;
    let mut tstate = remote_u64(pid, interp + u64::from(o.interp_threads_head)).unwrap_or(0);
    const SPAN: usize = 2048;
    let mut candidates: Option<Vec<u32>> = None;
    for _ in 0..64 {
        if tstate == 0 {
            break;
        }
        let pthread = remote_u64(pid, tstate + u64::from(o.tstate_native_thread_id))?;
        let bytes = read_remote(pid, pthread, SPAN)?;
        let here: Vec<u32> = (0..SPAN / 4)
            .map(|i| i as u32 * 4)
            .filter(|&off| {
                let v = u32::from_ne_bytes(bytes[off as usize..][..4].try_into().expect("4 bytes"));
                tids.contains(&v)
            })
            .collect();
        candidates = Some(match candidates {
            None => here,
            Some(c) => c.into_iter().filter(|off| here.contains(off)).collect(),
        });
        tstate = remote_u64(pid, tstate + u64::from(o.tstate_next)).unwrap_or(0);
    }
    candidates?.first().copied()
}

/// What a code object says of itself.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Code {
    filename: String,
    qualname: String,
    firstlineno: i64,
    linetable: Vec<u8>,
    /// The bytecode's address.
    start: u64,
    /// `file(first line): name`, made on first use by [`Resolver::functions`].
    info: Option<std::sync::Arc<str>>,
    /// The `co_filename` and `co_qualname` pointers it was read with: the code object's
    /// identity, checked again before a sample's frame is named from the cache.
    identity: (u64, u64),
}

/// A code object's `co_filename` and `co_qualname` pointers as they are now.
fn identity(pid: u32, code: u64, o: &offsets::CodeOffsets) -> Option<(u64, u64)> {
    Some((remote_u64(pid, code + o.filename)?, remote_u64(pid, code + o.qualname)?))
}

/// A compact ASCII `str` (file and function names); `?` for anything else.
fn remote_str(pid: u32, at: u64, o: &offsets::CodeOffsets) -> Option<String> {
    let head = read_remote(pid, at, o.ascii_data as usize)?;
    let len = u64::from_ne_bytes(head[o.str_length as usize..][..8].try_into().ok()?) as usize;
    let state = u32::from_ne_bytes(head[32..36].try_into().ok()?);
    let (compact, ascii) = (state >> 5 & 1 == 1, state >> 6 & 1 == 1);
    if !(compact && ascii) || len > 4096 {
        return Some("?".into());
    }
    String::from_utf8(read_remote(pid, at + o.ascii_data, len)?).ok()
}

fn read_code(pid: u32, code: u64, o: &offsets::CodeOffsets) -> Option<Code> {
    let identity = identity(pid, code, o)?;
    let filename = remote_str(pid, identity.0, o)?;
    let qualname = remote_str(pid, identity.1, o)?;
    let firstlineno = i64::from(i32::from_ne_bytes(read_remote(pid, code + o.firstlineno, 4)?.try_into().ok()?));
    let table = remote_u64(pid, code + o.linetable)?;
    let size = remote_u64(pid, table + o.bytes_size)? as usize;
    let linetable = if size <= 1 << 20 { read_remote(pid, table + o.bytes_data, size)? } else { Vec::new() };
    Some(Code { filename, qualname, firstlineno, linetable, start: code + o.code_adaptive, info: None, identity })
}

/// The line of a frame: `instr` is what the probe read at the layout's `frame_instr`.
fn line(layout: &Layout, c: &Code, instr: u64) -> i64 {
    use offsets::Frames;
    let lasti = u64::from(instr as u32);
    match layout.frames {
        Frames::Interpreter => {
            let unit = instr.saturating_sub(c.start) / 2;
            linetable::line_of(&c.linetable, c.firstlineno, unit)
        }
        Frames::Object310 => linetable::line_of_310(&c.linetable, c.firstlineno, lasti * 2),
        Frames::Object39 => Some(linetable::line_of_lnotab(&c.linetable, c.firstlineno, lasti)),
    }
    .unwrap_or(c.firstlineno)
}

/// Frames to lines, with each code object read once per process.
#[derive(Default)]
pub struct Resolver {
    interpreters: HashMap<u32, Option<&'static Layout>>,
    codes: HashMap<(u32, u64), Option<Code>>,
}

impl Resolver {
    /// Tells the resolver a process's layout (the session found its interpreter).
    pub fn set_layout(&mut self, pid: u32, layout: &'static Layout) {
        self.interpreters.insert(pid, Some(layout));
    }

    fn layout(&mut self, pid: u32) -> Option<&'static Layout> {
        *self.interpreters.entry(pid).or_insert_with(|| find(pid).ok().flatten().map(|i| i.layout))
    }

    /// `file(line): function` per frame, innermost first, one per line (msMemScope's
    /// `Call Stack(Python)`); a code object that cannot be read is `?`.
    pub fn text(&mut self, pid: u32, frames: &[(u64, u64)]) -> String {
        let Some(layout) = self.layout(pid) else { return String::new() };
        let o = layout.code;
        let mut out = String::new();
        for &(code, instr) in frames {
            let entry = self.codes.entry((pid, code)).or_insert_with(|| read_code(pid, code, &o));
            match entry {
                Some(c) => out.push_str(&format!("{}({}): {}\n", c.filename, line(layout, c, instr), c.qualname)),
                None => out.push_str("?\n"),
            }
        }
        out.pop();
        out
    }

    /// Each frame's code object and `file(first line): name` (msMemScope's `FuncInfo`), in the
    /// order given; `?` for a code object that cannot be read. Empty when the process's
    /// interpreter is unknown.
    pub fn functions(&mut self, pid: u32, frames: &[(u64, u64)]) -> Vec<(u64, std::sync::Arc<str>)> {
        let Some(layout) = self.layout(pid) else { return Vec::new() };
        let o = layout.code;
        let mut out = Vec::with_capacity(frames.len());
        for &(code, _) in frames {
            let entry = self.codes.entry((pid, code)).or_insert_with(|| read_code(pid, code, &o));
            // The object at the address was freed and another made there since it was read
            // (a module's body, an `exec`'s code, gone once run), or could not be read then (a
            // sample of a frame being torn down): read what is there now.
            if entry.as_ref().is_none_or(|c| identity(pid, code, &o) != Some(c.identity)) {
                *entry = read_code(pid, code, &o);
            }
            let info = match entry {
                Some(c) => {
                    if c.info.is_none() {
                        c.info = Some(format!("{}({}): {}", c.filename, c.firstlineno, c.qualname).into());
                    }
                    c.info.clone().expect("set above")
                }
                None => "?".into(),
            };
            out.push((code, info));
        }
        out
    }

    /// Forgets a process (it exited; its stacks are resolved).
    pub fn process_exited(&mut self, pid: u32) {
        self.interpreters.remove(&pid);
        self.codes.retain(|(p, _), _| *p != pid);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// pyenv's CPython 3.`minor` executable, when installed.
    pub(crate) fn pyenv(minor: u32) -> Option<PathBuf> {
        let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| "/root".into());
        let versions = std::fs::read_dir(home.join(".pyenv/versions")).ok()?;
        let mut found: Vec<PathBuf> = versions
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(&format!("3.{minor}."))))
            .map(|p| p.join(format!("bin/python3.{minor}")))
            .filter(|p| p.is_file())
            .collect();
        found.sort();
        found.pop()
    }

    #[test]
    fn versions_come_from_the_names_of_libpython_and_python() {
        assert_eq!(minor_of(Path::new("/usr/lib/libpython3.12.so.1.0")), Some(12));
        assert_eq!(minor_of(Path::new("/root/.pyenv/versions/3.11.7/lib/libpython3.11.so")), Some(11));
        assert_eq!(minor_of(Path::new("/usr/bin/python3.11")), Some(11));
        assert_eq!(minor_of(Path::new("/usr/bin/python3.13d")), Some(13));
        assert_eq!(minor_of(Path::new("/usr/lib/python3.11/lib-dynload/_ctypes.cpython-311.so")), None);
        assert_eq!(minor_of(Path::new("/usr/bin/python3")), None);
    }
}
