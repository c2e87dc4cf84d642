//! The event model and the live state built from it. No I/O and nothing of BPF or SQLite here,
//! so the same code serves the live trace and (later) offline analysis, and tests feed it events
//! directly.
//!
//! - [`event`]: what happened, as typed events ([`Event`], [`Op`]).
//! - [`output`]: the facts the store writes ([`Output`]).
//! - [`tracker`]: what is alive where, updated one event at a time; it hands each event to the
//!   part that owns its kind of memory: `blocks` (device and host blocks; `reuse`: an address
//!   handed out again before its free was seen), `vmm` (reservations,
//!   physical handles, mappings), `pools` (framework pools), `devices` (per-device totals, the
//!   device a thread is on), `owners` (owner paths, made once per allocator and spans); `finish`
//!   writes the stop's shadow frees.
//! - [`tags`]: tag spans per thread and owner paths; `marks`: what markers do to the state.
//! - `access`: uses of blocks; `atb`: ATB operations; `oom`: what was alive at an OOM.

mod access;
mod atb;
mod blocks;
mod devices;
pub mod event;
mod finish;
mod marks;
mod oom;
pub mod output;
mod owners;
mod pools;
mod reuse;
pub mod tags;
#[cfg(test)]
mod testing;
pub mod tracker;
mod vmm;

pub use devices::DeviceStats;
pub use event::{level, Call, DeviceKey, DriverInfo, Event, EventKind, Marker, Op, PageType, Pool, Space};
pub use output::{AccessKind, MstxKind, Origin, Output, Site, VmmStep};
pub use pools::PoolStats;
pub use tracker::Tracker;
