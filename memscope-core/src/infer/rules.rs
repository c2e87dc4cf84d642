//! Owner rules: a frame pattern and the owner, lifetime label and phase it gives. The built-in
//! table (`builtin.rules`) and a user's `--owner-rules` file are the same text format, read by
//! the one parser here, so a user can copy a built-in line and change it.
//!
//! Patterns are a path suffix and a function name, not regular expressions: what identifies a
//! frame is where its code lives and what it is called (owners-from-frames.md §1), and a suffix
//! also matches a source checkout (Megatron run from its repository) and any install prefix.

use std::sync::Arc;

use thiserror::Error;

use super::Frame;

/// The built-in rules, as `probes --pid` and docs/owners.md list them.
pub const BUILTIN: &str = include_str!("builtin.rules");

/// `FILE:FUNCTION`: which frames a rule (or `--step-frame`) names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pattern {
    /// The path suffix (`torch/optim/adam.py`) or, ending in `/`, a folder anywhere in the path.
    pub file: Box<str>,
    /// A qualified name (`Module._apply`), a last name (`__init__`: any class), or `*`.
    pub function: Box<str>,
    /// `lines=FIRST-LAST`: only a frame executing one of these lines. A function's branches are
    /// told apart this way (vllm-ascend's KV cache kinds), which ties the rule to one version of
    /// the file, so the built-in table names none and a user's file says which version it is for.
    pub lines: Option<(u32, u32)>,
}

impl Pattern {
    /// Reads `FILE:FUNCTION`; `None` when either side is missing.
    pub fn parse(text: &str) -> Option<Self> {
        let (file, function) = text.rsplit_once(':').filter(|(f, n)| !f.is_empty() && !n.is_empty())?;
        Some(Self { file: file.into(), function: function.into(), lines: None })
    }

    /// Whether this pattern names `frame`.
    pub fn matches(&self, frame: &Frame<'_>) -> bool {
        self.lines.is_none_or(|(first, last)| (first..=last).contains(&frame.line))
            && file_matches(&self.file, frame.file)
            && function_matches(&self.function, frame.function)
    }
}

/// One line of a rules file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    pub pattern: Pattern,
    /// The owner path's parts under the allocator's label (`fsdp2@sharded_weight`).
    pub owner: Arc<[Arc<str>]>,
    /// The owner of a block freed before its phase ended, when the rule tells the two apart.
    pub temporary: Option<Arc<[Arc<str>]>>,
    /// The phase of the job this frame marks (`forward`, `optimizer`, ...), if any.
    pub phase: Option<Arc<str>>,
    /// The rule's line in its file, to name it in messages.
    pub line: usize,
}

/// A rules file that cannot be read, with the line at fault.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum RuleError {
    #[error("line {line}: `{text}` is not `FILE:FUNCTION OWNER [temporary=OWNER] [phase=NAME] [lines=FIRST-LAST]`")]
    Shape { line: usize, text: String },
    #[error("line {line}: `{pattern}` has no `:FUNCTION` (write `{pattern}:*` for any function)")]
    NoFunction { line: usize, pattern: String },
    #[error("line {line}: the owner `{owner}` has an empty part (parts are joined with `@`, as in `fsdp2@gradient`)")]
    EmptyPart { line: usize, owner: String },
    #[error("line {line}: the owner `{owner}` has {parts} parts; an owner path holds at most {max} under the allocator's label")]
    TooDeep { line: usize, owner: String, parts: usize, max: usize },
    #[error("line {line}: `{word}` is not an option (write `temporary=OWNER`, `phase=NAME` or `lines=FIRST-LAST`)")]
    Option { line: usize, word: String },
    #[error("line {line}: `lines={value}` is not a range of lines (write `lines=120-131`, or `lines=120` for one)")]
    Lines { line: usize, value: String },
}

/// Parts under the allocator's label an owner path can hold (the seven levels above FRAMEWORK).
pub const MAX_PARTS: usize = 7;

