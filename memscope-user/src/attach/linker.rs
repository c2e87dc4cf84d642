//! A process's dynamic linker, and the one function in it that tells us about new libraries.
//!
//! ld.so calls `_dl_debug_state` (an empty function kept for debuggers, in glibc's and musl's
//! linkers alike) every time its list of loaded objects changes. With a uprobe there
//! (`probes::loader` in the eBPF crate) the daemon hears of each `dlopen` as it happens and
//! reads that process's mappings then, instead of reading every new process's maps every
//! second in case it loaded something.
//!
//! The linker is found through the process's auxiliary vector: `AT_BASE` is the address the
//! kernel mapped the program's interpreter at, whatever its file is called (a container's
//! `/lib/ld-musl-x86_64.so.1`, a wrapper's custom interpreter). A statically linked program has
//! none, and needs none: what it maps at its exec is all it ever maps.

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::elf::ElfSymbols;
use super::libs::{Library, Origin};

/// The function ld.so calls after each change to its list of loaded objects.
pub const HOOK_SYMBOL: &str = "_dl_debug_state";

/// `AT_BASE` in `<elf.h>`: the interpreter's base address.
const AT_BASE: u64 = 7;

/// The interpreter's base address from an auxiliary vector (`/proc/PID/auxv`: pairs of native
/// words ending at `AT_NULL`); `None` for a static program (no `AT_BASE`, or 0).
pub fn interpreter_base(auxv: &[u8]) -> Option<u64> {
    let words: Vec<u64> = auxv.chunks_exact(8).map(|w| u64::from_ne_bytes(w.try_into().expect("8 bytes"))).collect();
    words
        .chunks_exact(2)
        .take_while(|pair| pair[0] != 0)
        .find(|pair| pair[0] == AT_BASE)
        .map(|pair| pair[1])
        .filter(|b| *b != 0)
}

/// The path of the file mapped at `base` in a `/proc/PID/maps` text.
pub fn mapped_at(maps: &str, base: u64) -> Option<&str> {
    maps.lines().find_map(|line| {
        let start = u64::from_str_radix(line.split('-').next()?, 16).ok()?;
        let at = line.find(" /")?;
        (start == base).then(|| &line[at + 1..]).filter(|p| !p.ends_with(" (deleted)"))
    })
}

/// The dynamic linker process `pid` runs with, opened through its root (a container's own
/// copy is another file); `None` for a static program, or a process gone or not readable.
pub fn of_process(pid: u32) -> Option<Library> {
    let auxv = std::fs::read(format!("/proc/{pid}/auxv")).ok()?;
    let base = interpreter_base(&auxv)?;
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    let shown = super::libs::mapped_path(pid, mapped_at(&maps, base)?);
    let path = PathBuf::from(format!("/proc/{pid}/root{shown}"));
    let meta = std::fs::metadata(&path).ok().filter(std::fs::Metadata::is_file)?;
    Some(Library { path, shown: shown.into_owned(), file_id: (meta.dev(), meta.ino()), origin: Origin::Mapped { pid } })
}

/// The file offset of [`HOOK_SYMBOL`] in a linker file; `None` where it defines none.
pub fn hook_offset(path: &Path) -> Result<Option<u64>, super::elf::ElfError> {
    let data = super::file::map_library(path)?;
    let wanted: HashSet<String> = std::iter::once(HOOK_SYMBOL.to_owned()).collect();
    let symbols = ElfSymbols::parse(&data, &wanted.into())
        .map_err(|source| super::elf::ElfError::Parse { path: path.to_owned(), source })?;
    Ok(symbols.get(HOOK_SYMBOL).map(|s| s.file_offset))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auxv(pairs: &[(u64, u64)]) -> Vec<u8> {
        pairs.iter().flat_map(|(k, v)| [k.to_ne_bytes(), v.to_ne_bytes()]).flatten().collect()
    }

    #[test]
    fn the_base_is_at_base_and_a_static_program_has_none() {
        assert_eq!(interpreter_base(&auxv(&[(6, 4096), (AT_BASE, 0x7f00_0000), (0, 0)])), Some(0x7f00_0000));
        assert_eq!(interpreter_base(&auxv(&[(6, 4096), (AT_BASE, 0), (0, 0)])), None);
        // Past AT_NULL nothing counts.
        assert_eq!(interpreter_base(&auxv(&[(6, 4096), (0, 0), (AT_BASE, 5)])), None);
    }

    #[test]
    fn the_file_mapped_at_the_base_is_the_linker() {
        let maps = "55d0c0000000-55d0c0001000 r--p 00000000 08:01 11 /usr/bin/python3.11\n\
                    7f0000000000-7f0000001000 r--p 00000000 08:01 22 /usr/lib/x86_64-linux-gnu/ld linux.so.2\n\
                    7f0000001000-7f0000020000 r-xp 00001000 08:01 22 /usr/lib/x86_64-linux-gnu/ld linux.so.2\n";
        assert_eq!(mapped_at(maps, 0x7f00_0000_0000), Some("/usr/lib/x86_64-linux-gnu/ld linux.so.2"));
        assert_eq!(mapped_at(maps, 0x7f00_0000_1000 + 1), None);
    }

    #[test]
    fn this_process_runs_with_a_linker_that_has_the_hook() {
        // The test binary is dynamically linked: its interpreter is the system's ld.so, which
        // reads independently of us (the kernel's auxv, the ELF's own symbol table).
        let ld = of_process(std::process::id()).expect("a dynamically linked test binary has a linker");
        let interp = object_interp(&std::fs::read("/proc/self/exe").unwrap());
        let real = |p: &Path| std::fs::canonicalize(p).unwrap();
        assert_eq!(real(&ld.path), real(Path::new(&interp)), "{ld:?}");
        assert!(hook_offset(&ld.path).unwrap().is_some_and(|o| o > 0));
        assert_eq!(hook_offset(Path::new("/proc/self/exe")).unwrap(), None, "the test binary defines no linker hook");
    }

    /// PT_INTERP of an ELF, as the kernel reads it.
    fn object_interp(data: &[u8]) -> String {
        use object::read::elf::{ElfFile64, ProgramHeader as _};
        let elf = ElfFile64::<object::Endianness>::parse(data).unwrap();
        let e = elf.endian();
        let ph = elf.elf_program_headers().iter().find(|p| p.p_type(e) == object::elf::PT_INTERP).unwrap();
        let bytes = ph.data(e, data).unwrap();
        String::from_utf8(bytes.split(|b| *b == 0).next().unwrap().to_vec()).unwrap()
    }
}
