//! `memscope-bpf report`: a trace (or two, compared) as one self-contained HTML page that opens
//! from disk in any browser. Unprivileged: it reads the DBs and writes one file; the one change
//! it makes to a DB is the analyses' result tables it lacks (as `analyze` stores them, into our
//! DBs only; `--no-analyses` leaves every DB as it is). The aggregation is `memscope_core::
//! report`'s; this verb picks the DBs, shows progress and writes the file whole or not at all.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _};
use memscope_core::analysis::db::{self, DbFile, DumpDb};
use memscope_core::analysis::ranks;
use memscope_core::report::{self, compare, html, DeviceReport, Options, Page, Run};

use super::inputs::{self, write_atomically};
use crate::terminal::say::say;

/// Write a trace as one HTML page: memory over time by owner, the owner tree at the peak and at
/// any instant clicked, the peak by Python stack, the blocks, the analyses' findings; two
/// traces: what grew.
///
///   memscope-bpf report msout/memscope_4242_20260101120000_ascend
///   memscope-bpf report .../device_0/dump/memscope_dump_1.db -o run.html
///   memscope-bpf report msout/clean_run msout/leaky_run -o grew.html
///
/// The page is one file with everything inside (no network, nothing to install): memory over
/// time per device, stacked by owner as analyze --analysis decompose splits it, with the other
/// layers and the caching pools' reserved bytes as lines, step boundaries, marks and OOMs; drag
/// to zoom, click for the owner tree at that instant (the peak's is shown first); the bytes at
/// the peak by the Python stack that allocated them (a flame view, for jobs whose stacks the
/// trace read: its default on CPython); the largest blocks in a sortable, filterable table with their owners, lifetimes, inefficiency flags, the
/// job's line that made each (its site) and call stacks; the analyses' result tables (leaks,
/// OOMs, inefficient memory, the job's lines holding memory: run here when the DB lacks them,
/// unless --no-analyses; advise's come from `memscope-bpf advise`); per-step live memory.
///
/// With two traces (A, then B) the page also compares them per device: per-step curves of both
/// and the owners that grew from A to B at the last step both ended (else at their ends).
///
/// With a job's traces, one per rank (more than two, or folders of several, or --ranks), the
/// page compares the ranks: per rank its peak and the owners then, its growth per step, the
/// ranks that stand out and why (a higher peak by which owners, a leak only there), and a
/// rank × step view; each rank's own curves, tree and blocks are a click away.
///
///   memscope-bpf report node1/msout node2/msout -o job.html
///
/// Big traces are summarised, never truncated silently: the curves keep each of --points
/// intervals' highest and lowest instant (every peak is exact), the table the --top-blocks
/// largest blocks, and the page lists what was cut.
#[derive(Debug, clap::Args)]
#[command(verbatim_doc_comment)]
pub struct Args {
    /// A trace DB (memscope_dump_*.db) or CSV, or a trace's output folder; a second one to
    /// compare with the first (A, then B). msMemScope's own captures too: its CSV (read through a temporary DB) or DB, and its folders (msmemscope_<pid>_<time>_ascend/, memscopeDumpResults/, leaksDumpResults/).
    /// More than two: each trace is a rank of a distributed job (see --ranks).
    #[arg(value_name = "DB|DIR", num_args = 1.., required = true)]
    pub inputs: Vec<PathBuf>,

    /// Take every trace given as a rank of a distributed job: the page gets a Ranks section
    /// (per rank its peak and the owners then, its growth per step, the ranks that stand out
    /// and why, a rank × step view) and a picker of the ranks. The default with more than two
    /// traces, or with folders holding several traces of one device (a daemon's output folder).
    #[arg(long)]
    pub ranks: bool,

    /// Where to write the page. An existing file is replaced only once the new one is complete.
    #[arg(short, long, value_name = "FILE", default_value = "report.html")]
    pub output: PathBuf,

    /// Only this device: 0, 1, ..., cpu (default: every device of the input).
    #[arg(long, value_name = "D")]
    pub device: Option<String>,

    /// Time intervals the curves are cut into; each keeps its highest and lowest instant.
    #[arg(long, value_name = "N", default_value_t = 1000, value_parser = clap::value_parser!(u32).range(10..=100_000))]
    pub points: u32,

    /// Blocks listed in the table (the largest); the rest are counted.
    #[arg(long, value_name = "N", default_value_t = 1000)]
    pub top_blocks: usize,

    /// Rows kept of each analysis result table (ms_leaks, ms_oom, ...).
    #[arg(long, value_name = "N", default_value_t = 2000)]
    pub rows: usize,

    /// Only show the result tables the DBs already hold. By default the analyses the page shows
    /// (inefficient, leaks, oom, sites) run first on each of our DBs that lacks their table,
    /// and store it there as `analyze` does; msMemScope's DBs and CSVs are never written.
    #[arg(long)]
    pub no_analyses: bool,
}

