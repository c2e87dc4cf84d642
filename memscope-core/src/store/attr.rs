//! The `Attr` column.
//!
//! In the DB it is a compact JSON object whose values are all strings: Insight reads `size`,
//! `allocation_id`, `owner`, ... with a getter that returns "" for anything that is not a string,
//! and groups accesses with `LIKE '%"allocation_id":"N"%'`, which only matches compact JSON.
//! In CSV it is msMemScope's unquoted form `{key:value,...}`.
//!
//! Pairs are written as JSON the moment they are added ([`Pairs`]): a row is made for every traced
//! call, so its Attr goes straight into the text of the batch it travels in, never allocated nor
//! copied again. An [`Attr`] holds the pairs of a row made on its own. The CSV form is read back
//! from the JSON (CSV output is the rare case).

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
    /// Text known to need no escaping: written without looking at it.
    Plain(Plain),
    /// The same, padded to a fixed size: copied with the rest of its pair.
    Padded(&'a Padded),
}

/// The longest [`Padded`] text.
pub const PADDED: usize = 32;

/// Plain text padded with zeros to [`PADDED`] bytes, so that it is copied in one fixed-size
/// move with its key (API names: every row has one or two, and each copy of a few bytes was a
/// call).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Padded {
    bytes: [u8; PADDED],
    len: usize,
}

impl Padded {
    /// `text` padded, if it is plain and fits.
    pub fn new(text: &str) -> Option<Self> {
        if text.len() > PADDED || !is_plain(text) {
            return None;
        }
        let mut bytes = [0; PADDED];
        bytes[..text.len()].copy_from_slice(text.as_bytes());
        Some(Self { bytes, len: text.len() })
    }
}

/// Text that stands inside a JSON string as it is (no quote, backslash or control character),
/// checked when it is made: at compile time for a constant ([`Plain::new`]), or once for a
/// table of names ([`Plain::checked`]). Most of a row's text values are such names (APIs, page
/// types, pools), and skipping their scan is a tenth of a row's cost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plain(&'static str);

impl Plain {
    /// `text`, which must be plain: a constant made with it fails to compile otherwise.
    pub const fn new(text: &'static str) -> Self {
        match Self::checked(text) {
            Some(plain) => plain,
            None => panic!("a Plain value needs escaping"),
        }
    }

    /// `text` if it is plain.
    pub const fn checked(text: &'static str) -> Option<Self> {
        let bytes = text.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            if needs_escape(bytes[i]) {
                return None;
            }
            i += 1;
        }
        Some(Self(text))
    }
}

/// Appends the first `n` bytes of `bytes` with one copy of all of them and a shorter length:
/// a copy of a fixed size is a few moves, one of a variable size a call (and short copies
/// were the largest cost of a row).
fn push_prefix<const N: usize>(out: &mut String, bytes: &[u8; N], n: usize) {
    debug_assert!(std::str::from_utf8(&bytes[..n]).is_ok());
    // SAFETY: every caller's first `n` bytes are UTF-8: whole `str`s (keys, [`Padded`] texts)
    // and ASCII (JSON punctuation, digits), so the String stays UTF-8; the bytes after them are
    // cut off.
    let vec = unsafe { out.as_mut_vec() };
    let end = vec.len() + n;
    vec.extend_from_slice(bytes);
    vec.truncate(end);
}

/// Appends a [`Padded`] text in one copy.
pub fn push_padded(out: &mut String, text: &Padded) {
    push_prefix(out, &text.bytes, text.len);
}

/// `0x%016x` of `v`, as bytes: each nibble spread to a byte of its own, then all 16 made digits
/// at once.
fn hex_addr(v: u64) -> [u8; 18] {
    /// The 8 nibbles of `x`, one per byte, most significant first in memory, as hex digits.
    fn digits(x: u32) -> [u8; 8] {
        let mut x = u64::from(x);
        x = (x & 0x0000_0000_ffff) | ((x & 0xffff_0000) << 16);
        x = (x & 0x0000_00ff_0000_00ff) | ((x & 0x0000_ff00_0000_ff00) << 8);
        x = (x & 0x000f_000f_000f_000f) | ((x & 0x00f0_00f0_00f0_00f0) << 4);
        // Bytes of 10 to 15 get a 1 here, to move them from after '9' to 'a'.
        let letters = ((x + 0x0606_0606_0606_0606) >> 4) & 0x0101_0101_0101_0101;
        let ascii = x + 0x3030_3030_3030_3030 + letters * u64::from(b'a' - b'9' - 1);
        ascii.to_be_bytes()
    }
    let mut text = [0; 18];
    text[..2].copy_from_slice(b"0x");
    text[2..10].copy_from_slice(&digits((v >> 32) as u32));
    text[10..].copy_from_slice(&digits(v as u32));
    text
}

