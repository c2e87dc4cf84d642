//! `memscope-bpf advise`: allocator settings for the traced job, from its DBs. Unprivileged: it
//! reads the DBs and adds `ms_fragmentation` and `ms_advice` to them (unless `--no-write`).
//! [`advise_text`] is the same report for the end of `trace`, which only prints.

use std::path::PathBuf;

use anyhow::Context as _;
use memscope_core::analysis::contract::{self, Advise, AdviseOptions, Analysis as _};
use memscope_core::analysis::{advise, simulate};

use super::inputs;

/// Recommend allocator settings for a traced job, each with the evidence that triggered it.
///
///   memscope-bpf advise msout/memscope_4242_20260101120000_ascend
///   memscope-bpf advise .../device_0/dump/memscope_dump_20260101120000.db --json
///
/// Reads the job's allocator settings at the start (PYTORCH_NPU_ALLOC_CONF and the others the
/// trace stored from its environment) and what the caching allocator did: fragmentation over
/// time (reserved − allocated, the largest free piece inside cached segments, splits), growth of
/// reserved memory that fragmentation forced, big segments held by small blocks, cache flushes at
/// a ceiling, failed allocations, processes sharing the device, blocks freed while another stream
/// still used them, and the workspaces of ATB operations (ATB_START/ATB_END rows: kernel scratch
/// and intermediate tensors) against the device's peak. Recommends, only on evidence and never
/// what is already set: PYTORCH_NPU_ALLOC_CONF expandable_segments:True, max_split_size_mb,
/// garbage_collection_threshold, torch_npu.npu.set_per_process_memory_fraction,
/// MULTI_STREAM_MEMORY_REUSE (when blocks freed while another stream still used them made the
/// pool grow), gc.collect() at epoch ends (when, at the peak, tensors from earlier steps were
/// held by reference cycles until Python's garbage collector freed them), and
/// ATB_WORKSPACE_MEM_ALLOC_ALG_TYPE=3 (when an ATB operation's intermediate tensors were at least
/// 10% and 1 MiB of the device's peak while the variable was unset or ATB's default 1; with
/// ATB_WORKSPACE_MEM_ALLOC_GLOBAL=1 if that is unset). The samples, the advice and the replays'
/// curves are written into each DB as tables ms_fragmentation, ms_advice and ms_simulation.
///
/// Each recommended allocator setting is also replayed: the job's tensor requests and frees, in
/// order and per stream, go through a model of the caching allocator (PyTorch's rules with
/// torch_npu's differences, docs/simulate.md) under that setting, which says what peak reserved
/// memory, segments and OOMs it would have given, and ranks them. The replay under the job's own
/// settings is compared with the segments the allocator really took, and that agreement is
/// printed first ("replay matches the recorded run: 52/52 segments"). --simulate replays any
/// other setting:
///
///   memscope-bpf advise RUN --simulate expandable_segments:True --simulate max_split_size_mb:128
///   memscope-bpf advise RUN --capacity 64GiB --simulate per_process_memory_fraction:0.5
#[derive(Debug, clap::Args)]
#[command(verbatim_doc_comment)]
pub struct Args {
    /// Traces: DBs (memscope_dump_*.db) or CSVs, or folders: a trace's output folder, the folder
    /// holding such folders, or one device_<id>/. One report per DB, in device order.
    /// msMemScope's own captures too: its CSV (read through a temporary DB) or DB, and its folders (msmemscope_<pid>_<time>_ascend/, memscopeDumpResults/, leaksDumpResults/).
    /// And PyTorch's or torch_npu's memory snapshot (the pickle _dump_snapshot() writes).
    #[arg(value_name = "DB|DIR", required = true)]
    pub inputs: Vec<PathBuf>,

    /// Print JSON instead of text: an array of {db, device, settings, measured, recommendations:
    /// [{id, variable, setting, value, current, why, evidence, conflicts_with, predicted,
    /// predicted_rank}], recorded, baseline, reproduction, simulations, notes}, one per DB;
    /// `value` is the variable's whole new value (run the job with variable=value).
    #[arg(long)]
    pub json: bool,

    /// Only the DB of this device: 0, 1, ..., cpu, unknown.
    #[arg(long, value_name = "D")]
    pub device: Option<String>,

    /// Only print: open the DBs read-only and write no tables.
    #[arg(long)]
    pub no_write: bool,

