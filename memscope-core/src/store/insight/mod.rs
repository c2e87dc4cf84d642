//! Model outputs to `memscope_dump` rows, in msMemScope's vocabulary
//! (shared/reference/msmemscope-and-insight.md §2):
//!
//! | output | Event | Event Type | Ptr |
//! |---|---|---|---|
//! | device block allocated / freed | `MALLOC` / `FREE` | `HAL` | `0x%016x` |
//! | pinned host block allocated / freed (`aclrtMallocHost`) | `MALLOC` / `FREE` | `HOST_PINNED` (Attr `pinned`) | `0x%016x` |
//! | allocation failed for lack of memory (runtime 207001, driver 6) | `OOM_DETAIL` | `OOM_TRIGGER` | `N/A` |
//! | any other failed call | `API_ERROR` | `HAL` / `HOST` | `N/A` |
//! | address reserve/release, physical alloc/free (Attr `unmatched` on a release of what the trace never saw made) | `VMM` | `RESERVE` / `RELEASE` / `PHYSICAL_MALLOC` / `PHYSICAL_FREE` | `N/A` |
//! | trace start / stop | `SYSTEM` | `START_TRACE` / `STOP_TRACE` | `N/A` |
//! | framework pool block handed out / taken back | `MALLOC` / `FREE` | `PTA` (Attr `pool`, `used`, `total`) | `0x%016x` |
//! | CPU tensor storage (`c10::alloc_cpu`) | `MALLOC` / `FREE` | `HOST` | `0x%016x` |
//! | step boundary (markers `step()`, mstx `step start` range) | `SYSTEM` | `STEP` (Name: the step number) | `N/A` |
//! | mark, range start / end (markers or mstx) | `MSTX` | `Mark` / `Range_start` / `Range_end` (Name: `"message"`, `Range end from id N`) | `N/A` |
//! | operator start / end (markers `trace_ops()`) | `OP_LAUNCH` | `ATEN_START` / `ATEN_END` (Name: `aten.mm.default`) | `N/A` |
//! | ATB operation start / end (`atb::Runner::Execute` entry / return) | `OP_LAUNCH` | `ATB_START` / `ATB_END` (Attr `workspace_ptr`, `workspace_size`, `intermediate_size`, `runner`) | `N/A` |
//! | an operator's tensor read / written | `ACCESS` | `READ` / `WRITE` (Name: the operator; Attr `dtype`, `shape`) | `0x%016x` |
//!
//! Every MALLOC carries its `owner` path (`PTA@vllm@kv_cache`, `CANN@HCCL`, `HOST@weight`): the
//! allocator's label and the thread's tag spans; an address tag rewrites it later (DB only).
//! Step, MSTX and OP_LAUNCH rows go to every device's output: each device's analyses need the
//! steps, and the inefficient-memory analysis numbers a process's memory events by its
//! operators, in whichever device file the blocks are (an operator's own device is not known
//! from the marker, and one operator may touch host and device blocks). ATB operations are the
//! exception: their workspace places them on one device, and their rows are that device's.
//!
//! `API_ERROR` and `VMM` are ours; Insight ignores Events it does not know.
//!
//! The FREE of a block the trace never saw allocated (born before an attach) has no size and no
//! `allocation_id` (Attr `unmatched`): Insight would count it as a block of size 0 or pair it
//! with an unrelated one, so the store keeps it out of `memscope_dump` ([`is_untracked_free`]).
//!
//! The Event and Event Type of every row, and every Attr key, are the vocabulary's
//! ([`crate::vocab`]): the analyses read the same names. [`blocks`] writes the rows of blocks,
//! failures and OOM listings; [`events`] those of VMM steps, uses, operators, steps and marks.

mod blocks;
mod events;
#[cfg(test)]
mod tests;

use std::borrow::Cow;
use std::sync::OnceLock;

use super::attr::{push_padded, Attr, Padded, Pairs, Plain, Value};
use crate::apis::Api;
use crate::model::{DeviceKey, Output, Site};
use crate::vocab::{Event, EventType};

pub use self::events::system_row;
/// Where the analyses have named them since before the vocabulary.
pub use crate::vocab::{GC, STREAM_USES, UNMATCHED};

/// `"true"`, the value of every flag key.
const TRUE: Plain = Plain::new("true");

/// An API's name as an Attr value. Every row names one or two, so each name is checked once,
/// for the whole catalogue, and padded for a copy of a fixed size ([`Padded`]).
fn api_name(api: Api) -> Value<'static> {
    match api_names().get(api as usize) {
        Some(Some(name)) => Value::Padded(name),
        _ => Value::Str(api.name()),
    }
}

/// The `Name` of a row named by its API.
pub fn push_api_name(text: &mut String, api: Api) {
    match api_names().get(api as usize) {
        Some(Some(name)) => push_padded(text, name),
        _ => text.push_str(api.name()),
    }
}

fn api_names() -> &'static [Option<Padded>] {
    static NAMES: OnceLock<Vec<Option<Padded>>> = OnceLock::new();
    NAMES.get_or_init(|| {
        let mut names = vec![None; Api::all().map(|def| def.api as usize + 1).max().unwrap_or(0)];
        for def in Api::all() {
            names[def.api as usize] = Padded::new(def.name);
        }
        names
    })
}

