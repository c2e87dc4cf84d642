//! `memscope-bpf analyze`: msMemScope's offline analyses (`--analysis`) over DBs a trace wrote.
//! Unprivileged: it only reads the DBs and adds its own result tables to them.
//!
//! This module turns arguments into a list of DBs and instants, runs the analyses in
//! `memscope_core::analysis`, and prints; every input problem is reported before or instead of any
//! write, so a mistake costs one line and never a damaged DB.

use std::io::Write as _;
use std::path::PathBuf;

use anyhow::{bail, Context as _};
use memscope_core::analysis::contract::{
    self, Analysis as _, Decompose, DecomposeOptions, Inefficient, Leaks, Oom, Sites, Unexplained,
};
use memscope_core::analysis::db::DumpDb;
use memscope_core::analysis::decompose::TimeSpec;
use memscope_core::analysis::inefficient;

use super::inputs;

/// An analysis, by msMemScope's `--analysis` name.
#[derive(Clone, Copy, Debug, Eq)]
pub enum Analysis {
    Decompose,
    Inefficient,
    Leaks,
    /// The job's own lines holding memory, and the leaks by line.
    Sites,
    /// `oom:K`: K most recent and largest live blocks per failure (msMemScope's default 10).
    Oom(usize),
    /// The driver's figure for each process against its traced device memory.
    Unexplained,
}

/// The same analysis whatever its K: `oom:5,oom:20` runs once, and IMPLEMENTED lists `oom` once.
impl PartialEq for Analysis {
    fn eq(&self, other: &Self) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
    }
}

impl Analysis {
    fn name(self) -> &'static str {
        match self {
            Self::Decompose => Decompose::NAME,
            Self::Inefficient => Inefficient::NAME,
            Self::Leaks => Leaks::NAME,
            Self::Sites => Sites::NAME,
            Self::Oom(_) => Oom::NAME,
            Self::Unexplained => Unexplained::NAME,
        }
    }
}

/// One row of the dispatch table: an analysis by name, how its `--analysis` value parses, and
/// how `analyze` runs it on one DB (through the contract, with its options from the arguments).
struct Entry {
    name: &'static str,
    /// The value from the part after `name:`, if any; `None`: not a value of this analysis.
    parse: fn(Option<&str>) -> Option<Result<Analysis, String>>,
    run: fn(Analysis, &DumpDb, &Context<'_>) -> anyhow::Result<contract::Outcome>,
}

/// The analyses this build can run, in the order `--help` lists them; each one adds itself here.
const ANALYSES: [Entry; 6] = [
    Entry {
        name: Decompose::NAME,
        parse: |arg| arg.is_none().then_some(Ok(Analysis::Decompose)),
        run: |_, db, cx| drive::<Decompose>(db, cx, &cx.decompose),
    },
    // msMemScope's inefficient_type and Insight's time-based flags
    Entry {
        name: Inefficient::NAME,
        parse: |arg| arg.is_none().then_some(Ok(Analysis::Inefficient)),
        run: |_, db, cx| drive::<Inefficient>(db, cx, &cx.args.inefficient),
    },
    // step leak candidates, HAL never freed, degradation across steps
    Entry {
        name: Leaks::NAME,
        parse: |arg| arg.is_none().then_some(Ok(Analysis::Leaks)),
        run: |_, db, cx| drive::<Leaks>(db, cx, &cx.args.leaks),
    },
    // the job's own lines (Attr `site`) holding memory at the peak and the end; leaks by line
    Entry {
        name: Sites::NAME,
        parse: |arg| arg.is_none().then_some(Ok(Analysis::Sites)),
        run: |_, db, cx| drive::<Sites>(db, cx, &()),
    },
    // forensics of each failure (ms_oom); `oom:K` lists K blocks
    Entry {
        name: Oom::NAME,
        parse: |arg| {
            Some(match arg {
                Some(k) => memscope_core::analysis::oom::parse_top_k(k).map(Analysis::Oom),
                None => Ok(Analysis::Oom(memscope_core::analysis::oom::DEFAULT_TOP_K)),
            })
        },
        run: |a, db, cx| {
            let Analysis::Oom(k) = a else { bail!("`{}` is not the oom analysis", a.name()) };
            drive::<Oom>(db, cx, &k)
        },
    },
    // the driver's figure per process (ms_driver, or msMemScope's process_used) minus the traced
    // device memory, at each reading
    Entry {
        name: Unexplained::NAME,
        parse: |arg| arg.is_none().then_some(Ok(Analysis::Unexplained)),
        run: |_, db, cx| drive::<Unexplained>(db, cx, &()),
    },
];

/// The dispatch table's row for `analysis`.
fn entry(analysis: Analysis) -> Option<&'static Entry> {
    ANALYSES.iter().find(|e| e.name == analysis.name())
}

