//! msMemScope's `Attr` as its CSV writes it, turned into the compact JSON object of strings its
//! DB holds (and Insight and our analyses read).
//!
//! Two forms occur. The one every msMemScope version writes is bare: `{allocation_id:3,addr:0x..,
//! size:512,owner:PTA@weight}`, keys unquoted, values raw text, so a value may itself hold commas
//! (`shape:torch.Size([2, 3])`, an ATB `path:"a,b"`), colons (`name:aten::add`) or nothing
//! (`owner:`). msMemScope's own `FixJson` splits at every comma and so breaks such values; this
//! parser splits only at commas outside brackets and quotes. The other form is JSON already
//! (`{"addr":"0x..","size":512}`: files other tools wrote, or converted by hand), read with
//! serde_json and every value turned into its text. No library reads the bare form (it is
//! neither JSON, YAML flow syntax nor JSON5: values are unquoted text with spaces and colons), so
//! it is parsed here, by a small scanner fuzzed in the tests.

use std::borrow::Cow;
use std::fmt::Write as _;

/// What is wrong with an Attr, and where (a 1-based character column in the Attr text).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttrError {
    pub column: usize,
    pub why: String,
}

impl AttrError {
    /// At `byte` of `text` (clamped into it, back to the start of its character).
    fn at(text: &str, byte: usize, why: impl Into<String>) -> Self {
        let mut end = byte.min(text.len());
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        Self { column: text[..end].chars().count() + 1, why: why.into() }
    }
}

/// An Attr's keys and values, in order, borrowed from its text where they can be.
type Pairs<'t> = Vec<(Cow<'t, str>, Cow<'t, str>)>;

/// Which form an Attr was in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Form {
    Empty,
    Bare,
    Json,
}

/// `text` (either form, possibly still wrapped in the quotes msMemScope puts around it) as
/// compact JSON whose values are all strings; a key given twice keeps its first value (a JSON
/// reader would refuse the object, and with it the whole row).
pub fn to_json(text: &str) -> Result<(String, Form), AttrError> {
    let trimmed = text.trim();
    let inner = strip_wrapping_quotes(trimmed);
    if inner.trim().is_empty() {
        return Ok((String::new(), Form::Empty));
    }
    // Columns count characters of the whole text: those before `inner` (a slice of it).
    let offset = text[..inner.as_ptr() as usize - text.as_ptr() as usize].chars().count();
    let pairs = if looks_like_json(inner) {
        json_pairs(inner).map_err(|e| AttrError { column: e.column + offset, ..e })?
    } else {
        bare_pairs(inner).map_err(|e| AttrError { column: e.column + offset, ..e })?
    };
    let form = if looks_like_json(inner) { Form::Json } else { Form::Bare };
    Ok((write_object(&pairs), form))
}

/// One layer of `"..."` around the whole Attr, as msMemScope writes it (its CSV writer puts the
/// quotes in the text itself; a CSV reader has usually taken them off already).
fn strip_wrapping_quotes(text: &str) -> &str {
    match text.strip_prefix('"').and_then(|t| t.strip_suffix('"')) {
        Some(inner) if inner.trim_start().starts_with('{') => inner.trim(),
        _ => text,
    }
}

fn looks_like_json(text: &str) -> bool {
    text.strip_prefix('{').is_some_and(|rest| {
        let rest = rest.trim_start();
        rest.starts_with('"') || rest.starts_with('}')
    })
}

/// The pairs of a JSON object, values as text (strings as they are, others as their JSON).
fn json_pairs(text: &str) -> Result<Pairs<'_>, AttrError> {
    let map: serde_json::Map<String, serde_json::Value> = serde_json::from_str(text).map_err(|e| {
        let byte = line_col_to_byte(text, e.line(), e.column());
        AttrError::at(text, byte, format!("not valid JSON ({e})"))
    })?;
    Ok(map
        .into_iter()
        .map(|(k, v)| {
            let v = match v {
                serde_json::Value::String(s) => s,
                serde_json::Value::Null => String::new(),
                other => other.to_string(),
            };
            (Cow::Owned(k), Cow::Owned(v))
        })
        .collect())
}

fn line_col_to_byte(text: &str, line: usize, column: usize) -> usize {
    let start: usize = text.split_inclusive('\n').take(line.saturating_sub(1)).map(str::len).sum();
    (start + column.saturating_sub(1)).min(text.len())
}

/// The closer each opener expects.
fn closer(open: u8) -> u8 {
    match open {
        b'[' => b']',
        b'(' => b')',
        _ => b'}',
    }
}

