//! The flags of `analyze --analysis inefficient` and the options that set their thresholds:
//! msMemScope's op-index definitions and Insight's time-based ones, with how their values are
//! spelt on the command line and in reports.

use std::fmt;
use std::str::FromStr;

pub(super) use crate::units::parse_bytes;

/// msMemScope's `THREHOLD` (`inefficient_analyzer.h`) and `idle_threshold`'s default offline.
pub const DEFAULT_IDLE_THRESHOLD: u64 = 3000;

/// One bit per flag, in the order reports list them.
pub const EARLY_ALLOCATION: u8 = 1;
pub const LATE_DEALLOCATION: u8 = 1 << 1;
pub const TEMPORARY_IDLENESS: u8 = 1 << 2;
pub const LAZY_USED: u8 = 1 << 3;
pub const DELAYED_FREE: u8 = 1 << 4;
pub const LONG_IDLE: u8 = 1 << 5;
/// The flags msMemScope defines; only these go into `inefficient_type`, so tools that know its
/// vocabulary never meet a value they do not know.
pub const OP_INDEX_FLAGS: u8 = EARLY_ALLOCATION | LATE_DEALLOCATION | TEMPORARY_IDLENESS;

/// Every flag with its name (msMemScope's names for the op-index ones, Insight's for the others).
pub const FLAG_NAMES: [(u8, &str); 6] = [
    (EARLY_ALLOCATION, "early_allocation"),
    (LATE_DEALLOCATION, "late_deallocation"),
    (TEMPORARY_IDLENESS, "temporary_idleness"),
    (LAZY_USED, "lazy_used"),
    (DELAYED_FREE, "delayed_free"),
    (LONG_IDLE, "long_idle"),
];

/// `early_allocation,temporary_idleness`: the set flags of `mask`, comma-joined, in list order.
pub fn flag_list(flags: u8, mask: u8) -> String {
    let names: Vec<&str> = FLAG_NAMES.iter().filter(|(f, _)| flags & mask & f != 0).map(|(_, n)| *n).collect();
    names.join(",")
}

/// A threshold for a time-based flag, as Insight takes it: a duration, a share of the block's
/// lifetime, or both (either one exceeded fires, as Insight's `value OR percentage`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TimeThreshold {
    pub value_ns: Option<u64>,
    /// Percent of the block's lifetime (allocation to free), 0 < p < 100.
    pub percent: Option<f64>,
}

impl TimeThreshold {
    /// Whether `interval` exceeds the threshold (strictly, as Insight compares). The percentage is
    /// compared by cross-multiplying, so 200 ns of a 1000 ns life is exactly 20%, not 20.000001%.
    pub fn exceeded(&self, interval: i64, lifetime: i64) -> bool {
        interval > 0
            && (self.value_ns.is_some_and(|v| interval as u64 > v)
                || self.percent.is_some_and(|p| lifetime > 0 && interval as f64 * 100.0 > p * lifetime as f64))
    }
}

impl fmt::Display for TimeThreshold {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if let Some(v) = self.value_ns {
            parts.push(human_ns(v as i64));
        }
        if let Some(p) = self.percent {
            parts.push(format!("{p}% of the block's lifetime"));
        }
        f.write_str(&parts.join(" or "))
    }
}

/// `12.5 ms`, `300 ns`: a duration in the largest unit that keeps it readable.
pub fn human_ns(ns: i64) -> String {
    let abs = ns.unsigned_abs() as f64;
    let sign = if ns < 0 { "-" } else { "" };
    match ns.unsigned_abs() {
        1_000_000_000.. => format!("{sign}{:.3} s", abs / 1e9),
        1_000_000.. => format!("{sign}{:.3} ms", abs / 1e6),
        1_000.. => format!("{sign}{:.3} us", abs / 1e3),
        _ => format!("{ns} ns"),
    }
}