/// The names of the analyses, as the error messages list them.
fn available() -> String {
    ANALYSES.iter().map(|e| e.name).collect::<Vec<_>>().join(", ")
}

/// msMemScope's names (in any case), including its `oom:K` form, so its command lines carry over.
fn parse_analysis(text: &str) -> Result<Analysis, String> {
    let name = text.trim();
    let (base, arg) = match name.split_once(':') {
        Some((base, arg)) => (base, Some(arg)),
        None => (name, None),
    };
    ANALYSES
        .iter()
        .find(|e| e.name.eq_ignore_ascii_case(base))
        .and_then(|e| (e.parse)(arg))
        .unwrap_or_else(|| Err(format!("unknown analysis `{name}`; the analyses are: {}", available())))
}

/// Analyse trace DBs offline, without privileges: where the memory went, per device.
///
///   memscope-bpf analyze msout/memscope_4242_20260101120000_ascend --decompose
///   memscope-bpf analyze msout/ --analysis decompose --at peak,+2.5s --depth 2
///   memscope-bpf analyze .../device_0/dump/memscope_dump_20260101120000.db --json
///
/// decompose: which owners held the live memory (HAL: device memory the runtime took; PTA: the
/// framework's pool blocks, which live inside HAL memory; HOST: host memory), as the owner tree
/// MindStudio Insight draws, at the peak of live device bytes and at the end of the trace. The
/// trees are also written into each DB as table ms_decompose, replaced on every run.
///
/// inefficient: blocks that held memory while unused. msMemScope's definitions on its API index
/// (early_allocation, late_deallocation, temporary_idleness; PTA caching and ATB pools) are
/// written into each flagged MALLOC row's Attr as inefficient_type; Insight's time-based flags
/// (lazy_used, delayed_free, long_idle) are computed when a threshold is given. Every accessed
/// block's facts go into table ms_inefficient, replaced on every run.
///   memscope-bpf analyze msout/ --analysis inefficient --long-idle 50ms,30%
///
/// leaks: per step (memscope.step(), mstx `step start` ranges, or --step-marker), msMemScope's
/// leak candidates (blocks born after the warm-up and still live --min-steps whole steps later,
/// by owner, with step of birth), HAL memory never freed, the live bytes at each step's end, and
/// whether they rise in a sustained way (Mann-Kendall + Theil-Sen, at least 5 step ends; a single
/// jump is not a rise) and which owners grew. Stored as tables ms_steps, ms_leaks, ms_degradation.
///   memscope-bpf analyze msout/ --analysis leaks --warmup-steps 2
///
/// oom[:K]: each failed allocation explained from the blocks live at that instant: what was
/// asked for, the device memory held, the caching pool's reserved and allocated bytes, its
/// largest free piece, the owners holding the most and the K most recent and largest live
/// blocks, with a verdict (fragmentation, genuinely full, the allocator's own limit, ...). Stored
/// as tables ms_oom and ms_oom_blocks.
///   memscope-bpf analyze msout/ --analysis oom:5
///
/// unexplained: memory the driver counts for a process that no traced call explains: at each
/// of the driver's readings (ms_driver, taken by `trace --driver-every`; msMemScope's
/// process_used), its figure minus the process's live HAL blocks then. The runtime's context,
/// communication libraries' buffers and memory allocated before an attach are the usual
/// causes. Stored as table ms_unexplained.
///   memscope-bpf analyze msout/ --analysis unexplained
#[derive(Debug, clap::Args)]
#[command(verbatim_doc_comment)]
pub struct Args {
    /// Traces: DBs (memscope_dump_*.db) or CSVs, or folders: a trace's output folder
    /// (memscope_<pid>_<time>_ascend/), the folder holding such folders, or one device_<id>/.
    /// Every dump found in device_*/dump/ is analysed: one report per DB, in device order.
    /// msMemScope's own captures too: its CSV (read through a temporary DB) or DB, and its folders (msmemscope_<pid>_<time>_ascend/, memscopeDumpResults/, leaksDumpResults/).
    #[arg(value_name = "DB", required = true)]
    pub inputs: Vec<PathBuf>,

