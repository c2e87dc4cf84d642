//! `memscope-bpf`: where accelerator memory goes in AI jobs, traced with eBPF uprobes from outside
//! the process.
//!
//! Module map (arrows point down only):
//! ```text
//! cli (one module per verb) ─┬─ attach   find libraries and symbols, load and attach BPF
//!                            ├─ record   drain the ring buffer, decode records into events
//!                            ├─ store    per-device SQLite/CSV in msMemScope's layout
//!                            ├─ analysis offline analyses of written DBs (decompose; `analyze`)
//!                            ├─ session  the trace loop tying them together
//!                            ├─ replay   the consumer on synthetic records (`bench-consumer`)
//!                            └─ recorder events through the model into rows (both of the above)
//!                                  └─ model   events, live blocks per device (no I/O)
//!                                        └─ apis   what each traced API means
//! ```

mod analysis;
mod apis;
mod attach;
mod cli;
mod clock;
mod launch;
mod model;
mod preflight;
mod procs;
mod record;
mod recorder;
mod replay;
mod say;
mod session;
mod stop;
mod store;
mod summary;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    match cli.run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            // One line: what failed, then why, each cause once.
            say::say!("memscope-bpf: error: {}", attach::with_causes(err.as_ref()));
            ExitCode::from(1)
        }
    }
}
