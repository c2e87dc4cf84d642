//! Project tasks: `cargo xtask <task>`.
//!
//! - `setup`: install what a fresh machine lacks (apt packages, nightly rust-src, bpf-linker).
//! - `build`: stand-in libraries, test programs and the release binary.
//! - `test`: setup, build, unprivileged tests, then the privileged tier as root.
//! - `demo`: setup, build, trace the stand-in training job, print the summary and DB paths.
//! - `dist`: the release (static binaries for x86-64 and aarch64, tarballs, wheels, OCI image).
//! - `bench`: cost per traced allocation+free pair, against bpftrace on the same symbols.
//! - `same-results`: record what the binary makes of a corpus of DBs, or check another binary against it.

mod bench;
mod build;
mod demo;
mod dist;
mod same_results;
mod setup;
mod stable_tier;
mod test;
mod torch_env;
mod util;
mod vm;
mod wheel;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "memscope-bpf project tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install everything a fresh machine lacks (idempotent; quick when already done).
    Setup(setup::Options),
    /// Build the stand-in libraries, test programs and the release binary.
    Build,
    /// Run every test: setup, build, unprivileged `cargo test`, then the privileged tier as root.
    Test(test::Options),
    /// Trace the stand-in training job end to end and print where the DBs are.
    Demo(demo::Options),
    /// Build the release: static binaries, tarballs, wheels and the OCI image, in target/dist/.
    Dist(dist::Options),
    /// Measure the cost of tracing per allocation+free pair (results in target/bench/).
    Bench(bench::Options),
    /// Record every analysis' results on a corpus of DBs, or check a binary against a recording.
    SameResults(same_results::Options),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().task {
        Task::Setup(opts) => setup::run(&opts),
        Task::Build => build::run().map(|_| ()),
        Task::Test(opts) => test::run(&opts),
        Task::Demo(opts) => demo::run(&opts),
        Task::Dist(opts) => dist::run(&opts).map(|_| ()),
        Task::Bench(opts) => bench::run(&opts),
        Task::SameResults(opts) => same_results::run(&opts),
    }
}
