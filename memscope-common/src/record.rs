//! Ring-buffer records. Every record starts with a [`RecordHeader`]; its `kind` says which
//! payload struct the whole record is. Userspace checks the length against the kind's size before
//! reading anything (see `memscope-core/src/raw.rs`).
//!
//! Records are sized for the common case: a call record is 136 bytes (144 in the ring with the
//! kernel's 8-byte header), and only the few APIs with a text argument pay for the text, in a
//! [`CallTextRecord`]. The ring's size is a trade of memory (the tracer maps all of it) against
//! how many records a burst can leave waiting, so every byte of the common record is a byte of
//! either.

/// Arguments captured at function entry. Six is every integer register of the x86-64 and arm64
/// calling conventions that the traced APIs use.
pub const MAX_ARGS: usize = 6;

/// Bytes of a C string argument kept in a record (domain names, mstx messages), NUL included:
/// msMemScope keeps labels and messages up to 128 characters.
pub const TEXT_LEN: usize = crate::usdt::USDT_TEXT_LEN;

/// The `group_dead` offset handed to the exit tracepoint where the kernel's
/// `sched/sched_process_exit` has no such field (it came with Linux 6.16; Debian 12's 6.1 and
/// the 5.10–6.6 kernels of Ascend servers lack it). The probe then counts the thread-group
/// leader's exit as the process's, as bcc's tools do: right but for a leader that leaves by
/// `pthread_exit` while other threads run on.
pub const NO_GROUP_DEAD: u32 = u32::MAX;

/// Which payload follows the header. The ids are part of the ABI: never renumber, only append.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordKind {
    /// A traced function returned: [`CallRecord`].
    Call = 1,
    /// A traced process forked: [`ForkRecord`].
    Fork = 2,
    /// A traced process exited: [`ExitRecord`].
    Exit = 3,
    /// A USDT probe fired: [`UsdtRecord`].
    Usdt = 4,
    /// A buffer an API call passed, copied at its entry: [`BlobRecord`].
    Blob = 5,
    /// A traced function with a text argument returned: [`CallTextRecord`].
    CallText = 6,
    /// The user stack at the entry of a thread's outermost traced call: [`StackRecord`], cut to
    /// the frames captured.
    Stack = 7,
    /// A window of a thread's user stack and its registers at the entry of its outermost traced
    /// call (`--unwind dwarf`): [`StackWindowRecord`], cut to the bytes copied.
    StackWindow = 8,
    /// The calling thread's Python frames at the entry of its outermost traced call:
    /// [`crate::python::PyStackRecord`], cut to the frames read.
    PyStack = 9,
    /// A process replaced its image (`execve`): an [`ExitRecord`]'s layout, the header alone.
    /// What was known of its old image (its interpreter, its mappings) no longer holds. Sent for
    /// traced processes, and in the daemon for every process its rules do not deny (a new
    /// program to look at for libraries).
    Exec = 10,
    /// The dynamic linker of a process that is or may be traced changed its list of loaded
    /// objects (`_dl_debug_state`: the program's libraries at its start, each `dlopen` and
    /// `dlclose`): an [`ExitRecord`]'s layout, the header alone. Its mappings are to be read
    /// again, for library files not probed yet.
    Loaded = 11,
    /// The Python sampler's timer fired (`trace --python-trace`) while a traced thread ran
    /// Python on that CPU: its frames, as a [`crate::python::PyStackRecord`] cut to the frames
    /// read; the header's time is the sample's.
    PySample = 12,
}

impl RecordKind {
    /// Maps a raw header value back to a kind; `None` for ids this build does not know.
    pub fn from_u32(v: u32) -> Option<Self> {
        match v {
            1 => Some(Self::Call),
            2 => Some(Self::Fork),
            3 => Some(Self::Exit),
            4 => Some(Self::Usdt),
            5 => Some(Self::Blob),
            6 => Some(Self::CallText),
            7 => Some(Self::Stack),
            8 => Some(Self::StackWindow),
            9 => Some(Self::PyStack),
            10 => Some(Self::Exec),
            11 => Some(Self::Loaded),
            12 => Some(Self::PySample),
            _ => None,
        }
    }
}

/// Common to every record.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct RecordHeader {
    /// A [`RecordKind`] id.
    pub kind: u32,
    /// Padding that keeps `ts_ns` 8-byte aligned; always 0. Written explicitly because a ring
    /// slot is not zeroed: an implicit hole would carry whatever the slot held before.
    pub _reserved: u32,
    /// `bpf_ktime_get_ns()`: CLOCK_MONOTONIC nanoseconds when the record was produced.
    pub ts_ns: u64,
    /// Process id (kernel tgid).
    pub tgid: u32,
    /// Thread id (kernel pid of the task).
    pub tid: u32,
}

