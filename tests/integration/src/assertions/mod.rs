//! Comparing the tracer's rows with the ground truth: the workload's calls ([`calls`]), the
//! driver's own allocations ([`driver`]), the allocator's blocks and segments ([`pool`]), and
//! MindStudio Insight's import rules for every DB ([`insight`]).

mod calls;
mod driver;
mod insight;
mod pool;

pub use calls::*;
pub use driver::*;
pub use insight::*;
pub use pool::*;

/// Splits one thread's events at one address, in time order, into those before the trace went
/// live (no row) and those the `rows` rows stand for: a trace misses only what came before it,
/// and a thread's calls at one address happen in order, so the rows are the last events.
fn tail_pairs<'e, E: std::fmt::Debug>(events: &'e [E], rows: usize, what: &str) -> (&'e [E], &'e [E]) {
    assert!(rows <= events.len(), "{rows} rows for {} {what}: {events:#?}", events.len());
    events.split_at(events.len() - rows)
}
