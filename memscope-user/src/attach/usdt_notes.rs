//! Reading the USDT probe sites of an ELF file from its `.note.stapsdt` notes.
//!
//! Each site has one SystemTap v3 note (type 3, owner `stapsdt`) holding three addresses (the
//! site, the `.stapsdt.base` the file was linked with, the semaphore) and three strings
//! (provider, name, argument text). The addresses are link-time virtual addresses, but uprobes
//! attach by file offset and the kernel's semaphore counter (`ref_ctr_offset`) is a file offset
//! too, so every address is translated here through the PT_LOAD segment that contains it: in
//! most PIEs and shared libraries segment addresses and file offsets differ.
//!
//! The file is untrusted input (any library a process maps), so every inconsistency is a typed
//! error for the caller to report and skip, never a panic or a guessed offset: a wrong site
//! offset would plant a breakpoint in the middle of an instruction.

// Outside tests nothing calls this yet: the USDT attach path in the loader is the next step.

use object::elf;
use object::read::elf::{FileHeader, ProgramHeader, SectionHeader};
use object::{Endian, Endianness, FileKind};
use thiserror::Error;

/// One probe site.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UsdtNote {
    pub provider: String,
    pub name: String,
    /// The argument text, decoded by [`super::usdt_args::parse_args`].
    pub args: String,
    /// Link-time address of the site, after the `.stapsdt.base` adjustment.
    pub pc: u64,
    /// File offset of the site, through the executable PT_LOAD segment that contains it.
    pub file_offset: u64,
    /// Link-time address of the semaphore (after the base adjustment too), 0 for none.
    pub semaphore: u64,
    /// File offset of the semaphore, through the non-executable PT_LOAD segment whose file-backed
    /// part contains it. `None` when the site has no semaphore.
    pub semaphore_offset: Option<u64>,
}

#[derive(Debug, Error)]
pub enum UsdtNoteError {
    #[error("not an ELF file this tool can read: {0}")]
    NotElf(object::Error),
    #[error("not an ELF file: the file is {0:?}")]
    NotElfKind(FileKind),
    #[error("malformed .note.stapsdt section: {0}")]
    BadNotes(object::Error),
    #[error("USDT note {index}: its {len}-byte descriptor cannot hold three {addr_size}-byte addresses")]
    TruncatedDesc { index: usize, len: usize, addr_size: usize },
    #[error("USDT note {index}: the {field} string is not NUL-terminated")]
    MissingNul { index: usize, field: &'static str },
    #[error("USDT note {index}: the {field} string is not valid UTF-8")]
    InvalidUtf8 { index: usize, field: &'static str },
    #[error("USDT probe {provider}:{name}: location {pc:#x} is not inside an executable PT_LOAD segment")]
    PcNotInExecSegment { provider: String, name: String, pc: u64 },
    #[error(
        "USDT probe {provider}:{name}: semaphore {semaphore:#x} is not in the file-backed part of a \
         non-executable PT_LOAD segment"
    )]
    SemaphoreNotInDataSegment { provider: String, name: String, semaphore: u64 },
}

const NOTE_TYPE_STAPSDT: u32 = 3;
const NOTE_OWNER: &[u8] = b"stapsdt";

/// All probe sites of the file. A file without a `.note.stapsdt` section has none; any malformed
/// note fails the whole file, because a later note's position cannot be trusted after a bad one.
pub fn read_notes(data: &[u8]) -> Result<Vec<UsdtNote>, UsdtNoteError> {
    match FileKind::parse(data).map_err(UsdtNoteError::NotElf)? {
        FileKind::Elf32 => read::<elf::FileHeader32<Endianness>>(data),
        FileKind::Elf64 => read::<elf::FileHeader64<Endianness>>(data),
        kind => Err(UsdtNoteError::NotElfKind(kind)),
    }
}

/// A PT_LOAD segment, reduced to what the address translation needs.
struct Load {
    vaddr: u64,
    offset: u64,
    filesz: u64,
    memsz: u64,
    exec: bool,
}

impl Load {
    /// The file offset of `addr` if it lies in the first `len` bytes of the segment. Written
    /// as a difference so crafted headers near `u64::MAX` cannot overflow.
    fn offset_of(&self, addr: u64, len: u64) -> Option<u64> {
        let delta = addr.checked_sub(self.vaddr)?;
        (delta < len).then(|| self.offset.checked_add(delta)).flatten()
    }
}