impl RecordHeader {
    /// A header of `kind`, its padding zeroed: the one way producers build one.
    #[inline(always)]
    pub const fn new(kind: RecordKind, ts_ns: u64, tgid: u32, tid: u32) -> Self {
        Self { kind: kind as u32, _reserved: 0, ts_ns, tgid, tid }
    }

    /// A header for the current task, from `bpf_get_current_pid_tgid()`'s value (the tgid in
    /// the high half, the thread id in the low half).
    #[inline(always)]
    pub const fn of_task(kind: RecordKind, ts_ns: u64, pid_tgid: u64) -> Self {
        Self::new(kind, ts_ns, (pid_tgid >> 32) as u32, pid_tgid as u32)
    }
}

/// One traced call, emitted when the outermost traced function of its layer returns on a thread.
/// The narrow fields are narrow so the record fits 136 bytes (see the module comment): spec ids
/// are below [`crate::spec::MAX_SPECS`], and the config's module id is 16 bits in ACL.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CallRecord {
    pub hdr: RecordHeader,
    /// CLOCK_MONOTONIC nanoseconds at function entry (the header's `ts_ns` is the return).
    pub entry_ns: u64,
    /// Integer argument registers at entry.
    pub args: [u64; MAX_ARGS],
    /// The return register.
    pub ret: u64,
    /// Values of the spec's field reads (out-pointers, struct fields), in spec order.
    pub fields: [u64; crate::spec::MAX_FIELDS],
    /// The attach cookie: index of the [`crate::spec::ProbeSpec`] that describes this API.
    pub spec_id: u16,
    /// The spec id of the call open in the spec's outer layer on this thread, or 0.
    pub outer_spec: u16,
    /// The device the thread last set with a successful set-device call, or -1 if none was seen.
    pub thread_device: i32,
    /// Device id found in the call's malloc config, or -1.
    pub cfg_device: i32,
    /// Module id found in the call's malloc config, or [`NO_MODULE`].
    pub cfg_module: u16,
    /// Bit i set: `fields[i]` was read successfully.
    pub fields_ok: u8,
    /// Sampling's verdict on a sampled API's call: 0, recorded in full (no sampling, a block of
    /// the interval or more, a free, a failure); else the sample points that fell in its
    /// requested bytes (at most [`crate::sampling::MAX_POINTS`]), its weight being that many
    /// intervals.
    pub points: u8,
}

/// [`CallRecord::cfg_module`] when the config named no module (so module 0xffff reads as none;
/// ACL's module ids are far below it).
pub const NO_MODULE: u16 = u16::MAX;

/// A traced call whose spec has a text argument (mstx messages and domain names, kernel names):
/// the call, its header's kind [`RecordKind::CallText`], then the text.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CallTextRecord {
    pub call: CallRecord,
    /// The spec's text argument, NUL-terminated (empty if it could not be read).
    pub text: [u8; TEXT_LEN],
}

/// A traced process created a task. Threads trigger it too; userspace tells them apart.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ForkRecord {
    pub hdr: RecordHeader,
    /// The new task's id (its tgid when it is a process).
    pub child: u32,
    pub _reserved: u32,
}

/// The last thread of a traced process exited: the header's `tgid` is the process. Only the
/// group's end is sent (the eBPF side drops a thread's exit), so there is nothing to add to the
/// header; the exit code is not available to the tracepoint.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ExitRecord {
    pub hdr: RecordHeader,
}

/// A USDT probe fired (markers: tags, steps, ranges). Emitted at the probe site; there is no
/// return.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct UsdtRecord {
    pub hdr: RecordHeader,
    /// The attach cookie: index of the site's [`crate::usdt::UsdtSpec`].
    pub spec_id: u32,
    /// The spec's `probe` (userspace's id for what the probe means).
    pub probe: u32,
    /// The site's arguments, decoded per its spec (0 past `arg_count`).
    pub args: [u64; crate::usdt::USDT_MAX_ARGS],
    /// The spec's string argument, NUL-terminated (empty if none or unreadable).
    pub text: [u8; crate::usdt::USDT_TEXT_LEN],
}

/// Bytes of a call's buffer argument kept (kernel launch arguments: 32 pointers).
pub const BLOB_LEN: usize = 256;

/// A buffer argument of a call, copied at the call's entry (the buffer may be reused once the
/// call returns). The call's own [`CallRecord`] follows on the same thread.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlobRecord {
    pub hdr: RecordHeader,
    pub spec_id: u32,
    /// Bytes copied (at most [`BLOB_LEN`]; 0 when the read failed).
    pub len: u32,
    /// The buffer's length as the call gave it.
    pub full_len: u64,
    pub data: [u8; BLOB_LEN],
}

/// Frames a [`StackRecord`] can hold: the kernel's default `kernel.perf_event_max_stack`, the
/// most `bpf_get_stack` walks.
pub const MAX_STACK_DEPTH: usize = 127;

