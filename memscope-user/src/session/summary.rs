//! The end-of-trace report printed to stderr: why it stopped, what was recorded and lost, and per
//! device the peak, what is still live and where its file is.
//!
//! Records lost from a full ring make the counts wrong in known directions, and the report says
//! which: every recorded call happened, so counts are lower bounds; a lost free leaves its block
//! live and a lost allocation hides one, so peak and live bytes may be off either way (and frees
//! can outnumber allocations, when the lost records were allocations).

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use memscope_core::model::DeviceKey;
use memscope_core::printable::printable;
use memscope_core::units::human_bytes;

use crate::capture::attaching::SkippedLibrary;

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

/// One framework pool (PyTorch's or torch_npu's caching allocator, torch_npu's workspace one) on one device: allocated
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
    /// Libraries found but not traced (at start or loaded later), in the order met.
    pub skipped_libraries: Vec<SkippedLibrary>,
    /// The launched command's exit status, which `trace` exits with (launch mode).
    pub target_status: Option<i32>,
    /// The target was launched under the probes, not attached to.
    pub launched: bool,
    /// Libraries probed only after the job loaded them (their first calls may be missing).
    pub late_libraries: Vec<String>,
}

/// What loss does to the counts, as the summary and `ms_meta` `loss_effect` say it.
pub const LOSS_EFFECT: &str = "allocs, frees and failures are lower bounds (frees may outnumber allocs); peak and live bytes may be off either way";

/// What probing a library only after the job loaded it does to the counts.
pub const LATE_EFFECT: &str = "calls these libraries took between their load and their probes (a rescan every 250 ms, then the attach) are not recorded: allocs, frees and failures are lower bounds";

/// The `ms_meta` keys that say whether the counts are exact: `counts_exact`, with loss
/// `loss_effect`, and with libraries probed after the job loaded them `late_libraries` and
/// `late_effect`: the trace cannot know what they did before their probes were live.
pub fn loss_meta(lost: u64, late: &[String]) -> Vec<(String, String)> {
    let mut meta = vec![("counts_exact".to_owned(), (lost == 0 && late.is_empty()).to_string())];
    if lost > 0 {
        meta.push(("loss_effect".to_owned(), LOSS_EFFECT.to_owned()));
    }
    if !late.is_empty() {
        meta.push(("late_libraries".to_owned(), late.join(", ")));
        meta.push(("late_effect".to_owned(), LATE_EFFECT.to_owned()));
    }
    meta
}

fn device_name(d: DeviceKey) -> String {
    match d {
        DeviceKey::Npu(n) => format!("device {n}"),
        DeviceKey::Cpu => "host (cpu)".into(),
        DeviceKey::Unknown => "device ?".into(),
    }
}

