//! Model outputs to `memscope_dump` rows, in msMemScope's vocabulary
//! (shared/reference/msmemscope-and-insight.md §2):
//!
//! | output | Event | Event Type | Ptr |
//! |---|---|---|---|
//! | device block allocated / freed | `MALLOC` / `FREE` | `HAL` | `0x%016x` |
//! | pinned host block allocated / freed (`aclrtMallocHost`) | `MALLOC` / `FREE` | `HOST_PINNED` (Attr `pinned`) | `0x%016x` |
//! | allocation failed for lack of memory (runtime 207001, driver 6) | `OOM_DETAIL` | `OOM_TRIGGER` | `N/A` |
//! | any other failed call | `API_ERROR` | `HAL` / `HOST` | `N/A` |
//! | address reserve/release, physical alloc/free | `VMM` | `RESERVE` / `RELEASE` / `PHYSICAL_MALLOC` / `PHYSICAL_FREE` | `N/A` |
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

use std::borrow::Cow;
use std::cell::RefCell;
use std::sync::OnceLock;

use super::attr::{push_padded, Attr, Padded, Pairs, Plain, Value};
use super::Meta;
use crate::apis::{hal, Api};
use crate::model::output::Owner;
use crate::model::{AccessKind, DeviceKey, DriverInfo, MstxKind, Origin, Output, PageType, Pool, Site, Space, VmmStep};

/// The `Name` of an operator's rows when the marker's text could not be read.
const NO_NAME: &str = "N/A";
/// `Attr.freed_by` of a FREE made inside a pass of Python's garbage collector (not msMemScope's:
/// it cannot see the collector). `analysis::gc_held` reads it.
pub const GC: &str = "gc";
/// `Attr` key of a FREE of a block the trace never saw allocated.
pub const UNMATCHED: &str = "unmatched";
/// `Attr` key of a PTA FREE whose block was still marked on other streams (`recordStream`), so
/// the allocator kept it until their work completed (not msMemScope's). `analysis::stream_reuse`
/// reads it.
pub const STREAM_USES: &str = "stream_uses";

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

fn page_type(page: PageType) -> Plain {
    match page {
        PageType::Normal => const { Plain::new(PageType::Normal.as_str()) },
        PageType::Huge => const { Plain::new(PageType::Huge.as_str()) },
        PageType::Giant => const { Plain::new(PageType::Giant.as_str()) },
    }
}

fn pool_name(pool: Pool) -> Plain {
    match pool {
        Pool::Caching => const { Plain::new(Pool::Caching.as_str()) },
        Pool::Workspace => const { Plain::new(Pool::Workspace.as_str()) },
    }
}

fn pool_owner(pool: Pool) -> Value<'static> {
    Value::Plain(match pool {
        Pool::Caching => const { Plain::new(Pool::Caching.owner()) },
        Pool::Workspace => const { Plain::new(Pool::Workspace.owner()) },
    })
}

fn access_type(kind: AccessKind) -> &'static str {
    match kind {
        AccessKind::Read => "READ",
        AccessKind::Write => "WRITE",
        AccessKind::Unknown => "UNKNOWN",
    }
}

/// msMemScope's aten ACCESS keys from the markers' tensor description: `float32[4,8]` is dtype
/// `float32` and shape `[4,8]`; a description of another form is kept whole as `tensor`.
fn with_tensor_desc<'o>(attr: Pairs<'o>, desc: Option<&str>) -> Pairs<'o> {
    let Some(desc) = desc else { return attr };
    match desc.find('[') {
        Some(i) if i > 0 => attr.with("dtype", &desc[..i]).with("shape", &desc[i..]),
        _ => attr.with("tensor", desc),
    }
}

/// One `memscope_dump` row, before its per-file `ID`. It borrows its text from the model output
/// it is made from and its Attr reuses a buffer, so making one allocates nothing. Rows of a DB
/// trace skip this form: their columns and Attr go straight into a batch ([`write_row`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row<'a> {
    pub event: &'static str,
    pub event_type: &'static str,
    pub name: Cow<'a, str>,
    pub ts_ns: u64,
    pub pid: u32,
    pub tid: u32,
    pub device: DeviceKey,
    pub ptr: Option<u64>,
    pub attr: Attr,
    /// Written to every device's output (its `device` is replaced by each output's).
    pub broadcast: bool,
    /// The FREE of a block the trace never saw allocated (Attr `unmatched`).
    pub untracked: bool,
    /// A FREE made up at the stop for a block still live (Attr `shadow`).
    pub shadow: bool,
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
    pub event: &'static str,
    pub event_type: &'static str,
    pub name: Name<'a>,
    pub ts_ns: u64,
    pub pid: u32,
    pub tid: u32,
    pub device: DeviceKey,
    pub ptr: Option<u64>,
    pub broadcast: bool,
    pub untracked: bool,
    pub shadow: bool,
}

