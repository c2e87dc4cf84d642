//! The flags `trace` and `daemon` share: how long, how rows are written, which functions are
//! probed, how big the ring is, and what the person watching sees. One definition, so that the
//! two verbs cannot drift apart in a name, a default or a check; each verb adds its own
//! (`--output` too: their defaults differ).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::bail;
use memscope_core::store::{DbWriter, Format};

use super::parse_duration;
use crate::attach::ProbeSet;
use crate::capture;
use crate::terminal::say::{note, say};
use crate::terminal::status::Mode;

/// The default ring buffer, in MiB: as many call records as the 64 MiB ring held when every call
/// record carried a 136-byte text field (64 MiB / 288 bytes in the ring: about 233k), in half the
/// memory. Each sample takes the record and the kernel's 8-byte header.
const DEFAULT_RING_MB: u32 = 32;
const _: () = assert!(
    DEFAULT_RING_MB as usize * (1 << 20) / (std::mem::size_of::<memscope_common::record::CallRecord>() + 8)
        >= 64 * (1 << 20) / (280 + 8)
);

#[derive(Debug, clap::Args)]
pub struct CaptureArgs {
    /// Stop after this long (e.g. 30, 30s, 5m, 24h). Default: until a stop signal (SIGINT,
    /// SIGTERM; SIGHUP too for `trace`), or for `trace` until the traced processes have exited.
    #[arg(short, long, value_name = "TIME", value_parser = parse_duration)]
    pub duration: Option<Duration>,

    /// Output format: db (SQLite, what MindStudio Insight opens) or csv (msMemScope's CSV).
    #[arg(long, value_enum, default_value_t = Format::Db)]
    pub format: Format,

    /// How the DB's rows are written: pages (whole B-tree pages, the fast writer; plain SQL takes
    /// over by itself where pages cannot be used, e.g. a build without SQLite's sqlite_dbpage or
    /// while another process has the DB open) or sql (plain SQL inserts throughout). Both give
    /// the same rows; `ms_meta.writer` says which ran.
    #[arg(long, value_enum, value_name = "WRITER", default_value_t = DbWriter::Pages)]
    pub writer: DbWriter,

    /// Where a library exports both aclrtX and aclrtXImpl: probe the Impl only (default, one
    /// trap per call) or both (all: each call still recorded once).
    #[arg(long, value_enum, value_name = "SET", default_value_t = ProbeSet::Default)]
    pub probe_set: ProbeSet,

    /// Ring buffer size in MiB, a power of two (the daemon's jobs share one). Larger rides out
    /// longer bursts without losses: 32 MiB holds about 233k calls waiting (144 bytes each;
    /// calls with a text argument take 280), and is that much of the tracer's RSS (see
    /// docs/benchmarks.md).
    #[arg(long, value_name = "MIB", default_value_t = DEFAULT_RING_MB)]
    pub ring_mb: u32,

    /// Print only errors and the final summary: no live status, and none of the daemon's lines
    /// for each job's start and end.
    #[arg(short, long)]
    pub quiet: bool,

    /// The live status as one JSON object per second on stdout, for programs: elapsed_s,
    /// calls, calls_per_s, lost, devices [{device, live_bytes, peak_bytes, out_of_memory}],
    /// owners [{device, owner, bytes}] largest first, step, last_oom [device, seconds ago]
    /// (the daemon's name each running job). Without it the status is an area redrawn in place
    /// when stderr is a terminal; otherwise `trace` writes a plain line every 10 s and the
    /// daemon none (its jobs' starts and ends are what a journal wants).
    #[arg(long)]
    pub json: bool,

    /// How often to read the driver's own figures (each device's used and total memory, each
    /// traced process's usage: what npu-smi or nvidia-smi shows), or `off`. They go into table
    /// ms_driver and onto START_TRACE (free, total); `analyze --analysis unexplained` puts them
    /// against the traced calls. Read through libdcmi.so (Ascend) or libnvidia-ml.so.1 (NVIDIA),
    /// looked for beside the driver library the job maps, by a helper process
    /// (memscope-driver-query, installed beside memscope-bpf).
    #[arg(long, value_name = "TIME|off", default_value = "1s", value_parser = parse_every)]
    pub driver_every: Every,

    /// The management library to read the driver's figures from (a libdcmi.so or a
    /// libnvidia-ml.so.1), when it is not beside the job's driver library nor in the vendor's
    /// usual place.
    #[arg(long, value_name = "PATH")]
    pub driver_lib: Option<PathBuf>,

    /// Where the node's files are, for the Kubernetes pod and container of each traced process
    /// (its container runtime's configs under run/, the kubelet's var/log/pods): `/`, or where a
    /// DaemonSet mounts the node's root (e.g. /host). Their names go in ms_meta (k8s_*) and on
    /// the daemon's series (namespace, pod, container).
    #[arg(long, value_name = "PATH", default_value = "/")]
    pub node_root: PathBuf,
}

/// `--driver-every`: a period, or off.
#[derive(Clone, Copy, Debug)]
pub struct Every(pub Option<Duration>);

fn parse_every(text: &str) -> Result<Every, String> {
    if text.trim() == "off" {
        return Ok(Every(None));
    }
    let every = parse_duration(text)?;
    if every < Duration::from_millis(10) {
        return Err(format!(
            "--driver-every {text} is shorter than 10ms: each reading costs the driver a query per device"
        ));
    }
    Ok(Every(Some(every)))
}

impl CaptureArgs {
    /// What can be checked before anything is loaded; says which writer the rows will go
    /// through when it is not the page writer.
    pub fn check(&self) -> anyhow::Result<()> {
        if !self.ring_mb.is_power_of_two() || self.ring_mb > 1024 {
            bail!("--ring-mb {} must be a power of two between 1 and 1024", self.ring_mb);
        }
        Ok(())
    }

    /// The plan both verbs' captures are given; `status` is the verb's choice of
    /// [`Mode::choose`].
    pub fn plan(&self, output: PathBuf, status: Mode) -> capture::Plan {
        capture::Plan {
            output,
            duration: self.duration,
            format: self.format,
            writer: self.writer,
            probe_set: self.probe_set,
            ring_bytes: self.ring_mb * 1024 * 1024,
            quiet: self.quiet,
            status,
            driver: crate::driver::Config { every: self.driver_every.0, library: self.driver_lib.clone() },
            node_root: self.node_root.clone(),
        }
    }

    /// Says on stderr when a DB's rows will go through SQL rather than the page writer (asked
    /// for, or this build cannot write pages), before any row is written.
    pub fn say_writer(&self) {
        if self.format != Format::Db {
            return;
        }
        match (self.writer, DbWriter::unavailable_here()) {
            (DbWriter::Sql, _) => note(self.quiet, "rows are written through SQL (--writer sql)"),
            (DbWriter::Pages, Some(why)) => {
                say!("memscope-bpf: warning: rows are written through SQL, a slower writer: {why}")
            }
            (DbWriter::Pages, None) => {}
        }
    }
}
