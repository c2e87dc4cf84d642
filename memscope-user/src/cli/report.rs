//! `memscope-bpf report`: a trace (or two, compared) as one self-contained HTML page that opens
//! from disk in any browser. Unprivileged: it reads the DBs and writes one file, never touching
//! the DBs. The aggregation is `memscope_core::report`'s; this verb picks the DBs, shows progress
//! and writes the file whole or not at all.

use std::path::{Path, PathBuf};

use anyhow::bail;
use memscope_core::analysis::db::{self, DumpDb};
use memscope_core::report::{self, compare, html, DeviceReport, Options, Page, Run};

use super::inputs::{self, write_atomically};

/// Write a trace as one HTML page: memory over time by owner, the owner tree at the peak and at
/// any instant clicked, the blocks, the analyses' findings; two traces: what grew.
///
///   memscope-bpf report msout/memscope_4242_20260101120000_ascend
///   memscope-bpf report .../device_0/dump/memscope_dump_1.db -o run.html
///   memscope-bpf report msout/clean_run msout/leaky_run -o grew.html
///
/// The page is one file with everything inside (no network, nothing to install): memory over
/// time per device, stacked by owner as analyze --analysis decompose splits it, with the other
/// layers and the caching pools' reserved bytes as lines, step boundaries, marks and OOMs; drag
/// to zoom, click for the owner tree at that instant (the peak's is shown first); the largest
/// blocks in a sortable, filterable table with their owners, lifetimes, inefficiency flags and
/// call stacks; the analyses' result tables the DB holds (run analyze --analysis
/// leaks/oom/inefficient and advise first to have them); per-step live memory.
///
/// With two traces (A, then B) the page also compares them per device: per-step curves of both
/// and the owners that grew from A to B at the last step both ended (else at their ends).
///
/// Big traces are summarised, never truncated silently: the curves keep each of --points
/// intervals' highest and lowest instant (every peak is exact), the table the --top-blocks
/// largest blocks, and the page lists what was cut.
#[derive(Debug, clap::Args)]
#[command(verbatim_doc_comment)]
pub struct Args {
    /// A trace DB (memscope_dump_*.db) or CSV, or a trace's output folder; a second one to
    /// compare with the first (A, then B). msMemScope's own captures too: its CSV (read through a temporary DB) or DB, and its folders (msmemscope_<pid>_<time>_ascend/, memscopeDumpResults/, leaksDumpResults/).
    #[arg(value_name = "DB|DIR", num_args = 1..=2, required = true)]
    pub inputs: Vec<PathBuf>,

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
}

/// One input's DBs, device by device (in device order), as one run of the page.
fn run_of(input: &Path, want: Option<&str>, options: &Options) -> anyhow::Result<Run> {
    let mut files = inputs::device_files(input, want)?;
    files.sort_by_key(|(_, d)| db::device_order(Some(d)));
    let dbs = files
        .iter()
        .map(|(f, _)| Ok(inputs::open(f, "report", inputs::Store::Never)?.0))
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
        .zip(&files)
        .map(|(db, (_, device))| Ok(report::device(db, device, origin, options)?))
        .collect::<anyhow::Result<Vec<DeviceReport>>>()?;
    Ok(Run { label: input.display().to_string(), origin_ns: origin.to_string(), devices })
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let options = Options {
        buckets: args.points as usize,
        top_blocks: args.top_blocks,
        finding_rows: args.rows,
        ..Options::default()
    };
    let want = args.device.as_deref().map(inputs::normalise_device);
    let runs = args.inputs.iter().map(|i| run_of(i, want, &options)).collect::<anyhow::Result<Vec<Run>>>()?;
    let compare = match runs.as_slice() {
        [a, b] => {
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
        [a, b] => format!("memscope-bpf report: {} vs {}", a.label, b.label),
        _ => format!("memscope-bpf report: {}", runs[0].label),
    };
    let page = Page { tool: "memscope-bpf", version: env!("CARGO_PKG_VERSION"), runs, compare };
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
}
