//! Raw stacks to [`Stack`]s: deduplicated per process, and normalized (address → mapped file
//! and file offset, with the file's build id) while the process still lives, with blazesym's
//! `Normalizer`.
//!
//! Each process gets its own normalizer with its mappings cached: a stack captured just before
//! its process exited still normalizes from the cache once `/proc/PID/maps` is gone. A cache can
//! go stale when the process maps a new library (a `dlopen` after the first stack), so a stack
//! with a frame no cached mapping holds is normalized again from fresh mappings, once, while the
//! process lives.

use std::path::Path;
use std::sync::Arc;

use blazesym::normalize::{Normalizer, UserMeta};
use blazesym::Pid;
use foldhash::HashMap;

use super::{Frame, Module, Stack, StackId, NO_STACK};

/// A stack as the kernel sent it.
#[derive(Clone, Copy, Debug)]
pub struct RawStack<'a> {
    pub pid: u32,
    /// The traced function's return address at its entry (its caller's frame).
    pub return_address: u64,
    /// Innermost first: the function's entry, then the frame-pointer chain's return addresses.
    pub ips: &'a [u64],
    pub at_depth: bool,
    pub failed: bool,
}

/// What the capture side saw, for the summary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CaptureStats {
    pub stacks: u64,
    pub unique: u64,
    /// Frames no mapping held (JIT code, a library unmapped since, a process gone unseen).
    pub unknown_frames: u64,
    /// Stacks the kernel could not walk (or whose window it could not copy).
    pub failed: u64,
    /// Python stack records, distinct Python stacks, those cut at the depth asked for, and
    /// records of threads with no Python thread state.
    pub py_stacks: u64,
    pub py_unique: u64,
    pub py_at_depth: u64,
    pub py_no_thread: u64,
    /// Python stack records whose walk had a read of the interpreter's memory fail, and those
    /// of threads not found among the thread states the probe may walk.
    pub py_read_failed: u64,
    pub py_threads_bound: u64,
    /// Python stack records of threads that ran no Python, given the main thread's frames.
    pub py_main_thread: u64,
}

/// Finds a stripped file's separate debug file (the attach code's rules, handed in by the
/// caller so this crate does not depend on it).
pub type DebugFinder = Box<dyn FnMut(&Path) -> Option<std::path::PathBuf> + Send>;

#[derive(Default)]
pub struct Capture {
    /// By process, then by its frames: looked up by a borrowed slice, so a stack seen before
    /// (nearly every record) allocates nothing.
    ids: HashMap<u32, HashMap<Box<[u64]>, StackId>>,
    /// Stacks given an id so far.
    count: u32,
    /// The frames of the record at hand, reused.
    scratch: Vec<u64>,
    normalizers: HashMap<u32, Normalizer>,
    modules: HashMap<(std::path::PathBuf, Option<Vec<u8>>), Arc<Module>>,
    debug_finder: Option<DebugFinder>,
    pub stats: CaptureStats,
}

/// The frames of a raw stack: the walk's, with the caller's frame put back after the first
/// (a walk from a function's entry skips it; see `StackRecord::return_address`).
#[cfg(test)]
fn frames_of(raw: &RawStack<'_>) -> Vec<u64> {
    let mut ips = Vec::new();
    frames_into(raw, &mut ips);
    ips
}

/// [`frames_of`], into `ips` (cleared first).
fn frames_into(raw: &RawStack<'_>, ips: &mut Vec<u64>) {
    ips.clear();
    ips.extend(raw.ips.iter().copied().take(1));
    if raw.return_address != 0 && !ips.is_empty() && raw.ips.get(1) != Some(&raw.return_address) {
        ips.push(raw.return_address);
    }
    ips.extend(raw.ips.iter().copied().skip(1).take_while(|&ip| ip != 0));
}

fn normalizer() -> Normalizer {
    Normalizer::builder().enable_vma_caching(true).enable_build_ids(true).enable_build_id_caching(true).build()
}

