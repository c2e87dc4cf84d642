//! The `Call Stack(C)` column: msMemScope's text (`backtrace_symbols` lines, innermost first,
//! one per line), with what symbolization adds: the source line after the address, and a line
//! per inlined call. Also where a stack ends ([`cut`]).
//!
//! A line reads `PATH(FUNCTION+0xOFF) [0xADDR] FILE:LINE`, as `backtrace_symbols` writes it plus
//! the place; `PATH(+0xFILEOFF) [0xADDR]` when the file has no symbol there, `[0xADDR]` when the
//! address is in no file. An inlined call reads `PATH(FUNCTION) [0xADDR] FILE:LINE (inlined)`.

use std::fmt::Write as _;

use super::symbolize::{Resolved, Symbol};
use super::{Cut, Frame, Stack};

/// Functions a thread's or a process's stack begins in: a walk that reaches one is whole.
const ENTRIES: &[&str] =
    &["_start", "__libc_start_main", "__libc_start_call_main", "start_thread", "clone", "clone3", "__clone"];

/// Where the stack ends, from its outermost frame's function.
pub fn cut(stack: &Stack, resolved: &[Resolved]) -> Cut {
    if stack.failed {
        return Cut::Failed;
    }
    let outermost = resolved.last().and_then(|r| match r {
        Resolved::Symbols(symbols) => symbols.last().map(|s| s.name.as_str()),
        _ => None,
    });
    if outermost.is_some_and(|name| ENTRIES.contains(&name)) {
        Cut::Whole
    } else if stack.at_depth {
        Cut::AtDepth
    } else {
        Cut::Truncated
    }
}

/// The column's text.
pub fn c_stack(stack: &Stack, resolved: &[Resolved], cut: Cut) -> String {
    let mut out = String::new();
    for (frame, resolved) in stack.frames.iter().zip(resolved) {
        line(&mut out, frame, resolved);
    }
    match cut {
        Cut::Whole => {}
        Cut::AtDepth => out.push_str("... (cut at the depth asked for: --call-stack c:N)\n"),
        Cut::Truncated => {
            out.push_str("... (the frame-pointer chain ends here: a caller was built without frame pointers)\n")
        }
        Cut::Failed => out.push_str("(the kernel could not walk this stack)\n"),
    }
    out.pop();
    out
}

fn line(out: &mut String, frame: &Frame, resolved: &Resolved) {
    let path = frame.module.as_ref().map(|(m, _)| m.path.display().to_string());
    let path = path.as_deref().unwrap_or("");
    match resolved {
        Resolved::Symbols(symbols) => {
            for s in symbols.iter() {
                symbol_line(out, path, frame, s);
            }
        }
        Resolved::NoSymbol | Resolved::Changed => {
            let offset = frame.module.as_ref().map_or(0, |(_, off)| *off + u64::from(frame.returns));
            let _ = write!(out, "{path}(+{offset:#x}) [{:#x}]", frame.addr);
            if *resolved == Resolved::Changed {
                out.push_str(" (file changed since the trace: not symbolized)");
            }
            out.push('\n');
        }
        Resolved::NoFile => {
            let _ = writeln!(out, "[{:#x}]", frame.addr);
        }
    }
}

fn symbol_line(out: &mut String, path: &str, frame: &Frame, s: &Symbol) {
    if s.inlined {
        let _ = write!(out, "{path}({}) [{:#x}]", s.name, frame.addr);
    } else {
        // The symbolized address is one byte before a return address (the call): give the
        // return address's own offset, as backtrace_symbols does.
        let _ = write!(out, "{path}({}+{:#x}) [{:#x}]", s.name, s.offset + u64::from(frame.returns), frame.addr);
    }
    if let (Some(file), Some(line)) = (&s.file, s.line) {
        let _ = write!(out, " {file}:{line}");
    }
    if s.inlined {
        out.push_str(" (inlined)");
    }
    out.push('\n');
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::stacks::Module;

    fn frame(addr: u64, off: u64, returns: bool) -> Frame {
        let module = Arc::new(Module { path: "/lib/libx.so".into(), build_id: None, debug_file: None });
        Frame { addr, module: Some((module, off)), returns }
    }

    fn sym(name: &str, offset: u64, line: u32, inlined: bool) -> Symbol {
        Symbol { name: name.into(), offset, file: Some("x.c".into()), line: Some(line), inlined }
    }

    #[test]
    fn lines_read_as_backtrace_symbols_with_places_and_inlined_calls() {
        let stack = Stack {
            id: 1,
            pid: 1,
            frames: vec![frame(0x7000, 0x100, false), frame(0x7234, 0x233, true), frame(0x9000, 0x10, true)],
            at_depth: false,
            failed: false,
        };
        let resolved = [
            Resolved::Symbols(vec![sym("aclrtMalloc", 0, 10, false)].into()),
            Resolved::Symbols(vec![sym("step", 0, 20, true), sym("outer", 0x33, 30, false)].into()),
            Resolved::NoSymbol,
        ];
        assert_eq!(cut(&stack, &resolved), Cut::Truncated, "no thread entry at the end");
        assert_eq!(
            c_stack(&stack, &resolved, Cut::Truncated),
            "/lib/libx.so(aclrtMalloc+0x0) [0x7000] x.c:10\n\
             /lib/libx.so(step) [0x7234] x.c:20 (inlined)\n\
             /lib/libx.so(outer+0x34) [0x7234] x.c:30\n\
             /lib/libx.so(+0x11) [0x9000]\n\
             ... (the frame-pointer chain ends here: a caller was built without frame pointers)"
        );
    }

    #[test]
    fn a_stack_ending_in_a_thread_entry_is_whole_and_a_full_one_is_cut_at_depth() {
        let mut stack = Stack { id: 1, pid: 1, frames: vec![frame(1, 1, false)], at_depth: true, failed: false };
        let entry = [Resolved::Symbols(vec![sym("start_thread", 5, 1, false)].into())];
        assert_eq!(cut(&stack, &entry), Cut::Whole);
        let other = [Resolved::Symbols(vec![sym("work", 5, 1, false)].into())];
        assert_eq!(cut(&stack, &other), Cut::AtDepth);
        stack.failed = true;
        assert_eq!(cut(&stack, &other), Cut::Failed);
        assert_eq!(
            c_stack(&Stack { frames: vec![], ..stack }, &[], Cut::Failed),
            "(the kernel could not walk this stack)"
        );
    }
}
