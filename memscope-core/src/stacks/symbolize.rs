//! Normalized frames to functions, source lines and inlined calls, read from the files with
//! blazesym (ELF symbols, DWARF where there is debug information, in the file or in a separate
//! debug file under the debug folders).
//!
//! Runs on the store's thread: blazesym's `Symbolizer` is neither `Send` nor `Sync`, and the
//! store is where the text is needed. Each file is checked once against the build id the
//! capture saw: a file changed on disk since then is reported as changed, never read for
//! symbols that would belong to another build. Results are cached per (file, offset).

use std::path::PathBuf;
use std::sync::Arc;

use blazesym::symbolize::source::{Elf, Source};
use blazesym::symbolize::{Input, Symbolized, Symbolizer as Blazesym};
use foldhash::{HashMap, HashMapExt};

use super::{Frame, Module};

/// One function of a frame: the frame's own, or one inlined into it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Symbol {
    pub name: String,
    /// Bytes from the function's start (for an inlined function: 0, it has no start of its own).
    pub offset: u64,
    pub file: Option<String>,
    pub line: Option<u32>,
    /// Inlined into the next symbol of the frame.
    pub inlined: bool,
}

/// What symbolization made of one frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resolved {
    /// Innermost first: the inlined functions, then the function the address lies in.
    Symbols(Arc<[Symbol]>),
    /// The file has no symbol for the address.
    NoSymbol,
    /// The address was in no file (anonymous memory, JIT code).
    NoFile,
    /// The file is gone, or is another build than the one traced.
    Changed,
}

/// The file's state as the symbolizer found it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FileCheck {
    Same,
    Changed,
}

pub struct Symbolizer {
    inner: Blazesym,
    checked: HashMap<Arc<Module>, FileCheck>,
    /// (file offset, size, address) of the loadable segments of files symbolized from their
    /// debug file, whose offsets are not the stripped file's: there the address is asked.
    segments: HashMap<Arc<Module>, Vec<(u64, u64, u64)>>,
    cache: HashMap<(Arc<Module>, u64), Resolved>,
}

impl Symbolizer {
    /// A symbolizer that also looks for separate debug files in `debug_dirs` (as `--debug-dir`
    /// does for the attach code), after the standard folders.
    pub fn new(debug_dirs: &[PathBuf]) -> Self {
        let mut dirs: Vec<PathBuf> = vec!["/usr/lib/debug".into(), "/lib/debug".into()];
        dirs.extend(debug_dirs.iter().cloned());
        let inner = Blazesym::builder()
            .enable_code_info(true)
            .enable_inlined_fns(true)
            .enable_demangling(true)
            .set_debug_dirs(Some(dirs))
            .build();
        Self { inner, checked: HashMap::new(), segments: HashMap::new(), cache: HashMap::new() }
    }

    /// Resolves every frame of a stack, in order.
    pub fn frames(&mut self, frames: &[Frame]) -> Vec<Resolved> {
        frames.iter().map(|f| self.frame(f)).collect()
    }

    fn frame(&mut self, frame: &Frame) -> Resolved {
        let Some((module, offset)) = &frame.module else { return Resolved::NoFile };
        if self.check(module) == FileCheck::Changed {
            return Resolved::Changed;
        }
        let key = (module.clone(), *offset);
        if let Some(done) = self.cache.get(&key) {
            return done.clone();
        }
        let resolved = match &module.debug_file {
            Some(debug) => match self.address(module, *offset) {
                Some(addr) => self.via_debug_file(debug, addr),
                None => Resolved::NoSymbol,
            },
            None => self.symbolize(&module.path, Input::FileOffset(&[*offset])),
        };
        self.cache.insert(key, resolved.clone());
        resolved
    }

    fn check(&mut self, module: &Arc<Module>) -> FileCheck {
        *self.checked.entry(module.clone()).or_insert_with(|| match blazesym::helper::read_elf_build_id(&module.path) {
            Ok(now) if now.as_deref() == module.build_id.as_deref() => FileCheck::Same,
            _ => FileCheck::Changed,
        })
    }

    /// The address (as the file states it) of a file offset, from the file's segments.
    fn address(&mut self, module: &Arc<Module>, offset: u64) -> Option<u64> {
        use object::{Object, ObjectSegment};
        let segments = self.segments.entry(module.clone()).or_insert_with(|| {
            let Ok(bytes) = std::fs::read(&module.path) else { return Vec::new() };
            let Ok(file) = object::File::parse(&*bytes) else { return Vec::new() };
            file.segments().map(|s| (s.file_range().0, s.file_range().1, s.address())).collect()
        });
        segments.iter().find(|(o, size, _)| (*o..o + size).contains(&offset)).map(|(o, _, addr)| addr + (offset - o))
    }

