//! The `Attr` column.
//!
//! In the DB it is a compact JSON object whose values are all strings: Insight reads `size`,
//! `allocation_id`, `owner`, ... with a getter that returns "" for anything that is not a string,
//! and groups accesses with `LIKE '%"allocation_id":"N"%'`, which only matches compact JSON.
//! In CSV it is msMemScope's unquoted form `{key:value,...}`.
//!
//! Pairs are written as JSON the moment they are added, into a buffer each thread reuses: a row is
//! built for every traced call, so building one must neither allocate nor copy a large value
//! around. The CSV form is read back from the JSON (CSV output is the rare case).

use std::cell::Cell;

/// One value, formatted as it is added.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Value<'a> {
    U64(u64),
    I64(i64),
    /// `0x%016x`.
    Addr(u64),
    Str(&'a str),
    Text(String),
}

/// Appends `0x%016x` without going through `core::fmt` (this runs for every row).
pub fn push_addr(out: &mut String, v: u64) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.reserve(18);
    out.push_str("0x");
    for i in (0..16).rev() {
        out.push(char::from(HEX[((v >> (i * 4)) & 0xf) as usize]));
    }
}

/// Appends `s` as the inside of a JSON string.
fn push_escaped(out: &mut String, s: &str) {
    if s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        out.push_str(s);
    } else {
        // serde_json escapes quotes, backslashes and control characters.
        let quoted = serde_json::Value::from(s).to_string();
        out.push_str(&quoted[1..quoted.len() - 1]);
    }
}

impl From<u64> for Value<'_> {
    fn from(v: u64) -> Self {
        Self::U64(v)
    }
}
impl From<u16> for Value<'_> {
    fn from(v: u16) -> Self {
        Self::U64(v.into())
    }
}
impl From<i32> for Value<'_> {
    fn from(v: i32) -> Self {
        Self::I64(v.into())
    }
}
impl<'a> From<&'a str> for Value<'a> {
    fn from(v: &'a str) -> Self {
        Self::Str(v)
    }
}
impl From<String> for Value<'_> {
    fn from(v: String) -> Self {
        Self::Text(v)
    }
}

thread_local! {
    /// The buffer of the last Attr dropped on this thread, for the next one: a row is made for
    /// every traced call, and one allocation each (freed on the store thread) was a tenth of
    /// the consumer's time.
    static SPARE: Cell<String> = const { Cell::new(String::new()) };
}

/// Ordered key/value pairs (order is kept so output is stable and diffable), written as JSON as
/// they are added: `{"k":"v",...` without the closing brace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attr {
    json: String,
}

impl Default for Attr {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for Attr {
    fn drop(&mut self) {
        let json = std::mem::take(&mut self.json);
        // Fails only while the thread exits; the buffer is then simply freed.
        let _ = SPARE.try_with(|spare| spare.set(json));
    }
}

impl Attr {
    pub fn new() -> Self {
        let mut json = SPARE.try_with(Cell::take).unwrap_or_default();
        json.clear();
        json.reserve(256);
        json.push('{');
        Self { json }
    }

    pub fn with<'a>(mut self, key: &'static str, value: impl Into<Value<'a>>) -> Self {
        let out = &mut self.json;
        out.push_str(if out.len() > 1 { ",\"" } else { "\"" });
        out.push_str(key);
        out.push_str("\":\"");
        match value.into() {
            Value::U64(v) => out.push_str(itoa::Buffer::new().format(v)),
            Value::I64(v) => out.push_str(itoa::Buffer::new().format(v)),
            Value::Addr(v) => push_addr(out, v),
            Value::Str(s) => push_escaped(out, s),
            Value::Text(s) => push_escaped(out, &s),
        }
        out.push('"');
        self
    }

    pub fn addr(self, key: &'static str, addr: u64) -> Self {
        self.with(key, Value::Addr(addr))
    }

    pub fn with_opt<'a, V: Into<Value<'a>>>(self, key: &'static str, value: Option<V>) -> Self {
        match value {
            Some(v) => self.with(key, v),
            None => self,
        }
    }

    /// Whether `key` is set. Keys are plain and every quote inside a value is escaped, so a key
    /// is `"key":` right after the opening brace or a comma.
    #[cfg(test)]
    pub fn has(&self, key: &str) -> bool {
        let bytes = self.json.as_bytes();
        self.json.match_indices(key).any(|(i, _)| {
            let after = &bytes[i + key.len()..];
            i >= 2 && bytes[i - 1] == b'"' && matches!(bytes[i - 2], b'{' | b',') && after.starts_with(b"\":")
        })
    }

