//! Ring-buffer bytes to typed records.
//!
//! Each record is checked against the size its header's kind promises before any field is read,
//! and read with `read_unaligned` (the ring only guarantees 8-byte alignment of the sample, and a
//! truncated or unknown record must be an error, never undefined behaviour).

use std::mem::size_of;

use memscope_common::record::{BlobRecord, CallRecord, ExitRecord, ForkRecord, RecordHeader, RecordKind, UsdtRecord};
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

/// A decoded record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    Call(RawCall),
    Usdt(RawUsdt),
    Blob(RawBlob),
    Fork { mono_ns: u64, parent: u32, child: u32 },
    Exit { mono_ns: u64, tgid: u32 },
}

fn read<T: Copy>(bytes: &[u8]) -> T {
    debug_assert!(bytes.len() >= size_of::<T>());
    // SAFETY: the length was checked by the caller; T is a plain-old-data repr(C) record.
    unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) }
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

/// Decodes one ring-buffer sample.
pub fn decode(bytes: &[u8]) -> Result<Record, DecodeError> {
    if bytes.len() < size_of::<RecordHeader>() {
        return Err(DecodeError::TooShortForHeader { len: bytes.len(), need: size_of::<RecordHeader>() });
    }
    let header: RecordHeader = read(bytes);
    let kind = RecordKind::from_u32(header.kind).ok_or(DecodeError::UnknownKind { kind: header.kind })?;
    match kind {
        RecordKind::Call => {
            need::<CallRecord>(kind, bytes)?;
            let r: CallRecord = read(bytes);
            let fields = std::array::from_fn(|i| (r.fields_ok & (1 << i) != 0).then_some(r.fields[i]));
            let text_len = r.text.iter().position(|b| *b == 0).unwrap_or(r.text.len());
            Ok(Record::Call(RawCall {
                spec_id: r.spec_id,
                tgid: r.hdr.tgid,
                tid: r.hdr.tid,
                entry_mono_ns: r.entry_ns,
                return_mono_ns: r.hdr.ts_ns,
                args: r.args,
                ret: r.ret,
                fields,
                outer_spec: (r.outer_spec != 0).then_some(r.outer_spec),
                cfg_device: non_negative(r.cfg_device),
                cfg_module: u16::try_from(r.cfg_module).ok(),
                thread_device: non_negative(r.thread_device),
                text: (text_len > 0).then(|| String::from_utf8_lossy(&r.text[..text_len]).into_owned()),
                blob: None,
            }))
        }
        RecordKind::Usdt => {
            need::<UsdtRecord>(kind, bytes)?;
            let r: UsdtRecord = read(bytes);
            let text_len = r.text.iter().position(|b| *b == 0).unwrap_or(r.text.len());
            Ok(Record::Usdt(RawUsdt {
                spec_id: r.spec_id,
                probe: r.probe,
                tgid: r.hdr.tgid,
                tid: r.hdr.tid,
                mono_ns: r.hdr.ts_ns,
                args: r.args,
                text: (text_len > 0).then(|| String::from_utf8_lossy(&r.text[..text_len]).into_owned()),
            }))
        }
        RecordKind::Blob => {
            need::<BlobRecord>(kind, bytes)?;
            let r: BlobRecord = read(bytes);
            let len = (r.len as usize).min(r.data.len());
            Ok(Record::Blob(RawBlob { spec_id: r.spec_id, tid: r.hdr.tid, data: r.data[..len].to_vec() }))
        }
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
    }
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
    use memscope_common::record::RecordHeader;

    use super::*;

    fn call() -> CallRecord {
        CallRecord {
            hdr: RecordHeader { kind: RecordKind::Call as u32, cpu: 1, ts_ns: 2_000, tgid: 42, tid: 43 },
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
            text: {
                let mut t = [0; memscope_common::record::TEXT_LEN];
                t[..10].copy_from_slice(b"ptaCaching");
                t
            },
        }
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
        assert_eq!(c.text.as_deref(), Some("ptaCaching"));
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
        let mut r = call();
        r.fields_ok = 0;
        r.text = [b'x'; memscope_common::record::TEXT_LEN];
        r.outer_spec = 5;
        let Record::Call(c) = decode(&encode(&r)).unwrap() else { panic!() };
        assert_eq!(c.result(), None);
        assert_eq!(
            c.text.as_deref().map(str::len),
            Some(memscope_common::record::TEXT_LEN),
            "an unterminated text stops at the buffer end"
        );
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
    }

    #[test]
    fn usdt_record_keeps_args_and_bounded_text() {
        let mut r = UsdtRecord {
            hdr: RecordHeader { kind: RecordKind::Usdt as u32, cpu: 0, ts_ns: 9, tgid: 7, tid: 8 },
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
        let fork = ForkRecord {
            hdr: RecordHeader { kind: RecordKind::Fork as u32, cpu: 0, ts_ns: 5, tgid: 10, tid: 10 },
            child: 11,
            _reserved: 0,
        };
        assert_eq!(decode(&encode(&fork)), Ok(Record::Fork { mono_ns: 5, parent: 10, child: 11 }));
        let exit = ExitRecord {
            hdr: RecordHeader { kind: RecordKind::Exit as u32, cpu: 0, ts_ns: 6, tgid: 10, tid: 10 },
            group_dead: 1,
            _reserved: 0,
        };
        assert_eq!(decode(&encode(&exit)), Ok(Record::Exit { mono_ns: 6, tgid: 10 }));
    }
}
