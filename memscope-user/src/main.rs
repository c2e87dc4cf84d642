//! `memscope-bpf`: where accelerator memory goes in AI jobs, traced with eBPF uprobes from outside
//! the process.
//!
//! Module map (arrows point down only; every event enters `memscope_core::ingest` once, from
//! `capture::ring`, and flows down through the core):
//! ```text
//! cli (one module per verb) ─┬─ session   one trace: a target attached or launched, to its summary
//!                            ├─ daemon    every job on the node, each in its own run folder
//!                            ├─ capture   what both share: probes attached as libraries appear,
//!                            │            the ring drained into the core, the loop, the stop
//!                            ├─ metrics   the totals served for Prometheus (`--listen`, daemon)
//!                            ├─ attach    find libraries and symbols, load and attach BPF
//!                            ├─ terminal  lines, the live status and progress for the person watching
//!                            └─ memscope-core: ingest → analysis → store → model → apis → raw
//! ```

mod attach;
mod capture;
mod cli;
mod daemon;
mod driver;
mod metrics;
mod session;
mod terminal;

use std::process::ExitCode;

use clap::Parser;

use terminal::say::say;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    match cli.run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) if err.downcast_ref::<cli::PassOn>().is_some() => {
            ExitCode::from(err.downcast_ref::<cli::PassOn>().map_or(1, |p| p.0))
        }
        Err(err) => {
            // One line: what failed, then why, each cause once.
            say!("memscope-bpf: error: {}", attach::with_causes(err.as_ref()));
            ExitCode::from(1)
        }
    }
}
