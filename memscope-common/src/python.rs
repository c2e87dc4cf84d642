//! What the Python-stack probe needs to walk a CPython interpreter from outside it, and what it
//! sends: userspace finds the interpreter's `_PyRuntime` in each traced process and writes its
//! address and the version's field offsets into a map; the probe walks the thread list to the
//! calling thread's state and reads (code object, instruction pointer) per frame. Userspace
//! resolves code objects to file, function and line.

/// Frames a [`PyStackRecord`] can hold.
pub const MAX_PY_FRAMES: usize = 64;
/// Thread states walked before the probe gives up finding the calling thread's.
pub const MAX_PY_THREADS: u32 = 256;
/// An offset that does not apply to this version.
pub const NO_OFFSET: u32 = u32::MAX;

/// Field offsets of one CPython version (bytes, from the start of each struct).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PyOffsets {
    /// `_PyRuntimeState.interpreters.head`.
    pub runtime_interpreters_head: u32,
    /// `PyInterpreterState.threads.head`.
    pub interp_threads_head: u32,
    /// `PyThreadState.next`.
    pub tstate_next: u32,
    /// `PyThreadState.native_thread_id`.
    pub tstate_native_thread_id: u32,
    /// `PyThreadState.cframe` (3.11, 3.12) or `.current_frame` (3.13).
    pub tstate_frame: u32,
    /// `_PyCFrame.current_frame` behind `tstate_frame` (3.11, 3.12), or [`NO_OFFSET`] when
    /// `tstate_frame` is the frame pointer itself.
    pub cframe_current_frame: u32,
    /// `_PyInterpreterFrame.f_code` / `.f_executable`.
    pub frame_code: u32,
    /// `_PyInterpreterFrame.previous`.
    pub frame_previous: u32,
    /// `_PyInterpreterFrame.prev_instr` / `.instr_ptr`.
    pub frame_instr: u32,
    /// `_PyInterpreterFrame.owner` (a byte).
    pub frame_owner: u32,
    /// The `owner` value of a frame the C stack owns (a shim, not Python code), or [`NO_OFFSET`].
    pub owner_cstack: u32,
    /// 3.9 and 3.10, which have no `native_thread_id`: `tstate_native_thread_id` is then the
    /// offset of `thread_id` (`pthread_self()`, the thread's `struct pthread`), and the kernel
    /// thread id is the `u32` at this offset in it. [`NO_OFFSET`] where the thread state holds
    /// the id itself.
    pub pthread_tid: u32,
}

/// A traced process's interpreter, as the probe reads it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PyProcess {
    /// The address of `_PyRuntime` in the process.
    pub runtime: u64,
    pub offsets: PyOffsets,
}

/// One Python frame: its code object and where in it the frame is.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PyFrame {
    pub code: u64,
    pub instr: u64,
}

/// [`PyStackRecord::flags`]: the calling thread has no Python thread state (a C++ worker).
pub const PY_NO_THREAD: u32 = 1;
/// [`PyStackRecord::flags`]: the walk stopped at [`MAX_PY_FRAMES`] or the depth asked for.
pub const PY_AT_DEPTH: u32 = 2;
/// [`PyStackRecord::flags`]: a read of the interpreter's memory failed (the runtime, a thread
/// state or a frame), so the stack is missing or short.
pub const PY_READ_FAILED: u32 = 4;
/// [`PyStackRecord::flags`]: the thread list was longer than [`MAX_PY_THREADS`] and the calling
/// thread's state was not among those walked.
pub const PY_THREADS_BOUND: u32 = 8;
/// [`PyStackRecord::flags`]: the calling thread ran no Python at that instant (no thread state,
/// or one with no frame: the autograd engine's device threads, allocator and communication
/// threads), so the frames are the process's main thread's, read at the same instant.
pub const PY_MAIN_THREAD: u32 = 16;

/// The Python stack of the thread that made an outermost traced call, read at its entry; sent
/// before the call's records, cut to the frames read.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PyStackRecord {
    /// `ts_ns` is the outermost call's entry time.
    pub hdr: crate::record::RecordHeader,
    pub flags: u32,
    /// Frames in `frames`, innermost first.
    pub frames: u32,
    pub stack: [PyFrame; MAX_PY_FRAMES],
}

/// Bytes of a [`PyStackRecord`] before its frames.
pub const PY_STACK_HEADER_LEN: usize = 24 + 8;

const _: () = assert!(core::mem::size_of::<PyOffsets>() == 48);
const _: () = assert!(core::mem::size_of::<PyProcess>() == 56);
const _: () = assert!(core::mem::size_of::<PyStackRecord>() == PY_STACK_HEADER_LEN + 16 * MAX_PY_FRAMES);