fn read<Elf: FileHeader<Endian = Endianness>>(data: &[u8]) -> Result<Vec<UsdtNote>, UsdtNoteError> {
    let header = Elf::parse(data).map_err(UsdtNoteError::NotElf)?;
    let endian = header.endian().map_err(UsdtNoteError::NotElf)?;
    let sections = header.sections(endian, data).map_err(UsdtNoteError::NotElf)?;
    let loads: Vec<Load> = header
        .program_headers(endian, data)
        .map_err(UsdtNoteError::NotElf)?
        .iter()
        .filter(|ph| ph.p_type(endian) == elf::PT_LOAD)
        .map(|ph| Load {
            vaddr: ph.p_vaddr(endian).into(),
            offset: ph.p_offset(endian).into(),
            filesz: ph.p_filesz(endian).into(),
            memsz: ph.p_memsz(endian).into(),
            exec: ph.p_flags(endian) & elf::PF_X != 0,
        })
        .collect();
    let base_section: Option<u64> =
        sections.section_by_name(endian, b".stapsdt.base").map(|(_, section)| section.sh_addr(endian).into());
    let addr_size = if header.is_type_64() { 8 } else { 4 };

    let mut out = Vec::new();
    let mut index = 0;
    for section in sections.iter() {
        if section.sh_type(endian) != elf::SHT_NOTE
            || sections.section_name(endian, section).ok() != Some(b".note.stapsdt".as_slice())
        {
            continue;
        }
        let Some(mut notes) = section.notes(endian, data).map_err(UsdtNoteError::BadNotes)? else {
            continue;
        };
        while let Some(note) = notes.next().map_err(UsdtNoteError::BadNotes)? {
            // Other owners or types may share the section; they are not ours to judge.
            if note.n_type(endian) != NOTE_TYPE_STAPSDT || note.name() != NOTE_OWNER {
                continue;
            }
            out.push(decode(index, note.desc(), endian, addr_size, base_section, &loads)?);
            index += 1;
        }
    }
    Ok(out)
}

