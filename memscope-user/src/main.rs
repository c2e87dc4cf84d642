//! `memscope-bpf`: where accelerator memory goes in AI jobs, traced with eBPF uprobes from outside
//! the process.
//!
//! Module map (arrows point down only; `analysis`, `store`, `model` and `apis` are memscope-core's):
//! ```text
//! cli (one module per verb) ─┬─ attach   find libraries and symbols, load and attach BPF
//!                            ├─ session  the trace loop tying them together
//!                            ├─ replay   the consumer on synthetic records (`bench-consumer`)
//!                            ├─ recorder events through the model into rows (both of the above)
//!                            ├─ record   drain the ring buffer into events
//!                            └─ memscope-core: analysis → store → model → apis → raw
//! ```

mod attach;
mod cli;
mod clock;
mod daemon;
mod launch;
mod metrics;
mod preflight;
mod procs;
mod progress;
mod record;
mod recorder;
mod replay;
mod say;
mod session;
mod status;
mod stop;
mod summary;

use std::process::ExitCode;

// The core crate's modules, at the paths the rest of the binary names them by.
use memscope_core::{analysis, apis, import, model, stacks, store};

use clap::Parser;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    match cli.run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) if err.downcast_ref::<cli::PassOn>().is_some() => {
            ExitCode::from(err.downcast_ref::<cli::PassOn>().map_or(1, |p| p.0))
        }
        Err(err) => {
            // One line: what failed, then why, each cause once.
            say::say!("memscope-bpf: error: {}", attach::with_causes(err.as_ref()));
            ExitCode::from(1)
        }
    }
}
