//! Owner attribution: the tag spans open on each thread, and the owner path they give a block.
//!
//! msMemScope's rules (shared/reference/msmemscope-and-insight.md §1.3, §4.1), which existing
//! scripts rely on:
//! - spans are per thread; each system level (component, process, detail 1-2) shows its newest
//!   open label, and opening the label already on top again only counts a repeat;
//! - user labels fill USER_DEFINED_1..3 in the order they opened; a fourth is dropped;
//! - an owner path is the framework label (from the allocator) and then every non-empty level,
//!   joined with `@`; an address tag replaces its level's label for that one block.
//!
//! Spans opened before the tracer attached are unknown to it: their pops find nothing and are
//! ignored, and allocations inside them carry only what was opened after the attach.

use std::collections::HashMap;
use std::sync::Arc;

use super::event::level;

/// The labels of levels 1..=7 (index = level; 0, the framework, comes from the allocator).
pub type Labels = [Option<Arc<str>>; 8];

/// The labels a live block keeps: one copy shared by every block allocated under the same open
/// spans, and nothing at all for a block allocated under none (most of them). A block's state
/// is otherwise a few words, so a per-block array of labels would be most of the tracer's memory.
pub type BlockLabels = Option<Arc<Labels>>;

static NO_LABELS: Labels = [const { None }; 8];

/// The labels behind a [`BlockLabels`].
pub fn of(labels: &BlockLabels) -> &Labels {
    labels.as_deref().unwrap_or(&NO_LABELS)
}

/// Open spans of one level: (label, repeats), newest last.
type Stack = Vec<(Arc<str>, u32)>;

#[derive(Debug, Default)]
struct ThreadTags {
    /// Levels 1..=4 (index 0 unused: the framework is not a span).
    system: [Stack; 5],
    user: Stack,
    /// The labels these spans give, made once for all the blocks allocated until they change.
    shared: BlockLabels,
}

impl ThreadTags {
    fn stack(&mut self, level: u8) -> Option<&mut Stack> {
        match level {
            level::COMPONENT..=level::DETAIL_2 => self.system.get_mut(usize::from(level)),
            level::USER_DEFINED_1..=level::USER_DEFINED_3 => Some(&mut self.user),
            _ => None,
        }
    }

    fn is_empty(&self) -> bool {
        self.user.is_empty() && self.system.iter().all(Vec::is_empty)
    }
}

/// All threads' open spans.
#[derive(Debug, Default)]
pub struct Tags {
    threads: HashMap<(u32, u32), ThreadTags, foldhash::fast::RandomState>,
}

impl Tags {
    pub fn push(&mut self, pid: u32, tid: u32, level: u8, label: &str) {
        let thread = self.threads.entry((pid, tid)).or_default();
        thread.shared = None;
        let Some(stack) = thread.stack(level) else { return };
        match stack.last_mut() {
            Some((top, repeats)) if &**top == label => *repeats += 1,
            _ => stack.push((Arc::from(label), 1)),
        }
    }

    /// Closes the newest open span with this label at this level; `false` when none is open
    /// (opened before the attach, or a caller's mismatch).
    pub fn pop(&mut self, pid: u32, tid: u32, level: u8, label: &str) -> bool {
        let Some(thread) = self.threads.get_mut(&(pid, tid)) else { return false };
        thread.shared = None;
        let Some(stack) = thread.stack(level) else { return false };
        let Some(at) = stack.iter().rposition(|(l, _)| &**l == label) else { return false };
        stack[at].1 -= 1;
        if stack[at].1 == 0 {
            stack.remove(at);
        }
        if thread.is_empty() {
            self.threads.remove(&(pid, tid));
        }
        true
    }

    /// The labels a block allocated now by this thread carries.
    pub fn labels(&self, pid: u32, tid: u32) -> Labels {
        let mut labels = Labels::default();
        let Some(thread) = self.threads.get(&(pid, tid)) else { return labels };
        for (lvl, stack) in thread.system.iter().enumerate().skip(1) {
            labels[lvl] = stack.last().map(|(l, _)| l.clone());
        }
        let user = usize::from(level::USER_DEFINED_1);
        for (i, (label, _)) in thread.user.iter().take(3).enumerate() {
            labels[user + i] = Some(label.clone());
        }
        labels
    }

