//! Reading the `Attr` column: the few string values each analysis needs, out of a JSON object of
//! a dozen keys, on every one of millions of rows.
//!
//! A full serde parse of each Attr was the largest cost of an analysis after SQLite's own, so
//! [`attr_fields!`] structs first try [`scan`], which only accepts the plain form every writer
//! uses (a flat object of strings without escapes) and borrows the values. Anything else goes to
//! serde_json, which decides exactly as before: the fast path accepts nothing serde would refuse
//! and yields the same values, so results never depend on which path read a row.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// Declares a struct of Attr keys read as strings (`Option<Cow<str>>`, named as the keys) with
/// a `parse` that takes the fast path when it can. Non-string values read as absent, exactly as
/// Insight's getter treats them; text serde_json refuses (or a key given twice) parses to `None`.
macro_rules! attr_fields {
    ($(#[$meta:meta])* $vis:vis struct $name:ident { $($fvis:vis $field:ident),* $(,)? }) => {
        $(#[$meta])*
        #[derive(Default, serde::Deserialize)]
        $vis struct $name<'a> {
            $(
                #[serde(borrow, default, deserialize_with = "crate::analysis::attr::string_only")]
                $fvis $field: Option<std::borrow::Cow<'a, str>>,
            )*
        }

        impl<'a> $name<'a> {
            #[allow(dead_code, reason = "not every struct is parsed outside tests")]
            $vis fn parse(text: &'a str) -> Option<Self> {
                let mut out = Self::default();
                let plain = crate::analysis::attr::scan(text, |key, value| {
                    let slot = match key {
                        // Each field is its key's constant: a key no writer knows does not compile.
                        $(crate::vocab::attr::$field => &mut out.$field,)*
                        _ => return true,
                    };
                    // A key twice is an error to serde: let it say so.
                    slot.replace(std::borrow::Cow::Borrowed(value)).is_none()
                });
                if plain {
                    Some(out)
                } else {
                    serde_json::from_str(text).ok()
                }
            }
        }
    };
}
pub(crate) use attr_fields;

/// JSON whitespace (outside strings; [`scan`] has refused the other three by then).
fn skip_spaces(b: &[u8], mut i: usize) -> usize {
    while b.get(i) == Some(&b' ') {
        i += 1;
    }
    i
}

/// The quotes of a text, in order. Strings in an Attr are a few bytes long, and looking for each
/// closing quote byte by byte mispredicts a branch per string; finding them 64 bytes at a time as
/// a bit mask does not.
struct Quotes<'b> {
    bytes: &'b [u8],
    /// Offset of the 64-byte block `mask` describes.
    base: usize,
    mask: u64,
}

impl<'b> Quotes<'b> {
    fn new(bytes: &'b [u8]) -> Self {
        Self { bytes, base: 0, mask: quote_mask(bytes) }
    }
}

impl Iterator for Quotes<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        while self.mask == 0 {
            self.base += 64;
            let rest = self.bytes.get(self.base..).filter(|r| !r.is_empty())?;
            self.mask = quote_mask(rest);
        }
        let at = self.base + self.mask.trailing_zeros() as usize;
        self.mask &= self.mask - 1;
        Some(at)
    }
}

/// Bit i set where byte i of the first 64 is a quote, eight bytes per step: a byte of `w ^ QUOTES`
/// is zero exactly at a quote, adding 0x7f to its low seven bits sets its top bit unless it is
/// zero (and never carries into the next byte), and a multiply gathers the eight top bits.
fn quote_mask(bytes: &[u8]) -> u64 {
    const QUOTES: u64 = u64::from_ne_bytes([b'"'; 8]);
    const LOW7: u64 = u64::from_ne_bytes([0x7f; 8]);
    const GATHER: u64 = 0x0102_0408_1020_4080;
    let mut block = [0u8; 64];
    let n = bytes.len().min(64);
    block[..n].copy_from_slice(&bytes[..n]);
    let mut mask = 0;
    for (k, word) in block.chunks_exact(8).enumerate() {
        let w = u64::from_le_bytes(word.try_into().expect("8 bytes")) ^ QUOTES;
        let zero = !((w & LOW7).wrapping_add(LOW7) | w | LOW7);
        mask |= ((zero >> 7).wrapping_mul(GATHER) >> 56) << (8 * k);
    }
    mask
}