/// Appends `0x%016x` without going through `core::fmt` (this runs for every row), in one copy.
pub fn push_addr(out: &mut String, v: u64) {
    push_prefix(out, &hex_addr(v), 18);
}

/// The 8 decimal digits of `v` (below 10^8), one per byte, most significant first in memory:
/// all of them at once, with multiplications that divide each lane by 100, then by 10.
#[inline(always)]
fn eight_digits(v: u64) -> u64 {
    debug_assert!(v < 100_000_000);
    // Two lanes of 32 bits (4 digits each), then four of 16 (2 digits), then eight of 8. The
    // multipliers divide exactly below 10^4 and 10^2, and no lane overflows into the next.
    let mut x = (v / 10_000) | ((v % 10_000) << 32);
    let hundreds = ((x * 10_486) >> 20) & 0x0000_007f_0000_007f;
    x = hundreds | ((x - hundreds * 100) << 16);
    let tens = ((x * 103) >> 10) & 0x000f_000f_000f_000f;
    tens | ((x - tens * 10) << 8)
}

/// Numbers below this have at most 8 digits: one word.
const E8: u64 = 100_000_000;

/// `'0'` in every byte: digit values to ASCII.
const ZEROS: u64 = 0x3030_3030_3030_3030;

/// The 8 digits of `v` (below 10^8) as ASCII without its leading zeros (one stays for 0),
/// and how many are left.
#[inline(always)]
fn trimmed(v: u64) -> (u64, usize) {
    let digits = eight_digits(v);
    // Leading zeros are the low bytes.
    let zeros = (digits.trailing_zeros() / 8).min(7) as usize;
    ((digits + ZEROS) >> (zeros * 8), 8 - zeros)
}

/// `v` in decimal, left-aligned, and its length: eight digits at a time.
fn decimal(v: u64) -> ([u8; 24], usize) {
    let mut text = [0; 24];
    // The digits before the last 8 (or 16) of them.
    let head = if v >= E8 * E8 {
        v / (E8 * E8)
    } else if v >= E8 {
        v / E8
    } else {
        v
    };
    let (head, n) = trimmed(head);
    text[..8].copy_from_slice(&head.to_le_bytes());
    if v < E8 {
        return (text, n);
    }
    let full = |x: u64| (eight_digits(x % E8) + ZEROS).to_le_bytes();
    if v < E8 * E8 {
        text[n..n + 8].copy_from_slice(&full(v));
        return (text, n + 8);
    }
    text[n..n + 8].copy_from_slice(&full(v / E8));
    text[n + 8..n + 16].copy_from_slice(&full(v));
    (text, n + 16)
}

/// Appends `v` in decimal, in one copy.
#[cfg(test)]
fn push_u64(out: &mut String, v: u64) {
    let (text, n) = decimal(v);
    push_prefix(out, &text, n);
}

/// Whether a byte must be escaped inside a JSON string.
const fn needs_escape(b: u8) -> bool {
    b < 0x20 || b == b'"' || b == b'\\'
}

/// Whether `s` can stand inside a JSON string as it is, eight bytes at a time.
fn is_plain(s: &str) -> bool {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    /// A high bit in each byte that is zero (exact for the question "any?").
    fn zeros(x: u64) -> u64 {
        x.wrapping_sub(ONES) & !x & HIGH
    }
    let mut words = s.as_bytes().chunks_exact(8);
    for word in &mut words {
        let x = u64::from_le_bytes(word.try_into().expect("chunks of 8"));
        // Control characters are the bytes below 0x20; bytes from 0x80 have their high bit set
        // and are masked by `!x`.
        let control = x.wrapping_sub(ONES * 0x20) & !x & HIGH;
        if control | zeros(x ^ (ONES * u64::from(b'"'))) | zeros(x ^ (ONES * u64::from(b'\\'))) != 0 {
            return false;
        }
    }
    !words.remainder().iter().any(|&b| needs_escape(b))
}

/// Appends `s` as the inside of a JSON string.
#[inline]
fn push_escaped(out: &mut String, s: &str) {
    if is_plain(s) {
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
impl From<Plain> for Value<'_> {
    fn from(v: Plain) -> Self {
        Self::Plain(v)
    }
}
impl From<String> for Value<'_> {
    fn from(v: String) -> Self {
        Self::Text(v)
    }
}

