//! The one loop of `trace` and of the daemon: drain the ring when the kernel wakes us (a lot is
//! waiting) and on a short timer (the BPF side wakes us only then, see `maps::output`), renew
//! what is published, commit at least every second, and let the capture do its own periodic
//! work, until a stop signal or `--duration`, or until the capture itself says it is done.
//!
//! What differs between a trace and the daemon (one target and its children or every job on
//! the node; SIGHUP a stop or a reload; libraries looked for as loads are reported or on a
//! schedule) is the [`Capturing`] each brings; the timing and the order of a turn are here.

use std::future::Future;
use std::time::Duration;

use super::ring::Consumer;
use super::stop::{self, Every, Signals};

/// How often the ring is drained without a wakeup.
const DRAIN_EVERY: Duration = Duration::from_millis(20);
/// How often the totals served for Prometheus are renewed (it scrapes every 15 s by default).
const PUBLISH_EVERY: Duration = Duration::from_millis(500);
/// How often the rows are committed: what a kill or a power cut can cost at most.
const COMMIT_EVERY: Duration = Duration::from_secs(1);
/// The kernel wakes the consumer early once this fraction of the ring is waiting.
pub const WAKEUP_FRACTION: u64 = 4;

/// How the trace ended on its own (the target exited: how, and its exit status when the
/// tracer launched it).
pub type TargetExit = (String, Option<i32>);

/// What a capture does at each point of the loop.
pub trait Capturing {
    /// The ring's consumer, polled for the kernel's wakeups.
    fn consumer(&self) -> &Consumer;
    /// Feeds every record waiting in the ring on.
    fn drain(&mut self);
    /// After a wakeup's drain: what the records asked for now (libraries just loaded).
    fn woken(&mut self) -> anyhow::Result<()>;
    /// Renews the totals served for Prometheus and the live status.
    fn publish(&mut self);
    /// Commits the rows written so far.
    fn commit(&mut self) -> anyhow::Result<()>;
    /// The capture's own periodic work, after each timed drain; `Some(reason)` ends the loop.
    fn tick(&mut self) -> anyhow::Result<Option<String>>;
    /// SIGHUP: `Some(reason)` ends the loop.
    fn hangup(&mut self) -> Option<String>;
    /// Whether the target's exit is still awaited (the trace's; never the daemon's).
    fn awaits_target(&self) -> bool;
    /// The target exited: `Some(reason)` ends the loop, `None` goes on with its children.
    fn target_exited(&mut self, exit: TargetExit) -> Option<String>;
    /// After each turn: an error that ends the loop (the first failed write).
    fn check(&mut self) -> anyhow::Result<()>;
}

/// Runs the loop until a stop signal, `duration`, or the capture ends it; returns why it
/// stopped. `target_exit` resolves when the target exits (never, for the daemon).
pub async fn run(
    capture: &mut impl Capturing,
    signals: &mut Signals,
    duration: Option<Duration>,
    target_exit: impl Future<Output = TargetExit>,
) -> anyhow::Result<String> {
    let deadline = stop::deadline(duration);
    tokio::pin!(deadline);
    tokio::pin!(target_exit);
    let mut drain_tick = tokio::time::interval(DRAIN_EVERY);
    let (mut publish, mut commit) = (Every::new(PUBLISH_EVERY), Every::new(COMMIT_EVERY));
    loop {
        let awaits_target = capture.awaits_target();
        tokio::select! {
            signal = signals.next_or_hangup() => match signal {
                Some(reason) => return Ok(reason.to_owned()),
                None => {
                    if let Some(reason) = capture.hangup() {
                        return Ok(reason);
                    }
                }
            },
            reason = &mut deadline => return Ok(reason),
            exit = &mut target_exit, if awaits_target => {
                if let Some(reason) = capture.target_exited(exit) {
                    return Ok(reason);
                }
            }
            () = capture.consumer().woken() => {
                capture.drain();
                capture.woken()?;
            }
            _ = drain_tick.tick() => {
                capture.drain();
                if publish.due() {
                    capture.publish();
                }
                if commit.due() {
                    capture.commit()?;
                }
                if let Some(reason) = capture.tick()? {
                    return Ok(reason);
                }
            }
        }
        capture.check()?;
    }
}
