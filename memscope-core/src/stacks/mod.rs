//! Native call stacks: the captured frames, from the kernel's instruction pointers to the
//! `Call Stack(C)` text and the `ms_stacks`/`ms_frames` tables.
//!
//! The pattern is blazesym's own, *normalize now, symbolize later*: while the traced process
//! lives, each new stack's addresses become (module, file offset) pairs ([`capture`]); the store
//! thread later turns those into functions and lines from the files themselves ([`symbolize`]),
//! which works the same after the process has exited, and refuses (says so) when a file changed
//! on disk since the capture (its build id no longer matches). [`text`] writes msMemScope's column.
//!
//! A stack is captured once per outermost traced call on a thread; every row that call and the
//! calls nested in it make shares it, by a [`StackId`]. Identical stacks of one process are one
//! id, so a loop that allocates from the same place a million times stores one stack.

pub mod capture;
pub mod frame_pointers;
pub mod python;
pub mod spec;
pub mod symbolize;
pub mod text;
pub mod unwind;

use std::path::PathBuf;
use std::sync::Arc;

/// A stack's number in its trace (1, 2, ...); [`NO_STACK`] for rows without one.
pub type StackId = u32;

pub const NO_STACK: StackId = 0;

/// A mapped file, as the capture saw it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Module {
    pub path: PathBuf,
    /// The GNU build id, when the file has one.
    pub build_id: Option<Vec<u8>>,
    /// Its separate debug file, for a stripped file that has one (`.gnu_debuglink` or build id,
    /// found as the attach code finds them): symbols are read from there.
    pub debug_file: Option<PathBuf>,
}

/// One frame, normalized.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    /// The address in the process (the function's entry for frame 0, a return address after).
    pub addr: u64,
    /// The file it lies in and the offset there of the address symbolized (for a return
    /// address, the byte before it: the call); `None` for anonymous memory (JIT code) or an
    /// address no mapping held.
    pub module: Option<(Arc<Module>, u64)>,
    /// A return address (every frame but the first).
    pub returns: bool,
}

/// Why a stack ends where it does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// It reaches the thread's or the process's entry (`_start`, `start_thread`, ...).
    Whole,
    /// It filled the depth asked for (`--call-stack c:N`).
    AtDepth,
    /// The frame-pointer chain broke before the entry: a function on the way was built without
    /// frame pointers (`--unwind dwarf` walks such stacks).
    Truncated,
    /// The kernel could not walk the stack at all.
    Failed,
}

impl Cut {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Whole => "whole",
            Self::AtDepth => "at_depth",
            Self::Truncated => "truncated",
            Self::Failed => "failed",
        }
    }
}

/// A new stack, normalized, on its way to the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stack {
    pub id: StackId,
    pub pid: u32,
    /// Innermost first.
    pub frames: Vec<Frame>,
    /// The walk filled the depth asked for.
    pub at_depth: bool,
    /// The kernel's walk failed.
    pub failed: bool,
}
