//! The `Attr` column.
//!
//! In the DB it is a compact JSON object whose values are all strings: Insight reads `size`,
//! `allocation_id`, `owner`, ... with a getter that returns "" for anything that is not a string,
//! and groups accesses with `LIKE '%"allocation_id":"N"%'`, which only matches compact JSON.
//! In CSV it is msMemScope's unquoted form `{key:value,...}`.
//!
//! Values are kept typed until written: a row is built for every traced call, and formatting
//! numbers straight into the output buffer keeps allocations off that path.

/// One value, formatted when written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Value<'a> {
    U64(u64),
    I64(i64),
    /// `0x%016x`.
    Addr(u64),
    /// Borrowed from the model output the row is made from (or static).
    Str(&'a str),
    /// Made for this row (rare rows only: the hot ones borrow).
    Text(String),
}

/// Appends `0x%016x` without going through `core::fmt` (this runs for every row).
pub fn push_addr(out: &mut String, v: u64) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut buf = [0u8; 18];
    buf[0] = b'0';
    buf[1] = b'x';
    for i in 0..16 {
        buf[17 - i] = HEX[((v >> (i * 4)) & 0xf) as usize];
    }
    out.push_str(std::str::from_utf8(&buf).expect("ASCII"));
}

/// Whether `s` can go between JSON quotes as it is.
fn is_plain(s: &str) -> bool {
    s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\')
}

impl Value<'_> {
    fn write(&self, out: &mut String) {
        match self {
            Self::U64(v) => out.push_str(itoa::Buffer::new().format(*v)),
            Self::I64(v) => out.push_str(itoa::Buffer::new().format(*v)),
            Self::Addr(v) => push_addr(out, *v),
            Self::Str(s) => out.push_str(s),
            Self::Text(s) => out.push_str(s),
        }
    }

    /// Appends the value as a JSON string.
    fn write_json(&self, out: &mut String) {
        let text = match self {
            Self::Str(s) => *s,
            Self::Text(s) => s.as_str(),
            _ => {
                out.push('"');
                self.write(out);
                out.push('"');
                return;
            }
        };
        if is_plain(text) {
            out.push('"');
            out.push_str(text);
            out.push('"');
        } else {
            // serde_json escapes quotes, backslashes and control characters.
            out.push_str(&serde_json::Value::from(text).to_string());
        }
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

/// The most keys a row has (a device MALLOC with every driver detail has 15).
pub const CAPACITY: usize = 16;

/// Ordered key/value pairs (order is kept so output is stable and diffable), held inline: a row
/// is built for every traced call, and a heap allocation per row (freed on the store thread) was
/// a tenth of the consumer's time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attr<'a> {
    len: usize,
    pairs: [(&'static str, Value<'a>); CAPACITY],
}

impl Default for Attr<'_> {
    fn default() -> Self {
        Self::new()
    }
}

impl<'a> Attr<'a> {
    pub fn new() -> Self {
        Self { len: 0, pairs: [const { ("", Value::U64(0)) }; CAPACITY] }
    }

    fn pairs(&self) -> &[(&'static str, Value<'a>)] {
        &self.pairs[..self.len]
    }

    #[inline]
    pub fn with(mut self, key: &'static str, value: impl Into<Value<'a>>) -> Self {
        assert!(self.len < CAPACITY, "more than {CAPACITY} Attr keys (adding {key})");
        self.pairs[self.len] = (key, value.into());
        self.len += 1;
        self
    }

    #[inline]
    pub fn addr(self, key: &'static str, addr: u64) -> Self {
        self.with(key, Value::Addr(addr))
    }

    #[inline]
    pub fn with_opt<V: Into<Value<'a>>>(self, key: &'static str, value: Option<V>) -> Self {
        match value {
            Some(v) => self.with(key, v),
            None => self,
        }
    }

    pub fn has(&self, key: &str) -> bool {
        self.pairs().iter().any(|(k, _)| *k == key)
    }

    #[cfg(test)]
    pub fn get(&self, key: &str) -> Option<String> {
        self.pairs().iter().find(|(k, _)| *k == key).map(|(_, v)| {
            let mut s = String::new();
            v.write(&mut s);
            s
        })
    }

    /// Appends `{"k":"v",...}` (no whitespace) to `out`.
    pub fn write_json(&self, out: &mut String) {
        out.push('{');
        for (i, (k, v)) in self.pairs().iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push('"');
            out.push_str(k);
            out.push_str("\":");
            v.write_json(out);
        }
        out.push('}');
    }

    #[cfg(test)]
    pub fn to_json(&self) -> String {
        let mut s = String::with_capacity(160);
        self.write_json(&mut s);
        s
    }

    /// Appends msMemScope's CSV form, `{k:v,...}`. Values are written as-is; the CSV writer
    /// quotes the whole field.
    pub fn write_csv_form(&self, out: &mut String) {
        out.push('{');
        for (i, (k, v)) in self.pairs().iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(k);
            out.push(':');
            v.write(out);
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
