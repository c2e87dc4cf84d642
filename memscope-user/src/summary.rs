//! The end-of-trace report printed to stderr: why it stopped, what was recorded and lost, and per
//! device the peak, what is still live and where its file is.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use crate::model::DeviceKey;

#[derive(Clone, Debug)]
pub struct DeviceLine {
    pub device: DeviceKey,
    pub peak: u64,
    pub live_bytes: u64,
    pub live_blocks: u64,
    pub mallocs: u64,
    pub frees: u64,
    /// Frees of blocks born before the trace (in `ms_untracked_frees`, not Insight's table).
    pub untracked_frees: u64,
    pub failures: u64,
    pub file: Option<PathBuf>,
}

/// One framework pool (torch_npu's caching or workspace allocator) on one device: allocated
/// (`used`) and reserved (`total`) bytes, as the PTA rows carry them.
#[derive(Clone, Debug)]
pub struct PoolLine {
    pub device: DeviceKey,
    /// The process whose allocator it is (named when several share a device).
    pub pid: u32,
    pub pool: &'static str,
    pub peak_used: u64,
    pub peak_total: u64,
    pub used: u64,
    pub total: u64,
    pub live_blocks: u64,
}

#[derive(Clone, Debug)]
pub struct Summary {
    pub stop_reason: String,
    pub elapsed: Duration,
    pub calls: u64,
    pub lost: u64,
    pub undecodable: u64,
    pub run_dir: PathBuf,
    pub devices: Vec<DeviceLine>,
    pub pools: Vec<PoolLine>,
}

/// Bytes in binary units with one decimal.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

fn device_name(d: DeviceKey) -> String {
    match d {
        DeviceKey::Npu(n) => format!("device {n}"),
        DeviceKey::Cpu => "host (cpu)".into(),
        DeviceKey::Unknown => "device ?".into(),
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "memscope-bpf: stopped ({}) after {:.1} s", self.stop_reason, self.elapsed.as_secs_f64())?;
        writeln!(f, "memscope-bpf: {} calls recorded, {} lost (ring buffer full, all CPUs)", self.calls, self.lost)?;
        if self.undecodable > 0 {
            writeln!(f, "memscope-bpf: {} records could not be decoded", self.undecodable)?;
        }
        if self.devices.is_empty() {
            writeln!(
                f,
                "memscope-bpf: no memory calls were seen; nothing was written under {}",
                self.run_dir.display()
            )?;
        }
        for d in &self.devices {
            writeln!(
                f,
                "  {:<11} peak {:>10}  live at end {:>10} in {} blocks  ({} allocs, {} frees, {} failed)",
                device_name(d.device),
                human(d.peak),
                human(d.live_bytes),
                d.live_blocks,
                d.mallocs,
                d.frees,
                d.failures
            )?;
            if d.untracked_frees > 0 {
                writeln!(
                    f,
                    "              {} of the frees were of blocks allocated before the trace (table ms_untracked_frees)",
                    d.untracked_frees
                )?;
            }
            let pools: Vec<&PoolLine> = self.pools.iter().filter(|p| p.device == d.device).collect();
            let shared = pools.iter().any(|p| p.pid != pools[0].pid);
            for p in pools {
                let pool = if shared { format!("{} (pid {})", p.pool, p.pid) } else { p.pool.to_owned() };
                writeln!(
                    f,
                    "              torch_npu {:<9} peak allocated {:>10} / reserved {:>10}; at end {} / {} in {} blocks",
                    pool,
                    human(p.peak_used),
                    human(p.peak_total),
                    human(p.used),
                    human(p.total),
                    p.live_blocks
                )?;
            }
            if let Some(file) = &d.file {
                writeln!(f, "              {}", file.display())?;
            }
        }
        if self.devices.iter().any(|d| d.device == DeviceKey::Unknown) {
            writeln!(
                f,
                "  (device ?: threads that chose their device before the trace started, until they named one; kept apart from the device files, which Insight opens)"
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frees_of_blocks_from_before_the_trace_are_counted_per_device() {
        let line = |device, untracked_frees| DeviceLine {
            device,
            peak: 0,
            live_bytes: 0,
            live_blocks: 0,
            mallocs: 1,
            frees: 4,
            untracked_frees,
            failures: 0,
            file: None,
        };
        let summary = Summary {
            stop_reason: "target exited".into(),
            elapsed: Duration::from_secs(1),
            calls: 5,
            lost: 0,
            undecodable: 0,
            run_dir: PathBuf::from("/tmp/x"),
            devices: vec![line(DeviceKey::Npu(0), 3), line(DeviceKey::Npu(1), 0)],
            pools: vec![],
        };
        let text = summary.to_string();
        let said: Vec<&str> = text.lines().filter(|l| l.contains("allocated before the trace")).collect();
        assert_eq!(said.len(), 1, "{text}");
        assert!(said[0].trim_start().starts_with("3 of the frees"), "{text}");
    }

    #[test]
    fn human_units() {
        assert_eq!(human(0), "0 B");
        assert_eq!(human(1023), "1023 B");
        assert_eq!(human(1536), "1.5 KiB");
        assert_eq!(human(3 << 30), "3.0 GiB");
    }
}
