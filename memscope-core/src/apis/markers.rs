//! The USDT probes of our markers package (`markers/`, Python `import memscope`): provider
//! `memscope`, one probe per marker, each with a fixed argument order. This table is the contract
//! with the package's C extension; the tracer attaches every call site of these probes in any
//! library that carries them, and decodes a hit into a model [`Marker`].
//!
//! Ids are never reused or renumbered: a tracer and a markers build of different versions then
//! still agree on every probe both know, and a probe only one side knows is simply not attached
//! (its semaphore stays 0, so the package does not even build its arguments).

use super::op::Marker;
use crate::raw::RawUsdt;

/// The provider name in the notes.
pub const PROVIDER: &str = "memscope";

/// A probe's meaning; the value travels as the spec's `probe` id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum MarkerProbe {
    TagPush = 1,
    TagPop = 2,
    AddrTag = 3,
    Step = 4,
    Mark = 5,
    RangeStart = 6,
    RangeEnd = 7,
    Collect = 8,
    OpStart = 9,
    OpEnd = 10,
    TensorAccess = 11,
}

/// One probe of the contract.
#[derive(Debug)]
pub struct MarkerDef {
    pub probe: MarkerProbe,
    pub name: &'static str,
    /// Arguments the package passes (a note with another count is rejected: it is not ours).
    pub args: usize,
    /// The argument that is a C string, if any.
    pub text_arg: Option<usize>,
}

const fn def(probe: MarkerProbe, name: &'static str, args: usize, text_arg: Option<usize>) -> MarkerDef {
    MarkerDef { probe, name, args, text_arg }
}

pub static PROBES: [MarkerDef; 11] = [
    def(MarkerProbe::TagPush, "tag_push", 2, Some(1)),
    def(MarkerProbe::TagPop, "tag_pop", 2, Some(1)),
    def(MarkerProbe::AddrTag, "addr_tag", 3, Some(2)),
    def(MarkerProbe::Step, "step", 1, None),
    def(MarkerProbe::Mark, "mark", 1, Some(0)),
    def(MarkerProbe::RangeStart, "range_start", 2, Some(1)),
    def(MarkerProbe::RangeEnd, "range_end", 1, None),
    def(MarkerProbe::Collect, "collect", 1, None),
    def(MarkerProbe::OpStart, "op_start", 1, Some(0)),
    def(MarkerProbe::OpEnd, "op_end", 1, Some(0)),
    // ptr, nbytes, kind (0 read, 1 write), desc ("float32[4,8]")
    def(MarkerProbe::TensorAccess, "tensor_access", 4, Some(3)),
];

/// The definition of a probe named in a note, if it is ours.
pub fn find(provider: &str, name: &str) -> Option<&'static MarkerDef> {
    (provider == PROVIDER).then(|| PROBES.iter().find(|d| d.name == name)).flatten()
}

/// An owner level as the package sends it (0..=7); anything else is clamped to the last user
/// level, so a buggy caller's label still lands somewhere visible.
fn level(raw: u64) -> u8 {
    u8::try_from(raw).map_or(super::op::level::USER_DEFINED_3, |l| l.min(super::op::level::USER_DEFINED_3))
}