    /// The pairs, with their values unescaped.
    fn pairs(&self) -> Vec<(String, String)> {
        let object = format!("[{}]", self.json[1..].replace("\":\"", "\",\""));
        let flat: Vec<String> = serde_json::from_str(&object).expect("an Attr is JSON of strings");
        flat.chunks(2).map(|kv| (kv[0].clone(), kv[1].clone())).collect()
    }

    #[cfg(test)]
    pub fn get(&self, key: &str) -> Option<String> {
        self.pairs().into_iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// Appends `{"k":"v",...}` (no whitespace) to `out`.
    pub fn write_json(&self, out: &mut String) {
        out.push_str(&self.json);
        out.push('}');
    }

    #[cfg(test)]
    pub fn to_json(&self) -> String {
        let mut s = String::with_capacity(160);
        self.write_json(&mut s);
        s
    }

    /// Appends msMemScope's CSV form, `{k:v,...}`. Values are written as-is; the CSV writer
    /// quotes the whole field. (Taken from the JSON: CSV output is the rare case.)
    pub fn write_csv_form(&self, out: &mut String) {
        out.push('{');
        for (i, (k, v)) in self.pairs().iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(k);
            out.push(':');
            out.push_str(v);
        }
        out.push('}');
    }

    #[cfg(test)]
    pub fn to_csv_form(&self) -> String {
        let mut s = String::new();
        self.write_csv_form(&mut s);
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_is_compact_with_string_values() {
        let a = Attr::new().addr("addr", 0x1234).with("size", 4096u64).with("allocation_id", 7u64);
        let json = a.to_json();
        assert_eq!(json, r#"{"addr":"0x0000000000001234","size":"4096","allocation_id":"7"}"#);
        // Independent check: a JSON parser sees an object whose values are all strings.
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert!(v.as_object().unwrap().values().all(serde_json::Value::is_string));
        // Insight's access grouping query must match.
        assert!(json.contains(r#""allocation_id":"7""#));
    }

    #[test]
    fn json_escapes_hostile_values() {
        let a = Attr::new().with("owner", "a\"b\\c\n".to_owned());
        let v: serde_json::Value = serde_json::from_str(&a.to_json()).unwrap();
        assert_eq!(v["owner"], "a\"b\\c\n");
    }

    #[test]
    fn a_key_is_found_only_as_a_key() {
        let a = Attr::new().with("owner", r#"x","shadow":"true"#).with("size", 1u64);
        assert!(a.has("owner") && a.has("size"));
        assert!(!a.has("shadow"), "text inside a value is not a key: {}", a.to_json());
        assert!(!a.has("own") && !a.has("wner"));
        assert!(!Attr::new().has("size"));
    }

    #[test]
    fn csv_form_reads_escaped_values_back_raw() {
        let a = Attr::new().with("owner", "a\"b\\c:d,\"x\":\"y").with("size", 2u64);
        assert_eq!(a.to_csv_form(), "{owner:a\"b\\c:d,\"x\":\"y,size:2}");
        assert_eq!(Attr::new().to_csv_form(), "{}");
    }

    #[test]
    fn a_reused_buffer_starts_empty() {
        for _ in 0..3 {
            let a = Attr::new().with("size", 9u64);
            assert_eq!(a.to_json(), r#"{"size":"9"}"#);
        }
        let first = Attr::new().with("a", 1u64);
        let second = Attr::new().with("b", 2u64);
        assert_eq!((first.to_json(), second.to_json()), (r#"{"a":"1"}"#.to_owned(), r#"{"b":"2"}"#.to_owned()));
    }

    #[test]
    fn addresses_are_sixteen_hex_digits() {
        for v in [0u64, 1, 0xdead_beef, u64::MAX, 0x7fbf_3134_8200] {
            let mut s = String::new();
            push_addr(&mut s, v);
            assert_eq!(s, format!("0x{v:016x}"));
        }
    }

    #[test]
    fn csv_form_matches_msmemscope() {
        let a = Attr::new().with("addr", "0x10").with("size", 123u64).with("owner", "PTA@weight");
        assert_eq!(a.to_csv_form(), "{addr:0x10,size:123,owner:PTA@weight}");
    }

    #[test]
    fn optional_values_are_skipped_and_negatives_kept() {
        let a = Attr::new().with_opt("module_id", None::<u16>).with_opt("policy", Some(2u64)).with("status", -5i32);
        assert_eq!(a.to_json(), r#"{"policy":"2","status":"-5"}"#);
    }
}
