//! What a trace and the daemon share: the probes attached as libraries appear ([`attaching`]),
//! the kernel's ring mapped ([`ring_map`]) and drained into the core ([`ring`]), the loop that
//! drives both ([`event_loop`]), the stop (signals, detaching: [`stop`]), which traced
//! processes still run ([`procs`]) and their interpreters ([`python`]); [`replay`] drives the same consumer from synthetic records
//! (`bench-consumer`).

pub mod attaching;
pub mod event_loop;
pub mod procs;
pub mod python;
pub mod replay;
pub mod ring;
pub mod ring_map;
pub mod stop;

use std::path::PathBuf;
use std::time::Duration;

use memscope_core::store::{DbWriter, Format};

use crate::attach::ProbeSet;
use crate::terminal::status::Mode;

/// What a trace and the daemon are both told: where and how their rows are written, which
/// functions are probed, how big the ring is, for how long, and what the person watching sees.
pub struct Plan {
    /// The folder the run folders go in.
    pub output: PathBuf,
    /// `--duration`.
    pub duration: Option<Duration>,
    pub format: Format,
    /// `--writer`.
    pub writer: DbWriter,
    pub probe_set: ProbeSet,
    pub ring_bytes: u32,
    pub quiet: bool,
    /// The live status: a terminal's area, plain lines, JSON lines (`--json`) or none.
    pub status: Mode,
    /// `--driver-every`, `--driver-lib`.
    pub driver: crate::driver::Config,
    /// `--node-root`.
    pub node_root: PathBuf,
}