/// The pairs of the bare form: `{k:v,...}`, split at commas outside brackets and quotes.
fn bare_pairs(text: &str) -> Result<Pairs<'_>, AttrError> {
    let bytes = text.as_bytes();
    if bytes.first() != Some(&b'{') {
        return Err(AttrError::at(text, 0, "an Attr starts with `{`"));
    }
    let mut pairs = Vec::new();
    let mut stack: Vec<(u8, usize)> = Vec::new();
    let mut quote: Option<(u8, usize)> = None;
    let mut start = 1;
    let mut i = 1;
    while i < bytes.len() {
        let b = bytes[i];
        if let Some((q, _)) = quote {
            if b == b'\\' {
                i += 1;
            } else if b == q {
                quote = None;
            }
            i += 1;
            continue;
        }
        match b {
            b'"' | b'\'' => quote = Some((b, i)),
            b'[' | b'(' | b'{' => stack.push((b, i)),
            b']' | b')' | b'}' => match stack.pop() {
                Some((open, _)) if closer(open) == b => {}
                Some((open, at)) => {
                    let why = format!(
                        "`{}` closes the `{}` at column {}",
                        b as char,
                        open as char,
                        AttrError::at(text, at, "").column
                    );
                    return Err(AttrError::at(text, i, why));
                }
                None if b == b'}' => {
                    pair(text, start, i, &mut pairs)?;
                    if i + 1 != bytes.len() {
                        return Err(AttrError::at(text, i + 1, "text after the closing `}`"));
                    }
                    return Ok(pairs);
                }
                None => return Err(AttrError::at(text, i, format!("`{}` closes nothing", b as char))),
            },
            b',' if stack.is_empty() => {
                pair(text, start, i, &mut pairs)?;
                start = i + 1;
            }
            _ => {}
        }
        i += 1;
    }
    Err(match (quote, stack.last()) {
        (Some((q, at)), _) => AttrError::at(text, at, format!("the `{}` here is never closed", q as char)),
        (None, Some(&(open, at))) => AttrError::at(text, at, format!("the `{}` here is never closed", open as char)),
        (None, None) => AttrError::at(text, text.len(), "no closing `}`"),
    })
}

/// One `key:value` between `start` and `end` (bytes of `text`); an empty one (`{}` or a trailing
/// comma) is no pair.
fn pair<'t>(text: &'t str, start: usize, end: usize, pairs: &mut Pairs<'t>) -> Result<(), AttrError> {
    let part = &text[start..end];
    if part.trim().is_empty() {
        return Ok(());
    }
    let Some(colon) = part.find(':') else {
        let lead = part.len() - part.trim_start().len();
        return Err(AttrError::at(text, start + lead, format!("`{}` is not key:value", part.trim())));
    };
    let key = part[..colon].trim();
    if key.is_empty() {
        return Err(AttrError::at(text, start, "a value without a key"));
    }
    let value = unquote(part[colon + 1..].trim());
    if !pairs.iter().any(|(k, _)| k == key) {
        pairs.push((Cow::Borrowed(key), Cow::Borrowed(value)));
    }
    Ok(())
}

/// A value wholly inside one pair of quotes, without them.
fn unquote(value: &str) -> &str {
    for q in ['"', '\''] {
        if let Some(inner) = value.strip_prefix(q).and_then(|v| v.strip_suffix(q)) {
            if !inner.contains(q) {
                return inner;
            }
        }
    }
    value
}

/// Compact JSON, every value a string, keys in their order.
fn write_object(pairs: &Pairs<'_>) -> String {
    let mut out = String::with_capacity(pairs.iter().map(|(k, v)| k.len() + v.len() + 6).sum::<usize>() + 2);
    out.push('{');
    for (i, (k, v)) in pairs.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        json_string(&mut out, k);
        out.push(':');
        json_string(&mut out, v);
    }
    out.push('}');
    out
}

