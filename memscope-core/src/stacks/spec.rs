//! `--call-stack c[:N],python[:N]`: which stacks to capture and how deep, in msMemScope's
//! spelling (its `--call-stack`, and the `call_stack` key of its config).

use thiserror::Error;

/// msMemScope's default depth, when a kind is named without one.
pub const DEFAULT_DEPTH: u32 = 50;
// The default must fit both kinds' records.
const _: () = assert!(DEFAULT_DEPTH as usize <= memscope_common::python::MAX_PY_FRAMES);
/// msMemScope's largest depth.
pub const MAX_DEPTH: u32 = 1000;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum SpecError {
    #[error("`{0}` is not a stack kind: write `c`, `python`, or both as `c,python` (each may take a depth, `c:16`)")]
    Kind(String),
    #[error("`{0}`: the depth must be a whole number from 0 to {MAX_DEPTH}, as in `c:16`")]
    Depth(String),
    #[error("`{kind}` is named twice: give each kind once")]
    Twice { kind: &'static str },
    #[error(
        "`c:{0}`: the kernel walks native stacks to at most {max} frames (`kernel.perf_event_max_stack`); \
         use `c:{max}` or less",
        max = memscope_common::record::MAX_STACK_DEPTH
    )]
    NativeTooDeep(u32),
    #[error("`python:{0}`: the probe reads at most {max} Python frames; use `python:{max}` or less", max = memscope_common::python::MAX_PY_FRAMES)]
    PythonTooDeep(u32),
}

/// How native stacks are walked (`--unwind`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Unwind {
    /// Frame pointers, in the kernel: cheap, but a library built without them truncates the
    /// stack or skips frames.
    #[default]
    Fp,
    /// A window of the stack copied at each call and unwound in userspace from `.eh_frame`, as
    /// `perf --call-graph dwarf`: whole stacks through libraries without frame pointers, at the
    /// cost of copying the window (`--stack-window`).
    Dwarf,
}

/// `--stack-window`'s default, as `perf --call-graph dwarf`'s.
pub const DEFAULT_WINDOW: u32 = 8192;

/// The stacks asked for: a depth per kind, `None` when not captured (depth 0 is none too).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallStacks {
    pub c: Option<u32>,
    pub python: Option<u32>,
}

impl CallStacks {
    /// Parses `c[:N],python[:N]`.
    pub fn parse(text: &str) -> Result<Self, SpecError> {
        let mut out = Self::default();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (kind, depth) = match part.split_once(':') {
                Some((k, d)) => (
                    k.trim(),
                    d.trim()
                        .parse::<u32>()
                        .ok()
                        .filter(|&d| d <= MAX_DEPTH)
                        .ok_or_else(|| SpecError::Depth(part.into()))?,
                ),
                None => (part, DEFAULT_DEPTH),
            };
            let (slot, name) = match kind.to_ascii_lowercase().as_str() {
                "c" => (&mut out.c, "c"),
                "python" | "py" => (&mut out.python, "python"),
                _ => return Err(SpecError::Kind(kind.into())),
            };
            if slot.is_some() {
                return Err(SpecError::Twice { kind: name });
            }
            *slot = Some(depth);
        }
        if let Some(c) = out.c.filter(|&c| c as usize > memscope_common::record::MAX_STACK_DEPTH) {
            return Err(SpecError::NativeTooDeep(c));
        }
        if let Some(p) = out.python.filter(|&p| p as usize > memscope_common::python::MAX_PY_FRAMES) {
            return Err(SpecError::PythonTooDeep(p));
        }
        out.c = out.c.filter(|&d| d > 0);
        out.python = out.python.filter(|&d| d > 0);
        Ok(out)
    }

    /// Native frames per call for the BPF side (0: none).
    pub fn native_depth(&self) -> u32 {
        self.c.unwrap_or(0)
    }
}

/// Everything `trace` was told about stacks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StackOptions {
    pub call: CallStacks,
    pub unwind: Unwind,
    /// `--stack-window` bytes (`--unwind dwarf`).
    pub window: u32,
    /// Walk Python stacks for the owner rules, steps and sites even when `--call-stack` does
    /// not store them (`trace`'s default; `--no-infer` turns it off).
    pub infer: bool,
    /// `--python-trace[=HZ]`: each traced thread's Python stack sampled this many times a
    /// second, into msMemScope's `python_trace_<pid>` tables.
    pub python_trace: Option<u32>,
}

impl StackOptions {
    /// Frames the kernel walks per call (frame-pointer mode; 0 otherwise).
    pub fn kernel_depth(&self) -> u32 {
        if self.unwind == Unwind::Fp {
            self.call.native_depth()
        } else {
            0
        }
    }

    /// Python frames the kernel reads per call (0: none), at most the record's capacity: the
    /// depth asked for, else the default when the rules need the stacks.
    pub fn python_depth(&self) -> u32 {
        let inferring = if self.infer { DEFAULT_DEPTH } else { 0 };
        self.call.python.unwrap_or(inferring).min(memscope_common::python::MAX_PY_FRAMES as u32)
    }

    /// Python frames the sampler reads (0: `--python-trace` is off).
    pub fn python_sample_depth(&self) -> u32 {
        if self.python_trace.is_some() {
            memscope_common::python::MAX_PY_FRAMES as u32
        } else {
            0
        }
    }

    /// Stack bytes the kernel copies per call (`--unwind dwarf` with native stacks; 0 otherwise).
    pub fn window_bytes(&self) -> u32 {
        if self.unwind == Unwind::Dwarf && self.call.c.is_some() {
            self.window
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_take_msmemscopes_default_depth_and_their_own() {
        assert_eq!(CallStacks::parse("c,python").unwrap(), CallStacks { c: Some(50), python: Some(50) });
        assert_eq!(CallStacks::parse("c:16,python:8").unwrap(), CallStacks { c: Some(16), python: Some(8) });
        assert_eq!(CallStacks::parse("python:3").unwrap(), CallStacks { c: None, python: Some(3) });
        assert_eq!(CallStacks::parse("c:0").unwrap(), CallStacks::default(), "depth 0 captures nothing");
    }

    #[test]
    fn bad_specs_say_what_to_write() {
        assert_eq!(CallStacks::parse("java"), Err(SpecError::Kind("java".into())));
        assert_eq!(CallStacks::parse("c:x"), Err(SpecError::Depth("c:x".into())));
        assert_eq!(CallStacks::parse("c:1001"), Err(SpecError::Depth("c:1001".into())));
        assert_eq!(CallStacks::parse("c,c:3"), Err(SpecError::Twice { kind: "c" }));
        let deep = CallStacks::parse("c:500").unwrap_err();
        assert_eq!(deep, SpecError::NativeTooDeep(500));
        assert!(deep.to_string().contains("c:127"), "{deep}");
        assert_eq!(CallStacks::parse("python:100"), Err(SpecError::PythonTooDeep(100)));
    }
}