    /// Analyses to run, comma-separated, by msMemScope's names: decompose, inefficient, leaks,
    /// sites, oom, unexplained (oom:K lists K blocks per failure, default 10; sites and
    /// unexplained are ours: the job's own lines holding memory at the peak and the end, and the
    /// leaks by line; the driver's figure against the traced calls). Default: decompose.
    #[arg(long, value_name = "LIST", value_delimiter = ',', value_parser = parse_analysis)]
    pub analysis: Vec<Analysis>,

    /// Shorthand for --analysis decompose.
    #[arg(long)]
    pub decompose: bool,

    /// Instants to decompose, instead of the default peak,end: `peak` (most live HAL bytes; PTA,
    /// then HOST, in a trace without HAL), `end` (just before the trace stopped), a
    /// Timestamp(ns) as in the DB, or +TIME after the trace start (+2.5s, +300ms, +1m).
    /// Comma-separated or repeated: `--at peak,end,+30s` keeps the defaults and adds one.
    #[arg(long, value_name = "TIME", value_delimiter = ',')]
    pub at: Vec<TimeSpec>,

    /// Only the DB of this device: 0, 1, ..., cpu (host memory), unknown.
    #[arg(long, value_name = "D")]
    pub device: Option<String>,

    /// Owner levels to show: 0 for the totals only, 1 for the first level (CANN, PTA, ...), and
    /// so on. Default: all. The DB always gets the whole tree.
    #[arg(long, value_name = "N")]
    pub depth: Option<usize>,

    /// Print JSON instead of text: an array of {db, device, point, ts_ns, family, nodes: [{path,
    /// depth, bytes, blocks}]}, one element per DB, instant and family; each tree's first node is
    /// its root (path "", depth 0). inefficient adds one {db, device, analysis: "inefficient",
    /// options, types, flagged_blocks, blocks (the 1000 largest flagged), stats} per DB. leaks adds one {db, device, analysis: "leaks",
    /// options, candidates, never_freed, steps, degradation, ...} per DB.
    #[arg(long)]
    pub json: bool,

    /// Only print: open the DBs read-only and write nothing into them (no ms_* tables, no
    /// inefficient_type; for read-only copies).
    #[arg(long)]
    pub no_write: bool,

    /// Store the results also in msMemScope's own DBs (by default they are only printed for
    /// those, so a capture is never changed unasked; ours always get them).
    #[arg(long, conflicts_with = "no_write")]
    pub write: bool,

    #[command(flatten)]
    pub inefficient: inefficient::Options,

    #[command(flatten)]
    pub leaks: memscope_core::analysis::leaks::Options,
}

/// Writes to stdout; once the reader has gone (`| head`) the analyses still run and write their
/// tables, only the printing stops.
struct Stdout {
    open: bool,
}

impl Stdout {
    fn print(&mut self, text: &str) -> anyhow::Result<()> {
        if !self.open {
            return Ok(());
        }
        let mut out = std::io::stdout().lock();
        match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
                self.open = false;
                Ok(())
            }
            r => r.context("cannot write to stdout"),
        }
    }
}

