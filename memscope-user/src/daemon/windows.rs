//! When the daemon's windows open and close (`--windows LENGTH/EVERY`): the sampled APIs'
//! probes are attached for LENGTH at the start of every EVERY (`attach::loader::windows`).
//!
//! A window goes through four phases: open; draining (the allocations' probes gone, the
//! frees' kept until every block born in the window is freed, or for LENGTH more at most);
//! detaching (the frees' probes going); closed. Only once the last probe is gone are the
//! blocks still live forgotten (`Tracker::forget_sampled`): a free that ran before that is seen.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use memscope_core::model::DeviceKey;

/// `--windows LENGTH/EVERY`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Schedule {
    pub length: Duration,
    pub every: Duration,
}

/// `--windows`: a schedule, or the probes attached at all times.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Windowing {
    Always,
    Every(Schedule),
}

/// The schedule when none is given.
pub const DEFAULT: Schedule = Schedule { length: Duration::from_secs(30), every: Duration::from_secs(300) };

/// Parses `--windows`: `always` or `LENGTH/EVERY`.
pub fn parse(text: &str) -> Result<Windowing, String> {
    if text == "always" {
        return Ok(Windowing::Always);
    }
    let usage = "expected LENGTH/EVERY (e.g. 20s/5m) or `always`";
    let (length, every) = text.split_once('/').ok_or_else(|| format!("`{text}`: {usage}"))?;
    let parse = |part: &str| crate::cli::parse_duration(part).map_err(|e| format!("`{text}`: {e}; {usage}"));
    let (length, every) = (parse(length)?, parse(every)?);
    if length.is_zero() || length > every {
        return Err(format!(
            "`{text}`: a window must last more than 0 s and no longer than the time between openings ({usage})"
        ));
    }
    Ok(Windowing::Every(Schedule { length, every }))
}

/// A device that fills to this share of its memory (the driver's figure) opens a window at once,
/// so that an OOM's flight recording has the pool's blocks.
pub const NEAR_FULL: f64 = 0.9;
/// ... once per crossing: many jobs sit that full for good (vLLM's KV cache, a caching
/// allocator's reserve), so a device must fall under this share to open another.
pub const NEAR_FULL_AGAIN: f64 = 0.8;

/// The devices that crossed [`NEAR_FULL`] and have not fallen under [`NEAR_FULL_AGAIN`] since.
#[derive(Debug, Default)]
pub struct Fill(HashSet<DeviceKey>);

impl Fill {
    /// Takes a device's reading; whether it has just filled up.
    pub fn crossed(&mut self, device: DeviceKey, used: u64, total: u64) -> bool {
        let share = used as f64 / total.max(1) as f64;
        if share < NEAR_FULL_AGAIN {
            self.0.remove(&device);
            false
        } else {
            share >= NEAR_FULL && self.0.insert(device)
        }
    }
}

/// How often a drain counts the blocks still live.
const LOOK_EVERY: Duration = Duration::from_millis(500);

/// What the daemon does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Attach the sampled APIs' probes.
    Open,
    /// Detach the allocations' probes.
    Close,
    /// Detach the frees' probes.
    EndDrain,
    /// Drain the ring, then forget the blocks still live.
    Forget,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Closed { next: Instant },
    Open { since: Instant },
    Draining { since: Instant, closed: Instant },
    Detaching { since: Instant },
}

/// The schedule and where it stands, with what the metrics say of it.
#[derive(Debug)]
pub struct Windows {
    schedule: Schedule,
    phase: Phase,
    /// When a drain last counted the blocks still live (a walk of every job's blocks).
    looked: Option<Instant>,
    /// Windows opened so far.
    pub opened: u64,
    /// Blocks still live when a window's last probe went, all windows together.
    pub forgotten: u64,
}

impl Windows {
    /// The first window opens at once.
    pub fn new(schedule: Schedule, now: Instant) -> Self {
        Self { schedule, phase: Phase::Closed { next: now }, looked: None, opened: 0, forgotten: 0 }
    }

    /// Brings the next opening forward to `now` (a trigger: the card nearly full, a job's live
    /// bytes rising for good); whether it did (a window is open or draining already, or the
    /// next one is due anyway).
    pub fn open_soon(&mut self, now: Instant) -> bool {
        match &mut self.phase {
            Phase::Closed { next } if *next > now => {
                *next = now;
                true
            }
            _ => false,
        }
    }

    /// Whether the allocations' probes are attached.
    pub fn is_open(&self) -> bool {
        matches!(self.phase, Phase::Open { .. })
    }

