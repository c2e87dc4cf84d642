//! Ring-buffer bytes to typed records.
//!
//! Each record is checked against the size its header's kind promises before any field is read
//! (a truncated or unknown record must be an error, never undefined behaviour), then read in place
//! where it is aligned for its type (ring samples are 8-byte aligned) and from an unaligned copy
//! otherwise. Calls, almost every record, go straight to a [`RawCall`] ([`decode_call`]).

use std::mem::{align_of, size_of};

use memscope_common::record::{
    BlobRecord, CallRecord, CallTextRecord, ExitRecord, ForkRecord, RecordHeader, RecordKind, UsdtRecord,
    MAX_STACK_DEPTH, MAX_STACK_WINDOW, NO_MODULE, STACK_HEADER_LEN, WINDOW_HEADER_LEN,
};
use memscope_common::spec::MAX_FIELDS;
use memscope_common::usdt::USDT_MAX_ARGS;
use thiserror::Error;

/// A record that could not be decoded. The consumer counts these and keeps going.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum DecodeError {
    /// Fewer bytes than a header.
    #[error("record of {len} bytes is shorter than its {need}-byte header")]
    TooShortForHeader { len: usize, need: usize },
    /// A kind this build does not know (a newer eBPF object with an older userspace?).
    #[error("record kind {kind} is unknown to this build")]
    UnknownKind { kind: u32 },
    /// A record read in place only (its own function), never copied into a [`Record`].
    #[error("{kind:?} records are read in place")]
    ReadInPlace { kind: RecordKind },
    /// The header's kind needs more bytes than the record has.
    #[error("{kind:?} record has {len} bytes, needs {need}")]
    Truncated { kind: RecordKind, len: usize, need: usize },
}

/// One traced call as the kernel captured it, with `Option`s where the kernel marked a value as
/// absent. Times are still CLOCK_MONOTONIC here; the model converts them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawCall {
    pub spec_id: u32,
    pub tgid: u32,
    pub tid: u32,
    pub entry_mono_ns: u64,
    pub return_mono_ns: u64,
    pub args: [u64; 6],
    pub ret: u64,
    /// The spec's field reads, `None` where the spec has none or the read failed.
    pub fields: [Option<u64>; MAX_FIELDS],
    /// The spec id of the call this one ran inside of (the spec's outer layer), if any.
    pub outer_spec: Option<u32>,
    pub cfg_device: Option<u32>,
    pub cfg_module: Option<u16>,
    pub thread_device: Option<u32>,
    /// The spec's text argument, if it has one.
    pub text: Option<String>,
    /// The buffer argument copied at entry (its [`BlobRecord`] preceded this record on the
    /// thread), when the spec has one.
    pub blob: Option<Vec<u8>>,
    /// Sampling's points in the call's requested bytes (`CallRecord::points`): 0, recorded in
    /// full; else its weight is that many sampling intervals.
    pub points: u8,
}

impl RawCall {
    /// The status the API returned (`aclError`: 0 is success). The register is 64 bits wide but
    /// the C type is `int`, so only the low half is meaningful.
    pub fn status(&self) -> i32 {
        self.ret as u32 as i32
    }

    /// Field `i`, if it was read.
    pub fn field(&self, i: usize) -> Option<u64> {
        self.fields.get(i).copied().flatten()
    }

    /// Field 0 (the out-pointer's value) when the call succeeded: on failure the callee writes
    /// nothing, so whatever the caller left there is not a result.
    pub fn result(&self) -> Option<u64> {
        if self.status() == 0 {
            self.field(0)
        } else {
            None
        }
    }
}

/// A USDT probe hit, as the kernel captured it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawUsdt {
    pub spec_id: u32,
    /// What the probe means (the id userspace gave its spec).
    pub probe: u32,
    pub tgid: u32,
    pub tid: u32,
    pub mono_ns: u64,
    pub args: [u64; USDT_MAX_ARGS],
    /// The probe's string argument; `None` when it has none or it could not be read.
    pub text: Option<String>,
}

