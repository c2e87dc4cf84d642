//! `memscope-bpf compare A B`: two traces of the same program (before and after a change, a clean
//! and a leaking run), step by step: the live bytes per family and per owner at the end of each
//! step both traces have, and at their ends, with B − A; then what grew in B.
//!
//! msMemScope's compare diffs kernel or op sequences (reference §4.3), which need op events; the
//! step view needs only allocations and step markers, and answers the usual question ("which
//! owner holds more, and from which step on?") directly. `--level op|kernel` gives msMemScope's
//! view as well (`analysis::calls`, `analysis::calldiff`): which calls one run made and the other
//! did not, and which allocated differently. Devices are paired by their `device_<id>` folder;
//! two DB files are compared as given.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{bail, Context as _};
use memscope_core::analysis::blocks::Family;
use memscope_core::analysis::calldiff;
use memscope_core::analysis::calls::{self, Calls, Level};
use memscope_core::analysis::compare::{self, At, OwnerDiff, Point};
use memscope_core::analysis::db::{self, DbFile};
use memscope_core::analysis::steps::{StepDb, Timeline};
use memscope_core::analysis::AnalysisError;
use memscope_core::printable::printable;
use memscope_core::units::{human_bytes, signed_bytes as signed};
use serde::Serialize;

use super::inputs;
use crate::terminal::say::say;

/// Compare two traces: what grew from A to B, per step and per owner, or (--level) which ops or kernels differ; or a job's ranks.
///
/// The live bytes per family and per owner at the end of each step in A and in B, the
/// difference, and the owners that grew (or shrank) in B.
///
///   memscope-bpf compare msout/clean_run/ msout/leaky_run/
///   memscope-bpf compare a/device_0/dump/memscope_dump_1.db b/device_0/dump/memscope_dump_2.db --json
///
/// Steps come from memscope.step() or mstx `step start` ranges (or --step-marker), numbered as in
/// `analyze --analysis leaks`; steps only one trace has are listed, not compared. The ends of the
/// traces are always compared, so traces without steps can be compared too. Nothing is written.
///
/// With a distributed job's traces, one per rank (more than two, a daemon's output folder, the
/// nodes' folders, or --ranks), it compares the ranks instead: per rank its peak and the owners
/// then, its growth per step, a rank × step table, and the ranks that stand out with why (a
/// higher peak by which owners, a leak only there), each job (its job_id) apart.
///
///   memscope-bpf compare node1/msout node2/msout
///   memscope-bpf compare /var/lib/memscope --json
///
/// --level op|kernel compares the call sequences instead, as msMemScope's compare does: the
/// operators (OP_LAUNCH rows, from memscope.torch.trace_ops()) or the kernel launches
/// (KERNEL_LAUNCH rows) of A and B, aligned by a shortest edit script (Myers' diff on their
/// names), each call with its memory delta: the size of the next caching-pool (PTA) event after
/// it, + for an allocation, - for a free. It lists the calls only A or only B made, the matched
/// calls whose deltas differ (largest first) and the totals.
///
///   memscope-bpf compare msout/run_a/ msout/run_b/ --level op
///   memscope-bpf compare msout/run_a/ msout/run_b/ --level kernel --device 0 --rows 0
#[derive(Debug, clap::Args)]
#[command(verbatim_doc_comment)]
pub struct Args {
    /// The baseline: a trace DB (memscope_dump_*.db) or CSV, or a trace output folder;
    /// msMemScope's own captures too: its CSV (read through a temporary DB) or DB, and its folders (msmemscope_<pid>_<time>_ascend/, memscopeDumpResults/, leaksDumpResults/).
    #[arg(value_name = "A")]
    pub a: PathBuf,

    /// The trace compared with it, likewise. Left out: A is a folder of a job's traces, one
    /// per rank (see --ranks).
    #[arg(value_name = "B")]
    pub b: Option<PathBuf>,

    /// More traces: with them, every trace given is a rank of a distributed job (see --ranks).
    #[arg(value_name = "MORE")]
    pub more: Vec<PathBuf>,

    /// Compare the traces as the ranks of distributed jobs rather than A against B: per rank
    /// its peak and the owners then, its growth per step and its live bytes at each step's end;
    /// the ranks that stand out, with why. Ranks are grouped into jobs by the job id each trace
    /// recorded (torchrun's, the rendezvous address, HCCL's rank table). The default with more
    /// than two traces, or with folders holding several traces of one device (a daemon's
    /// output folder, one per node).
    #[arg(long, conflicts_with = "level")]
    pub ranks: bool,

