//! `memscope-bpf export`: a trace in another tool's format. Unprivileged: it reads the DBs and
//! writes one file, never touching the DBs.

use std::path::PathBuf;

use anyhow::bail;
use memscope_core::analysis::db::DbFile;
use memscope_core::export::{memory_viz, perfetto};

use super::inputs::{self, write_atomically};

/// Write a trace in a format another tool opens.
///
///   memscope-bpf export --format memory-viz msout/memscope_4242_20260101120000_ascend --device 0
///   memscope-bpf export --format memory-viz .../device_0/dump/memscope_dump_*.db -o snapshot.pickle
///   memscope-bpf export --format perfetto msout/memscope_4242_20260101120000_ascend -o trace.json
///
/// memory-viz: the snapshot PyTorch's torch.cuda.memory._snapshot() returns (segments with
/// their blocks at the end of the trace, and every allocator event of the trace in
/// device_traces), pickled: drop it on PyTorch's memory_viz page, or read it with
/// torch/cuda/_memory_viz.py (segsum, trace, segment_plot, trace_plot). The segments are
/// torch_npu's caching-pool segments as the trace saw them taken, its blocks inside them where
/// the allocator placed them, each event and block with its call stack as frames when the trace
/// recorded stacks (trace --call-stack c,python). After an attach, the segments taken before it
/// are unknown: each run of blocks seen in one is written as a segment of just those addresses,
/// live through the whole trace, so every reader (MindStudio Insight's MemSnapDump too) finds
/// each block in a segment. One device.
///
/// perfetto: a Chrome JSON trace for Perfetto's UI (or chrome://tracing): per device, a counter
/// track per owner (live bytes, as analyze --analysis decompose has them at any instant) and per
/// layer, the caching pools' reserved bytes, and instants for steps, marks and OOMs. Every
/// device of the input unless --device names one.
#[derive(Debug, clap::Args)]
#[command(verbatim_doc_comment)]
pub struct Args {
    /// A trace DB (memscope_dump_*.db) or CSV, or a trace's output folder;
    /// msMemScope's own captures too: its CSV (read through a temporary DB) or DB, and its folders (msmemscope_<pid>_<time>_ascend/, memscopeDumpResults/, leaksDumpResults/).
    #[arg(value_name = "DB|DIR")]
    pub input: PathBuf,

    /// The format to write.
    #[arg(long, value_enum)]
    pub format: Format,

    /// Where to write (default: snapshot_<device>.pickle, or trace.json, in the current
    /// folder). An existing file is replaced only once the new one is complete.
    #[arg(short, long, value_name = "FILE")]
    pub output: Option<PathBuf>,

    /// The device whose DB to export: 0, 1, ... (memory-viz: needed when the input holds
    /// several).
    #[arg(long, value_name = "D")]
    pub device: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// PyTorch's memory snapshot (pickle), for memory_viz.
    MemoryViz,
    /// Chrome JSON trace, for Perfetto.
    Perfetto,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let want = args.device.as_deref().map(inputs::normalise_device);
    let candidates = inputs::device_files(&args.input, want)?;
    match args.format {
        Format::MemoryViz => memory_viz_file(&args, candidates),
        Format::Perfetto => perfetto_file(&args, &candidates),
    }
}

