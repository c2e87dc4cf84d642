//! `bench-simulate` (hidden): times the allocator replay (`advise --simulate`) on a made-up
//! training job's requests, for `cargo xtask bench`. Prints one line per setting of `key value`
//! pairs that the bench parses.

use memscope_core::analysis::simulate::{self, synthetic, Flavour, Options};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Requests in the stream (each with its free).
    #[arg(long, default_value_t = 1_000_000)]
    requests: u64,
    /// Settings to replay under, besides the defaults (repeatable).
    #[arg(long = "setting")]
    settings: Vec<String>,
    /// Replays per setting; the fastest is printed.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    let trace = synthetic::trace(args.requests);
    let requests = trace.steps.iter().filter(|s| matches!(s.step, simulate::trace::Step::Alloc { .. })).count();
    let mut settings = vec![String::new()];
    settings.extend(args.settings.iter().cloned());
    for setting in &settings {
        let options = Options { flavour: Flavour::Npu, ..Options::default() };
        let mut best = f64::INFINITY;
        let mut figures = None;
        for _ in 0..args.rounds.max(1) {
            let start = std::time::Instant::now();
            let f = simulate::predict(&trace, setting, &options)?;
            best = best.min(start.elapsed().as_secs_f64());
            figures = Some(f);
        }
        let f = figures.expect("one round at least");
        println!(
            "setting {} requests {requests} seconds {best:.3} per_million_s {:.3} segments {} peak_reserved {}",
            if setting.is_empty() { "defaults" } else { setting },
            best * 1e6 / requests as f64,
            f.segments,
            f.peak_reserved_bytes
        );
    }
    Ok(())
}