impl<'a> Row<'a> {
    fn new(columns: Columns<'a>, attr: Attr) -> Self {
        let Columns { event, event_type, name, ts_ns, pid, tid, device, ptr, broadcast, untracked, shadow } = columns;
        let name = match name {
            Name::Api(api) => Cow::Borrowed(api.name()),
            Name::Text(name) => name,
        };
        Self { event, event_type, name, ts_ns, pid, tid, device, ptr, attr, broadcast, untracked, shadow }
    }

    #[cfg(test)]
    pub fn device_id(&self) -> String {
        let mut s = String::new();
        super::batch::write_device_id(self.device, &mut s);
        s
    }

    #[cfg(test)]
    pub fn ptr_text(&self) -> String {
        let mut s = String::new();
        super::batch::write_ptr(self.ptr, &mut s);
        s
    }
}

/// Whether `row` is the FREE of a block the trace never saw allocated: such rows go to our own
/// `ms_untracked_frees`, never to Insight's table.
pub fn is_untracked_free(row: &Row<'_>) -> bool {
    row.untracked
}

/// Pinned host memory is marked as msMemScope does; CPU-allocator memory is not pinned.
fn pinned(space: Space) -> bool {
    space == Space::Host
}

fn columns<'a>(
    site: &Site,
    event: &'static str,
    event_type: &'static str,
    device: DeviceKey,
    ptr: Option<u64>,
) -> Columns<'a> {
    Columns {
        event,
        event_type,
        name: Name::Api(site.api),
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

/// Attr keys for the driver call behind a fact: the driver API when it differs from the row's
/// (a merged runtime + driver call), its flag, module and page class.
fn with_driver<'o>(mut attr: Pairs<'o>, site: &Site, driver: Option<&DriverInfo>) -> Pairs<'o> {
    let Some(d) = driver else { return attr };
    if d.api != site.api {
        attr = attr.with("hal_api", api_name(d.api));
    }
    attr = attr.with_opt("flag", d.flag.map(Value::Addr)).with_opt("page_type", d.page.map(page_type));
    match d.api {
        Api::HalMemAlloc => attr.with("alloc_type", const { Plain::new("alloc") }),
        Api::HalMemCreate => attr.with("alloc_type", const { Plain::new("create") }),
        _ => attr,
    }
}

fn with_module(attr: Pairs<'_>, module: Option<u16>) -> Pairs<'_> {
    match module {
        Some(m) => attr.with("module_id", m).with("owner", hal::owner(m)),
        None => attr,
    }
}

/// A row not tied to a block or call: steps and marks.
fn marker_columns<'a>(event_type: &'static str, name: String, ts_ns: u64, pid: u32, tid: u32) -> Columns<'a> {
    let (event, device, ptr) = (if event_type == "STEP" { "SYSTEM" } else { "MSTX" }, DeviceKey::Unknown, None);
    let name = Name::Text(Cow::Owned(name));
    Columns { event, event_type, name, ts_ns, pid, tid, device, ptr, broadcast: true, untracked: false, shadow: false }
}

/// The row for one model output; `None` for outputs that change earlier rows ([`Output::Retag`]).
pub fn to_row(output: &Output) -> Option<Row<'_>> {
    let mut attr = Attr::new();
    let (columns, _) = build(output, attr.pairs())?;
    Some(Row::new(columns, attr))
}

/// Writes the Attr of one model output's row onto the end of `text` and gives its other
/// columns; `None`, with nothing written, for outputs that change earlier rows
/// ([`Output::Retag`]).
pub fn write_row<'a>(output: &'a Output, text: &mut String) -> Option<Columns<'a>> {
    let (columns, attr) = build(output, Pairs::new(text))?;
    attr.close();
    Some(columns)
}