/// Room for one pair's `,"key":"`, a number or an address, and its closing quote.
const PAIR: usize = 64;
/// The longest key written in one copy with its value; longer ones are added piece by piece.
const KEY_MAX: usize = PAIR - 5 - 24;

/// Puts `,"key":"` (`{"key":"` for the first pair) at the start of `pair`; returns its length.
#[inline(always)]
fn pair_start(pair: &mut [u8; PAIR], first: bool, key: &str) -> usize {
    pair[0] = if first { b'{' } else { b',' };
    pair[1] = b'"';
    let at = 2 + key.len();
    pair[2..at].copy_from_slice(key.as_bytes());
    pair[at..at + 3].copy_from_slice(b"\":\"");
    at + 3
}

/// Appends a value between its quotes.
fn push_value(out: &mut String, value: Value<'_>) {
    match value {
        Value::U64(v) => {
            let (digits, n) = decimal(v);
            push_prefix(out, &digits, n);
        }
        Value::I64(v) => out.push_str(itoa::Buffer::new().format(v)),
        Value::Addr(v) => push_addr(out, v),
        Value::Str(s) => push_escaped(out, s),
        Value::Text(s) => push_escaped(out, &s),
        Value::Plain(s) => out.push_str(s.0),
        Value::Padded(s) => push_padded(out, s),
    }
}

/// Appends a whole pair, piece by piece.
fn push_pair(out: &mut String, first: bool, key: &str, value: Value<'_>) {
    out.push_str(if first { "{\"" } else { ",\"" });
    out.push_str(key);
    out.push_str("\":\"");
    push_value(out, value);
    out.push('"');
}

/// Writes an Attr's pairs as JSON onto the end of a text, as they are added: the batch's text
/// itself for a row on its way to the store, so the JSON is written once and never copied.
///
/// Its methods are inlined: a row's keys are constants, so each pair's punctuation and key
/// become a few stores instead of three calls that copy a few bytes each (most of a row's cost
/// when they were not).
pub struct Pairs<'o> {
    out: &'o mut String,
    /// No pair written yet: the next one opens the object.
    first: bool,
}

impl<'o> Pairs<'o> {
    /// Pairs to write onto the end of `out`; nothing is written until the first pair or
    /// [`Pairs::close`].
    pub fn new(out: &'o mut String) -> Self {
        Self { out, first: true }
    }

    #[inline(always)]
    pub fn with<'v>(mut self, key: &'static str, value: impl Into<Value<'v>>) -> Self {
        let first = std::mem::replace(&mut self.first, false);
        let value = value.into();
        if key.len() > KEY_MAX {
            push_pair(self.out, first, key, value);
            return self;
        }
        // The pair is put together here, then added in one copy: its key's length is a
        // constant, and the number after it is at most 24 bytes.
        let mut pair = [0; PAIR];
        let at = pair_start(&mut pair, first, key);
        let end = match value {
            Value::U64(v) if v < E8 => {
                let (digits, n) = trimmed(v);
                pair[at..at + 8].copy_from_slice(&digits.to_le_bytes());
                at + n
            }
            Value::U64(v) => {
                let (digits, n) = decimal(v);
                pair[at..at + 24].copy_from_slice(&digits);
                at + n
            }
            Value::Addr(v) => {
                pair[at..at + 18].copy_from_slice(&hex_addr(v));
                at + 18
            }
            Value::Padded(text) if at + PADDED < PAIR => {
                pair[at..at + PADDED].copy_from_slice(&text.bytes);
                at + text.len
            }
            text => {
                push_prefix(self.out, &pair, at);
                push_value(self.out, text);
                self.out.push('"');
                return self;
            }
        };
        pair[end] = b'"';
        push_prefix(self.out, &pair, end + 1);
        self
    }

    #[inline(always)]
    pub fn addr(self, key: &'static str, addr: u64) -> Self {
        self.with(key, Value::Addr(addr))
    }

    #[inline(always)]
    pub fn with_opt<'v, V: Into<Value<'v>>>(self, key: &'static str, value: Option<V>) -> Self {
        match value {
            Some(v) => self.with(key, v),
            None => self,
        }
    }

    /// Where the next pair will start in the text, and whether it is the object's first.
    pub(super) fn position(&self) -> (usize, bool) {
        (self.out.len(), self.first)
    }

    /// The text written since `start` (a [`Pairs::position`]).
    pub(super) fn since(&self, start: usize) -> &str {
        &self.out[start..]
    }

    /// Appends pairs written earlier by [`Pairs`] after at least one other pair (each starts
    /// with its comma), as they were.
    pub(super) fn repeat(&mut self, pairs: &str) {
        debug_assert!(!self.first && (pairs.is_empty() || pairs.starts_with(",\"")));
        self.out.push_str(pairs);
    }

    /// Ends the object: `{"k":"v",...}`, or `{}` without pairs.
    pub fn close(self) {
        self.out.push_str(if self.first { "{}" } else { "}" });
    }
}