/// One input's DBs, device by device (in device order), as one run of the page.
fn run_of(input: &Path, want: Option<&str>, options: &Options, analyses: bool) -> anyhow::Result<Run> {
    let mut files = inputs::device_files(input, want)?;
    files.sort_by_key(|(_, d)| db::device_order(Some(d)));
    run_of_files(input.display().to_string(), &files, options, analyses)
}

/// These DBs as one run of the page, called `label`.
fn run_of_files(label: String, files: &[(DbFile, String)], options: &Options, analyses: bool) -> anyhow::Result<Run> {
    let store = if analyses { inputs::Store::Default } else { inputs::Store::Never };
    let dbs = files
        .iter()
        .map(|(f, device)| {
            let (db, writable) = inputs::open(f, "report", store)?;
            if writable {
                super::analyze::store_for_report(&db, device)
                    .with_context(|| format!("the analyses of {} for the report failed", f.shown().display()))?;
            }
            Ok(db)
        })
        .collect::<anyhow::Result<Vec<DumpDb>>>()?;
    let mut origin = None;
    for db in &dbs {
        if let Some(first) = report::first_ts(db)? {
            origin = Some(origin.map_or(first, |o: i64| o.min(first)));
        }
    }
    let origin = origin.unwrap_or(0);
    let devices = dbs
        .iter()
        .zip(files)
        .map(|(db, (_, device))| Ok(report::device(db, device, origin, options)?))
        .collect::<anyhow::Result<Vec<DeviceReport>>>()?;
    let identity = match dbs.as_slice() {
        [one] => Some(ranks::identity_of(one)?),
        _ => None,
    };
    Ok(Run { label, origin_ns: origin.to_string(), devices, identity })
}