    /// Only this device: 0, 1, ..., cpu, unknown.
    #[arg(long, value_name = "D")]
    pub device: Option<String>,

    /// Take step boundaries from MSTX marks (or ranges) with this message instead of
    /// memscope.step() / mstx `step start` ranges; each mark starts the next step.
    #[arg(long, value_name = "NAME", conflicts_with = "level")]
    pub step_marker: Option<String>,

    /// Compare call sequences instead of steps: op (operators: OP_LAUNCH ends, ATEN_END and
    /// ATB_END, named by their starts) or kernel (KERNEL_LAUNCH rows). Default: the step view.
    #[arg(long, value_enum, value_name = "LEVEL")]
    pub level: Option<Level>,

    /// Owners listed under "what grew" and "what shrank"; with --level, the matched calls whose
    /// memory deltas differ most.
    #[arg(long, value_name = "N", default_value_t = 10)]
    pub top: usize,

    /// With --level: lines of the edit script printed per device (0: all). Runs of the same call
    /// with the same deltas are one line, and long stretches of matched calls with equal deltas
    /// are folded into one.
    #[arg(long, value_name = "N", default_value_t = 200, requires = "level")]
    pub rows: usize,

    /// Print JSON: an array, one element per device pair, {device, a, b, steps: [{step, ts_a,
    /// ts_b, families: [{family, a, b, diff}], owners: [{family, owner, a, b, diff}]}], grew,
    /// shrank, only_in_a, only_in_b}; the last element of steps is the traces' ends (step "end").
    /// With --level: {device, level, a, b: {db, calls, unpaired_ends, unattributed_events},
    /// summary: {calls_a, calls_b, matched, only_a, only_b, delta_a, delta_b, only_a_delta,
    /// only_b_delta, matched_delta_differs}, largest_delta_diffs, rows}; each row is a run of
    /// identical edits {kind: same|only_a|only_b, a, b (1-based positions of its first call, null
    /// on the side without it), name, delta_a, delta_b, count}, every call in order.
    #[arg(long)]
    pub json: bool,
}

/// One trace of a pair: its instants ([`compare::Side`]) and what the text says of it.
struct Run {
    path: PathBuf,
    side: compare::Side,
    families: Vec<Family>,
    sources: String,
}

fn run_of(file: &DbFile, marker: Option<&str>) -> anyhow::Result<Run> {
    let (dump, _) = inputs::open(file, "compare", inputs::Store::Never)?;
    let db = StepDb::new(&dump)?;
    let timeline = Timeline::replay(&db, marker, &mut ())?;
    let summary = timeline.summary();
    let sources: Vec<String> = summary.sources.iter().map(|(s, n)| format!("{n} from {}", s.describe())).collect();
    Ok(Run {
        path: dump.path().to_owned(),
        side: compare::Side::of(&timeline),
        families: summary.families,
        sources: if sources.is_empty() { "no steps".into() } else { sources.join(", ") },
    })
}

#[derive(Debug, Serialize)]
struct FamilyDiff {
    family: &'static str,
    a: i64,
    b: i64,
    diff: i64,
}

#[derive(Debug, Serialize)]
struct StepDiff {
    /// A step number, or "end".
    step: serde_json::Value,
    ts_a: i64,
    ts_b: i64,
    families: Vec<FamilyDiff>,
    owners: Vec<OwnerDiff>,
}

#[derive(Debug, Serialize)]
struct Growth {
    family: &'static str,
    owner: String,
    a: i64,
    b: i64,
    diff: i64,
    /// Change over the compared steps (first to last common step) within each trace.
    growth_a: i64,
    growth_b: i64,
}

#[derive(Debug, Serialize)]
struct SideJson {
    db: String,
    steps: usize,
    step_sources: String,
}

#[derive(Debug, Serialize)]
struct PairDiff {
    device: String,
    a: SideJson,
    b: SideJson,
    steps: Vec<StepDiff>,
    /// Where "grew" and "shrank" are measured: the last common step, else "end".
    at: serde_json::Value,
    grew: Vec<Growth>,
    shrank: Vec<Growth>,
    only_in_a: Vec<u64>,
    only_in_b: Vec<u64>,
}

