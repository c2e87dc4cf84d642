//! What an unmodified job's Python stack says about the memory allocated under it: the owner
//! (rules from frames to owner paths, [`rules`]), the phase of the job (forward, backward,
//! optimizer, ...: for telling a block that lives on from a temporary, and for steps), and the
//! site (the innermost frame of the job's own code, [`site`]).
//!
//! A stack's text is read once, when its id is new ([`Reader::learn`]); the tracker then looks
//! the reading up by id for every block allocated under it, so the cost per allocation is one
//! hash lookup. Markers are the tracker's business: they win over anything read here.

pub mod rules;
pub mod site;

use std::collections::HashMap;
use std::sync::Arc;

use rules::{Pattern, Rule, RuleError};

use crate::stacks::StackId;

/// The first line of a Python stack's text that is the main thread's, lent to a thread that ran
/// no Python at the call (the probe's [`memscope_common::python::PY_MAIN_THREAD`]).
pub const MAIN_THREAD_LINE: &str = "<the main thread's stack: the calling thread ran no Python>";

/// One line of a Python stack's text (`file(line): function`, innermost first).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Frame<'a> {
    pub file: &'a str,
    pub line: u32,
    pub function: &'a str,
}

impl<'a> Frame<'a> {
    /// Reads one line of [`crate::stacks::python::Resolver::text`]; `None` for a frame whose
    /// code could not be read (`?`).
    pub fn parse(text: &'a str) -> Option<Self> {
        let (head, function) = text.split_once("): ")?;
        let (file, line) = head.rsplit_once('(')?;
        Some(Self { file, line: line.parse().ok()?, function })
    }
}

/// The frames of a stack's text, innermost first.
pub fn frames(text: &str) -> impl Iterator<Item = Frame<'_>> {
    text.lines().filter_map(Frame::parse)
}

/// What one Python stack says.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reading {
    /// The owner path's parts under the allocator's label, when a rule named a frame.
    pub owner: Option<Arc<[Arc<str>]>>,
    /// The owner of a block freed before its phase ended.
    pub temporary: Option<Arc<[Arc<str>]>>,
    /// The job's phase under this stack; `None` when no rule names one.
    pub phase: Option<Arc<str>>,
    /// The innermost frame of the job's own code, as `file:line function`.
    pub site: Option<Arc<str>>,
    /// Whether the `--step-frame` frame is on this stack.
    pub in_step_frame: bool,
    /// The stack is the main thread's, lent to a thread that ran no Python.
    pub main_thread: bool,
}

/// How steps are found without markers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StepRule {
    /// A step starts at the first allocation in a `forward` phase after an `optimizer` one (and
    /// at the first `forward` of all).
    ForwardAfterOptimizer,
    /// A step starts at each allocation under this frame that follows one not under it.
    Frame(Pattern),
}

/// The rules in force, and the readings of the stacks seen so far.
#[derive(Debug)]
pub struct Reader {
    rules: Vec<Rule>,
    pub step_rule: StepRule,
    readings: HashMap<StackId, Arc<Reading>, foldhash::fast::RandomState>,
}

impl Default for Reader {
    fn default() -> Self {
        Self::new(Vec::new(), StepRule::ForwardAfterOptimizer)
    }
}

impl Reader {
    /// The user's rules (tried first) and the built-in ones.
    pub fn new(mut user: Vec<Rule>, step_rule: StepRule) -> Self {
        user.extend(rules::parse(rules::BUILTIN).expect("the built-in rules parse (a unit test checks it)"));
        Self { rules: user, step_rule, readings: HashMap::default() }
    }

    /// As [`Self::new`], with the user's rules from a rules file's text.
    pub fn with_user_rules(text: &str, step_rule: StepRule) -> Result<Self, RuleError> {
        Ok(Self::new(rules::parse(text)?, step_rule))
    }

    /// Reads a new stack's text.
    pub fn learn(&mut self, id: StackId, text: &str) {
        self.readings.insert(id, Arc::new(self.read(text)));
    }

