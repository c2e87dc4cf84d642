//! Steps found from the repeating pattern of allocations, for a trace that has no step of any
//! kind (no markers, no `STEP` rows the tracer inferred from Python stacks: a C++ job, a job
//! traced with `--no-infer`, msMemScope's capture of an unmarked job). A training or serving
//! loop allocates the same sizes in the same order every iteration, so the sizes of its busiest
//! stream of blocks repeat with the iteration's length as their period.
//!
//! Written here, not taken from a library: what is needed is the smallest lag at which a
//! sequence equals itself shifted (with room for noise), then where the repetition starts and
//! which of its allocations starts an iteration; each is a few lines over the sequence, where
//! a general period detector (autocorrelation by FFT) would answer a different question (the
//! dominant frequency of a signal, not the exact lag of a token sequence). The rule is
//! conservative: no period, or one whose iteration is a single repeated size, gives no steps.

use super::db::DumpDb;
use super::AnalysisError;
use crate::vocab::{Event, EventType};

/// Shortest period taken for an iteration (one block of one size repeated is not a step).
const MIN_PERIOD: usize = 2;
/// Longest period looked for, in allocations of the stream.
const MAX_PERIOD: usize = 50_000;
/// Iterations the judged part of the stream must hold at least.
const MIN_REPEATS: usize = 3;
/// Share (%) of the judged positions equal to the one a period later.
const MATCH_PCT: usize = 95;
/// Share (%) of an iteration equal to its neighbour's for a boundary to be kept.
const WINDOW_PCT: usize = 90;
/// Positions compared per candidate period.
const SAMPLES: usize = 2048;
/// The stream's latest allocations read, at most (and the latest allocations of all, among
/// which the busiest stream is chosen): enough for ten iterations of 50,000 allocations, and a
/// bounded read of a DB of any size.
const MAX_TOKENS: usize = 500_000;

/// A repetition: its period, and the first index from which it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Repeat {
    pub period: usize,
    pub first: usize,
}

/// The smallest period at which the last two thirds of `tokens` repeat (the first third is
/// often warm-up: an optimizer's state, a cache filling), and where the repetition starts.
pub fn period(tokens: &[u64]) -> Option<Repeat> {
    let n = tokens.len();
    let judged = n / 3;
    let max = ((n - judged) / MIN_REPEATS).min(MAX_PERIOD);
    let period = (MIN_PERIOD..=max).find(|&p| {
        let span = n - p - judged;
        let samples = span.min(SAMPLES);
        let same = (0..samples).filter(|k| {
            let i = judged + k * span / samples;
            tokens[i] == tokens[i + p]
        });
        same.count() * 100 >= samples * MATCH_PCT
    })?;
    // One size over and over: no iteration to tell apart.
    let one = &tokens[n - period..];
    if one.iter().all(|t| *t == one[0]) {
        return None;
    }
    let windows = Windows::new(tokens, period);
    let first = (0..n.saturating_sub(2 * period)).find(|&i| windows.holds(i))?;
    Some(Repeat { period, first })
}

/// Match counts of `tokens[i] == tokens[i + period]`, summed, to judge any window at once.
struct Windows {
    period: usize,
    /// `sums[i]`: matches among the positions before `i`.
    sums: Vec<usize>,
}

impl Windows {
    fn new(tokens: &[u64], period: usize) -> Self {
        let mut sums = vec![0];
        for i in 0..tokens.len().saturating_sub(period) {
            sums.push(sums[i] + usize::from(tokens[i] == tokens[i + period]));
        }
        Self { period, sums }
    }

    /// Whether the iteration starting at `i` equals the next one (mostly).
    fn holds(&self, i: usize) -> bool {
        let end = i + self.period;
        end < self.sums.len() && (self.sums[end] - self.sums[i]) * 100 >= self.period * WINDOW_PCT
    }
}

