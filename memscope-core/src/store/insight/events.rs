//! The rows of VMM steps, block uses, operators, kernels, steps and marks, and the `SYSTEM` rows
//! that open and close a file.

use std::borrow::Cow;

use super::blocks::{with_driver, with_module};
use super::{api_name, Attr, Columns, Head, Pairs, Plain, Row, Value, TRUE};
use crate::model::{AccessKind, DeviceKey, MstxKind, Output, Pool, VmmStep};
use crate::store::Meta;
use crate::vocab::{attr, Event, EventType, UNMATCHED};

/// The `Name` of an operator's rows when the marker's text could not be read.
const NO_NAME: &str = "N/A";

fn pool_owner(pool: Pool) -> Value<'static> {
    Value::Plain(match pool {
        Pool::Caching => const { Plain::new(Pool::Caching.owner()) },
        Pool::Workspace => const { Plain::new(Pool::Workspace.owner()) },
    })
}

fn access_type(kind: AccessKind) -> EventType {
    match kind {
        AccessKind::Read => EventType::Read,
        AccessKind::Write => EventType::Write,
        AccessKind::Unknown => EventType::Unknown,
    }
}

/// msMemScope's aten ACCESS keys from the markers' tensor description: `float32[4,8]` is dtype
/// `float32` and shape `[4,8]`; a description of another form is kept whole as `tensor`.
fn with_tensor_desc<'o>(attr: Pairs<'o>, desc: Option<&str>) -> Pairs<'o> {
    let Some(desc) = desc else { return attr };
    match desc.find('[') {
        Some(i) if i > 0 => attr.with(attr::dtype, &desc[..i]).with(attr::shape, &desc[i..]),
        _ => attr.with(attr::tensor, desc),
    }
}

/// An address reservation or release, or physical memory made or released.
pub(super) fn vmm<'a, 'o>(output: &'a Output, attr: Pairs<'o>) -> (Columns<'a>, Pairs<'o>) {
    let Output::Vmm { site, device, step, addr, size, driver, unmatched } = output else {
        unreachable!("called for a Vmm")
    };
    let (event_type, key) = match step {
        VmmStep::Reserve => (EventType::Reserve, attr::addr),
        VmmStep::Release => (EventType::Release, attr::addr),
        VmmStep::MallocPhysical => (EventType::PhysicalMalloc, attr::handle),
        VmmStep::FreePhysical => (EventType::PhysicalFree, attr::handle),
    };
    let attr = attr.addr(key, *addr).with_opt(attr::size, *size).with(attr::api, api_name(site.api));
    let attr = with_driver(with_module(attr, driver.and_then(|d| d.module)), site, driver.as_ref());
    let attr = if *unmatched { attr.with(UNMATCHED, TRUE) } else { attr };
    (Columns::at(site, Event::Vmm, event_type, *device, None), attr)
}

