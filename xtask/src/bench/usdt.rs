//! What one hit of a USDT site costs a traced process, by the site's instruction (`cargo xtask
//! bench`, and `--usdt-only`): PyTorch's `pytorch:malloc/free` sites are 1-byte nops (its
//! static_tracepoint.h), our markers' are 5-byte nops, which the kernel's uprobe code handles more
//! cheaply. Both kinds are the same `pytorch:free` probe of the stand-in libc10_cuda.so
//! (`tests/bench/usdt_nop_bench.c`), traced by memscope-bpf and, as the peer, by bpftrace on the
//! same probe, in the same run.

use std::path::Path;
use std::process::Command;

use anyhow::Context as _;

use crate::build::Built;
use crate::util::privileged;

fn parse(stdout: &str) -> anyhow::Result<(f64, f64)> {
    let get = |key: &str| {
        stdout
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .with_context(|| format!("no {key} in the USDT bench's output:\n{stdout}"))
    };
    Ok((get("nop1_ns ")?, get("nop5_ns ")?))
}

/// The bench under bpftrace on every site of `pytorch:free` (counting hits) and `pytorch:malloc`
/// (the bench waits for both semaphores, as memscope-bpf raises both).
fn bpftrace(built: &Built, hits: &str, rounds: &str) -> anyhow::Result<(f64, f64)> {
    let l = built.cuda.join("libc10_cuda.so");
    let l = l.display();
    let program =
        format!("usdt:{l}:pytorch:free {{ @hits = count(); }} usdt:{l}:pytorch:malloc {{}} END {{ clear(@hits); }}");
    let stdout =
        super::markers::bpftrace_by_pid(Command::new(&built.usdt_bench).args([hits, rounds, "--wait"]), &program)?;
    parse(&stdout)
}

/// Runs the comparison and returns its section of results.md.
pub fn run(built: &Built, out: &Path, have_bpftrace: bool) -> anyhow::Result<String> {
    let (hits, rounds) = ("200000", "5");
    eprintln!("xtask bench: USDT sites, untraced");
    let (stdout, _) = super::measure::run_capture(Command::new(&built.usdt_bench).args([hits, rounds]))?;
    let untraced = parse(&stdout)?;
    eprintln!("xtask bench: USDT sites, traced by memscope-bpf");
    let _ = std::fs::remove_dir_all(out);
    let (stdout, _) = super::measure::run_capture(
        privileged(built.binary.to_str().expect("utf-8 path"))
            .args(["trace", "--quiet", "--output"])
            .arg(out)
            .arg("--lib")
            .arg(built.cuda.join("libc10_cuda.so"))
            .arg("--")
            .arg(&built.usdt_bench)
            .args([hits, rounds, "--wait"]),
    )?;
    let ours = parse(&stdout)?;
    let mut md = format!(
        "\n## USDT sites: PyTorch's 1-byte nop against a 5-byte nop (tests/bench/usdt_nop_bench.c, best of {rounds} rounds of {hits} hits)\n\n\
         The same `pytorch:free` probe of the stand-in libc10_cuda.so on both kinds of site, ns per hit:\n\n\
         | configuration | 1-byte nop (PyTorch's sites) | 5-byte nop (our markers' sites) |\n|---|---|---|\n\
         | untraced (semaphore 0: one load and branch) | {:.1} | {:.1} |\n\
         | memscope-bpf trace | {:.1} | {:.1} |\n",
        untraced.0, untraced.1, ours.0, ours.1
    );
    if have_bpftrace {
        eprintln!("xtask bench: USDT sites, traced by bpftrace");
        match bpftrace(built, hits, rounds) {
            Ok(p) => md.push_str(&format!(
                "| bpftrace, same probe (a count) | {:.1} | {:.1} |\n\n\
                 memscope-bpf / bpftrace, added cost per hit: {:.2}x (1-byte nop), {:.2}x (5-byte nop): \
                 bpftrace counts; memscope-bpf reads the four arguments and sends a record.\n",
                p.0,
                p.1,
                (ours.0 - untraced.0) / (p.0 - untraced.0),
                (ours.1 - untraced.1) / (p.1 - untraced.1)
            )),
            Err(e) => md.push_str(&format!("\nbpftrace on the USDT probe failed: {e:#}\n")),
        }
    }
    md.push_str(&format!(
        "\nA traced hit of a 1-byte-nop site costs {:.2}x one of a 5-byte-nop site under memscope-bpf.\n",
        (ours.0 - untraced.0) / (ours.1 - untraced.1)
    ));
    Ok(md)
}