    /// A stripped file's frame, from its debug file: the function's name and offset from the
    /// debug file's ELF symbol table (its DWARF gives C++ methods only their short name, and no
    /// start), the lines and inlined calls from its DWARF.
    fn via_debug_file(&self, debug: &std::path::Path, addr: u64) -> Resolved {
        let resolved = self.symbolize(debug, Input::VirtOffset(&[addr]));
        let mut elf = Elf::new(debug);
        elf.debug_syms = false;
        let named = self.inner.symbolize(&Source::Elf(elf), Input::VirtOffset(&[addr]));
        let (Resolved::Symbols(symbols), Ok(mut named)) = (&resolved, named) else { return resolved };
        let Some(Symbolized::Sym(sym)) = named.pop() else { return resolved };
        let mut symbols = symbols.to_vec();
        if let Some(own) = symbols.last_mut() {
            own.name = sym.name.to_string();
            own.offset = sym.offset as u64;
        }
        Resolved::Symbols(symbols.into())
    }

    fn symbolize(&self, path: &std::path::Path, input: Input<&[u64]>) -> Resolved {
        let src = Source::Elf(Elf::new(path));
        let Ok(mut out) = self.inner.symbolize(&src, input) else { return Resolved::NoSymbol };
        let Some(Symbolized::Sym(sym)) = out.pop() else { return Resolved::NoSymbol };
        let code = |info: Option<&blazesym::symbolize::CodeInfo<'_>>| {
            info.map_or((None, None), |c| (Some(c.to_path().display().to_string()), c.line))
        };
        // blazesym names the function the address lies in (`sym`) and the calls inlined into it,
        // outermost first, each with its own place: the outer function's is its call of the
        // first inlined one, the innermost's is the address's line (checked against the
        // stack-chain stand-in's `__LINE__`s). A stack reads innermost first.
        let names = sym.inlined.iter().rev().map(|f| (f.name.to_string(), true)).chain([(sym.name.to_string(), false)]);
        let places =
            sym.inlined.iter().rev().map(|f| code(f.code_info.as_ref())).chain([code(sym.code_info.as_deref())]);
        let symbols: Vec<Symbol> = names
            .zip(places)
            .map(|((name, inlined), (file, line))| Symbol {
                name,
                offset: if inlined { 0 } else { sym.offset as u64 },
                file,
                line,
                inlined,
            })
            .collect();
        Resolved::Symbols(symbols.into())
    }
}

#[cfg(test)]
mod tests {
    //! Against this test binary itself: the functions below are where the compiler put them, so
    //! their names are known without asking the code under test.

    use super::*;
    use crate::stacks::capture::{Capture, RawStack};

    #[inline(never)]
    fn a_function_the_symbolizer_must_name() -> u64 {
        std::hint::black_box(7)
    }

    #[test]
    fn an_address_of_this_process_normalizes_to_its_file_and_symbolizes_to_its_function() {
        let addr = (a_function_the_symbolizer_must_name as fn() -> u64) as usize as u64;
        let mut capture = Capture::default();
        let raw = RawStack { pid: std::process::id(), return_address: 0, ips: &[addr], at_depth: false, failed: false };
        let (id, stack) = capture.stack(&raw);
        let stack = stack.expect("new");
        let exe = std::fs::canonicalize(std::env::current_exe().unwrap()).unwrap();
        let (module, _) = stack.frames[0].module.as_ref().expect("in the test binary");
        assert_eq!(std::fs::canonicalize(&module.path).unwrap(), exe);
        assert_eq!(capture.stack(&raw), (id, None), "the same stack again is the same id, not sent twice");

        let resolved = Symbolizer::new(&[]).frames(&stack.frames);
        let Resolved::Symbols(symbols) = &resolved[0] else { panic!("{resolved:?}") };
        let own = symbols.last().unwrap();
        assert!(own.name.ends_with("a_function_the_symbolizer_must_name"), "{own:?}");
        assert_eq!(own.offset, 0, "the function's own address is its start");
        assert!(own.file.as_deref().is_some_and(|f| f.ends_with("symbolize.rs")), "{own:?}");
    }

    #[test]
    fn a_file_that_is_not_the_build_traced_is_reported_changed_not_read() {
        let exe = std::env::current_exe().unwrap();
        let module = Arc::new(Module { path: exe, build_id: Some(vec![0xde, 0xad]), debug_file: None });
        let frame = Frame { addr: 0x1000, module: Some((module, 0x1000)), returns: false };
        assert_eq!(Symbolizer::new(&[]).frames(std::slice::from_ref(&frame)), [Resolved::Changed]);
        let gone = Arc::new(Module { path: "/nonexistent/libgone.so".into(), build_id: None, debug_file: None });
        let frame = Frame { module: Some((gone, 0x10)), ..frame };
        assert_eq!(Symbolizer::new(&[]).frames(&[frame]), [Resolved::Changed], "a file gone is not the file traced");
    }
}