/// A call's buffer argument, copied at its entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawBlob {
    pub spec_id: u32,
    pub tid: u32,
    pub data: Vec<u8>,
}

/// A thread's user stack at the entry of its outermost traced call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawStack {
    pub tgid: u32,
    pub tid: u32,
    /// The outermost call's entry time, equal to its record's `entry_mono_ns`.
    pub entry_mono_ns: u64,
    pub return_address: u64,
    /// `memscope_common::record::STACK_*` bits.
    pub flags: u32,
    pub ips: Vec<u64>,
}

/// A thread's Python frames (code object, instruction pointer) at the entry of its outermost
/// traced call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawPyStack {
    pub tgid: u32,
    pub tid: u32,
    pub entry_mono_ns: u64,
    /// `memscope_common::python::PY_*` bits.
    pub flags: u32,
    /// Innermost first.
    pub frames: Vec<(u64, u64)>,
}

/// A decoded record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    PyStack(RawPyStack),
    /// A sample of a thread's Python frames (`trace --python-trace`): the same layout, its time
    /// the sample's.
    PySample(RawPyStack),
    Call(RawCall),
    Usdt(RawUsdt),
    Blob(RawBlob),
    Stack(RawStack),
    Fork {
        mono_ns: u64,
        parent: u32,
        child: u32,
    },
    Exit {
        mono_ns: u64,
        tgid: u32,
    },
    Exec {
        mono_ns: u64,
        tgid: u32,
    },
    Loaded {
        mono_ns: u64,
        tgid: u32,
    },
}

/// A ring record type for which any bytes of its size are a value.
///
/// # Safety
/// Only for `repr(C)` types whose fields are integers and arrays of integers.
unsafe trait Plain: Copy {}

// SAFETY: each is `repr(C)` with integer and integer-array fields only (memscope-common/src/record.rs).
unsafe impl Plain for CallRecord {}
// SAFETY: as above.
unsafe impl Plain for CallTextRecord {}

// The stack record's fields, read by offset (its length varies, so it is never read whole).
const _: () = {
    use memscope_common::record::StackRecord;
    assert!(std::mem::offset_of!(StackRecord, return_address) == 24);
    assert!(std::mem::offset_of!(StackRecord, flags) == 32);
    assert!(std::mem::offset_of!(StackRecord, frames) == 36);
    assert!(std::mem::offset_of!(StackRecord, ips) == STACK_HEADER_LEN);
    use memscope_common::record::StackWindowRecord as W;
    assert!(std::mem::offset_of!(W, ip) == 24 && std::mem::offset_of!(W, sp) == 32);
    assert!(std::mem::offset_of!(W, fp) == 40 && std::mem::offset_of!(W, lr) == 48);
    assert!(std::mem::offset_of!(W, len) == 56 && std::mem::offset_of!(W, flags) == 60);
    assert!(std::mem::offset_of!(W, data) == WINDOW_HEADER_LEN);
};
// SAFETY: as above.
unsafe impl Plain for UsdtRecord {}
// SAFETY: as above.
unsafe impl Plain for BlobRecord {}
// SAFETY: as above.
unsafe impl Plain for ForkRecord {}
// SAFETY: as above.
unsafe impl Plain for ExitRecord {}

/// Every caller has checked the length already ([`need`]); the check here keeps the unsafe read
/// sound on its own, at the cost of a branch the CPU always predicts.
fn check_len<T>(bytes: &[u8]) {
    assert!(bytes.len() >= size_of::<T>(), "a record of {} bytes read as {} bytes", bytes.len(), size_of::<T>());
}

fn read<T: Plain>(bytes: &[u8]) -> T {
    check_len::<T>(bytes);
    // SAFETY: `bytes` holds at least a T, and any bytes are a T ([`Plain`]).
    unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) }
}