/// A row's typed columns: all but its text ones (Name, Ptr's text, Attr). The same for a row
/// made whole ([`Row`]), one written straight into a batch ([`Columns`]), and one a batch holds
/// (`batch::Head`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Head {
    pub event: Event,
    pub event_type: EventType,
    pub ts_ns: u64,
    pub pid: u32,
    pub tid: u32,
    pub device: DeviceKey,
    pub ptr: Option<u64>,
    /// Written to every device's output (its `device` is replaced by each output's).
    pub broadcast: bool,
    /// The FREE of a block the trace never saw allocated (Attr `unmatched`).
    pub untracked: bool,
    /// A FREE made up at the stop for a block still live (Attr `shadow`).
    pub shadow: bool,
}

impl Head {
    /// The head of a call's row, at the call's time and thread.
    fn at(site: &Site, event: Event, event_type: EventType, device: DeviceKey, ptr: Option<u64>) -> Self {
        Self {
            event,
            event_type,
            ts_ns: site.wall_ns,
            pid: site.pid,
            tid: site.tid,
            device,
            ptr,
            broadcast: false,
            untracked: false,
            shadow: false,
        }
    }

    /// The head of a row every device's output gets, tied to no block or call.
    fn broadcast(event: Event, event_type: EventType, ts_ns: u64, pid: u32, tid: u32) -> Self {
        let (device, ptr) = (DeviceKey::Unknown, None);
        Self { event, event_type, ts_ns, pid, tid, device, ptr, broadcast: true, untracked: false, shadow: false }
    }
}

/// One `memscope_dump` row, before its per-file `ID`. It borrows its text from the model output
/// it is made from and its Attr reuses a buffer, so making one allocates nothing. Rows of a DB
/// trace skip this form: their columns and Attr go straight into a batch ([`write_row`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row<'a> {
    pub head: Head,
    pub name: Cow<'a, str>,
    pub attr: Attr,
}

/// A row's `Name`: most rows are named by their API, whose name is written from the catalogue
/// ([`push_api_name`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Name<'a> {
    Api(Api),
    Text(Cow<'a, str>),
}

impl Name<'_> {
    /// Appends the `Name` column.
    pub fn write(&self, text: &mut String) {
        match self {
            Self::Api(api) => push_api_name(text, *api),
            Self::Text(name) => text.push_str(name),
        }
    }
}

/// A row's columns but its Attr (see [`Row`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Columns<'a> {
    pub head: Head,
    pub name: Name<'a>,
}

impl<'a> Columns<'a> {
    /// The columns of a call's row, named by its API.
    fn at(site: &Site, event: Event, event_type: EventType, device: DeviceKey, ptr: Option<u64>) -> Self {
        Self { head: Head::at(site, event, event_type, device, ptr), name: Name::Api(site.api) }
    }

    fn named(head: Head, name: Cow<'a, str>) -> Self {
        Self { head, name: Name::Text(name) }
    }
}

impl<'a> Row<'a> {
    fn new(columns: Columns<'a>, attr: Attr) -> Self {
        let name = match columns.name {
            Name::Api(api) => Cow::Borrowed(api.name()),
            Name::Text(name) => name,
        };
        Self { head: columns.head, name, attr }
    }

    #[cfg(test)]
    pub fn device_id(&self) -> String {
        let mut s = String::new();
        super::batch::write_device_id(self.head.device, &mut s);
        s
    }

    #[cfg(test)]
    pub fn ptr_text(&self) -> String {
        let mut s = String::new();
        super::batch::write_ptr(self.head.ptr, &mut s);
        s
    }
}

/// Whether `row` is the FREE of a block the trace never saw allocated: such rows go to our own
/// `ms_untracked_frees`, never to Insight's table.
pub fn is_untracked_free(row: &Row<'_>) -> bool {
    row.head.untracked
}

/// The row for one model output; `None` for outputs that change earlier rows ([`Output::Retag`]).
pub fn to_row(output: &Output) -> Option<Row<'_>> {
    let mut attr = Attr::new();
    let (columns, _) = build(output, attr.pairs())?;
    Some(Row::new(columns, attr))
}

/// Writes the Attr of one model output's row onto the end of `text` and gives its other
/// columns; `None`, with nothing written, for outputs that change earlier rows
/// ([`Output::Retag`]). `extra` pairs (the driver's latest figures) end the Attr.
pub fn write_row<'a>(output: &'a Output, text: &mut String, extra: &[(&'static str, u64)]) -> Option<Columns<'a>> {
    let (columns, mut attr) = build(output, Pairs::new(text))?;
    for (key, value) in extra {
        attr = attr.with(key, *value);
    }
    attr.close();
    Some(columns)
}

/// The columns of `output`'s row, and its Attr's pairs added to `attr`.
fn build<'a, 'o>(output: &'a Output, attr: Pairs<'o>) -> Option<(Columns<'a>, Pairs<'o>)> {
    Some(match output {
        Output::Retag { .. } => return None,
        Output::Malloc { .. } => blocks::malloc(output, attr),
        Output::Free { .. } => blocks::free(output, attr),
        Output::PoolMalloc { .. } => blocks::pool_malloc(output, attr),
        Output::PoolFree { .. } => blocks::pool_free(output, attr),
        Output::OomBlock { .. } => blocks::oom_block(output, attr),
        Output::Failed { .. } => blocks::failed(output, attr),
        Output::Vmm { .. } => events::vmm(output, attr),
        Output::Access { .. } => events::access(output, attr),
        Output::OpAccess { .. } => events::op_access(output, attr),
        Output::OpLaunch { .. } => events::op_launch(output, attr),
        Output::AtbLaunch { .. } => events::atb_launch(output, attr),
        Output::KernelLaunch { .. } => events::kernel_launch(output, attr),
        Output::Step { .. } => events::step(output, attr),
        Output::Mstx { .. } => events::mstx(output, attr),
    })
}