/// What every analysis gets for one DB.
struct Context<'a> {
    args: &'a Args,
    decompose: DecomposeOptions,
    device: &'a str,
    write: bool,
    run_wall_ns: u64,
}

/// Runs analysis `A` on one DB through the contract, and says what it stored.
fn drive<A: contract::Analysis>(
    db: &DumpDb,
    cx: &Context<'_>,
    options: &A::Options,
) -> anyhow::Result<contract::Outcome>
where
    A::Error: std::error::Error + Send + Sync + 'static,
{
    let done = contract::run::<A>(db, cx.device, options, cx.args.json, cx.write.then_some(cx.run_wall_ns))?;
    if let Some(line) = &done.stored {
        crate::terminal::say::say!("memscope-bpf: {line}");
    }
    Ok(done)
}

/// Parses an `--analysis` list as `analyze` would, without running anything (what `trace
/// --analysis` checks before tracing).
pub fn parse_list(list: &str) -> anyhow::Result<Vec<Analysis>> {
    let mut analyses = Vec::new();
    for name in list.split(',') {
        let analysis = parse_analysis(name).map_err(anyhow::Error::msg)?;
        if entry(analysis).is_none() {
            bail!(
                "--analysis: `{}` is not implemented yet in this version; the available analyses are: {}",
                analysis.name(),
                available()
            );
        }
        analyses.push(analysis);
    }
    Ok(analyses)
}

