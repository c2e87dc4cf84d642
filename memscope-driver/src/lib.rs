//! The driver's own view of accelerator memory: each device's total and used bytes and each
//! process's usage on it, as the vendor's management library reports them (DCMI on Ascend, the
//! library npu-smi uses; NVML on NVIDIA). Traced calls explain what a job allocated through the
//! APIs the tracer probes; these figures include everything else the driver charged the process
//! for (its context, a communication library's buffers, another library's direct driver calls).
//!
//! The tracer is a static binary and cannot load a shared library, so the queries run in a
//! helper process (`memscope-driver-query`, this crate's binary) that the tracer starts and
//! asks, one JSON line each way ([`protocol`]). [`dcmi`] and [`nvml`] bind the two libraries.

pub mod dcmi;
pub mod nvml;
pub mod protocol;

pub use protocol::{DeviceReading, Hello, Message, ProcessUse, Reading, SourceKind};

/// A management library, loaded and initialised, that answers for its devices.
pub trait Source {
    /// The devices it knows, by the id the job's allocations carry (the logical device id on
    /// Ascend, the NVML index on NVIDIA).
    fn devices(&self) -> Vec<u32>;
    /// One device's figures now; a failed part is told in the reading's `error`.
    fn read(&self, device: u32) -> DeviceReading;
}

/// Why a library could not be used.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot load {path}: {source}")]
    Open { path: String, source: libloading::Error },
    #[error("{path} lacks {symbol}: not a {what} library")]
    Symbol { path: String, symbol: &'static str, what: &'static str },
    #[error("{call} failed with {code}")]
    Init { call: &'static str, code: i64 },
}

/// Opens `path` (a plain name goes through the dynamic linker's search path).
pub(crate) fn open(path: &str) -> Result<libloading::Library, LoadError> {
    // SAFETY: loading a vendor library runs its initialisers; that is the point of this process,
    // which exists so that whatever they do cannot reach the tracer.
    unsafe { libloading::Library::new(path) }.map_err(|source| LoadError::Open { path: path.to_owned(), source })
}

/// Bytes in the MB the DCMI reports device memory in.
pub const MIB: u64 = 1 << 20;
