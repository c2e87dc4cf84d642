//! The cost of native stacks per aclrtMalloc + aclrtFree pair (`trace --call-stack c`, frame
//! pointers and `--unwind dwarf`), against bpftrace on the same 8 probes taking `ustack` at the
//! same two outermost entries (its stacks go to a stack map, deduplicated in the kernel), all in
//! the same run and interleaved: untraced, memscope-bpf without stacks, with `c`, with `c
//! --unwind dwarf`, bpftrace without and with `ustack`. Then Python stacks: the same pairs made
//! from Python (`tests/bench/py_alloc_bench.py`, ctypes at the bottom of a 4-frame chain) on
//! pyenv's CPython 3.12: `--no-infer` (no walk), the default (one walk per call, for the owner
//! rules and sites), with `python` and with `c,python`, and bpftrace's floor on the same 8 probes
//! (it has no Python stacks to compare with).

use std::path::Path;
use std::process::Command;

use super::measure::{median, run_capture};
use crate::build::Built;
use crate::util::{output, privileged};

fn ns(stdout: &str) -> anyhow::Result<f64> {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("ns_per_pair "))
        .and_then(|r| r.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no ns_per_pair in:\n{stdout}"))
}

fn traced(built: &Built, out: &Path, pairs: u64, stacks: &[&str]) -> anyhow::Result<(f64, String)> {
    let _ = std::fs::remove_dir_all(out);
    let (stdout, stderr) = run_capture(
        privileged(built.binary.to_str().expect("utf-8 path"))
            .args(["trace", "--quiet", "--output"])
            .arg(out)
            .arg("--lib")
            .arg(&built.libascendcl)
            .args(stacks)
            .arg("--")
            .arg(&built.alloc_bench)
            .arg(pairs.to_string()),
    )?;
    let lost = stderr.lines().find(|l| l.contains("calls recorded")).unwrap_or("").trim_start_matches("memscope-bpf: ");
    Ok((ns(&stdout)?, lost.to_owned()))
}

/// The bench's 8 probes; with `ustack`, a 50-frame user stack counted per outermost call.
fn bpftrace_script(lib: &Path, ustack: bool) -> String {
    let (l, h) = (lib.display(), lib.with_file_name("libascend_hal.so"));
    let h = h.display();
    let (st, clear_st) = if ustack { ("@st[ustack(50)] = count();", "clear(@st);") } else { ("", "") };
    format!(
        "uprobe:{l}:aclrtMallocImpl {{ @p[tid] = arg0; {st} }} \
         uretprobe:{l}:aclrtMallocImpl /@p[tid]/ {{ @live[*(uint64 *)uptr(@p[tid])] = 1; delete(@p[tid]); }} \
         uprobe:{l}:aclrtFreeImpl {{ @f[tid] = arg0; {st} }} \
         uretprobe:{l}:aclrtFreeImpl /@f[tid]/ {{ delete(@live[@f[tid]]); delete(@f[tid]); }} \
         uprobe:{h}:halMemAllocInner {{ @hp[tid] = arg0; }} \
         uretprobe:{h}:halMemAllocInner /@hp[tid]/ {{ @hlive[*(uint64 *)uptr(@hp[tid])] = 1; delete(@hp[tid]); }} \
         uprobe:{h}:halMemFreeInner {{ @hf[tid] = arg0; }} \
         uretprobe:{h}:halMemFreeInner /@hf[tid]/ {{ delete(@hlive[@hf[tid]]); delete(@hf[tid]); }} \
         END {{ clear(@live); clear(@p); clear(@f); clear(@hlive); clear(@hp); clear(@hf); {clear_st} }}"
    )
}

fn bpftrace(built: &Built, pairs: u64, ustack: bool) -> anyhow::Result<f64> {
    let (stdout, _) = run_capture(
        privileged("bpftrace")
            .arg("-e")
            .arg(bpftrace_script(&built.libascendcl, ustack))
            .arg("-c")
            .arg(format!("{} {pairs}", built.alloc_bench.display())),
    )?;
    ns(&stdout)
}

/// pyenv's newest CPython 3.12, for the Python-stack rounds.
fn python312() -> Option<std::path::PathBuf> {
    let mut found: Vec<_> = std::fs::read_dir("/root/.pyenv/versions")
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path().join("bin/python3.12")))
        .filter(|p| p.is_file())
        .collect();
    found.sort();
    found.pop()
}

fn py_run(built: &Built, python: &Path, out: &Path, pairs: u64, stacks: Option<&[&str]>) -> anyhow::Result<f64> {
    let script = crate::util::root().join("tests/bench/py_alloc_bench.py");
    let mut cmd = match stacks {
        None => Command::new(python),
        Some(stacks) => {
            let _ = std::fs::remove_dir_all(out);
            let mut c = privileged(built.binary.to_str().expect("utf-8 path"));
            c.args(["trace", "--quiet", "--output"])
                .arg(out)
                .arg("--lib")
                .arg(&built.libascendcl)
                .args(stacks)
                .arg("--")
                .arg(python);
            c.env("BENCH_WAIT", "1");
            c
        }
    };
    cmd.env("ASCEND_HOME_PATH", &built.ascend_home).arg(script).arg(pairs.to_string());
    ns(&run_capture(&mut cmd)?.0)
}