/// Calls `pair` with each key and value of `text` when it is a flat JSON object of plain strings
/// (no escapes), and returns true; false as soon as it is anything else or `pair` returns false
/// (the caller then parses with serde_json, which handles every other form).
pub(crate) fn scan<'a>(text: &'a str, mut pair: impl FnMut(&'a str, &'a str) -> bool) -> bool {
    let b = text.as_bytes();
    // One pass without branches (it vectorises): with no backslash and no control character
    // anywhere, every quote delimits a string and every string is as serde would read it. Tabs
    // and newlines between tokens are legal JSON, but no writer puts them there: serde reads those.
    if b.iter().fold(false, |bad, &c| bad | (c < 0x20) | (c == b'\\')) {
        return false;
    }
    let mut quotes = Quotes::new(b);
    // The string that must start at `at`, and the index after it. Both ends are ASCII quotes, so
    // the slice is on character boundaries.
    let mut string_at = |at: usize| -> Option<(&'a str, usize)> {
        let open = quotes.next().filter(|&q| q == at)?;
        let close = quotes.next()?;
        Some((&text[open + 1..close], close + 1))
    };
    let mut at = skip_spaces(b, 0);
    if b.get(at) != Some(&b'{') {
        return false;
    }
    at = skip_spaces(b, at + 1);
    if b.get(at) == Some(&b'}') {
        return skip_spaces(b, at + 1) == b.len();
    }
    loop {
        let Some((key, next)) = string_at(at) else { return false };
        at = skip_spaces(b, next);
        if b.get(at) != Some(&b':') {
            return false;
        }
        let Some((value, next)) = string_at(skip_spaces(b, at + 1)) else { return false };
        if !pair(key, value) {
            return false;
        }
        at = skip_spaces(b, next);
        match b.get(at) {
            Some(b',') => at = skip_spaces(b, at + 1),
            Some(b'}') => return skip_spaces(b, at + 1) == b.len(),
            _ => return false,
        }
    }
}

/// An Attr value as text: Attr values are strings, and anything else (a number, a nested value
/// from another tool) reads as absent rather than failing the whole row. Borrowed when possible,
/// so reading millions of rows allocates nothing per key.
pub(crate) fn string_only<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Cow<'de, str>>, D::Error> {
    struct StringOnly;
    impl<'de> Visitor<'de> for StringOnly {
        type Value = Option<Cow<'de, str>>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("any JSON value")
        }
        fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
            Ok(Some(v.into()))
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
            Ok(Some(v.to_owned().into()))
        }
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok(None)
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
            Ok(None)
        }
    }
    d.deserialize_any(StringOnly)
}

#[cfg(test)]
mod tests {
    use super::*;

    attr_fields! {
        #[derive(Debug, PartialEq)]
        struct Probe { size, owner, shadow }
    }

    /// What serde alone makes of `text`, to hold the fast path to it.
    fn by_serde(text: &str) -> Option<Probe<'_>> {
        serde_json::from_str(text).ok()
    }

    #[test]
    fn the_fast_path_agrees_with_serde_on_every_form() {
        let texts = [
            r#"{"addr":"0x10","size":"4096","owner":"PTA@model","api":"aclrtMalloc"}"#,
            r#"{}"#,
            " { \"size\" : \"1\" ,\n\t\"owner\":\"x\" } \r\n",
            r#"{"size":"1","size":"2"}"#,                  // a key twice: serde refuses
            r#"{"other":"1","other":"2","size":"3"}"#,     // an unknown key twice is fine
            r#"{"size":4096,"owner":null,"shadow":true}"#, // non-strings read as absent
            r#"{"size":"1","nested":{"owner":"x"},"list":[1,2]}"#, // nested values are skipped
            r#"{"owner":"a\"b","size":"\u0031"}"#,         // escapes are decoded
            r#"{"si\u007ae":"5"}"#,                        // even in keys
            "{\"owner\":\"tab\there\"}",                   // a raw control character
            r#"{"owner":"ünïcödé","size":"7"}"#,
            r#"{"size":"1"} x"#,
            r#"{"size":"1",}"#,
            r#"{"size" "1"}"#,
            r#"{"size":"1""#,
            r#"["1","x","true"]"#, // serde also takes a struct as a sequence
            r#"{"size":"1"}{}"#,
            "",
            "N/A",
            "   ",
        ];
        for text in texts {
            assert_eq!(Probe::parse(text), by_serde(text), "{text:?}");
        }
        let plain = Probe::parse(r#"{"size":"4096","owner":"PTA@kv","shadow":"true"}"#).unwrap();
        assert!(matches!(plain.owner, Some(Cow::Borrowed("PTA@kv"))), "plain values are borrowed");
    }

    #[test]
    fn quotes_are_found_across_blocks() {
        // Every length around the 64-byte blocks, quotes at every offset pattern.
        for len in 0..200usize {
            let text: Vec<u8> =
                (0..len).map(|i| if (i * 7 + len) % 5 == 0 { b'"' } else { b'a' + (i % 26) as u8 }).collect();
            let naive: Vec<usize> = (0..len).filter(|&i| text[i] == b'"').collect();
            assert_eq!(Quotes::new(&text).collect::<Vec<_>>(), naive, "length {len}");
        }
        let long = format!("{{{}\"last\":\"x\"}}", "\"k\":\"v\",".repeat(40));
        assert_eq!(Probe::parse(&long), by_serde(&long));
    }

    #[test]
    fn scan_stops_at_the_first_thing_it_does_not_know() {
        let mut seen = Vec::new();
        assert!(scan(r#"{"a":"1","b":""}"#, |k, v| {
            seen.push((k, v));
            true
        }));
        assert_eq!(seen, [("a", "1"), ("b", "")]);
        assert!(!scan(r#"{"a":"1","b":2}"#, |_, _| true));
        assert!(!scan(r#"{"a":"1"}"#, |_, _| false));
    }
}
