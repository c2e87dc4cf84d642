//! Ending a trace: the signals that stop it, and detaching the probes off the critical path.
//!
//! Detaching is slow in the kernel: each uprobe perf event waits for an RCU grace period when it
//! is closed (`uprobe_unregister_sync`, under the global `event_mutex`, so closing them from
//! several threads barely overlaps them: 20 events, 3.6 s one after another, 1.9 s from 20
//! threads), 0.11-0.18 s per event here: 8-37 s for a trace of 37-171 probes. A supervisor's
//! grace period (`docker stop`, Kubernetes: 10 s) is shorter than that, so the session finishes
//! its DBs first, while this module's thread detaches, and the summary prints before the
//! detaching ends. A second stop signal skips the wait for it; the DBs are complete by then.
//! Where the kernel has multi-uprobe links the loader uses two per library (and one per markers
//! module), which wait once each and are closed here in parallel, and the wait is short anyway
//! (0.15 s for 171 probes).

use std::time::{Duration, Instant};

use anyhow::Context as _;
use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::sync::oneshot;

use crate::attach::Tracer;
use crate::terminal::say::say;

/// SIGHUP, as the summary and `ms_meta`'s `stop_reason` name it when it ends a trace.
pub const HANGUP: &str = "hung up (SIGHUP)";

/// The signals that end a trace. Held from the start of the loop to the end of the detach
/// wait, so a signal that arrives while the DBs are being finished is not lost.
pub struct Signals {
    int: Signal,
    term: Signal,
    hup: Signal,
}

impl Signals {
    pub fn new() -> anyhow::Result<Self> {
        Ok(Self {
            int: signal(SignalKind::interrupt()).context("cannot handle SIGINT")?,
            term: signal(SignalKind::terminate()).context("cannot handle SIGTERM")?,
            // A closed terminal or a supervisor's hang-up ends the trace like SIGTERM: with
            // the default action the DBs were left unfinished (exit 129).
            hup: signal(SignalKind::hangup()).context("cannot handle SIGHUP")?,
        })
    }

    /// The next of the three signals, SIGHUP included, as the summary and `ms_meta`'s
    /// `stop_reason` name it.
    pub async fn next(&mut self) -> &'static str {
        self.next_or_hangup().await.unwrap_or(HANGUP)
    }

    /// The next stop signal, or `None` for SIGHUP, which asks a daemon to apply its
    /// configuration again rather than to stop (a trace stops on it: [`HANGUP`]).
    pub async fn next_or_hangup(&mut self) -> Option<&'static str> {
        tokio::select! {
            _ = self.int.recv() => Some("interrupted (SIGINT)"),
            _ = self.term.recv() => Some("terminated (SIGTERM)"),
            _ = self.hup.recv() => None,
        }
    }
}

/// Resolves once `--duration` has passed (never without one), with the stop reason the summary
/// and `ms_meta` give.
pub async fn deadline(duration: Option<Duration>) -> String {
    match duration {
        Some(d) => {
            tokio::time::sleep(d).await;
            format!("--duration {:.1} s reached", d.as_secs_f64())
        }
        None => std::future::pending().await,
    }
}

/// A piece of a loop's periodic work (commit, rescan, publish): due once its period has passed
/// since it last ran.
pub struct Every {
    period: Duration,
    last: Instant,
}

impl Every {
    pub fn new(period: Duration) -> Self {
        Self { period, last: Instant::now() }
    }

    /// Whether the work is due now; if so it counts as done from now.
    pub fn due(&mut self) -> bool {
        let due = self.last.elapsed() >= self.period;
        if due {
            self.last = Instant::now();
        }
        due
    }

    /// Counts the work as done now (it ran for another reason).
    pub fn ran(&mut self) {
        self.last = Instant::now();
    }
}

/// Probes being detached on a thread of their own.
pub struct Detaching {
    done: oneshot::Receiver<Duration>,
    signals: Signals,
}

impl Detaching {
    /// Drops `tracer` (closing every link and perf event) on a new thread.
    pub fn start(tracer: Tracer, signals: Signals) -> Self {
        let (tx, done) = oneshot::channel();
        let spawned = std::thread::Builder::new().name("memscope-detach".into()).spawn(move || {
            let start = Instant::now();
            detach(tracer);
            let _ = tx.send(start.elapsed());
        });
        if let Err(e) = spawned {
            // No thread: the probes go when the process exits, which the kernel does the same way.
            say!("memscope-bpf: warning: cannot start the detaching thread ({e}); detaching at exit");
        }
        Self { done, signals }
    }

    /// Waits until the probes are detached, unless a further stop signal comes first (also one
    /// that came while the DBs were being finished). Returns how long the detach took, if it
    /// was waited for.
    pub async fn wait(mut self, quiet: bool) -> Option<Duration> {
        match self.done.try_recv() {
            Ok(took) => return Some(took),
            Err(oneshot::error::TryRecvError::Closed) => return None,
            Err(oneshot::error::TryRecvError::Empty) => {}
        }
        if !quiet {
            say!("memscope-bpf: detaching the probes; the DB files are complete (Ctrl-C again to exit now)");
        }
        tokio::select! {
            took = &mut self.done => took.ok(),
            reason = self.signals.next() => {
                if !quiet {
                    say!("memscope-bpf: {reason} again: exiting; the kernel removes the remaining probes");
                }
                None
            }
        }
    }
}

/// Closes the multi-uprobe links on a thread each (their grace-period waits overlap: nothing
/// serialises them in the kernel), and the marker sites' perf events likewise (they overlap
/// less, see the module doc), while this thread drops the rest of the tracer.
fn detach(mut tracer: Tracer) {
    let spawn =
        |what: Box<dyn Send>| std::thread::Builder::new().name("memscope-unlink".into()).spawn(move || drop(what));
    let mut closers = Vec::new();
    for link in tracer.take_multi_links() {
        closers.push(spawn(Box::new(link)));
    }
    for site in tracer.take_usdt_links() {
        closers.push(spawn(Box::new(site)));
    }
    drop(tracer);
    for closer in closers.into_iter().flatten() {
        let _ = closer.join();
    }
}