    /// Whether a drain's blocks are all freed, counted at most every [`LOOK_EVERY`] (the loop
    /// asks every 20 ms, and the count walks every block of every job).
    fn drained(&mut self, now: Instant, live: impl FnOnce() -> usize) -> bool {
        if self.looked.is_some_and(|at| now < at + LOOK_EVERY) {
            return false;
        }
        self.looked = Some(now);
        live() == 0
    }

    /// The step due at `now`, given the blocks born in windows that are still live and whether
    /// the probes taken off so far are gone (each asked only in the phase that needs it).
    pub fn next(
        &mut self,
        now: Instant,
        live: impl FnOnce() -> usize,
        detached: impl FnOnce() -> bool,
    ) -> Option<Step> {
        let Schedule { length, every } = self.schedule;
        let current = self.phase;
        let (phase, step) = match current {
            Phase::Closed { next } if now >= next => (Phase::Open { since: now }, Step::Open),
            Phase::Open { since } if now >= since + length => (Phase::Draining { since, closed: now }, Step::Close),
            Phase::Draining { since, closed } if now >= closed + length || self.drained(now, live) => {
                (Phase::Detaching { since }, Step::EndDrain)
            }
            Phase::Detaching { since } if detached() => {
                (Phase::Closed { next: (since + every).max(now) }, Step::Forget)
            }
            _ => return None,
        };
        self.phase = phase;
        if step == Step::Open {
            self.opened += 1;
        }
        Some(step)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn a_device_opens_a_window_once_per_filling_up() {
        let mut fill = Fill::default();
        let (npu0, npu1) = (DeviceKey::Npu(0), DeviceKey::Npu(1));
        let readings = [(npu0, 50), (npu0, 91), (npu0, 95), (npu1, 92), (npu0, 85), (npu0, 93), (npu0, 79), (npu0, 90)];
        let crossed: Vec<bool> = readings.iter().map(|&(d, used)| fill.crossed(d, used, 100)).collect();
        assert_eq!(crossed, [false, true, false, true, false, false, false, true]);
    }

    #[test]
    fn schedules_parse_and_bad_ones_say_what_is_expected() {
        assert_eq!(parse("always"), Ok(Windowing::Always));
        assert_eq!(parse("20s/5m"), Ok(Windowing::Every(Schedule { length: 20 * S, every: 300 * S })));
        for bad in ["20s", "5m/20s", "0s/1m", "x/1m"] {
            let e = parse(bad).unwrap_err();
            assert!(e.contains("LENGTH/EVERY") && e.contains(bad), "{e}");
        }
    }

    #[test]
    fn a_window_opens_closes_drains_and_forgets_only_once_its_probes_are_gone() {
        let t0 = Instant::now();
        let mut w = Windows::new(Schedule { length: 10 * S, every: 60 * S }, t0);
        assert_eq!(w.next(t0, || 0, || true), Some(Step::Open));
        assert!(w.is_open());
        assert_eq!(w.next(t0 + 9 * S, || 5, || true), None);
        assert_eq!(w.next(t0 + 10 * S, || 5, || true), Some(Step::Close));
        assert!(!w.is_open());
        // Blocks born in the window are live: the frees stay, up to LENGTH more.
        assert_eq!(w.next(t0 + 12 * S, || 3, || true), None);
        assert_eq!(w.next(t0 + 12 * S + LOOK_EVERY / 2, || 0, || true), None, "not counted again so soon");
        assert_eq!(w.next(t0 + 13 * S, || 0, || true), Some(Step::EndDrain), "all freed");
        assert_eq!(w.next(t0 + 14 * S, || 0, || false), None, "the frees' probes are still going");
        assert_eq!(w.next(t0 + 15 * S, || 0, || true), Some(Step::Forget));
        assert_eq!(w.next(t0 + 59 * S, || 0, || true), None);
        assert_eq!(w.next(t0 + 60 * S, || 0, || true), Some(Step::Open), "EVERY counts from the last opening");
        assert_eq!(w.next(t0 + 70 * S, || 9, || true), Some(Step::Close));
        assert_eq!(w.next(t0 + 80 * S, || 9, || true), Some(Step::EndDrain), "the drain lasts LENGTH at most");
        assert_eq!(w.opened, 2);
        // A trigger brings the next opening forward, only while closed.
        assert_eq!(w.next(t0 + 81 * S, || 0, || true), Some(Step::Forget));
        assert!(w.open_soon(t0 + 90 * S));
        assert!(!w.open_soon(t0 + 90 * S), "due already");
        assert_eq!(w.next(t0 + 90 * S, || 0, || true), Some(Step::Open));
        assert!(!w.open_soon(t0 + 91 * S), "open already");
        assert_eq!(w.next(t0 + 100 * S, || 0, || true), Some(Step::Close));
        assert!(!w.open_soon(t0 + 101 * S), "draining");
    }
}
