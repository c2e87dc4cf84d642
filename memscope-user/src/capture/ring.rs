//! The kernel's ring buffer drained into the core's decoder ([`Decoder`]), sample by sample.
//!
//! The BPF side wakes us only when a lot is waiting (see `maps::output`), so the consumer also
//! drains on a short timer; both paths call [`Consumer::drain`].

use std::os::fd::{AsRawFd as _, RawFd};

use aya::maps::MapData;
use memscope_core::ingest::clock::Clock;
use memscope_core::ingest::decoder::{ConsumerStats, Decoder};
use memscope_core::model::Event;
use memscope_core::stacks::capture::CaptureStats;
use memscope_core::stacks::python::Layout;
use thiserror::Error;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use super::ring_map::{RingMap, RingMapError};

/// Why the ring cannot be read.
#[derive(Debug, Error)]
pub enum RingError {
    #[error("cannot map the ring buffer")]
    Map(#[from] RingMapError),
    #[error("cannot poll the ring buffer")]
    Poll(#[source] std::io::Error),
}

pub struct Consumer {
    /// The ring's descriptor registered with the async runtime. Declared before `ring`, which
    /// owns the descriptor, so that it is deregistered first.
    polled: AsyncFd<RawFd>,
    ring: RingMap,
    pub stats: ConsumerStats,
    decoder: Decoder,
}

impl Consumer {
    /// Maps the ring buffer map (`EVENTS`) for reading, and registers it to be polled (inside
    /// the async runtime).
    pub fn new(map: MapData, clock: Clock) -> Result<Self, RingError> {
        let ring = RingMap::new(map)?;
        // SAFETY: the descriptor belongs to `ring`, which outlives the registration: both are
        // fields of the consumer, `polled` declared first and so dropped first.
        let polled = unsafe { AsyncFd::register_with_interest(ring.as_raw_fd(), Interest::READABLE) }
            .map_err(|e| RingError::Poll(e.into_parts().1))?;
        Ok(Self { polled, ring, stats: ConsumerStats::default(), decoder: Decoder::new(clock) })
    }

    /// Resolves when the kernel has woken the ring's readers (a lot is waiting).
    pub async fn woken(&self) {
        if let Ok(mut guard) = self.polled.readable().await {
            guard.clear_ready();
        }
    }

    /// What the stack capture saw (`--call-stack c`).
    pub fn stack_stats(&self) -> CaptureStats {
        self.decoder.stack_stats()
    }

    pub fn set_stack_depth(&mut self, depth: u32) {
        self.decoder.set_stack_depth(depth);
    }

    /// The kernel samples with this interval (`--sample-bytes`; 0: not at all).
    pub fn set_sample_bytes(&mut self, bytes: u64) {
        self.decoder.set_sample_bytes(bytes);
    }

    /// Where stripped libraries' debug files are looked for (`--debug-dir`), for their stacks.
    pub fn set_debug_dirs(&mut self, dirs: Vec<std::path::PathBuf>) {
        self.decoder.set_debug_finder(crate::attach::debug::finder(dirs));
    }

    /// A process's interpreter, found by the session.
    pub fn set_python(&mut self, pid: u32, layout: &'static Layout) {
        self.decoder.set_python(pid, layout);
    }

    /// The traced processes that replaced their image since the last call (their interpreter
    /// must be looked for again).
    pub fn take_execs(&mut self) -> Vec<u32> {
        self.decoder.take_execs()
    }

    /// The processes whose dynamic linker loaded or unloaded objects since the last call, in
    /// the order reported, repeats included (their mappings are to be read again).
    pub fn take_loads(&mut self) -> Vec<u32> {
        self.decoder.take_loads()
    }

    /// Reads everything waiting, in ring order (per thread, that is call order).
    pub fn drain(&mut self, mut sink: impl FnMut(Event)) {
        let Self { ring, stats, decoder, .. } = self;
        ring.drain(|record| decoder.feed(record, stats, &mut sink));
    }
}