impl Args {
    /// `analyze DIR --analysis LIST` with every other option at its default: what `trace
    /// --analysis` runs on the trace it just wrote.
    pub fn for_trace(dir: &std::path::Path, analyses: Vec<Analysis>) -> Self {
        Self {
            inputs: vec![dir.to_owned()],
            analysis: analyses,
            decompose: false,
            at: Vec::new(),
            device: None,
            depth: None,
            json: false,
            no_write: false,
            write: false,
            inefficient: inefficient::Options::default(),
            leaks: memscope_core::analysis::leaks::Options::default(),
        }
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    analyse(&args)
}

/// What `trace --analysis` runs on the trace it just wrote (see [`Args::for_trace`]).
pub fn after_trace(dir: &std::path::Path, analyses: Vec<Analysis>) -> anyhow::Result<()> {
    analyse(&Args::for_trace(dir, analyses))
}

/// The analyses whose result tables `report` shows, each by the table it writes.
const FOR_REPORT: [(Analysis, &str); 5] = [
    (Analysis::Inefficient, memscope_core::analysis::inefficient_out::INEFFICIENT_TABLE),
    (Analysis::Leaks, memscope_core::analysis::leaks::LEAKS_TABLE),
    (Analysis::Oom(memscope_core::analysis::oom::DEFAULT_TOP_K), memscope_core::analysis::oom::OOM_TABLE),
    (Analysis::Sites, memscope_core::analysis::sites::TABLE),
    (Analysis::Unexplained, memscope_core::analysis::unexplained::TABLE),
];

/// Runs on `dump` (opened for writing) each analysis the report shows whose table the DB lacks,
/// with `analyze`'s defaults, and stores its results as `analyze` does (each says so on stderr):
/// the report then shows findings rather than the commands that would make them.
pub fn store_for_report(dump: &DumpDb, device: &str) -> anyhow::Result<()> {
    let args = Args::for_trace(dump.path(), Vec::new());
    let run_wall_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    let decompose = DecomposeOptions { points: Vec::new(), depth: None };
    let cx = Context { args: &args, decompose, device, write: true, run_wall_ns };
    for (analysis, table) in FOR_REPORT {
        if memscope_core::report::findings::has_table(dump, table)? {
            continue;
        }
        let entry = entry(analysis).expect("every analysis the report runs is in the dispatch table");
        (entry.run)(analysis, dump, &cx)?;
    }
    Ok(())
}

/// Analyses every DB the arguments name and prints the reports.
fn analyse(args: &Args) -> anyhow::Result<()> {
    let mut analyses = args.analysis.clone();
    if args.decompose || analyses.is_empty() {
        analyses.push(Analysis::Decompose);
    }
    analyses.dedup();
    // Refused before any DB is touched: a half-run analysis list would look like a result.
    if let Some(missing) = analyses.iter().find(|a| entry(**a).is_none()) {
        bail!(
            "`{}` is not implemented yet in this version; the available analyses are: {}",
            missing.name(),
            available()
        );
    }
    let points = if args.at.is_empty() { vec![TimeSpec::Peak, TimeSpec::End] } else { args.at.clone() };
    let decompose = DecomposeOptions { points, depth: args.depth };
    let want_device = args.device.as_deref().map(inputs::normalise_device);
    let store = inputs::Store::from_flags(args.write, args.no_write);

    // Every input is resolved first, so a typo in the last one does not come after output.
    let files = inputs::files(&args.inputs)?;

    let run_wall_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    let mut stdout = Stdout { open: true };
    let mut json = Vec::new();
    let mut other_devices = Vec::new();
    let mut analysed = 0;
    for file in &files {
        if let (Some(want), Some(have)) = (want_device, file.device.as_deref()) {
            if want != have {
                other_devices.push(have.to_owned());
                continue;
            }
        }
        let (dump, write) = inputs::open(file, "analyze", store)?;
        let device = inputs::device_of(file, &dump)?;
        if let Some(want) = want_device {
            if !inputs::is_device(&device, want) {
                other_devices.push(device);
                continue;
            }
        }
        let cx = Context { args, decompose: decompose.clone(), device: &device, write, run_wall_ns };
        let mut texts = Vec::new();
        for analysis in &analyses {
            let Some(entry) = entry(*analysis) else { continue };
            let done = (entry.run)(*analysis, &dump, &cx)?;
            texts.extend(done.text);
            json.extend(done.json);
        }
        for text in texts {
            if analysed > 0 {
                stdout.print("\n")?;
            }
            stdout.print(&text)?;
            analysed += 1;
        }
        analysed = analysed.max(1);
    }
    if analysed == 0 {
        if let Some(want) = want_device {
            return Err(inputs::no_such_device(want, other_devices));
        }
    }
    if args.json {
        let text = serde_json::to_string_pretty(&json).context("cannot format the JSON report")?;
        stdout.print(&(text + "\n"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;
    use rusqlite::Connection;

    use super::*;
    use crate::cli::{Cli, Command};
    use memscope_core::analysis::inefficient::scenario::{small_trace, A, B};
    use memscope_core::analysis::steps::testrows::noisy_run;
    use memscope_core::analysis::testdb::{dir, TestDb};

    fn parse(argv: &[&str]) -> Result<Args, clap::Error> {
        let mut full = vec!["memscope-bpf", "analyze"];
        full.extend_from_slice(argv);
        match Cli::try_parse_from(full)?.command {
            Command::Analyze(args) => Ok(args),
            other => panic!("parsed as {other:?}"),
        }
    }

    /// A run folder with devices 1 and 0 (written in that order) and one HAL/PTA trace each.
    fn run_folder(name: &str) -> PathBuf {
        let root = dir(name);
        let run = root.join("memscope_42_20260101000000_ascend");
        for (dev, size) in [("1", 300u64), ("0", 200)] {
            let mut db = TestDb::create(&run.join(format!("device_{dev}/dump/memscope_dump_20260101000000.db")));
            db.system("START_TRACE", 1_000);
            db.malloc("HAL", 1_100, 0x10, size, Some("CANN@APP"));
            db.malloc("PTA", 1_200, 0x10, size / 2, Some("PTA@weight"));
            db.free("PTA", 1_300, 0x10);
            db.system("STOP_TRACE", 2_000);
            db.free_marked("HAL", 2_001, 0x10, "shadow");
        }
        run
    }

    fn decompose_rows(path: &std::path::Path) -> Vec<(String, i64, String, String, i64, i64, i64)> {
        let conn = Connection::open(path).unwrap();
        let mut stmt = conn
            .prepare("SELECT point, ts_ns, family, owner, depth, bytes, blocks FROM ms_decompose ORDER BY rowid")
            .unwrap();
        stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?, r.get(6)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    }

    #[test]
    fn arguments_parse() {
        let a = parse(&["x.db", "--decompose"]).unwrap();
        assert!(a.decompose && a.analysis.is_empty());
        assert_eq!(a.inputs, [PathBuf::from("x.db")]);
        let a = parse(&["--analysis", "decompose,leaks", "a", "b", "--at", "peak,+2.5s", "--at", "123"]).unwrap();
        assert_eq!(a.analysis, [Analysis::Decompose, Analysis::Leaks]);
        assert_eq!(a.at, [TimeSpec::Peak, TimeSpec::SinceStart(2_500_000_000), TimeSpec::Absolute(123)]);
        assert_eq!(a.inputs.len(), 2);
        let a =
            parse(&["d", "--analysis", "oom:20", "--device", "cpu", "--depth", "2", "--json", "--no-write"]).unwrap();
        assert_eq!(
            (a.analysis[0], a.device.as_deref(), a.depth, a.json, a.no_write),
            (Analysis::Oom(20), Some("cpu"), Some(2), true, true)
        );
        // Unknown names list the valid ones; a DB is required; times are checked.
        let err = parse(&["x.db", "--analysis", "decompose,leak"]).unwrap_err().to_string();
        assert!(
            err.contains("unknown analysis `leak`") && err.contains("decompose, inefficient, leaks, sites, oom"),
            "{err}"
        );
        assert!(parse(&["--decompose"]).is_err());
        let err = parse(&["x.db", "--at", "soon"]).unwrap_err().to_string();
        assert!(err.contains("+2.5s"), "{err}");
    }

    #[test]
    fn the_dispatch_table_runs_every_analysis_the_help_lists() {
        use clap::CommandFactory as _;
        let help = Cli::command()
            .find_subcommand_mut("analyze")
            .unwrap()
            .get_arguments()
            .find(|a| a.get_id() == "analysis")
            .and_then(|a| a.get_help().map(|h| h.to_string()))
            .unwrap();
        let listed = help.split_once("names:").unwrap().1.split_once('(').unwrap().0;
        let listed: Vec<&str> = listed.split(',').map(str::trim).collect();
        let table: Vec<&str> = ANALYSES.iter().map(|e| e.name).collect();
        assert_eq!(listed, table, "--help: {help}");
        for name in table {
            let analysis = parse_analysis(name).unwrap();
            assert_eq!(entry(analysis).unwrap().name, name);
            assert_eq!(parse_list(name).unwrap(), [analysis]);
        }
        assert!(parse_list("decompose,nope").is_err());
    }

    #[test]
    fn after_a_trace_the_analyses_run_with_the_defaults_of_the_command_line() {
        let dir = PathBuf::from("/some/run");
        let parsed = parse(&["/some/run", "--analysis", "leaks,oom:3"]).unwrap();
        let built = Args::for_trace(&dir, parse_list("leaks,oom:3").unwrap());
        assert_eq!(format!("{built:?}"), format!("{parsed:?}"));
    }

    #[test]
    fn unimplemented_analyses_fail_before_touching_anything() {
        // Every analysis is implemented now; a bad `oom:K` is refused while parsing, before any DB.
        let err = parse(&["/nonexistent/x.db", "--analysis", "oom:0"]).unwrap_err().to_string();
        assert!(err.contains("K must be a whole number from 1 to 1000"), "{err}");
        assert!(matches!(parse(&["d", "--analysis", "oom"]).unwrap().analysis[0], Analysis::Oom(10)));
    }

    #[test]
    fn decompose_writes_every_device_and_reruns_replace() {
        let run_dir = run_folder("cli-run");
        let db0 = run_dir.join("device_0/dump/memscope_dump_20260101000000.db");
        for _ in 0..2 {
            run(parse(&[run_dir.parent().unwrap().to_str().unwrap(), "--decompose"]).unwrap()).unwrap();
        }
        let rows = decompose_rows(&db0);
        // The HAL peak comes first (+100, before any PTA block), then the end; each with its
        // whole tree, the empty PTA tree as its root alone.
        let want = [
            ("peak", 1_100, "HAL", "", 0, 200, 1),
            ("peak", 1_100, "HAL", "CANN", 1, 200, 1),
            ("peak", 1_100, "HAL", "CANN@APP", 2, 200, 1),
            ("peak", 1_100, "PTA", "", 0, 0, 0),
            ("end", 2_000, "HAL", "", 0, 200, 1),
            ("end", 2_000, "HAL", "CANN", 1, 200, 1),
            ("end", 2_000, "HAL", "CANN@APP", 2, 200, 1),
            ("end", 2_000, "PTA", "", 0, 0, 0),
        ];
        let want: Vec<_> = want
            .iter()
            .map(|(p, ts, f, o, d, b, n)| (p.to_string(), *ts, f.to_string(), o.to_string(), *d, *b, *n))
            .collect();
        assert_eq!(rows, want, "the second run replaced the first's rows");
        let conn = Connection::open(&db0).unwrap();
        let at: String =
            conn.query_row("SELECT value FROM ms_meta WHERE key = 'decompose_at'", [], |r| r.get(0)).unwrap();
        assert!(at.parse::<u64>().unwrap() > 1_600_000_000_000_000_000);
        let metas: i64 =
            conn.query_row("SELECT count(*) FROM ms_meta WHERE key = 'decompose_at'", [], |r| r.get(0)).unwrap();
        assert_eq!(metas, 1);
        for t in memscope_core::store::schema::INSIGHT_OWNED_TABLES {
            let n: i64 =
                conn.query_row("SELECT count(*) FROM sqlite_master WHERE name = ?1", [t], |r| r.get(0)).unwrap();
            assert_eq!(n, 0, "{t} is Insight's");
        }
        // The dump itself is untouched.
        let dump: i64 = conn.query_row("SELECT count(*) FROM memscope_dump", [], |r| r.get(0)).unwrap();
        assert_eq!(dump, 6);
        // Device 1 got its own numbers.
        let rows1 = decompose_rows(&run_dir.join("device_1/dump/memscope_dump_20260101000000.db"));
        assert_eq!(rows1[0].5, 300);
    }

    #[test]
    fn at_replaces_the_defaults_and_no_write_writes_nothing() {
        let run_dir = run_folder("cli-at");
        let db0 = run_dir.join("device_0/dump/memscope_dump_20260101000000.db");
        let before = std::fs::read(&db0).unwrap();
        run(parse(&[db0.to_str().unwrap(), "--at", "+150ns", "--no-write", "--json"]).unwrap()).unwrap();
        assert_eq!(std::fs::read(&db0).unwrap(), before);
        run(parse(&[db0.to_str().unwrap(), "--at", "+150ns,1250"]).unwrap()).unwrap();
        let rows = decompose_rows(&db0);
        assert!(rows.iter().all(|r| r.0 == "at"));
        let roots: Vec<(i64, String, i64)> =
            rows.iter().filter(|r| r.4 == 0).map(|r| (r.1, r.2.clone(), r.5)).collect();
        assert_eq!(
            roots,
            [
                (1_150, "HAL".into(), 200),
                (1_150, "PTA".into(), 0),
                (1_250, "HAL".into(), 200),
                (1_250, "PTA".into(), 100)
            ]
        );
    }

    #[test]
    fn device_filter_picks_one_db_or_says_which_exist() {
        let run_dir = run_folder("cli-device");
        run(parse(&[run_dir.to_str().unwrap(), "--device", "1"]).unwrap()).unwrap();
        assert!(!decompose_rows(&run_dir.join("device_1/dump/memscope_dump_20260101000000.db")).is_empty());
        let conn = Connection::open(run_dir.join("device_0/dump/memscope_dump_20260101000000.db")).unwrap();
        let n: i64 =
            conn.query_row("SELECT count(*) FROM sqlite_master WHERE name = 'ms_decompose'", [], |r| r.get(0)).unwrap();
        assert_eq!(n, 0, "device 0 was not asked for");
        let err = run(parse(&[run_dir.to_str().unwrap(), "--device", "7"]).unwrap()).unwrap_err().to_string();
        assert!(err.contains("no DB of device 7") && err.contains("devices found: 0, 1"), "{err}");
    }

    #[test]
    fn bad_inputs_fail_with_the_problem_named() {
        let d = dir("cli-bad");
        let err = run(parse(&[d.join("none.db").to_str().unwrap()]).unwrap()).unwrap_err();
        assert!(format!("{err:#}").contains("no such file or folder"), "{err:#}");
        std::fs::write(d.join("memscope_dump_1.db"), "garbage").unwrap();
        let err = run(parse(&[d.to_str().unwrap()]).unwrap()).unwrap_err();
        assert!(format!("{err:#}").contains("not an SQLite database"), "{err:#}");
    }

    /// The `Attr` of the MALLOC row of the block at `ptr`.
    fn attr_of(path: &std::path::Path, ptr: u64) -> String {
        let conn = Connection::open(path).unwrap();
        let sql = "SELECT \"Attr\" FROM memscope_dump WHERE \"Event\" = 'MALLOC' AND \"Ptr\" = ?1";
        conn.query_row(sql, [format!("0x{ptr:016x}")], |r| r.get(0)).unwrap()
    }

    fn cli(args: &[&str]) -> anyhow::Result<()> {
        let mut argv = vec!["memscope-bpf", "analyze"];
        argv.extend_from_slice(args);
        Cli::try_parse_from(argv)?.run()
    }

    #[test]
    fn the_cli_runs_it_and_refuses_bad_thresholds_before_touching_the_db() {
        let path = small_trace("out-cli");
        let db = path.to_str().unwrap();
        let before = std::fs::read(&path).unwrap();
        cli(&[db, "--analysis", "inefficient", "--long-idle", "1us", "--no-write", "--json"]).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), before, "--no-write");
        for (bad, says) in [
            ("--long-idle=5", "needs a unit"),
            ("--lazy-used=120%", "below 100%"),
            ("--idle-threshold=0", "0"),
            ("--mem-size=lots", "not a size"),
        ] {
            let err = format!("{:#}", cli(&[db, "--analysis", "inefficient", bad]).unwrap_err());
            assert!(err.contains(says), "{bad}: {err}");
        }
        assert_eq!(std::fs::read(&path).unwrap(), before);
        cli(&[db, "--analysis", "inefficient,decompose", "--idle-threshold", "1", "--mem-size", "1MiB"]).unwrap();
        assert!(attr_of(&path, B).contains("\"inefficient_type\":\"early_allocation,temporary_idleness\""));
        assert!(!attr_of(&path, A).contains("inefficient_type"), "A is below --mem-size");
    }

    #[test]
    fn analyze_leaks_runs_from_the_command_line() {
        let path = noisy_run("leaks-cli", true);
        let run = |args: &[&str]| {
            let mut argv = vec!["memscope-bpf", "analyze", path.to_str().unwrap(), "--analysis", "leaks"];
            argv.extend_from_slice(args);
            Cli::try_parse_from(argv).unwrap().run()
        };
        run(&["--json", "--no-write"]).unwrap();
        assert!(Connection::open(&path).unwrap().prepare("SELECT 1 FROM ms_leaks").is_err(), "--no-write");
        run(&["--warmup-steps", "3", "--min-steps", "2"]).unwrap();
        let conn = Connection::open(&path).unwrap();
        let births: Vec<i64> = conn
            .prepare("SELECT birth_step FROM ms_leaks WHERE kind = 'candidate' ORDER BY birth_step")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(births, (4..=10).collect::<Vec<_>>(), "born after step 3, live at the end of step birth + 2");
        let err = run(&["--step-marker", "nope"]).unwrap_err();
        assert!(format!("{err:#}").contains("--step-marker"), "{err:#}");
    }
}