/// A use of a live block by a traced call.
pub(super) fn access<'a, 'o>(output: &'a Output, attr: Pairs<'o>) -> (Columns<'a>, Pairs<'o>) {
    let Output::Access { site, device, block_type, block, allocation_id, pool, addr, size, kind } = output else {
        unreachable!("called for an Access")
    };
    let attr = attr
        .with(attr::allocation_id, *allocation_id)
        .addr(attr::addr, *addr)
        .with_opt(attr::size, *size)
        .with(attr::r#type, pool.map_or(Value::Str(block_type.as_str()), pool_owner))
        .addr(attr::block, *block)
        .with(attr::api, api_name(site.api));
    (Columns::at(site, Event::Access, access_type(*kind), *device, Some(*addr)), attr)
}

/// An operator's tensor read or written, named by the operator.
pub(super) fn op_access<'a, 'o>(output: &'a Output, attr: Pairs<'o>) -> (Columns<'a>, Pairs<'o>) {
    let Output::OpAccess {
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
    } = output
    else {
        unreachable!("called for an OpAccess")
    };
    let attr = attr
        .with(attr::allocation_id, *allocation_id)
        .addr(attr::addr, *addr)
        .with(attr::size, *size)
        .with(attr::r#type, pool.map_or(Value::Str(block_type.as_str()), pool_owner))
        .addr(attr::block, *block);
    let name = op.as_deref().filter(|n| !n.is_empty()).unwrap_or(NO_NAME);
    let head = Head {
        event: Event::Access,
        event_type: access_type(*kind),
        ts_ns: *wall_ns,
        pid: *pid,
        tid: *tid,
        device: *device,
        ptr: Some(*addr),
        broadcast: false,
        untracked: false,
        shadow: false,
    };
    (Columns::named(head, Cow::Borrowed(name)), with_tensor_desc(attr, desc.as_deref()))
}

/// An operator's start or end (every device's output gets it).
pub(super) fn op_launch<'a, 'o>(output: &'a Output, attr: Pairs<'o>) -> (Columns<'a>, Pairs<'o>) {
    let Output::OpLaunch { wall_ns, pid, tid, start, name } = output else { unreachable!("called for an OpLaunch") };
    let name = if name.is_empty() { NO_NAME } else { name.as_str() };
    let event_type = if *start { EventType::AtenStart } else { EventType::AtenEnd };
    let head = Head::broadcast(Event::OpLaunch, event_type, *wall_ns, *pid, *tid);
    (Columns::named(head, Cow::Borrowed(name)), attr)
}

/// An ATB operation's start or end, on the device of its workspace.
pub(super) fn atb_launch<'a, 'o>(output: &'a Output, attr: Pairs<'o>) -> (Columns<'a>, Pairs<'o>) {
    let Output::AtbLaunch { site, device, start, runner, workspace, workspace_size, intermediate_size, status } =
        output
    else {
        unreachable!("called for an AtbLaunch")
    };
    // msMemScope's keys, plus the intermediate part of the workspace (what
    // ATB_WORKSPACE_MEM_ALLOC_ALG_TYPE lays out) and the runner that names the operation.
    let attr = attr
        .with_opt(attr::workspace_ptr, workspace.map(Value::Addr))
        .with_opt(attr::workspace_size, *workspace_size)
        .with_opt(attr::intermediate_size, *intermediate_size)
        .addr(attr::runner, *runner)
        .with_opt(attr::status, *status);
    let event_type = if *start { EventType::AtbStart } else { EventType::AtbEnd };
    (Columns::at(site, Event::OpLaunch, event_type, *device, None), attr)
}

/// A kernel launch, named by the kernel when its name is known.
pub(super) fn kernel_launch<'a, 'o>(output: &'a Output, attr: Pairs<'o>) -> (Columns<'a>, Pairs<'o>) {
    let Output::KernelLaunch { site, device, name, function, stream, args_size } = output else {
        unreachable!("called for a KernelLaunch")
    };
    let attr = attr.addr(attr::streamId, *stream).addr(attr::function, *function).with(attr::args_size, *args_size);
    let mut c = Columns::at(site, Event::KernelLaunch, EventType::KernelLaunch, *device, None);
    c.name = super::Name::Text(match name {
        Some(name) => Cow::Borrowed(name.as_str()),
        None => Cow::Owned(format!("kernel@{function:#x}")),
    });
    (c, attr)
}

/// A step boundary (every device's output gets it), named by its number.
pub(super) fn step<'a, 'o>(output: &'a Output, attr: Pairs<'o>) -> (Columns<'a>, Pairs<'o>) {
    let Output::Step { wall_ns, pid, tid, number, inferred } = output else { unreachable!("called for a Step") };
    let attr = attr.with_opt(attr::source, inferred.then_some("inferred"));
    let head = Head::broadcast(Event::System, EventType::Step, *wall_ns, *pid, *tid);
    (Columns::named(head, Cow::Owned(number.to_string())), attr)
}

/// An mstx (or markers') mark or range end (every device's output gets it).
pub(super) fn mstx<'a, 'o>(output: &'a Output, attr: Pairs<'o>) -> (Columns<'a>, Pairs<'o>) {
    let Output::Mstx { wall_ns, pid, tid, api, kind, id, message } = output else { unreachable!("called for a Mstx") };
    let (event_type, name) = match kind {
        MstxKind::Mark => (EventType::Mark, format!("\"{message}\"")),
        MstxKind::RangeStart => (EventType::RangeStart, format!("\"{message}\"")),
        MstxKind::RangeEnd => (EventType::RangeEnd, format!("Range end from id {}", id.unwrap_or(0))),
    };
    let attr = attr.with_opt(attr::id, *id).with(attr::source, api.map_or("memscope", |a| a.name()));
    let head = Head::broadcast(Event::Mstx, event_type, *wall_ns, *pid, *tid);
    (Columns::named(head, Cow::Owned(name)), attr)
}

/// A `SYSTEM` row opening ([`EventType::StartTrace`]) or closing ([`EventType::StopTrace`]) one
/// device's trace; `memory` is the device's (free, total) bytes when the driver said.
pub fn system_row(
    event_type: EventType,
    ts_ns: u64,
    device: DeviceKey,
    meta: &Meta,
    memory: Option<(u64, u64)>,
) -> Row<'static> {
    let get = |key: &str| meta.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str());
    let pid: u32 = get("target_pid").and_then(|p| p.parse().ok()).unwrap_or(0);
    let attr = Attr::new()
        .with(attr::tool, "memscope-bpf")
        .with_opt(attr::version, get("tool_version"))
        .with_opt(attr::mode, get("mode"))
        .with_opt(attr::stop_reason, if event_type == EventType::StopTrace { get("stop_reason") } else { None })
        .with_opt(attr::free, memory.map(|(free, _)| free))
        .with_opt(attr::total, memory.map(|(_, total)| total));
    let head = Head {
        event: Event::System,
        event_type,
        ts_ns,
        pid,
        tid: pid,
        device,
        ptr: None,
        broadcast: false,
        untracked: false,
        shadow: false,
    };
    Row { head, name: Cow::Borrowed(event_type.as_str()), attr }
}