fn memory_viz_file(args: &Args, mut candidates: Vec<(DbFile, String)>) -> anyhow::Result<()> {
    if candidates.len() > 1 {
        bail!(
            "{} holds the DBs of devices {}: pick one with --device",
            args.input.display(),
            candidates.iter().map(|(_, d)| d.as_str()).collect::<Vec<_>>().join(", ")
        );
    }
    let (file, device) = candidates.remove(0);
    let Ok(index) = device.parse::<u32>() else {
        bail!("device {device} is not an NPU (memory_viz shows device memory): pick an NPU's DB with --device");
    };
    let output = args.output.clone().unwrap_or_else(|| PathBuf::from(format!("snapshot_{index}.pickle")));
    let (db, _) = inputs::open(&file, "export", inputs::Store::Never)?;
    let summary = write_atomically(&output, |out| Ok(memory_viz::export(&db, index, out)?))?;
    eprintln!(
        "memscope-bpf: wrote {} ({} events; {} segments; {} blocks live at the end, {} bytes requested)",
        output.display(),
        summary.entries,
        summary.segments,
        summary.live_blocks,
        summary.live_requested
    );
    if summary.with_frames > 0 {
        eprintln!("memscope-bpf: {} events carry their call stacks as frames", summary.with_frames);
    }
    if summary.pretrace_segments > 0 {
        eprintln!(
            "memscope-bpf: note: {} segments were taken before the trace started: each is written as the run of \
             addresses its blocks took (its real size is not known), live through the whole trace",
            summary.pretrace_segments
        );
    }
    if summary.outside > 0 {
        eprintln!(
            "memscope-bpf: note: {} live blocks lie where a segment taken before the trace started was, and \
             another is now: they are in the trace, not in the segments",
            summary.outside
        );
    }
    Ok(())
}

fn perfetto_file(args: &Args, candidates: &[(DbFile, String)]) -> anyhow::Result<()> {
    let output = args.output.clone().unwrap_or_else(|| PathBuf::from("trace.json"));
    let dbs = candidates
        .iter()
        .map(|(f, _)| Ok(inputs::open(f, "export", inputs::Store::Never)?.0))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let devices: Vec<perfetto::Device<'_>> = dbs
        .iter()
        .zip(candidates)
        .enumerate()
        .map(|(i, (db, (_, device)))| perfetto::Device {
            db,
            name: if device.parse::<u32>().is_ok() { format!("NPU {device}") } else { format!("device {device}") },
            pid: i as u32 + 1,
        })
        .collect();
    let summary = write_atomically(&output, |out| Ok(perfetto::export(&devices, out)?))?;
    eprintln!(
        "memscope-bpf: wrote {} ({} devices, {} counter tracks, {} counter values, {} instants)",
        output.display(),
        devices.len(),
        summary.tracks,
        summary.counters,
        summary.instants
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use crate::cli::Cli;
    use memscope_core::analysis::testdb::{dir, TestDb};

    fn run(args: &[&str]) -> anyhow::Result<()> {
        let mut argv = vec!["memscope-bpf", "export", "--format", "memory-viz"];
        argv.extend_from_slice(args);
        Cli::try_parse_from(argv).unwrap().run()
    }

    #[test]
    fn a_folder_of_several_devices_needs_device_and_host_memory_is_refused() {
        let run_dir = dir("cli-export");
        for device in ["device_0", "device_1", "device_cpu"] {
            let mut db = TestDb::create(&run_dir.join(device).join("dump").join("memscope_dump_1.db"));
            db.malloc("PTA", 10, 0x1000, 64, None);
        }
        let folder = run_dir.to_str().unwrap();
        let err = format!("{:#}", run(&[folder]).unwrap_err());
        assert!(err.contains("devices 0, 1, cpu") && err.contains("--device"), "{err}");
        let err = format!("{:#}", run(&[folder, "--device", "cpu"]).unwrap_err());
        assert!(err.contains("not an NPU"), "{err}");
        let err = format!("{:#}", run(&[folder, "--device", "7"]).unwrap_err());
        assert!(err.contains("no DB of device 7") && err.contains("found: 0, 1, cpu"), "{err}");
        // And one that works writes the whole file under its name, nothing beside it.
        let out = run_dir.join("snap.pickle");
        run(&[folder, "--device", "npu:1", "-o", out.to_str().unwrap()]).unwrap();
        assert_eq!(std::fs::read(&out).unwrap()[..2], [0x80, 4]);
        let partial = std::fs::read_dir(&run_dir)
            .unwrap()
            .filter_map(Result::ok)
            .any(|e| e.file_name().to_string_lossy().ends_with(".partial"));
        assert!(!partial);
    }
}
