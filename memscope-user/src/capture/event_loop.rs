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
    /// Resolves when the kernel wakes the ring's reader ([`super::ring::Consumer::woken`]).
    fn wakeup(&self) -> impl Future<Output = ()> + '_;
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
            () = capture.wakeup() => {
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

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    /// A capture that counts what the loop asks of it and ends where it is told to.
    #[derive(Default)]
    struct Fake {
        drains: u32,
        ticks: u32,
        /// `tick` ends the loop at this tick.
        done_at_tick: Option<u32>,
        /// SIGHUP ends the loop (a trace) or is counted (the daemon's reload).
        hangup_stops: bool,
        hangups: u32,
        awaits_target: bool,
        target_exits: Vec<String>,
        /// `check` fails after this many turns.
        fail_after_turns: Option<u32>,
        turns: Cell<u32>,
    }

    impl Capturing for Fake {
        fn wakeup(&self) -> impl Future<Output = ()> + '_ {
            std::future::pending()
        }
        fn drain(&mut self) {
            self.drains += 1;
        }
        fn woken(&mut self) -> anyhow::Result<()> {
            Ok(())
        }
        fn publish(&mut self) {}
        fn commit(&mut self) -> anyhow::Result<()> {
            Ok(())
        }
        fn tick(&mut self) -> anyhow::Result<Option<String>> {
            self.ticks += 1;
            Ok((Some(self.ticks) == self.done_at_tick).then(|| "done".to_owned()))
        }
        fn hangup(&mut self) -> Option<String> {
            self.hangups += 1;
            self.hangup_stops.then(|| stop::HANGUP.to_owned())
        }
        fn awaits_target(&self) -> bool {
            self.awaits_target
        }
        fn target_exited(&mut self, (reason, _): TargetExit) -> Option<String> {
            self.target_exits.push(reason);
            // Its children still run: the loop goes on without the target.
            self.awaits_target = false;
            None
        }
        fn check(&mut self) -> anyhow::Result<()> {
            self.turns.set(self.turns.get() + 1);
            match self.fail_after_turns {
                Some(n) if self.turns.get() > n => anyhow::bail!("write failed"),
                _ => Ok(()),
            }
        }
    }

    fn never() -> std::future::Pending<TargetExit> {
        std::future::pending()
    }

    /// One test: the loop's signals are the process's, and SIGHUP is raised here.
    #[test]
    fn the_loop_ends_where_its_capture_a_signal_or_the_deadline_says() {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let mut signals = Signals::new().unwrap();

            let mut fake = Fake { done_at_tick: Some(3), ..Fake::default() };
            assert_eq!(run(&mut fake, &mut signals, None, never()).await.unwrap(), "done");
            assert_eq!((fake.ticks, fake.drains), (3, 3), "each tick drains first");

            let mut fake = Fake::default();
            let reason = run(&mut fake, &mut signals, Some(Duration::from_millis(100)), never()).await.unwrap();
            assert!(reason.starts_with("--duration 0.1 s"), "{reason}");
            assert!(fake.ticks >= 2, "ticks every 20 ms: {}", fake.ticks);

            // The target's exit is handed over once (its future is not polled again), and the
            // loop goes on with the children.
            let mut fake = Fake { awaits_target: true, done_at_tick: Some(5), ..Fake::default() };
            let exit = std::future::ready(("target exited".to_owned(), Some(0)));
            assert_eq!(run(&mut fake, &mut signals, None, exit).await.unwrap(), "done");
            assert_eq!(fake.target_exits, ["target exited"]);

            let mut fake = Fake { fail_after_turns: Some(2), ..Fake::default() };
            let err = run(&mut fake, &mut signals, None, never()).await.unwrap_err();
            assert_eq!(err.to_string(), "write failed");

            // SIGHUP: a trace stops on it; the daemon reloads and goes on.
            for hangup_stops in [true, false] {
                let mut fake = Fake { hangup_stops, done_at_tick: Some(10), ..Fake::default() };
                // SAFETY: raising a signal this process handles (Signals above).
                unsafe { libc::raise(libc::SIGHUP) };
                let reason = run(&mut fake, &mut signals, None, never()).await.unwrap();
                assert_eq!(fake.hangups, 1);
                assert_eq!(reason, if hangup_stops { stop::HANGUP } else { "done" });
            }
        });
    }
}
