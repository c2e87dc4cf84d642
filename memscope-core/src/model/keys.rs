//! The small types that more than one part of the state names: table keys and the records of
//! live blocks. They live here, below every part, so that a part can hand a block to another
//! (a reused address retires a block into `reuse`) without the two importing each other.

use std::collections::HashMap;

use super::event::{DeviceKey, DriverInfo, Pool, Space};
use super::output::{Output, Site};
use super::owners::OwnerBase;
use super::tags::BlockLabels;
use crate::apis::Api;

/// The state's hash maps. Most calls look several up (held driver calls, segments, the thread's
/// spans, ...), most of them empty or tiny, so the hash is the fast one.
pub(super) type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// (pid, space, address), as the live-block table's key.
pub(super) type Key = (u32, Space, u64);

/// Where a displaced block was: the live-block table or the pool-block table (pool calls are
/// serialized by their allocator's lock, so the window is short there, but it is the same race).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) enum Slot {
    Block(Key),
    Pool(u32, u64),
}

impl Slot {
    pub(super) fn pid(self) -> u32 {
        match self {
            Self::Block((pid, ..)) | Self::Pool(pid, _) => pid,
        }
    }
}

/// A live device or host block. Kept small (48 bytes): a job can hold a million of them, and the
/// tracer's memory is mostly these.
#[derive(Clone, Debug)]
pub(super) struct Live {
    pub(super) device: DeviceKey,
    pub(super) size: u64,
    pub(super) allocation_id: u64,
    pub(super) api: Api,
    pub(super) base: OwnerBase,
    pub(super) labels: BlockLabels,
    pub(super) hidden: bool,
    pub(super) born_ns: u64,
}

const _: () = assert!(std::mem::size_of::<Live>() <= 48, "a live block's state grew: see Live");

impl Live {
    /// The FREE row of this block, found at `key`, with its device's total `used` after it.
    pub(super) fn free_row(
        &self,
        site: Site,
        (_, space, ptr): Key,
        used: u64,
        (shadow, implied): (bool, bool),
        driver: Option<DriverInfo>,
    ) -> Output {
        Output::Free {
            site,
            device: self.device,
            space,
            ptr,
            size: Some(self.size),
            allocation_id: Some(self.allocation_id),
            used,
            shadow,
            implied,
            driver,
        }
    }
}

/// A live block of a framework pool.
#[derive(Clone, Debug)]
pub(super) struct PoolBlock {
    pub(super) device: DeviceKey,
    pub(super) pool: Pool,
    pub(super) size: u64,
    pub(super) allocation_id: u64,
    pub(super) api: Api,
    pub(super) labels: BlockLabels,
    /// Born while collection was off: never reported.
    pub(super) hidden: bool,
    pub(super) born_ns: u64,
    /// Streams it is marked on (`recordStream`, until `eraseStream`).
    pub(super) streams: Vec<u64>,
}
