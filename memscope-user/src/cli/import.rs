//! `import`: msMemScope's dump CSVs, and PyTorch's and torch_npu's memory snapshots, into DBs,
//! once, for Insight (which opens only DBs) and for reruns of the offline verbs (which otherwise
//! import them into a temporary DB each time).

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
///
/// A memory snapshot (the pickle torch.cuda.memory._dump_snapshot() or
/// torch.npu.memory._dump_snapshot() writes) becomes a trace folder: <name>_memscope/device_<n>/
/// dump/memscope_dump_<time>.db per device (with -o, that folder), its entries as block and
/// segment rows, its frames as call stacks, and the segments that existed before its first entry
/// (the snapshot keeps only the last events) first. No pickle's code is ever run.
///   memscope-bpf import msmemscope_3290097_20250101120000_ascend/
///   memscope-bpf import baseline.csv -o baseline.db
///   memscope-bpf import snapshot.pickle
#[derive(Debug, clap::Args)]
#[command(verbatim_doc_comment)]
pub struct Args {
    /// Dump CSVs, or folders laid out as msMemScope's (msmemscope_<pid>_<time>_ascend/,
    /// memscopeDumpResults/, device_<n>/, leaksDumpResults/): every dump CSV under them; or
    /// memory snapshot pickles.
    #[arg(value_name = "CSV|DIR|PICKLE", required = true)]
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
    let (snapshots, csv_inputs): (Vec<PathBuf>, Vec<PathBuf>) = args.inputs.iter().cloned().partition(|p| {
        p.is_file() && memscope_core::import::sniff(p).is_ok_and(|k| k == memscope_core::import::Kind::Pickle)
    });
    for pickle in &snapshots {
        import_snapshot(&args, pickle)?;
    }
    if csv_inputs.is_empty() {
        return Ok(());
    }
    let args = Args { inputs: csv_inputs, ..args };
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

/// What a snapshot's import made, in one line.
pub fn snapshot_summary(pickle: &Path, got: &[memscope_core::import::SnapshotDevice]) -> String {
    let devices: Vec<String> = got
        .iter()
        .map(|d| {
            let before = if d.segments_before + d.blocks_before > 0 {
                format!(
                    ", {} segment(s) and {} block(s) from before its first entry (the snapshot keeps only the last events)",
                    d.segments_before, d.blocks_before
                )
            } else {
                String::new()
            };
            let timed = if d.timed || d.entries == 0 { "" } else { ", no times (torch_npu's): entries 1 µs apart" };
            format!("device {}: {} entries, {} rows{before}{timed}", d.device, d.entries, d.rows)
        })
        .collect();
    format!("read the memory snapshot {} ({})", pickle.display(), devices.join("; "))
}

/// A snapshot into a trace folder: `<stem>_memscope/device_<n>/dump/memscope_dump_<time>.db`.
fn import_snapshot(args: &Args, pickle: &Path) -> anyhow::Result<()> {
    let stem = pickle.file_stem().map_or_else(|| "snapshot".into(), |s| s.to_string_lossy().into_owned());
    let out = args.output.clone().unwrap_or_else(|| pickle.with_file_name(format!("{stem}_memscope")));
    if out.exists() && !args.force {
        bail!(
            "{} exists already (from an earlier import?); pass --force to replace it, or -o to write elsewhere",
            out.display()
        );
    }
    if out.exists() {
        // --force: the DBs an earlier import made there go (they are named by time, so the new
        // ones would not replace them); nothing else in the folder is touched.
        for db in db::discover(&out).unwrap_or_default() {
            std::fs::remove_file(&db.path).with_context(|| format!("cannot replace {}", db.path.display()))?;
        }
    }
    let time = now_stamp();
    let dest = |d: &str| out.join(format!("device_{d}/dump/memscope_dump_{time}.db"));
    // The folders first: the import writes each DB beside its final name.
    let snap_devices = memscope_core::import::import_snapshot(pickle, |d| {
        let path = dest(d);
        if let Some(dir) = path.parent() {
            // 0700, as a trace's run folder is.
            use std::os::unix::fs::DirBuilderExt as _;
            let _ = std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir);
        }
        path
    })?;
    say!("memscope-bpf: {}", snapshot_summary(pickle, &snap_devices));
    say!(
        "memscope-bpf: analyse it with `memscope-bpf analyze {}`, or open its DBs in MindStudio Insight",
        out.display()
    );
    Ok(())
}

/// Now, as trace folders name their DBs (local `YYYYmmddHHMMSS`).
fn now_stamp() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    memscope_core::store::layout::local_stamp(i64::try_from(secs).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A two-device snapshot pickled by Python: one trace folder, a DB per device; again only
    /// with --force, which replaces the DBs rather than adding to them.
    #[test]
    fn a_snapshot_becomes_a_trace_folder_of_one_db_per_device() {
        let dir = std::env::temp_dir().join(format!("memscope-import-snapshot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pickle = dir.join("snap.pickle");
        let script = "import pickle, sys\n\
            e = lambda a, addr, size: {'action': a, 'addr': addr, 'size': size, 'stream': 0, 'time_us': 5}\n\
            t = [e('segment_alloc', 1 << 30, 2 << 20), e('alloc', 1 << 30, 4096)]\n\
            pickle.dump({'segments': [], 'device_traces': [t, t], 'allocator_settings': {}}, open(sys.argv[1], 'wb'))";
        let Ok(out) = std::process::Command::new("python3").args(["-c", script]).arg(&pickle).output() else {
            eprintln!("skipped: no python3 to write the snapshot with");
            return;
        };
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let args = |force| Args { inputs: vec![pickle.clone()], output: None, force };
        run(args(false)).unwrap();
        let folder = dir.join("snap_memscope");
        let dbs = |d: &str| std::fs::read_dir(folder.join(format!("device_{d}/dump"))).unwrap().count();
        assert_eq!((dbs("0"), dbs("1")), (1, 1));
        let err = run(args(false)).unwrap_err().to_string();
        assert!(err.contains("exists already") && err.contains("--force"), "{err}");
        std::thread::sleep(std::time::Duration::from_millis(1100)); // a new time in the DB's name
        run(args(true)).unwrap();
        assert_eq!((dbs("0"), dbs("1")), (1, 1), "replaced, not added");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