    /// The reading of stack `id`, if it was learnt.
    #[inline]
    pub fn get(&self, id: StackId) -> Option<&Arc<Reading>> {
        self.readings.get(&id)
    }

    /// The innermost frame any rule names decides the owner; the first such rule wins.
    pub fn read(&self, text: &str) -> Reading {
        let mut reading = Reading::default();
        let rule = frames(text).find_map(|f| self.rules.iter().find(|r| r.pattern.matches(&f)));
        if let Some(rule) = rule {
            reading.owner = Some(rule.owner.clone());
            reading.temporary = rule.temporary.clone();
            reading.phase = rule.phase.clone();
        }
        reading.site = site::of(text).map(Arc::from);
        reading.main_thread = text.starts_with(MAIN_THREAD_LINE);
        if let StepRule::Frame(pattern) = &self.step_rule {
            reading.in_step_frame = frames(text).any(|f| pattern.matches(&f));
        }
        reading
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SITE: &str = "/usr/lib/python3.12/site-packages";

    fn stack(frames: &[(&str, u32, &str)]) -> String {
        frames.iter().map(|(f, l, n)| format!("{f}({l}): {n}")).collect::<Vec<_>>().join("\n")
    }

    fn owner(r: &Reading) -> String {
        r.owner.as_ref().map(|p| p.join("@")).unwrap_or_default()
    }

    #[test]
    fn frames_parse_from_the_resolvers_text() {
        let f = Frame::parse("/a/b(c)/train.py(12): Net.forward").unwrap();
        assert_eq!(f, Frame { file: "/a/b(c)/train.py", line: 12, function: "Net.forward" });
        assert_eq!(Frame::parse("?"), None);
        assert_eq!(frames("?\nx.py(1): f").count(), 1);
    }

    #[test]
    fn the_innermost_named_frame_decides() {
        let reader = Reader::default();
        // Lightning's closure: the forward runs inside the optimizer's step.
        let text = stack(&[
            ("/job/model.py", 20, "Net.forward"),
            (&format!("{SITE}/torch/nn/modules/module.py"), 1784, "Module._call_impl"),
            ("/job/train.py", 40, "closure"),
            (&format!("{SITE}/torch/optim/adam.py"), 227, "Adam.step"),
            (&format!("{SITE}/torch/optim/optimizer.py"), 526, "Optimizer.profile_hook_step.<locals>.wrapper"),
            ("/job/train.py", 50, "main"),
        ]);
        let r = reader.read(&text);
        assert_eq!((owner(&r).as_str(), r.phase.as_deref()), ("activation", Some("forward")));
        assert_eq!(r.temporary.map(|t| t.join("@")).as_deref(), Some("forward_temporary"));
        assert_eq!(r.site.as_deref(), Some("/job/model.py:20 Net.forward"));
        let state = stack(&[
            (&format!("{SITE}/torch/optim/adam.py"), 168, "Adam._init_group"),
            (&format!("{SITE}/torch/optim/adam.py"), 240, "Adam.step"),
            ("/job/train.py", 50, "main"),
        ]);
        assert_eq!(owner(&reader.read(&state)), "optimizer_state");
        let none = reader.read(&stack(&[("/job/train.py", 7, "main")]));
        assert_eq!((none.owner, none.phase), (None, None));
    }

    #[test]
    fn user_rules_come_first_and_the_step_frame_is_found() {
        let step = StepRule::Frame(Pattern::parse("train.py:train_step").unwrap());
        let reader = Reader::with_user_rules("torch/nn/modules/:__init__ frozen phase=init", step).unwrap();
        let text = stack(&[
            (&format!("{SITE}/torch/nn/modules/linear.py"), 106, "Linear.__init__"),
            ("/job/train.py", 9, "train_step"),
        ]);
        let r = reader.read(&text);
        assert_eq!(owner(&r), "frozen");
        assert!(r.in_step_frame);
        assert!(!reader.read(&stack(&[("/job/train.py", 9, "main")])).in_step_frame);
    }
}