/// Runs `f` on the record at the start of `bytes`, in place when it is aligned for `T` (ring
/// samples are 8-byte aligned, as are the replay's), else on a copy: the consumer reads a few
/// fields of each record and has no use for a copy of all of it.
#[inline]
fn view<T: Plain, R>(bytes: &[u8], f: impl FnOnce(&T) -> R) -> R {
    check_len::<T>(bytes);
    let at = bytes.as_ptr();
    if at.align_offset(align_of::<T>()) == 0 {
        // SAFETY: aligned, long enough (checked above), and any bytes are a T ([`Plain`]); the
        // ring does not change a sample until it is released, after this call.
        f(unsafe { &*at.cast::<T>() })
    } else {
        f(&read(bytes))
    }
}

fn need<T>(kind: RecordKind, bytes: &[u8]) -> Result<(), DecodeError> {
    if bytes.len() < size_of::<T>() {
        return Err(DecodeError::Truncated { kind, len: bytes.len(), need: size_of::<T>() });
    }
    Ok(())
}

fn non_negative(v: i32) -> Option<u32> {
    u32::try_from(v).ok()
}

/// A NUL-terminated (or buffer-long) text field; `None` when empty.
fn text(bytes: &[u8]) -> Option<String> {
    let len = bytes.iter().position(|b| *b == 0).unwrap_or(bytes.len());
    (len > 0).then(|| String::from_utf8_lossy(&bytes[..len]).into_owned())
}

/// The record's kind, from its header.
#[inline]
pub fn kind(bytes: &[u8]) -> Result<RecordKind, DecodeError> {
    if bytes.len() < size_of::<RecordHeader>() {
        return Err(DecodeError::TooShortForHeader { len: bytes.len(), need: size_of::<RecordHeader>() });
    }
    // The kind is the header's first field.
    let id = u32::from_ne_bytes(bytes[..4].try_into().expect("checked length"));
    RecordKind::from_u32(id).ok_or(DecodeError::UnknownKind { kind: id })
}

#[inline(always)]
fn call(r: &CallRecord, text: Option<String>) -> RawCall {
    RawCall {
        spec_id: u32::from(r.spec_id),
        tgid: r.hdr.tgid,
        tid: r.hdr.tid,
        entry_mono_ns: r.entry_ns,
        return_mono_ns: r.hdr.ts_ns,
        args: r.args,
        ret: r.ret,
        fields: std::array::from_fn(|i| (r.fields_ok & (1 << i) != 0).then_some(r.fields[i])),
        outer_spec: (r.outer_spec != 0).then_some(u32::from(r.outer_spec)),
        cfg_device: non_negative(r.cfg_device),
        cfg_module: (r.cfg_module != NO_MODULE).then_some(r.cfg_module),
        thread_device: non_negative(r.thread_device),
        text,
        blob: None,
        points: r.points,
    }
}

/// Decodes a call record, with or without its text ([`RecordKind::Call`] or
/// [`RecordKind::CallText`]), without the detour through [`Record`]: calls are almost every
/// record.
#[inline(always)]
pub fn decode_call(kind: RecordKind, bytes: &[u8]) -> Result<RawCall, DecodeError> {
    match kind {
        RecordKind::Call => {
            need::<CallRecord>(kind, bytes)?;
            Ok(view(bytes, |r: &CallRecord| call(r, None)))
        }
        _ => {
            need::<CallTextRecord>(kind, bytes)?;
            Ok(view(bytes, |r: &CallTextRecord| call(&r.call, text(&r.text))))
        }
    }
}

