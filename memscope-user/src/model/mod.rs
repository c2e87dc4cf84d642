//! The event model and the live state built from it. No I/O and nothing of BPF or SQLite here,
//! so the same code serves the live trace and (later) offline analysis, and tests feed it events
//! directly.
//!
//! - [`event`]: what happened, as typed events ([`Event`], [`Op`]).
//! - [`tracker`]: what is alive where — blocks per device, physical handles, reservations — and
//!   the per-block facts the store writes ([`Output`]).
//! - [`tags`]: tag spans per thread and owner paths; `marks`: what markers do to the state.
//! - `atb`: ATB operations as start/end rows placed on their workspace's device.

mod access;
mod atb;
pub mod event;
mod marks;
mod oom;
pub mod tags;
pub mod tracker;

pub use event::{level, Call, DeviceKey, DriverInfo, Event, EventKind, Marker, Op, PageType, Pool, Space};
pub use tracker::{AccessKind, MstxKind, Origin, Output, Site, Tracker, VmmStep};
