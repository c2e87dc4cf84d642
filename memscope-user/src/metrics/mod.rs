//! `--listen`: what the trace knows now, for Prometheus to scrape (`/metrics`, [`http`]).
//!
//! The session publishes a [`Snapshot`] of the tracker's totals about once a second; a scrape
//! encodes the latest one. So a scrape never waits for the session, never sees an event half
//! applied, and costs the traced work nothing. Names follow Prometheus's conventions: the unit in
//! the name, `_total` on counters, labels of bounded cardinality (devices, pools, processes).
//! The values are the same totals the trace's summary prints and its DB's rows carry.

pub mod http;
mod live;
mod own;

use std::sync::{Arc, Mutex, PoisonError};

use memscope_common::sampling::{CounterKey, Counters};
use memscope_common::spec::sample_class;
use memscope_core::cluster::identity::Identity;
use memscope_core::cluster::pod::Pod;
use memscope_core::ingest::live::{LiveView, OwnerLive, SeriesTrend, StepSource};
use memscope_core::model::{DeviceKey, DeviceStats, Pool, PoolStats, Tracker};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::{Registry, Unit};

/// One job's totals: a traced process (with `trace`, the target and the children it forked).
#[derive(Clone, Debug, Default)]
pub struct JobTotals {
    pub pid: u32,
    /// Its command name (`/proc/PID/comm`), a label operators recognise.
    pub comm: String,
    pub devices: Vec<(DeviceKey, DeviceStats)>,
    pub pools: Vec<((DeviceKey, Pool, u32), PoolStats)>,
    /// The live view's owners, step and verdicts (the daemon's jobs; empty for `trace`).
    pub owners: Vec<OwnerLive>,
    pub step: Option<(u64, StepSource)>,
    pub trends: Vec<SeriesTrend>,
    /// The driver's latest figure for the job's processes on each device (`--driver-every`).
    pub driver: Vec<(DeviceKey, u64)>,
    /// Its rank and job, from its launcher's variables (the daemon's jobs).
    pub identity: Identity,
    /// Its Kubernetes pod, from the node's records (the daemon's jobs).
    pub pod: Option<Pod>,
    /// Its flight recordings so far, by reason, and the last one's folder (the daemon's jobs).
    pub flights: Vec<(&'static str, u64)>,
    pub flight_latest: Option<String>,
}

impl JobTotals {
    pub fn of(pid: u32, comm: String, tracker: &Tracker) -> Self {
        Self {
            pid,
            comm,
            devices: tracker.devices().map(|(k, s)| (k, s.clone())).collect(),
            pools: tracker.pools().map(|(k, s)| (k, s.clone())).collect(),
            ..Self::default()
        }
    }

    /// The labels every series of the job carries: `pid`, `comm`; `rank` and `job_id` when its
    /// launcher set them; `namespace`, `pod` and `container` when it runs in a pod.
    pub fn labels(&self) -> Labels {
        let mut labels = vec![("pid", self.pid.to_string()), ("comm", self.comm.clone())];
        labels.extend(self.identity.labels());
        labels.extend(self.pod.iter().flat_map(Pod::labels));
        labels
    }