/// Decodes one ring-buffer sample.
pub fn decode(bytes: &[u8]) -> Result<Record, DecodeError> {
    let kind = kind(bytes)?;
    match kind {
        RecordKind::Call | RecordKind::CallText => decode_call(kind, bytes).map(Record::Call),
        RecordKind::Usdt => {
            need::<UsdtRecord>(kind, bytes)?;
            Ok(view(bytes, |r: &UsdtRecord| {
                Record::Usdt(RawUsdt {
                    spec_id: r.spec_id,
                    probe: r.probe,
                    tgid: r.hdr.tgid,
                    tid: r.hdr.tid,
                    mono_ns: r.hdr.ts_ns,
                    args: r.args,
                    text: text(&r.text),
                })
            }))
        }
        RecordKind::Blob => {
            need::<BlobRecord>(kind, bytes)?;
            Ok(view(bytes, |r: &BlobRecord| {
                let len = (r.len as usize).min(r.data.len());
                Record::Blob(RawBlob { spec_id: r.spec_id, tid: r.hdr.tid, data: r.data[..len].to_vec() })
            }))
        }
        RecordKind::Stack => stack(bytes).map(Record::Stack),
        RecordKind::PyStack => py_stack(bytes).map(Record::PyStack),
        RecordKind::PySample => py_stack(bytes).map(Record::PySample),
        // Read in place by the consumer ([`stack_window`]): only its unwound frames are kept.
        RecordKind::StackWindow => Err(DecodeError::ReadInPlace { kind }),
        RecordKind::Fork => {
            need::<ForkRecord>(kind, bytes)?;
            let r: ForkRecord = read(bytes);
            Ok(Record::Fork { mono_ns: r.hdr.ts_ns, parent: r.hdr.tgid, child: r.child })
        }
        RecordKind::Exit => {
            need::<ExitRecord>(kind, bytes)?;
            let r: ExitRecord = read(bytes);
            Ok(Record::Exit { mono_ns: r.hdr.ts_ns, tgid: r.hdr.tgid })
        }
        RecordKind::Exec => {
            need::<ExitRecord>(kind, bytes)?;
            let r: ExitRecord = read(bytes);
            Ok(Record::Exec { mono_ns: r.hdr.ts_ns, tgid: r.hdr.tgid })
        }
        RecordKind::Loaded => {
            need::<ExitRecord>(kind, bytes)?;
            let r: ExitRecord = read(bytes);
            Ok(Record::Loaded { mono_ns: r.hdr.ts_ns, tgid: r.hdr.tgid })
        }
    }
}

/// The `u64` at `at` of a record whose length was checked to hold it.
fn word_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_ne_bytes(bytes[at..at + 8].try_into().expect("checked length"))
}

/// The `u32` at `at`, as [`word_at`].
fn half_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes(bytes[at..at + 4].try_into().expect("checked length"))
}

/// A Python stack record: its fixed part, then the frames it says it holds.
fn py_stack(bytes: &[u8]) -> Result<RawPyStack, DecodeError> {
    use memscope_common::python::{MAX_PY_FRAMES, PY_STACK_HEADER_LEN};
    let kind = RecordKind::PyStack;
    if bytes.len() < PY_STACK_HEADER_LEN {
        return Err(DecodeError::Truncated { kind, len: bytes.len(), need: PY_STACK_HEADER_LEN });
    }
    let (word, half) = (|at| word_at(bytes, at), |at| half_at(bytes, at));
    let n = (half(28) as usize).min(MAX_PY_FRAMES);
    let need = PY_STACK_HEADER_LEN + 16 * n;
    if bytes.len() < need {
        return Err(DecodeError::Truncated { kind, len: bytes.len(), need });
    }
    Ok(RawPyStack {
        tgid: half(16),
        tid: half(20),
        entry_mono_ns: word(8),
        flags: half(24),
        frames: (0..n).map(|i| (word(PY_STACK_HEADER_LEN + 16 * i), word(PY_STACK_HEADER_LEN + 16 * i + 8))).collect(),
    })
}

/// A stack record: its fixed part, then as many frames as it says (the BPF side sends only
/// those), each checked to be there.
fn stack(bytes: &[u8]) -> Result<RawStack, DecodeError> {
    let kind = RecordKind::Stack;
    if bytes.len() < STACK_HEADER_LEN {
        return Err(DecodeError::Truncated { kind, len: bytes.len(), need: STACK_HEADER_LEN });
    }
    let (word, half) = (|at| word_at(bytes, at), |at| half_at(bytes, at));
    let frames = (half(36) as usize).min(MAX_STACK_DEPTH);
    let need = STACK_HEADER_LEN + 8 * frames;
    if bytes.len() < need {
        return Err(DecodeError::Truncated { kind, len: bytes.len(), need });
    }
    Ok(RawStack {
        tgid: half(16),
        tid: half(20),
        entry_mono_ns: word(8),
        return_address: word(24),
        flags: half(32),
        ips: bytes[STACK_HEADER_LEN..need]
            .chunks_exact(8)
            .map(|w| u64::from_ne_bytes(w.try_into().expect("8 bytes")))
            .collect(),
    })
}

