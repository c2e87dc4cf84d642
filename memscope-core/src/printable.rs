//! Text the traced process controls (owner labels, marks, allocator settings, library paths,
//! USDT notes, process names), made safe to print on a terminal or into a log.
//!
//! Printed raw, such text reached root's terminal with its control sequences: a label could
//! clear the screen, retitle the window or colour the output, and a newline in it forged a log
//! line of its own. Every control character (C0, DEL, C1) and every bidirectional override is
//! written as a Rust-style escape instead (`\n`, `\u{1b}`), so the text stays readable and
//! unambiguous. Machine output (`--json`, the DBs, exports) keeps the exact text.

use std::borrow::Cow;

/// Whether `c` could change how a terminal shows what follows it.
fn unsafe_char(c: char) -> bool {
    c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{200e}' | '\u{200f}')
}

/// `text` with every control character escaped; borrowed when there is none (the usual case).
pub fn printable(text: &str) -> Cow<'_, str> {
    if !text.chars().any(unsafe_char) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if unsafe_char(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_reach_no_terminal_and_plain_text_is_untouched() {
        assert!(matches!(printable("PTA@kv_cache/层"), Cow::Borrowed("PTA@kv_cache/层")));
        assert_eq!(printable("a\x1b[2Jb"), "a\\u{1b}[2Jb");
        assert_eq!(printable("x\nmemscope-bpf: forged"), "x\\nmemscope-bpf: forged");
        assert_eq!(printable("\u{9b}31m\u{7f}\r\t"), "\\u{9b}31m\\u{7f}\\r\\t");
        assert_eq!(printable("ab\u{202e}cd"), "ab\\u{202e}cd");
    }
}