/// [`StackRecord::flags`]: the walk filled every frame it was allowed (`--call-stack c:N`), so
/// the stack may go on past its last frame.
pub const STACK_AT_DEPTH: u32 = 1;
/// [`StackRecord::flags`]: `bpf_get_stack` failed; the record has no frames.
pub const STACK_FAILED: u32 = 2;

/// The user stack of a thread at the entry of its outermost traced call (no traced call of any
/// layer open on the thread), so that every call nested in it, and the rows they make, share
/// it. Sent before those calls' own records on the same thread. Only the frames captured travel:
/// the record is `STACK_HEADER_LEN + 8 * frames` bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct StackRecord {
    /// `ts_ns` is the outermost call's entry time, exactly its [`CallRecord::entry_ns`].
    pub hdr: RecordHeader,
    /// The return address at entry (x86-64: the word at the stack pointer; arm64: the link
    /// register). A frame-pointer walk from a function's first instruction skips its caller,
    /// whose frame is not set up yet: this is that frame.
    pub return_address: u64,
    /// `STACK_*` bits.
    pub flags: u32,
    /// Frames in `ips`.
    pub frames: u32,
    /// Instruction pointers, innermost first: the traced function's entry, then the return
    /// addresses the frame-pointer chain gives.
    pub ips: [u64; MAX_STACK_DEPTH],
}

/// Bytes of a [`StackRecord`] before its `ips`.
pub const STACK_HEADER_LEN: usize = 24 + 16;

/// The largest stack window `--unwind dwarf` copies (`--stack-window`), as `perf --call-graph
/// dwarf` copies 8 KiB by default.
pub const MAX_STACK_WINDOW: usize = 16384;

/// [`StackWindowRecord::flags`]: no window could be read at all.
pub const WINDOW_FAILED: u32 = 1;

/// The registers and the top of a thread's user stack at the entry of its outermost traced
/// call, for unwinding in userspace from `.eh_frame` (`--unwind dwarf`), where frame pointers
/// are missing. Sent, like a [`StackRecord`], before the calls' own records; only the bytes
/// copied travel: the record is `WINDOW_HEADER_LEN + len` bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct StackWindowRecord {
    /// `ts_ns` is the outermost call's entry time, exactly its [`CallRecord::entry_ns`].
    pub hdr: RecordHeader,
    /// The instruction pointer (the traced function's entry).
    pub ip: u64,
    /// The stack pointer: `data` is the memory from here up.
    pub sp: u64,
    /// The frame pointer (x86-64 `rbp`, arm64 `x29`).
    pub fp: u64,
    /// The link register (arm64 `x30`; 0 on x86-64, where the return address is on the stack).
    pub lr: u64,
    /// Bytes of `data` copied (the window asked for, or less at the top of the stack).
    pub len: u32,
    /// `WINDOW_*` bits.
    pub flags: u32,
    pub data: [u8; MAX_STACK_WINDOW],
}

/// Bytes of a [`StackWindowRecord`] before its `data`.
pub const WINDOW_HEADER_LEN: usize = 24 + 40;

const _: () = assert!(core::mem::size_of::<RecordHeader>() == 24);
const _: () = assert!(core::mem::size_of::<BlobRecord>() == 24 + 16 + BLOB_LEN);
const _: () =
    assert!(core::mem::size_of::<UsdtRecord>() == 24 + 8 + 8 * crate::usdt::USDT_MAX_ARGS + crate::usdt::USDT_TEXT_LEN);
const _: () = assert!(core::mem::size_of::<CallRecord>() == 24 + 8 + 48 + 8 + 32 + 16);
const _: () = assert!(core::mem::size_of::<CallRecord>() == 136);
const _: () = assert!(core::mem::size_of::<CallTextRecord>() == 136 + TEXT_LEN);
const _: () = assert!(crate::spec::MAX_SPECS <= u16::MAX as u32);
const _: () = assert!(crate::spec::MAX_FIELDS <= 8);
const _: () = assert!(core::mem::size_of::<ForkRecord>() == 32);
const _: () = assert!(core::mem::size_of::<ExitRecord>() == 24);
const _: () = assert!(core::mem::size_of::<StackRecord>() == STACK_HEADER_LEN + 8 * MAX_STACK_DEPTH);
const _: () = assert!(core::mem::size_of::<StackWindowRecord>() == WINDOW_HEADER_LEN + MAX_STACK_WINDOW);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_task_header_splits_pid_tgid_and_zeroes_its_padding() {
        let hdr = RecordHeader::of_task(RecordKind::Exit, 9, (7 << 32) | 8);
        assert_eq!((hdr.kind, hdr._reserved, hdr.ts_ns, hdr.tgid, hdr.tid), (RecordKind::Exit as u32, 0, 9, 7, 8));
    }
}