fn diff_at(step: serde_json::Value, a: &Point, b: &Point, families: &[Family]) -> StepDiff {
    let fams = families
        .iter()
        .map(|&f| {
            let (x, y) = (a.totals[f as usize], b.totals[f as usize]);
            FamilyDiff { family: f.as_str(), a: x, b: y, diff: y - x }
        })
        .collect();
    StepDiff { step, ts_a: a.ts, ts_b: b.ts, families: fams, owners: compare::owner_diffs(a, b) }
}

fn compare(device: &str, a: &Run, b: &Run, top: usize) -> PairDiff {
    let mut families: Vec<Family> = a.families.iter().chain(&b.families).copied().collect();
    families.sort();
    families.dedup();
    let common = compare::common_steps(&a.side, &b.side);
    let mut steps: Vec<StepDiff> =
        common.iter().map(|s| diff_at((*s).into(), &a.side.steps[s], &b.side.steps[s], &families)).collect();
    if let (Some(ea), Some(eb)) = (&a.side.end, &b.side.end) {
        steps.push(diff_at("end".into(), ea, eb, &families));
    }
    let at_index = compare::judged_at(&a.side, &b.side).map(|at| match at {
        At::Step(_) => common.len() - 1,
        At::End => steps.len() - 1,
    });
    let (mut grew, mut shrank) = (Vec::new(), Vec::new());
    if let Some(i) = at_index {
        let first = common.first().map(|s| (&a.side.steps[s], &b.side.steps[s]));
        for o in &steps[i].owners {
            let key = (o.family, o.owner.clone());
            let growth = |first: &Point, now: i64| now - first.owners.get(&key).copied().unwrap_or(0);
            let g = Growth {
                family: o.family.as_str(),
                owner: o.owner.clone(),
                a: o.a,
                b: o.b,
                diff: o.diff,
                growth_a: first.map_or(0, |(fa, _)| growth(fa, o.a)),
                growth_b: first.map_or(0, |(_, fb)| growth(fb, o.b)),
            };
            match o.diff {
                d if d > 0 => grew.push(g),
                d if d < 0 => shrank.push(g),
                _ => {}
            }
        }
    }
    grew.sort_by(|x, y| y.diff.cmp(&x.diff).then_with(|| x.owner.cmp(&y.owner)));
    shrank.sort_by(|x, y| x.diff.cmp(&y.diff).then_with(|| x.owner.cmp(&y.owner)));
    grew.truncate(top);
    shrank.truncate(top);
    let side_json = |r: &Run| SideJson {
        db: r.path.display().to_string(),
        steps: r.side.steps.len(),
        step_sources: r.sources.clone(),
    };
    PairDiff {
        device: device.to_owned(),
        a: side_json(a),
        b: side_json(b),
        at: at_index.map_or(serde_json::Value::Null, |i| steps[i].step.clone()),
        steps,
        grew,
        shrank,
        only_in_a: a.side.steps.keys().filter(|s| !b.side.steps.contains_key(s)).copied().collect(),
        only_in_b: b.side.steps.keys().filter(|s| !a.side.steps.contains_key(s)).copied().collect(),
    }
}

fn steps_list(steps: &[u64]) -> String {
    match (steps.first(), steps.last()) {
        (Some(f), Some(l)) if steps.len() as u64 == l - f + 1 => format!("{f}..{l}"),
        _ => steps.iter().map(u64::to_string).collect::<Vec<_>>().join(", "),
    }
}