    /// Adds what the job's live view knows: its `top` owners, its step and its verdicts.
    pub fn with_live(mut self, live: &LiveView, top: usize) -> Self {
        self.owners = if top == 0 { Vec::new() } else { live.owners(top) };
        self.step = live.step();
        self.trends = live.trends().to_vec();
        self
    }
}

/// Puts the kernel's exact counters (`--sample-bytes` with `--flight-rows 0`) over what the
/// sampled rows say: a pool's bytes handed out, its peak and its live blocks, and the CPU
/// allocator's device totals. A pool's reserved memory is exact already (its segments are
/// runtime calls, never sampled).
pub fn apply_exact(jobs: &mut [JobTotals], counters: &[(CounterKey, Counters)]) {
    for job in jobs {
        let mine = counters.iter().filter(|(k, _)| k.tgid == job.pid);
        let mut cpu: Option<DeviceStats> = None;
        for (key, c) in mine {
            let device = u32::try_from(key.device).map_or(DeviceKey::Unknown, DeviceKey::Npu);
            let pool = match key.class as u8 {
                sample_class::CACHING => Pool::Caching,
                sample_class::WORKSPACE => Pool::Workspace,
                sample_class::CPU => {
                    // Host memory: the kernel counts it under device -1 alone.
                    let mut d = DeviceStats::default();
                    (d.used, d.peak, d.mallocs, d.frees) = (c.live, c.peak, c.allocs, c.frees);
                    d.untracked_frees = c.untracked_frees;
                    cpu = Some(d);
                    continue;
                }
                _ => continue,
            };
            if c.allocs == 0 {
                // Only frees of blocks from before the trace: nothing of the pool's to show.
                continue;
            }
            let key = (device, pool, job.pid);
            let at = match job.pools.iter().position(|(k, _)| *k == key) {
                Some(at) => at,
                None => {
                    job.pools.push((key, PoolStats::default()));
                    job.pools.len() - 1
                }
            };
            let stats = &mut job.pools[at].1;
            (stats.used, stats.peak_used) = (c.live, c.peak);
            stats.live_blocks = c.allocs.saturating_sub(c.frees);
        }
        if let Some(exact) = cpu {
            let at = match job.devices.iter().position(|(k, _)| *k == DeviceKey::Cpu) {
                Some(at) => at,
                None => {
                    job.devices.push((DeviceKey::Cpu, DeviceStats::default()));
                    job.devices.len() - 1
                }
            };
            let stats = &mut job.devices[at].1;
            (stats.used, stats.peak, stats.mallocs, stats.frees) = (exact.used, exact.peak, exact.mallocs, exact.frees);
            stats.live_blocks = exact.mallocs.saturating_sub(exact.frees);
            stats.untracked_frees = exact.untracked_frees;
        }
    }
}

/// The totals a scrape reports.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub jobs: Vec<JobTotals>,
    /// Traced calls decoded so far.
    pub calls: u64,
    /// Records the ring buffer dropped so far.
    pub lost: u64,
    /// Kernel memory charged to each of the tracer's BPF maps, by name.
    pub maps: Vec<(String, u64)>,
    /// The daemon's windows (`None`: not a daemon).
    pub windows: Option<WindowFacts>,
}

/// What the daemon's windows did (`daemon --windows`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WindowFacts {
    /// The pool and CPU-tensor probes are attached now (always, under `--windows always`).
    pub open: bool,
    pub opened: u64,
    pub forgotten: u64,
}

/// A process's command name, as `/proc/PID/comm` gives it ("" once it is gone).
pub fn comm_of(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm")).map(|c| c.trim_end().to_owned()).unwrap_or_default()
}

/// Where the session puts the latest [`Snapshot`], and the registry that encodes it.
#[derive(Clone, Debug, Default)]
pub struct Published(Arc<Mutex<Snapshot>>);

impl Published {
    pub fn publish(&self, snapshot: Snapshot) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = snapshot;
    }

    /// A registry whose every scrape reads the latest snapshot.
    pub fn registry(&self) -> Registry {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(self.clone()));
        registry
    }
}

/// Binds `addr` and serves the latest published totals there until the runtime ends.
pub async fn serve(
    addr: std::net::SocketAddr,
    quiet: bool,
    flight: Option<http::FlightAsk>,
) -> Result<Published, http::ListenError> {
    let listener = http::bind(addr).await?;
    crate::terminal::say::note(quiet, format!("metrics: http://{}/metrics", listener.addr));
    let published = Published::default();
    listener.serve(published.registry(), flight);
    Ok(published)
}

/// The `device` label: the runtime's id, `cpu` for host memory, `unknown` where the trace never
/// learnt it (as the DB folders are named).
pub(crate) fn device_label(device: DeviceKey) -> String {
    match device {
        DeviceKey::Npu(n) => n.to_string(),
        DeviceKey::Cpu => "cpu".to_owned(),
        DeviceKey::Unknown => "unknown".to_owned(),
    }
}

fn pool_label(pool: Pool) -> &'static str {
    match pool {
        Pool::Caching => "caching",
        Pool::Workspace => "workspace",
    }
}