/// The columns of `output`'s row, and its Attr's pairs added to `attr`.
fn build<'a, 'o>(output: &'a Output, attr: Pairs<'o>) -> Option<(Columns<'a>, Pairs<'o>)> {
    Some(match output {
        Output::Retag { .. } => return None,
        Output::Malloc { .. } => malloc(output, attr),
        Output::Free { .. } => free(output, attr),
        Output::PoolMalloc { .. } | Output::PoolFree { .. } => pool(output, attr),
        Output::OomBlock { site, device, recent, rank, block_type, ptr, size, born_ns, allocation_id, owner } => {
            let attr = attr
                .with("pool", *block_type)
                .with("allocation_id", *allocation_id)
                .addr("ptr", *ptr)
                .with("size", *size)
                .with("timestamp", *born_ns)
                .with("rank", *rank as u64)
                .with_opt("owner", owner.as_deref());
            let event_type = if *recent { "OOM_RECENT_ALLOC" } else { "OOM_TOP_ALLOC" };
            (columns(site, "OOM_DETAIL", event_type, *device, Some(*ptr)), attr)
        }
        Output::Failed { .. } => failed(output, attr),
        Output::Vmm { site, device, step, addr, size, driver } => {
            let (event_type, key) = match step {
                VmmStep::Reserve => ("RESERVE", "addr"),
                VmmStep::Release => ("RELEASE", "addr"),
                VmmStep::MallocPhysical => ("PHYSICAL_MALLOC", "handle"),
                VmmStep::FreePhysical => ("PHYSICAL_FREE", "handle"),
            };
            let attr = attr.addr(key, *addr).with_opt("size", *size).with("api", api_name(site.api));
            let attr = with_driver(with_module(attr, driver.and_then(|d| d.module)), site, driver.as_ref());
            (columns(site, "VMM", event_type, *device, None), attr)
        }
        _ => operators(output, attr),
    })
}

/// MALLOC of a device or host block.
fn malloc<'a, 'o>(output: &'a Output, attr: Pairs<'o>) -> (Columns<'a>, Pairs<'o>) {
    let Output::Malloc { site, device, space, ptr, size, req_size, allocation_id, used, origin, owner, segment } =
        output
    else {
        unreachable!("called for a Malloc")
    };
    let mut attr = attr
        .addr("addr", *ptr)
        .with("size", *size)
        .with("req_size", *req_size)
        .with("allocation_id", *allocation_id)
        .with("api", api_name(site.api))
        .with("used", *used);
    if pinned(*space) {
        attr = attr.with("pinned", TRUE);
    }
    let tail = |attr: Pairs<'o>| {
        let attr = match origin {
            Origin::Direct { policy, module, driver } => {
                let module = driver.and_then(|d| d.module).or(*module);
                let attr = attr.with_opt("policy", *policy).with_opt("module_id", module);
                with_driver(attr, site, driver.as_ref())
            }
            Origin::Mapped { handle, offset } => attr.with("vmm", TRUE).addr("handle", *handle).with("offset", *offset),
        };
        attr.with_opt("owner", owner.as_deref()).with_opt("segment", segment.map(pool_name))
    };
    let attr = MALLOC_TAIL.with_borrow_mut(|last| last.write(attr, site.api, origin, owner, *segment, tail));
    (columns(site, "MALLOC", space.event_type(), *device, Some(*ptr)), attr)
}

/// The end of the last MALLOC row's Attr (its origin's pairs, owner and segment) and what it
/// was made from. The rows of an allocation loop repeat it (the same API, driver call, flag,
/// module and owner), and copying it whole costs a fraction of writing its seven pairs again.
#[derive(Default)]
struct MallocTail {
    made_from: Option<(Api, Origin, Option<Owner>, Option<Pool>)>,
    pairs: String,
}

thread_local! {
    static MALLOC_TAIL: RefCell<MallocTail> = RefCell::default();
}

impl MallocTail {
    /// Writes the tail with `write`, or copies the last one when it was made from the same.
    fn write<'o>(
        &mut self,
        mut attr: Pairs<'o>,
        api: Api,
        origin: &Origin,
        owner: &Option<Owner>,
        segment: Option<Pool>,
        write: impl FnOnce(Pairs<'o>) -> Pairs<'o>,
    ) -> Pairs<'o> {
        // The driver's size is no pair of the tail: rows of different sizes share it.
        let origin = match *origin {
            Origin::Direct { policy, module, driver } => {
                Origin::Direct { policy, module, driver: driver.map(|d| DriverInfo { size: 0, ..d }) }
            }
            mapped => mapped,
        };
        let (start, first) = attr.position();
        // Pairs after the first start with a comma: only such a tail can be copied.
        if first {
            return write(attr);
        }
        let same = |(a, o, w, s): &(Api, Origin, Option<Owner>, Option<Pool>)| {
            *a == api && *o == origin && w == owner && *s == segment
        };
        if self.made_from.as_ref().is_some_and(same) {
            attr.repeat(&self.pairs);
            return attr;
        }
        let attr = write(attr);
        self.pairs.clear();
        self.pairs.push_str(attr.since(start));
        self.made_from = Some((api, origin, owner.clone(), segment));
        attr
    }
}

