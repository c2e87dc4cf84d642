//! The trace's stacks on the store's thread: each new stack symbolized once when it arrives
//! (before any row that refers to it), its `Call Stack(C)` text kept for the rows, and its
//! frames kept for `ms_stacks` and `ms_frames` (docs/db-schema.md), written at the end.
//!
//! The symbolizer is made on first use, on this thread: blazesym's is neither `Send` nor `Sync`.

use std::path::PathBuf;

use crate::stacks::symbolize::{Resolved, Symbolizer};
use crate::stacks::{text, Cut, Stack, StackId, NO_STACK};

/// One row of `ms_stacks`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StackRow {
    pub id: StackId,
    pub pid: u32,
    pub cut: Cut,
    pub frames: u32,
    pub text: Box<str>,
}

/// One row of `ms_frames`: a function of a frame (a frame with inlined calls has several).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrameRow {
    pub stack: StackId,
    /// The frame's place in its stack, 0 innermost.
    pub frame: u32,
    /// The function's place in its frame, 0 innermost (the inlined calls come first).
    pub depth: u32,
    pub addr: u64,
    pub path: Option<String>,
    pub build_id: Option<String>,
    pub file_offset: Option<u64>,
    pub symbol: Option<String>,
    pub symbol_offset: Option<u64>,
    pub file: Option<String>,
    pub line: Option<u32>,
    pub inlined: bool,
    /// `symbolized`, `no_symbol`, `no_file` or `changed` (the file is not the one traced).
    pub status: &'static str,
}

#[derive(Default)]
pub struct StackTable {
    debug_dirs: Vec<PathBuf>,
    symbolizer: Option<Symbolizer>,
    /// By id: ids are given in order from 1, and each arrives once.
    rows: Vec<StackRow>,
    frames: Vec<FrameRow>,
    /// Python stack texts by id (from 1).
    py: Vec<Box<str>>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl StackTable {
    /// Separate debug files are also looked for in `debug_dirs` (`--debug-dir`).
    pub fn new(debug_dirs: Vec<PathBuf>) -> Self {
        Self { debug_dirs, ..Self::default() }
    }

    /// Symbolizes a new stack and keeps what the rows and tables need of it.
    pub fn add(&mut self, stack: &Stack) {
        let dirs = &self.debug_dirs;
        let symbolizer = self.symbolizer.get_or_insert_with(|| Symbolizer::new(dirs));
        let resolved = symbolizer.frames(&stack.frames);
        let cut = text::cut(stack, &resolved);
        let text = text::c_stack(stack, &resolved, cut);
        for (i, (frame, r)) in stack.frames.iter().zip(&resolved).enumerate() {
            self.frame_rows(stack.id, i as u32, frame, r);
        }
        debug_assert_eq!(stack.id as usize, self.rows.len() + 1, "stacks arrive in id order");
        self.rows.push(StackRow {
            id: stack.id,
            pid: stack.pid,
            cut,
            frames: stack.frames.len() as u32,
            text: text.into(),
        });
    }

    fn frame_rows(&mut self, stack: StackId, frame: u32, f: &crate::stacks::Frame, resolved: &Resolved) {
        let base = FrameRow {
            stack,
            frame,
            depth: 0,
            addr: f.addr,
            path: f.module.as_ref().map(|(m, _)| m.path.display().to_string()),
            build_id: f.module.as_ref().and_then(|(m, _)| m.build_id.as_deref().map(hex)),
            file_offset: f.module.as_ref().map(|(_, off)| *off),
            symbol: None,
            symbol_offset: None,
            file: None,
            line: None,
            inlined: false,
            status: "symbolized",
        };
        match resolved {
            Resolved::Symbols(symbols) => {
                for (depth, s) in symbols.iter().enumerate() {
                    self.frames.push(FrameRow {
                        depth: depth as u32,
                        symbol: Some(s.name.clone()),
                        symbol_offset: (!s.inlined).then_some(s.offset),
                        file: s.file.clone(),
                        line: s.line,
                        inlined: s.inlined,
                        ..base.clone()
                    });
                }
            }
            Resolved::NoSymbol => self.frames.push(FrameRow { status: "no_symbol", ..base }),
            Resolved::NoFile => self.frames.push(FrameRow { status: "no_file", ..base }),
            Resolved::Changed => self.frames.push(FrameRow { status: "changed", ..base }),
        }
    }

    /// The `Call Stack(C)` text of a row's stack ("" for none, or one this table never got).
    pub fn text(&self, id: StackId) -> &str {
        if id == NO_STACK {
            return "";
        }
        self.rows.get(id as usize - 1).map_or("", |r| &r.text)
    }

    /// A Python stack text, by its id (they arrive in id order).
    pub fn add_py(&mut self, id: StackId, text: Box<str>) {
        debug_assert_eq!(id as usize, self.py.len() + 1, "Python stacks arrive in id order");
        self.py.push(text);
    }

    /// The Python stacks' texts, the first being id 1.
    pub fn py_texts(&self) -> &[Box<str>] {
        &self.py
    }

    /// The `Call Stack(Python)` text of a row's Python stack ("" for none).
    pub fn py_text(&self, id: StackId) -> &str {
        if id == NO_STACK {
            return "";
        }
        self.py.get(id as usize - 1).map_or("", |t| t)
    }

    pub fn rows(&self) -> &[StackRow] {
        &self.rows
    }

    pub fn frames(&self) -> &[FrameRow] {
        &self.frames
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
}