fn text(d: &PairDiff) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "device {}", d.device);
    let _ = writeln!(out, "  A: {} ({})", d.a.db, d.a.step_sources);
    let _ = writeln!(out, "  B: {} ({})", d.b.db, d.b.step_sources);
    for (which, only) in [("A", &d.only_in_a), ("B", &d.only_in_b)] {
        if !only.is_empty() {
            let _ = writeln!(out, "  steps only {which} has (not compared): {}", steps_list(only));
        }
    }
    let families: Vec<&'static str> = d.steps.first().map_or(vec![], |s| s.families.iter().map(|f| f.family).collect());
    for (i, family) in families.iter().enumerate() {
        let _ = writeln!(out, "  {family} live bytes at the end of each step, and at the end of the traces:");
        let _ = writeln!(out, "    {:>8}  {:>12}  {:>12}  {:>12}", "step", "A", "B", "B-A");
        for s in &d.steps {
            let f = &s.families[i];
            let step = s.step.as_u64().map_or("end".to_owned(), |n| n.to_string());
            let _ = writeln!(
                out,
                "    {step:>8}  {:>12}  {:>12}  {:>12}",
                human_bytes(f.a),
                human_bytes(f.b),
                signed(f.diff)
            );
        }
    }
    let at = match d.at.as_u64() {
        Some(s) => format!("at the end of step {s}"),
        None => "at the end of the traces".to_owned(),
    };
    let change = |b: i64| if b == 0 { "no change".to_owned() } else { signed(b) };
    let growth = |g: &Growth| match (d.steps.first().and_then(|s| s.step.as_u64()), d.at.as_u64()) {
        (Some(first), Some(last)) if first < last => {
            format!(" (step {first} to {last}: A {}, B {})", change(g.growth_a), change(g.growth_b))
        }
        _ => String::new(),
    };
    if d.grew.is_empty() {
        let _ = writeln!(out, "  nothing grew in B {at}");
    } else {
        let _ = writeln!(out, "  what grew in B, {at}:");
        for g in &d.grew {
            let _ = writeln!(
                out,
                "    {:<28} A {:>10}  B {:>10}  {:>11}{}",
                printable(&g.owner),
                human_bytes(g.a),
                human_bytes(g.b),
                signed(g.diff),
                growth(g)
            );
        }
    }
    if !d.shrank.is_empty() {
        let _ = writeln!(out, "  what shrank in B, {at}:");
        for g in &d.shrank {
            let _ = writeln!(
                out,
                "    {:<28} A {:>10}  B {:>10}  {:>11}",
                printable(&g.owner),
                human_bytes(g.a),
                human_bytes(g.b),
                signed(g.diff)
            );
        }
    }
    out
}

/// One side's DBs by device, in device order: (device, DB).
type ByDevice = BTreeMap<(u8, u64, String), (String, DbFile)>;

/// Pairs the DBs of A and B by device; two single files are a pair whatever their devices.
fn pairs(args: &Args) -> anyhow::Result<Vec<(String, DbFile, DbFile)>> {
    let files_a = inputs::files(std::slice::from_ref(&args.a)).with_context(|| "A")?;
    let Some(b) = &args.b else { bail!("compare needs a second trace (B)") };
    let files_b = inputs::files(std::slice::from_ref(b)).with_context(|| "B")?;
    let want = args.device.as_deref().map(inputs::normalise_device);
    let by_device = |files: &[DbFile]| -> anyhow::Result<ByDevice> {
        let mut map = BTreeMap::new();
        for f in files {
            let device = inputs::device_of_file(f)?;
            if want.is_some_and(|w| !device.split(',').any(|d| d == w)) {
                continue;
            }
            if map.insert(db::device_order(Some(&device)), (device.clone(), f.clone())).is_some() {
                let shown = f.shown();
                bail!("{} holds several traces of device {device}; give the trace output folders (memscope_<pid>_<time>_ascend/) or the DB files to compare", shown.parent().map_or(shown.display().to_string(), |p| p.display().to_string()));
            }
        }
        Ok(map)
    };
    if files_a.len() == 1 && files_b.len() == 1 && args.a.is_file() && b.is_file() {
        let device = inputs::device_of_file(&files_a[0])?;
        let other = inputs::device_of_file(&files_b[0])?;
        let label = if device == other { device } else { format!("{device} (A) vs {other} (B)") };
        return Ok(vec![(label, files_a[0].clone(), files_b[0].clone())]);
    }
    let (map_a, map_b) = (by_device(&files_a)?, by_device(&files_b)?);
    let pairs: Vec<(String, DbFile, DbFile)> = map_a
        .iter()
        .filter_map(|(k, (d, pa))| map_b.get(k).map(|(_, pb)| (d.clone(), pa.clone(), pb.clone())))
        .collect();
    if pairs.is_empty() {
        let names = |m: &ByDevice| {
            let v: Vec<&str> = m.values().map(|(d, _)| d.as_str()).collect();
            if v.is_empty() {
                "none".to_owned()
            } else {
                v.join(", ")
            }
        };
        let what = want.map_or(String::new(), |w| format!(" for --device {w}"));
        bail!(
            "A and B have no device in common{what} (A: {}; B: {}); give two DB files to compare them whatever their devices, or drop --device",
            names(&map_a),
            names(&map_b)
        );
    }
    for (k, (d, _)) in &map_a {
        if !map_b.contains_key(k) {
            eprintln!("memscope-bpf: device {d} is only in A; not compared");
        }
    }
    for (k, (d, _)) in &map_b {
        if !map_a.contains_key(k) {
            eprintln!("memscope-bpf: device {d} is only in B; not compared");
        }
    }
    Ok(pairs)
}

