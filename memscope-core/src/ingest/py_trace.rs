//! Python function intervals from sampled stacks (`trace --python-trace`): msMemScope's
//! `python_trace_<pid>` table, which MindStudio Insight draws as a flame graph per thread,
//! filled from outside the process. msMemScope records each call and return in the process (a
//! profile hook); we see each thread's stack at every sample, so a function runs, for us, from
//! the first sample that finds it on the stack to the last one before a sample that does not.
//!
//! Each end is put half way to the neighbouring sample (at most half a sampling period away):
//! the true call and return are somewhere in between, so an end is within half a period of the
//! truth for a thread on a CPU. A thread that waits (I/O, a lock) is not sampled meanwhile; its
//! functions' intervals bridge the wait when the same frames are there on both sides, and a
//! function called and returned between two samples is not seen at all.
//!
//! Frames are told apart by their code object, never by line: a function stays one interval
//! while its line moves. Insight nests a thread's intervals by their start alone and takes an
//! interval that ends where the next starts for its parent, so each interval's start is moved
//! `depth + 1` ns later and its end `depth + 1` ns earlier: a child then starts after its parent
//! and ends before it, and siblings never touch, at the outermost level too.

use std::collections::BTreeMap;
use std::sync::Arc;

pub use crate::store::py_trace::PyTraceRow;

/// One frame of a sample: its code object (the identity) and `file(line): name`, msMemScope's
/// `FuncInfo`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PyFunction {
    pub code: u64,
    pub info: Arc<str>,
}

#[derive(Clone, Debug)]
struct Open {
    function: PyFunction,
    start_ns: u64,
    last_ns: u64,
}

#[derive(Default)]
struct Thread {
    /// Outermost first.
    open: Vec<Open>,
    last_sample_ns: u64,
}

/// Every traced thread's open functions.
pub struct Builder {
    /// Half the sampling period: the most an end is moved from its sample.
    half_period_ns: u64,
    threads: BTreeMap<(u32, u32), Thread>,
    /// Samples taken, for the summary.
    pub samples: u64,
}

impl Builder {
    pub fn new(hz: u32) -> Self {
        Self { half_period_ns: 500_000_000 / u64::from(hz.max(1)), threads: BTreeMap::new(), samples: 0 }
    }

    /// A thread's stack at `ts_ns` (`frames` outermost first); the intervals it closed.
    pub fn sample(&mut self, pid: u32, tid: u32, ts_ns: u64, frames: &[PyFunction], out: &mut Vec<PyTraceRow>) {
        self.samples += 1;
        let half = self.half_period_ns;
        let thread = self.threads.entry((pid, tid)).or_default();
        // Samples come in order per thread; a late one (another CPU's) is taken as now.
        let ts = ts_ns.max(thread.last_sample_ns);
        let kept = thread.open.iter().zip(frames).take_while(|(o, f)| o.function.code == f.code).count();
        let gap = if thread.last_sample_ns == 0 { half } else { ((ts - thread.last_sample_ns) / 2).min(half) };
        close(pid, tid, thread.open.drain(kept..).enumerate().map(|(i, o)| (kept + i, o)), |last| last + gap, out);
        for o in &mut thread.open {
            o.last_ns = ts;
        }
        for f in &frames[kept..] {
            thread.open.push(Open { function: f.clone(), start_ns: ts - gap, last_ns: ts });
        }
        thread.last_sample_ns = ts;
    }

    /// A process exited, or the trace stopped (`None`): its threads' open functions end half a
    /// period after their last sample.
    pub fn close(&mut self, pid: Option<u32>, out: &mut Vec<PyTraceRow>) {
        let half = self.half_period_ns;
        let keys: Vec<(u32, u32)> = self.threads.keys().filter(|(p, _)| pid.is_none_or(|x| x == *p)).copied().collect();
        for key in keys {
            let thread = self.threads.remove(&key).expect("listed");
            close(key.0, key.1, thread.open.into_iter().enumerate(), |last| last + half, out);
        }
    }
}

/// Ends `open` (with their depths), deepest first, each at `end(last sample)`.
fn close(
    pid: u32,
    tid: u32,
    open: impl DoubleEndedIterator<Item = (usize, Open)>,
    end: impl Fn(u64) -> u64,
    out: &mut Vec<PyTraceRow>,
) {
    for (depth, o) in open.rev() {
        // Depth + 1: siblings at the outermost level must not touch either.
        let d = depth as u64 + 1;
        let start_ns = o.start_ns + d;
        let end_ns = end(o.last_ns).saturating_sub(d).max(start_ns + 1);
        out.push(PyTraceRow { pid, tid, info: o.function.info, start_ns, end_ns });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(code: u64, name: &str) -> PyFunction {
        PyFunction { code, info: name.into() }
    }

    fn rows(samples: &[(u64, &[PyFunction])]) -> Vec<(String, u64, u64)> {
        let mut b = Builder::new(100);
        let mut out = Vec::new();
        for (ts, frames) in samples {
            b.sample(1, 2, *ts, frames, &mut out);
        }
        b.close(None, &mut out);
        out.into_iter().map(|r| (r.info.to_string(), r.start_ns, r.end_ns)).collect()
    }

    const MS: u64 = 1_000_000;

    #[test]
    fn a_function_runs_from_half_way_before_its_first_sample_to_half_way_after_its_last() {
        let (main, a, b) = (f(1, "main"), f(2, "a"), f(3, "b"));
        let got = rows(&[
            (100 * MS, &[main.clone(), a.clone()]),
            (110 * MS, &[main.clone(), a.clone()]),
            (120 * MS, &[main.clone(), b.clone()]),
            (130 * MS, std::slice::from_ref(&main)),
        ]);
        assert_eq!(
            got,
            [
                ("a".into(), 95 * MS + 2, 115 * MS - 2),
                ("b".into(), 115 * MS + 2, 125 * MS - 2),
                ("main".into(), 95 * MS + 1, 135 * MS - 1),
            ]
        );
    }

    #[test]
    fn frames_are_told_apart_by_code_object_and_a_wait_is_bridged_but_bounded() {
        let (main, a, a_again) = (f(1, "main"), f(2, "a"), f(4, "a"));
        let got = rows(&[
            (100 * MS, &[main.clone(), a.clone()]),
            // The thread waited 2 s inside `a`: still one interval.
            (2100 * MS, &[main.clone(), a.clone()]),
            // Another code object of the same name: a new call.
            (2110 * MS, &[main.clone(), a_again.clone()]),
        ]);
        assert_eq!(got[0], ("a".into(), 95 * MS + 2, 2105 * MS - 2));
        assert_eq!(got[1], ("a".into(), 2105 * MS + 2, 2115 * MS - 2));
        assert_eq!(got[2], ("main".into(), 95 * MS + 1, 2115 * MS - 1));
    }

    #[test]
    fn children_start_after_and_end_before_their_parents_and_siblings_never_touch() {
        let frames = [f(1, "main"), f(2, "step"), f(3, "leaf")];
        let got = rows(&[(100 * MS, &frames), (110 * MS, &frames[..2]), (120 * MS, &frames)]);
        let by = |n: &str| got.iter().filter(|r| r.0 == n).cloned().collect::<Vec<_>>();
        let (main, step, leaf) = (by("main"), by("step"), by("leaf"));
        assert!(main[0].1 < step[0].1 && step[0].1 < leaf[0].1, "{got:?}");
        assert!(leaf[1].2 < step[0].2 && step[0].2 < main[0].2, "{got:?}");
        assert!(leaf[0].2 < leaf[1].1, "siblings: {got:?}");
    }
}
