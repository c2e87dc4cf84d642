//! What the probes say about their own trouble (`trace --bpf-log`): a user stack the kernel
//! could not walk, a stack window it could not copy, a Python walk whose reads failed or that
//! ran out of its bound.
//!
//! The probes write those through aya-log (the `AYA_LOGS` ring, a second, small ring beside the
//! events); aya-log's reader turns each into a `log::Record`, which [`BpfLog`] prints on stderr
//! and counts for the summary. The records' own flags count the same trouble whether or not
//! this is on; this adds which thread, where and what the kernel returned. Off, the probes'
//! level is 0 and no message is even formatted in the kernel.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::terminal::say::say;

/// How much the probes tell (`--bpf-log LEVEL`): each level includes those above it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum BpfLogLevel {
    /// Failed reads and walks cut by a bound.
    Warn,
    /// Also what is expected but may explain a missing stack (a thread with no Python state, a
    /// stack window read again at half its size).
    Debug,
}

impl BpfLogLevel {
    /// The value of the probes' `AYA_LOG_LEVEL` (aya-log's numbering, which is `log`'s).
    pub fn kernel_value(level: Option<Self>) -> u8 {
        match level {
            None => 0,
            Some(Self::Warn) => log::Level::Warn as u8,
            Some(Self::Debug) => log::Level::Debug as u8,
        }
    }
}

/// Messages seen, by level; shared with the summary.
#[derive(Debug, Default)]
pub struct BpfLogCounts {
    pub warnings: AtomicU64,
    pub other: AtomicU64,
}

impl BpfLogCounts {
    /// `(warnings and errors, the rest)`.
    pub fn get(&self) -> (u64, u64) {
        (self.warnings.load(Ordering::Relaxed), self.other.load(Ordering::Relaxed))
    }
}

/// Prints the probes' messages as they are drained, one line each, and counts them.
pub struct BpfLog {
    pub counts: Arc<BpfLogCounts>,
}

impl log::Log for BpfLog {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        // The kernel side filtered already.
        true
    }

    fn log(&self, record: &log::Record<'_>) {
        let counter = if record.level() <= log::Level::Warn { &self.counts.warnings } else { &self.counts.other };
        counter.fetch_add(1, Ordering::Relaxed);
        let level = record.level().as_str().to_ascii_lowercase();
        say!("memscope-bpf: bpf {level}: {}", record.args());
    }

    fn flush(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use log::Log as _;

    #[test]
    fn kernel_levels_are_aya_logs_numbers_and_off_is_zero() {
        // aya-log-ebpf lets a message through when its level <= AYA_LOG_LEVEL.
        assert_eq!(BpfLogLevel::kernel_value(None), 0);
        assert_eq!(BpfLogLevel::kernel_value(Some(BpfLogLevel::Warn)), aya_log_common::Level::Warn as u8);
        assert_eq!(BpfLogLevel::kernel_value(Some(BpfLogLevel::Debug)), aya_log_common::Level::Debug as u8);
    }

    #[test]
    fn messages_are_counted_by_level() {
        let log = BpfLog { counts: Arc::default() };
        for level in [log::Level::Warn, log::Level::Warn, log::Level::Debug] {
            log.log(&log::Record::builder().level(level).args(format_args!("x")).build());
        }
        assert_eq!(log.counts.get(), (2, 1));
    }
}