thread_local! {
    /// The buffer of the last Attr dropped on this thread, for the next one: an Attr is made for
    /// every row of a CSV trace, and one allocation each (freed on the store thread) was a
    /// tenth of the consumer's time.
    static SPARE: Cell<String> = const { Cell::new(String::new()) };
}

/// Ordered key/value pairs (order is kept so output is stable and diffable), written as JSON as
/// they are added (`{"k":"v",...` without the closing brace; empty without pairs). Rows of a DB
/// trace have their pairs written straight into their batch ([`Pairs`]); an `Attr` holds them
/// where a row is made on its own (the start and stop rows, CSV, tests).
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
        Self { json }
    }

    /// A writer that adds pairs to this Attr.
    pub fn pairs(&mut self) -> Pairs<'_> {
        let first = self.json.is_empty();
        Pairs { out: &mut self.json, first }
    }

    pub fn with<'a>(mut self, key: &'static str, value: impl Into<Value<'a>>) -> Self {
        self.pairs().with(key, value);
        self
    }

    #[cfg(any(test, feature = "testing"))]
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
    #[cfg(any(test, feature = "testing"))]
    pub fn has(&self, key: &str) -> bool {
        let bytes = self.json.as_bytes();
        self.json.match_indices(key).any(|(i, _)| {
            let after = &bytes[i + key.len()..];
            i >= 2 && bytes[i - 1] == b'"' && matches!(bytes[i - 2], b'{' | b',') && after.starts_with(b"\":")
        })
    }

    /// The pairs, with their values unescaped.
    fn pairs_text(&self) -> Vec<(String, String)> {
        let inside = self.json.get(1..).unwrap_or_default();
        let object = format!("[{}]", inside.replace("\":\"", "\",\""));
        let flat: Vec<String> = serde_json::from_str(&object).expect("an Attr is JSON of strings");
        flat.chunks(2).map(|kv| (kv[0].clone(), kv[1].clone())).collect()
    }

    #[cfg(any(test, feature = "testing"))]
    pub fn get(&self, key: &str) -> Option<String> {
        self.pairs_text().into_iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// Appends `{"k":"v",...}` (no whitespace) to `out`.
    pub fn write_json(&self, out: &mut String) {
        if self.json.is_empty() {
            out.push_str("{}");
        } else {
            out.push_str(&self.json);
            out.push('}');
        }
    }

    #[cfg(any(test, feature = "testing"))]
    pub fn to_json(&self) -> String {
        let mut s = String::with_capacity(160);
        self.write_json(&mut s);
        s
    }

    /// Appends msMemScope's CSV form, `{k:v,...}`, values as-is (the CSV writer quotes the whole
    /// field), when every value reads back as itself in that form; otherwise the JSON form, which
    /// readers of the CSV (our `import` among them) also take. A value the job chose (an owner
    /// label `x,weight:1000`, one with brackets or quotes) would else add a key or break the
    /// row. (Taken from the JSON: CSV output is the rare case.)
    pub fn write_csv_form(&self, out: &mut String) {
        let pairs = self.pairs_text();
        if !pairs.iter().all(|(_, v)| bare_safe(v)) {
            self.write_json(out);
            return;
        }
        out.push('{');
        for (i, (k, v)) in pairs.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(k);
            out.push(':');
            out.push_str(v);
        }
        out.push('}');
    }

    #[cfg(any(test, feature = "testing"))]
    pub fn to_csv_form(&self) -> String {
        let mut s = String::new();
        self.write_csv_form(&mut s);
        s
    }
}

