//! The cases: which verb, options and inputs, derived from what `inputs/` holds (so `record`
//! and `check` list the same ones), and running one into its text.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context as _;

use super::dump::{self, Window};
use super::inputs::{copy_db, copy_tree, dump_dbs, run_folders};

/// An argument: literal, or the working copy of the case's N-th input.
enum Arg {
    Lit(String),
    Input(usize),
}

pub struct Case {
    /// The case file's path under expected/ and actual/.
    pub name: String,
    args: Vec<Arg>,
    /// DBs or run folders, relative to inputs/.
    inputs: Vec<PathBuf>,
    /// Whether the run may write: then what it left in each DB is part of the result.
    dump: bool,
}

const ANALYSES: [&str; 4] = ["decompose", "inefficient", "leaks", "oom"];

/// Options beyond the defaults, one variant per analysis, so the paths behind them are covered.
const VARIANTS: [(&str, &[&str]); 4] = [
    ("decompose-at-depth", &["--analysis", "decompose", "--at", "peak,end,+1ms", "--depth", "2"]),
    (
        "inefficient-insight-flags",
        &[
            "--analysis",
            "inefficient",
            "--json",
            "--idle-threshold",
            "10",
            "--lazy-used",
            "1ms,20%",
            "--delayed-free",
            "1ms,20%",
            "--long-idle",
            "1ms,20%",
        ],
    ),
    ("leaks-no-warmup", &["--analysis", "leaks", "--json", "--warmup-steps", "0", "--min-steps", "2"]),
    ("oom-top-3", &["--analysis", "oom:3", "--json"]),
];

fn lits(args: &[&str]) -> Vec<Arg> {
    args.iter().map(|a| Arg::Lit((*a).to_owned())).collect()
}

fn case(input: &Path, what: &str, verb: &[&str], dump: bool) -> Case {
    let mut args = lits(verb);
    args.push(Arg::Input(0));
    Case { name: format!("{}/{what}.txt", input.display()), args, inputs: vec![input.to_owned()], dump }
}

/// Every case, in a fixed order.
pub fn all(inputs: &Path) -> anyhow::Result<Vec<Case>> {
    let rel = |p: PathBuf| p.strip_prefix(inputs).expect("found under inputs").to_owned();
    let dbs: Vec<PathBuf> = dump_dbs(inputs)?.into_iter().map(rel).collect();
    let mut cases = Vec::new();
    for db in &dbs {
        for a in ANALYSES {
            cases.push(case(db, &format!("analyze-{a}"), &["analyze", "--analysis", a], true));
            cases.push(case(db, &format!("analyze-{a}-json"), &["analyze", "--analysis", a, "--json"], true));
        }
        for (what, args) in VARIANTS {
            let mut verb = vec!["analyze"];
            verb.extend_from_slice(args);
            cases.push(case(db, &format!("analyze-{what}"), &verb, true));
        }
        cases.push(case(
            db,
            "analyze-all-no-write-json",
            &["analyze", "--analysis", "decompose,inefficient,leaks,oom", "--no-write", "--json"],
            true,
        ));
        cases.push(case(db, "advise", &["advise"], true));
        cases.push(case(db, "advise-json", &["advise", "--json"], true));
    }
    let runs: Vec<PathBuf> = run_folders(inputs)?.into_iter().map(rel).collect();
    for run in &runs {
        if dump_dbs(&inputs.join(run))?.len() > 1 {
            let all = ["analyze", "--analysis", "decompose,inefficient,leaks,oom"];
            cases.push(case(run, "folder-analyze-all", &all, true));
            cases.push(case(run, "folder-analyze-all-json", &[&all[..], &["--json"]].concat(), true));
            cases.push(case(run, "folder-advise", &["advise"], true));
        }
    }
    for (a, b) in pairs(&dbs, &runs) {
        cases.extend(compare_cases(&a, &b));
    }
    Ok(cases)
}

/// The pairs compared: the first two run folders of each test (or of the demo), the demo's DB
/// with its shuffled copy, and the two msMemScope-style DBs.
fn pairs(dbs: &[PathBuf], runs: &[PathBuf]) -> Vec<(PathBuf, PathBuf)> {
    let group = |run: &Path| -> PathBuf { run.parent().unwrap_or(run).components().take(2).collect() };
    let mut pairs = Vec::new();
    for (i, run) in runs.iter().enumerate() {
        let first_of_group = i == 0 || group(&runs[i - 1]) != group(run);
        if let Some(next) = runs.get(i + 1).filter(|n| first_of_group && group(n) == group(run)) {
            pairs.push((run.clone(), next.clone()));
        }
    }
    for shuffled in dbs.iter().filter(|d| d.starts_with("shuffled")) {
        let original = Path::new("demo").join(shuffled.strip_prefix("shuffled").expect("starts with it"));
        pairs.push((original, shuffled.clone()));
    }
    let ms: Vec<&PathBuf> =
        dbs.iter().filter(|d| d.starts_with("msmemscope") || d.starts_with("msmemscope-legacy")).collect();
    if let [a, b] = ms[..] {
        pairs.push((a.clone(), b.clone()));
    }
    pairs
}