/// One side of a call comparison: the DB's calls at `level`, or why it has none.
fn calls_side(file: &DbFile, level: Level) -> anyhow::Result<Calls> {
    let (db, _) = inputs::open(file, "compare", inputs::Store::Never)?;
    Ok(calls::read(&db, level)?)
}

/// The step view of every device pair.
fn step_reports(args: &Args) -> anyhow::Result<Vec<PairDiff>> {
    let marker = args.step_marker.as_deref();
    let mut reports = Vec::new();
    for (device, pa, pb) in pairs(args)? {
        let a = run_of(&pa, marker).context("A")?;
        let b = run_of(&pb, marker).context("B")?;
        reports.push(compare(&device, &a, &b, args.top));
    }
    Ok(reports)
}

/// The call view (`--level`) of every device pair.
fn call_reports(args: &Args, level: Level) -> anyhow::Result<Vec<calldiff::CallDiff>> {
    let mut sides = Vec::new();
    for (device, pa, pb) in pairs(args)? {
        let (a, b) = (calls_or_none(&pa, level).context("trace A")?, calls_or_none(&pb, level).context("trace B")?);
        sides.push(CallPair { device, pa, pb, a, b });
    }
    // A trace with no calls on any device was recorded without them: the error says how to.
    if let Some(e) = none_anywhere(&mut sides, |p| &mut p.a) {
        return Err(anyhow::Error::new(e).context("trace A"));
    }
    if let Some(e) = none_anywhere(&mut sides, |p| &mut p.b) {
        return Err(anyhow::Error::new(e).context("trace B"));
    }
    let mut reports = Vec::new();
    for CallPair { device, pa, pb, a, b } in sides {
        // With calls on one side only a device differs; with none on either (host memory, a
        // device of no kernels) it is said and skipped.
        if a.is_err() && b.is_err() {
            say!("memscope-bpf: device {device}: no {} calls in either trace; not compared", level_name(level));
            continue;
        }
        let (a, b) = (a.unwrap_or_default(), b.unwrap_or_default());
        reports.push(calldiff::compare(&device, level, (pa.shown(), &a), (pb.shown(), &b), args.top));
    }
    Ok(reports)
}

/// A side's calls, or the error saying it has none.
type CallsOrNone = Result<Calls, AnalysisError>;

/// One device's two traces and their calls.
struct CallPair {
    device: String,
    pa: DbFile,
    pb: DbFile,
    a: CallsOrNone,
    b: CallsOrNone,
}

/// The first "no calls" error of `side` when it has no calls on any device.
fn none_anywhere(pairs: &mut [CallPair], side: fn(&mut CallPair) -> &mut CallsOrNone) -> Option<AnalysisError> {
    if !pairs.iter_mut().all(|p| side(p).is_err()) {
        return None;
    }
    std::mem::replace(side(pairs.first_mut()?), Ok(Calls::default())).err()
}

/// One side's calls, or the error saying it has none (any other error is the caller's).
fn calls_or_none(file: &DbFile, level: Level) -> anyhow::Result<CallsOrNone> {
    match calls_side(file, level) {
        Ok(calls) => Ok(Ok(calls)),
        Err(e) => match e.downcast::<AnalysisError>() {
            Ok(e @ (AnalysisError::NoOps { .. } | AnalysisError::NoKernels { .. })) => Ok(Err(e)),
            Ok(e) => Err(e.into()),
            Err(e) => Err(e),
        },
    }
}

fn level_name(level: Level) -> &'static str {
    match level {
        Level::Op => "operator",
        Level::Kernel => "kernel",
    }
}

/// Prints the reports as one JSON array, or their texts one after the other.
fn print<T: Serialize>(json: bool, reports: &[T], text: impl Fn(&T) -> String) -> anyhow::Result<()> {
    let out = if json {
        serde_json::to_string_pretty(reports).context("cannot format the JSON report")? + "\n"
    } else {
        reports.iter().map(text).collect::<Vec<_>>().join("\n")
    };
    write_stdout(&out)
}

