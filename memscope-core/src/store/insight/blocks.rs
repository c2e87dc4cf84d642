//! The rows of blocks (device, host and pool MALLOC / FREE), of failed calls and of the blocks
//! an OOM lists.

use std::cell::RefCell;

use super::{api_name, Columns, Pairs, Plain, Value, TRUE};
use crate::apis::{hal, Api};
use crate::model::output::{block_weight, Owner};
use crate::model::{BlockFrom, DeviceKey, DriverInfo, Origin, Output, PageType, Pool, Site, Space};
use crate::vocab::{attr, Event, EventType, GC, STREAM_USES, UNMATCHED};

fn page_type(page: PageType) -> Plain {
    match page {
        PageType::Normal => const { Plain::new(PageType::Normal.as_str()) },
        PageType::Huge => const { Plain::new(PageType::Huge.as_str()) },
        PageType::Giant => const { Plain::new(PageType::Giant.as_str()) },
    }
}

pub(super) fn pool_name(pool: Pool) -> Plain {
    match pool {
        Pool::Caching => const { Plain::new(Pool::Caching.as_str()) },
        Pool::Workspace => const { Plain::new(Pool::Workspace.as_str()) },
    }
}

/// Pinned host memory is marked as msMemScope does; CPU-allocator memory is not pinned.
fn pinned(space: Space) -> bool {
    matches!(space, Space::Host | Space::Registered)
}

/// Attr keys for the driver call behind a fact: the driver API when it differs from the row's
/// (a merged runtime + driver call), its flag, module and page class.
pub(super) fn with_driver<'o>(mut attr: Pairs<'o>, site: &Site, driver: Option<&DriverInfo>) -> Pairs<'o> {
    let Some(d) = driver else { return attr };
    if d.api != site.api {
        attr = attr.with(attr::hal_api, api_name(d.api));
    }
    attr = attr.with_opt(attr::flag, d.flag.map(Value::Addr)).with_opt(attr::page_type, d.page.map(page_type));
    match d.api {
        Api::HalMemAlloc => attr.with(attr::alloc_type, const { Plain::new("alloc") }),
        Api::HalMemCreate => attr.with(attr::alloc_type, const { Plain::new("create") }),
        _ => attr,
    }
}

pub(super) fn with_module(attr: Pairs<'_>, module: Option<u16>) -> Pairs<'_> {
    match module {
        Some(m) => attr.with(attr::module_id, m).with(attr::owner, hal::owner(m)),
        None => attr,
    }
}

/// The flags a FREE may carry, in the order they are written.
#[derive(Clone, Copy)]
struct FreeFlags {
    unmatched: bool,
    shadow: bool,
    implied: bool,
    gc: bool,
}

fn with_free_flags(mut attr: Pairs<'_>, flags: FreeFlags) -> Pairs<'_> {
    if flags.unmatched {
        attr = attr.with(UNMATCHED, TRUE);
    }
    if flags.shadow {
        attr = attr.with(attr::shadow, TRUE);
    }
    if flags.implied {
        attr = attr.with(attr::implied, TRUE);
    }
    if flags.gc {
        attr = attr.with(attr::freed_by, const { Plain::new(GC) });
    }
    attr
}

/// Where a new block's owner came from (absent: the allocator's label alone), its site and its
/// Python stack.
fn with_from<'o>(attr: Pairs<'o>, from: &BlockFrom, site: &Site) -> Pairs<'o> {
    let lent = from.main_thread.then_some("main_thread");
    let py_stack = (site.py_stack != crate::stacks::NO_STACK).then_some(u64::from(site.py_stack));
    attr.with_opt(attr::owner_source, from.owner_by.as_str())
        .with_opt(attr::site, from.site.as_deref())
        .with_opt(attr::py_stack_of, lent)
        .with_opt(attr::py_stack, py_stack)
}

/// MALLOC of a device or host block.
pub(super) fn malloc<'a, 'o>(output: &'a Output, attr: Pairs<'o>) -> (Columns<'a>, Pairs<'o>) {
    let Output::Malloc { site, device, space, ptr, size, req_size, allocation_id, used, origin, owner, segment, from } =
        output
    else {
        unreachable!("called for a Malloc")
    };
    let mut attr = attr
        .addr(attr::addr, *ptr)
        .with(attr::size, *size)
        .with(attr::req_size, *req_size)
        .with(attr::allocation_id, *allocation_id)
        .with(attr::api, api_name(site.api))
        .with(attr::used, *used);
    if pinned(*space) {
        attr = attr.with(attr::pinned, TRUE);
    }
    let tail = |attr: Pairs<'o>| {
        let attr = match origin {
            Origin::Direct { policy, module, driver } => {
                let module = driver.and_then(|d| d.module).or(*module);
                let attr = attr.with_opt(attr::policy, *policy).with_opt(attr::module_id, module);
                with_driver(attr, site, driver.as_ref())
            }
            Origin::Mapped { handle, offset } => {
                attr.with(attr::vmm, TRUE).addr(attr::handle, *handle).with(attr::offset, *offset)
            }
        };
        attr.with_opt(attr::owner, owner.as_deref()).with_opt(attr::segment, segment.map(pool_name))
    };
    let attr = MALLOC_TAIL.with_borrow_mut(|last| last.write(attr, site.api, origin, owner, *segment, tail));
    let attr = with_from(attr, from, site).with_opt(attr::weight, block_weight(site, *size, Some(*req_size)));
    (Columns::at(site, Event::Malloc, space.event_type(), *device, Some(*ptr)), attr)
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
pub(super) fn free<'a, 'o>(output: &'a Output, attr: Pairs<'o>) -> (Columns<'a>, Pairs<'o>) {
    let Output::Free { site, device, space, ptr, size, allocation_id, used, shadow, implied, driver } = output else {
        unreachable!("called for a Free")
    };
    let mut attr = attr
        .addr(attr::addr, *ptr)
        // A free of a block allocated before the trace has no known size: "0" makes
        // Insight skip it instead of pairing it with something else.
        .with(attr::size, size.unwrap_or(0))
        .with_opt(attr::allocation_id, *allocation_id)
        .with(attr::api, api_name(site.api))
        .with(attr::used, *used);
    if pinned(*space) {
        attr = attr.with(attr::pinned, TRUE);
    }
    let flags = FreeFlags { unmatched: size.is_none(), shadow: *shadow, implied: *implied, gc: site.gc };
    let attr = with_driver(with_free_flags(attr, flags), site, driver.as_ref());
    let mut c = Columns::at(site, Event::Free, space.event_type(), *device, Some(*ptr));
    (c.head.untracked, c.head.shadow) = (size.is_none(), *shadow);
    (c, attr)
}