fn decode(
    index: usize,
    desc: &[u8],
    endian: Endianness,
    addr_size: usize,
    base_section: Option<u64>,
    loads: &[Load],
) -> Result<UsdtNote, UsdtNoteError> {
    if desc.len() < 3 * addr_size {
        return Err(UsdtNoteError::TruncatedDesc { index, len: desc.len(), addr_size });
    }
    let addr = |i: usize| -> u64 {
        let bytes = &desc[i * addr_size..(i + 1) * addr_size];
        match bytes.try_into() {
            Ok(eight) => endian.read_u64_bytes(eight),
            // `addr_size` is 4 here: the only other width.
            Err(_) => endian.read_u32_bytes(bytes.try_into().unwrap_or_default()).into(),
        }
    };
    let (mut pc, note_base, mut semaphore) = (addr(0), addr(1), addr(2));

    let mut strings = &desc[3 * addr_size..];
    let mut string = |field: &'static str| -> Result<String, UsdtNoteError> {
        let nul = strings.iter().position(|&b| b == 0).ok_or(UsdtNoteError::MissingNul { index, field })?;
        let text = std::str::from_utf8(&strings[..nul]).map_err(|_| UsdtNoteError::InvalidUtf8 { index, field })?;
        strings = &strings[nul + 1..];
        Ok(text.to_owned())
    };
    let provider = string("provider")?;
    let name = string("name")?;
    let args = string("arguments")?;

    // A prelinked file was moved after the notes were written: the note keeps the old address
    // of `.stapsdt.base`, the section header has the new one, and the difference applies to
    // every address in the note. A zero base means the note was written without one (some
    // generators do), so there is nothing to compare against.
    if let Some(section_addr) = base_section {
        if note_base != 0 {
            let shift = section_addr.wrapping_sub(note_base);
            pc = pc.wrapping_add(shift);
            if semaphore != 0 {
                semaphore = semaphore.wrapping_add(shift);
            }
        }
    }

    // The site must be code the file supplies: an offset past the file-backed part could not
    // hold an instruction for the uprobe to replace.
    let file_offset = loads
        .iter()
        .filter(|l| l.exec)
        .find_map(|l| l.offset_of(pc, l.memsz.min(l.filesz)))
        .ok_or_else(|| UsdtNoteError::PcNotInExecSegment { provider: provider.clone(), name: name.clone(), pc })?;

    // The kernel increments the semaphore through the page cache of the file's mapping, so the
    // counter must be in the file-backed part of a data segment, never in .bss or code.
    let semaphore_offset = if semaphore == 0 {
        None
    } else {
        Some(loads.iter().filter(|l| !l.exec).find_map(|l| l.offset_of(semaphore, l.memsz.min(l.filesz))).ok_or_else(
            || UsdtNoteError::SemaphoreNotInDataSegment { provider: provider.clone(), name: name.clone(), semaphore },
        )?)
    };

    Ok(UsdtNote { provider, name, args, pc, file_offset, semaphore, semaphore_offset })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::path::{Path, PathBuf};
    use std::process::Command;

    // ---- A minimal ELF writer, for exact control over segments, notes and malformations. ----

    #[derive(Clone)]
    pub(crate) struct Seg {
        pub exec: bool,
        pub offset: u64,
        pub vaddr: u64,
        pub filesz: u64,
        pub memsz: u64,
    }

    #[derive(Clone)]
    pub(crate) struct RawNote {
        pub owner: Vec<u8>,
        pub n_type: u32,
        pub desc: Vec<u8>,
    }

    #[derive(Clone)]
    pub(crate) struct TestElf {
        pub is_64: bool,
        pub big_endian: bool,
        pub segs: Vec<Seg>,
        pub notes: Vec<RawNote>,
        pub stapsdt_base: Option<u64>,
        /// The section name of the note section (to test that others are ignored).
        pub note_section: &'static str,
    }

    struct Out {
        bytes: Vec<u8>,
        big: bool,
    }

    impl Out {
        fn u16(&mut self, v: u16) {
            self.bytes.extend(if self.big { v.to_be_bytes() } else { v.to_le_bytes() });
        }
        fn u32(&mut self, v: u32) {
            self.bytes.extend(if self.big { v.to_be_bytes() } else { v.to_le_bytes() });
        }
        fn u64(&mut self, v: u64) {
            self.bytes.extend(if self.big { v.to_be_bytes() } else { v.to_le_bytes() });
        }
        /// An address-sized field.
        fn word(&mut self, is_64: bool, v: u64) {
            if is_64 {
                self.u64(v)
            } else {
                self.u32(v as u32)
            }
        }
        fn pad4(&mut self) {
            while !self.bytes.len().is_multiple_of(4) {
                self.bytes.push(0);
            }
        }
    }

    /// Note descriptor bytes: three addresses then provider, name, args, each NUL-terminated.
    pub(crate) fn stapsdt_desc(
        is_64: bool,
        big: bool,
        addrs: [u64; 3],
        provider: &str,
        name: &str,
        args: &str,
    ) -> Vec<u8> {
        let mut out = Out { bytes: Vec::new(), big };
        for a in addrs {
            out.word(is_64, a);
        }
        for s in [provider, name, args] {
            out.bytes.extend(s.as_bytes());
            out.bytes.push(0);
        }
        out.bytes
    }

    impl TestElf {
        pub(crate) fn new(is_64: bool) -> Self {
            Self {
                is_64,
                big_endian: false,
                segs: vec![
                    Seg { exec: true, offset: 0x1000, vaddr: 0x401000, filesz: 0x1000, memsz: 0x1000 },
                    Seg { exec: false, offset: 0x2000, vaddr: 0x403100, filesz: 0x100, memsz: 0x400 },
                ],
                notes: Vec::new(),
                stapsdt_base: None,
                note_section: ".note.stapsdt",
            }
        }

        pub(crate) fn probe(mut self, addrs: [u64; 3], provider: &str, name: &str, args: &str) -> Self {
            let desc = stapsdt_desc(self.is_64, self.big_endian, addrs, provider, name, args);
            self.notes.push(RawNote { owner: b"stapsdt".to_vec(), n_type: 3, desc });
            self
        }

        pub(crate) fn build(&self) -> Vec<u8> {
            let (is_64, big) = (self.is_64, self.big_endian);
            let (ehsize, phentsize, shentsize) = if is_64 { (64u64, 56u64, 64u64) } else { (52, 32, 40) };
            let mut notes = Out { bytes: Vec::new(), big };
            for n in &self.notes {
                notes.u32(n.owner.len() as u32 + 1);
                notes.u32(n.desc.len() as u32);
                notes.u32(n.n_type);
                notes.bytes.extend(&n.owner);
                notes.bytes.push(0);
                notes.pad4();
                notes.bytes.extend(&n.desc);
                notes.pad4();
            }
            let mut shstrtab = b"\0".to_vec();
            let mut name = |s: &str| {
                let at = shstrtab.len() as u32;
                shstrtab.extend(s.as_bytes());
                shstrtab.push(0);
                at
            };
            let note_name = name(self.note_section);
            let base_name = name(".stapsdt.base");
            let shstr_name = name(".shstrtab");

            let phoff = ehsize;
            let notes_off = phoff + phentsize * self.segs.len() as u64;
            let shstr_off = notes_off + notes.bytes.len() as u64;
            let shoff = (shstr_off + shstrtab.len() as u64 + 7) & !7;
            // null, notes, [.stapsdt.base], .shstrtab
            let shnum = 3 + self.stapsdt_base.is_some() as u16;

            let mut o = Out { bytes: Vec::new(), big };
            o.bytes.extend([0x7f, b'E', b'L', b'F', if is_64 { 2 } else { 1 }, if big { 2 } else { 1 }, 1, 0]);
            o.bytes.extend([0; 8]);
            o.u16(3); // ET_DYN
            o.u16(if is_64 { 62 } else { 3 });
            o.u32(1);
            o.word(is_64, 0); // entry
            o.word(is_64, phoff);
            o.word(is_64, shoff);
            o.u32(0);
            o.u16(ehsize as u16);
            o.u16(phentsize as u16);
            o.u16(self.segs.len() as u16);
            o.u16(shentsize as u16);
            o.u16(shnum);
            o.u16(shnum - 1);
            for s in &self.segs {
                let flags = if s.exec { 5 } else { 6 }; // R+X or R+W
                o.u32(1); // PT_LOAD
                if is_64 {
                    o.u32(flags);
                    o.u64(s.offset);
                    o.u64(s.vaddr);
                    o.u64(s.vaddr);
                    o.u64(s.filesz);
                    o.u64(s.memsz);
                    o.u64(0x1000);
                } else {
                    o.u32(s.offset as u32);
                    o.u32(s.vaddr as u32);
                    o.u32(s.vaddr as u32);
                    o.u32(s.filesz as u32);
                    o.u32(s.memsz as u32);
                    o.u32(flags);
                    o.u32(0x1000);
                }
            }
            o.bytes.extend(&notes.bytes);
            o.bytes.extend(&shstrtab);
            o.bytes.resize(shoff as usize, 0);
            let section = |o: &mut Out, name: u32, ty: u32, addr: u64, off: u64, size: u64, align: u64| {
                o.u32(name);
                o.u32(ty);
                o.word(is_64, if ty == elf::SHT_PROGBITS { 2 } else { 0 }); // SHF_ALLOC for .stapsdt.base
                o.word(is_64, addr);
                o.word(is_64, off);
                o.word(is_64, size);
                o.u32(0);
                o.u32(0);
                o.word(is_64, align);
                o.word(is_64, 0);
            };
            section(&mut o, 0, 0, 0, 0, 0, 0);
            section(&mut o, note_name, elf::SHT_NOTE, 0, notes_off, notes.bytes.len() as u64, 4);
            if let Some(addr) = self.stapsdt_base {
                section(&mut o, base_name, elf::SHT_PROGBITS, addr, 0, 1, 1);
            }
            section(&mut o, shstr_name, elf::SHT_STRTAB, 0, shstr_off, shstrtab.len() as u64, 1);
            o.bytes
        }
    }

    fn note(provider: &str, name: &str, args: &str, pc: u64, off: u64, sem: u64, sem_off: Option<u64>) -> UsdtNote {
        UsdtNote {
            provider: provider.into(),
            name: name.into(),
            args: args.into(),
            pc,
            file_offset: off,
            semaphore: sem,
            semaphore_offset: sem_off,
        }
    }

    #[test]
    fn synthetic_64_and_32_bit_little_and_big_endian() {
        for is_64 in [true, false] {
            for big in [false, true] {
                let mut elf = TestElf::new(is_64);
                elf.big_endian = big;
                let elf = elf.probe([0x401234, 0, 0x403110], "prov", "with_sema", "-4@%edi 8@%rsi").probe(
                    [0x401ffe, 0, 0],
                    "prov",
                    "no_sema",
                    "",
                );
                let got = read_notes(&elf.build()).unwrap();
                assert_eq!(
                    got,
                    vec![
                        note("prov", "with_sema", "-4@%edi 8@%rsi", 0x401234, 0x1234, 0x403110, Some(0x2010)),
                        note("prov", "no_sema", "", 0x401ffe, 0x1ffe, 0, None),
                    ],
                    "64-bit {is_64}, big-endian {big}"
                );
            }
        }
    }

    #[test]
    fn no_notes_section_is_empty() {
        let elf = TestElf::new(true);
        assert_eq!(read_notes(&elf.build()).unwrap(), vec![]);
        let mut other = TestElf::new(true).probe([0x401234, 0, 0], "p", "n", "");
        other.note_section = ".note.other";
        assert_eq!(read_notes(&other.build()).unwrap(), vec![]);
    }

    #[test]
    fn foreign_notes_in_the_section_are_skipped() {
        let mut elf = TestElf::new(true).probe([0x401234, 0, 0], "p", "n", "");
        elf.notes.insert(0, RawNote { owner: b"GNU".to_vec(), n_type: 3, desc: vec![1, 2, 3] });
        elf.notes.push(RawNote { owner: b"stapsdt".to_vec(), n_type: 1, desc: vec![] });
        let got = read_notes(&elf.build()).unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].name, "n");
    }

    #[test]
    fn base_adjustment_applies_only_with_both_bases() {
        // Prelinked: the note recorded base 0x402000, the section now sits 0x40 lower.
        let mut elf = TestElf::new(true).probe([0x401240, 0x402000, 0x403150], "p", "moved", "");
        elf.stapsdt_base = Some(0x401fc0);
        let got = read_notes(&elf.build()).unwrap();
        assert_eq!(got, vec![note("p", "moved", "", 0x401200, 0x1200, 0x403110, Some(0x2010))]);

        // Note base 0 (some generators): no adjustment even with the section present.
        let mut elf = TestElf::new(true).probe([0x401240, 0, 0x403150], "p", "zero_base", "");
        elf.stapsdt_base = Some(0x401fc0);
        assert_eq!(read_notes(&elf.build()).unwrap()[0].pc, 0x401240);

        // No section: no adjustment even with a note base.
        let elf = TestElf::new(true).probe([0x401240, 0x402000, 0], "p", "no_section", "");
        assert_eq!(read_notes(&elf.build()).unwrap()[0].pc, 0x401240);

        // A semaphore of 0 stays 0 (no semaphore), whatever the shift.
        let mut elf = TestElf::new(true).probe([0x401240, 0x402000, 0], "p", "no_sema", "");
        elf.stapsdt_base = Some(0x401fc0);
        let got = &read_notes(&elf.build()).unwrap()[0];
        assert_eq!((got.semaphore, got.semaphore_offset), (0, None));
    }

    #[test]
    fn addresses_outside_the_right_segments_are_errors() {
        let err = |addrs: [u64; 3]| read_notes(&TestElf::new(true).probe(addrs, "p", "n", "").build()).unwrap_err();
        // Site in the data segment, before all segments, just past the text segment.
        for pc in [0x403110, 0x1000, 0x402000] {
            assert!(
                matches!(err([pc, 0, 0]), UsdtNoteError::PcNotInExecSegment { pc: got, .. } if got == pc),
                "{pc:#x}"
            );
        }
        // Semaphore in code, in .bss (past filesz, inside memsz), unmapped.
        for sem in [0x401100, 0x403200, 0x9000_0000] {
            assert!(
                matches!(err([0x401100, 0, sem]), UsdtNoteError::SemaphoreNotInDataSegment { semaphore, .. } if semaphore == sem),
                "{sem:#x}"
            );
        }
        // Last byte of each file-backed range is fine.
        let ok = read_notes(&TestElf::new(true).probe([0x401fff, 0, 0x4031ff], "p", "n", "").build()).unwrap();
        assert_eq!((ok[0].file_offset, ok[0].semaphore_offset), (0x1fff, Some(0x20ff)));
    }

    #[test]
    fn malformed_descriptors_are_errors() {
        let with_desc = |desc: Vec<u8>| {
            let mut elf = TestElf::new(true);
            elf.notes.push(RawNote { owner: b"stapsdt".to_vec(), n_type: 3, desc });
            read_notes(&elf.build())
        };
        let full = stapsdt_desc(true, false, [0x401100, 0, 0], "prov", "name", "8@%rdi");
        assert!(matches!(
            with_desc(full[..23].to_vec()),
            Err(UsdtNoteError::TruncatedDesc { len: 23, addr_size: 8, .. })
        ));
        // Cut inside each string: the first string that lost its NUL is named.
        assert!(matches!(with_desc(full[..26].to_vec()), Err(UsdtNoteError::MissingNul { field: "provider", .. })));
        assert!(matches!(with_desc(full[..31].to_vec()), Err(UsdtNoteError::MissingNul { field: "name", .. })));
        assert!(matches!(
            with_desc(full[..full.len() - 1].to_vec()),
            Err(UsdtNoteError::MissingNul { field: "arguments", .. })
        ));
        let mut bad_utf8 = full.clone();
        bad_utf8[24 + 5] = 0xff; // first byte of the name
        assert!(matches!(with_desc(bad_utf8), Err(UsdtNoteError::InvalidUtf8 { field: "name", .. })));
        assert!(matches!(read_notes(b"\x7fELF"), Err(UsdtNoteError::NotElf(_))));
        assert!(matches!(read_notes(b"#!/bin/sh\n"), Err(UsdtNoteError::NotElf(_) | UsdtNoteError::NotElfKind(_))));
        assert!(matches!(read_notes(&[]), Err(UsdtNoteError::NotElf(_))));
        // A note header claiming more bytes than the section has.
        let mut elf = TestElf::new(true).probe([0x401100, 0, 0], "p", "n", "").build();
        let notes_off = 64 + 56 * 2;
        elf[notes_off + 4] = 0xff;
        assert!(matches!(read_notes(&elf), Err(UsdtNoteError::BadNotes(_))));
    }

    #[test]
    fn error_messages_name_the_probe() {
        let elf = TestElf::new(true).probe([0x10, 0, 0], "myprov", "myprobe", "").build();
        let msg = read_notes(&elf).unwrap_err().to_string();
        assert!(msg.contains("myprov:myprobe") && msg.contains("0x10"), "{msg}");
    }

    // ---- Real fixtures built by the system C compiler, checked against readelf. ----

    /// A C file with hand-written SystemTap v3 notes (no <sys/sdt.h> needed): per site a `nop`,
    /// a note whose three addresses are the nop, `_.stapsdt.base` and the semaphore, and the
    /// compiler's own operand text in the argument string.
    pub(crate) const FIXTURE_C: &str = r#"