/// With --ranks, more than two inputs or folders holding several traces: every DB is a run of
/// its own, a rank.
fn rank_runs(args: &Args, want: Option<&str>, options: &Options, analyses: bool) -> anyhow::Result<Option<Vec<Run>>> {
    let explicit = args.ranks || args.inputs.len() > 2;
    let Some(files) = inputs::rank_files(&args.inputs, &[], want, explicit)? else { return Ok(None) };
    say!("memscope-bpf: {} traces, each a rank", files.len());
    let runs = files
        .into_iter()
        .map(|file| run_of_files(file.0.shown().display().to_string(), &[file], options, analyses))
        .collect::<anyhow::Result<Vec<Run>>>()?;
    Ok(Some(runs))
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let options = Options {
        buckets: args.points as usize,
        top_blocks: args.top_blocks,
        finding_rows: args.rows,
        ..Options::default()
    };
    let want = args.device.as_deref().map(inputs::normalise_device);
    let analyses = !args.no_analyses;
    let ranked = rank_runs(&args, want, &options, analyses)?;
    let ranked_mode = ranked.is_some();
    let runs = match ranked {
        Some(runs) => runs,
        None => {
            args.inputs.iter().map(|i| run_of(i, want, &options, analyses)).collect::<anyhow::Result<Vec<Run>>>()?
        }
    };
    let ranks = ranked_mode.then(|| report::ranks(&runs));
    let compare = match runs.as_slice() {
        [a, b] if ranks.is_none() => {
            let pairs = compare::pairs(&a.devices, &b.devices);
            if pairs.is_empty() {
                let names = |r: &Run| r.devices.iter().map(|d| d.device.as_str()).collect::<Vec<_>>().join(", ");
                bail!(
                    "A and B share no device (A: {}; B: {}): compare one device of each, given as DB files or with --device",
                    names(a),
                    names(b)
                );
            }
            pairs
        }
        _ => Vec::new(),
    };
    let title = match runs.as_slice() {
        _ if ranks.is_some() => format!("memscope-bpf report: {} ranks", runs.len()),
        [a, b] => format!("memscope-bpf report: {} vs {}", a.label, b.label),
        _ => format!("memscope-bpf report: {}", runs[0].label),
    };
    let page = Page { tool: "memscope-bpf", version: env!("CARGO_PKG_VERSION"), runs, compare, ranks };
    let size = write_atomically(&args.output, |out| Ok(html::write(&page, &title, out)?))?;
    let devices: usize = page.runs.iter().map(|r| r.devices.len()).sum();
    let notes: usize = page.runs.iter().flat_map(|r| &r.devices).map(|d| d.summarised.len()).sum();
    eprintln!(
        "memscope-bpf: wrote {} ({:.1} MiB; {} device trace(s){}); open it in a browser",
        args.output.display(),
        size as f64 / (1024.0 * 1024.0),
        devices,
        if notes > 0 { format!("; {notes} summaries listed at the page's end") } else { String::new() }
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use crate::cli::Cli;
    use memscope_core::analysis::testdb::{dir, TestDb};

    fn run(args: &[&str]) -> anyhow::Result<()> {
        let mut argv = vec!["memscope-bpf", "report"];
        argv.extend_from_slice(args);
        Cli::try_parse_from(argv).unwrap().run()
    }

    #[test]
    fn a_page_is_written_whole_and_runs_without_a_common_device_are_refused() {
        let base = dir("cli-report");
        for (run, device) in [("a", "device_0"), ("b", "device_1"), ("b", "device_2")] {
            let mut db = TestDb::create(&base.join(run).join(device).join("dump").join("memscope_dump_1.db"));
            db.malloc("PTA", 10, 0x1000, 64, Some("PTA@w"));
        }
        let (a, b) = (base.join("a"), base.join("b"));
        let page = base.join("page.html");
        let p = page.to_str().unwrap();
        let err = format!("{:#}", run(&[a.to_str().unwrap(), b.to_str().unwrap(), "-o", p]).unwrap_err());
        assert!(err.contains("share no device") && err.contains("A: 0; B: 1, 2"), "{err}");
        assert!(!page.exists());
        let err = format!("{:#}", run(&[b.to_str().unwrap(), "--device", "7", "-o", p]).unwrap_err());
        assert!(err.contains("no DB of device 7"), "{err}");
        run(&[b.to_str().unwrap(), "-o", p]).unwrap();
        let html = std::fs::read_to_string(&page).unwrap();
        assert!(html.starts_with("<!doctype html>") && html.trim_end().ends_with("</html>"));
        assert_eq!(html.matches("\"device\":\"").count(), 2, "both devices of b are in the page");
        assert!(!html.contains("src=\"http") && !html.contains("href=\"http"), "nothing is loaded from the network");
        let partial = std::fs::read_dir(&base)
            .unwrap()
            .filter_map(Result::ok)
            .any(|e| e.file_name().to_string_lossy().ends_with(".partial"));
        assert!(!partial);
    }

    /// Three traces are ranks: the page carries their comparison, each trace a run of its own.
    #[test]
    fn more_than_two_traces_are_compared_as_ranks() {
        use memscope_core::analysis::steps::testrows::noisy_run;
        let dbs: Vec<String> = (0..3)
            .map(|r| {
                let db = noisy_run(&format!("cli-report-rank{r}"), r == 1);
                let conn = rusqlite::Connection::open(&db).unwrap();
                conn.execute("INSERT INTO ms_meta (key, value) VALUES ('rank', ?1)", [r.to_string()]).unwrap();
                db.display().to_string()
            })
            .collect();
        let page = dir("cli-report-ranks").join("ranks.html");
        let mut argv: Vec<&str> = dbs.iter().map(String::as_str).collect();
        argv.extend(["--no-analyses", "-o", page.to_str().unwrap()]);
        run(&argv).unwrap();
        let html = std::fs::read_to_string(&page).unwrap();
        let data = html.split("id=\"memscope-data\">").nth(1).unwrap().split("</script>").next().unwrap();
        let data: serde_json::Value = serde_json::from_str(data).unwrap();
        assert_eq!(data["runs"].as_array().unwrap().len(), 3);
        let job = &data["ranks"]["jobs"][0];
        assert_eq!(job["job"], serde_json::Value::Null);
        assert_eq!(job["outliers"].as_array().unwrap().len(), 1, "{job:#}");
        assert_eq!(job["outliers"][0]["rank"], 1, "{job:#}");
        assert_eq!(job["ranks"][1]["label"], data["runs"][1]["label"], "a rank is found by its run's label");
    }

    fn tables(db: &std::path::Path) -> Vec<String> {
        let conn = rusqlite::Connection::open(db).unwrap();
        let mut stmt = conn.prepare("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name").unwrap();
        stmt.query_map([], |r| r.get(0)).unwrap().map(Result::unwrap).collect()
    }

    /// The page shows findings, not the commands that would make them: the analyses it shows
    /// run on a DB that lacks their tables (and store them, as `analyze` does); with
    /// --no-analyses the DB is left as it is and the page says which command writes each.
    #[test]
    fn report_runs_the_analyses_it_shows_unless_told_not_to() {
        let db = memscope_core::analysis::steps::testrows::noisy_run("cli-report-analyses", true);
        let path = db.to_str().unwrap();
        let page = db.with_file_name("page.html");
        let before = tables(&db);
        run(&[path, "--no-analyses", "-o", page.to_str().unwrap()]).unwrap();
        assert_eq!(tables(&db), before, "--no-analyses writes nothing");
        let html = std::fs::read_to_string(&page).unwrap();
        assert!(
            html.contains("\"table\":\"ms_leaks\",") && html.contains("\"present\":false"),
            "the commands are named"
        );
        run(&[path, "-o", page.to_str().unwrap()]).unwrap();
        let after = tables(&db);
        for table in ["ms_inefficient", "ms_leaks", "ms_oom", "ms_sites"] {
            assert!(after.iter().any(|t| t == table), "{table} in {after:?}");
        }
        let html = std::fs::read_to_string(&page).unwrap();
        let leaks = html.split("\"table\":\"ms_leaks\",").nth(1).unwrap();
        assert!(
            leaks.starts_with("\"title\":\"Leak candidates\"") && leaks.contains("\"present\":true"),
            "{leaks:.300}"
        );
        assert!(leaks.contains("\"candidate\""), "the leak is a row: {leaks:.600}");
    }
}
