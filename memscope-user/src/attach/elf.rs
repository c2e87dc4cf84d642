//! Symbol lookup in ELF files: names to the file offsets that uprobes attach by.
//!
//! Both `.dynsym` (exported) and `.symtab` (present unless stripped) are read; undefined entries
//! (imports) and non-functions are skipped. The address-to-offset step goes through the PT_LOAD
//! segment that contains the address, because section and segment addresses differ from file
//! offsets in most shared libraries built with separate code/data alignment.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

use object::{Object, ObjectSegment, ObjectSymbol, SymbolKind};
use thiserror::Error;

use super::file::FileError;

/// Messages leave the cause out: it is the error's `source`, printed after it (`{:#}`).
#[derive(Debug, Error)]
pub enum ElfError {
    #[error(transparent)]
    File(#[from] FileError),
    #[error("{path} is not an ELF file this tool can read")]
    Parse { path: PathBuf, source: object::Error },
}

/// Which table a symbol came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SymbolSource {
    Dynsym,
    Symtab,
    /// The `.symtab` of the library's separate debug file (hidden symbols of stripped builds).
    DebugFile,
}

impl SymbolSource {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Dynsym => "dynsym",
            Self::Symtab => "symtab",
            Self::DebugFile => "debug file",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FoundSymbol {
    /// The function's own name (the same as the key, unless found by a prefix).
    pub name: String,
    pub vaddr: u64,
    pub file_offset: u64,
    pub source: SymbolSource,
}

/// The functions a lookup keeps: names, and name prefixes (a match is kept under its prefix).
#[derive(Debug, Default)]
pub struct Wanted {
    pub names: HashSet<String>,
    pub prefixes: Vec<String>,
}

impl From<HashSet<String>> for Wanted {
    fn from(names: HashSet<String>) -> Self {
        Self { names, prefixes: Vec::new() }
    }
}

impl Wanted {
    /// The key `name` is kept under, if it is wanted. A prefix never matches a split-off part
    /// of a function (`name.cold`, `name.isra.0`): a probe there would not be at its entry.
    fn key<'w>(&'w self, name: &'w str) -> Option<&'w str> {
        if self.names.contains(name) {
            return Some(name);
        }
        if name.contains('.') {
            return None;
        }
        self.prefixes.iter().find(|p| name.starts_with(p.as_str())).map(String::as_str)
    }
}

/// The wanted symbols that a file defines.
#[derive(Debug, Default)]
pub struct ElfSymbols {
    symbols: HashMap<String, FoundSymbol>,
}

impl ElfSymbols {
    /// Reads `path` and keeps the functions named in `wanted`.
    #[cfg(test)]
    pub fn load(path: &std::path::Path, wanted: &Wanted) -> Result<Self, ElfError> {
        let data = super::file::map_library(path)?;
        Self::parse(&data, wanted).map_err(|source| ElfError::Parse { path: path.to_owned(), source })
    }

    /// As [`ElfSymbols::parse`], then adds the wanted functions of `debug`'s `.symtab` that the
    /// library itself does not define. Their addresses are the library's, so file offsets are
    /// computed with the library's segments (a debug-only file has no loadable bytes).
    pub fn parse_with_debug(data: &[u8], debug: &[u8], wanted: &Wanted) -> Result<Self, object::Error> {
        let mut symbols = Self::parse(data, wanted)?;
        let segments = segments(&object::File::parse(data)?);
        let debug = object::File::parse(debug)?;
        collect(&mut symbols.symbols, debug.symbols(), &segments, wanted, SymbolSource::DebugFile);
        Ok(symbols)
    }

    pub fn parse(data: &[u8], wanted: &Wanted) -> Result<Self, object::Error> {
        let file = object::File::parse(data)?;
        let segments = segments(&file);
        let mut symbols = HashMap::new();
        collect(&mut symbols, file.dynamic_symbols(), &segments, wanted, SymbolSource::Dynsym);
        collect(&mut symbols, file.symbols(), &segments, wanted, SymbolSource::Symtab);
        Ok(Self { symbols })
    }

