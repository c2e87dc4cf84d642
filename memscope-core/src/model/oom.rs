//! What was alive when an allocation failed for lack of memory: the K most recent and the K
//! largest live blocks of the device, listed right after the trigger (msMemScope's
//! OOM_RECENT_ALLOC and OOM_TOP_ALLOC). A framework pool giving up lists its own blocks (which
//! tensors hold the memory); a runtime or driver failure lists the device's runtime blocks
//! (which include the pool's segments).

use super::event::DeviceKey;
use super::output::{Output, Site};
use super::owners::OwnerBase;
use super::tags;
use super::tracker::Tracker;
use crate::vocab::EventType;

/// msMemScope's default K (`--analysis oom:K`).
pub const OOM_TOP_K: usize = 10;

struct Listed {
    block_type: EventType,
    ptr: u64,
    size: u64,
    born_ns: u64,
    allocation_id: u64,
    owner: String,
}

impl Tracker {
    pub(super) fn oom_snapshot(&self, site: Site, device: DeviceKey, pool: bool, out: &mut Vec<Output>) {
        let mut live: Vec<Listed> = if pool {
            self.pools
                .table()
                .iter()
                .filter(|((pid, _), b)| *pid == site.pid && b.device == device && !b.hidden)
                .map(|((_, ptr), b)| Listed {
                    block_type: EventType::Pta,
                    ptr: *ptr,
                    size: b.size,
                    born_ns: b.born_ns,
                    allocation_id: b.allocation_id,
                    owner: OwnerBase::Pool(b.pool).owner(tags::of(&b.labels)),
                })
                .collect()
        } else {
            self.blocks
                .table()
                .iter()
                .filter(|((pid, _, _), b)| *pid == site.pid && b.device == device && !b.hidden)
                .map(|((_, space, ptr), b)| Listed {
                    block_type: space.event_type(),
                    ptr: *ptr,
                    size: b.size,
                    born_ns: b.born_ns,
                    allocation_id: b.allocation_id,
                    owner: b.base.owner(tags::of(&b.labels)),
                })
                .collect()
        };
        live.sort_by(|a, b| b.born_ns.cmp(&a.born_ns).then(b.allocation_id.cmp(&a.allocation_id)));
        for (rank, b) in live.iter().take(OOM_TOP_K).enumerate() {
            out.push(listed(site, device, true, rank + 1, b));
        }
        live.sort_by(|a, b| b.size.cmp(&a.size).then(b.born_ns.cmp(&a.born_ns)));
        for (rank, b) in live.iter().take(OOM_TOP_K).enumerate() {
            out.push(listed(site, device, false, rank + 1, b));
        }
    }
}

fn listed(site: Site, device: DeviceKey, recent: bool, rank: usize, b: &Listed) -> Output {
    Output::OomBlock {
        site,
        device,
        recent,
        rank,
        block_type: b.block_type,
        ptr: b.ptr,
        size: b.size,
        born_ns: b.born_ns,
        allocation_id: b.allocation_id,
        owner: Some(b.owner.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apis::Api;
    use crate::model::{Call, Event, EventKind, Op, Pool};

    fn pool_call(wall_ns: u64, ptr: Option<u64>, size: u64) -> Event {
        let op = Op::PoolMalloc {
            pool: Pool::Caching,
            ptr,
            size: Some(size),
            req: Some(size),
            device: Some(0),
            handle: None,
            stream: None,
        };
        let call = Call {
            api: Api::DeviceCachingAllocatorMalloc,
            entry_wall_ns: wall_ns,
            status: 0,
            out_of_memory: false,
            outer: None,
            thread_device: Some(0),
            op,
            stack: crate::stacks::NO_STACK,
            py_stack: crate::stacks::NO_STACK,
            sample_weight: None,
            window_only: false,
            caller: None,
        };
        Event { wall_ns, pid: 1, tid: 1, kind: EventKind::Call(call) }
    }

    #[test]
    fn a_pool_giving_up_lists_the_most_recent_and_the_largest_live_blocks() {
        let mut t = Tracker::new();
        let mut out = Vec::new();
        // 12 blocks: sizes grow then shrink, so "recent" and "largest" differ.
        let sizes = [10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 5, 6];
        for (i, size) in sizes.iter().enumerate() {
            t.apply(pool_call(100 + i as u64, Some(0x1000 * (i as u64 + 1)), *size), &mut out);
        }
        out.clear();
        t.apply(pool_call(500, None, 1 << 30), &mut out);
        assert!(matches!(out[0], Output::Failed { out_of_memory: true, .. }));
        let listed = |want_recent: bool| -> Vec<(usize, u64)> {
            out.iter()
                .filter_map(|o| match o {
                    Output::OomBlock { recent, rank, size, .. } if *recent == want_recent => Some((*rank, *size)),
                    _ => None,
                })
                .collect()
        };
        let recent: Vec<u64> = listed(true).into_iter().map(|(_, s)| s).collect();
        assert_eq!(recent, [6, 5, 100, 90, 80, 70, 60, 50, 40, 30], "newest first, K = 10");
        let top: Vec<u64> = listed(false).into_iter().map(|(_, s)| s).collect();
        assert_eq!(top, [100, 90, 80, 70, 60, 50, 40, 30, 20, 10], "largest first");
        assert_eq!(listed(true)[0].0, 1, "ranks start at 1");
    }
}
