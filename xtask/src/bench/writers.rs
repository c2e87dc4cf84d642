//! `cargo xtask bench --writers-only`: the trace DB's two writers, page and SQL, on the same row
//! stream in one run (alternating, twice each), and what a commit costs now that it is synced.
//! The timing loop lives beside the writers (`store::dump_rows::tests::bench_writers`, an ignored
//! test of the core crate), which is where their types are; this runs it in release mode.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context as _};

pub fn run(root: &Path, rows: u64) -> anyhow::Result<()> {
    let out = Command::new("cargo")
        .current_dir(root)
        .env("MEMSCOPE_BENCH_ROWS", rows.to_string())
        .args(["test", "--release", "-p", "memscope-core", "--lib", "store::dump_rows::tests::bench_writers", "--"])
        .args(["--ignored", "--exact", "--nocapture", "--test-threads=1"])
        .output()
        .context("cannot run cargo test")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!("the writers' bench failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    }
    // The first figure shares its line with libtest's `test ... ` prefix.
    let lines: Vec<&str> = stdout.lines().filter_map(|l| l.find("writer ").map(|at| &l[at..])).collect();
    if lines.len() < 4 {
        bail!("the writers' bench printed no figures:\n{stdout}");
    }
    let mut md = format!(
        "## The trace DB's writers\n\n`cargo xtask bench --writers-only` ({rows} rows of a PTA block, 6 Attr keys, \
         a commit every 50,000 rows, synced: the pages' fdatasync, then the WAL's fsync)\n\n```\n"
    );
    for line in lines {
        md.push_str(line);
        md.push('\n');
    }
    md.push_str("```\n");
    let dir = root.join("target/bench");
    std::fs::create_dir_all(&dir)?;
    super::measure::report(&dir.join("results-writers.md"), &md)
}