impl Capture {
    /// The id of `raw`'s stack, and the stack itself when it is new (to be sent to the store
    /// before any row that refers to it).
    pub fn stack(&mut self, raw: &RawStack<'_>) -> (StackId, Option<Stack>) {
        self.stats.stacks += 1;
        self.stats.failed += u64::from(raw.failed);
        let mut ips = std::mem::take(&mut self.scratch);
        frames_into(raw, &mut ips);
        if ips.is_empty() && !raw.failed {
            self.scratch = ips;
            return (NO_STACK, None);
        }
        if let Some(&id) = self.ids.get(&raw.pid).and_then(|m| m.get(ips.as_slice())) {
            self.scratch = ips;
            return (id, None);
        }
        self.count = self.count.checked_add(1).expect("fewer than 4 billion stacks");
        let id = self.count;
        let frames = self.normalize(raw.pid, &ips);
        self.ids.entry(raw.pid).or_default().insert(ips.as_slice().into(), id);
        self.scratch = ips;
        self.stats.unique += 1;
        (id, Some(Stack { id, pid: raw.pid, frames, at_depth: raw.at_depth, failed: raw.failed }))
    }

    /// Frames of `ips`, from the process's cached mappings, refreshed once if one is missing.
    fn normalize(&mut self, pid: u32, ips: &[u64]) -> Vec<Frame> {
        // A return address is the instruction after its call, which may be another function or
        // line: the call itself is one byte before.
        let lookups: Vec<u64> =
            ips.iter().enumerate().map(|(i, &ip)| if i == 0 { ip } else { ip.saturating_sub(1) }).collect();
        let mut frames = self.lookup(pid, ips, &lookups);
        let missing = frames.iter().any(|f| f.module.is_none());
        if missing && Path::new(&format!("/proc/{pid}")).exists() {
            self.normalizers.insert(pid, normalizer());
            frames = self.lookup(pid, ips, &lookups);
        }
        self.stats.unknown_frames += frames.iter().filter(|f| f.module.is_none()).count() as u64;
        frames
    }

    fn lookup(&mut self, pid: u32, ips: &[u64], lookups: &[u64]) -> Vec<Frame> {
        let normalizer = self.normalizers.entry(pid).or_insert_with(normalizer);
        let Ok(out) = normalizer.normalize_user_addrs(Pid::from(pid), lookups) else {
            return ips.iter().map(|&addr| Frame { addr, module: None, returns: false }).collect();
        };
        let metas: Vec<Option<Arc<Module>>> = out
            .meta
            .iter()
            .map(|meta| match meta {
                UserMeta::Elf(elf) => {
                    let key = (elf.path.clone(), elf.build_id.as_ref().map(|b| b.to_vec()));
                    let finder = &mut self.debug_finder;
                    let module = self.modules.entry(key).or_insert_with_key(|(path, build_id)| {
                        let debug_file = finder.as_mut().and_then(|find| find(path));
                        Arc::new(Module { path: path.clone(), build_id: build_id.clone(), debug_file })
                    });
                    Some(module.clone())
                }
                _ => None,
            })
            .collect();
        ips.iter()
            .zip(out.outputs)
            .enumerate()
            .map(|(i, (&addr, (offset, meta)))| Frame {
                addr,
                module: metas.get(meta).cloned().flatten().map(|m| (m, offset)),
                returns: i > 0,
            })
            .collect()
    }

    /// Sets how stripped files' debug files are found.
    pub fn set_debug_finder(&mut self, finder: DebugFinder) {
        self.debug_finder = Some(finder);
    }

    /// Forgets a process's cached mappings (it exited; its stacks are normalized already).
    /// A process exited or replaced its image (`execve`): its records so far are all in, and
    /// an address of the new image may mean another file, so nothing of it is kept.
    pub fn process_exited(&mut self, pid: u32) {
        self.normalizers.remove(&pid);
        self.ids.remove(&pid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_callers_frame_goes_back_after_the_entry_unless_the_walk_has_it() {
        let raw =
            |ips: &'static [u64], ret| RawStack { pid: 1, return_address: ret, ips, at_depth: false, failed: false };
        assert_eq!(frames_of(&raw(&[10, 30, 40], 20)), [10, 20, 30, 40]);
        assert_eq!(frames_of(&raw(&[10, 20, 30], 20)), [10, 20, 30]);
        assert_eq!(frames_of(&raw(&[10, 30], 0)), [10, 30]);
        assert_eq!(frames_of(&raw(&[], 20)), Vec::<u64>::new());
    }
}