#ifndef FIXTURE_NOSTDLIB
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#endif

#if defined(__LP64__)
#define ADDR ".8byte "
#else
#define ADDR ".4byte "
#endif

__asm__(".pushsection .stapsdt.base,\"a\",@progbits\n"
        "_.stapsdt.base: .space 1\n"
        ".popsection\n");

#define SITE(provider, name, base, sema, args, ...)                          \
    __asm__ __volatile__("990: nop\n"                                        \
                         ".pushsection .note.stapsdt,\"\",@note\n"           \
                         ".balign 4\n"                                       \
                         ".4byte 992f-991f, 994f-993f, 3\n"                  \
                         "991: .asciz \"stapsdt\"\n"                         \
                         "992: .balign 4\n"                                  \
                         "993: " ADDR "990b\n"                               \
                         ADDR base "\n"                                      \
                         ADDR sema "\n"                                      \
                         ".asciz \"" provider "\"\n"                         \
                         ".asciz \"" name "\"\n"                             \
                         ".asciz \"" args "\"\n"                             \
                         "994: .balign 4\n"                                  \
                         ".popsection\n" ::__VA_ARGS__)

#ifndef SEMA_INIT
#define SEMA_INIT 0
#endif

__attribute__((section(".probes"), used, visibility("hidden")))
volatile unsigned short memscope_fixture_sema = SEMA_INIT;

