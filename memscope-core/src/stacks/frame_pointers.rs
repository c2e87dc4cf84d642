//! Whether a library keeps frame pointers, for `probes --pid` to say before a trace whether
//! frame-pointer stacks through it will be whole: the share of its functions whose first
//! instructions set one up (x86-64 `mov %rsp,%rbp` in the first 64 bytes: gcc's scheduling and
//! shrink-wrapping may put other instructions before it; arm64 `mov x29, sp` among the first 16
//! instructions). A compiler told to omit frame pointers never writes these. Forwarders that
//! only jump on (a tail call leaves no frame to walk) are not counted either way. No library states
//! how it was compiled, and no crate answers this, so the prologues are read by hand.

use std::path::Path;

use object::{Object, ObjectSection, ObjectSymbol, SymbolKind};

/// What the survey of one file found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Survey {
    /// Functions looked at (symbols of code at least 8 bytes long, but the C runtime's own).
    pub functions: u32,
    /// Those whose prologue sets up a frame pointer.
    pub with_frame_pointer: u32,
}

impl Survey {
    /// Most functions keep one: a frame-pointer walk through this file holds.
    pub fn keeps_frame_pointers(&self) -> bool {
        self.functions > 0 && self.with_frame_pointer * 2 >= self.functions
    }
}

/// The C runtime's start-up and tear-down code, in every program and library and never built
/// with frame pointers: it says nothing of how the file's own code was built.
const CRT: &[&str] = &[
    "_start",
    "_init",
    "_fini",
    "deregister_tm_clones",
    "register_tm_clones",
    "__do_global_dtors_aux",
    "frame_dummy",
    "__libc_csu_init",
    "__libc_csu_fini",
    "_dl_relocate_static_pie",
];

/// How far into a function its frame set-up is looked for.
const PROLOGUE_BYTES: usize = 64;
const MOV_RSP_RBP: [u8; 3] = [0x48, 0x89, 0xe5];
const ENDBR64: [u8; 4] = [0xf3, 0x0f, 0x1e, 0xfa];
const MOV_X29_SP: u32 = 0x9100_03fd;

/// Whether `code` (a function's first bytes) sets up a frame pointer on `arch`; `None` for a
/// forwarder that only jumps on.
pub fn sets_frame_pointer(arch: object::Architecture, code: &[u8]) -> Option<bool> {
    match arch {
        object::Architecture::X86_64 => {
            let body = code.strip_prefix(&ENDBR64[..]).unwrap_or(code);
            if matches!(body.first(), Some(0xe9 | 0xeb)) {
                return None;
            }
            Some(code.windows(3).take(PROLOGUE_BYTES).any(|w| w == MOV_RSP_RBP))
        }
        object::Architecture::Aarch64 => {
            let mut words = code.chunks_exact(4).map(|i| u32::from_le_bytes(i.try_into().expect("4 bytes")));
            // `b <label>`: a tail call.
            if code.len() >= 4 && u32::from_le_bytes(code[..4].try_into().expect("4 bytes")) >> 26 == 0b000101 {
                return None;
            }
            Some(words.by_ref().take(PROLOGUE_BYTES / 4).any(|w| w == MOV_X29_SP))
        }
        _ => Some(false),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SurveyError {
    #[error("cannot read it")]
    Read(#[from] std::io::Error),
    #[error("not an ELF file this tool reads")]
    Parse(#[from] object::Error),
}

/// Surveys a file's functions (its symbol table, else its dynamic one).
pub fn survey(path: &Path) -> Result<Survey, SurveyError> {
    let bytes = std::fs::read(path)?;
    let file = object::File::parse(&*bytes)?;
    let arch = file.architecture();
    let mut out = Survey::default();
    let symbols: Vec<_> =
        if file.symbols().next().is_some() { file.symbols().collect() } else { file.dynamic_symbols().collect() };
    for sym in symbols {
        if sym.kind() != SymbolKind::Text || sym.size() < 8 || sym.name().is_ok_and(|n| CRT.contains(&n)) {
            continue;
        }
        let Some(section) = sym.section_index().and_then(|i| file.section_by_index(i).ok()) else { continue };
        let Ok(data) = section.data() else { continue };
        let Some(at) = sym.address().checked_sub(section.address()) else { continue };
        let len = (sym.size() as usize).min(PROLOGUE_BYTES + 3);
        let Some(code) = data.get(at as usize..).map(|c| &c[..c.len().min(len)]) else { continue };
        let Some(sets) = sets_frame_pointer(arch, code) else { continue };
        out.functions += 1;
        out.with_frame_pointer += u32::from(sets);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use object::Architecture::{Aarch64, X86_64};

    use super::*;

    #[test]
    fn prologues_that_set_up_a_frame_pointer_are_told_from_those_that_do_not() {
        // gcc -O2 -fno-omit-frame-pointer, with and without -fcf-protection.
        let yes = Some(true);
        assert_eq!(sets_frame_pointer(X86_64, &[0x55, 0x48, 0x89, 0xe5, 0x41, 0x54]), yes);
        assert_eq!(sets_frame_pointer(X86_64, &[0xf3, 0x0f, 0x1e, 0xfa, 0x55, 0x48, 0x89, 0xe5]), yes);
        // Scheduled: `push %rbp; lea -0x458(%rip),%rsi; mov %rsp,%rbp`.
        let scheduled = [0x55, 0x48, 0x8d, 0x35, 0xa8, 0xfb, 0xff, 0xff, 0x48, 0x89, 0xe5];
        assert_eq!(sets_frame_pointer(X86_64, &scheduled), yes);
        // Shrink-wrapped: an early exit first (`test %rdi,%rdi; je`), then the frame.
        assert_eq!(sets_frame_pointer(X86_64, &[0x48, 0x85, 0xff, 0x74, 0x10, 0x55, 0x48, 0x89, 0xe5]), yes);
        // gcc -O2 (no frame pointer): `push %rbx; sub $0x10,%rsp`, or straight to work.
        assert_eq!(sets_frame_pointer(X86_64, &[0x53, 0x48, 0x83, 0xec, 0x10]), Some(false));
        assert_eq!(sets_frame_pointer(X86_64, &[0xf3, 0x0f, 0x1e, 0xfa, 0x48, 0x8b, 0x07]), Some(false));
        // A forwarder: `jmp halMemAllocInner`.
        assert_eq!(sets_frame_pointer(X86_64, &[0xe9, 0xab, 0xfa, 0xff, 0xff]), None);
        // arm64: `paciasp; stp x29, x30, [sp, #-16]!; mov x29, sp` against a leaf `add`.
        let words = |w: &[u32]| w.iter().flat_map(|w| w.to_le_bytes()).collect::<Vec<u8>>();
        assert_eq!(sets_frame_pointer(Aarch64, &words(&[0xd503_233f, 0xa9bf_7bfd, 0x9100_03fd])), yes);
        assert_eq!(sets_frame_pointer(Aarch64, &words(&[0x8b01_0000, 0xd65f_03c0])), Some(false));
        assert_eq!(sets_frame_pointer(Aarch64, &words(&[0x1400_0010])), None, "`b` on: a tail call");
    }

    #[test]
    fn a_share_of_half_or_more_keeps_frame_pointers() {
        assert!(Survey { functions: 10, with_frame_pointer: 9 }.keeps_frame_pointers());
        assert!(!Survey { functions: 10, with_frame_pointer: 1 }.keeps_frame_pointers());
        assert!(!Survey::default().keeps_frame_pointers(), "no function: nothing to say it does");
    }
}