type Labels = Vec<(&'static str, String)>;

/// One metric family: a gauge or a counter per label set.
fn family<S>(
    encoder: &mut DescriptorEncoder<'_>,
    f: &Family<S>,
    series: impl Iterator<Item = (Labels, u64)>,
) -> Result<(), std::fmt::Error> {
    let metric_type =
        if f.counter { ConstCounter::new(0u64).metric_type() } else { ConstGauge::new(0u64).metric_type() };
    let unit = f.bytes.then_some(&Unit::Bytes);
    let mut metric = encoder.encode_descriptor(f.name, f.help, unit, metric_type)?;
    for (labels, value) in series {
        let sample = metric.encode_family(&labels)?;
        if f.counter {
            ConstCounter::new(value).encode(sample)?;
        } else {
            ConstGauge::new(value).encode(sample)?;
        }
    }
    Ok(())
}

/// One metric family: its name (the unit is appended), help, kind, and its value in one source.
struct Family<S> {
    name: &'static str,
    help: &'static str,
    bytes: bool,
    counter: bool,
    value: fn(&S) -> u64,
}

const fn gauge<S>(name: &'static str, help: &'static str, bytes: bool, value: fn(&S) -> u64) -> Family<S> {
    Family { name, help, bytes, counter: false, value }
}

const fn counter<S>(name: &'static str, help: &'static str, value: fn(&S) -> u64) -> Family<S> {
    Family { name, help, bytes: false, counter: true, value }
}

const DEVICE_FAMILIES: [Family<DeviceStats>; 8] = [
    gauge("memscope_live", "Bytes the runtime and driver have handed out and not taken back", true, |s| s.used),
    gauge("memscope_peak", "The most bytes live at once since the trace started", true, |s| s.peak),
    gauge("memscope_live_blocks", "Blocks handed out and not taken back", false, |s| s.live_blocks),
    counter("memscope_allocations", "Successful allocations", |s| s.mallocs),
    counter("memscope_frees", "Frees of blocks the trace saw allocated", |s| s.frees),
    counter("memscope_untracked_frees", "Frees of blocks allocated before the trace", |s| s.untracked_frees),
    counter("memscope_failed_allocations", "Allocations that failed (out of memory among them)", |s| s.failures),
    counter("memscope_out_of_memory", "Allocations that failed for want of memory", |s| s.out_of_memory),
];

const POOL_FAMILIES: [Family<PoolStats>; 5] = [
    gauge("memscope_pool_used", "Bytes a framework pool has handed out (PTA caching, workspace)", true, |s| s.used),
    gauge("memscope_pool_live_blocks", "Blocks a framework pool has handed out and not taken back", false, |s| {
        s.live_blocks
    }),
    gauge("memscope_pool_reserved", "Device memory a framework pool holds", true, |s| s.total),
    gauge("memscope_pool_peak_used", "The most bytes a pool had handed out at once", true, |s| s.peak_used),
    gauge("memscope_pool_peak_reserved", "The most device memory a pool held at once", true, |s| s.peak_total),
];

const TRACER_FAMILIES: [Family<Snapshot>; 3] = [
    gauge("memscope_jobs", "Processes traced now", false, |s| s.jobs.len() as u64),
    counter("memscope_calls_recorded", "Traced calls recorded", |s| s.calls),
    counter("memscope_records_lost", "Records the ring buffer dropped (raise --ring-mb)", |s| s.lost),
];

/// The driver's figure and what the traced calls leave of it unexplained, per device: the
/// values come with the series.
const DRIVER_FAMILIES: [Family<()>; 2] = [
    gauge(
        "memscope_driver_process",
        "Device memory the driver counts for the job (npu-smi's or nvidia-smi's figure, --driver-every)",
        true,
        |_| 0,
    ),
    gauge(
        "memscope_unexplained",
        "The driver's figure for the job minus its live traced device memory (0 when the driver counts less)",
        true,
        |_| 0,
    ),
];

/// The daemon's flight recordings: the values come with the series.
const FLIGHT_FAMILIES: [Family<()>; 2] = [
    counter(
        "memscope_flight_recordings",
        "Flight recordings written for the job (reason: oom, degradation, request)",
        |_| 0,
    ),
    gauge(
        "memscope_flight_recording_latest",
        "1, labelled with the folder of the job's last flight recording",
        false,
        |_| 0,
    ),
];

const WINDOW_FAMILIES: [Family<WindowFacts>; 3] = [
    gauge(
        "memscope_window_open",
        "1 while a window is open (daemon --windows): the pool's and CPU tensors' allocations are probed, and their series count the blocks born in windows",
        false,
        |w| u64::from(w.open),
    ),
    counter("memscope_windows", "Windows opened (daemon --windows)", |w| w.opened),
    counter(
        "memscope_window_forgotten_blocks",
        "Blocks still live when a window's last probe went: forgotten, their rows ended by a FREE marked implied",
        |w| w.forgotten,
    ),
];

/// Per map: the value comes with the series, not from a field.
const MAP_MEMORY: Family<()> = gauge(
    "memscope_bpf_map_memory",
    "Kernel memory charged to one of the tracer's BPF maps (fdinfo memlock; the ring buffer among them)",
    true,
    |_| 0,
);

impl Collector for Published {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let s = self.0.lock().unwrap_or_else(PoisonError::into_inner).clone();
        for f in &DEVICE_FAMILIES {
            let series = s.jobs.iter().flat_map(|job| {
                job.devices.iter().map(move |(d, stats)| {
                    let mut labels = job.labels();
                    labels.push(("device", device_label(*d)));
                    (labels, (f.value)(stats))
                })
            });
            family(&mut encoder, f, series)?;
        }
        for f in &POOL_FAMILIES {
            let series = s.jobs.iter().flat_map(|job| {
                job.pools.iter().map(move |((d, p, pid), stats)| {
                    // The pool's own process (a job's child may have one).
                    let mut labels = vec![("pid", pid.to_string()), ("comm", job.comm.clone())];
                    labels.extend(job.identity.labels());
                    labels.extend(job.pod.iter().flat_map(Pod::labels));
                    labels.extend([("device", device_label(*d)), ("pool", pool_label(*p).to_owned())]);
                    (labels, (f.value)(stats))
                })
            });
            family(&mut encoder, f, series)?;
        }
        for f in &TRACER_FAMILIES {
            family(&mut encoder, f, std::iter::once((Labels::new(), (f.value)(&s))))?;
        }
        for f in WINDOW_FAMILIES.iter().filter(|_| s.windows.is_some()) {
            let w = s.windows.unwrap_or_default();
            family(&mut encoder, f, std::iter::once((Labels::new(), (f.value)(&w))))?;
        }
        for (i, f) in DRIVER_FAMILIES.iter().enumerate() {
            let series = s.jobs.iter().flat_map(|job| {
                job.driver.iter().map(move |(d, process)| {
                    let live = job.devices.iter().find(|(k, _)| k == d).map_or(0, |(_, s)| s.used);
                    let mut labels = job.labels();
                    labels.push(("device", device_label(*d)));
                    (labels, if i == 0 { *process } else { process.saturating_sub(live) })
                })
            });
            family(&mut encoder, f, series)?;
        }
        let flights = s.jobs.iter().flat_map(|job| {
            job.flights.iter().map(move |(reason, n)| {
                let mut labels = job.labels();
                labels.push(("reason", (*reason).to_owned()));
                (labels, *n)
            })
        });
        family(&mut encoder, &FLIGHT_FAMILIES[0], flights)?;
        let latest = s.jobs.iter().filter_map(|job| {
            let mut labels = job.labels();
            labels.push(("folder", job.flight_latest.clone()?));
            Some((labels, 1))
        });
        family(&mut encoder, &FLIGHT_FAMILIES[1], latest)?;
        let maps = s.maps.iter().map(|(name, bytes)| (vec![("map", name.clone())], *bytes));
        family(&mut encoder, &MAP_MEMORY, maps)?;
        live::encode(&mut encoder, &s.jobs)?;
        own::encode(&mut encoder)
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;
    use std::process::{Command, Stdio};

    use memscope_core::model::Output;
    use prometheus_client::encoding::prometheus_text;

    use super::*;

    fn encoded(snapshot: Snapshot) -> String {
        let published = Published::default();
        let registry = published.registry();
        published.publish(snapshot);
        let mut text = String::new();
        prometheus_text::encode(&mut text, &registry).unwrap();
        text
    }

    fn sample(text: &str, series: &str) -> Option<u64> {
        text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn the_window_series_are_the_daemons_alone() {
        let text = encoded(one_job());
        assert_eq!(sample(&text, "memscope_window_open"), Some(1));
        assert_eq!(sample(&text, "memscope_windows_total"), Some(3));
        assert_eq!(sample(&text, "memscope_window_forgotten_blocks_total"), Some(2));
        let text = encoded(Snapshot { windows: None, ..one_job() });
        assert!(!text.contains("memscope_window"), "{text}");
    }

    #[test]
    fn the_drivers_figure_and_what_the_traced_calls_leave_unexplained_are_series_per_device() {
        let mut device = DeviceStats::default();
        device.used = 4096;
        let job = JobTotals {
            pid: 7,
            comm: "python3".into(),
            devices: vec![(DeviceKey::Npu(1), device)],
            driver: vec![(DeviceKey::Npu(1), 10_000), (DeviceKey::Npu(2), 300)],
            ..JobTotals::default()
        };
        let text = encoded(Snapshot { jobs: vec![job], ..Snapshot::default() });
        let at =
            |name: &str, device: &str| sample(&text, &format!(r#"{name}{{pid="7",comm="python3",device="{device}"}}"#));
        assert_eq!(at("memscope_driver_process_bytes", "1"), Some(10_000), "{text}");
        assert_eq!(at("memscope_unexplained_bytes", "1"), Some(10_000 - 4096));
        assert_eq!(at("memscope_unexplained_bytes", "2"), Some(300), "nothing traced there");
    }

    /// A rank of a launch: every series of its job carries `rank` and `job_id` after `pid` and
    /// `comm`; a job with no launcher's variables carries neither.
    #[test]
    fn a_ranks_series_carry_its_rank_and_job() {
        let env: std::collections::HashMap<String, String> =
            [("RANK", "3"), ("MASTER_ADDR", "10.0.0.7"), ("MASTER_PORT", "29500")]
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
        let mut device = DeviceStats::default();
        device.used = 4096;
        let pool = PoolStats { used: 512, ..PoolStats::default() };
        let job = |pid, identity| JobTotals {
            pid,
            comm: "python3".into(),
            devices: vec![(DeviceKey::Npu(1), device.clone())],
            pools: vec![((DeviceKey::Npu(1), Pool::Caching, pid), pool.clone())],
            identity,
            ..JobTotals::default()
        };
        let jobs = vec![job(7, Identity::from_env(&env)), job(8, Identity::default())];
        let text = encoded(Snapshot { jobs, ..Snapshot::default() });
        let rank = r#"pid="7",comm="python3",rank="3",job_id="10.0.0.7:29500",device="1""#;
        assert_eq!(sample(&text, &format!("memscope_live_bytes{{{rank}}}")), Some(4096), "{text}");
        assert_eq!(
            sample(&text, &format!(r#"memscope_pool_used_bytes{{{rank},pool="caching"}}"#)),
            Some(512),
            "{text}"
        );
        let plain = r#"memscope_live_bytes{pid="8",comm="python3",device="1"}"#;
        assert_eq!(sample(&text, plain), Some(4096), "{text}");
    }

    #[test]
    fn a_scrape_reads_the_latest_snapshot_in_prometheus_names() {
        let mut device = DeviceStats::default();
        (device.used, device.peak, device.live_blocks, device.mallocs, device.failures) = (4096, 8192, 1, 3, 1);
        device.out_of_memory = 1;
        let pool = PoolStats { used: 512, total: 2 << 20, peak_used: 1024, peak_total: 2 << 20, live_blocks: 2 };
        let job = JobTotals {
            pid: 4242,
            comm: "python3".into(),
            devices: vec![(DeviceKey::Npu(1), device), (DeviceKey::Cpu, DeviceStats::default())],
            pools: vec![((DeviceKey::Npu(1), Pool::Caching, 4242), pool)],
            ..JobTotals::default()
        };
        let maps = vec![("BLOCKS".into(), 96 << 20)];
        let snapshot = Snapshot { jobs: vec![job], calls: 10, lost: 0, maps, windows: None };
        let text = encoded(snapshot);
        assert_eq!(sample(&text, r#"memscope_live_bytes{pid="4242",comm="python3",device="1"}"#), Some(4096), "{text}");
        assert_eq!(sample(&text, r#"memscope_peak_bytes{pid="4242",comm="python3",device="1"}"#), Some(8192));
        assert_eq!(sample(&text, r#"memscope_live_bytes{pid="4242",comm="python3",device="cpu"}"#), Some(0));
        assert_eq!(sample(&text, r#"memscope_allocations_total{pid="4242",comm="python3",device="1"}"#), Some(3));
        assert_eq!(
            sample(&text, r#"memscope_failed_allocations_total{pid="4242",comm="python3",device="1"}"#),
            Some(1)
        );
        let oom = r#"memscope_out_of_memory_total{pid="4242",comm="python3",device="1"}"#;
        assert_eq!(sample(&text, oom), Some(1));
        let reserved = r#"memscope_pool_reserved_bytes{pid="4242",comm="python3",device="1",pool="caching"}"#;
        assert_eq!(sample(&text, reserved), Some(2 << 20));
        assert_eq!(sample(&text, "memscope_calls_recorded_total"), Some(10));
        assert_eq!(sample(&text, "memscope_records_lost_total"), Some(0));
        assert_eq!(sample(&text, "memscope_jobs"), Some(1));
        assert_eq!(sample(&text, r#"memscope_bpf_map_memory_bytes{map="BLOCKS"}"#), Some(96 << 20));
        assert!(sample(&text, "process_resident_memory_bytes").is_some_and(|rss| rss > 0), "{text}");
    }

    /// The kernel's counters replace the sampled rows' pool totals and CPU totals, per job, and
    /// leave the exact reserved bytes and other jobs alone.
    #[test]
    fn the_kernels_exact_counters_replace_what_sampled_rows_sum_to() {
        let pool = PoolStats { used: 10, total: 2 << 20, peak_used: 10, peak_total: 2 << 20, live_blocks: 1 };
        let job = |pid| JobTotals {
            pid,
            comm: "train".into(),
            devices: vec![(DeviceKey::Npu(1), DeviceStats::default())],
            pools: vec![((DeviceKey::Npu(1), Pool::Caching, pid), pool.clone())],
            ..JobTotals::default()
        };
        let mut jobs = vec![job(7), job(8)];
        let key = |device, class| CounterKey { tgid: 7, device, class: u32::from(class), _pad: 0 };
        let counters = |live, peak, allocs, frees| Counters { live, peak, allocs, frees, untracked_frees: 0 };
        let exact = [
            (key(1, sample_class::CACHING), counters(4096, 8192, 5, 2)),
            (key(0, sample_class::WORKSPACE), counters(0, 1 << 20, 3, 3)),
            (key(-1, sample_class::CPU), Counters { untracked_frees: 4, ..counters(64, 128, 2, 1) }),
            // Frees of blocks from before the trace only: no pool to show.
            (key(-1, sample_class::CACHING), Counters { untracked_frees: 9, ..Counters::default() }),
        ];
        apply_exact(&mut jobs, &exact);
        let caching = &jobs[0].pools[0].1;
        assert_eq!((caching.used, caching.peak_used, caching.live_blocks, caching.total), (4096, 8192, 3, 2 << 20));
        let workspace = jobs[0].pools.iter().find(|(k, _)| k.1 == Pool::Workspace).unwrap();
        assert_eq!((workspace.0 .0, workspace.1.peak_used, workspace.1.live_blocks), (DeviceKey::Npu(0), 1 << 20, 0));
        assert_eq!(jobs[0].pools.len(), 2, "{:?}", jobs[0].pools);
        let cpu = &jobs[0].devices.iter().find(|(k, _)| *k == DeviceKey::Cpu).unwrap().1;
        assert_eq!((cpu.used, cpu.peak, cpu.mallocs, cpu.live_blocks, cpu.untracked_frees), (64, 128, 2, 1, 4));
        assert_eq!(jobs[1].pools[0].1.used, 10, "another process's counters are not job 8's");
    }

    /// One job with a device and a pool: every kind of series the exposition has.
    fn one_job() -> Snapshot {
        let mut device = DeviceStats::default();
        device.used = 1;
        let job = JobTotals {
            pid: 1,
            comm: "train".into(),
            devices: vec![(DeviceKey::Npu(0), device)],
            pools: vec![((DeviceKey::Npu(0), Pool::Workspace, 1), PoolStats::default())],
            ..JobTotals::default()
        };
        Snapshot {
            jobs: vec![job.with_live(&leaking_view(), 1)],
            calls: 1,
            lost: 2,
            maps: vec![("EVENTS".into(), 1 << 20)],
            windows: Some(WindowFacts { open: true, opened: 3, forgotten: 2 }),
        }
    }

    /// A job's live view after 8 steps that each kept 1 MiB more under `PTA@kv_cache`, beside a
    /// constant `PTA@weight`.
    fn leaking_view() -> LiveView {
        use memscope_core::apis::Api;
        use memscope_core::ingest::live::Options;
        use memscope_core::model::Site;
        let mut view = LiveView::new(Options { warmup_steps: 1, step_marker: None, window_ns: 0, trend_every_ns: 0 });
        let site = Site::of(Api::DeviceCachingAllocatorMalloc, 1, 1, 1);
        let block = |ptr: u64, owner: &str| Output::PoolMalloc {
            site,
            device: DeviceKey::Npu(0),
            pool: Pool::Caching,
            ptr,
            size: 1 << 20,
            req_size: Some(1 << 20),
            stream: None,
            allocation_id: ptr,
            used: 0,
            total: 0,
            owner: owner.into(),
            from: Default::default(),
        };
        view.observe(&block(1, "PTA@weight"));
        view.observe(&block(2, "PTA@weight"));
        for step in 1..=8 {
            view.observe(&block(100 + step, "PTA@kv_cache"));
            view.observe(&Output::Step { wall_ns: step, pid: 1, tid: 1, number: step, inferred: false });
            view.settle();
        }
        view.tick(1);
        view
    }

    #[test]
    fn a_jobs_owners_step_and_degradation_are_series_with_bounded_owner_labels() {
        let text = encoded(one_job());
        let at = |series: &str| -> Option<i64> {
            text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        };
        let labels = r#"pid="1",comm="train",device="0",layer="PTA""#;
        // The top owner alone has a label of its own (--owner-labels 1); the other is summed.
        assert_eq!(
            at(&format!(r#"memscope_owner_live_bytes{{{labels},owner="PTA@kv_cache"}}"#)),
            Some(8 << 20),
            "{text}"
        );
        assert_eq!(at(&format!(r#"memscope_owner_live_bytes{{{labels},owner="other"}}"#)), Some(2 << 20));
        assert!(!text.contains("PTA@weight"), "{text}");
        assert_eq!(at(r#"memscope_step{pid="1",comm="train",source="markers"}"#), Some(8));
        assert_eq!(at(&format!("memscope_degradation_sustained{{{labels}}}")), Some(1));
        // Boundaries ending steps 1..=8: 7 steps of 1 MiB each after the warm-up's end.
        assert_eq!(at(&format!("memscope_degradation_rise_bytes{{{labels}}}")), Some(7 << 20));
        assert_eq!(at(&format!("memscope_degradation_points{{{labels}}}")), Some(8));
    }

    /// The label names a query file uses: in `by (...)`, `on (...)`, selectors and `{{legend}}`s.
    fn labels_used(body: &str) -> std::collections::BTreeSet<String> {
        let ident = |s: &str| s.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect::<String>();
        let mut used = std::collections::BTreeSet::new();
        for key in ["by (", "on (", "without ("] {
            for (at, _) in body.match_indices(key) {
                let list = body[at + key.len()..].split(')').next().unwrap_or("");
                used.extend(list.split(',').map(|l| l.trim().to_owned()).filter(|l| !l.is_empty()));
            }
        }
        for (at, _) in body.match_indices("{{") {
            used.insert(ident(&body[at + 2..]));
        }
        for (at, _) in body.match_indices("memscope_").chain(body.match_indices("process_")) {
            let rest = &body[at..];
            let name = ident(rest);
            let Some(selector) = rest[name.len()..].strip_prefix('{') else { continue };
            for matcher in selector.split('}').next().unwrap_or("").split(',') {
                used.insert(ident(matcher.trim()));
            }
        }
        used.retain(|l| !l.is_empty() && !l.starts_with("__"));
        used
    }

    /// Prometheus's own linter reads the exposition: the format, the names' conventions (units,
    /// `_total`) and the help texts.
    #[test]
    fn promtool_accepts_the_exposition() {
        let text = encoded(one_job());
        let child = Command::new("promtool")
            .args(["check", "metrics"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        let Ok(mut child) = child else {
            eprintln!(
                "SKIPPED: promtool is not installed (Debian's prometheus package; `cargo xtask setup` installs it)"
            );
            return;
        };
        child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success() && said.trim().is_empty(), "promtool: {said}\n{text}");
    }

    /// The deployment's Prometheus files (docs/deploy) are what Prometheus accepts, and every
    /// series the alerts and the Grafana dashboard query is one the exposition has.
    #[test]
    fn the_deploy_files_query_exported_series_and_promtool_accepts_them() {
        let deploy = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/deploy");
        let mut snapshot = one_job();
        let identity = [("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "1")];
        snapshot.jobs[0].identity =
            Identity::from_env(&identity.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
        snapshot.jobs[0].pod = Some(memscope_core::cluster::pod::Pod {
            namespace: "ml".into(),
            name: "llama-0".into(),
            container: Some("trainer".into()),
            uid: "u".into(),
        });
        let text = encoded(snapshot);
        // Prometheus's own labels, and the node the scrape job adds.
        let mut labels: std::collections::BTreeSet<String> = ["job", "instance", "node"].map(String::from).into();
        for l in text.lines().filter(|l| !l.starts_with('#')) {
            let inner = l.split_once('{').and_then(|(_, r)| r.rsplit_once('}')).map_or("", |(i, _)| i);
            labels.extend(inner.split(',').filter_map(|kv| Some(kv.split_once('=')?.0.to_owned())));
        }
        let exported: std::collections::BTreeSet<&str> =
            text.lines().filter(|l| !l.starts_with('#')).filter_map(|l| l.split(['{', ' ']).next()).collect();
        for file in ["alerts.yml", "grafana-dashboard.json"] {
            let body = std::fs::read_to_string(deploy.join(file)).unwrap();
            let mut queried = 0;
            for (at, _) in body.match_indices("memscope_").chain(body.match_indices("process_")) {
                let name: String = body[at..].chars().take_while(|c| c.is_ascii_lowercase() || *c == '_').collect();
                assert!(exported.contains(name.as_str()), "{file} queries {name}, which is not exported: {exported:?}");
                queried += 1;
            }
            assert!(queried >= 3, "{file}: {queried}");
            for used in labels_used(&body) {
                assert!(labels.contains(&used), "{file} uses the label {used}, which no series has: {labels:?}");
            }
        }
        let promtool = |what: &str, file: &std::path::Path| {
            let out = Command::new("promtool").args(["check", what]).arg(file).output().ok()?;
            let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            Some((out.status.success(), said))
        };
        let Some((ok, said)) = promtool("rules", &deploy.join("alerts.yml")) else {
            eprintln!(
                "SKIPPED: promtool is not installed (Debian's prometheus package; `cargo xtask setup` installs it)"
            );
            return;
        };
        assert!(ok, "promtool check rules alerts.yml: {said}");
        // The dashboard's queries, as recording rules, parse as PromQL (its variables as
        // Grafana fills them with "All").
        let dashboard: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(deploy.join("grafana-dashboard.json")).unwrap()).unwrap();
        let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
        for (i, target) in
            dashboard["panels"].as_array().unwrap().iter().flat_map(|p| p["targets"].as_array().unwrap()).enumerate()
        {
            let expr = target["expr"]
                .as_str()
                .unwrap()
                .replace("$node", ".*")
                .replace("$namespace", ".*")
                .replace("$job_id", ".*");
            rules += &format!(
                "      - record: dashboard:query{i}\n        expr: {}\n",
                serde_json::to_string(&expr).unwrap()
            );
        }
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("dashboard.yml"), rules).unwrap();
        let (ok, said) = promtool("rules", &dir.path().join("dashboard.yml")).unwrap();
        assert!(ok, "the dashboard's queries: {said}");
        let scrape = deploy.join("prometheus-scrape.yml");
        let (mut ok, mut said) = promtool("config", &scrape).unwrap();
        if !ok && said.contains("field kubernetes_sd_configs not found") {
            // Debian builds Prometheus without Kubernetes discovery: check the rest of the job
            // with a static target in its place.
            let body = std::fs::read_to_string(&scrape).unwrap();
            let (head, rest) = body.split_once("    kubernetes_sd_configs:").unwrap();
            let tail = &rest[rest.find("    relabel_configs:").unwrap()..];
            let swapped = format!("{head}    static_configs:\n      - targets: ['127.0.0.1:9464']\n{tail}");
            let dir = tempfile::tempdir().unwrap();
            std::fs::write(dir.path().join("scrape.yml"), swapped).unwrap();
            (ok, said) = promtool("config", &dir.path().join("scrape.yml")).unwrap();
        }
        assert!(ok, "promtool check config prometheus-scrape.yml: {said}");
    }
}