/// A stack window record, read in place: the unwinder reads the copied stack straight from the
/// ring's bytes, with no copy in between.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StackWindowView<'a> {
    pub tgid: u32,
    pub tid: u32,
    pub entry_mono_ns: u64,
    pub ip: u64,
    pub sp: u64,
    pub fp: u64,
    pub lr: u64,
    /// `memscope_common::record::WINDOW_*` bits.
    pub flags: u32,
    pub data: &'a [u8],
}

/// Reads a [`RecordKind::StackWindow`] record: its fixed part, then the bytes it says it holds.
pub fn stack_window(bytes: &[u8]) -> Result<StackWindowView<'_>, DecodeError> {
    let kind = RecordKind::StackWindow;
    if bytes.len() < WINDOW_HEADER_LEN {
        return Err(DecodeError::Truncated { kind, len: bytes.len(), need: WINDOW_HEADER_LEN });
    }
    let (word, half) = (|at| word_at(bytes, at), |at| half_at(bytes, at));
    let len = (half(56) as usize).min(MAX_STACK_WINDOW);
    let need = WINDOW_HEADER_LEN + len;
    if bytes.len() < need {
        return Err(DecodeError::Truncated { kind, len: bytes.len(), need });
    }
    Ok(StackWindowView {
        tgid: half(16),
        tid: half(20),
        entry_mono_ns: word(8),
        ip: word(24),
        sp: word(32),
        fp: word(40),
        lr: word(48),
        flags: half(60),
        data: &bytes[WINDOW_HEADER_LEN..need],
    })
}

/// The raw bytes of a record, as the BPF side writes them (tests, and the consumer benchmark).
pub fn as_bytes<T: Copy>(record: &T) -> &[u8] {
    // SAFETY: T is a padding-free repr(C) record (sizes are asserted in memscope-common).
    unsafe { std::slice::from_raw_parts((record as *const T).cast::<u8>(), size_of::<T>()) }
}

#[cfg(test)]
pub fn encode<T: Copy>(record: &T) -> Vec<u8> {
    as_bytes(record).to_vec()
}

#[cfg(test)]
mod tests {
    use memscope_common::record::{RecordHeader, TEXT_LEN};

    use super::*;

    #[test]
    #[should_panic(expected = "read as")]
    fn a_record_too_short_for_its_type_is_refused_not_read_past() {
        let bytes = [0u8; 16];
        let _: ForkRecord = read(&bytes);
    }

    fn call() -> CallRecord {
        CallRecord {
            hdr: RecordHeader::new(RecordKind::Call, 2_000, 42, 43),
            spec_id: 3,
            thread_device: 1,
            entry_ns: 1_000,
            args: [0x7fff_0000, 4096, 2, 0, 0, 0],
            ret: 0,
            fields: [0xdead_beef_0000, 0, 0, 77],
            fields_ok: 0b1001,
            outer_spec: 0,
            cfg_device: -1,
            cfg_module: 7,
            points: 0,
        }
    }

    fn with_text(text: &[u8]) -> CallTextRecord {
        let mut r = CallTextRecord { call: call(), text: [0; TEXT_LEN] };
        r.call.hdr.kind = RecordKind::CallText as u32;
        r.text[..text.len()].copy_from_slice(text);
        r
    }

    #[test]
    fn call_round_trips_with_absent_values_as_none() {
        let Record::Call(c) = decode(&encode(&call())).unwrap() else { panic!("not a call") };
        assert_eq!((c.tgid, c.tid), (42, 43));
        assert_eq!((c.entry_mono_ns, c.return_mono_ns), (1_000, 2_000));
        assert_eq!(c.args[1], 4096);
        assert_eq!(c.fields, [Some(0xdead_beef_0000), None, None, Some(77)], "only fields with their ok bit");
        assert_eq!(c.result(), Some(0xdead_beef_0000));
        assert_eq!(c.outer_spec, None, "0 means not nested");
        assert_eq!(c.cfg_device, None, "-1 means absent");
        assert_eq!(c.cfg_module, Some(7));
        assert_eq!(c.thread_device, Some(1));
        assert_eq!(c.text, None, "a plain call record has no text");
    }