    /// [`Self::labels`], shared with the thread's other blocks born under the same spans.
    pub fn block_labels(&mut self, pid: u32, tid: u32) -> BlockLabels {
        if let Some(shared) = &self.threads.get(&(pid, tid))?.shared {
            return Some(shared.clone());
        }
        let labels = self.labels(pid, tid);
        if !any(&labels) {
            return None;
        }
        let shared = Arc::new(labels);
        self.threads.get_mut(&(pid, tid)).expect("looked up above").shared = Some(shared.clone());
        Some(shared)
    }

    /// Forgets a process's threads (it exited).
    pub fn forget_process(&mut self, pid: u32) {
        self.threads.retain(|(p, _), _| *p != pid);
    }
}

/// `framework@level1@...`, skipping empty levels.
pub fn owner_path(framework: &str, labels: &Labels) -> String {
    let mut path = framework.to_owned();
    for label in labels.iter().skip(1).flatten() {
        if !path.is_empty() {
            path.push('@');
        }
        path.push_str(label);
    }
    path
}

/// Whether any level has a label.
fn any(labels: &Labels) -> bool {
    labels.iter().any(Option::is_some)
}

/// The level an address tag's label replaces (user tags go to the first user level).
pub fn tag_level(level: u8) -> Option<usize> {
    match level {
        level::COMPONENT..=level::USER_DEFINED_3 => Some(usize::from(level)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(tags: &Tags, tid: u32) -> String {
        owner_path("PTA", &tags.labels(1, tid))
    }

    #[test]
    fn system_levels_show_the_newest_and_repeats_are_counted() {
        let mut t = Tags::default();
        t.push(1, 10, level::COMPONENT, "vllm");
        t.push(1, 10, level::PROCESS, "profile_run");
        t.push(1, 10, level::PROCESS, "profile_run");
        assert_eq!(path(&t, 10), "PTA@vllm@profile_run");
        t.push(1, 10, level::PROCESS, "serve");
        assert_eq!(path(&t, 10), "PTA@vllm@serve", "the newest label of a level wins");
        assert!(t.pop(1, 10, level::PROCESS, "serve"));
        assert!(t.pop(1, 10, level::PROCESS, "profile_run"));
        assert_eq!(path(&t, 10), "PTA@vllm@profile_run", "one repeat is still open");
        assert!(t.pop(1, 10, level::PROCESS, "profile_run"));
        assert_eq!(path(&t, 10), "PTA@vllm");
    }

    #[test]
    fn user_labels_fill_three_slots_in_order_and_extras_drop() {
        let mut t = Tags::default();
        for l in ["a", "b", "c", "d"] {
            t.push(1, 10, level::USER_DEFINED_1, l);
        }
        t.push(1, 10, level::DETAIL_1, "weight");
        assert_eq!(path(&t, 10), "PTA@weight@a@b@c");
        assert!(t.pop(1, 10, level::USER_DEFINED_1, "b"));
        assert_eq!(path(&t, 10), "PTA@weight@a@c@d", "closing one moves the later ones up");
    }

    #[test]
    fn threads_are_separate_and_unknown_pops_are_ignored() {
        let mut t = Tags::default();
        t.push(1, 10, level::USER_DEFINED_1, "x");
        assert_eq!(path(&t, 11), "PTA");
        assert!(!t.pop(1, 11, level::USER_DEFINED_1, "x"), "another thread's span");
        assert!(!t.pop(1, 10, level::USER_DEFINED_1, "opened-before-attach"));
        assert_eq!(path(&t, 10), "PTA@x");
        assert!(!t.pop(1, 10, level::FRAMEWORK, "x"), "the framework level is not a span");
        t.forget_process(1);
        assert_eq!(path(&t, 10), "PTA");
    }
}
