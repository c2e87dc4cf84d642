//! The live status of `trace` and `daemon` while they run: elapsed time, calls and their rate,
//! lost records, live and peak bytes per device (per job, for the daemon), the largest owners,
//! the current step and the last OOM.
//!
//! Three forms, one content: on a terminal a status area redrawn in place about once a second
//! (indicatif, which clears it for any other line the trace prints: [`super::say`] holds it
//! and writes above it); on a pipe or file a plain line every [`LINE_EVERY`]; with `--json` one JSON
//! object per second on stdout, for programs. Nothing with `--quiet`.

use std::io::Write as _;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use memscope_core::printable::printable;
use memscope_core::units::human_bytes;
use serde::Serialize;

use super::say::{say, AREA};

/// How often a plain status line is written when stderr is not a terminal.
pub const LINE_EVERY: Duration = Duration::from_secs(10);
/// How often the status is renewed (the terminal's area, the JSON lines).
pub const RENEW_EVERY: Duration = Duration::from_secs(1);
/// Owners shown on a terminal.
const TOP_OWNERS: usize = 5;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// A status area redrawn in place (stderr is a terminal).
    Area,
    /// A plain line every [`LINE_EVERY`] on stderr.
    Lines,
    /// A JSON object per second on stdout.
    Json,
    Off,
}

impl Mode {
    /// `--quiet` wins, then `--json`, then what stderr is.
    pub fn choose(quiet: bool, json: bool) -> Self {
        use std::io::IsTerminal as _;
        if quiet {
            Self::Off
        } else if json {
            Self::Json
        } else if std::io::stderr().is_terminal() {
            Self::Area
        } else {
            Self::Lines
        }
    }
}

/// One device's bytes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DeviceFacts {
    /// The daemon's job, `PID (COMM)`; `None` for `trace`'s one target.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    pub device: String,
    pub live_bytes: u64,
    pub peak_bytes: u64,
    pub out_of_memory: u64,
}

/// One owner's live bytes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct OwnerFacts {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    pub device: String,
    pub owner: String,
    pub bytes: i64,
}

/// What the status says, as the trace knows it now.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Facts {
    pub calls: u64,
    pub lost: u64,
    pub devices: Vec<DeviceFacts>,
    /// The largest owners first.
    pub owners: Vec<OwnerFacts>,
    pub step: Option<u64>,
    /// The daemon's running jobs; `None` for `trace`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub jobs: Option<usize>,
}

/// A status line for programs (`--json`).
#[derive(Serialize)]
struct JsonLine<'a> {
    elapsed_s: f64,
    calls_per_s: f64,
    /// The device of the last out-of-memory failure, and how long ago (s).
    last_oom: Option<(&'a str, f64)>,
    #[serde(flatten)]
    facts: &'a Facts,
}

pub struct Status {
    mode: Mode,
    started: Instant,
    /// Calls and when, at the last renewal (for the rate).
    last: (u64, Instant),
    last_line: Option<Instant>,
    /// Out-of-memory failures seen so far, and the device and time of the last one.
    ooms: u64,
    last_oom: Option<(String, Instant)>,
}

impl Status {
    pub fn new(mode: Mode) -> Self {
        let now = Instant::now();
        if mode == Mode::Area {
            let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr_with_hz(4));
            bar.set_style(ProgressStyle::with_template("{msg}").expect("a valid template"));
            if let Ok(mut area) = AREA.lock() {
                *area = Some(bar);
            }
        }
        Self { mode, started: now, last: (0, now), last_line: None, ooms: 0, last_oom: None }
    }

    /// Whether the status wants the owners and steps (a live view fed beside the store).
    pub fn shown(&self) -> bool {
        self.mode != Mode::Off
    }

    /// Renews the status from `facts` (called every [`RENEW_EVERY`]).
    pub fn renew(&mut self, facts: &Facts) {
        let now = Instant::now();
        let ooms: u64 = facts.devices.iter().map(|d| d.out_of_memory).sum();
        if ooms > self.ooms {
            // The device whose count rose last in the list is as good a guess as any of two.
            let device = facts.devices.iter().rev().find(|d| d.out_of_memory > 0).map(|d| d.device.clone());
            self.last_oom = device.map(|d| (d, now));
            self.ooms = ooms;
        }
        let elapsed = now.duration_since(self.last.1).as_secs_f64().max(1e-3);
        let rate = facts.calls.saturating_sub(self.last.0) as f64 / elapsed;
        self.last = (facts.calls, now);
        match self.mode {
            Mode::Off => {}
            Mode::Area => {
                if let Some(bar) = AREA.lock().ok().and_then(|a| a.clone()) {
                    bar.set_message(self.text(facts, rate, now));
                }
            }
            Mode::Lines => {
                if self.last_line.is_none_or(|t| now.duration_since(t) >= LINE_EVERY) {
                    self.last_line = Some(now);
                    let text = self.text(facts, rate, now).replace("\n  ", "; ");
                    say!("memscope-bpf: status: {text}");
                }
            }
            Mode::Json => {
                let last_oom = self.last_oom.as_ref().map(|(d, t)| (d.as_str(), now.duration_since(*t).as_secs_f64()));
                let line = JsonLine {
                    elapsed_s: now.duration_since(self.started).as_secs_f64(),
                    calls_per_s: rate,
                    last_oom,
                    facts,
                };
                if let Ok(text) = serde_json::to_string(&line) {
                    let mut out = std::io::stdout().lock();
                    let _ = writeln!(out, "{text}");
                    let _ = out.flush();
                }
            }
        }
    }

    /// The status as lines for a person.
    fn text(&self, facts: &Facts, rate: f64, now: Instant) -> String {
        let elapsed = now.duration_since(self.started).as_secs();
        let jobs = facts.jobs.map(|n| format!(" · {n} job(s)")).unwrap_or_default();
        let mut lines = vec![format!(
            "tracing for {}:{:02}{jobs} · {} calls ({rate:.0}/s) · {} lost",
            elapsed / 60,
            elapsed % 60,
            facts.calls,
            facts.lost
        )];
        // Jobs (`PID (COMM)`) and owners are the targets' text; the JSON keeps it exact.
        let job = |j: &Option<String>| j.as_ref().map(|j| format!("job {} ", printable(j))).unwrap_or_default();
        for d in &facts.devices {
            let (live, peak) = (human_bytes(d.live_bytes), human_bytes(d.peak_bytes));
            lines.push(format!("{}device {}: {live} live, peak {peak}", job(&d.job), d.device));
        }
        if !facts.owners.is_empty() {
            let top: Vec<String> = facts
                .owners
                .iter()
                .take(TOP_OWNERS)
                .map(|o| {
                    format!(
                        "{}{} {}",
                        o.job.as_ref().map(|j| format!("{}: ", printable(j))).unwrap_or_default(),
                        printable(&o.owner),
                        human_bytes(o.bytes.max(0))
                    )
                })
                .collect();
            lines.push(format!("owners: {}", top.join(", ")));
        }
        let mut tail = Vec::new();
        if let Some(step) = facts.step {
            tail.push(format!("step {step}"));
        }
        if let Some((device, at)) = &self.last_oom {
            tail.push(format!("last OOM: device {device}, {} s ago", now.duration_since(*at).as_secs()));
        }
        if !tail.is_empty() {
            lines.push(tail.join(" · "));
        }
        lines.join("\n  ")
    }

    /// Takes the status area off the terminal (before the summary).
    pub fn finish(&mut self) {
        if let Some(bar) = AREA.lock().ok().and_then(|mut a| a.take()) {
            bar.finish_and_clear();
        }
    }
}

