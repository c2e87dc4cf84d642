//! The daemon's windows (`daemon --windows`): the probes of the sampled APIs (the caching and
//! workspace allocators, CPU tensors: `Api::sampled`) attached only part of the time. Every
//! probed call traps into the kernel (~850 ns here) whether or not sampling records it, so on a
//! loop of tensor calls only fewer traps make the daemon cheaper; the runtime's and driver's
//! probes, attached at all times, keep the device counters exact.
//!
//! - A window opens with the frees' links first, then the allocations': a block born in the
//!   window cannot be freed unseen.
//! - It closes with the allocations' links alone; the frees' stay while the blocks born in the
//!   window drain ([`Tracer::end_drain`] ends that).
//! - Closing a link waits for the kernel (~0.1 s), so links are closed on a thread of their own,
//!   the frees' only once the allocations' are gone, and never on the loop that drains the ring.
//! - A call whose return probe went before it returned leaves its thread's slot open: each
//!   opening numbers the windowed specs anew (`SampleRule::window`), and the kernel replaces a
//!   slot opened under another number rather than nesting in it.
//!
//! Only multi-uprobe links (Linux 6.6) are windowed: per-probe links would take a second per
//! hundred probes to close. Elsewhere the probes stay attached ([`Tracer::windowed`] is false).

use std::collections::HashMap;
use std::os::fd::{AsFd as _, OwnedFd};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

use aya::maps::Array;
use memscope_common::spec::{cookie, sample_kind, ProbeSpec};

use super::super::plan::AttachedProbe;
use super::super::uprobe_multi::{self, MultiError};
use super::{LoadError, Tracer};

/// Offsets and cookies of one program's probes in one library.
#[derive(Default)]
struct Points {
    offsets: Vec<u64>,
    cookies: Vec<u64>,
}

impl Points {
    fn of<'a>(probes: impl Iterator<Item = &'a AttachedProbe>) -> Self {
        let mut points = Self::default();
        for p in probes {
            points.offsets.push(p.file_offset);
            points.cookies.push(cookie(p.api.spec_id(), p.api.def().spec.layer));
        }
        points
    }
}

/// A library's windowed probes: (entries, returns) for its allocations and for its frees.
struct WindowLib {
    path: PathBuf,
    allocs: (Points, Points),
    frees: (Points, Points),
}

/// The windowed probes and the links of the window open now.
#[derive(Default)]
pub(super) struct Windows {
    libs: Vec<WindowLib>,
    /// Spec id -> the spec as the kernel has it, for the windowed APIs.
    specs: HashMap<u32, ProbeSpec>,
    /// The current window's number (`SampleRule::window`; 0 before the first).
    number: u8,
    open: bool,
    allocs: Vec<OwnedFd>,
    frees: Vec<OwnedFd>,
    /// Closes the links taken off last (the allocations', then the frees').
    closing: Option<JoinHandle<()>>,
    /// [`Tracer::take_window_failures`].
    failed: Vec<MultiError>,
}

impl Windows {
    /// The spec of a windowed API as the kernel gets it, remembered for the next opening.
    pub(super) fn spec(&mut self, spec_id: u32, mut spec: ProbeSpec) -> ProbeSpec {
        spec.sample.window = self.number;
        self.specs.insert(spec_id, spec);
        spec
    }

    /// Closes `links` after whatever is closing now.
    fn close_after(&mut self, links: Vec<OwnedFd>) {
        let before = self.closing.take();
        self.closing = Some(std::thread::spawn(move || {
            if let Some(before) = before {
                let _ = before.join();
            }
            drop(links);
        }));
    }

    /// Every link, for the stop's detach.
    pub(super) fn take_links(&mut self) -> Vec<OwnedFd> {
        self.open = false;
        let mut links = std::mem::take(&mut self.frees);
        links.append(&mut self.allocs);
        links
    }
}

/// The probes of one sampling kind, and those of them with a return probe.
fn split<'a>(
    probes: &'a [AttachedProbe],
    returns: &'a [AttachedProbe],
    kind: u8,
) -> (impl Iterator<Item = &'a AttachedProbe>, impl Iterator<Item = &'a AttachedProbe>) {
    let of_kind = move |p: &&AttachedProbe| p.api.def().spec.sample.kind == kind;
    (probes.iter().filter(of_kind), returns.iter().filter(of_kind))
}

/// Attaches one program's points in `path` (nothing where there are none).
fn link(
    prog: std::os::fd::BorrowedFd<'_>,
    path: &Path,
    points: &Points,
    ret: bool,
) -> Result<Option<OwnedFd>, MultiError> {
    if points.offsets.is_empty() {
        return Ok(None);
    }
    uprobe_multi::attach(prog, path, &points.offsets, &points.cookies, None, ret, None).map(Some)
}

