//! `cargo xtask same-results record|check --corpus DIR`: proof that a change (issue 11's
//! refactor) leaves every analysis' results as they were. `record` gathers input DBs into
//! `DIR/inputs/` and writes what the binary makes of them into `DIR/expected/`, one text file per
//! case (stdout, stderr, exit status, and what the run left in the DB); `check` reruns the same
//! cases with another binary into `DIR/actual/` and compares, file by file.
//!
//! Each case runs on a fresh copy of its inputs under `DIR/work/`, so the analyses write their
//! tables as a user's run would and the inputs stay as recorded.

mod cases;
mod dump;
mod inputs;
mod msmemscope;

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context as _};

use crate::util::root;
use cases::Case;

#[derive(clap::Args)]
pub struct Options {
    #[command(subcommand)]
    mode: Mode,
}

#[derive(clap::Subcommand)]
enum Mode {
    /// Gather the input DBs into DIR/inputs/ and write the results of every case into DIR/expected/.
    Record {
        #[command(flatten)]
        common: Common,
        /// Where the demo's run folders are; `cargo xtask demo` runs first when it holds no DB.
        #[arg(long, default_value = "target/demo")]
        demo: PathBuf,
        /// Run `cargo xtask demo` even when the demo's DBs are there.
        #[arg(long)]
        run_demo: bool,
        /// The DBs the privileged test tier left (copied when present).
        #[arg(long, default_value = "target/privileged-tests")]
        privileged: PathBuf,
    },
    /// Rerun every recorded case into DIR/actual/ and compare with DIR/expected/ (exit 1 on a difference).
    Check {
        #[command(flatten)]
        common: Common,
    },
}

#[derive(clap::Args)]
struct Common {
    /// The corpus folder (inputs/, expected/, actual/, work/).
    #[arg(long)]
    corpus: PathBuf,
    /// The binary whose results are recorded or checked.
    #[arg(long, default_value = "target/release/memscope-bpf")]
    bin: PathBuf,
}

pub fn run(opts: &Options) -> anyhow::Result<()> {
    match &opts.mode {
        Mode::Record { common, demo, run_demo, privileged } => {
            let (corpus, bin) = common.resolve()?;
            let started = Instant::now();
            let sources =
                inputs::Sources { demo: absolute(demo), run_demo: *run_demo, privileged: absolute(privileged) };
            for line in inputs::gather(&corpus.join("inputs"), &sources)? {
                eprintln!("xtask same-results: {line}");
            }
            let cases = cases::all(&corpus.join("inputs"))?;
            let expected = corpus.join("expected");
            let _ = std::fs::remove_dir_all(&expected);
            for case in &cases {
                write(&expected.join(&case.name), &cases::run(&bin, &corpus, case)?)?;
            }
            let _ = std::fs::remove_dir_all(corpus.join("work"));
            eprintln!(
                "xtask same-results: recorded {} cases into {} in {:.1} s",
                cases.len(),
                expected.display(),
                started.elapsed().as_secs_f64()
            );
            Ok(())
        }
        Mode::Check { common } => check(common),
    }
}

impl Common {
    fn resolve(&self) -> anyhow::Result<(PathBuf, PathBuf)> {
        let bin = absolute(&self.bin);
        if !bin.is_file() {
            bail!("no binary at {} (build it, or give --bin)", bin.display());
        }
        std::fs::create_dir_all(&self.corpus).with_context(|| format!("cannot create {}", self.corpus.display()))?;
        Ok((absolute(&self.corpus).canonicalize()?, bin))
    }
}

/// Relative paths are the workspace's, as for every xtask command.
fn absolute(p: &Path) -> PathBuf {
    if p.is_absolute() {
        p.to_owned()
    } else {
        root().join(p)
    }
}

fn write(path: &Path, text: &str) -> anyhow::Result<()> {
    std::fs::create_dir_all(path.parent().expect("a case file has a folder"))?;
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
}

fn check(common: &Common) -> anyhow::Result<()> {
    let (corpus, bin) = common.resolve()?;
    let started = Instant::now();
    let expected_dir = corpus.join("expected");
    if !expected_dir.is_dir() {
        bail!("{} has no expected/: record it first (cargo xtask same-results record)", corpus.display());
    }
    let cases = cases::all(&corpus.join("inputs"))?;
    let actual_dir = corpus.join("actual");
    let _ = std::fs::remove_dir_all(&actual_dir);
    let mut differing = 0;
    for case in &cases {
        let actual = cases::run(&bin, &corpus, case)?;
        write(&actual_dir.join(&case.name), &actual)?;
        let expected = std::fs::read_to_string(expected_dir.join(&case.name));
        let report = match &expected {
            Ok(expected) if *expected == actual => continue,
            Ok(expected) => first_difference(expected, &actual),
            Err(_) => "  no expected file: the case is new (record again?)\n".to_owned(),
        };
        differing += 1;
        println!("DIFFERS: {}\n{report}", case.name);
    }
    let known: Vec<&str> = cases.iter().map(|c: &Case| c.name.as_str()).collect();
    for gone in recorded_cases(&expected_dir)? {
        if !known.contains(&gone.as_str()) {
            differing += 1;
            println!("DIFFERS: {gone}\n  recorded, but no such case any more\n");
        }
    }
    let _ = std::fs::remove_dir_all(corpus.join("work"));
    let secs = started.elapsed().as_secs_f64();
    if differing > 0 {
        println!(
            "xtask same-results: {differing} of {} cases differ ({secs:.1} s); `diff -r {} {}` shows all",
            cases.len(),
            expected_dir.display(),
            actual_dir.display()
        );
        std::process::exit(1);
    }
    println!("xtask same-results: all {} cases identical to {} ({secs:.1} s)", cases.len(), expected_dir.display());
    Ok(())
}

/// Every case file under `expected/`, as case names.
fn recorded_cases(dir: &Path) -> anyhow::Result<Vec<String>> {
    let mut names = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d)? {
            let p = entry?.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                names.push(p.strip_prefix(dir).expect("under it").to_string_lossy().into_owned());
            }
        }
    }
    names.sort();
    Ok(names)
}

/// The first few lines that differ, by line number, from each side (long lines cut).
fn first_difference(expected: &str, actual: &str) -> String {
    let (e, a): (Vec<&str>, Vec<&str>) = (expected.lines().collect(), actual.lines().collect());
    let cut = |line: Option<&&str>| match line {
        None => "(no such line)".to_owned(),
        Some(l) if l.chars().count() > 240 => format!("{}...", l.chars().take(240).collect::<String>()),
        Some(l) => (*l).to_owned(),
    };
    let differ: Vec<usize> = (0..e.len().max(a.len())).filter(|&i| e.get(i) != a.get(i)).collect();
    let mut out = format!("  {} lines differ ({} expected, {} now); the first:\n", differ.len(), e.len(), a.len());
    for &i in differ.iter().take(5) {
        out.push_str(&format!("  line {}\n    - {}\n    + {}\n", i + 1, cut(e.get(i)), cut(a.get(i))));
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_first_differences_are_named_by_line() {
        let report = super::first_difference("a\nb\nc\n", "a\nB\nc\nd\n");
        assert!(report.starts_with("  2 lines differ (3 expected, 4 now)"), "{report}");
        assert!(report.contains("  line 2\n    - b\n    + B\n"), "{report}");
        assert!(report.contains("  line 4\n    - (no such line)\n    + d\n"), "{report}");
    }
}