/// A probe hit as a marker; `None` for a probe id this build does not know, or a tag without
/// its label (unreadable string: nothing to attribute).
pub fn decode(raw: &RawUsdt) -> Option<Marker> {
    let text = || raw.text.clone();
    let a = raw.args;
    Some(match PROBES.iter().find(|d| d.probe as u32 == raw.probe)?.probe {
        MarkerProbe::TagPush => Marker::TagPush { level: level(a[0]), label: text()? },
        MarkerProbe::TagPop => Marker::TagPop { level: level(a[0]), label: text()? },
        MarkerProbe::AddrTag => Marker::AddrTag { addr: a[0], level: level(a[1]), label: text()? },
        MarkerProbe::Step => Marker::Step { number: Some(a[0]) },
        MarkerProbe::Mark => Marker::Mark { message: text().unwrap_or_default() },
        MarkerProbe::RangeStart => Marker::RangeStart { id: a[0], message: text().unwrap_or_default() },
        MarkerProbe::RangeEnd => Marker::RangeEnd { id: a[0] },
        MarkerProbe::Collect => Marker::Collect { on: a[0] != 0 },
        // An unreadable name still opens and closes an operator: the sequence stays balanced.
        MarkerProbe::OpStart => Marker::OpStart { name: text().unwrap_or_default() },
        MarkerProbe::OpEnd => Marker::OpEnd { name: text().unwrap_or_default() },
        MarkerProbe::TensorAccess => Marker::TensorAccess { ptr: a[0], size: a[1], write: a[2] != 0, desc: text() },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(probe: MarkerProbe, args: [u64; 6], text: Option<&str>) -> RawUsdt {
        RawUsdt { spec_id: 0, probe: probe as u32, tgid: 1, tid: 2, mono_ns: 3, args, text: text.map(str::to_owned) }
    }

    #[test]
    fn probes_decode_in_the_package_argument_order() {
        let push = decode(&raw(MarkerProbe::TagPush, [2, 0x7f00, 0, 0, 0, 0], Some("vllm"))).unwrap();
        assert_eq!(push, Marker::TagPush { level: 2, label: "vllm".into() });
        let tag = decode(&raw(MarkerProbe::AddrTag, [0xabc0, 3, 0x7f00, 0, 0, 0], Some("kv_cache"))).unwrap();
        assert_eq!(tag, Marker::AddrTag { addr: 0xabc0, level: 3, label: "kv_cache".into() });
        assert_eq!(decode(&raw(MarkerProbe::Step, [7, 0, 0, 0, 0, 0], None)), Some(Marker::Step { number: Some(7) }));
        assert_eq!(decode(&raw(MarkerProbe::Collect, [0; 6], None)), Some(Marker::Collect { on: false }));
        assert_eq!(decode(&raw(MarkerProbe::RangeEnd, [9, 0, 0, 0, 0, 0], None)), Some(Marker::RangeEnd { id: 9 }));
    }

    #[test]
    fn operator_probes_decode_name_and_tensor_in_the_package_argument_order() {
        let start = decode(&raw(MarkerProbe::OpStart, [0x7f00, 0, 0, 0, 0, 0], Some("aten.mm.default"))).unwrap();
        assert_eq!(start, Marker::OpStart { name: "aten.mm.default".into() });
        assert_eq!(decode(&raw(MarkerProbe::OpEnd, [0; 6], None)), Some(Marker::OpEnd { name: String::new() }));
        let read = decode(&raw(MarkerProbe::TensorAccess, [0xa000, 128, 0, 0x7f00, 0, 0], Some("float32[4,8]")));
        assert_eq!(
            read,
            Some(Marker::TensorAccess { ptr: 0xa000, size: 128, write: false, desc: Some("float32[4,8]".into()) })
        );
        let write = decode(&raw(MarkerProbe::TensorAccess, [0xb000, 16, 1, 0, 0, 0], None)).unwrap();
        assert_eq!(write, Marker::TensorAccess { ptr: 0xb000, size: 16, write: true, desc: None });
        let def = find("memscope", "tensor_access").unwrap();
        assert_eq!((def.probe as u32, def.args, def.text_arg), (11, 4, Some(3)));
        assert_eq!(PROBES.iter().map(|d| d.probe as u32).collect::<Vec<_>>(), (1..=11).collect::<Vec<_>>());
    }

    #[test]
    fn tags_without_label_and_unknown_probes_are_dropped() {
        assert_eq!(decode(&raw(MarkerProbe::TagPush, [5, 0, 0, 0, 0, 0], None)), None);
        let mut unknown = raw(MarkerProbe::Step, [0; 6], None);
        unknown.probe = 99;
        assert_eq!(decode(&unknown), None);
        let wild = decode(&raw(MarkerProbe::TagPush, [u64::MAX, 0, 0, 0, 0, 0], Some("x"))).unwrap();
        assert_eq!(wild, Marker::TagPush { level: 7, label: "x".into() }, "out-of-range levels are clamped");
    }

    #[test]
    fn only_our_provider_and_names_match() {
        assert_eq!(find("memscope", "tag_push").map(|d| d.probe), Some(MarkerProbe::TagPush));
        assert!(find("pytorch", "tag_push").is_none());
        assert!(find("memscope", "malloc").is_none());
    }
}