/// `5ms`, `2.5us`, `1s`: a positive duration with its unit, in ns.
pub(super) fn parse_time_ns(text: &str) -> Result<u64, String> {
    let split = text.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let unit_ns: f64 = match unit.trim() {
        "ns" => 1.0,
        "us" | "µs" => 1e3,
        "ms" => 1e6,
        "s" => 1e9,
        "m" | "min" => 60e9,
        "" => {
            return Err(format!(
            "`{text}` needs a unit: a duration such as 5ms, 200us, 1s, or a share of the block's lifetime such as 20%"
        ))
        }
        other => {
            return Err(format!("unknown unit `{other}` in `{text}` (use ns, us, ms, s, m, or % of the lifetime)"))
        }
    };
    let value: f64 = number.parse().map_err(|_| format!("`{text}` is not a duration (examples: 5ms, 200us, 1s)"))?;
    let ns = (value * unit_ns).round();
    if !(ns.is_finite() && ns >= 1.0 && ns < u64::MAX as f64) {
        return Err(format!("`{text}` must be a duration of at least 1ns"));
    }
    Ok(ns as u64)
}

impl FromStr for TimeThreshold {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let mut t = Self { value_ns: None, percent: None };
        for part in text.split(',').map(str::trim) {
            let twice = || format!("`{text}` gives two {}; give at most one duration and one percentage", part);
            if let Some(p) = part.strip_suffix('%') {
                let v: f64 = p.trim().parse().map_err(|_| format!("`{part}` is not a percentage (example: 20%)"))?;
                if !(v > 0.0 && v < 100.0) {
                    return Err(format!("`{part}`: a share of the block's lifetime must be above 0% and below 100%"));
                }
                if t.percent.replace(v).is_some() {
                    return Err(twice());
                }
            } else if t.value_ns.replace(parse_time_ns(part)?).is_some() {
                return Err(twice());
            }
        }
        Ok(t)
    }
}

// The options of `analyze --analysis inefficient`. Plain comments here: a doc comment on a
// flattened struct would replace the verb's own help text.
#[derive(Clone, Debug, PartialEq, clap::Args)]
#[command(next_help_heading = "Inefficient memory (--analysis inefficient)")]
pub struct Options {
    /// msMemScope's temporary_idleness: flag a block when two consecutive accesses to it are
    /// more than N APIs apart (ops and memory events outside ops, counted per process).
    #[arg(long, value_name = "N", default_value_t = DEFAULT_IDLE_THRESHOLD,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub idle_threshold: u64,

    /// Flag only blocks of at least this size, by either definition (msMemScope's mem_size):
    /// 1048576, 512KiB, 1MiB. Default: every block.
    #[arg(long, value_name = "BYTES", default_value = "0", hide_default_value = true, value_parser = parse_bytes)]
    pub mem_size: u64,

    /// Insight's lazy_used: flag blocks whose first access came more than THRESHOLD after their
    /// allocation. THRESHOLD is a duration (5ms, 200us), a share of the block's lifetime (20%),
    /// or both (5ms,20%: either exceeded flags). Off unless given, as in Insight.
    #[arg(long, value_name = "THRESHOLD")]
    pub lazy_used: Option<TimeThreshold>,

    /// Insight's delayed_free: flag blocks freed more than THRESHOLD after their last access (a
    /// block still live when the trace stopped counts as freed then). THRESHOLD as for --lazy-used.
    #[arg(long, value_name = "THRESHOLD")]
    pub delayed_free: Option<TimeThreshold>,

    /// Insight's long_idle: flag blocks with a gap of more than THRESHOLD between two consecutive
    /// accesses. THRESHOLD as for --lazy-used.
    #[arg(long, value_name = "THRESHOLD")]
    pub long_idle: Option<TimeThreshold>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            idle_threshold: DEFAULT_IDLE_THRESHOLD,
            mem_size: 0,
            lazy_used: None,
            delayed_free: None,
            long_idle: None,
        }
    }
}
