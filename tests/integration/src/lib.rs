//! Helpers for the privileged test tier: run the stand-in workload and the tracer, read the
//! workload's ledger (ground truth) and the tracer's output, and compare them.
//!
//! These tests load BPF, so they run only through `cargo xtask test` (as root), which builds the
//! stand-ins and the release binary and sets `MEMSCOPE_PRIVILEGED_TIER=1` plus the paths below.
//! Run any other way they fail with that instruction instead of passing silently.
//!
//! By role: [`binutils`] (a file's own tables, read with nm and readelf), [`environment`] (paths, variables, skips), [`ledgers`] (the workloads' own ground
//! truth), [`readers`] (the DBs, CSVs and text the tracer wrote, read back), [`runner`] (starting
//! memscope-bpf and the workloads), [`scrape`] (HTTP, Prometheus and PromQL), [`browser`] (pages in headless Chromium), [`kernel`] (the BPF programs loaded) and [`assertions`]
//! (the comparisons). Everything is
//! re-exported here, so a test needs only `use memscope_integration::*`.

pub mod assertions;
pub mod binutils;
pub mod browser;
pub mod environment;
pub mod kernel;
pub mod ledgers;
pub mod readers;
pub mod runner;
pub mod scrape;

pub use assertions::*;
pub use binutils::*;
pub use browser::*;
pub use environment::*;
pub use kernel::*;
pub use ledgers::*;
pub use readers::*;
pub use runner::*;
pub use scrape::*;