/// FREE of a device or host block.
fn free<'a, 'o>(output: &'a Output, attr: Pairs<'o>) -> (Columns<'a>, Pairs<'o>) {
    let Output::Free { site, device, space, ptr, size, allocation_id, used, shadow, driver } = output else {
        unreachable!("called for a Free")
    };
    let mut attr = attr
        .addr("addr", *ptr)
        // A free of a block allocated before the trace has no known size: "0" makes
        // Insight skip it instead of pairing it with something else.
        .with("size", size.unwrap_or(0))
        .with_opt("allocation_id", *allocation_id)
        .with("api", api_name(site.api))
        .with("used", *used);
    if pinned(*space) {
        attr = attr.with("pinned", TRUE);
    }
    if size.is_none() {
        attr = attr.with(UNMATCHED, TRUE);
    }
    if *shadow {
        attr = attr.with("shadow", TRUE);
    }
    if site.gc {
        attr = attr.with("freed_by", const { Plain::new(GC) });
    }
    let attr = with_driver(attr, site, driver.as_ref());
    let c = columns(site, "FREE", space.event_type(), *device, Some(*ptr));
    (Columns { untracked: size.is_none(), shadow: *shadow, ..c }, attr)
}

/// MALLOC / FREE of a framework pool block.
fn pool<'a, 'o>(output: &'a Output, attr: Pairs<'o>) -> (Columns<'a>, Pairs<'o>) {
    match output {
        Output::PoolMalloc { site, device, pool, ptr, size, req_size, allocation_id, used, total, owner } => {
            let attr = attr
                .addr("addr", *ptr)
                .with("size", *size)
                .with_opt("req_size", *req_size)
                .with("allocation_id", *allocation_id)
                .with("api", api_name(site.api))
                .with("used", *used)
                .with("total", *total)
                .with("pool", pool_name(*pool))
                .with("owner", &**owner);
            (columns(site, "MALLOC", "PTA", *device, Some(*ptr)), attr)
        }
        Output::PoolFree {
            site,
            device,
            pool,
            ptr,
            size,
            allocation_id,
            used,
            total,
            shadow,
            implied,
            stream_uses,
        } => {
            let mut attr = attr
                .addr("addr", *ptr)
                .with("size", size.unwrap_or(0))
                .with_opt("allocation_id", *allocation_id)
                .with("api", api_name(site.api))
                .with("used", *used)
                .with("total", *total)
                .with("pool", pool_name(*pool));
            if size.is_none() {
                attr = attr.with(UNMATCHED, TRUE);
            }
            if *shadow {
                attr = attr.with("shadow", TRUE);
            }
            if *implied {
                attr = attr.with("implied", TRUE);
            }
            if site.gc {
                attr = attr.with("freed_by", const { Plain::new(GC) });
            }
            if *stream_uses > 0 {
                attr = attr.with(STREAM_USES, u64::from(*stream_uses));
            }
            let c = columns(site, "FREE", "PTA", *device, Some(*ptr));
            (Columns { untracked: size.is_none(), shadow: *shadow, ..c }, attr)
        }
        _ => unreachable!("called for a pool block"),
    }
}

/// A call that failed: out of memory, or any other error.
fn failed<'a, 'o>(output: &'a Output, attr: Pairs<'o>) -> (Columns<'a>, Pairs<'o>) {
    let Output::Failed { site, device, status, out_of_memory, size, ptr, driver } = output else {
        unreachable!("called for a Failed")
    };
    let space_type = if *device == DeviceKey::Cpu { "HOST" } else { "HAL" };
    if *out_of_memory && size.is_some() {
        let attr = attr
            .with("func", api_name(site.api))
            .with_opt("req_size", *size)
            .with_opt("flag", driver.and_then(|d| d.flag).map(Value::Addr))
            .with("status", *status);
        let attr = with_module(attr, driver.and_then(|d| d.module));
        (columns(site, "OOM_DETAIL", "OOM_TRIGGER", *device, None), attr)
    } else {
        let attr = attr
            .with("api", api_name(site.api))
            .with("status", *status)
            .with_opt("size", *size)
            .with_opt("addr", ptr.map(Value::Addr));
        (columns(site, "API_ERROR", space_type, *device, None), with_driver(attr, site, driver.as_ref()))
    }
}

