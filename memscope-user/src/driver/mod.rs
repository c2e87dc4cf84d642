//! The driver's own figures while tracing: each device's used and total memory and each traced
//! process's usage, as npu-smi or nvidia-smi would show them, read every `--driver-every` by a
//! helper process ([`watch`]) from the management library found for the job ([`find`]). Written
//! as `ms_driver` rows and onto `START_TRACE` (see `memscope_core::store::driver`); `analyze
//! --analysis unexplained` puts them against the traced calls.
//!
//! Off, with the reason said once and kept in `ms_meta.driver_off`, where no library or no
//! helper is found: the trace itself never depends on it.

pub mod find;
pub mod watch;

use std::path::PathBuf;
use std::time::Duration;

use memscope_core::model::DeviceKey;
use memscope_core::store::DriverRow;
use memscope_driver::{Reading, SourceKind};

use find::Library;
use watch::{Said, Watch};

/// `--driver-every`'s default: a reading costs the helper a few ms (docs/benchmarks.md).
pub const DEFAULT_EVERY: Duration = Duration::from_secs(1);

/// `--driver-every` and `--driver-lib`.
#[derive(Clone, Debug)]
pub struct Config {
    /// `None`: off.
    pub every: Option<Duration>,
    pub library: Option<PathBuf>,
}

enum State {
    /// No driver library mapped by the job yet.
    Waiting,
    Running {
        kind: SourceKind,
        library: String,
        watch: Watch,
    },
    Off(String),
}

pub struct Driver {
    every: Duration,
    library: Option<PathBuf>,
    state: State,
    /// The job's ordinal for each of the library's device ids (`CUDA_VISIBLE_DEVICES`,
    /// `ASCEND_RT_VISIBLE_DEVICES`).
    visible: Option<Vec<u32>>,
    readings: u64,
    took_ns: (u64, u64),
    /// The latest figure for each (device, process), for the metrics.
    latest: std::collections::BTreeMap<(DeviceKey, u32), u64>,
    /// Each device's latest (used, total) bytes, for the daemon's windows.
    devices: std::collections::BTreeMap<DeviceKey, (u64, u64)>,
}

impl Driver {
    pub fn new(config: &Config) -> Self {
        let state = match config.every {
            None => State::Off("--driver-every off".into()),
            Some(_) => State::Waiting,
        };
        let every = config.every.unwrap_or(DEFAULT_EVERY);
        let (latest, devices) = Default::default();
        let library = config.library.clone();
        Self { every, library, state, visible: None, readings: 0, took_ns: (0, 0), latest, devices }
    }

    /// Starts the helper once `pid` maps a driver library (at once with `--driver-lib`); the
    /// line to say when it started or cannot.
    pub fn try_start(&mut self, pid: u32) -> Option<String> {
        if !matches!(self.state, State::Waiting) {
            return None;
        }
        let library = match &self.library {
            Some(path) => match find::kind_of(path) {
                Some(kind) => Library { kind, path: path.clone(), chosen_by: None },
                None => {
                    return self
                        .off(format!("--driver-lib {} is neither libdcmi.so nor libnvidia-ml.so", path.display()))
                }
            },
            None => find::library_for(pid)?,
        };
        let Some(helper) = find::helper() else {
            return self.off(format!("{} is not beside memscope-bpf nor on PATH", find::HELPER));
        };
        self.visible =
            std::fs::read(format!("/proc/{pid}/environ")).ok().and_then(|e| find::visible_ordinals(&e, library.kind));
        match Watch::start(&helper, &library, self.every) {
            Ok(watch) => {
                let name = library.path.display().to_string();
                self.state = State::Running { kind: library.kind, library: name, watch };
                None
            }
            Err(e) => self.off(format!("cannot start {}: {e}", helper.display())),
        }
    }

    /// No library found yet (the daemon tries each job until one maps a driver library).
    pub fn waiting(&self) -> bool {
        matches!(self.state, State::Waiting)
    }

    fn off(&mut self, why: String) -> Option<String> {
        let line = format!("the driver's figures are off: {why}");
        self.state = State::Off(why);
        Some(line)
    }