/// The Python-stack rounds and their table.
pub fn python_rounds(built: &Built, dir: &Path, pairs: u64, rounds: usize) -> anyhow::Result<String> {
    let Some(python) = python312() else {
        return Ok("
No pyenv CPython 3.12 here (`cargo xtask setup` installs it): no Python-stack figures.
"
        .into());
    };
    let configs: [(&str, Option<&[&str]>); 5] = [
        ("untraced", None),
        ("memscope-bpf --no-infer (no Python walk)", Some(&["--no-infer"])),
        ("memscope-bpf, default (a Python walk per call: owners, steps, sites)", Some(&[])),
        ("memscope-bpf --call-stack python", Some(&["--call-stack", "python"])),
        ("memscope-bpf --call-stack c,python", Some(&["--call-stack", "c,python"])),
    ];
    let have_bpftrace = output(Command::new("bpftrace").arg("--version")).is_some();
    let mut runs: Vec<Vec<f64>> = vec![Vec::new(); configs.len() + 1];
    for round in 1..=rounds {
        eprintln!("xtask bench: Python stacks, round {round}/{rounds}");
        for (i, (_, stacks)) in configs.iter().enumerate() {
            runs[i].push(py_run(built, &python, &dir.join("out-pystacks"), pairs, *stacks)?);
        }
        if have_bpftrace {
            runs[configs.len()].push(py_bpftrace(built, &python, pairs)?);
        }
    }
    let med: Vec<f64> = runs.iter().map(|r| if r.is_empty() { f64::NAN } else { median(r.clone()) }).collect();
    let mut md = format!(
        "\nPython stacks: the same pairs from Python ({}), {pairs} per run, median of {rounds}, interleaved.\n\n\
         | configuration | ns per pair (median) | added by the stacks | runs |\n|---|---|---|---|\n",
        python.display()
    );
    let names = configs.iter().map(|(n, _)| *n).chain(["bpftrace, same 8 probes (its floor: no stacks)"]);
    for (i, name) in names.enumerate() {
        if runs[i].is_empty() {
            continue;
        }
        let added = if (2..configs.len()).contains(&i) { format!("{:.0}", med[i] - med[1]) } else { "–".into() };
        let r = runs[i].iter().map(|x| format!("{x:.0}")).collect::<Vec<_>>().join(", ");
        md.push_str(&format!("| {name} | {:.0} | {added} | {r} |\n", med[i]));
    }
    md.push_str(
        "\nThe default's walk serves the owner rules, steps and sites (docs/owners.md): its added cost per \
         aclrtMalloc+aclrtFree pair is the row's; pool frees (torch's allocators) skip it unless `--call-stack python`.\n",
    );
    Ok(md)
}

/// bpftrace's floor for the Python rounds: the same 8 probes, no stacks, on the same script.
fn py_bpftrace(built: &Built, python: &Path, pairs: u64) -> anyhow::Result<f64> {
    let script = crate::util::root().join("tests/bench/py_alloc_bench.py");
    let (stdout, _) = run_capture(
        privileged("bpftrace")
            .env("ASCEND_HOME_PATH", &built.ascend_home)
            .arg("-e")
            .arg(bpftrace_script(&built.libascendcl, false))
            .arg("-c")
            .arg(format!("{} {} {pairs}", python.display(), script.display())),
    )?;
    ns(&stdout)
}

