"""The probe layout in the built extension: what memscope-bpf reads to attach its uprobes.

A wrong note does not fail loudly anywhere else: the tracer would skip the probe, read the wrong
registers, or raise a semaphore the wrappers never look at. So these tests check, from the .so's
bytes, every property the tracer relies on: provider, names, argument sizes and operand forms,
the `_.stapsdt.base` address, semaphores in a file-backed writable mapping, and each site being
the 5-byte nop.
"""

import os
import re
import shutil
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _elf  # noqa: E402
import _support  # noqa: E402,F401  (a clear error when memscope is not installed)

from memscope import _native  # noqa: E402

# probe -> argument sizes as the note must declare them (the tracer's decoding contract).
EXPECTED = {
    "tag_push": ["-8", "8"],
    "tag_pop": ["-8", "8"],
    "addr_tag": ["8", "-8", "8"],
    "step": ["-8"],
    "mark": ["8"],
    "range_start": ["8", "8"],
    "range_end": ["8"],
    "collect": ["-8"],
    "op_start": ["8"],
    "op_end": ["8"],
    "tensor_access": ["8", "8", "-8", "8"],
}

X86_OPERAND = re.compile(r"^(%[a-z0-9]+|-?(0x[0-9a-f]+|[0-9]+)?\(%[a-z0-9]+\)|\$-?[0-9]+)$")
ARM64_OPERAND = re.compile(r"^(x[0-9]+|sp|\[(x[0-9]+|sp)(, -?[0-9]+)?\]|-?[0-9]+)$")
X86_NOP5 = bytes.fromhex("0f1f440000")
ARM64_NOP = bytes.fromhex("1f2003d5")


@unittest.skipUnless(_native.PROBES_COMPILED, "this platform builds memscope without USDT probes")
class ProbeNotes(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.path = _native.__file__
        cls.elf = _elf.Elf(cls.path)
        cls.notes = cls.elf.stapsdt_notes()

    def test_one_note_per_probe_with_the_contract_arguments(self):
        self.assertEqual(sorted(n.name for n in self.notes), sorted(EXPECTED), "one site per probe")
        for n in self.notes:
            with self.subTest(probe=n.name):
                self.assertEqual(n.provider, "memscope")
                args = n.args.split(" ")
                self.assertEqual([a.split("@", 1)[0] for a in args], EXPECTED[n.name])
                operand = X86_OPERAND if self.elf.machine == _elf.EM_X86_64 else ARM64_OPERAND
                for a in args:
                    op = a.split("@", 1)[1]
                    self.assertRegex(op, operand, f"operand form the tracer decodes (no %rip/globals): {a}")
                    self.assertNotIn("%rip", op)

    def test_probe_names_match_the_module(self):
        self.assertEqual(sorted(_native.PROBES), sorted(EXPECTED))

    def test_base_is_the_stapsdt_base_section(self):
        base = self.elf.section(".stapsdt.base")
        self.assertIsNotNone(base, ".stapsdt.base section missing")
        self.assertTrue(base.flags & _elf.SHF_ALLOC and not base.flags & _elf.SHF_WRITE)
        for n in self.notes:
            self.assertEqual(n.base, base.addr, n.name)
        note_sec = self.elf.section(".note.stapsdt")
        self.assertEqual(note_sec.type, _elf.SHT_NOTE)
        self.assertFalse(note_sec.flags & _elf.SHF_ALLOC, "the note section is not loaded (as sys/sdt.h)")

    def test_semaphores_live_in_probes_in_a_writable_file_backed_segment(self):
        probes = self.elf.section(".probes")
        self.assertIsNotNone(probes, ".probes section missing")
        self.assertEqual(probes.type, _elf.SHT_PROGBITS, ".probes must be PROGBITS (file-backed), not NOBITS")
        self.assertEqual(probes.flags & (_elf.SHF_ALLOC | _elf.SHF_WRITE), _elf.SHF_ALLOC | _elf.SHF_WRITE)
        symbols = self.elf.symbols()
        sems = set()
        for n in self.notes:
            with self.subTest(probe=n.name):
                self.assertTrue(probes.addr <= n.semaphore < probes.addr + probes.size, hex(n.semaphore))
                seg = self.elf.load_segment_of(n.semaphore)
                self.assertIsNotNone(seg)
                self.assertTrue(seg.flags & _elf.PF_W and not seg.flags & _elf.PF_X, "writable, non-exec PT_LOAD")
                self.assertLess(n.semaphore + 2 - seg.vaddr, seg.filesz + 1, "inside the file-backed part")
                self.assertFalse(self.elf.in_relro(n.semaphore), "RELRO turns read-only after relocation")
                off = self.elf.file_offset(n.semaphore)
                self.assertEqual(self.elf.data[off:off + 2], b"\0\0", "initialised to 0")
                if symbols:
                    self.assertEqual(symbols.get(f"memscope_{n.name}_semaphore"), n.semaphore)
                sems.add(n.semaphore)
        self.assertEqual(len(sems), len(self.notes), "one semaphore per probe")

    def test_each_site_is_the_nop(self):
        nop = X86_NOP5 if self.elf.machine == _elf.EM_X86_64 else ARM64_NOP
        for n in self.notes:
            with self.subTest(probe=n.name):
                seg = self.elf.load_segment_of(n.pc)
                self.assertIsNotNone(seg)
                self.assertTrue(seg.flags & _elf.PF_X, "site in an executable segment")
                off = self.elf.file_offset(n.pc)
                self.assertEqual(self.elf.data[off:off + len(nop)].hex(), nop.hex())

    @unittest.skipUnless(shutil.which("readelf"), "readelf not installed")
    def test_readelf_agrees(self):
        out = subprocess.run(["readelf", "-n", "--wide", self.path], stdout=subprocess.PIPE, text=True,
                             check=True).stdout
        names = re.findall(r"^\s+Name: (\S+)$", out, re.M)
        self.assertEqual(sorted(names), sorted(EXPECTED))
        self.assertEqual(out.count("Provider: memscope"), len(EXPECTED))
        for n in self.notes:
            self.assertIn(f"Location: {n.pc:#018x}, Base: {n.base:#018x}, Semaphore: {n.semaphore:#018x}", out)
            self.assertIn(f"Arguments: {n.args}", out)


if __name__ == "__main__":
    unittest.main()
