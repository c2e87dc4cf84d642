"""A minimal ELF64 little-endian reader for the tests: sections, program headers, symbols and the
SystemTap SDT notes of the built extension.

The tests check the probe layout the tracer depends on from the file's bytes, independently of
binutils (readelf is used only as a cross-check when present), so this reads the structures the
tracer itself reads: section headers, PT_LOAD segments and `.note.stapsdt`.
"""

import struct
from collections import namedtuple

Section = namedtuple("Section", "name type flags addr offset size")
Segment = namedtuple("Segment", "type flags offset vaddr filesz memsz")
Note = namedtuple("Note", "provider name args pc base semaphore")

SHT_PROGBITS = 1
SHT_SYMTAB = 2
SHT_NOTE = 7
SHT_NOBITS = 8
SHF_WRITE = 0x1
SHF_ALLOC = 0x2
SHF_EXECINSTR = 0x4
PT_LOAD = 1
PT_GNU_RELRO = 0x6474E552
PF_X, PF_W, PF_R = 1, 2, 4
EM_X86_64 = 62
EM_AARCH64 = 183
NT_STAPSDT = 3


class Elf:
    def __init__(self, path):
        with open(path, "rb") as f:
            self.data = f.read()
        d = self.data
        if d[:4] != b"\x7fELF" or d[4] != 2 or d[5] != 1:
            raise ValueError(f"{path}: not a little-endian ELF64 file")
        (self.machine,) = struct.unpack_from("<H", d, 18)
        phoff, shoff = struct.unpack_from("<QQ", d, 32)
        phentsize, phnum, shentsize, shnum, shstrndx = struct.unpack_from("<HHHHH", d, 54)
        raw = [struct.unpack_from("<IIQQQQIIQQ", d, shoff + i * shentsize) for i in range(shnum)]
        names_off = raw[shstrndx][4]
        self.sections = []
        self._raw_sections = raw
        for name, typ, flags, addr, off, size, _link, _info, _align, _entsize in raw:
            self.sections.append(Section(self._cstr(names_off + name), typ, flags, addr, off, size))
        self.segments = []
        for i in range(phnum):
            typ, flags, off, vaddr, _paddr, filesz, memsz, _align = struct.unpack_from(
                "<IIQQQQQQ", d, phoff + i * phentsize)
            self.segments.append(Segment(typ, flags, off, vaddr, filesz, memsz))

    def _cstr(self, off):
        end = self.data.index(b"\0", off)
        return self.data[off:end].decode()

    def section(self, name):
        found = [s for s in self.sections if s.name == name]
        return found[0] if found else None

    def load_segment_of(self, addr):
        for seg in self.segments:
            if seg.type == PT_LOAD and seg.vaddr <= addr < seg.vaddr + seg.memsz:
                return seg
        return None

    def in_relro(self, addr):
        return any(s.type == PT_GNU_RELRO and s.vaddr <= addr < s.vaddr + s.memsz for s in self.segments)

    def file_offset(self, addr):
        """The file offset of a virtual address, through its PT_LOAD (as a tracer computes it)."""
        seg = self.load_segment_of(addr)
        if seg is None or addr - seg.vaddr >= seg.filesz:
            raise ValueError(f"address {addr:#x} is not backed by the file")
        return seg.offset + (addr - seg.vaddr)

    def symbols(self):
        """name -> value from .symtab (empty when stripped)."""
        out = {}
        for idx, (_n, typ, _f, _a, off, size, link, _i, _al, entsize) in enumerate(self._raw_sections):
            if typ != SHT_SYMTAB or not entsize:
                continue
            stroff = self._raw_sections[link][4]
            for j in range(size // entsize):
                name, _info, _other, _shndx, value, _sz = struct.unpack_from("<IBBHQQ", self.data, off + j * entsize)
                if name:
                    out[self._cstr(stroff + name)] = value
        return out

    def stapsdt_notes(self):
        sec = self.section(".note.stapsdt")
        if sec is None:
            return []
        notes = []
        pos, end = sec.offset, sec.offset + sec.size
        align4 = lambda n: (n + 3) & ~3  # noqa: E731
        while pos + 12 <= end:
            namesz, descsz, typ = struct.unpack_from("<III", self.data, pos)
            owner = self.data[pos + 12:pos + 12 + namesz].rstrip(b"\0").decode()
            desc_off = pos + 12 + align4(namesz)
            desc = self.data[desc_off:desc_off + descsz]
            pos = desc_off + align4(descsz)
            if owner != "stapsdt" or typ != NT_STAPSDT:
                continue
            pc, base, sem = struct.unpack_from("<QQQ", desc, 0)
            provider, name, args = desc[24:].split(b"\0")[:3]
            notes.append(Note(provider.decode(), name.decode(), args.decode(), pc, base, sem))
        return notes
