//! Typed events. Everything the store and the analyses know about a call is here; raw registers
//! do not travel further than `record`. What a call did ([`Op`] and the kinds it names) is the
//! catalogue's (`apis::op`), re-exported here; the DB's names for them are added here.

use crate::apis::libraries::Library;
pub use crate::apis::op::{level, DriverInfo, Marker, Op, PageType, Pool, Space};
use crate::apis::Api;
use crate::stacks::{Stack, StackId};
use crate::vocab::EventType;

impl Space {
    /// The `Event Type` of this memory's MALLOC/FREE rows, as msMemScope writes them: pinned host
    /// memory is `HOST_PINNED` (Insight's decomposition accepts it), CPU tensors are `HOST`.
    pub fn event_type(self) -> EventType {
        match self {
            Self::Device => EventType::Hal,
            Self::Host | Self::Registered => EventType::HostPinned,
            Self::Cpu => EventType::Host,
        }
    }
}

/// Which per-device output an event belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeviceKey {
    /// An accelerator, by the runtime's device id.
    Npu(u32),
    /// Host memory.
    Cpu,
    /// Device memory whose device the trace could not learn: the thread selected its device
    /// before the tracer attached and has not called set/get-device since.
    Unknown,
}

impl Pool {
    /// The FRAMEWORK level of a pool block's owner, as msMemScope's decomposition names it:
    /// Insight hangs these under the HAL root of its decomposition tree.
    pub const fn owner(self) -> &'static str {
        match self {
            Self::Caching => "PTA",
            Self::Workspace => "PTA_WORKSPACE",
        }
    }

    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Caching => "caching",
            Self::Workspace => "workspace",
        }
    }
}

/// A traced call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Call {
    pub api: Api,
    /// Wall-clock ns at function entry (the event's own time is the return).
    pub entry_wall_ns: u64,
    /// The API's status (`aclError`, `drvError_t`; 0 is success).
    pub status: i32,
    /// The status means the callee ran out of memory.
    pub out_of_memory: bool,
    /// The call of the next layer out that this one ran inside of, on the same thread.
    pub outer: Option<Api>,
    /// The thread's device at return, as set by its last successful set/get-device call.
    pub thread_device: Option<u32>,
    pub op: Op,
    /// The native stack of the thread's outermost traced call this one ran in (or is), when
    /// stacks are captured ([`NO_STACK`] otherwise): every row the call makes carries it.
    pub stack: StackId,
    /// The thread's Python stack at that call (`--call-stack python`), or none.
    pub py_stack: StackId,
    /// Under the daemon's sampling, the requested bytes this recorded allocation stands for
    /// (a multiple of the interval; `memscope_common::sampling`); `None`: recorded in full.
    pub sample_weight: Option<u64>,
    /// Left out by the daemon's sampling, sent for its flight recorder's window alone: the
    /// job's own rows and live view never see it.
    pub window_only: bool,
    /// The library that made the call, when it is one known to take memory itself (its
    /// caller's address lies in that library's file): the owner of what the call takes.
    pub caller: Option<Library>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EventKind {
    Call(Call),
    /// A USDT marker of the markers package.
    Marker(Marker),
    /// A traced process created a child process.
    Fork {
        child: u32,
    },
    /// A traced process exited.
    Exit,
    /// A stack seen for the first time, normalized: the store needs it before the first row
    /// that refers to it. No model state changes.
    Stack(Box<Stack>),
    /// A Python stack text seen for the first time, by its id (its own numbering).
    PyStack {
        id: StackId,
        text: Box<str>,
    },
    /// A sample of the thread's Python functions, outermost first (`trace --python-trace`). No
    /// model state changes.
    PySample(Vec<crate::ingest::py_trace::PyFunction>),
}

/// One event. `wall_ns` is nanoseconds since the Unix epoch (converted from the kernel's
/// monotonic clock), `pid` the process (tgid) and `tid` the kernel thread id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    pub wall_ns: u64,
    pub pid: u32,
    pub tid: u32,
    pub kind: EventKind,
}