    pub fn get(&self, name: &str) -> Option<&FoundSymbol> {
        self.symbols.get(name)
    }
}

/// (address, file size, file offset) of each loadable segment.
fn segments(file: &object::File<'_>) -> Vec<(u64, u64, u64)> {
    file.segments()
        .map(|s| {
            let (offset, size) = s.file_range();
            (s.address(), size, offset)
        })
        .collect()
}

fn collect<'data: 'file, 'file>(
    into: &mut HashMap<String, FoundSymbol>,
    table: impl Iterator<Item = object::Symbol<'data, 'file>>,
    segments: &[(u64, u64, u64)],
    wanted: &Wanted,
    source: SymbolSource,
) {
    let to_offset = |vaddr: u64| {
        segments
            .iter()
            .find(|(addr, size, _)| vaddr >= *addr && vaddr < addr + size)
            .map(|(addr, _, offset)| vaddr - addr + offset)
    };
    for sym in table {
        if sym.is_undefined() || sym.kind() != SymbolKind::Text || sym.address() == 0 {
            continue;
        }
        let Ok(name) = sym.name() else { continue };
        let Some(key) = wanted.key(name) else { continue };
        if into.contains_key(key) {
            continue;
        }
        if let Some(file_offset) = to_offset(sym.address()) {
            let found = FoundSymbol { name: name.to_owned(), vaddr: sym.address(), file_offset, source };
            into.insert(key.to_owned(), found);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_a_function_in_this_test_binary_and_skips_imports() {
        // The test binary itself is an ELF file with .symtab; `main` is defined in it and
        // `malloc` is only imported from libc.
        let exe = std::env::current_exe().unwrap();
        let wanted: HashSet<String> = ["main", "malloc"].into_iter().map(String::from).collect();
        let syms = ElfSymbols::load(&exe, &wanted.into()).unwrap();
        let main = syms.get("main").expect("main is defined");
        assert!(main.file_offset > 0);
        assert!(syms.get("malloc").is_none(), "imports are not attach points");
        // Independent check of the offset: the bytes at the offset are the bytes the loader
        // maps at the symbol's address, i.e. the same segment-relative position.
        let data = std::fs::read(&exe).unwrap();
        let file = object::File::parse(&*data).unwrap();
        let seg = file.segments().find(|s| main.vaddr >= s.address() && main.vaddr < s.address() + s.size()).unwrap();
        let seg_bytes = seg.data().unwrap();
        let at = (main.vaddr - seg.address()) as usize;
        assert_eq!(&data[main.file_offset as usize..][..16], &seg_bytes[at..][..16]);
    }

    /// Prefixes find a function whatever its parameters, never its split-off parts, and an
    /// exact name is kept under itself.
    #[test]
    fn a_prefix_finds_the_first_whole_function_that_starts_with_it() {
        let names: HashSet<String> = ["_ZN1a1fEv".to_owned()].into();
        let wanted = Wanted { names, prefixes: vec!["_ZN1a5blockE".to_owned()] };
        assert_eq!(wanted.key("_ZN1a1fEv"), Some("_ZN1a1fEv"));
        assert_eq!(wanted.key("_ZN1a5blockERNS_6ParamsEb"), Some("_ZN1a5blockE"));
        assert_eq!(wanted.key("_ZN1a5blockERNS_6ParamsEb.cold"), None);
        assert_eq!(wanted.key("_ZZN1a5blockEvENKUlvE_clEv"), None, "a lambda inside it is not it");
        assert_eq!(wanted.key("_ZN1a6blocksEv"), None);
    }

    #[test]
    fn garbage_is_a_parse_error_not_a_panic() {
        let wanted = Wanted::default();
        assert!(ElfSymbols::parse(b"\x7fELF garbage", &wanted).is_err());
        assert!(ElfSymbols::parse(b"", &wanted).is_err());
    }
}

/// The `DT_NEEDED` names and the `DT_RUNPATH`/`DT_RPATH` folders of an ELF file, as written (with
/// `$ORIGIN` unexpanded).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Dependencies {
    pub needed: Vec<String>,
    pub search: Vec<String>,
}

pub fn dependencies(data: &[u8]) -> Result<Dependencies, object::Error> {
    use object::elf::{DT_NEEDED, DT_RPATH, DT_RUNPATH};
    use object::read::elf::{Dyn, ElfFile64};

    let elf = ElfFile64::<object::Endianness>::parse(data)?;
    let endian = elf.endian();
    let sections = elf.elf_section_table();
    let mut deps = Dependencies::default();
    let Some((entries, link)) = sections.dynamic(endian, data)? else { return Ok(deps) };
    let strings = sections.strings(endian, data, link)?;
    for entry in entries {
        let tag = entry.tag32(endian);
        if !matches!(tag, Some(DT_NEEDED | DT_RPATH | DT_RUNPATH)) {
            continue;
        }
        let Ok(text) = entry.string(endian, strings) else { continue };
        let text = String::from_utf8_lossy(text).into_owned();
        if tag == Some(DT_NEEDED) {
            deps.needed.push(text);
        } else {
            deps.search.extend(text.split(':').filter(|s| !s.is_empty()).map(str::to_owned));
        }
    }
    Ok(deps)
}