/// Writes the report; a reader that went away (`| head`) is no error.
pub(super) fn write_stdout(out: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(out.as_bytes()).and_then(|()| stdout.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => r.context("cannot write to stdout"),
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if let Some(files) = super::compare_ranks::wanted(&args)? {
        return super::compare_ranks::run(&args, files);
    }
    match args.level {
        Some(level) => print(args.json, &call_reports(&args, level)?, |d| calldiff::text(d, args.rows)),
        None => print(args.json, &step_reports(&args)?, text),
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use clap::Parser as _;

    use super::*;
    use memscope_core::analysis::steps::testrows::step;
    use memscope_core::analysis::testdb::{dir, TestDb};

    const MIB: u64 = 1 << 20;

    /// A run folder with the given devices; 6 steps; `leak` keeps one 2 MiB kv block per step.
    fn run_folder(name: &str, devices: &[&str], leak: bool) -> PathBuf {
        let root = dir(name);
        let run = root.join("memscope_42_20260101000000_ascend");
        for dev in devices {
            let mut db = TestDb::create(&run.join(format!("device_{dev}/dump/memscope_dump_20260101000000.db")));
            db.system("START_TRACE", 1);
            db.malloc("PTA", 10, 0x100, 8 * MIB, Some("PTA@weight"));
            db.malloc("PTA", 11, 0x101, 4 * MIB, Some("PTA@optimizer"));
            for k in 1..=6u64 {
                let ts = 100 * k as i64;
                db.malloc("PTA", ts - 50, 0x900 + k, 3 * MIB, Some("PTA@activation"));
                db.free("PTA", ts - 40, 0x900 + k);
                if leak && k >= 2 {
                    db.malloc("PTA", ts - 30, 0x700 + k, 2 * MIB, Some("PTA@kv_cache"));
                }
                step(&mut db, ts, k);
            }
            if leak {
                db.free("PTA", 650, 0x101); // B frees its optimizer state at the end
            }
            db.system("STOP_TRACE", 700);
        }
        run
    }

    fn args(argv: &[&str]) -> Args {
        let mut full = vec!["memscope-bpf", "compare"];
        full.extend_from_slice(argv);
        let cli = crate::cli::Cli::try_parse_from(full).unwrap();
        match cli.command {
            crate::cli::Command::Compare(args) => args,
            other => panic!("parsed as {other:?}"),
        }
    }

    fn diffs(a: &Path, b: &Path, extra: &[&str]) -> Vec<PairDiff> {
        let mut argv = vec![a.to_str().unwrap(), b.to_str().unwrap()];
        argv.extend_from_slice(extra);
        let args = args(&argv);
        pairs(&args)
            .unwrap()
            .into_iter()
            .map(|(d, pa, pb)| compare(&d, &run_of(&pa, None).unwrap(), &run_of(&pb, None).unwrap(), args.top))
            .collect()
    }

    #[test]
    fn the_leaking_owner_is_what_grew_step_by_step() {
        let clean = run_folder("cmp-clean", &["0", "1"], false);
        let leaky = run_folder("cmp-leaky", &["0"], true);
        let d = diffs(&clean, &leaky, &[]);
        assert_eq!(d.len(), 1, "device 1 is only in A");
        let d = &d[0];
        assert_eq!(d.device, "0");
        let steps: Vec<String> = d.steps.iter().map(|s| s.step.to_string()).collect();
        assert_eq!(steps, ["1", "2", "3", "4", "5", "6", "\"end\""]);
        // Step 4: kv blocks of steps 2, 3, 4 in B only.
        let s4 = &d.steps[3];
        assert_eq!((s4.families[0].family, s4.families[0].diff), ("PTA", 3 * 2 * MIB as i64));
        let kv = s4.owners.iter().find(|o| o.owner == "PTA@kv_cache").unwrap();
        assert_eq!((kv.a, kv.b, kv.diff), (0, 6 * MIB as i64, 6 * MIB as i64));
        assert_eq!(d.at, serde_json::json!(6));
        assert_eq!(d.grew.len(), 1);
        let g = &d.grew[0];
        assert_eq!(
            (g.owner.as_str(), g.diff, g.growth_a, g.growth_b),
            ("PTA@kv_cache", 10 * MIB as i64, 0, 10 * MIB as i64)
        );
        assert!(d.shrank.is_empty(), "the optimizer is freed after the last step: only the end shows it");
        let end = d.steps.last().unwrap();
        assert_eq!(end.owners.iter().find(|o| o.owner == "PTA@optimizer").unwrap().diff, -4 * MIB as i64);
        let text = text(d);
        assert!(text.contains("what grew in B, at the end of step 6:") && text.contains("PTA@kv_cache"), "{text}");
        // The other way round, kv shrank.
        let back = diffs(&leaky, &clean, &["--device", "0"]);
        assert_eq!(back[0].shrank[0].owner, "PTA@kv_cache");
    }

    #[test]
    fn owners_are_escaped_in_the_text() {
        let clean = run_folder("cmp-escaped-clean", &["0"], false);
        let leaky = run_folder("cmp-escaped-leaky", &["0"], true);
        let mut d = diffs(&clean, &leaky, &[]).remove(0);
        d.grew[0].owner = "PTA@x\u{1b}[2J\nmemscope-bpf: forged".into();
        let text = text(&d);
        assert!(!text.contains('\u{1b}') && !text.contains("\nmemscope-bpf: forged"), "{text}");
        assert!(text.contains("    PTA@x\\u{1b}[2J\\nmemscope-bpf: forged A "), "{text}");
    }

    #[test]
    fn two_files_are_compared_whatever_their_devices() {
        let a = run_folder("cmp-files-a", &["0"], false).join("device_0/dump/memscope_dump_20260101000000.db");
        let b = run_folder("cmp-files-b", &["3"], true).join("device_3/dump/memscope_dump_20260101000000.db");
        let d = diffs(&a, &b, &[]);
        assert_eq!(d[0].device, "0 (A) vs 3 (B)");
        assert_eq!(d[0].grew[0].owner, "PTA@kv_cache");
    }

    /// A run folder whose devices ran `ops` (name, bytes) inside trace_ops(): per op its start
    /// and end (broadcast, so in every device's file) and, when bytes > 0, a caching-pool block of
    /// that size allocated right after the end (the op's delta). Each op launches one kernel
    /// named after it (`k_<name>`), followed by the same block on the kernel level.
    fn op_folder(name: &str, devices: &[&str], ops: &[(&str, u64)]) -> PathBuf {
        let run = dir(name).join("memscope_42_20260101000000_ascend");
        for dev in devices {
            let mut db = TestDb::create(&run.join(format!("device_{dev}/dump/memscope_dump_20260101000000.db")));
            db.system("START_TRACE", 1);
            for (i, (op, bytes)) in ops.iter().enumerate() {
                let ts = 100 * (i as i64 + 1);
                db.named("OP_LAUNCH", "ATEN_START", op, ts, 7);
                db.named("KERNEL_LAUNCH", "KERNEL_LAUNCH", &format!("k_{op}"), ts + 1, 7);
                db.named("OP_LAUNCH", "ATEN_END", "N/A", ts + 2, 7);
                if *bytes > 0 {
                    db.malloc("PTA", ts + 3, 0x1000 * (i as u64 + 1), *bytes, Some("PTA@activation"));
                }
            }
            db.system("STOP_TRACE", 100 * (ops.len() as i64 + 1));
        }
        run
    }

    fn call_diffs(a: &Path, b: &Path, extra: &[&str]) -> Vec<calldiff::CallDiff> {
        let mut argv = vec![a.to_str().unwrap(), b.to_str().unwrap()];
        argv.extend_from_slice(extra);
        let args = args(&argv);
        let level = args.level.expect("--level given");
        pairs(&args)
            .unwrap()
            .into_iter()
            .map(|(d, pa, pb)| {
                let (ca, cb) = (calls_side(&pa, level).unwrap(), calls_side(&pb, level).unwrap());
                calldiff::compare(&d, level, (pa.shown(), &ca), (pb.shown(), &cb), args.top)
            })
            .collect()
    }

    #[test]
    fn the_call_view_finds_the_one_inserted_op_and_its_allocation() {
        use memscope_core::analysis::calldiff::Kind;
        const X: u64 = 3 * MIB;
        let base: Vec<(&str, u64)> = (0..30)
            .flat_map(|_| [("aten.mm.default", 4 * MIB), ("aten.add.Tensor", 0), ("aten.relu.default", MIB)])
            .collect();
        let mut with_cat = base.clone();
        with_cat.insert(40, ("aten.cat.default", X));
        let a = op_folder("cmp-ops-a", &["0", "1"], &base);
        let b = op_folder("cmp-ops-b", &["0", "1"], &with_cat);
        for (level, name) in [("op", "aten.cat.default"), ("kernel", "k_aten.cat.default")] {
            let d = call_diffs(&a, &b, &["--level", level]);
            assert_eq!(d.iter().map(|d| d.device.as_str()).collect::<Vec<_>>(), ["0", "1"], "per device pair");
            for d in &d {
                let s = &d.summary;
                assert_eq!((s.calls_a, s.calls_b, s.matched, s.only_a, s.only_b), (90, 91, 90, 0, 1), "{level}");
                assert_eq!((s.only_b_delta, s.delta_b - s.delta_a, s.matched_delta_differs), (X as i64, X as i64, 0));
                let inserted: Vec<_> = d.rows.iter().filter(|r| r.kind != Kind::Same).collect();
                assert_eq!(inserted.len(), 1, "{level}: {inserted:?}");
                let r = inserted[0];
                assert_eq!(
                    (r.kind, r.name.as_str(), r.b, r.delta_b, r.count),
                    (Kind::OnlyB, name, Some(41), Some(X as i64), 1)
                );
                assert!(d.largest_delta_diffs.is_empty());
                let text = calldiff::text(d, 200);
                assert!(text.contains(&format!("+{:.1} MiB  {name}\n", X as f64 / MIB as f64)), "{text}");
            }
        }
        // A's copy of the op allocating more shows as a matched op with another delta.
        let mut bigger = base.clone();
        bigger[10].1 = 6 * MIB;
        let d = &call_diffs(&a, &op_folder("cmp-ops-c", &["0"], &bigger), &["--level", "op", "--top", "1"])[0];
        assert_eq!((d.summary.only_a, d.summary.only_b, d.summary.matched_delta_differs), (0, 0, 1));
        let r = &d.largest_delta_diffs[0];
        assert_eq!(
            (r.name.as_str(), r.a, r.delta_a, r.delta_b),
            ("aten.add.Tensor", Some(11), Some(0), Some(6 * MIB as i64))
        );
    }

    #[test]
    fn the_call_view_needs_calls_and_says_how_to_get_them() {
        let steps_only = run_folder("cmp-nocalls", &["0"], false);
        let ops = op_folder("cmp-calls", &["0"], &[("aten.mm.default", MIB)]);
        let err = run(args(&[ops.to_str().unwrap(), steps_only.to_str().unwrap(), "--level", "op"])).unwrap_err();
        let msg = format!("{err:#}");
        assert!(
            msg.starts_with("trace B: ") && msg.contains("no operator calls") && msg.contains("trace_ops()"),
            "{msg}"
        );
        let err = run(args(&[steps_only.to_str().unwrap(), ops.to_str().unwrap(), "--level", "kernel"])).unwrap_err();
        let msg = format!("{err:#}");
        assert!(
            msg.starts_with("trace A: ") && msg.contains("no kernel calls") && msg.contains("aclrtLaunchKernel"),
            "{msg}"
        );
        // --rows belongs to the call view, --step-marker to the step view.
        let cli =
            |argv: &[&str]| crate::cli::Cli::try_parse_from([&["memscope-bpf", "compare", "a", "b"], argv].concat());
        assert!(cli(&["--rows", "5"]).is_err());
        assert!(cli(&["--level", "op", "--step-marker", "iter"]).is_err());
        assert!(cli(&["--level", "kernel", "--rows", "0", "--json"]).is_ok());
        run(args(&[ops.to_str().unwrap(), ops.to_str().unwrap(), "--level", "op", "--json"])).unwrap();
    }

    #[test]
    fn bad_inputs_name_the_problem() {
        let a = run_folder("cmp-bad-a", &["0"], false);
        let b = run_folder("cmp-bad-b", &["1"], false);
        let err = run(args(&[a.to_str().unwrap(), b.to_str().unwrap()])).unwrap_err();
        let msg = format!("{err:#}");
        assert!(msg.contains("no device in common") && msg.contains("A: 0; B: 1"), "{msg}");
        let err = run(args(&[a.to_str().unwrap(), "/nonexistent/run"])).unwrap_err();
        assert!(format!("{err:#}").starts_with("B: /nonexistent/run: no such file or folder"), "{err:#}");
        let err = run(args(&[a.to_str().unwrap(), a.to_str().unwrap(), "--step-marker", "iter"])).unwrap_err();
        assert!(format!("{err:#}").contains("no MSTX mark or range named \"iter\""), "{err:#}");
        // JSON is one array element per device pair.
        run(args(&[a.to_str().unwrap(), a.to_str().unwrap(), "--json"])).unwrap();
    }
}
