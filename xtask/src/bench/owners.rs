//! What reading owners from Python stacks costs a real job (`cargo xtask bench --owners-only`):
//! the real PyTorch CPU training loop (`tests/workloads/torch_cpu_loop.py`, its own loop time)
//! untraced, under `trace --no-infer` (no Python walk) and under `trace`'s default (a walk per
//! allocation), in rotating order; the overhead of each in percent of the untraced loop, and of
//! the walk alone against `--no-infer`. The per-call figures are the Python rounds of
//! `stacks.rs`, on the stand-in's pairs.

use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::Context as _;

use super::measure::median;
use crate::build::Built;
use crate::util::privileged;

/// The loop's seconds, from its `loop_s=` line.
fn loop_seconds(stdout: &[u8]) -> anyhow::Result<f64> {
    let text = String::from_utf8_lossy(stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("loop_s=")?.trim().parse().ok())
        .with_context(|| format!("the PyTorch loop printed no loop time: {text}"))
}

/// The bytes of the DBs a trace wrote under `out`: what the rows' `site` and `py_stack` and the
/// `ms_py_stacks` table cost on disk.
fn db_bytes(out: &Path) -> u64 {
    let mut total = 0;
    let mut dirs = vec![out.to_owned()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "db") {
                total += entry.metadata().map_or(0, |m| m.len());
            }
        }
    }
    total
}

/// One run of the loop: untraced (`trace` is `None`) or launched under `trace` with those flags;
/// its loop seconds and the bytes of the DBs it wrote.
fn one(python: &Path, root: &Path, built: &Built, out: &Path, trace: Option<&[&str]>) -> anyhow::Result<(f64, u64)> {
    let script = root.join("tests/workloads/torch_cpu_loop.py");
    let mut cmd = match trace {
        None => Command::new(python),
        Some(flags) => {
            let _ = std::fs::remove_dir_all(out);
            let mut c = privileged(built.binary.to_str().expect("utf-8 path"));
            c.args(["trace", "--quiet", "--output"]).arg(out).args(flags).arg("--").arg(python);
            c
        }
    };
    let run = cmd.arg(script).args(["--steps", "300"]).stdin(Stdio::null()).stderr(Stdio::null()).output()?;
    anyhow::ensure!(run.status.success(), "the PyTorch loop failed ({})", run.status);
    Ok((loop_seconds(&run.stdout)?, if trace.is_some() { db_bytes(out) } else { 0 }))
}

pub fn run(built: &Built, root: &Path, out: &Path, rounds: usize) -> anyhow::Result<String> {
    let python = match crate::torch_env::python() {
        Ok(p) => p,
        Err(why) => return Ok(format!("\n## Owners from Python stacks: a real PyTorch loop\n\nNot run: {why}\n")),
    };
    let variants: [(&str, Option<&[&str]>); 3] = [
        ("nothing attached", None),
        ("`trace --no-infer` (no Python walk)", Some(&["--no-infer"])),
        ("`trace` (default: a Python walk per allocation)", Some(&[])),
    ];
    let mut runs: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    let mut dbs: Vec<u64> = vec![0; variants.len()];
    for round in 0..2 * rounds {
        eprintln!("xtask bench: owners, a real PyTorch loop, round {}/{}", round + 1, 2 * rounds);
        for k in 0..variants.len() {
            let v = (round + k) % variants.len();
            let (seconds, bytes) = one(&python, root, built, out, variants[v].1)?;
            runs[v].push(seconds);
            dbs[v] = bytes;
        }
    }
    let med: Vec<f64> = runs.iter().map(|r| median(r.clone())).collect();
    let mut md = format!(
        "\n## Owners from Python stacks: a real PyTorch training loop on the CPU\n\nCommand: `cargo xtask bench \
         --owners-only --rounds {rounds}`. torch_cpu_loop.py (MLP 512-1024-1024-512, Adam, batch 64, 300 steps, 1 \
         thread), launched under `trace`; the loop's own seconds, median of {} runs in rotating order.\n\n\
         | run | loop s (median) | vs nothing attached | DB MiB | runs |\n|---|---|---|---|---|\n",
        2 * rounds
    );
    for (i, (name, _)) in variants.iter().enumerate() {
        let vs = if i == 0 { "–".to_owned() } else { format!("{:+.2} %", (med[i] / med[0] - 1.0) * 100.0) };
        let r = runs[i].iter().map(|x| format!("{x:.3}")).collect::<Vec<_>>().join(", ");
        let db = if i == 0 { "–".to_owned() } else { format!("{:.2}", dbs[i] as f64 / (1 << 20) as f64) };
        md.push_str(&format!("| {name} | {:.3} | {vs} | {db} | {r} |\n", med[i]));
    }
    md.push_str(&format!(
        "\nThe Python walk alone (default against `--no-infer`): {:+.2} % of the untraced loop.\n",
        (med[2] - med[1]) / med[0] * 100.0
    ));
    Ok(md)
}
