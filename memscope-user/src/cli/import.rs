//! `import`: msMemScope's dump CSVs into DBs, once, for Insight (which opens only DBs) and for
//! reruns of the offline verbs (which otherwise import a CSV into a temporary DB each time).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _};
use memscope_core::analysis::db::{self, DbFile, Format};

use crate::terminal::say::say;

/// Import msMemScope's dump CSVs into DBs, once: for Insight, and for faster reruns of the other verbs.
///
/// Each CSV (memscope_dump_*.csv, the older leaks_dump_*.csv, or any file whose first line is the
/// dump header) becomes an SQLite DB with the same rows, which Insight and every offline verb
/// open. Each DB goes beside its CSV, under the same name ending in .db
/// (Insight opens memscope_dump_<digits>.db); with -o, into that file (one CSV) or folder (the
/// inputs' layout kept under it). The other verbs take CSVs too, through a temporary DB; import
/// once to keep it.
///   memscope-bpf import msmemscope_3290097_20250101120000_ascend/
///   memscope-bpf import baseline.csv -o baseline.db
#[derive(Debug, clap::Args)]
#[command(verbatim_doc_comment)]
pub struct Args {
    /// Dump CSVs, or folders laid out as msMemScope's (msmemscope_<pid>_<time>_ascend/,
    /// memscopeDumpResults/, device_<n>/, leaksDumpResults/): every dump CSV under them.
    #[arg(value_name = "CSV|DIR", required = true)]
    pub inputs: Vec<PathBuf>,

    /// Where the DBs go: a .db file for one CSV, else a folder (made if missing) that receives
    /// each CSV's folders below its input. Default: beside each CSV.
    #[arg(short, long, value_name = "PATH")]
    pub output: Option<PathBuf>,

    /// Replace DBs that exist already.
    #[arg(long)]
    pub force: bool,
}

/// One CSV to import, and where its DB goes.
struct Job {
    csv: PathBuf,
    db: PathBuf,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let jobs = plan(&args)?;
    for job in &jobs {
        if let Some(dir) = job.db.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("cannot make {}", dir.display()))?;
        }
        let started = std::time::Instant::now();
        let mut bar = crate::terminal::progress::bytes(crate::terminal::progress::label("import", &job.csv));
        let got = memscope_core::import::import_csv(&job.csv, &job.db, args.force, &mut bar)?;
        say!(
            "memscope-bpf: imported {} into {} ({} rows of device{} {}{}{}{}; {:.1} s)",
            job.csv.display(),
            job.db.display(),
            got.rows,
            if got.devices.len() == 1 { "" } else { "s" },
            got.devices.join(", "),
            if got.out_of_order > 0 {
                format!("; {} rows out of time order, as msMemScope writes them", got.out_of_order)
            } else {
                String::new()
            },
            if got.missing_columns.is_empty() {
                String::new()
            } else {
                format!("; no {} column", got.missing_columns.join(", "))
            },
            if got.micros { "; timestamps were µs (msLeaks'), now ns" } else { "" },
            started.elapsed().as_secs_f64()
        );
    }
    if let [job] = jobs.as_slice() {
        say!(
            "memscope-bpf: analyse it with `memscope-bpf analyze {}`, or open it in MindStudio Insight",
            job.db.display()
        );
    }
    Ok(())
}

/// Every CSV of the inputs, with its DB's path; refused whole (before anything is written) when
/// an input holds no CSV or a DB is in the way.
fn plan(args: &Args) -> anyhow::Result<Vec<Job>> {
    let mut jobs = Vec::new();
    for input in &args.inputs {
        let found = db::discover(input)?;
        // A CSV imported before is hidden by its DB; --force imports it again.
        let again = found.iter().filter(|f| args.force && f.format == Format::Db).filter_map(|f| {
            let csv = f.path.with_extension("csv");
            let dump = memscope_core::import::sniff(&csv).is_ok_and(|k| k == memscope_core::import::Kind::DumpCsv);
            dump.then(|| DbFile::new(csv, Format::Csv))
        });
        let csvs: Vec<DbFile> =
            found.iter().filter(|f| f.format == Format::Csv).cloned().chain(again.collect::<Vec<_>>()).collect();
        if csvs.is_empty() {
            bail!("{}: no msMemScope dump CSV here to import (a folder whose CSVs were imported already holds their DBs, which the verbs read as they are)", input.display());
        }
        for f in csvs {
            let db = destination(args, input, &f.path)?;
            jobs.push(Job { csv: f.path, db });
        }
    }
    if args.output.as_ref().is_some_and(|o| o.extension().is_some_and(|e| e == "db")) && jobs.len() > 1 {
        bail!("-o names one .db file, but {} CSVs are to be imported; give a folder instead", jobs.len());
    }
    for job in &jobs {
        if job.db.exists() && !args.force {
            bail!(
                "{} exists already (from an earlier import?); pass --force to replace it, or -o to write elsewhere",
                job.db.display()
            );
        }
    }
    Ok(jobs)
}

/// Where the DB of `csv` (found under `input`) goes.
fn destination(args: &Args, input: &Path, csv: &Path) -> anyhow::Result<PathBuf> {
    let Some(out) = &args.output else { return Ok(csv.with_extension("db")) };
    if out.extension().is_some_and(|e| e == "db") {
        return Ok(out.clone());
    }
    let name = csv.with_extension("db");
    let below = if input.is_dir() {
        let base = input.file_name().map(PathBuf::from).unwrap_or_default();
        base.join(name.strip_prefix(input).unwrap_or(&name))
    } else {
        PathBuf::from(name.file_name().context("a CSV file has a name")?)
    };
    Ok(out.join(below))
}