fn compare_cases(a: &Path, b: &Path) -> Vec<Case> {
    let dir =
        format!("compare/{}~{}", a.display().to_string().replace('/', "~"), b.display().to_string().replace('/', "~"));
    let views: [(&str, &[&str]); 6] = [
        ("steps", &[]),
        ("steps-json", &["--json"]),
        ("op", &["--level", "op", "--rows", "0"]),
        ("op-json", &["--level", "op", "--json"]),
        ("kernel", &["--level", "kernel", "--rows", "0"]),
        ("kernel-json", &["--level", "kernel", "--json"]),
    ];
    views
        .iter()
        .map(|(what, extra)| {
            let mut args = lits(&["compare"]);
            args.extend([Arg::Input(0), Arg::Input(1)]);
            args.extend(lits(extra));
            Case { name: format!("{dir}/{what}.txt"), args, inputs: vec![a.to_owned(), b.to_owned()], dump: true }
        })
        .collect()
}

fn now_ns() -> u64 {
    let d = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Runs one case on fresh copies of its inputs; returns its text.
pub fn run(bin: &Path, corpus: &Path, case: &Case) -> anyhow::Result<String> {
    let work = corpus.join("work");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).with_context(|| format!("cannot create {}", work.display()))?;
    let copies: Vec<PathBuf> =
        case.inputs.iter().enumerate().map(|(i, rel)| work.join(i.to_string()).join(rel)).collect();
    for (rel, copy) in case.inputs.iter().zip(&copies) {
        let from = corpus.join("inputs").join(rel);
        if from.is_dir() {
            copy_tree(&from, copy)?;
        } else {
            copy_db(&from, copy)?;
        }
    }
    let args: Vec<String> = case
        .args
        .iter()
        .map(|a| match a {
            Arg::Lit(s) => s.clone(),
            Arg::Input(i) => copies[*i].to_string_lossy().into_owned(),
        })
        .collect();
    let start_ns = now_ns();
    let (status, stdout, stderr) = run_binary(bin, &args, &work)?;
    let window = Window { start_ns, end_ns: now_ns() };
    let mut text =
        format!("$ memscope-bpf {}\nexit status: {status}\n--- stdout\n{stdout}--- stderr\n{stderr}", args.join(" "));
    if case.dump {
        for (rel, copy) in case.inputs.iter().zip(&copies) {
            let from = corpus.join("inputs").join(rel);
            let dbs = if copy.is_dir() { dump_dbs(copy)? } else { vec![copy.clone()] };
            for db in dbs {
                let sub = db.strip_prefix(copy).expect("found under it");
                let before = if sub.as_os_str().is_empty() { from.clone() } else { from.join(sub) };
                let named = if sub.as_os_str().is_empty() { rel.clone() } else { rel.join(sub) };
                text.push_str(&format!("--- db {}\n", named.display()));
                text.push_str(&dump::dump(&db, &before, window)?);
            }
        }
    }
    Ok(normalise(&text, &work))
}

/// A case still running after this long is killed and reported so (an endless loop brought in
/// by a change must not hang the check); the slowest case today takes a few seconds.
const CASE_LIMIT: Duration = Duration::from_secs(300);

/// Runs the binary with its output into files under `work` (no pipe to fill while we wait);
/// returns its exit status as written into the case file, stdout and stderr.
fn run_binary(bin: &Path, args: &[String], work: &Path) -> anyhow::Result<(String, String, String)> {
    let (out_path, err_path) = (work.join("stdout"), work.join("stderr"));
    let mut child = Command::new(bin)
        .args(args)
        // A panic's report would otherwise depend on the caller's environment.
        .env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LIB_BACKTRACE")
        .stdin(Stdio::null())
        .stdout(File::create(&out_path)?)
        .stderr(File::create(&err_path)?)
        .spawn()
        .with_context(|| format!("cannot run {}", bin.display()))?;
    let started = Instant::now();
    let mut pause = Duration::from_millis(1);
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break format!("{:?}", status.code());
        }
        if started.elapsed() > CASE_LIMIT {
            child.kill()?;
            child.wait()?;
            break format!("killed after {} s", CASE_LIMIT.as_secs());
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(20));
    };
    let read = |p: &Path| String::from_utf8_lossy(&std::fs::read(p).unwrap_or_default()).into_owned();
    Ok((status, read(&out_path), read(&err_path)))
}

/// The working copies' folder is under the corpus folder, which is wherever the user put it:
/// paths in reports and messages name it, so it becomes `<WORK>`. Nothing else is rewritten.
fn normalise(text: &str, work: &Path) -> String {
    text.replace(&format!("{}/", work.display()), "<WORK>/")
}