impl Drop for Status {
    fn drop(&mut self) {
        self.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts() -> Facts {
        Facts {
            calls: 1200,
            lost: 0,
            devices: vec![DeviceFacts {
                job: None,
                device: "0".into(),
                live_bytes: 3 << 20,
                peak_bytes: 5 << 20,
                out_of_memory: 1,
            }],
            owners: vec![OwnerFacts {
                job: None,
                device: "0".into(),
                owner: "PTA@vllm@kv_cache".into(),
                bytes: 2 << 20,
            }],
            step: Some(14),
            jobs: None,
        }
    }

    #[test]
    fn the_text_names_every_fact() {
        let mut status = Status::new(Mode::Off);
        status.renew(&facts());
        let text = status.text(&facts(), 98.0, Instant::now());
        for want in [
            "1200 calls (98/s)",
            "0 lost",
            "device 0: 3.0 MiB live, peak 5.0 MiB",
            "PTA@vllm@kv_cache 2.0 MiB",
            "step 14",
            "last OOM: device 0",
        ] {
            assert!(text.contains(want), "{want:?} missing from {text}");
        }
    }

    #[test]
    fn the_daemons_jobs_label_their_devices_and_owners() {
        let mut f = facts();
        f.jobs = Some(2);
        f.devices[0].job = Some("42 (python3, step 3)".into());
        f.owners[0].job = Some("42".into());
        let text = Status::new(Mode::Off).text(&f, 5.0, Instant::now());
        for want in ["· 2 job(s) ·", "job 42 (python3, step 3) device 0: 3.0 MiB live", "42: PTA@vllm@kv_cache 2.0 MiB"]
        {
            assert!(text.contains(want), "{want:?} missing from {text}");
        }
        let json = serde_json::to_value(&f).unwrap();
        assert_eq!(json["devices"][0]["job"], "42 (python3, step 3)");
        assert!(
            serde_json::to_value(facts()).unwrap()["devices"][0].get("job").is_none(),
            "trace's lines are unchanged"
        );
    }

    #[test]
    fn the_targets_owners_and_names_are_escaped_on_the_terminal_and_exact_in_json() {
        let mut f = facts();
        f.owners[0].owner = "PTA@x\u{1b}[2J\nmemscope-bpf: forged".into();
        f.owners[0].job = Some("42".into());
        f.devices[0].job = Some("42 (py\u{1b}]0;t\u{7})".into());
        let text = Status::new(Mode::Off).text(&f, 5.0, Instant::now());
        assert!(!text.contains('\u{1b}') && !text.contains("\nmemscope-bpf: forged"), "{text}");
        assert!(text.contains("42: PTA@x\\u{1b}[2J\\nmemscope-bpf: forged 2.0 MiB"), "{text}");
        assert!(text.contains("job 42 (py\\u{1b}]0;t\\u{7}) device 0"), "{text}");
        let json = serde_json::to_value(&f).unwrap();
        assert_eq!(json["owners"][0]["owner"], f.owners[0].owner.as_str());
    }

    #[test]
    fn quiet_wins_and_json_is_chosen_over_the_terminal() {
        assert_eq!(Mode::choose(true, true), Mode::Off);
        assert_eq!(Mode::choose(false, true), Mode::Json);
    }
}