    /// Replay the job's requests under this allocator setting (repeatable): a
    /// PYTORCH_NPU_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF string applied over the job's own
    /// (expandable_segments, max_split_size_mb, garbage_collection_threshold,
    /// roundup_power2_divisions), and per_process_memory_fraction:F for the fraction (needs
    /// --capacity). JSON: `simulations`, one object per setting, beside `recorded`.
    #[arg(long, value_name = "SETTING")]
    pub simulate: Vec<String>,

    /// The device's memory, for the fraction and for OOMs in the replay (e.g. 64GiB); without it
    /// the replayed device never runs out.
    #[arg(long, value_name = "BYTES", value_parser = memscope_core::units::parse_bytes)]
    pub capacity: Option<u64>,

    /// The per-process memory fraction the job itself ran with
    /// (torch.npu.set_per_process_memory_fraction, which the trace does not see); needs --capacity.
    #[arg(long, value_name = "F", requires = "capacity")]
    pub fraction: Option<f64>,

    /// Store the results also in msMemScope's own DBs (by default they are only printed for
    /// those, so a capture is never changed unasked; ours always get them).
    #[arg(long, conflicts_with = "no_write")]
    pub write: bool,
}

/// The advice for the DBs of a finished trace, as text (for the end of `trace`); reads only.
/// Host memory (`device_cpu`) has no caching pool: it is shown only when CPU tensors were held
/// by reference cycles (the one rule about host memory).
pub fn advise_text(db_paths: &[PathBuf]) -> anyhow::Result<String> {
    let mut out = Vec::new();
    for file in inputs::files(db_paths)? {
        let (db, _) = inputs::open(&file, "advise", inputs::Store::Never)?;
        let device = inputs::device_of(&file, &db)?;
        let options = AdviseOptions { device, ..AdviseOptions::default() };
        let report = Advise::analyse(&db, &options)?;
        let host_advice = report.0.recommendations.iter().any(|r| r.id == advise::GC_AT_EPOCH_END);
        if file.device.as_deref() == Some("cpu") && !host_advice {
            continue;
        }
        out.push(Advise::text(&report, file.shown(), &options.device, &options));
    }
    Ok(out.join("\n"))
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let simulate = simulate::Options {
        settings: args.simulate.clone(),
        fraction: args.fraction,
        capacity: args.capacity,
        ..simulate::Options::default()
    };
    // A setting the allocators refuse fails before any DB is read.
    simulate::check("", &simulate)?;
    let want = args.device.as_deref().map(inputs::normalise_device);
    let files = inputs::files(&args.inputs)?;
    let run_wall_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    let mut texts = Vec::new();
    let mut json = Vec::new();
    let mut found = Vec::new();
    for file in &files {
        // Opened for writing first: a read-only file fails here, not after the analysis.
        let (db, write) = inputs::open(file, "advise", inputs::Store::from_flags(args.write, args.no_write))?;
        let device = inputs::device_of(file, &db)?;
        found.push(device.clone());
        if want.is_some_and(|w| !inputs::is_device(&device, w)) {
            continue;
        }
        let store_at = write.then_some(run_wall_ns);
        let options = AdviseOptions { device, simulate: simulate.clone() };
        let done = contract::run::<Advise>(&db, &options.device, &options, args.json, store_at)?;
        if let Some(line) = done.stored {
            crate::terminal::say::say!("memscope-bpf: {line}");
        }
        texts.extend(done.text);
        json.extend(done.json);
    }
    if let Some(w) = want {
        if texts.is_empty() && json.is_empty() {
            return Err(inputs::no_such_device(w, found));
        }
    }
    let text = if args.json {
        serde_json::to_string_pretty(&json).context("cannot format the JSON report")? + "\n"
    } else {
        texts.join("\n")
    };
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => r.context("cannot write to stdout"),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;
    use crate::cli::{Cli, Command};
    use memscope_core::analysis::fragmentation::fx::Fx;

    fn parse(argv: &[&str]) -> Result<Args, clap::Error> {
        let mut full = vec!["memscope-bpf", "advise"];
        full.extend_from_slice(argv);
        match Cli::try_parse_from(full)?.command {
            Command::Advise(args) => Ok(args),
            other => panic!("parsed as {other:?}"),
        }
    }

    /// A fragmenting pool in a trace folder's layout (device 0), and a host-memory DB beside it.
    fn run_folder(name: &str) -> PathBuf {
        const M: u64 = 1 << 20;
        let mut fx = Fx::new(name);
        for base in [0x1000_0000u64, 0x2000_0000, 0x3000_0000] {
            fx.segment(1, base, 20 * M, false);
            for i in 0..3 {
                fx.block(1, base + i * 6 * M, 6 * M, "PTA");
            }
            fx.free(1, base + 6 * M, 6 * M);
        }
        for base in [0x4000_0000u64, 0x5000_0000] {
            fx.segment(1, base, 12 * M, false);
            fx.block(1, base, 12 * M, "PTA");
        }
        let flat = fx.stop();
        let run = flat.parent().unwrap().join("memscope_1_20260101000000_ascend");
        for dev in ["0", "cpu"] {
            let dump = run.join(format!("device_{dev}/dump"));
            std::fs::create_dir_all(&dump).unwrap();
            std::fs::copy(&flat, dump.join("memscope_dump_20260101000000.db")).unwrap();
        }
        std::fs::remove_file(&flat).unwrap();
        run
    }

    #[test]
    fn arguments_parse() {
        let a = parse(&["x.db", "y", "--json", "--device", "npu:1", "--no-write"]).unwrap();
        assert_eq!(a.inputs, [PathBuf::from("x.db"), PathBuf::from("y")]);
        assert!(a.json && a.no_write);
        assert_eq!(a.device.as_deref(), Some("npu:1"));
        assert!(parse(&["--json"]).is_err(), "a DB is required");
    }

    #[test]
    fn advice_is_printed_and_stored_per_db() {
        let run_dir = run_folder("cli-advise");
        let db0 = run_dir.join("device_0/dump/memscope_dump_20260101000000.db");
        run(parse(&[run_dir.to_str().unwrap(), "--device", "0"]).unwrap()).unwrap();
        let conn = rusqlite::Connection::open(&db0).unwrap();
        let setting: String = conn.query_row("SELECT setting FROM ms_advice", [], |r| r.get(0)).unwrap();
        assert_eq!(setting, "expandable_segments:True");
        let samples: i64 = conn.query_row("SELECT count(*) FROM ms_fragmentation", [], |r| r.get(0)).unwrap();
        assert!(samples >= 2);
        // The other device was not asked for.
        let cpu = rusqlite::Connection::open(run_dir.join("device_cpu/dump/memscope_dump_20260101000000.db")).unwrap();
        let n: i64 =
            cpu.query_row("SELECT count(*) FROM sqlite_master WHERE name = 'ms_advice'", [], |r| r.get(0)).unwrap();
        assert_eq!(n, 0);
        let err = run(parse(&[run_dir.to_str().unwrap(), "--device", "7"]).unwrap()).unwrap_err().to_string();
        assert!(err.contains("no DB of device 7") && err.contains("devices found: 0, cpu"), "{err}");
        // The text for the end of `trace` leaves host memory out and writes nothing.
        let before = std::fs::read(&db0).unwrap();
        let text = advise_text(std::slice::from_ref(&run_dir)).unwrap();
        assert!(text.starts_with("device 0: ") && !text.contains("device cpu"), "{text}");
        assert!(text.contains("1. PYTORCH_NPU_ALLOC_CONF=expandable_segments:True"), "{text}");
        assert_eq!(std::fs::read(&db0).unwrap(), before);
    }

    #[test]
    fn no_write_leaves_the_file_as_it_was() {
        let run_dir = run_folder("cli-advise-nowrite");
        let db0 = run_dir.join("device_0/dump/memscope_dump_20260101000000.db");
        let before = std::fs::read(&db0).unwrap();
        run(parse(&[db0.to_str().unwrap(), "--no-write", "--json"]).unwrap()).unwrap();
        assert_eq!(std::fs::read(&db0).unwrap(), before);
    }

    #[test]
    fn bad_inputs_fail_with_the_problem_and_the_fix() {
        let d = memscope_core::analysis::testdb::dir("cli-advise-bad");
        let err = run(parse(&[d.join("none.db").to_str().unwrap()]).unwrap()).unwrap_err();
        assert!(
            format!("{err:#}").contains("no such file or folder; give a memscope_dump_*.db or .csv file"),
            "{err:#}"
        );
        let junk = d.join("memscope_dump_1.db");
        std::fs::write(&junk, "not a database").unwrap();
        let err = run(parse(&[junk.to_str().unwrap()]).unwrap()).unwrap_err();
        assert!(format!("{err:#}").contains("not an SQLite database"), "{err:#}");
        assert_eq!(std::fs::read(&junk).unwrap(), b"not a database");
        let empty = memscope_core::analysis::testdb::dir("cli-advise-empty");
        let err = run(parse(&[empty.to_str().unwrap()]).unwrap()).unwrap_err();
        assert!(format!("{err:#}").contains("no trace under this folder"), "{err:#}");
    }
}