/* Room so that the data segment's addresses and offsets drift apart from the text's. */
__attribute__((used)) char memscope_fixture_pad[8192] = {1};

static volatile unsigned long sink;

__attribute__((noinline)) void memscope_fixture_fire(int n, char **argv) {
    if (memscope_fixture_sema)
        sink++;
    SITE("memscope_fx", "alloc", "_.stapsdt.base", "memscope_fixture_sema", "-4@%0 8@%1", "nor"(n), "nor"(argv));
    SITE("memscope_fx", "free", "_.stapsdt.base", "0", "8@%0 -8@%1", "nor"(argv[0]), "nor"(-5L));
    SITE("memscope_fx", "noargs", "_.stapsdt.base", "0", "");
    /* A note written as if the file had been prelinked 16 bytes higher. */
    SITE("memscope_fx", "prelinked", "_.stapsdt.base+16", "0", "");
}

#if !defined(FIXTURE_SHARED) && !defined(FIXTURE_NOSTDLIB)
int main(int argc, char **argv) {
    /* With an argument: print the semaphore's address, then fire the sites for that many seconds. */
    if (argc > 1) {
        printf("%p\n", (void *)&memscope_fixture_sema);
        fflush(stdout);
        for (long i = 0; i < atol(argv[1]) * 1000L; i++) {
            memscope_fixture_fire((int)i, argv);
            usleep(1000);
        }
    }
    return 0;
}
#endif