    #[test]
    fn absent_module_and_wide_ids_decode() {
        let mut r = call();
        r.cfg_module = NO_MODULE;
        r.cfg_device = 2;
        r.spec_id = 255;
        r.outer_spec = 254;
        let Record::Call(c) = decode(&encode(&r)).unwrap() else { panic!() };
        assert_eq!((c.cfg_module, c.cfg_device), (None, Some(2)));
        assert_eq!((c.spec_id, c.outer_spec), (255, Some(254)));
    }

    #[test]
    fn text_record_is_the_call_and_its_text() {
        let Record::Call(c) = decode(&encode(&with_text(b"ptaCaching"))).unwrap() else { panic!("not a call") };
        assert_eq!(c.text.as_deref(), Some("ptaCaching"));
        assert_eq!((c.spec_id, c.tgid, c.tid, c.args[1]), (3, 42, 43, 4096), "the call part as in a plain record");
        assert_eq!(c.fields, [Some(0xdead_beef_0000), None, None, Some(77)]);
        let Record::Call(c) = decode(&encode(&with_text(b""))).unwrap() else { panic!() };
        assert_eq!(c.text, None, "an unreadable string is no text");
    }

    #[test]
    fn records_decode_in_place_and_from_unaligned_bytes_alike() {
        let bytes = encode(&with_text(b"kv"));
        let mut shifted = vec![0u8; bytes.len() + 1];
        shifted[1..].copy_from_slice(&bytes);
        assert_eq!(decode(&shifted[1..]), decode(&bytes));
        let bytes = encode(&call());
        let mut shifted = vec![0u8; bytes.len() + 3];
        shifted[3..].copy_from_slice(&bytes);
        assert_eq!(decode(&shifted[3..]), decode(&bytes));
    }

    #[test]
    fn failed_call_has_no_result_even_if_out_was_read() {
        let mut r = call();
        // 207001 = ACL_ERROR_RT_MEMORY_ALLOCATION, with garbage in the upper half of rax.
        r.ret = 0xffff_ffff_0000_0000 | 207_001;
        let Record::Call(c) = decode(&encode(&r)).unwrap() else { panic!() };
        assert_eq!(c.status(), 207_001);
        assert_eq!(c.result(), None);
    }

    #[test]
    fn status_uses_the_low_32_bits() {
        let mut r = call();
        r.ret = 0xabcd_0000_0000_0000;
        let Record::Call(c) = decode(&encode(&r)).unwrap() else { panic!() };
        assert_eq!(c.status(), 0);
    }

    #[test]
    fn unread_out_pointer_is_none_and_text_is_bounded() {
        let mut r = with_text(&[b'x'; TEXT_LEN]);
        r.call.fields_ok = 0;
        r.call.outer_spec = 5;
        let Record::Call(c) = decode(&encode(&r)).unwrap() else { panic!() };
        assert_eq!(c.result(), None);
        assert_eq!(c.text.as_deref().map(str::len), Some(TEXT_LEN), "an unterminated text stops at the buffer end");
        assert_eq!(c.outer_spec, Some(5));
    }

    #[test]
    fn truncated_and_unknown_records_are_errors() {
        let bytes = encode(&call());
        assert_eq!(
            decode(&bytes[..bytes.len() - 1]),
            Err(DecodeError::Truncated { kind: RecordKind::Call, len: bytes.len() - 1, need: bytes.len() })
        );
        assert!(matches!(decode(&bytes[..10]), Err(DecodeError::TooShortForHeader { len: 10, .. })));
        let mut unknown = call();
        unknown.hdr.kind = 99;
        assert_eq!(decode(&encode(&unknown)), Err(DecodeError::UnknownKind { kind: 99 }));
        // A text record cut after its call part is truncated, not a call without text.
        let mut cut = call();
        cut.hdr.kind = RecordKind::CallText as u32;
        assert_eq!(
            decode(&encode(&cut)),
            Err(DecodeError::Truncated {
                kind: RecordKind::CallText,
                len: bytes.len(),
                need: size_of::<CallTextRecord>()
            })
        );
    }

