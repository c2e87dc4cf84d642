//! The tracer's own cost, under the names every Prometheus client library uses for its process
//! (`process_cpu_seconds_total`, `process_resident_memory_bytes`), so the dashboards operators
//! already have show it. Read from `/proc/self` at each scrape: prometheus-client has no process
//! collector, and two numbers do not justify another crate.

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Unit;

/// CPU seconds (user + system) and resident bytes of this process, where `/proc` gives them.
pub fn usage() -> Option<(f64, u64)> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name (field 2) may hold spaces and parentheses: count from its closing one.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    // Fields 14 and 15 (utime, stime) are the 12th and 13th after the name.
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf only reads configuration values.
    let (hz, page) = unsafe { (libc::sysconf(libc::_SC_CLK_TCK), libc::sysconf(libc::_SC_PAGESIZE)) };
    (hz > 0 && page > 0).then(|| (ticks as f64 / hz as f64, pages * page as u64))
}

pub fn encode(encoder: &mut DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
    let Some((cpu, rss)) = usage() else { return Ok(()) };
    let counter = ConstCounter::new(cpu);
    let metric = encoder.encode_descriptor(
        "process_cpu",
        "CPU time this tracer has used",
        Some(&Unit::Seconds),
        counter.metric_type(),
    )?;
    counter.encode(metric)?;
    let gauge = ConstGauge::new(rss as i64);
    let metric = encoder.encode_descriptor(
        "process_resident_memory",
        "Resident memory of this tracer",
        Some(&Unit::Bytes),
        gauge.metric_type(),
    )?;
    gauge.encode(metric)
}