    /// Waits up to `wait` for the first reading (an attach: the DBs' START_TRACE then has the
    /// device's memory); the rows and lines of what came.
    pub fn first(&mut self, wait: Duration, traced: &dyn Fn(u32) -> bool) -> (Vec<DriverRow>, Vec<String>) {
        let deadline = std::time::Instant::now() + wait;
        let mut out = (Vec::new(), Vec::new());
        while let State::Running { watch, .. } = &self.state {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let Some(said) = watch.next_within(left) else { break };
            let reading = matches!(said, Said::Reading(_));
            self.take(said, traced, &mut out);
            if reading {
                break;
            }
        }
        out
    }

    /// What came since the last look: rows for the store, lines to say.
    pub fn poll(&mut self, traced: &dyn Fn(u32) -> bool) -> (Vec<DriverRow>, Vec<String>) {
        let mut out = (Vec::new(), Vec::new());
        let said = match &self.state {
            State::Running { watch, .. } => watch.said(),
            _ => return out,
        };
        for s in said {
            self.take(s, traced, &mut out);
        }
        out
    }

    fn take(&mut self, said: Said, traced: &dyn Fn(u32) -> bool, (rows, lines): &mut (Vec<DriverRow>, Vec<String>)) {
        let State::Running { kind, library, .. } = &self.state else { return };
        match said {
            Said::Hello(h) => lines.push(format!(
                "the driver's figures: {} via {library} ({} devices), every {:?}",
                kind.name(),
                h.devices.len(),
                self.every
            )),
            Said::Reading(r) => {
                self.readings += 1;
                self.took_ns = (self.took_ns.0 + r.took_ns, self.took_ns.1.max(r.took_ns));
                let new = self.rows_of(*kind, &r, traced);
                for row in &new {
                    if let (Some(pid), Some(bytes)) = (row.pid, row.process_used) {
                        self.latest.insert((row.device, pid), bytes);
                    }
                    if let Some((free, total)) = row.free_total() {
                        self.devices.insert(row.device, (total - free, total));
                    }
                }
                rows.extend(new);
            }
            Said::Gone(why) => lines.extend(self.off(format!("{}: {why}", library.clone()))),
        }
    }

    fn rows_of(&self, kind: SourceKind, r: &Reading, traced: &dyn Fn(u32) -> bool) -> Vec<DriverRow> {
        let mut rows = Vec::new();
        for d in &r.devices {
            let Some(device) = find::ordinal(self.visible.as_deref(), d.device) else { continue };
            let row = |pid, process_used| DriverRow {
                ts_ns: r.ts_ns,
                device: DeviceKey::Npu(device),
                pid,
                process_used,
                device_used: d.used,
                device_total: d.total,
                source: kind.name(),
            };
            let before = rows.len();
            rows.extend(d.processes.iter().filter(|p| traced(p.pid)).map(|p| row(Some(p.pid), Some(p.bytes))));
            if rows.len() == before {
                rows.push(row(None, None));
            }
        }
        rows
    }

    /// Each device's memory by the driver's latest reading: (device, used, total).
    pub fn device_memory(&self) -> impl Iterator<Item = (DeviceKey, u64, u64)> + '_ {
        self.devices.iter().map(|(d, (used, total))| (*d, *used, *total))
    }

    /// The driver's latest figure for the processes `traced` says are the job's, per device.
    pub fn latest(&self, traced: &dyn Fn(u32) -> bool) -> Vec<(DeviceKey, u64)> {
        let mut per_device: std::collections::BTreeMap<DeviceKey, u64> = Default::default();
        for ((device, pid), bytes) in &self.latest {
            if traced(*pid) {
                *per_device.entry(*device).or_default() += bytes;
            }
        }
        per_device.into_iter().collect()
    }

    /// `ms_meta`'s keys: where the figures came from and what they cost, or why there are none.
    pub fn meta(&self) -> Vec<(String, String)> {
        let mut meta = vec![("driver_readings".to_owned(), self.readings.to_string())];
        match &self.state {
            State::Off(why) => meta.push(("driver_off".into(), why.clone())),
            State::Waiting => meta.push(("driver_off".into(), "the job mapped no driver library".into())),
            State::Running { kind, library, .. } => {
                meta.push(("driver_source".into(), kind.name().into()));
                meta.push(("driver_library".into(), library.clone()));
                meta.push(("driver_every_ms".into(), self.every.as_millis().to_string()));
            }
        }
        if let Some(mean) = self.took_ns.0.checked_div(self.readings) {
            meta.push(("driver_query_us_mean".into(), (mean / 1000).to_string()));
            meta.push(("driver_query_us_max".into(), (self.took_ns.1 / 1000).to_string()));
        }
        meta
    }
}
