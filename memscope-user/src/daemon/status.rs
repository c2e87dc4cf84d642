//! The daemon's live status (`crate::terminal::status`, as `trace` shows it) from the totals it publishes
//! for Prometheus: each running job's devices (live and peak bytes, out-of-memory failures, the
//! exact counts when sampling) and its largest owners, labelled `PID (COMM)`, with its
//! current step when it marks steps.

use crate::metrics::{self, JobTotals};
use crate::terminal::status::{DeviceFacts, Facts, OwnerFacts};

/// The status of `jobs` (the running ones) with the daemon's `calls` and `lost` so far.
pub fn facts(jobs: &[JobTotals], calls: u64, lost: u64) -> Facts {
    let mut devices = Vec::new();
    let mut owners = Vec::new();
    for job in jobs {
        let label = match job.step {
            Some((step, _)) => format!("{} ({}, step {step})", job.pid, job.comm),
            None => format!("{} ({})", job.pid, job.comm),
        };
        for (key, stats) in &job.devices {
            devices.push(DeviceFacts {
                job: Some(label.clone()),
                device: metrics::device_label(*key),
                live_bytes: stats.used,
                peak_bytes: stats.peak,
                out_of_memory: stats.out_of_memory,
            });
        }
        owners.extend(job.owners.iter().filter(|o| o.bytes > 0 && o.owner != memscope_core::ingest::live::OTHER).map(
            |o| OwnerFacts {
                job: Some(job.pid.to_string()),
                device: metrics::device_label(o.device),
                owner: o.owner.clone(),
                bytes: o.bytes,
            },
        ));
    }
    owners.sort_by_key(|o| std::cmp::Reverse(o.bytes));
    Facts { calls, lost, devices, owners, step: None, jobs: Some(jobs.len()) }
}

#[cfg(test)]
mod tests {
    use memscope_core::analysis::decompose::Family;
    use memscope_core::ingest::live::{OwnerLive, StepSource, OTHER};
    use memscope_core::model::{DeviceKey, DeviceStats};

    use super::*;

    #[test]
    fn each_jobs_devices_and_owners_are_labelled_with_the_job_and_the_summed_other_is_left_out() {
        let mut stats = DeviceStats::default();
        (stats.used, stats.peak, stats.out_of_memory) = (3 << 20, 5 << 20, 1);
        let owner = |name: &str, bytes| OwnerLive {
            device: DeviceKey::Npu(1),
            family: Family::Hal,
            owner: name.to_owned(),
            bytes,
            blocks: 1,
        };
        let job = JobTotals {
            pid: 42,
            comm: "python3".into(),
            devices: vec![(DeviceKey::Npu(1), stats)],
            owners: vec![owner("CANN@APP", 2 << 20), owner(OTHER, 1 << 20), owner("CANN@HCCL", 0)],
            step: Some((3, StepSource::Markers)),
            ..JobTotals::default()
        };
        let f = facts(&[job], 900, 2);
        assert_eq!(f.jobs, Some(1));
        assert_eq!(f.devices.len(), 1);
        assert_eq!(f.devices[0].job.as_deref(), Some("42 (python3, step 3)"));
        assert_eq!(
            (f.devices[0].device.as_str(), f.devices[0].live_bytes, f.devices[0].peak_bytes),
            ("1", 3 << 20, 5 << 20)
        );
        let owners: Vec<(&str, i64)> = f.owners.iter().map(|o| (o.owner.as_str(), o.bytes)).collect();
        assert_eq!(owners, [("CANN@APP", 2 << 20)]);
    }
}
