//! The event model and the live state built from it. No I/O and nothing of BPF or SQLite here,
//! so the same code serves the live trace and (later) offline analysis, and tests feed it events
//! directly.
//!
//! - [`event`]: what happened, as typed events ([`Event`], [`Op`]).
//! - [`output`]: the facts the store writes ([`Output`]).
//! - [`tracker`]: what is alive where, updated one event at a time. Its state is split by owner,
//!   each a type that keeps its own invariants and never names the tracker: `blocks` (device and
//!   host blocks), `devices` (per-device totals and ids, the device a thread is on), `pools`
//!   (framework pools), `vmm` (reservations, physical handles), `reuse` (blocks whose address was
//!   handed out again before their free was seen), `owners` (owner paths, made once per allocator
//!   and spans); `keys` holds the small types they share. The rules that need several parts are
//!   the tracker's: `route_blocks`, `route_vmm`, `route_pools`; `finish` writes the stop's
//!   shadow frees.
//! - [`tags`]: tag spans per thread and owner paths; `marks`: what markers do to the state.
//! - `access`: uses of blocks; `atb`: ATB operations; `oom`: what was alive at an OOM.

mod access;
mod atb;
mod blocks;
mod devices;
pub mod event;
mod finish;
mod inferred;
mod keys;
mod marks;
mod oom;
pub mod output;
mod owners;
mod pools;
mod reuse;
mod route_blocks;
mod route_owner;
mod route_pools;
mod route_vmm;
pub mod tags;
#[cfg(test)]
pub(crate) mod testing;
pub mod tracker;
mod vmm;
mod window;

pub use devices::DeviceStats;
pub use event::{level, Call, DeviceKey, DriverInfo, Event, EventKind, Marker, Op, PageType, Pool, Space};
pub use output::{AccessKind, BlockFrom, MstxKind, Origin, Output, OwnerBy, Site, VmmStep};
pub use pools::PoolStats;
pub use tracker::Tracker;