/// `text` as a JSON string (RFC 8259's escapes), written straight into `out`: a value per key of
/// millions of rows, where going through serde_json's `Value` cost two copies each.
fn json_string(out: &mut String, text: &str) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn json(text: &str) -> String {
        to_json(text).unwrap().0
    }

    #[test]
    fn the_bare_form_becomes_json_strings() {
        assert_eq!(
            json("{addr:20615843020800,size:16384,owner:,MID:7}"),
            r#"{"addr":"20615843020800","size":"16384","owner":"","MID":"7"}"#
        );
        assert_eq!(
            json("\"{allocation_id:3,addr:0x12c0000,size:512,owner:PTA@weight}\""),
            r#"{"allocation_id":"3","addr":"0x12c0000","size":"512","owner":"PTA@weight"}"#
        );
        // Commas inside brackets and quotes stay in their value; colons after the first too.
        assert_eq!(
            json("{type:PTA,dtype:torch.float16,shape:torch.Size([2, 3]),name:aten::add,path:\"a,b\"}"),
            r#"{"type":"PTA","dtype":"torch.float16","shape":"torch.Size([2, 3])","name":"aten::add","path":"a,b"}"#
        );
        assert_eq!(json("{}"), "{}");
        assert_eq!(json("{a:1,}"), r#"{"a":"1"}"#);
        assert_eq!(json(""), "");
        assert_eq!(json("  "), "");
        // A key twice keeps the first.
        assert_eq!(json("{size:1,size:2}"), r#"{"size":"1"}"#);
    }

    #[test]
    fn the_json_form_is_read_as_json() {
        let (out, form) = to_json(r#"{"addr":"0x10","size":512,"shadow":true,"x":null,"l":[1,2]}"#).unwrap();
        assert_eq!(form, Form::Json);
        // Keys come back sorted (serde_json's map), which no reader minds.
        assert_eq!(out, r#"{"addr":"0x10","l":"[1,2]","shadow":"true","size":"512","x":""}"#);
        assert_eq!(to_json("{addr:1}").unwrap().1, Form::Bare);
    }

    #[test]
    fn malformed_attrs_say_what_and_where() {
        let err = |t: &str| to_json(t).unwrap_err();
        assert_eq!(err("{addr:1,size:2").why, "no closing `}`");
        let e = err("{addr:1,shape:[2,3}");
        assert!(e.why.contains("closes the `[` at column 15"), "{e:?}");
        assert_eq!(e.column, 19);
        assert_eq!(err("{addr:1,oops,size:2}").why, "`oops` is not key:value");
        assert_eq!(err("{addr:1,oops,size:2}").column, 9);
        assert_eq!(err("addr:1").why, "an Attr starts with `{`");
        assert!(err("{a:1}x").why.contains("after the closing"));
        assert!(err("{a:\"1,b:2}").why.contains("never closed"));
        assert!(err(r#"{"addr":}"#).why.starts_with("not valid JSON"));
        assert_eq!(err("{:1}").why, "a value without a key");
    }

    /// A value the bare form can carry: text with balanced brackets and closed quotes.
    fn value() -> impl Strategy<Value = String> {
        let atom = "[a-zA-Z0-9_.@ :-]{0,8}";
        let leaf = prop_oneof![
            atom.prop_map(|s| s),
            atom.prop_map(|s| format!("[{s}, {s}]")),
            atom.prop_map(|s| format!("torch.Size([{s},{s}])")),
            atom.prop_map(|s| format!("\"{s},{s}\"")),
        ];
        prop::collection::vec(leaf, 1..3).prop_map(|v| v.concat())
    }

    proptest! {
        #[test]
        fn any_text_parses_or_fails_cleanly(text in "\\PC{0,60}") {
            // Never panics; an error points inside (or just past) the text.
            if let Err(e) = to_json(&text) {
                prop_assert!(e.column >= 1 && e.column <= text.chars().count() + 1, "{e:?} for {text:?}");
            }
        }

        #[test]
        fn values_are_escaped_as_json_reads_them(v in "\\PC{0,20}", c in "[\\x00-\\x1f\"\\\\]{0,3}") {
            let text = format!("{v}{c}");
            let mut out = String::new();
            json_string(&mut out, &text);
            prop_assert_eq!(serde_json::from_str::<String>(&out).unwrap(), text);
        }

        #[test]
        fn bare_pairs_round_trip(pairs in prop::collection::vec(("[a-z_]{1,10}", value()), 0..6)) {
            let mut want: Vec<(String, String)> = Vec::new();
            for (k, v) in &pairs {
                if !want.iter().any(|(have, _)| have == k) {
                    want.push((k.clone(), unquote(v.trim()).to_owned()));
                }
            }
            let text = format!("{{{}}}", pairs.iter().map(|(k, v)| format!("{k}:{v}")).collect::<Vec<_>>().join(","));
            let (out, _) = to_json(&text).unwrap();
            let read: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&out).unwrap();
            let got: Vec<(String, String)> = read.into_iter().map(|(k, v)| (k, v.as_str().unwrap().to_owned())).collect();
            let mut want_sorted = want.clone();
            want_sorted.sort();
            let mut got_sorted = got;
            got_sorted.sort();
            prop_assert_eq!(got_sorted, want_sorted);
        }
    }
}
