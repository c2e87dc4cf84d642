//! Command line: one module per verb, each owning its arguments and its `run`.

pub mod advise;
pub mod analyze;
mod bench_consumer;
mod bench_simulate;
mod capture;
pub mod compare;
mod compare_ranks;
pub mod daemon;
pub mod export;
pub mod import;
mod imports;
mod inputs;
mod owner_rules;
pub mod probes;
pub mod report;
pub mod trace;

use std::time::Duration;

use clap::{Parser, Subcommand};

/// Traces accelerator (Ascend NPU) memory of AI training and inference jobs with eBPF uprobes,
/// without modifying or restarting the traced process, and writes MindStudio Insight databases.
#[derive(Debug, Parser)]
#[command(name = "memscope-bpf", version, about, long_about = None, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    Trace(trace::Args),
    Probes(probes::Args),
    Analyze(analyze::Args),
    Compare(compare::Args),
    Advise(advise::Args),
    Daemon(daemon::Args),
    Export(export::Args),
    Import(import::Args),
    Report(report::Args),
    /// Replays synthetic ring records through the consumer (for `cargo xtask bench`).
    #[command(hide = true)]
    BenchConsumer(bench_consumer::Args),
    /// Times the allocator replay on a made-up job's requests (for `cargo xtask bench`).
    #[command(hide = true)]
    BenchSimulate(bench_simulate::Args),
}

impl Cli {
    pub fn run(self) -> anyhow::Result<()> {
        let result = self.run_verb();
        // The temporary DBs of CSVs the verb read.
        imports::remove_imports();
        result
    }

    fn run_verb(self) -> anyhow::Result<()> {
        match self.command {
            Command::Trace(args) => trace::run(args),
            Command::Probes(args) => probes::run(args),
            Command::Analyze(args) => analyze::run(args),
            Command::Compare(args) => compare::run(args),
            Command::Advise(args) => advise::run(args),
            Command::Daemon(args) => daemon::run(args),
            Command::Export(args) => export::run(args),
            Command::Import(args) => import::run(args),
            Command::Report(args) => report::run(args),
            Command::BenchConsumer(args) => bench_consumer::run(&args),
            Command::BenchSimulate(args) => bench_simulate::run(&args),
        }
    }
}

/// A launched command's non-zero exit status, which `trace -- CMD` exits with once its trace is
/// complete, as `time` and `strace` do: a script running a job under the tracer sees the job's
/// failure. Not an error of the tracer's (nothing more is printed).
#[derive(Debug, thiserror::Error)]
#[error("the traced command exited with status {0}")]
pub struct PassOn(pub u8);

/// Parses `30`, `30s`, `500ms`, `5m`, `1h`, `7d`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 =
        number.parse().map_err(|_| format!("`{text}` is not a duration (examples: 30, 30s, 500ms, 5m, 1h, 7d)"))?;
    let seconds = match unit {
        "" | "s" => value,
        "ms" => value / 1e3,
        "m" => value * 60.0,
        "h" => value * 3600.0,
        "d" => value * 86400.0,
        _ => return Err(format!("unknown unit `{unit}` in `{text}` (use ms, s, m, h or d)")),
    };
    if !(seconds.is_finite() && seconds > 0.0) {
        return Err(format!("`{text}` must be a positive duration"));
    }
    Duration::try_from_secs_f64(seconds).map_err(|_| {
        format!("`{text}` is too long a duration (more than {} s); omit --duration to trace until stopped", u64::MAX)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("7d").unwrap(), Duration::from_secs(7 * 86400));
        assert!(parse_duration("0").is_err());
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("x").is_err());
    }

    #[test]
    fn a_duration_too_long_for_the_clock_is_an_error_not_a_panic() {
        let err = parse_duration("99999999999999999999").unwrap_err();
        assert!(err.contains("too long") && err.contains("--duration"), "{err}");
        // Past f64's range the number is infinite.
        assert!(parse_duration(&format!("1{}", "0".repeat(400))).is_err());
        assert!(parse_duration("99999999999999999999h").is_err());
        // The longest accepted one still fits.
        assert_eq!(parse_duration("1000000000h").unwrap(), Duration::from_secs(3_600_000_000_000));
    }

    #[test]
    fn cli_is_well_formed() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn pid_and_command_are_exclusive() {
        let r = Cli::try_parse_from(["memscope-bpf", "trace", "--pid", "1", "--", "true"]);
        assert!(r.is_err());
    }
}
