//! Events for the model's unit tests: one thread (pid 100) calling the runtime, the driver and
//! the framework allocators, and a run of them through a fresh tracker.

use super::event::{Call, DriverInfo, Event, EventKind, Op, Pool, Space};
use super::output::Output;
use super::tracker::Tracker;
use super::DeviceKey;
use crate::apis::Api;

thread_local! {
    /// Calls made so far on this test's thread: each call starts and ends after the one made
    /// before it, as one thread's calls do.
    static CALLS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

pub fn call(api: Api, tid: u32, device: Option<u32>, status: i32, op: Op) -> Event {
    let n = CALLS.with(|c| c.replace(c.get() + 1));
    let wall_ns = 1_000 + 10 * n + u64::from(tid % 5);
    Event {
        wall_ns,
        pid: 100,
        tid,
        kind: EventKind::Call(Call {
            api,
            entry_wall_ns: wall_ns - 5,
            status,
            out_of_memory: status == 207_001,
            outer: None,
            thread_device: device,
            op,
            stack: crate::stacks::NO_STACK,
            py_stack: crate::stacks::NO_STACK,
            sample_weight: None,
            window_only: false,
            caller: None,
        }),
    }
}

/// A block of torch_npu's caching pool on device 0 handed out at `ptr`.
pub fn pool_malloc_op(ptr: u64, size: u64) -> Op {
    Op::PoolMalloc {
        pool: Pool::Caching,
        ptr: Some(ptr),
        size: Some(size),
        req: None,
        device: Some(0),
        handle: None,
        stream: None,
    }
}

pub fn malloc(ptr: Option<u64>, size: u64, device: Option<u32>, status: i32) -> Event {
    call(
        Api::AclrtMalloc,
        1,
        device,
        status,
        Op::Malloc { space: Space::Device, size, ptr, policy: Some(0), device: None, module: None, driver: None },
    )
}

pub fn free(ptr: u64, device: Option<u32>) -> Event {
    call(Api::AclrtFree, 1, device, 0, Op::Free { space: Space::Device, ptr, driver: None })
}

pub fn run(events: &[Event]) -> (Tracker, Vec<Output>) {
    let mut t = Tracker::new();
    let mut out = Vec::new();
    for e in events {
        t.apply(e.clone(), &mut out);
    }
    (t, out)
}

pub fn with_outer(mut e: Event, outer: Api) -> Event {
    if let EventKind::Call(c) = &mut e.kind {
        c.outer = Some(outer);
    }
    e
}

pub fn driver_alloc(ptr: u64, size: u64, device: u32, module: u16) -> Event {
    let flag = u64::from(device) | (u64::from(module) << 56);
    let driver = DriverInfo { api: Api::HalMemAlloc, flag: Some(flag), size, module: Some(module), page: None };
    let op = Op::Malloc {
        space: Space::Device,
        size,
        ptr: Some(ptr),
        policy: None,
        device: Some(device),
        module: Some(module),
        driver: Some(driver),
    };
    call(Api::HalMemAlloc, 1, None, 0, op)
}

pub fn pool_malloc(ptr: u64, size: u64, device: u32) -> Event {
    let op = Op::PoolMalloc {
        pool: Pool::Caching,
        ptr: Some(ptr),
        size: Some(size),
        req: Some(size),
        device: Some(device),
        handle: None,
        stream: None,
    };
    call(Api::DeviceCachingAllocatorMalloc, 1, None, 0, op)
}

pub fn workspace_malloc(ptr: u64, size: u64, device: u32) -> Event {
    let op = Op::PoolMalloc {
        pool: Pool::Workspace,
        ptr: Some(ptr),
        size: Some(size),
        req: Some(size),
        device: Some(device),
        handle: None,
        stream: None,
    };
    call(Api::WorkspaceMalloc, 1, None, 0, op)
}

pub fn host_malloc(api: Api, space: Space, ptr: u64) -> Event {
    let op = Op::Malloc { space, size: 64, ptr: Some(ptr), policy: None, device: None, module: None, driver: None };
    call(api, 1, Some(0), 0, op)
}

/// Every MALLOC-like output as (file, allocation_id, what).
pub fn ids(out: &[Output]) -> Vec<(DeviceKey, u64, &'static str)> {
    out.iter()
        .filter_map(|o| match o {
            Output::Malloc { device, allocation_id, space, .. } => {
                Some((*device, *allocation_id, space.event_type().as_str()))
            }
            Output::PoolMalloc { device, allocation_id, pool, .. } => Some((*device, *allocation_id, pool.owner())),
            _ => None,
        })
        .collect()
}
