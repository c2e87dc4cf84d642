//! The allocator replay (`advise --simulate`; `cargo xtask bench --simulate-only`, and in the
//! full run): seconds per million requests, per setting, on a made-up training job's requests
//! (`memscope-bpf bench-simulate`, which builds the stream in memory so that only the replay is
//! timed). No peer replays a job's requests; PyTorch's own answer is a rerun of the job.

use std::path::Path;
use std::process::Command;

use anyhow::Context as _;

/// The settings timed besides the defaults: the ones `advise` recommends.
const SETTINGS: [&str; 3] = ["expandable_segments:True", "max_split_size_mb:64", "roundup_power2_divisions:4"];

pub fn run(binary: &Path, requests: u64, rounds: usize) -> anyhow::Result<String> {
    eprintln!("xtask bench: the allocator replay, {requests} requests per setting");
    let mut cmd = Command::new(binary);
    cmd.args(["bench-simulate", "--requests", &requests.to_string(), "--rounds", &rounds.max(1).to_string()]);
    for s in SETTINGS {
        cmd.args(["--setting", s]);
    }
    let out = cmd.output().with_context(|| format!("cannot run {}", binary.display()))?;
    anyhow::ensure!(out.status.success(), "bench-simulate failed: {}", String::from_utf8_lossy(&out.stderr));
    let mut md = format!(
        "\n## Allocator replay (`advise --simulate`: {requests} requests of a made-up training job and their \
         frees, replayed in memory; fastest of {} rounds)\n\n\
         | setting | seconds | seconds per million requests | segments | peak reserved |\n|---|---|---|---|---|\n",
        rounds.max(1)
    );
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let get =
            |key: &str| words.iter().position(|w| *w == key).and_then(|i| words.get(i + 1)).copied().unwrap_or("?");
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} |\n",
            get("setting"),
            get("seconds"),
            get("per_million_s"),
            get("segments"),
            get("peak_reserved")
        ));
    }
    Ok(md)
}
