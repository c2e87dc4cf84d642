//! `bench-consumer` (hidden): times the consumer on replayed records, for `cargo xtask bench`.
//! Prints one line of `key value` pairs that the bench parses.

use std::path::PathBuf;

use crate::capture::replay::{self, Options};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Allocation + free pairs (4 records each: runtime and driver calls).
    #[arg(long, default_value_t = 1_000_000)]
    pairs: u64,
    /// Blocks allocated first and left live until the stop (2 records each).
    #[arg(long, default_value_t = 0)]
    live: u64,
    /// Distinct native stacks to replay, one before each outermost call (0: none), as
    /// `--call-stack c` sends them: each new one is normalized and symbolized.
    #[arg(long, default_value_t = 0)]
    stacks: u64,
    /// Folder for the run's DB.
    #[arg(long)]
    output: PathBuf,
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    let r =
        replay::run(&Options { pairs: args.pairs, live: args.live, output: args.output.clone(), stacks: args.stacks })?;
    let (wall, cpu) = (r.wall.as_secs_f64(), r.cpu.as_secs_f64());
    println!(
        "records {} rejected {} wall_s {wall:.3} cpu_s {cpu:.3} records_per_s {:.0} records_per_cpu_s {:.0} peak_rss_kib {}",
        r.records,
        r.rejected,
        r.records as f64 / wall,
        r.records as f64 / cpu,
        r.peak_rss_kib
    );
    for f in &r.files {
        println!("db {}", f.display());
    }
    Ok(())
}