    #[test]
    fn usdt_record_keeps_args_and_bounded_text() {
        let mut r = UsdtRecord {
            hdr: RecordHeader::new(RecordKind::Usdt, 9, 7, 8),
            spec_id: 2,
            probe: 3,
            args: [5, u64::MAX, 0, 0, 0, 0],
            text: [0; memscope_common::usdt::USDT_TEXT_LEN],
        };
        r.text[..5].copy_from_slice(b"kv\xffab");
        let Record::Usdt(u) = decode(&encode(&r)).unwrap() else { panic!("not usdt") };
        assert_eq!((u.spec_id, u.probe, u.tgid, u.tid, u.mono_ns), (2, 3, 7, 8, 9));
        assert_eq!(u.args[1], u64::MAX);
        assert_eq!(u.text.as_deref(), Some("kv\u{fffd}ab"), "invalid UTF-8 is replaced, not an error");
        r.text = [0; memscope_common::usdt::USDT_TEXT_LEN];
        let Record::Usdt(u) = decode(&encode(&r)).unwrap() else { panic!() };
        assert_eq!(u.text, None);
        let bytes = encode(&r);
        assert!(matches!(decode(&bytes[..bytes.len() - 1]), Err(DecodeError::Truncated { .. })));
    }

    #[test]
    fn fork_and_exit_decode() {
        let fork = ForkRecord { hdr: RecordHeader::new(RecordKind::Fork, 5, 10, 10), child: 11, _reserved: 0 };
        assert_eq!(decode(&encode(&fork)), Ok(Record::Fork { mono_ns: 5, parent: 10, child: 11 }));
        let exit = ExitRecord { hdr: RecordHeader::new(RecordKind::Exit, 6, 10, 10) };
        assert_eq!(decode(&encode(&exit)), Ok(Record::Exit { mono_ns: 6, tgid: 10 }));
        let exec = ExitRecord { hdr: RecordHeader::new(RecordKind::Exec, 7, 11, 11) };
        assert_eq!(decode(&encode(&exec)), Ok(Record::Exec { mono_ns: 7, tgid: 11 }));
        let loaded = ExitRecord { hdr: RecordHeader::new(RecordKind::Loaded, 8, 12, 13) };
        assert_eq!(decode(&encode(&loaded)), Ok(Record::Loaded { mono_ns: 8, tgid: 12 }));
    }

    fn stack_bytes(frames: u32, ips: &[u64]) -> Vec<u8> {
        let mut b = encode(&RecordHeader::new(RecordKind::Stack, 500, 7, 8));
        b.extend_from_slice(&0x4444u64.to_ne_bytes());
        b.extend_from_slice(&1u32.to_ne_bytes());
        b.extend_from_slice(&frames.to_ne_bytes());
        for ip in ips {
            b.extend_from_slice(&ip.to_ne_bytes());
        }
        b
    }

    #[test]
    fn a_stack_record_carries_only_the_frames_it_says_and_a_short_one_is_refused() {
        let Ok(Record::Stack(s)) = decode(&stack_bytes(2, &[0x10, 0x20])) else { panic!() };
        assert_eq!((s.tgid, s.tid, s.entry_mono_ns, s.return_address, s.flags), (7, 8, 500, 0x4444, 1));
        assert_eq!(s.ips, [0x10, 0x20]);
        assert_eq!(
            decode(&stack_bytes(3, &[0x10, 0x20])),
            Err(DecodeError::Truncated {
                kind: RecordKind::Stack,
                len: STACK_HEADER_LEN + 16,
                need: STACK_HEADER_LEN + 24
            })
        );
    }
}
