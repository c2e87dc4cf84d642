//! The `Attr` column.
//!
//! In the DB it is a compact JSON object whose values are all strings: Insight reads `size`,
//! `allocation_id`, `owner`, ... with a getter that returns "" for anything that is not a string,
//! and groups accesses with `LIKE '%"allocation_id":"N"%'`, which only matches compact JSON.
//! In CSV it is msMemScope's unquoted form `{key:value,...}`.
//!
//! Values are kept typed until written: a row is built for every traced call, and formatting
//! numbers straight into the output buffer keeps allocations off that path.

use std::sync::Arc;

/// One value, formatted when written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Value {
    U64(u64),
    I64(i64),
    /// `0x%016x`.
    Addr(u64),
    Static(&'static str),
    Text(String),
    /// Text shared with other rows (an owner path).
    Shared(Arc<str>),
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

impl Value {
    fn write(&self, out: &mut String) {
        match self {
            Self::U64(v) => out.push_str(itoa::Buffer::new().format(*v)),
            Self::I64(v) => out.push_str(itoa::Buffer::new().format(*v)),
            Self::Addr(v) => push_addr(out, *v),
            Self::Static(s) => out.push_str(s),
            Self::Text(s) => out.push_str(s),
            Self::Shared(s) => out.push_str(s),
        }
    }

    /// Whether the formatted value could need JSON escaping.
    fn is_plain(&self) -> bool {
        match self {
            Self::U64(_) | Self::I64(_) | Self::Addr(_) => true,
            Self::Static(s) => s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\'),
            Self::Text(s) => s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\'),
            Self::Shared(s) => s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\'),
        }
    }
}

impl From<u64> for Value {
    fn from(v: u64) -> Self {
        Self::U64(v)
    }
}
impl From<u16> for Value {
    fn from(v: u16) -> Self {
        Self::U64(v.into())
    }
}
impl From<i32> for Value {
    fn from(v: i32) -> Self {
        Self::I64(v.into())
    }
}
impl From<&'static str> for Value {
    fn from(v: &'static str) -> Self {
        Self::Static(v)
    }
}
impl From<String> for Value {
    fn from(v: String) -> Self {
        Self::Text(v)
    }
}
impl From<Arc<str>> for Value {
    fn from(v: Arc<str>) -> Self {
        Self::Shared(v)
    }
}

/// Ordered key/value pairs (order is kept so output is stable and diffable).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Attr(Vec<(&'static str, Value)>);

impl Attr {
    pub fn new() -> Self {
        Self(Vec::with_capacity(8))
    }

    pub fn with(mut self, key: &'static str, value: impl Into<Value>) -> Self {
        self.0.push((key, value.into()));
        self
    }

    pub fn addr(self, key: &'static str, addr: u64) -> Self {
        self.with(key, Value::Addr(addr))
    }

    pub fn with_opt(self, key: &'static str, value: Option<impl Into<Value>>) -> Self {
        match value {
            Some(v) => self.with(key, v),
            None => self,
        }
    }

    pub fn has(&self, key: &str) -> bool {
        self.0.iter().any(|(k, _)| *k == key)
    }

    #[cfg(test)]
    pub fn get(&self, key: &str) -> Option<String> {
        self.0.iter().find(|(k, _)| *k == key).map(|(_, v)| {
            let mut s = String::new();
            v.write(&mut s);
            s
        })
    }

    /// Appends `{"k":"v",...}` (no whitespace) to `out`.
    pub fn write_json(&self, out: &mut String) {
        out.push('{');
        for (i, (k, v)) in self.0.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push('"');
            out.push_str(k);
            out.push_str("\":");
            if v.is_plain() {
                out.push('"');
                v.write(out);
                out.push('"');
            } else {
                let mut raw = String::new();
                v.write(&mut raw);
                // serde_json escapes quotes, backslashes and control characters.
                out.push_str(&serde_json::Value::from(raw).to_string());
            }
        }
        out.push('}');
    }

    #[cfg(test)]
    pub fn to_json(&self) -> String {
        let mut s = String::with_capacity(160);
        self.write_json(&mut s);
        s
    }

    /// msMemScope's CSV form, `{k:v,...}`. Values are written as-is; the CSV writer quotes the
    /// whole field.
    pub fn to_csv_form(&self) -> String {
        let mut s = String::from("{");
        for (i, (k, v)) in self.0.iter().enumerate() {
            if i > 0 {
                s.push(',');
            }
            s.push_str(k);
            s.push(':');
            v.write(&mut s);
        }
        s.push('}');
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