pub fn run(built: &Built, dir: &Path, pairs: u64, rounds: usize) -> anyhow::Result<String> {
    let have_bpftrace = output(Command::new("bpftrace").arg("--version")).is_some();
    let names = [
        "untraced",
        "memscope-bpf, no stacks",
        "memscope-bpf --call-stack c (frame pointers)",
        "memscope-bpf --call-stack c --unwind dwarf (8 KiB window)",
        "bpftrace, same 8 probes",
        "bpftrace, same 8 probes + ustack(50) at the 2 outermost entries",
    ];
    let mut runs: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
    let mut losses = Vec::new();
    for round in 1..=rounds {
        eprintln!("xtask bench: stacks, round {round}/{rounds}");
        let (out, n) = (dir.join("out-stacks"), pairs.to_string());
        runs[0].push(ns(&run_capture(Command::new(&built.alloc_bench).arg(&n))?.0)?);
        for (i, stacks) in
            [&[][..], &["--call-stack", "c"], &["--call-stack", "c", "--unwind", "dwarf"]].iter().enumerate()
        {
            let (v, lost) = traced(built, &out, pairs, stacks)?;
            runs[1 + i].push(v);
            losses.push(format!("{}: {lost}", names[1 + i]));
        }
        if have_bpftrace {
            runs[4].push(bpftrace(built, pairs, false)?);
            runs[5].push(bpftrace(built, pairs, true)?);
        }
    }
    let med: Vec<f64> = runs.iter().map(|r| if r.is_empty() { f64::NAN } else { median(r.clone()) }).collect();
    let mut md = format!(
        "\n## Native stacks per pair\n\nCommand: `cargo xtask bench --stacks-only --pairs {pairs} --rounds {rounds}`. \
         Median of {rounds} runs, interleaved; each run times {pairs} aclrtMalloc+aclrtFree pairs inside the process.\n\n\
         | configuration | ns per pair (median) | added by the stacks | runs |\n|---|---|---|---|\n"
    );
    for (i, name) in names.iter().enumerate() {
        if runs[i].is_empty() {
            continue;
        }
        let base = match i {
            2 | 3 => med[1],
            5 => med[4],
            _ => f64::NAN,
        };
        let added = if base.is_nan() { "–".to_owned() } else { format!("{:.0}", med[i] - base) };
        let r = runs[i].iter().map(|x| format!("{x:.0}")).collect::<Vec<_>>().join(", ");
        md.push_str(&format!("| {name} | {:.0} | {added} | {r} |\n", med[i]));
    }
    if have_bpftrace {
        md.push_str(&format!(
            "\nFrame-pointer stacks, added cost: memscope-bpf {:.0} ns against bpftrace's ustack {:.0} ns per pair: {:.3}x \
             (target: at most 1.10x).\n",
            med[2] - med[1],
            med[5] - med[4],
            (med[2] - med[1]) / (med[5] - med[4])
        ));
    } else {
        md.push_str("\nbpftrace is not installed (`cargo xtask setup` installs it): no peer comparison.\n");
    }
    md.push_str(&format!("\nPer run: {}\n", losses.join("; ")));
    md.push_str(&python_rounds(built, dir, pairs / 4, rounds)?);
    Ok(md)
}

/// The consumer with native stacks, on one core: `bench-consumer` replays the allocation loop's
/// records with a stack record before each outermost call, drawn round-robin from a number of
/// distinct stacks (each new one normalized and symbolized from a real file), against no stacks.
pub fn consumer(built: &Built, dir: &Path, pairs: u64) -> anyhow::Result<String> {
    let mut md = format!(
        "\nConsumer with native stacks on one core (`taskset -c 0 memscope-bpf bench-consumer --pairs {pairs} \
         --stacks N`: 4 call records per pair, plus 2 stack records of 24 frames with stacks; decode, \
         dedup, normalize and symbolize each new stack, rows and SQLite, all threads on CPU 0):\n\n\
         | distinct stacks | records/s (wall, one core) | records per CPU-second | rows/s (wall) |\n|---|---|---|---|\n"
    );
    for stacks in [0, 100, 10_000] {
        eprintln!("xtask bench: consumer on one core, {stacks} distinct stacks");
        let (wall, cpu) =
            super::consumer::one_core_with_stacks(&built.binary, &dir.join("replay-stacks"), pairs, stacks)?;
        // A pair is 2 rows: its MALLOC and its FREE.
        let records_per_pair = if stacks == 0 { 4.0 } else { 6.0 };
        md.push_str(&format!(
            "| {} | {wall:.0} | {cpu:.0} | {:.0} |\n",
            if stacks == 0 { "none".to_owned() } else { stacks.to_string() },
            wall / records_per_pair * 2.0
        ));
    }
    Ok(md)
}

/// Sustained load with native stacks: 500 k traced calls/s (125 k pairs/s on two threads) for
/// `seconds`, without stacks at the default 32 MiB ring, then without and with `--call-stack c`
/// at a 256 MiB ring (a 60 s run at this rate overflows 32 MiB now and then even without
/// stacks: the traced threads, the consumer and the store share the two CPUs).
pub fn sustained(built: &Built, dir: &Path, seconds: u64) -> anyhow::Result<String> {
    let mut md = String::from(
        "\nSustained load (2 threads, 125,000 pairs/s = 500,000 traced calls/s asked for; \
         \"pinned\": the tracer on CPU 0, the two threads on CPU 1):\n\n\
         | configuration | seconds | calls/s offered | calls recorded | lost |\n|---|---|---|---|---|\n",
    );
    let stacks: &[&str] = &["--call-stack", "c", "--ring-mb", "256"];
    let runs: [(&str, &[&str], bool); 4] = [
        ("no stacks, 32 MiB ring", &[], false),
        ("no stacks, `--ring-mb 256`", &["--ring-mb", "256"], false),
        ("`--call-stack c --ring-mb 256`", stacks, false),
        ("`--call-stack c --ring-mb 256`, pinned", stacks, true),
    ];
    for run in runs {
        md.push_str(&super::loss::sustained(built, dir, (seconds, 125_000), run)?);
    }
    Ok(md)
}