/// Whether `value` written bare in `{k:v,...}` reads back as itself: no separator, bracket or
/// quote the bare form's readers split or strip at, no surrounding space, no line break.
fn bare_safe(value: &str) -> bool {
    value.trim() == value && !value.contains([',', '{', '}', '[', ']', '(', ')', '"', '\'', '\n', '\r'])
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
    fn csv_form_reads_back_as_the_same_attr_whatever_the_job_named_its_owner() {
        // Read back by the import's own parser of msMemScope's CSV (import/attr.rs): the pairs
        // must be the ones written, no key added, no value cut.
        for owner in
            ["PTA@weight", "x,weight:1000", "a\"b\\c:d,\"x\":\"y", "l[0]}", " pad", "it's \"q\"", "aten::add", ""]
        {
            let a = Attr::new().with("size", 1_048_576u64).with("owner", owner);
            let (json, _) = crate::import::attr::to_json(&a.to_csv_form()).unwrap();
            let read = |j: &str| serde_json::from_str::<std::collections::BTreeMap<String, String>>(j).unwrap();
            assert_eq!(read(&json), read(&a.to_json()), "owner {owner:?} as {}", a.to_csv_form());
        }
        assert_eq!(
            Attr::new().with("owner", "PTA@kv").to_csv_form(),
            "{owner:PTA@kv}",
            "msMemScope's form when it can be"
        );
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

    /// Values around every power of ten and of two, and a spread between them.
    fn numbers() -> Vec<u64> {
        let mut v = vec![0, 1, 9, u64::MAX, u64::MAX - 1];
        for p in 1..20 {
            let ten = 10u64.pow(p);
            v.extend([ten - 1, ten, ten + 1]);
        }
        for p in 0..64 {
            v.extend([1 << p, (1 << p) - 1, (1u64 << p).wrapping_mul(0x9e37_79b9_7f4a_7c15)]);
        }
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..10_000 {
            // xorshift: numbers of every length, not only round ones.
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            v.extend([x, x >> (x % 64)]);
        }
        v
    }

    #[test]
    fn numbers_are_written_as_std_formats_them() {
        let mut s = String::from("x");
        for v in numbers() {
            s.truncate(1);
            push_u64(&mut s, v);
            assert_eq!(s, format!("x{v}"));
            s.truncate(1);
            push_addr(&mut s, v);
            assert_eq!(s, format!("x0x{v:016x}"));
        }
    }

    #[test]
    fn the_word_scan_finds_every_byte_that_needs_escaping() {
        // Each position of strings of every length up to 3 words, and bytes of every value.
        for len in 0..24 {
            for at in 0..len {
                for b in 0u8..=255 {
                    let mut bytes = vec![b'a'; len];
                    bytes[at] = b;
                    let Ok(s) = std::str::from_utf8(&bytes) else { continue };
                    // serde_json is the judge: what it writes back as is needs no escaping.
                    let plain = serde_json::to_string(s).unwrap() == format!("\"{s}\"");
                    assert_eq!(is_plain(s), plain, "{bytes:?}");
                }
            }
        }
        assert!(is_plain("CANN@APP") && is_plain("vllm@kv_cache/é") && is_plain(""));
        assert_eq!(Plain::checked("a\"b"), None);
        assert_eq!(Plain::checked("tab\t"), None);
        assert!(Plain::checked("halMemAlloc").is_some());
    }

    #[test]
    fn pairs_write_a_json_object_onto_the_end_of_a_text() {
        let mut text = String::from("before");
        Pairs::new(&mut text)
            .addr("addr", 0xabc)
            .with("size", 4096u64)
            .with_opt("none", None::<u64>)
            .with("owner", "q\"x\\y\n")
            .with("flag", Plain::new("true"))
            .with("status", -7i32)
            .with("a_key_longer_than_a_pair_has_room_for", 12_345_678_901u64)
            .close();
        let json = text.strip_prefix("before").unwrap();
        let v: serde_json::Value = serde_json::from_str(json).unwrap();
        let object = v.as_object().unwrap();
        assert_eq!(object.len(), 6);
        assert_eq!(v["a_key_longer_than_a_pair_has_room_for"], "12345678901");
        assert_eq!(v["addr"], "0x0000000000000abc");
        assert_eq!(v["size"], "4096");
        assert_eq!(v["owner"], "q\"x\\y\n");
        assert_eq!(v["flag"], "true");
        assert_eq!(v["status"], "-7");
        // Keys in the order they were added, compact (Insight's LIKE queries need both).
        let at = |k: &str| json.find(&format!("\"{k}\":")).unwrap();
        assert!(at("addr") < at("size") && at("size") < at("owner") && at("owner") < at("flag"));
        assert!(!json.contains(' ') && json.starts_with("{\"addr\":") && json.ends_with("\"12345678901\"}"));
        let mut empty = String::from("x");
        Pairs::new(&mut empty).close();
        assert_eq!(empty, "x{}");
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