/// What the frees of blocks the trace never saw allocated were, as far as it can tell: nothing a
/// launched job allocated predates the trace, so there they are lost records or allocations made
/// before their library was probed (a library loaded later is probed a moment after its load).
fn untracked_cause(launched: bool, lost: u64) -> &'static str {
    match (launched, lost > 0) {
        (false, false) => "allocated before the trace",
        (false, true) => "allocated before the trace or whose allocation record was lost",
        (true, false) => "allocated before their library was probed (loaded while the job ran)",
        (true, true) => "whose allocation record was lost, or made before their library was probed",
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "memscope-bpf: stopped ({}) after {:.1} s", self.stop_reason, self.elapsed.as_secs_f64())?;
        writeln!(f, "memscope-bpf: {} calls recorded, {} lost (ring buffer full, all CPUs)", self.calls, self.lost)?;
        if self.lost > 0 {
            writeln!(
                f,
                "memscope-bpf: warning: {} records lost: {LOSS_EFFECT}; a larger --ring-mb rides out longer bursts",
                self.lost
            )?;
        }
        if self.undecodable > 0 {
            writeln!(f, "memscope-bpf: {} records could not be decoded", self.undecodable)?;
        }
        if !self.late_libraries.is_empty() {
            let names: Vec<_> = self.late_libraries.iter().map(|l| printable(l)).collect();
            writeln!(
                f,
                "memscope-bpf: warning: probed after the job loaded them: {}; {LATE_EFFECT} (name them with --lib, \
                 or set ASCEND_HOME_PATH, so they are probed from the start)",
                names.join(", ")
            )?;
        }
        if !self.skipped_libraries.is_empty() {
            let n = self.skipped_libraries.len();
            let names: Vec<_> = self.skipped_libraries.iter().map(|s| printable(&s.library)).collect();
            let what = if n == 1 { "library" } else { "libraries" };
            writeln!(f, "memscope-bpf: {n} {what} not traced (see the warnings): {}", names.join(", "))?;
        }
        if self.devices.is_empty() {
            writeln!(
                f,
                "memscope-bpf: no memory calls were seen; nothing was written under {}",
                self.run_dir.display()
            )?;
        }
        // Under loss the counts are at least what was recorded.
        let at_least = if self.lost > 0 { ">=" } else { "" };
        for d in &self.devices {
            writeln!(
                f,
                "  {:<11} peak {:>10}  live at end {:>10} in {} blocks  ({at_least}{} allocs, {at_least}{} frees, {at_least}{} failed)",
                device_name(d.device),
                human_bytes(d.peak),
                human_bytes(d.live_bytes),
                d.live_blocks,
                d.mallocs,
                d.frees,
                d.failures
            )?;
            if d.untracked_frees > 0 {
                let why = untracked_cause(self.launched, self.lost);
                writeln!(
                    f,
                    "              {} of the frees were of blocks {why} (table ms_untracked_frees)",
                    d.untracked_frees
                )?;
            }
            let pools: Vec<&PoolLine> = self.pools.iter().filter(|p| p.device == d.device).collect();
            let shared = pools.iter().any(|p| p.pid != pools[0].pid);
            for p in pools {
                let pool = if shared { format!("{} (pid {})", p.pool, p.pid) } else { p.pool.to_owned() };
                writeln!(
                    f,
                    "              {:<9} pool peak allocated {:>10} / reserved {:>10}; at end {} / {} in {} blocks",
                    pool,
                    human_bytes(p.peak_used),
                    human_bytes(p.peak_total),
                    human_bytes(p.used),
                    human_bytes(p.total),
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

    fn summary(lost: u64) -> Summary {
        Summary {
            stop_reason: "target exited".into(),
            elapsed: Duration::from_secs(2),
            calls: 1000,
            lost,
            undecodable: 0,
            run_dir: PathBuf::from("/tmp/run"),
            devices: vec![DeviceLine {
                device: DeviceKey::Npu(0),
                peak: 4096,
                live_bytes: 0,
                live_blocks: 0,
                mallocs: 400,
                frees: 420,
                untracked_frees: 0,
                failures: 0,
                file: None,
            }],
            pools: Vec::new(),
            skipped_libraries: Vec::new(),
            target_status: None,
            launched: false,
            late_libraries: vec![],
        }
    }

    #[test]
    fn loss_marks_the_counts_it_affects() {
        let text = summary(37).to_string();
        assert!(text.contains("1000 calls recorded, 37 lost"), "{text}");
        assert!(text.contains("warning: 37 records lost: allocs, frees and failures are lower bounds"), "{text}");
        assert!(text.contains("peak and live bytes may be off either way"), "{text}");
        assert!(text.contains("(>=400 allocs, >=420 frees, >=0 failed)"), "{text}");
        assert_eq!(
            loss_meta(37, &[]),
            [("counts_exact".to_owned(), "false".to_owned()), ("loss_effect".to_owned(), LOSS_EFFECT.to_owned())]
        );
    }

    #[test]
    fn skipped_library_paths_are_escaped() {
        let mut s = summary(0);
        let library = "/tmp/lib\u{1b}[2J\nmemscope-bpf: forged.so".to_owned();
        s.skipped_libraries.push(SkippedLibrary { library, reason: "not an ELF file".into() });
        let text = s.to_string();
        assert!(!text.contains('\u{1b}') && !text.contains("\nmemscope-bpf: forged"), "{text}");
        assert!(text.contains("1 library not traced (see the warnings): /tmp/lib\\u{1b}[2J\\nmemscope-bpf: forged.so"));
    }

    #[test]
    fn without_loss_the_counts_are_exact() {
        let text = summary(0).to_string();
        assert!(text.contains("1000 calls recorded, 0 lost"), "{text}");
        assert!(!text.contains("warning"), "{text}");
        assert!(!text.contains(">="), "{text}");
        assert!(text.contains("(400 allocs, 420 frees, 0 failed)"), "{text}");
        let late = loss_meta(0, &["libacl_rt.so".to_owned()]);
        assert!(
            late.contains(&("counts_exact".to_owned(), "false".to_owned())),
            "a late library's first calls are unknown"
        );
        assert!(late.iter().any(|(k, v)| k == "late_libraries" && v == "libacl_rt.so"));
        let text = Summary { late_libraries: vec!["libacl_rt.so".into()], ..summary(0) }.to_string();
        assert!(text.contains("probed after the job loaded them: libacl_rt.so"), "{text}");
        assert_eq!(loss_meta(0, &[]), [("counts_exact".to_owned(), "true".to_owned())]);
    }

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
            skipped_libraries: vec![],
            target_status: None,
            launched: false,
            late_libraries: vec![],
        };
        let text = summary.to_string();
        let said: Vec<&str> = text.lines().filter(|l| l.contains("allocated before the trace")).collect();
        assert_eq!(said.len(), 1, "{text}");
        assert!(said[0].trim_start().starts_with("3 of the frees"), "{text}");
        // Launched, nothing predates the trace; under loss the records may be what is missing.
        let launched = Summary { launched: true, lost: 4, ..summary };
        let text = launched.to_string();
        assert!(!text.contains("allocated before the trace"), "{text}");
        assert!(text.contains("3 of the frees were of blocks whose allocation record was lost"), "{text}");
    }
}