#ifdef FIXTURE_NOSTDLIB
void _start(void) {
    memscope_fixture_fire(1, 0);
    for (;;) {
    }
}
#endif
"#;

    pub(crate) struct Fixture {
        pub dir: PathBuf,
        pub path: PathBuf,
    }

    impl Drop for Fixture {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    /// Compiles [`FIXTURE_C`] with `flags`; `None` (with the reason printed) when the system
    /// cannot, so the test can be skipped rather than failed on machines without a C toolchain.
    pub(crate) fn compile_fixture(tag: &str, flags: &[&str]) -> Option<Fixture> {
        static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("memscope-usdt-{}-{n}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir).ok()?;
        let fixture = Fixture { path: dir.join(tag), dir };
        let src = fixture.dir.join("fixture.c");
        std::fs::write(&src, FIXTURE_C).ok()?;
        let result = Command::new("cc").args(flags).arg(&src).arg("-o").arg(&fixture.path).output();
        match result {
            Ok(out) if out.status.success() => Some(fixture),
            Ok(out) => {
                println!("skipping {tag}: cc {flags:?} failed: {}", String::from_utf8_lossy(&out.stderr));
                None
            }
            Err(e) => {
                println!("skipping {tag}: cannot run cc: {e}");
                None
            }
        }
    }

    /// What `readelf` says about a file, parsed from its text output only.
    struct Readelf {
        /// (provider, name, location, base, semaphore, arguments)
        notes: Vec<(String, String, u64, u64, u64, String)>,
        /// (offset, vaddr, filesz, memsz, executable)
        loads: Vec<(u64, u64, u64, u64, bool)>,
        stapsdt_base: Option<u64>,
    }

    fn hex(s: &str) -> u64 {
        let s = s.trim().trim_end_matches(',');
        u64::from_str_radix(s.trim_start_matches("0x"), 16).unwrap_or_else(|e| panic!("readelf number {s}: {e}"))
    }

    fn readelf(path: &Path) -> Option<Readelf> {
        let run = |flag: &str| -> Option<String> {
            let out = Command::new("readelf").arg(flag).arg(path).output().ok()?;
            out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
        };
        let (Some(notes_text), Some(segments_text), Some(sections_text)) = (run("-nW"), run("-lW"), run("-SW")) else {
            println!("skipping: readelf is not available");
            return None;
        };
        let mut notes = Vec::new();
        let mut current: Option<(String, String, u64, u64, u64)> = None;
        for line in notes_text.lines().map(str::trim) {
            // With -W the provider shares the line of the note's owner and type.
            if let Some((_, v)) = line.split_once("Provider: ") {
                current = Some((v.trim().to_owned(), String::new(), 0, 0, 0));
            } else if let Some(v) = line.strip_prefix("Name: ") {
                current.as_mut().unwrap().1 = v.to_owned();
            } else if let Some(v) = line.strip_prefix("Location: ") {
                // "Location: 0x..., Base: 0x..., Semaphore: 0x..."
                let fields: Vec<&str> = v.split(", ").collect();
                let c = current.as_mut().unwrap();
                c.2 = hex(fields[0]);
                c.3 = hex(fields[1].trim_start_matches("Base: "));
                c.4 = hex(fields[2].trim_start_matches("Semaphore: "));
            } else if let Some(v) = line.strip_prefix("Arguments:") {
                let (p, n, l, b, s) = current.take().unwrap();
                notes.push((p, n, l, b, s, v.trim().to_owned()));
            }
        }
        let loads = segments_text
            .lines()
            .map(str::split_whitespace)
            .filter_map(|mut f| {
                (f.next()? == "LOAD").then_some(())?;
                let cols: Vec<&str> = f.collect();
                // Offset VirtAddr PhysAddr FileSiz MemSiz Flg... Align; Flg may be "R E" (two words).
                let flags = cols[5..cols.len() - 1].join("");
                Some((hex(cols[0]), hex(cols[1]), hex(cols[3]), hex(cols[4]), flags.contains('E')))
            })
            .collect();
        let stapsdt_base = sections_text.lines().find_map(|l| {
            let l = l.split_once(']')?.1;
            let mut f = l.split_whitespace();
            (f.next()? == ".stapsdt.base").then_some(())?;
            f.next()?;
            Some(hex(f.next()?))
        });
        Some(Readelf { notes, loads, stapsdt_base })
    }

    /// Checks the parser against readelf for every fixture site, and checks the offsets against
    /// the file's bytes: the site offset must hold the `nop`, the semaphore offset its initial
    /// value.
    fn check_fixture(fixture: &Fixture, sema_init: u16, text_moves: bool) {
        let data = std::fs::read(&fixture.path).unwrap();
        let Some(re) = readelf(&fixture.path) else { return };
        let got = read_notes(&data).unwrap();
        assert_eq!(got.len(), re.notes.len(), "{:?}", fixture.path);
        assert_eq!(got.len(), 4);
        let base_addr = re.stapsdt_base.expect("the fixture has .stapsdt.base");
        let to_offset = |addr: u64, exec: bool| {
            re.loads
                .iter()
                .find(|&&(_, vaddr, filesz, _, e)| e == exec && addr >= vaddr && addr < vaddr + filesz)
                .map(|&(off, vaddr, ..)| addr - vaddr + off)
        };
        for (note, (provider, name, loc, base, sema, args)) in got.iter().zip(&re.notes) {
            assert_eq!((&note.provider, &note.name, &note.args), (provider, name, args));
            let pc = loc + base_addr - base;
            assert_eq!(note.pc, pc, "{name}");
            assert_eq!(Some(note.file_offset), to_offset(pc, true), "{name}");
            let want_sema = if *sema == 0 { 0 } else { sema + base_addr - base };
            assert_eq!(note.semaphore, want_sema, "{name}");
            assert_eq!(note.semaphore_offset, (want_sema != 0).then(|| to_offset(want_sema, false).unwrap()), "{name}");
            if name != "prelinked" {
                assert_eq!(data[note.file_offset as usize], 0x90, "{name}: the site offset holds the nop");
            } else {
                assert_eq!(note.pc, loc - 16, "the fake prelink shift applies");
            }
            if let Some(off) = note.semaphore_offset {
                let off = off as usize;
                assert_eq!(u16::from_le_bytes([data[off], data[off + 1]]), sema_init, "{name}: semaphore bytes");
            }
        }
        let alloc = &got[0];
        assert_eq!(alloc.name, "alloc");
        assert!(alloc.semaphore_offset.is_some());
        assert_ne!(alloc.semaphore, alloc.semaphore_offset.unwrap(), "data vaddr differs from its file offset");
        if text_moves {
            assert_ne!(alloc.pc, alloc.file_offset, "text vaddr differs from its file offset");
        }
        // The compiler's own operand text must decode.
        if cfg!(target_arch = "x86_64") {
            for n in &got {
                super::super::usdt_args::parse_args(&n.args, super::super::usdt_args::Arch::X86_64)
                    .unwrap_or_else(|e| panic!("{}: {e}", n.args));
            }
        }
    }

    #[test]
    fn real_fixtures_match_readelf() {
        let variants: &[(&str, &[&str], bool)] = &[
            ("pie", &["-O2", "-fPIE", "-pie", "-DSEMA_INIT=0x1234"], false),
            ("nopie", &["-O2", "-fno-pie", "-no-pie", "-DSEMA_INIT=0x1234"], true),
            ("shared.so", &["-O2", "-fPIC", "-shared", "-DFIXTURE_SHARED", "-DSEMA_INIT=0x1234"], false),
            ("O0", &["-O0", "-DSEMA_INIT=0x1234"], false),
            (
                "sepcode",
                &[
                    "-O2",
                    "-fPIC",
                    "-shared",
                    "-DFIXTURE_SHARED",
                    "-DSEMA_INIT=0x1234",
                    "-Wl,-z,separate-code",
                    "-Wl,-Ttext-segment=0x10000",
                ],
                true,
            ),
        ];
        let mut ran = 0;
        for (tag, flags, text_moves) in variants {
            let Some(fixture) = compile_fixture(tag, flags) else { continue };
            check_fixture(&fixture, 0x1234, *text_moves);
            ran += 1;
        }
        println!("checked {ran} compiled fixtures against readelf");
    }

    #[test]
    fn real_32_bit_fixture_matches_readelf() {
        let flags = [
            "-m32",
            "-O2",
            "-nostdlib",
            "-static",
            "-ffreestanding",
            "-fno-pie",
            "-no-pie",
            "-DFIXTURE_NOSTDLIB",
            "-DSEMA_INIT=0x1234",
        ];
        // The fixture includes <stdio.h>; a 32-bit build without multilib headers cannot.
        let Some(fixture) = compile_fixture("i386", &flags) else { return };
        let data = std::fs::read(&fixture.path).unwrap();
        assert_eq!(data[4], 1, "ELFCLASS32");
        check_fixture(&fixture, 0x1234, true);
    }

    /// Bytes of one real fixture for the mutation property test (or the synthetic ELF when no C
    /// compiler is available), built once.
    fn mutation_seed() -> &'static [Vec<u8>] {
        static SEEDS: std::sync::OnceLock<Vec<Vec<u8>>> = std::sync::OnceLock::new();
        SEEDS.get_or_init(|| {
            let mut seeds = vec![
                TestElf::new(true).probe([0x401234, 0x402000, 0x403110], "p", "n", "8@%rdi").build(),
                TestElf::new(false).probe([0x401234, 0, 0x403110], "p", "n", "-4@%eax").build(),
            ];
            if let Some(f) = compile_fixture("seed", &["-O2", "-fPIC", "-shared", "-DFIXTURE_SHARED"]) {
                seeds.push(std::fs::read(&f.path).unwrap());
            }
            seeds
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        #[test]
        fn read_notes_never_panics_on_arbitrary_bytes(data in prop::collection::vec(any::<u8>(), 0..512)) {
            let _ = read_notes(&data);
        }

        #[test]
        fn read_notes_never_panics_on_arbitrary_bytes_after_an_elf_magic(
            tail in prop::collection::vec(any::<u8>(), 0..512), class in 1u8..=2, data in 1u8..=2,
        ) {
            let mut bytes = vec![0x7f, b'E', b'L', b'F', class, data, 1, 0];
            bytes.extend(tail);
            let _ = read_notes(&bytes);
        }

        #[test]
        fn read_notes_never_panics_on_mutated_elfs(
            seed in any::<prop::sample::Index>(),
            flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..16),
            cut in prop::option::of(any::<prop::sample::Index>()),
        ) {
            let seeds = mutation_seed();
            let mut data = seeds[seed.index(seeds.len())].clone();
            // Mutations land anywhere, but the headers, note section and section table of the
            // synthetic seeds are the interesting part; Index spreads evenly, which is enough.
            for (at, value) in flips {
                let i = at.index(data.len());
                data[i] ^= value;
            }
            if let Some(cut) = cut {
                data.truncate(cut.index(data.len() + 1));
            }
            let _ = read_notes(&data);
        }

        #[test]
        fn read_notes_never_panics_on_mutated_note_section(
            flips in prop::collection::vec((0usize..256, any::<u8>()), 1..8),
            is_64 in any::<bool>(),
        ) {
            // Mutate only the bytes after the headers, where the notes and section names live.
            let mut data = TestElf::new(is_64).probe([0x401234, 0x402000, 0x403110], "p", "n", "8@%rdi").build();
            let start = if is_64 { 64 + 2 * 56 } else { 52 + 2 * 32 };
            for (at, value) in flips {
                let i = start + at % (data.len() - start);
                data[i] ^= value;
            }
            let _ = read_notes(&data);
        }
    }
}
