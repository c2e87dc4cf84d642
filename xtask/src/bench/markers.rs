//! The markers' cost (`cargo xtask bench`, second part): per call with no tracer attached (the
//! number that lets them stay in production scripts; target at most 150 ns), and per tag
//! push+pop pair when traced by memscope-bpf and, as the peer, by bpftrace on the same USDT
//! probes (all of them: the bench waits until every marker probe is attached).
//!
//! The cases run inside one Python process (markers/bench/untraced.py), best of N rounds, so
//! process start and attach time are not counted.

use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::Context as _;

use crate::build::Built;
use crate::util::privileged;

/// The traced comparison uses the tag span pair: the marker a training loop fires most.
const TRACED_CASE: &str = "describe_label+undescribe_pair";

fn script(root: &Path) -> String {
    root.join("markers/bench/untraced.py").display().to_string()
}

fn parse(stdout: &str) -> anyhow::Result<serde_json::Value> {
    let start = stdout.find('{').context("the markers bench printed no JSON")?;
    serde_json::from_str(&stdout[start..]).context("the markers bench printed bad JSON")
}

fn net(json: &serde_json::Value, case: &str) -> anyhow::Result<f64> {
    json["net_ns"][case].as_f64().with_context(|| format!("no `{case}` in the markers bench output"))
}

/// Runs `bench` (which says "waiting" on stderr once it is ready to be traced, then waits for a
/// tracer to raise its semaphores) under bpftrace attached by pid with `program`, and returns its
/// stdout. bpftrace 0.17 cannot resolve USDT sites of a library a `-c` child has not loaded yet,
/// so it attaches to the running process; it is stopped when the bench exits.
pub(crate) fn bpftrace_by_pid(bench: &mut Command, program: &str) -> anyhow::Result<String> {
    use std::io::{BufRead as _, BufReader, Read as _};
    let mut bench = bench
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("cannot start the bench")?;
    // Kept open until the bench exits: a closed pipe would kill it at its next message.
    let mut stderr = BufReader::new(bench.stderr.take().expect("piped"));
    let mut line = String::new();
    stderr.read_line(&mut line)?;
    anyhow::ensure!(line.contains("waiting"), "the bench did not start: {line}");
    let mut tracer = privileged("bpftrace")
        .args(["-p", &bench.id().to_string(), "-e", program])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("cannot start bpftrace")?;
    let out = bench.wait_with_output()?;
    // SAFETY: plain kill(2) on our child.
    unsafe { libc::kill(tracer.id() as i32, libc::SIGINT) };
    let _ = tracer.wait();
    let mut rest = String::new();
    let _ = stderr.read_to_string(&mut rest);
    anyhow::ensure!(out.status.success(), "the bench failed under bpftrace ({}): {rest}", out.status);
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The markers bench under bpftrace on its USDT probes.
fn bpftrace_attached(program: &str, python_path: &str, script: &str, args: &[&str]) -> anyhow::Result<f64> {
    let stdout =
        bpftrace_by_pid(Command::new("python3").env("PYTHONPATH", python_path).arg(script).args(args), program)?;
    net(&parse(&stdout)?, TRACED_CASE)
}

/// Runs the markers bench and returns its section of results.md.
pub fn run(built: &Built, root: &Path, out: &Path, have_bpftrace: bool) -> anyhow::Result<String> {
    let python_path = built.markers.display().to_string();
    eprintln!("xtask bench: markers, untraced");
    let (stdout, _) = super::measure::run_capture(
        Command::new("python3").env("PYTHONPATH", &python_path).arg(script(root)).args(["--rounds", "5"]),
    )?;
    let untraced = parse(&stdout)?;
    let mut md = String::from(
        "\n## Markers (markers/bench/untraced.py, best of 5 rounds of 1M calls, ns per call net of the loop)\n\n\
         | case | untraced ns |\n|---|---|\n",
    );
    if let Some(cases) = untraced["net_ns"].as_object() {
        for (case, ns) in cases {
            md.push_str(&format!("| {case} | {ns} |\n"));
        }
    }
    let calls = "100000";
    let traced_args = ["--rounds", "3", "--calls", calls, "--cases", TRACED_CASE, "--wait-tracer", "30"];

    eprintln!("xtask bench: markers, traced by memscope-bpf");
    let _ = std::fs::remove_dir_all(out);
    let (stdout, _) = super::measure::run_capture(
        privileged(built.binary.to_str().expect("utf-8 path"))
            .env("PYTHONPATH", &python_path)
            .env("ASCEND_HOME_PATH", &built.ascend_home)
            .args(["trace", "--quiet", "--output"])
            .arg(out)
            .args(["--", "python3"])
            .arg(script(root))
            .args(traced_args),
    )?;
    let ours = net(&parse(&stdout)?, TRACED_CASE)?;
    let u = net(&untraced, TRACED_CASE)?;
    md.push_str(&format!(
        "\nTraced, per tag push+pop pair (`{TRACED_CASE}`, best of 3 rounds of {calls}):\n\n\
         | configuration | ns per pair |\n|---|---|\n| untraced | {u} |\n| memscope-bpf trace (USDT, semaphores via ref_ctr, tag stacks) | {ours} |\n"
    ));
    if have_bpftrace {
        eprintln!("xtask bench: markers, traced by bpftrace");
        let lib = std::fs::read_dir(built.markers.join("memscope"))?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("_native")))
            .context("no _native module in the markers build")?;
        let l = lib.display();
        let program = format!(
            "usdt:{l}:memscope:tag_push {{ @push[str(arg1)] = count(); }} usdt:{l}:memscope:tag_pop {{ @pop[str(arg1)] = count(); }} \
             usdt:{l}:memscope:step {{}} usdt:{l}:memscope:mark {{}} usdt:{l}:memscope:addr_tag {{}} \
             usdt:{l}:memscope:range_start {{}} usdt:{l}:memscope:range_end {{}} usdt:{l}:memscope:collect {{}} \
             usdt:{l}:memscope:op_start {{}} usdt:{l}:memscope:op_end {{}} usdt:{l}:memscope:tensor_access {{}} \
             END {{ clear(@push); clear(@pop); }}"
        );
        let peer = bpftrace_attached(&program, &python_path, &script(root), &traced_args);
        match peer {
            Ok(p) => md.push_str(&format!(
                "| bpftrace, same USDT probes (label read into a map) | {p} |\n\nmemscope-bpf / bpftrace: {:.3}x of the added cost.\n",
                (ours - u) / (p - u)
            )),
            Err(e) => md.push_str(&format!("\nbpftrace on the USDT probes failed: {e:#}\n")),
        }
    }
    Ok(md)
}