/// Reads a rules file: blank lines and `#` comments are skipped; the first error stops it.
pub fn parse(text: &str) -> Result<Vec<Rule>, RuleError> {
    let mut rules = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let text = raw.split_once('#').map_or(raw, |(before, _)| before).trim();
        if text.is_empty() {
            continue;
        }
        rules.push(parse_line(line, text)?);
    }
    Ok(rules)
}

fn parse_line(line: usize, text: &str) -> Result<Rule, RuleError> {
    let mut words = text.split_whitespace();
    let (Some(pattern), Some(owner)) = (words.next(), words.next()) else {
        return Err(RuleError::Shape { line, text: text.to_owned() });
    };
    let Some(mut pattern) = Pattern::parse(pattern) else {
        return Err(RuleError::NoFunction { line, pattern: pattern.to_owned() });
    };
    let owner = owner_parts(line, owner)?;
    let (mut temporary, mut phase) = (None, None);
    for word in words {
        match word.split_once('=') {
            Some(("temporary", value)) => temporary = Some(owner_parts(line, value)?),
            Some(("phase", value)) if !value.is_empty() => phase = Some(Arc::from(value)),
            Some(("lines", value)) => pattern.lines = Some(line_range(line, value)?),
            _ => return Err(RuleError::Option { line, word: word.to_owned() }),
        }
    }
    Ok(Rule { pattern, owner, temporary, phase, line })
}

fn owner_parts(line: usize, owner: &str) -> Result<Arc<[Arc<str>]>, RuleError> {
    let parts: Vec<Arc<str>> = owner.split('@').map(Arc::from).collect();
    if parts.iter().any(|p| p.is_empty()) {
        return Err(RuleError::EmptyPart { line, owner: owner.to_owned() });
    }
    if parts.len() > MAX_PARTS {
        return Err(RuleError::TooDeep { line, owner: owner.to_owned(), parts: parts.len(), max: MAX_PARTS });
    }
    Ok(parts.into())
}

fn line_range(line: usize, value: &str) -> Result<(u32, u32), RuleError> {
    let (first, last) = value.split_once('-').unwrap_or((value, value));
    match (first.parse::<u32>(), last.parse::<u32>()) {
        (Ok(first), Ok(last)) if first <= last => Ok((first, last)),
        _ => Err(RuleError::Lines { line, value: value.to_owned() }),
    }
}

fn file_matches(pattern: &str, file: &str) -> bool {
    if pattern.ends_with('/') {
        return file.starts_with(pattern) || file.match_indices(pattern).any(|(at, _)| file[..at].ends_with('/'));
    }
    file == pattern || file.strip_suffix(pattern).is_some_and(|head| head.ends_with('/'))
}