/// MALLOC of a framework pool block.
pub(super) fn pool_malloc<'a, 'o>(output: &'a Output, attr: Pairs<'o>) -> (Columns<'a>, Pairs<'o>) {
    let Output::PoolMalloc { site, device, pool, ptr, size, req_size, stream, allocation_id, used, total, owner, from } =
        output
    else {
        unreachable!("called for a PoolMalloc")
    };
    let attr = attr
        .addr(attr::addr, *ptr)
        .with(attr::size, *size)
        .with_opt(attr::req_size, *req_size)
        .with(attr::allocation_id, *allocation_id)
        .with(attr::api, api_name(site.api))
        .with(attr::used, *used)
        .with(attr::total, *total)
        .with(attr::pool, pool_name(*pool))
        .with(attr::owner, &**owner);
    let attr = match stream {
        Some(stream) => attr.addr(attr::stream, *stream),
        None => attr,
    };
    let attr = with_from(attr, from, site).with_opt(attr::weight, block_weight(site, *size, *req_size));
    (Columns::at(site, Event::Malloc, EventType::Pta, *device, Some(*ptr)), attr)
}

/// FREE of a framework pool block.
pub(super) fn pool_free<'a, 'o>(output: &'a Output, attr: Pairs<'o>) -> (Columns<'a>, Pairs<'o>) {
    let Output::PoolFree { site, device, pool, ptr, size, allocation_id, used, total, shadow, implied, stream_uses } =
        output
    else {
        unreachable!("called for a PoolFree")
    };
    let attr = attr
        .addr(attr::addr, *ptr)
        .with(attr::size, size.unwrap_or(0))
        .with_opt(attr::allocation_id, *allocation_id)
        .with(attr::api, api_name(site.api))
        .with(attr::used, *used)
        .with(attr::total, *total)
        .with(attr::pool, pool_name(*pool));
    let flags = FreeFlags { unmatched: size.is_none(), shadow: *shadow, implied: *implied, gc: site.gc };
    let mut attr = with_free_flags(attr, flags);
    if *stream_uses > 0 {
        attr = attr.with(STREAM_USES, u64::from(*stream_uses));
    }
    let mut c = Columns::at(site, Event::Free, EventType::Pta, *device, Some(*ptr));
    (c.head.untracked, c.head.shadow) = (size.is_none(), *shadow);
    (c, attr)
}

/// One of the blocks live at an out-of-memory failure.
pub(super) fn oom_block<'a, 'o>(output: &'a Output, attr: Pairs<'o>) -> (Columns<'a>, Pairs<'o>) {
    let Output::OomBlock { site, device, recent, rank, block_type, ptr, size, born_ns, allocation_id, owner } = output
    else {
        unreachable!("called for an OomBlock")
    };
    let attr = attr
        .with(attr::pool, block_type.as_str())
        .with(attr::allocation_id, *allocation_id)
        .addr(attr::ptr, *ptr)
        .with(attr::size, *size)
        .with(attr::timestamp, *born_ns)
        .with(attr::rank, *rank as u64)
        .with_opt(attr::owner, owner.as_deref());
    let event_type = if *recent { EventType::OomRecentAlloc } else { EventType::OomTopAlloc };
    (Columns::at(site, Event::OomDetail, event_type, *device, Some(*ptr)), attr)
}

/// A call that failed: out of memory, or any other error.
pub(super) fn failed<'a, 'o>(output: &'a Output, attr: Pairs<'o>) -> (Columns<'a>, Pairs<'o>) {
    let Output::Failed { site, device, status, out_of_memory, size, ptr, driver, segment } = output else {
        unreachable!("called for a Failed")
    };
    let space_type = if *device == DeviceKey::Cpu { EventType::Host } else { EventType::Hal };
    if *out_of_memory && size.is_some() {
        let attr = attr
            .with(attr::func, api_name(site.api))
            .with_opt(attr::req_size, *size)
            .with_opt(attr::flag, driver.and_then(|d| d.flag).map(Value::Addr))
            .with(attr::status, *status);
        let attr = with_module(attr, driver.and_then(|d| d.module)).with_opt(attr::segment, segment.map(pool_name));
        (Columns::at(site, Event::OomDetail, EventType::OomTrigger, *device, None), attr)
    } else {
        let attr = attr
            .with(attr::api, api_name(site.api))
            .with(attr::status, *status)
            .with_opt(attr::size, *size)
            .with_opt(attr::addr, ptr.map(Value::Addr));
        (Columns::at(site, Event::ApiError, space_type, *device, None), with_driver(attr, site, driver.as_ref()))
    }
}
