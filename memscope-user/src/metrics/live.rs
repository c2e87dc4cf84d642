//! The series of each job's live view (`memscope_core::ingest::live`): live bytes by owner
//! (the largest `--owner-labels` owners, the rest as `owner="other"`, so the cardinality stays
//! bounded however many tags a job uses), its last step, and the degradation verdict of each
//! device's families, the same test `analyze --analysis leaks` runs on the job's DB.
//!
//! The owner breakdown is a family of its own, not more labels on `memscope_live_bytes`: a sum
//! over a metric's series must not mix totals with their parts.

use memscope_core::analysis::degradation::{Trend, Verdict};
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Unit;

use super::{device_label, JobTotals, Labels};

/// One gauge family over every job's rows of one kind.
fn gauges<'a>(
    encoder: &mut DescriptorEncoder<'_>,
    (name, help, unit): (&str, &str, Option<&Unit>),
    series: impl Iterator<Item = (Labels, i64)> + 'a,
) -> Result<(), std::fmt::Error> {
    let mut metric = encoder.encode_descriptor(name, help, unit, ConstGauge::new(0i64).metric_type())?;
    for (labels, value) in series {
        ConstGauge::new(value).encode(metric.encode_family(&labels)?)?;
    }
    Ok(())
}

fn job_labels(job: &JobTotals) -> Labels {
    job.labels()
}

/// A job's verdicts with their labels.
fn trend_series(job: &JobTotals) -> impl Iterator<Item = (Labels, Trend)> + '_ {
    job.trends.iter().map(move |t| {
        let mut labels = job_labels(job);
        labels.extend([("device", device_label(t.device)), ("layer", t.family.as_str().to_owned())]);
        (labels, t.trend)
    })
}

pub fn encode(encoder: &mut DescriptorEncoder<'_>, jobs: &[JobTotals]) -> Result<(), std::fmt::Error> {
    let owners = jobs.iter().flat_map(|job| {
        job.owners.iter().map(move |o| {
            let mut labels = job_labels(job);
            labels.extend([
                ("device", device_label(o.device)),
                ("layer", o.family.as_str().to_owned()),
                ("owner", o.owner.clone()),
            ]);
            (labels, o.bytes)
        })
    });
    let help = "Live bytes by owner (tag path), estimated from the sampled rows' weights under --sample-bytes; the largest --owner-labels owners of a job, the rest as owner=\"other\"";
    gauges(encoder, ("memscope_owner_live", help, Some(&Unit::Bytes)), owners)?;

    let steps = jobs.iter().filter_map(|job| {
        let (step, source) = job.step?;
        let mut labels = job_labels(job);
        labels.push(("source", source.as_str().to_owned()));
        Some((labels, step as i64))
    });
    let help = "The step that ended at the job's last boundary (source: markers, or time windows of --step-window)";
    gauges(encoder, ("memscope_step", help, None), steps)?;

    let trend = trend_series;
    let help = "1 when live bytes at the step boundaries rise in a sustained way (the test of analyze --analysis leaks: Mann-Kendall, Theil-Sen, above the noise, not one jump)";
    let sustained = jobs.iter().flat_map(trend).map(|(l, t)| (l, i64::from(t.verdict == Verdict::SustainedRise)));
    gauges(encoder, ("memscope_degradation_sustained", help, None), sustained)?;
    let help = "Theil-Sen rise of live bytes over the boundaries after the warm-up (slope times steps)";
    let rise = jobs.iter().flat_map(trend).map(|(l, t)| (l, t.rise as i64));
    gauges(encoder, ("memscope_degradation_rise", help, Some(&Unit::Bytes)), rise)?;
    let help = "Boundaries the degradation test ran on (a verdict needs 5)";
    let points = jobs.iter().flat_map(trend).map(|(l, t)| (l, t.points as i64));
    gauges(encoder, ("memscope_degradation_points", help, None), points)
}