/// CPython 3.9 and 3.10 give only the last name, so a qualified pattern also matches its last
/// part when the frame's name has no dot.
fn function_matches(pattern: &str, function: &str) -> bool {
    if pattern == "*" || pattern == function {
        return true;
    }
    let last = |name: &str| name.rsplit('.').next().unwrap_or(name).to_owned();
    if !pattern.contains('.') {
        return last(function) == pattern;
    }
    // `<locals>` nesting: `Optimizer.profile_hook_step.<locals>.wrapper` inside another class.
    function.ends_with(pattern) && function[..function.len() - pattern.len()].ends_with('.')
        || !function.contains('.') && last(pattern) == function
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame<'a>(file: &'a str, function: &'a str) -> Frame<'a> {
        Frame { file, line: 1, function }
    }

    #[test]
    fn the_builtin_table_parses_and_every_rule_names_a_phase() {
        let rules = parse(BUILTIN).expect("the built-in rules parse");
        assert!(rules.len() > 40, "{} rules", rules.len());
        for r in &rules {
            assert!(r.phase.is_some(), "line {}: no phase", r.line);
        }
    }

    #[test]
    fn files_match_by_suffix_and_folders_anywhere() {
        let r = parse("torch/optim/adam.py:Adam._init_group state").unwrap().remove(0);
        let lib = "/usr/lib/python3/dist-packages/torch/optim/adam.py";
        assert!(r.pattern.matches(&frame(lib, "Adam._init_group")));
        assert!(!r.pattern.matches(&frame("/x/mytorch/optim/adam.py", "Adam._init_group")), "a suffix starts at a `/`");
        let folder = parse("torch/nn/modules/:__init__ weight").unwrap().remove(0);
        assert!(folder.pattern.matches(&frame("/v/site-packages/torch/nn/modules/linear.py", "Linear.__init__")));
        assert!(folder.pattern.matches(&frame("torch/nn/modules/conv.py", "__init__")));
        assert!(!folder.pattern.matches(&frame("/v/site-packages/xtorch/nn/modules/linear.py", "Linear.__init__")));
        assert!(!folder.pattern.matches(&frame("/v/site-packages/torch/nn/functional.py", "__init__")));
    }

    #[test]
    fn functions_match_qualified_names_and_the_last_name_older_pythons_give() {
        let r = parse("optimizer.py:Optimizer.profile_hook_step.<locals>.wrapper o").unwrap().remove(0);
        assert!(r.pattern.matches(&frame("a/optimizer.py", "Optimizer.profile_hook_step.<locals>.wrapper")));
        assert!(r.pattern.matches(&frame("a/optimizer.py", "wrapper")), "3.9/3.10: co_name only");
        assert!(!r.pattern.matches(&frame("a/optimizer.py", "Other.wrapper")));
        let last = parse("m.py:__init__ o").unwrap().remove(0);
        assert!(last.pattern.matches(&frame("m.py", "A.__init__")) && last.pattern.matches(&frame("m.py", "__init__")));
        assert!(!last.pattern.matches(&frame("m.py", "A.__init__.<locals>.f")));
        let any = parse("m.py:* o").unwrap().remove(0);
        assert!(any.pattern.matches(&frame("/p/m.py", "whatever")));
    }

    #[test]
    fn options_and_owner_paths() {
        let r =
            parse("  f.py:g   fsdp2@gradient  temporary=fsdp2@reduce_scatter phase=reduce  # note").unwrap().remove(0);
        assert_eq!(&*r.owner, [Arc::from("fsdp2"), Arc::from("gradient")]);
        assert_eq!(r.temporary.as_deref().map(<[_]>::len), Some(2));
        assert_eq!(r.phase.as_deref(), Some("reduce"));
    }

    /// vllm-ascend's KV cache kinds are branches of one function: a `lines=` rule names one.
    #[test]
    fn a_line_range_names_one_branch_of_a_function() {
        let r = parse("runner.py:R.alloc kv_cache@mamba lines=120-131").unwrap().remove(0);
        assert_eq!(r.pattern.lines, Some((120, 131)));
        let at = |line| Frame { file: "/v/runner.py", line, function: "R.alloc" };
        assert!(r.pattern.matches(&at(120)) && r.pattern.matches(&at(131)));
        assert!(!r.pattern.matches(&at(119)) && !r.pattern.matches(&at(132)));
        let one = parse("runner.py:R.alloc o lines=7").unwrap().remove(0);
        assert_eq!(one.pattern.lines, Some((7, 7)));
    }

    #[test]
    fn bad_lines_are_named() {
        let cases = [
            ("\n\nonly", "line 3: `only` is not"),
            ("f.py o", "line 1: `f.py` has no `:FUNCTION`"),
            ("f.py:g a@@b", "line 1: the owner `a@@b` has an empty part"),
            ("f.py:g a@b@c@d@e@f@g@h", "has 8 parts"),
            ("f.py:g o lifetime=x", "line 1: `lifetime=x` is not an option"),
            ("f.py:g o lines=9-3", "line 1: `lines=9-3` is not a range of lines"),
            ("f.py:g o lines=", "line 1: `lines=` is not a range"),
        ];
        for (text, want) in cases {
            let e = parse(text).unwrap_err().to_string();
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }
}