/// The indices that start an iteration: the residue (mod the period) after whose allocations
/// the loop paused the longest, on the whole (between iterations a loop loads data, logs,
/// syncs), from the repetition's start on, while an iteration equals a neighbour.
pub fn starts(ts: &[i64], tokens: &[u64], repeat: Repeat) -> Vec<usize> {
    let Repeat { period, first } = repeat;
    let mut gaps = vec![0i128; period];
    for i in first.max(1)..ts.len() {
        gaps[i % period] += i128::from(ts[i].saturating_sub(ts[i - 1]));
    }
    let residue = (0..period).max_by_key(|&r| (gaps[r], std::cmp::Reverse(r))).unwrap_or(0);
    let windows = Windows::new(tokens, period);
    let start = first + (residue + period - first % period) % period;
    (start..ts.len())
        .step_by(period)
        .filter(|&i| windows.holds(i) || (i >= period && windows.holds(i - period)))
        .collect()
}

/// The step boundaries (timestamps) of a trace without steps, from its busiest stream (the
/// process and block kind with the most of the latest allocations); empty when the trace has
/// steps or no repetition is found.
pub fn boundaries(db: &DumpDb) -> Result<Vec<i64>, AnalysisError> {
    let read = |source| AnalysisError::Read { path: db.path().to_owned(), source };
    let table = db.table();
    let has_steps: bool = db
        .conn()
        .query_row(
            &format!(
                "SELECT EXISTS (SELECT 1 FROM {table} WHERE (Event = ?1 AND \"Event Type\" = ?2) OR \
                 (Event = ?3 AND \"Event Type\" = ?4 AND Name IN ('step start', '\"step start\"')))"
            ),
            [Event::System.as_str(), EventType::Step.as_str(), Event::Mstx.as_str(), EventType::RangeStart.as_str()],
            |r| r.get(0),
        )
        .map_err(read)?;
    if has_steps {
        return Ok(Vec::new());
    }
    let busiest: Option<(i64, String)> = db
        .conn()
        .query_row(
            &format!(
                "SELECT \"Process Id\", \"Event Type\" FROM (SELECT \"Process Id\", \"Event Type\" FROM {table} \
                 WHERE Event = ?1 ORDER BY rowid DESC LIMIT {MAX_TOKENS}) GROUP BY 1, 2 ORDER BY count(*) DESC LIMIT 1"
            ),
            [Event::Malloc.as_str()],
            |r| Ok(Some((r.get(0)?, r.get(1)?))),
        )
        .or_else(|e| if e == rusqlite::Error::QueryReturnedNoRows { Ok(None) } else { Err(e) })
        .map_err(read)?;
    let Some((pid, event_type)) = busiest else { return Ok(Vec::new()) };
    let sql = format!(
        "SELECT \"Timestamp(ns)\", json_extract(Attr, '$.size') FROM {table} \
         WHERE Event = ?1 AND \"Process Id\" = ?2 AND \"Event Type\" = ?3 ORDER BY rowid DESC LIMIT {MAX_TOKENS}"
    );
    let mut stmt = db.conn().prepare(&sql).map_err(read)?;
    let rows = stmt.query_map(rusqlite::params![Event::Malloc.as_str(), pid, event_type], |r| {
        let size: Option<String> = r.get::<_, Option<rusqlite::types::Value>>(1)?.map(|v| match v {
            rusqlite::types::Value::Text(t) => t,
            rusqlite::types::Value::Integer(i) => i.to_string(),
            _ => String::new(),
        });
        Ok((r.get::<_, i64>(0)?, size.and_then(|s| s.parse::<u64>().ok()).unwrap_or(0)))
    });
    let mut read_rows: Vec<(i64, u64)> = rows.and_then(Iterator::collect).map_err(read)?;
    read_rows.reverse();
    let (ts, tokens): (Vec<i64>, Vec<u64>) = read_rows.into_iter().unzip();
    let Some(repeat) = period(&tokens) else { return Ok(Vec::new()) };
    Ok(starts(&ts, &tokens, repeat).into_iter().map(|i| ts[i]).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A loop: a warm-up, then `iterations` of the same sizes, a pause before each.
    fn loop_of(warmup: &[u64], iteration: &[u64], iterations: usize) -> (Vec<i64>, Vec<u64>) {
        let (mut ts, mut tokens, mut t) = (Vec::new(), Vec::new(), 0i64);
        for &s in warmup {
            t += 10;
            ts.push(t);
            tokens.push(s);
        }
        for _ in 0..iterations {
            t += 1000;
            for &s in iteration {
                ts.push(t);
                tokens.push(s);
                t += 10;
            }
        }
        (ts, tokens)
    }

    #[test]
    fn a_loop_is_cut_at_the_pause_before_each_iteration() {
        let iteration = [64, 4096, 4096, 64, 128, 4096, 8];
        let (ts, tokens) = loop_of(&[1, 2, 3, 64, 9], &iteration, 10);
        let repeat = period(&tokens).expect("a period");
        assert_eq!(repeat.period, 7);
        let starts = starts(&ts, &tokens, repeat);
        assert_eq!(starts, (0..10).map(|k| 5 + 7 * k).collect::<Vec<_>>(), "each iteration's first allocation");
    }

    #[test]
    fn noise_within_iterations_is_tolerated_and_no_repetition_gives_no_steps() {
        let iteration: Vec<u64> = (1..=40).collect();
        let (ts, mut tokens) = loop_of(&[], &iteration, 8);
        tokens[100] = 999; // one allocation of another size in the third iteration
        let repeat = period(&tokens).expect("a period");
        assert_eq!(repeat.period, 40);
        assert_eq!(starts(&ts, &tokens, repeat).len(), 8);
        let random: Vec<u64> = (0..500u64).map(|i| i.wrapping_mul(2_654_435_761) % 997).collect();
        assert_eq!(period(&random), None);
        assert_eq!(period(&[4096; 300]), None, "one size over and over is not a loop of steps");
        assert_eq!(period(&[1, 2, 1]), None, "too short to repeat three times");
    }

    /// A traced loop with no step of any kind: each iteration's temporaries are freed, one block
    /// of a size nothing else has is kept. The leaks analysis gets its steps from the pattern and
    /// finds the kept blocks, and only them.
    #[test]
    fn a_trace_without_steps_gets_them_from_its_allocations_and_its_leak_is_found() {
        use crate::analysis::db::DumpDb;
        use crate::analysis::leaks;
        use crate::analysis::steps::Source;
        use crate::analysis::testdb::{dir, TestDb};
        let mut db = TestDb::create(&dir("step-pattern").join("d.db"));
        let mut t = 1_000_000_000i64;
        db.system("START_TRACE", t);
        db.malloc("PTA", t + 1, 0x10_0000, 1 << 20, None);
        for k in 0..10u64 {
            t += 1_000_000;
            for (i, size) in [4096u64, 8192, 512, 8192].into_iter().enumerate() {
                db.malloc("PTA", t + i as i64 * 10, 0x20_0000 + i as u64 * 0x1_0000, size, None);
            }
            for i in 0..4u64 {
                db.free("PTA", t + 100 + i as i64, 0x20_0000 + i * 0x1_0000);
            }
            db.malloc("PTA", t + 200, 0x100_0000 + k * 0x1000, 1000, None);
        }
        db.system("STOP_TRACE", t + 1_000_000);
        let dump = DumpDb::open_read(&db.path).unwrap();
        assert_eq!(boundaries(&dump).unwrap().len(), 10, "one step per iteration");
        let r = leaks::analyse(&dump, &leaks::Options::default()).unwrap();
        assert!(r.boundaries.iter().all(|b| b.source == Source::Pattern), "{:?}", r.boundaries);
        assert!(!r.candidates.is_empty());
        assert!(r.candidates.iter().all(|c| c.size == 1000), "only the kept blocks: {:?}", r.candidates);
        // A trace with a step marked has those steps only.
        crate::analysis::steps::testrows::step(&mut db, t + 2_000_000, 1);
        assert!(boundaries(&DumpDb::open_read(&db.path).unwrap()).unwrap().is_empty());
    }
}