/// Operators, kernels, accesses, steps and marks.
fn operators<'a, 'o>(output: &'a Output, attr: Pairs<'o>) -> (Columns<'a>, Pairs<'o>) {
    match output {
        Output::Access { site, device, block_type, block, allocation_id, pool, addr, size, kind } => {
            let event_type = access_type(*kind);
            let attr = attr
                .with("allocation_id", *allocation_id)
                .addr("addr", *addr)
                .with_opt("size", *size)
                .with("type", pool.map_or(Value::Str(block_type), pool_owner))
                .addr("block", *block)
                .with("api", api_name(site.api));
            (columns(site, "ACCESS", event_type, *device, Some(*addr)), attr)
        }
        Output::OpAccess {
            wall_ns,
            pid,
            tid,
            device,
            block_type,
            block,
            allocation_id,
            pool,
            addr,
            size,
            kind,
            op,
            desc,
        } => {
            let attr = attr
                .with("allocation_id", *allocation_id)
                .addr("addr", *addr)
                .with("size", *size)
                .with("type", pool.map_or(Value::Str(block_type), pool_owner))
                .addr("block", *block);
            let name = op.as_deref().filter(|n| !n.is_empty()).unwrap_or(NO_NAME);
            let columns = Columns {
                event: "ACCESS",
                event_type: access_type(*kind),
                name: Name::Text(Cow::Borrowed(name)),
                ts_ns: *wall_ns,
                pid: *pid,
                tid: *tid,
                device: *device,
                ptr: Some(*addr),
                broadcast: false,
                untracked: false,
                shadow: false,
            };
            (columns, with_tensor_desc(attr, desc.as_deref()))
        }
        Output::OpLaunch { wall_ns, pid, tid, start, name } => {
            let name = if name.is_empty() { NO_NAME } else { name.as_str() };
            let columns = Columns {
                event: "OP_LAUNCH",
                event_type: if *start { "ATEN_START" } else { "ATEN_END" },
                name: Name::Text(Cow::Borrowed(name)),
                ts_ns: *wall_ns,
                pid: *pid,
                tid: *tid,
                device: DeviceKey::Unknown,
                ptr: None,
                broadcast: true,
                untracked: false,
                shadow: false,
            };
            (columns, attr)
        }
        Output::AtbLaunch { site, device, start, runner, workspace, workspace_size, intermediate_size, status } => {
            // msMemScope's keys, plus the intermediate part of the workspace (what
            // ATB_WORKSPACE_MEM_ALLOC_ALG_TYPE lays out) and the runner that names the operation.
            let attr = attr
                .with_opt("workspace_ptr", workspace.map(Value::Addr))
                .with_opt("workspace_size", *workspace_size)
                .with_opt("intermediate_size", *intermediate_size)
                .addr("runner", *runner)
                .with_opt("status", *status);
            let event_type = if *start { "ATB_START" } else { "ATB_END" };
            (columns(site, "OP_LAUNCH", event_type, *device, None), attr)
        }
        Output::KernelLaunch { site, device, name, function, stream, args_size } => {
            let attr = attr.addr("streamId", *stream).addr("function", *function).with("args_size", *args_size);
            let mut c = columns(site, "KERNEL_LAUNCH", "KERNEL_LAUNCH", *device, None);
            c.name = Name::Text(match name {
                Some(name) => Cow::Borrowed(name.as_str()),
                None => Cow::Owned(format!("kernel@{function:#x}")),
            });
            (c, attr)
        }
        Output::Step { wall_ns, pid, tid, number } => {
            (marker_columns("STEP", number.to_string(), *wall_ns, *pid, *tid), attr)
        }
        Output::Mstx { wall_ns, pid, tid, api, kind, id, message } => {
            let (event_type, name) = match kind {
                MstxKind::Mark => ("Mark", format!("\"{message}\"")),
                MstxKind::RangeStart => ("Range_start", format!("\"{message}\"")),
                MstxKind::RangeEnd => ("Range_end", format!("Range end from id {}", id.unwrap_or(0))),
            };
            let attr = attr.with_opt("id", *id).with("source", api.map_or("memscope", |a| a.name()));
            (marker_columns(event_type, name, *wall_ns, *pid, *tid), attr)
        }
        _ => unreachable!("blocks, failures and VMM steps are built apart"),
    }
}