impl Tracer {
    /// Whether the sampled APIs' probes are attached only in windows.
    pub fn windowed(&self) -> bool {
        self.windows.is_some()
    }

    /// Keeps a library's windowed probes (attached now if a window is open); `returns` are
    /// those of `probes` that have a return probe.
    pub(super) fn add_windowed(&mut self, path: &Path, probes: &[AttachedProbe], returns: &[AttachedProbe]) {
        let Some(windows) = &mut self.windows else { return };
        let (allocs, alloc_returns) = split(probes, returns, sample_kind::ALLOC);
        let (frees, free_returns) = split(probes, returns, sample_kind::FREE);
        let lib = WindowLib {
            path: path.to_path_buf(),
            allocs: (Points::of(allocs), Points::of(alloc_returns)),
            frees: (Points::of(frees), Points::of(free_returns)),
        };
        let index = windows.libs.len();
        windows.libs.push(lib);
        if windows.open {
            if let Err(e) = self.attach_window_lib(index, true).and_then(|()| self.attach_window_lib(index, false)) {
                if let Some(windows) = &mut self.windows {
                    windows.failed.push(e);
                }
            }
        }
    }

    /// The libraries found while a window was open whose windowed probes could not be attached
    /// then (they are from the next window), for the caller to say.
    pub fn take_window_failures(&mut self) -> Vec<MultiError> {
        self.windows.as_mut().map(|w| std::mem::take(&mut w.failed)).unwrap_or_default()
    }

    /// Attaches library `index`'s frees (`frees`) or allocations, returns before entries.
    fn attach_window_lib(&mut self, index: usize, frees: bool) -> Result<(), MultiError> {
        let (Ok(multi), Some(windows)) = (&self.multi, &mut self.windows) else { return Ok(()) };
        let lib = &windows.libs[index];
        let (entries, returns) = if frees { &lib.frees } else { &lib.allocs };
        let mut links = Vec::with_capacity(2);
        links.extend(link(multi.exit.as_fd(), &lib.path, returns, true)?);
        links.extend(link(multi.enter.as_fd(), &lib.path, entries, false)?);
        if frees { &mut windows.frees } else { &mut windows.allocs }.extend(links);
        Ok(())
    }

    /// Opens a window: the windowed specs numbered anew, then every library's frees attached,
    /// then its allocations. Returns the libraries that could not be (warned about by the
    /// caller); the others are attached.
    pub fn open_window(&mut self) -> Result<Vec<MultiError>, LoadError> {
        let Some(windows) = &mut self.windows else { return Ok(Vec::new()) };
        if let Some(closing) = windows.closing.take() {
            // The last window's frees must be gone before its slots can be told from this one's.
            let _ = closing.join();
        }
        windows.number = windows.number.checked_add(1).unwrap_or(1);
        let map = self.ebpf.map_mut("SPECS").ok_or(LoadError::Missing("SPECS"))?;
        let mut specs: Array<_, ProbeSpec> =
            Array::try_from(map).map_err(|source| LoadError::Map { name: "SPECS", source })?;
        for (id, spec) in &mut windows.specs {
            spec.sample.window = windows.number;
            specs.set(*id, *spec, 0).map_err(|source| LoadError::Map { name: "SPECS", source })?;
        }
        windows.open = true;
        let count = windows.libs.len();
        let mut failed = Vec::new();
        for frees in [true, false] {
            for index in 0..count {
                if let Err(e) = self.attach_window_lib(index, frees) {
                    failed.push(e);
                }
            }
        }
        Ok(failed)
    }

    /// Closes the window: its allocations' probes go; its frees' stay for the drain.
    pub fn close_window(&mut self) {
        if let Some(windows) = &mut self.windows {
            windows.open = false;
            let allocs = std::mem::take(&mut windows.allocs);
            windows.close_after(allocs);
        }
    }

    /// Ends the drain: the frees' probes go too, once the allocations' have.
    pub fn end_drain(&mut self) {
        if let Some(windows) = &mut self.windows {
            let frees = std::mem::take(&mut windows.frees);
            windows.close_after(frees);
        }
    }

    /// Whether every link taken off so far is closed: no windowed probe runs any more.
    pub fn window_detached(&self) -> bool {
        self.windows.as_ref().is_none_or(|w| w.closing.as_ref().is_none_or(JoinHandle::is_finished))
    }
}