/// A `SYSTEM` row opening or closing one device's trace.
pub fn system_row<'m>(event_type: &'static str, ts_ns: u64, device: DeviceKey, meta: &'m Meta) -> Row<'m> {
    let get = |key: &str| meta.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str());
    let pid: u32 = get("target_pid").and_then(|p| p.parse().ok()).unwrap_or(0);
    let attr = Attr::new()
        .with("tool", "memscope-bpf")
        .with_opt("version", get("tool_version"))
        .with_opt("mode", get("mode"))
        .with_opt("stop_reason", if event_type == "STOP_TRACE" { get("stop_reason") } else { None });
    let name = Cow::Borrowed(event_type);
    let (broadcast, untracked, shadow) = (false, false, false);
    Row {
        event: "SYSTEM",
        event_type,
        name,
        ts_ns,
        pid,
        tid: pid,
        device,
        ptr: None,
        attr,
        broadcast,
        untracked,
        shadow,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apis::Api;

    /// The row of `output`, which it borrows (kept for the test's life).
    fn to_row(output: Output) -> Row<'static> {
        super::to_row(Box::leak(Box::new(output))).expect("a row")
    }

    fn site(api: Api) -> Site {
        Site { api, wall_ns: 5, pid: 1, tid: 2, gc: false }
    }

    #[test]
    fn device_malloc_is_hal_with_insight_keys() {
        let r = to_row(Output::Malloc {
            site: site(Api::AclrtMalloc),
            device: DeviceKey::Npu(1),
            space: Space::Device,
            ptr: 0xabc,
            size: 512,
            allocation_id: 3,
            used: 1024,
            origin: Origin::Direct { policy: Some(0), module: None, driver: None },
            req_size: 512,
            owner: Some("CANN@UNKNOWN@x".into()),
            segment: Some(Pool::Caching),
        });
        assert_eq!((r.event, r.event_type, r.name.as_ref()), ("MALLOC", "HAL", "aclrtMalloc"));
        assert_eq!(r.ptr_text(), "0x0000000000000abc");
        assert_eq!(r.device_id(), "1");
        for key in ["addr", "size", "allocation_id", "used"] {
            assert!(r.attr.get(key).is_some(), "missing {key}");
        }
        assert_eq!(r.attr.get("size").as_deref(), Some("512"));
        assert_eq!(r.attr.get("owner").as_deref(), Some("CANN@UNKNOWN@x"));
        assert_eq!(r.attr.get("segment").as_deref(), Some("caching"));
    }

    #[test]
    fn a_malloc_whose_tail_repeats_the_last_ones_is_written_the_same_as_on_its_own() {
        let driver = |size| DriverInfo {
            api: Api::HalMemAlloc,
            flag: Some(0x2100_0000_0000_0400),
            size,
            module: Some(33),
            page: Some(PageType::Normal),
        };
        let malloc = |ptr: u64, size: u64, owner: &str| Output::Malloc {
            site: site(Api::AclrtMalloc),
            device: DeviceKey::Npu(0),
            space: Space::Device,
            ptr,
            size,
            req_size: size - 32,
            allocation_id: ptr,
            used: size,
            origin: Origin::Direct { policy: Some(0), module: None, driver: Some(driver(size)) },
            owner: Some(owner.into()),
            segment: None,
        };
        let tail = |owner: &str| {
            format!(
                r#""policy":"0","module_id":"33","hal_api":"halMemAlloc","flag":"0x2100000000000400","page_type":"normal","alloc_type":"alloc","owner":"{owner}"}}"#
            )
        };
        let mut batch = crate::store::Batch::default();
        for (ptr, size, owner) in
            [(1, 4128, "CANN@APP"), (2, 4160, "CANN@APP"), (3, 4160, "CANN@APP@x\"y"), (4, 64, "CANN@APP")]
        {
            batch.clear();
            assert!(batch.push_output(&malloc(ptr, size, owner)));
            let json = batch.get(0).attr.to_owned();
            let head = format!(
                r#"{{"addr":"0x{ptr:016x}","size":"{size}","req_size":"{}","allocation_id":"{ptr}","api":"aclrtMalloc","used":"{size}","#,
                size - 32
            );
            let escaped = owner.replace('"', "\\\"");
            assert_eq!(json, head + &tail(&escaped), "row {ptr}");
            let v: serde_json::Value = serde_json::from_str(&json).unwrap();
            assert_eq!(v["owner"], owner);
        }
    }

    #[test]
    fn pool_blocks_are_pta_with_counters_and_owner() {
        for (pool, owner) in [(Pool::Caching, "PTA"), (Pool::Workspace, "PTA_WORKSPACE")] {
            let r = to_row(Output::PoolMalloc {
                site: site(Api::DeviceCachingAllocatorMalloc),
                device: DeviceKey::Npu(0),
                pool,
                ptr: 0x200,
                size: 1024,
                req_size: Some(1000),
                allocation_id: 1,
                used: 1024,
                total: 2 << 20,
                owner: crate::model::tracker::OwnerBase::Pool(pool).label(),
            });
            assert_eq!((r.event, r.event_type), ("MALLOC", "PTA"));
            assert_eq!(r.attr.get("owner").as_deref(), Some(owner));
            assert_eq!(r.attr.get("pool").as_deref(), Some(pool.as_str()));
            assert_eq!(r.attr.get("used").as_deref(), Some("1024"));
            assert_eq!(r.attr.get("total").as_deref(), Some("2097152"));
            assert_eq!(r.attr.get("req_size").as_deref(), Some("1000"));
        }
    }

    #[test]
    fn free_carries_size_and_shadow_mark() {
        let r = to_row(Output::Free {
            site: site(Api::AclrtFree),
            device: DeviceKey::Npu(0),
            space: Space::Device,
            ptr: 0x1,
            size: Some(64),
            allocation_id: Some(1),
            used: 0,
            shadow: true,
            driver: None,
        });
        assert_eq!((r.event, r.event_type), ("FREE", "HAL"));
        assert_eq!(r.attr.get("size").as_deref(), Some("64"));
        assert_eq!(r.attr.get("shadow").as_deref(), Some("true"));
        assert!(r.shadow && !r.untracked);
    }

    #[test]
    fn pinned_host_blocks_are_host_pinned_and_cpu_tensors_host() {
        let host = |api, space| Output::Malloc {
            site: site(api),
            device: DeviceKey::Cpu,
            space,
            ptr: 0x1,
            size: 1,
            allocation_id: 1,
            used: 1,
            origin: Origin::Direct { policy: None, module: None, driver: None },
            req_size: 1,
            owner: Some("HOST".into()),
            segment: None,
        };
        let pinned = to_row(host(Api::AclrtMallocHost, Space::Host));
        assert_eq!((pinned.event_type, pinned.device_id().as_str()), ("HOST_PINNED", "cpu"), "msMemScope's name");
        assert_eq!(pinned.attr.get("pinned").as_deref(), Some("true"));
        let tensor = to_row(host(Api::C10AllocCpu, Space::Cpu));
        assert_eq!((tensor.event_type, tensor.attr.get("pinned")), ("HOST", None), "a CPU tensor is not pinned");
    }

    #[test]
    fn a_free_of_a_block_never_seen_is_kept_out_of_insights_table() {
        let free = |size| Output::Free {
            site: site(Api::AclrtFree),
            device: DeviceKey::Npu(0),
            space: Space::Device,
            ptr: 0x1,
            size,
            allocation_id: size.map(|_| 1),
            used: 0,
            shadow: false,
            driver: None,
        };
        assert!(is_untracked_free(&to_row(free(None))));
        assert!(!is_untracked_free(&to_row(free(Some(8)))));
    }

    #[test]
    fn steps_and_marks_are_broadcast_rows_in_msmemscope_names() {
        let step = to_row(Output::Step { wall_ns: 9, pid: 1, tid: 2, number: 3 });
        assert_eq!((step.event, step.event_type, step.name.as_ref(), step.broadcast), ("SYSTEM", "STEP", "3", true));
        let kind = MstxKind::RangeStart;
        let start =
            to_row(Output::Mstx { wall_ns: 9, pid: 1, tid: 2, api: None, kind, id: Some(4), message: "fwd".into() });
        assert_eq!((start.event, start.event_type, start.name.as_ref()), ("MSTX", "Range_start", "\"fwd\""));
        let kind = MstxKind::RangeEnd;
        let end =
            to_row(Output::Mstx { wall_ns: 9, pid: 1, tid: 2, api: None, kind, id: Some(4), message: String::new() });
        assert_eq!(end.name.as_ref(), "Range end from id 4");
        assert!(super::to_row(&Output::Retag {
            device: DeviceKey::Npu(0),
            pid: 1,
            event_type: "PTA",
            ptr: 1,
            owner: "PTA@x".into()
        })
        .is_none());
    }

    #[test]
    fn operators_are_broadcast_op_launch_rows_and_their_tensors_accesses() {
        let start =
            to_row(Output::OpLaunch { wall_ns: 9, pid: 1, tid: 2, start: true, name: "aten.mm.default".into() });
        assert_eq!(
            (start.event, start.event_type, start.name.as_ref(), start.broadcast, start.ptr_text().as_str()),
            ("OP_LAUNCH", "ATEN_START", "aten.mm.default", true, "N/A")
        );
        let end = to_row(Output::OpLaunch { wall_ns: 9, pid: 1, tid: 2, start: false, name: String::new() });
        assert_eq!((end.event_type, end.name.as_ref()), ("ATEN_END", "N/A"));

        let access = |kind, pool, op: Option<&str>, desc: Option<&str>| {
            to_row(Output::OpAccess {
                wall_ns: 9,
                pid: 1,
                tid: 2,
                device: DeviceKey::Npu(0),
                block_type: "PTA",
                block: 0x1000,
                allocation_id: 4,
                pool,
                addr: 0x1010,
                size: 128,
                kind,
                op: op.map(str::to_owned),
                desc: desc.map(str::to_owned),
            })
        };
        let r = access(AccessKind::Read, Some(Pool::Caching), Some("aten.mm.default"), Some("float32[4,8]"));
        assert_eq!((r.event, r.event_type, r.name.as_ref(), r.broadcast), ("ACCESS", "READ", "aten.mm.default", false));
        assert_eq!((r.ptr_text().as_str(), r.device_id().as_str()), ("0x0000000000001010", "0"));
        assert_eq!(
            r.attr.to_json(),
            r#"{"allocation_id":"4","addr":"0x0000000000001010","size":"128","type":"PTA","block":"0x0000000000001000","dtype":"float32","shape":"[4,8]"}"#
        );
        let w = access(AccessKind::Write, None, None, Some("opaque"));
        assert_eq!((w.event_type, w.name.as_ref()), ("WRITE", "N/A"));
        assert_eq!((w.attr.get("type").as_deref(), w.attr.get("tensor").as_deref()), (Some("PTA"), Some("opaque")));
        assert_eq!(w.attr.get("dtype"), None);
    }

    #[test]
    fn atb_operations_are_op_launch_rows_on_their_device_with_the_workspace() {
        let launch = |start: bool, status| {
            to_row(Output::AtbLaunch {
                site: Site { wall_ns: if start { 4 } else { 5 }, ..site(Api::AtbRunnerExecute) },
                device: DeviceKey::Npu(1),
                start,
                runner: 0x55,
                workspace: Some(0x9000),
                workspace_size: Some(1 << 20),
                intermediate_size: Some(3 << 20),
                status,
            })
        };
        let start = launch(true, None);
        assert_eq!(
            (start.event, start.event_type, start.name.as_ref(), start.ts_ns, start.broadcast),
            ("OP_LAUNCH", "ATB_START", "atb::Runner::Execute", 4, false)
        );
        assert_eq!((start.device_id().as_str(), start.ptr_text().as_str()), ("1", "N/A"));
        assert_eq!(
            start.attr.to_json(),
            r#"{"workspace_ptr":"0x0000000000009000","workspace_size":"1048576","intermediate_size":"3145728","runner":"0x0000000000000055"}"#
        );
        let end = launch(false, Some(0));
        assert_eq!((end.event_type, end.ts_ns, end.attr.get("status").as_deref()), ("ATB_END", 5, Some("0")));
        assert_eq!(end.attr.get("workspace_size").as_deref(), Some("1048576"));
    }

    #[test]
    fn out_of_memory_is_an_oom_trigger_and_other_errors_are_api_errors() {
        let oom = to_row(Output::Failed {
            site: site(Api::AclrtMalloc),
            device: DeviceKey::Npu(0),
            status: 207_001,
            out_of_memory: true,
            size: Some(10),
            ptr: None,
            driver: None,
        });
        assert_eq!((oom.event, oom.event_type), ("OOM_DETAIL", "OOM_TRIGGER"));
        assert_eq!(oom.attr.get("req_size").as_deref(), Some("10"));
        assert_eq!(oom.ptr_text(), "N/A");
        let err = to_row(Output::Failed {
            site: site(Api::AclrtFree),
            device: DeviceKey::Npu(0),
            status: 100_000,
            out_of_memory: false,
            size: None,
            ptr: Some(0x5),
            driver: None,
        });
        assert_eq!((err.event, err.event_type), ("API_ERROR", "HAL"));
    }
}
