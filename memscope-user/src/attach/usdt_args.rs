//! Decoding a USDT note's argument string into the [`UsdtArg`] locations the BPF side follows.
//!
//! The note gives each argument as `[-]size@location`, where the location is whatever operand
//! text the compiler printed for the inline-asm operand: a register, an immediate or a memory
//! operand, in the target's assembler syntax. A BPF program cannot parse text, and the same probe
//! can have different locations at each call site, so userspace decodes every site's string here,
//! once, into plain numbers (a `pt_regs` offset, a displacement, a shift) that the BPF side applies
//! without knowing the architecture.
//!
//! Every register name maps to the `pt_regs` slot of its full 64-bit register: a sub-register is
//! the low part of that slot, and the `bitshift` derived from the declared size cuts the value
//! down to the right width and extension. That is also why `%ah`-style high-byte registers are
//! refused: they are not the low bits of any slot.
//!
//! Anything this module cannot express as a [`UsdtArg`] is an error naming the item, never a
//! guess: a wrong location would silently record garbage, which is worse than a probe that is
//! reported as unusable.

// Outside tests nothing calls this yet: the USDT attach path in the loader is the next step.

use std::sync::atomic::{AtomicU8, Ordering};

use memscope_common::usdt::{arg_kind, UsdtArg, UsdtSpec, USDT_MAX_ARGS};
use thiserror::Error;

/// The assembler syntax and `pt_regs` layout an argument string is written for. It is the
/// traced file's architecture, which for a tracer that attaches to local processes is the host's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arch {
    /// AT&T syntax, `struct pt_regs` of x86-64.
    X86_64,
    /// GNU aarch64 syntax, `struct user_pt_regs` (`regs[31]`, `sp`, `pc`, `pstate`).
    Aarch64,
}

/// [`Arch::of_files`]: 0 for the host's, else the [`Arch`] set by [`Arch::read_files_as`].
static FILES_ARCH: AtomicU8 = AtomicU8::new(0);

impl Arch {
    /// The architecture this binary runs on, or `None` where USDT arguments are not decoded.
    pub const fn host() -> Option<Self> {
        if cfg!(target_arch = "x86_64") {
            Some(Self::X86_64)
        } else if cfg!(target_arch = "aarch64") {
            Some(Self::Aarch64)
        } else {
            None
        }
    }

    /// The architecture whose files are read (ELF machine, USDT argument syntax): the host's,
    /// for everything that attaches; another only for `probes --lib --arch`, which checks an
    /// aarch64 wheel's libraries from an x86-64 machine (or the reverse) and attaches nothing.
    pub fn of_files() -> Option<Self> {
        match FILES_ARCH.load(Ordering::Relaxed) {
            1 => Some(Self::X86_64),
            2 => Some(Self::Aarch64),
            _ => Self::host(),
        }
    }

    /// Reads files as `arch`'s from now on (`probes --lib --arch`, before it reads any).
    pub fn read_files_as(arch: Self) {
        FILES_ARCH.store(if arch == Self::X86_64 { 1 } else { 2 }, Ordering::Relaxed);
    }

    /// As ELF headers and `uname -m` name it.
    pub fn name(self) -> &'static str {
        match self {
            Self::X86_64 => "x86-64",
            Self::Aarch64 => "aarch64",
        }
    }
}

/// Why one `size@location` item was rejected.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum ArgProblem {
    #[error("expected `[-]size@location`")]
    MissingAt,
    #[error("size `{0}` is not 1, 2, 4 or 8 (negative for signed)")]
    BadSize(String),
    #[error("unknown register `{0}`")]
    UnknownRegister(String),
    #[error("`{0}` is not a decimal or 0x-hexadecimal number that fits in 64 bits")]
    BadNumber(String),
    #[error("SIB scale `{0}` is not 1, 2, 4 or 8")]
    BadScale(String),
    #[error("cannot parse the location")]
    BadLocation,
    #[error("unsupported: `%rip`-relative operands address globals, which needs symbol resolution")]
    RipRelative,
    #[error("unsupported: high-byte register `{0}` is not the low part of any pt_regs slot")]
    HighByteRegister(String),
    #[error("unsupported: memory operand without a base register")]
    NoBaseRegister,
    #[error("unsupported: register-indexed memory operands on aarch64")]
    Aarch64RegisterIndex,
}

impl ArgProblem {
    /// True for valid assembler operands this decoder deliberately does not handle, as opposed to
    /// text that is not a USDT argument at all.
    #[cfg_attr(not(test), expect(dead_code, reason = "for callers that word the two cases differently"))]
    pub fn is_unsupported(&self) -> bool {
        matches!(
            self,
            Self::RipRelative | Self::HighByteRegister(_) | Self::NoBaseRegister | Self::Aarch64RegisterIndex
        )
    }
}

#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum UsdtArgError {
    #[error("USDT argument {index} `{item}`: {problem}")]
    Item { index: usize, item: String, problem: ArgProblem },
    /// Reading only the first arguments would make the others look like zeros to whoever
    /// interprets the record, so a longer list is refused as a whole.
    #[error("the note declares {count} arguments; at most {max} can be read", max = USDT_MAX_ARGS)]
    TooMany { count: usize },
    #[error("text argument {index} does not exist: the site has {count} arguments")]
    TextArgOutOfRange { index: usize, count: usize },
    /// The BPF side copies a string from the address the argument holds; anything narrower than
    /// a pointer cannot be one.
    #[error("text argument {index} is {size} bytes wide, not a pointer (8 bytes)")]
    TextArgNotPointer { index: usize, size: u8 },
}

/// Decodes a note's argument string. An empty (or all-blank) string is a probe without arguments.
pub fn parse_args(text: &str, arch: Arch) -> Result<Vec<UsdtArg>, UsdtArgError> {
    let items = split_items(text);
    if items.len() > USDT_MAX_ARGS {
        return Err(UsdtArgError::TooMany { count: items.len() });
    }
    items
        .into_iter()
        .enumerate()
        .map(|(index, item)| {
            parse_item(item, arch).map_err(|problem| UsdtArgError::Item { index, item: item.to_owned(), problem })
        })
        .collect()
}

/// Packs one site's decoded arguments into the map value the BPF side reads. `text_arg` is the
/// argument whose pointee string goes into the record; `probe` is userspace's id for the probe.
pub fn build_spec(args: &[UsdtArg], text_arg: Option<usize>, probe: u32) -> Result<UsdtSpec, UsdtArgError> {
    if args.len() > USDT_MAX_ARGS {
        return Err(UsdtArgError::TooMany { count: args.len() });
    }
    let mut spec = UsdtSpec { probe, ..UsdtSpec::EMPTY };
    spec.args[..args.len()].copy_from_slice(args);
    spec.arg_count = args.len() as u32;
    if let Some(index) = text_arg {
        let arg = args.get(index).ok_or(UsdtArgError::TextArgOutOfRange { index, count: args.len() })?;
        if arg.bitshift != 0 {
            return Err(UsdtArgError::TextArgNotPointer { index, size: (64 - arg.bitshift) / 8 });
        }
        spec.text_arg = index as i32;
    }
    Ok(spec)
}

/// Splits on blanks, except inside brackets: aarch64 memory operands are printed as `[sp, 16]`.
fn split_items(text: &str) -> Vec<&str> {
    let mut items = Vec::new();
    let mut depth = 0usize;
    let mut start = None;
    for (i, c) in text.char_indices() {
        match c {
            '[' | '(' => depth += 1,
            ']' | ')' => depth = depth.saturating_sub(1),
            _ => {}
        }
        if c.is_ascii_whitespace() && depth == 0 {
            if let Some(s) = start.take() {
                items.push(&text[s..i]);
            }
        } else if start.is_none() {
            start = Some(i);
        }
    }
    if let Some(s) = start {
        items.push(&text[s..]);
    }
    items
}

fn parse_item(item: &str, arch: Arch) -> Result<UsdtArg, ArgProblem> {
    let (size, location) = item.split_once('@').ok_or(ArgProblem::MissingAt)?;
    let (signed, bytes) = match size.strip_prefix('-') {
        Some(rest) => (1, rest),
        None => (0, size),
    };
    let bitshift = match bytes {
        "1" => 56,
        "2" => 48,
        "4" => 32,
        "8" => 0,
        _ => return Err(ArgProblem::BadSize(size.to_owned())),
    };
    let mut arg = match arch {
        Arch::X86_64 => x86::location(location)?,
        Arch::Aarch64 => aarch64::location(location)?,
    };
    arg.signed = signed;
    arg.bitshift = bitshift;
    Ok(arg)
}

/// A decimal or `0x` hexadecimal number with an optional minus sign. Values up to `u64::MAX` are
/// accepted and reinterpreted as `i64`: an 8-byte unsigned constant is the same 64 bits.
fn number(text: &str) -> Result<i64, ArgProblem> {
    let bad = || ArgProblem::BadNumber(text.to_owned());
    let (negative, digits) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let magnitude = match digits.strip_prefix("0x").or_else(|| digits.strip_prefix("0X")) {
        Some(hex) if !hex.is_empty() && hex.bytes().all(|b| b.is_ascii_hexdigit()) => u64::from_str_radix(hex, 16),
        None if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) => digits.parse::<u64>(),
        _ => return Err(bad()),
    }
    .map_err(|_| bad())?;
    if negative {
        // -2^63 is the most negative value; its magnitude does not fit in i64 but does in u64.
        if magnitude > 1 << 63 {
            return Err(bad());
        }
        Ok((magnitude as i64).wrapping_neg())
    } else {
        Ok(magnitude as i64)
    }
}

fn constant(val_off: i64) -> UsdtArg {
    UsdtArg { kind: arg_kind::CONST, val_off, ..UsdtArg::default() }
}

fn register(reg_off: u16) -> UsdtArg {
    UsdtArg { kind: arg_kind::REG, reg_off, ..UsdtArg::default() }
}

fn deref(reg_off: u16, val_off: i64) -> UsdtArg {
    UsdtArg { kind: arg_kind::REG_DEREF, reg_off, val_off, ..UsdtArg::default() }
}

mod x86 {
    use super::*;

    /// `struct pt_regs` offsets (arch/x86/include/asm/ptrace.h, 64-bit).
    pub(super) const RIP: u16 = 128;

    /// The `pt_regs` slot of a register name without its `%`. `Err` for names that are
    /// registers but cannot be read as a slot's low bits.
    pub(super) fn reg_offset(name: &str) -> Result<u16, ArgProblem> {
        let legacy = |full: &str| -> Option<u16> {
            Some(match full {
                "ax" => 80,
                "bx" => 40,
                "cx" => 88,
                "dx" => 96,
                "si" => 104,
                "di" => 112,
                "bp" => 32,
                "sp" => 152,
                _ => return None,
            })
        };
        if matches!(name, "ah" | "bh" | "ch" | "dh") {
            return Err(ArgProblem::HighByteRegister(name.to_owned()));
        }
        if name == "rip" {
            return Ok(RIP);
        }
        // r8..r15 with the optional d/w/b suffix.
        if let Some(rest) = name.strip_prefix('r') {
            let digits = rest.trim_end_matches(['d', 'w', 'b']);
            // At most one suffix letter.
            if rest.len() - digits.len() <= 1 {
                let off = match digits {
                    "8" => Some(72),
                    "9" => Some(64),
                    "10" => Some(56),
                    "11" => Some(48),
                    "12" => Some(24),
                    "13" => Some(16),
                    "14" => Some(8),
                    "15" => Some(0),
                    _ => None,
                };
                if let Some(off) = off {
                    return Ok(off);
                }
            }
        }
        // rax/eax/ax, and the two low-byte naming schemes: al..dl, sil/dil/bpl/spl.
        let full = match name.len() {
            3 if name.starts_with('r') || name.starts_with('e') => legacy(&name[1..]),
            2 => legacy(name).or(match name {
                "al" => Some(80),
                "bl" => Some(40),
                "cl" => Some(88),
                "dl" => Some(96),
                _ => None,
            }),
            3 if name.ends_with('l') => legacy(&name[..2]).filter(|_| matches!(name, "sil" | "dil" | "bpl" | "spl")),
            _ => None,
        };
        full.ok_or_else(|| ArgProblem::UnknownRegister(format!("%{name}")))
    }

    /// `%name` → the slot; `rip` is refused here because every use of it as a base or index
    /// addresses a global.
    fn operand_reg(text: &str) -> Result<u16, ArgProblem> {
        let name = text.strip_prefix('%').ok_or(ArgProblem::BadLocation)?;
        match reg_offset(name)? {
            RIP => Err(ArgProblem::RipRelative),
            off => Ok(off),
        }
    }

    pub(super) fn location(text: &str) -> Result<UsdtArg, ArgProblem> {
        if let Some(imm) = text.strip_prefix('$') {
            return Ok(constant(number(imm)?));
        }
        if let Some(name) = text.strip_prefix('%') {
            return Ok(register(reg_offset(name)?));
        }
        // disp(base[,index[,scale]])
        let open = text.find('(').ok_or(ArgProblem::BadLocation)?;
        let inner = text[open + 1..].strip_suffix(')').ok_or(ArgProblem::BadLocation)?;
        let parts: Vec<&str> = inner.split(',').collect();
        // Check %rip before the displacement: `sym+8(%rip)` has a symbolic displacement, and
        // "needs symbol resolution" is the useful message for it, not "bad number".
        if parts.contains(&"%rip") {
            return Err(ArgProblem::RipRelative);
        }
        let disp = &text[..open];
        let val_off = if disp.is_empty() { 0 } else { number(disp)? };
        match parts.as_slice() {
            [base] => Ok(deref(operand_reg(base)?, val_off)),
            [base, index] | [base, index, _] => {
                if base.is_empty() {
                    // Validate the rest anyway so the message is about the real problem.
                    operand_reg(index)?;
                    return Err(ArgProblem::NoBaseRegister);
                }
                let scale_shift = match parts.get(2).copied() {
                    None | Some("1") => 0,
                    Some("2") => 1,
                    Some("4") => 2,
                    Some("8") => 3,
                    Some(other) => return Err(ArgProblem::BadScale(other.to_owned())),
                };
                Ok(UsdtArg {
                    kind: arg_kind::SIB,
                    reg_off: operand_reg(base)?,
                    idx_reg_off: operand_reg(index)?,
                    val_off,
                    scale_shift,
                    ..UsdtArg::default()
                })
            }
            _ => Err(ArgProblem::BadLocation),
        }
    }
}

mod aarch64 {
    use super::*;

    /// `struct user_pt_regs`: `regs[31]` then `sp`.
    const SP: u16 = 31 * 8;

    fn reg_offset(name: &str) -> Result<u16, ArgProblem> {
        if name == "sp" {
            return Ok(SP);
        }
        let digits = name.strip_prefix('x').or_else(|| name.strip_prefix('w'));
        match digits {
            // No leading zeros or signs: `x01` is not a register name the assembler prints.
            Some(d) if !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()) && (d == "0" || !d.starts_with('0')) => {
                match d.parse::<u16>() {
                    Ok(n) if n <= 30 => Ok(n * 8),
                    _ => Err(ArgProblem::UnknownRegister(name.to_owned())),
                }
            }
            _ => Err(ArgProblem::UnknownRegister(name.to_owned())),
        }
    }

    fn immediate(text: &str) -> Result<i64, ArgProblem> {
        number(text.strip_prefix('#').unwrap_or(text))
    }

    pub(super) fn location(text: &str) -> Result<UsdtArg, ArgProblem> {
        if let Some(inner) = text.strip_prefix('[') {
            let inner = inner.strip_suffix(']').ok_or(ArgProblem::BadLocation)?;
            let (base, off) = match inner.split_once(',') {
                Some((base, off)) => (base.trim(), Some(off.trim())),
                None => (inner.trim(), None),
            };
            let reg_off = reg_offset(base)?;
            let val_off = match off {
                None => 0,
                Some(off) if reg_offset(off).is_ok() => return Err(ArgProblem::Aarch64RegisterIndex),
                Some(off) => immediate(off)?,
            };
            return Ok(deref(reg_off, val_off));
        }
        let first = text.as_bytes().first().copied().ok_or(ArgProblem::BadLocation)?;
        if first == b'#' || first == b'-' || first.is_ascii_digit() {
            return Ok(constant(immediate(text)?));
        }
        Ok(register(reg_offset(text)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn one(text: &str, arch: Arch) -> UsdtArg {
        let args = parse_args(text, arch).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(args.len(), 1, "{text}");
        args[0]
    }

    fn problem(text: &str, arch: Arch) -> ArgProblem {
        match parse_args(text, arch) {
            Err(UsdtArgError::Item { problem, item, .. }) => {
                assert_eq!(item, text.trim(), "the error names the item");
                problem
            }
            other => panic!("{text}: expected an item error, got {other:?}"),
        }
    }

    fn reg(reg_off: u16, size: u8, signed: bool) -> UsdtArg {
        UsdtArg { kind: arg_kind::REG, reg_off, bitshift: 64 - 8 * size, signed: signed as u8, ..UsdtArg::default() }
    }

    /// Every x86-64 register family with its pt_regs offset (from arch/x86/include/asm/ptrace.h,
    /// written out independently of the decoder's tables).
    const X86_FAMILIES: &[(u16, [&str; 4])] = &[
        (80, ["rax", "eax", "ax", "al"]),
        (40, ["rbx", "ebx", "bx", "bl"]),
        (88, ["rcx", "ecx", "cx", "cl"]),
        (96, ["rdx", "edx", "dx", "dl"]),
        (104, ["rsi", "esi", "si", "sil"]),
        (112, ["rdi", "edi", "di", "dil"]),
        (32, ["rbp", "ebp", "bp", "bpl"]),
        (152, ["rsp", "esp", "sp", "spl"]),
        (72, ["r8", "r8d", "r8w", "r8b"]),
        (64, ["r9", "r9d", "r9w", "r9b"]),
        (56, ["r10", "r10d", "r10w", "r10b"]),
        (48, ["r11", "r11d", "r11w", "r11b"]),
        (24, ["r12", "r12d", "r12w", "r12b"]),
        (16, ["r13", "r13d", "r13w", "r13b"]),
        (8, ["r14", "r14d", "r14w", "r14b"]),
        (0, ["r15", "r15d", "r15w", "r15b"]),
    ];

    #[test]
    fn x86_every_register_family() {
        for (off, names) in X86_FAMILIES {
            for (name, size) in names.iter().zip([8u8, 4, 2, 1]) {
                assert_eq!(one(&format!("-{size}@%{name}"), Arch::X86_64), reg(*off, size, true), "{name}");
                assert_eq!(one(&format!("{size}@%{name}"), Arch::X86_64), reg(*off, size, false), "{name}");
            }
        }
        assert_eq!(one("8@%rip", Arch::X86_64), reg(128, 8, false));
    }

    #[test]
    fn x86_typical_gcc_strings() {
        let args = parse_args("-4@%edi 8@%rsi -4@-20(%rbp) 8@$0x10 1@%al", Arch::X86_64).unwrap();
        assert_eq!(
            args,
            vec![
                reg(112, 4, true),
                reg(104, 8, false),
                UsdtArg {
                    kind: arg_kind::REG_DEREF,
                    reg_off: 32,
                    val_off: -20,
                    bitshift: 32,
                    signed: 1,
                    ..Default::default()
                },
                UsdtArg { kind: arg_kind::CONST, val_off: 16, bitshift: 0, ..Default::default() },
                reg(80, 1, false),
            ]
        );
    }

    #[test]
    fn x86_immediates() {
        let c = |t: &str| one(t, Arch::X86_64).val_off;
        assert_eq!(c("8@$0"), 0);
        assert_eq!(c("-4@$-1"), -1);
        assert_eq!(c("8@$0xff"), 255);
        assert_eq!(c("8@$-0x10"), -16);
        assert_eq!(c("8@$18446744073709551615"), -1);
        assert_eq!(c("-8@$-9223372036854775808"), i64::MIN);
        assert_eq!(c("8@$0xFFFFFFFFFFFFFFFF"), -1);
        assert_eq!(one("-2@$5", Arch::X86_64).kind, arg_kind::CONST);
    }

    #[test]
    fn x86_memory_operands() {
        let m = |t: &str| one(t, Arch::X86_64);
        let d = |reg_off, val_off, size: u8, signed: u8| UsdtArg {
            kind: arg_kind::REG_DEREF,
            reg_off,
            val_off,
            bitshift: 64 - 8 * size,
            signed,
            ..Default::default()
        };
        assert_eq!(m("8@(%rax)"), d(80, 0, 8, 0));
        assert_eq!(m("-4@-4(%rbp)"), d(32, -4, 4, 1));
        assert_eq!(m("2@0x18(%r12)"), d(24, 0x18, 2, 0));
        assert_eq!(m("1@-0x8(%rsp)"), d(152, -8, 1, 0));
        // A 32-bit base register (address-size prefix) still names the same slot.
        assert_eq!(m("8@8(%edi)"), d(112, 8, 8, 0));
    }

    #[test]
    fn x86_sib_operands() {
        let s = |t: &str| one(t, Arch::X86_64);
        let sib = |reg_off, idx_reg_off, val_off, scale_shift, size: u8| UsdtArg {
            kind: arg_kind::SIB,
            reg_off,
            idx_reg_off,
            val_off,
            scale_shift,
            bitshift: 64 - 8 * size,
            ..Default::default()
        };
        assert_eq!(s("8@(%rax,%rbx)"), sib(80, 40, 0, 0, 8));
        assert_eq!(s("8@(%rax,%rbx,1)"), sib(80, 40, 0, 0, 8));
        assert_eq!(s("4@16(%rdx,%rcx,2)"), sib(96, 88, 16, 1, 4));
        assert_eq!(s("2@-0x20(%r8,%r15,4)"), sib(72, 0, -32, 2, 2));
        assert_eq!(s("1@0x7(%rsp,%rsi,8)"), sib(152, 104, 7, 3, 1));
    }

    #[test]
    fn x86_unsupported_forms_say_so() {
        for (text, want) in [
            ("8@sym(%rip)", ArgProblem::RipRelative),
            ("8@sym+8(%rip)", ArgProblem::RipRelative),
            ("-4@0x10(%rip)", ArgProblem::RipRelative),
            ("8@(%rip)", ArgProblem::RipRelative),
            ("1@%ah", ArgProblem::HighByteRegister("ah".into())),
            ("1@%bh", ArgProblem::HighByteRegister("bh".into())),
            ("1@%ch", ArgProblem::HighByteRegister("ch".into())),
            ("1@%dh", ArgProblem::HighByteRegister("dh".into())),
            ("8@16(,%rax,8)", ArgProblem::NoBaseRegister),
        ] {
            let got = problem(text, Arch::X86_64);
            assert_eq!(got, want, "{text}");
            assert!(got.is_unsupported(), "{text}");
        }
    }

    #[test]
    fn x86_malformed_items() {
        for (text, want) in [
            ("%rdi", ArgProblem::MissingAt),
            ("3@%rdi", ArgProblem::BadSize("3".into())),
            ("16@%rdi", ArgProblem::BadSize("16".into())),
            ("-@%rdi", ArgProblem::BadSize("-".into())),
            ("@%rdi", ArgProblem::BadSize("".into())),
            ("+4@%rdi", ArgProblem::BadSize("+4".into())),
            ("8@%rzz", ArgProblem::UnknownRegister("%rzz".into())),
            ("8@%r16", ArgProblem::UnknownRegister("%r16".into())),
            ("8@%r8dd", ArgProblem::UnknownRegister("%r8dd".into())),
            ("8@%xmm0", ArgProblem::UnknownRegister("%xmm0".into())),
            ("8@%sih", ArgProblem::UnknownRegister("%sih".into())),
            ("8@$", ArgProblem::BadNumber("".into())),
            ("8@$0x", ArgProblem::BadNumber("0x".into())),
            ("8@$12a", ArgProblem::BadNumber("12a".into())),
            ("8@$--1", ArgProblem::BadNumber("--1".into())),
            ("8@$18446744073709551616", ArgProblem::BadNumber("18446744073709551616".into())),
            ("8@$-9223372036854775809", ArgProblem::BadNumber("-9223372036854775809".into())),
            ("8@sym(%rax)", ArgProblem::BadNumber("sym".into())),
            ("8@(%rax,%rbx,3)", ArgProblem::BadScale("3".into())),
            ("8@(%rax,%rbx,)", ArgProblem::BadScale("".into())),
            ("8@(%rax", ArgProblem::BadLocation),
            ("8@(rax)", ArgProblem::BadLocation),
            ("8@()", ArgProblem::BadLocation),
            ("8@(%rax,%rbx,1,2)", ArgProblem::BadLocation),
            ("8@0x1000", ArgProblem::BadLocation),
            ("8@", ArgProblem::BadLocation),
        ] {
            let got = problem(text, Arch::X86_64);
            assert_eq!(got, want, "{text}");
            assert!(!got.is_unsupported(), "{text}");
        }
    }

    #[test]
    fn aarch64_forms() {
        let a = |t: &str| one(t, Arch::Aarch64);
        for n in 0..=30u16 {
            assert_eq!(a(&format!("8@x{n}")), reg(8 * n, 8, false));
            assert_eq!(a(&format!("-4@w{n}")), reg(8 * n, 4, true));
        }
        assert_eq!(a("8@sp"), reg(248, 8, false));
        let d = |reg_off, val_off, size: u8, signed: u8| UsdtArg {
            kind: arg_kind::REG_DEREF,
            reg_off,
            val_off,
            bitshift: 64 - 8 * size,
            signed,
            ..Default::default()
        };
        assert_eq!(a("8@[x0]"), d(0, 0, 8, 0));
        assert_eq!(a("-4@[sp, 12]"), d(248, 12, 4, 1));
        assert_eq!(a("2@[x29, -8]"), d(29 * 8, -8, 2, 0));
        assert_eq!(a("1@[x3,#16]"), d(24, 16, 1, 0));
        assert_eq!(a("8@[x3, #-16]"), d(24, -16, 8, 0));
        let c = |v| UsdtArg { kind: arg_kind::CONST, val_off: v, ..Default::default() };
        assert_eq!(a("8@5"), c(5));
        assert_eq!(a("8@#5"), c(5));
        assert_eq!(a("8@-5"), c(-5));
        assert_eq!(a("8@#-0x10"), c(-16));
    }

    #[test]
    fn aarch64_items_split_on_spaces_outside_brackets() {
        let args = parse_args("-4@[sp, 12] 8@x1  -8@[x2, -8] 4@#7", Arch::Aarch64).unwrap();
        assert_eq!(args.len(), 4);
        assert_eq!(args[0].reg_off, 248);
        assert_eq!(args[2].val_off, -8);
        assert_eq!(args[3].val_off, 7);
    }

    #[test]
    fn aarch64_errors() {
        for (text, want) in [
            ("8@x31", ArgProblem::UnknownRegister("x31".into())),
            ("8@x01", ArgProblem::UnknownRegister("x01".into())),
            ("8@xzr", ArgProblem::UnknownRegister("xzr".into())),
            ("8@%rax", ArgProblem::UnknownRegister("%rax".into())),
            ("8@[x0, x1]", ArgProblem::Aarch64RegisterIndex),
            ("8@[x0, 1", ArgProblem::BadLocation),
            ("8@[x0, #]", ArgProblem::BadNumber("".into())),
            ("8@[]", ArgProblem::UnknownRegister("".into())),
            ("8@", ArgProblem::BadLocation),
            ("8@#", ArgProblem::BadNumber("".into())),
        ] {
            assert_eq!(problem(text, Arch::Aarch64), want, "{text}");
        }
    }

    #[test]
    fn host_arch_is_known_on_supported_targets() {
        if cfg!(target_arch = "x86_64") {
            assert_eq!(Arch::host(), Some(Arch::X86_64));
        } else if cfg!(target_arch = "aarch64") {
            assert_eq!(Arch::host(), Some(Arch::Aarch64));
        }
    }

    #[test]
    fn empty_and_blank_strings_have_no_args() {
        assert_eq!(parse_args("", Arch::X86_64).unwrap(), vec![]);
        assert_eq!(parse_args("  \t ", Arch::Aarch64).unwrap(), vec![]);
    }

    #[test]
    fn too_many_args_is_an_error() {
        let six = ["8@%rax"; USDT_MAX_ARGS].join(" ");
        assert_eq!(parse_args(&six, Arch::X86_64).unwrap().len(), USDT_MAX_ARGS);
        let seven = ["8@%rax"; USDT_MAX_ARGS + 1].join(" ");
        let err = parse_args(&seven, Arch::X86_64).unwrap_err();
        assert_eq!(err, UsdtArgError::TooMany { count: USDT_MAX_ARGS + 1 });
        assert!(err.to_string().contains("at most 6"), "{err}");
    }

    #[test]
    fn error_names_the_item_and_its_index() {
        let err = parse_args("8@%rdi 8@%bogus", Arch::X86_64).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("argument 1") && msg.contains("`8@%bogus`") && msg.contains("%bogus"), "{msg}");
    }

    #[test]
    fn build_spec_packs_args() {
        let args = parse_args("-4@%edi 8@%rsi", Arch::X86_64).unwrap();
        let spec = build_spec(&args, Some(1), 7).unwrap();
        assert_eq!(spec.arg_count, 2);
        assert_eq!(spec.text_arg, 1);
        assert_eq!(spec.probe, 7);
        assert_eq!(&spec.args[..2], &args[..]);
        assert!(spec.args[2..].iter().all(|a| a.kind == arg_kind::NONE));

        let none = build_spec(&[], None, 3).unwrap();
        assert_eq!(none.text_arg, -1);
        assert_eq!(none.arg_count, 0);

        assert_eq!(build_spec(&args, Some(2), 0), Err(UsdtArgError::TextArgOutOfRange { index: 2, count: 2 }));
        assert_eq!(build_spec(&args, Some(0), 0), Err(UsdtArgError::TextArgNotPointer { index: 0, size: 4 }));
        let many = vec![args[1]; USDT_MAX_ARGS + 1];
        assert_eq!(build_spec(&many, None, 0), Err(UsdtArgError::TooMany { count: USDT_MAX_ARGS + 1 }));
    }

    /// One randomly generated argument: its text and the value the decoder must produce.
    fn arb_x86_arg() -> impl Strategy<Value = (String, UsdtArg)> {
        let reg = (0..X86_FAMILIES.len(), 0..4usize).prop_map(|(f, w)| (X86_FAMILIES[f].1[w], X86_FAMILIES[f].0));
        let size = (prop::sample::select(vec![1u8, 2, 4, 8]), any::<bool>());
        let disp = prop_oneof![Just(None), any::<i32>().prop_map(Some)];
        let hex = any::<bool>();
        let location = prop_oneof![
            reg.clone().prop_map(|(name, off)| (format!("%{name}"), register(off))),
            (any::<i64>(), hex).prop_map(|(v, hex)| (format!("${}", render(v, hex)), constant(v))),
            (reg.clone(), disp.clone(), hex).prop_map(|((name, off), d, hex)| {
                (
                    format!("{}(%{name})", d.map(|d| render(d as i64, hex)).unwrap_or_default()),
                    deref(off, d.unwrap_or(0) as i64),
                )
            }),
            (reg.clone(), reg, disp, hex, prop::option::of(0u8..4)).prop_map(
                |((b, boff), (i, ioff), d, hex, scale)| {
                    let scale_text = scale.map(|s| format!(",{}", 1u8 << s)).unwrap_or_default();
                    let text =
                        format!("{}(%{b},%{i}{scale_text})", d.map(|d| render(d as i64, hex)).unwrap_or_default());
                    let arg = UsdtArg {
                        kind: arg_kind::SIB,
                        reg_off: boff,
                        idx_reg_off: ioff,
                        val_off: d.unwrap_or(0) as i64,
                        scale_shift: scale.unwrap_or(0),
                        ..Default::default()
                    };
                    (text, arg)
                }
            ),
        ];
        (size, location).prop_map(|((size, signed), (loc, arg))| with_size(size, signed, loc, arg))
    }

    fn arb_aarch64_arg() -> impl Strategy<Value = (String, UsdtArg)> {
        let reg = prop_oneof![
            (0u16..=30, any::<bool>()).prop_map(|(n, w)| (format!("{}{n}", if w { 'w' } else { 'x' }), n * 8)),
            Just(("sp".to_owned(), 248)),
        ];
        let size = (prop::sample::select(vec![1u8, 2, 4, 8]), any::<bool>());
        let location = prop_oneof![
            reg.clone().prop_map(|(name, off)| (name, register(off))),
            (any::<i64>(), any::<bool>())
                .prop_map(|(v, hash)| (format!("{}{v}", if hash { "#" } else { "" }), constant(v))),
            reg.clone().prop_map(|(name, off)| (format!("[{name}]"), deref(off, 0))),
            (reg, any::<i32>(), any::<bool>()).prop_map(|((name, off), d, hash)| {
                (format!("[{name}, {}{d}]", if hash { "#" } else { "" }), deref(off, d as i64))
            }),
        ];
        (size, location).prop_map(|((size, signed), (loc, arg))| with_size(size, signed, loc, arg))
    }

    fn render(v: i64, hex: bool) -> String {
        match (hex, v < 0) {
            (false, _) => v.to_string(),
            (true, false) => format!("{v:#x}"),
            (true, true) => format!("-{:#x}", v.unsigned_abs()),
        }
    }

    fn with_size(size: u8, signed: bool, loc: String, arg: UsdtArg) -> (String, UsdtArg) {
        let text = format!("{}{size}@{loc}", if signed { "-" } else { "" });
        (text, UsdtArg { bitshift: 64 - 8 * size, signed: signed as u8, ..arg })
    }

    proptest! {
        #[test]
        fn parse_args_never_panics(text in ".*", aarch64 in any::<bool>()) {
            let arch = if aarch64 { Arch::Aarch64 } else { Arch::X86_64 };
            let _ = parse_args(&text, arch);
        }

        #[test]
        fn parse_args_never_panics_on_near_miss_text(
            text in r"(-?[0-9]{0,2}@[%$#\[\]()x0-9a-z,\- ]{0,16} ?){0,8}",
            aarch64 in any::<bool>(),
        ) {
            let arch = if aarch64 { Arch::Aarch64 } else { Arch::X86_64 };
            let _ = parse_args(&text, arch);
        }

        #[test]
        fn x86_round_trip(items in prop::collection::vec(arb_x86_arg(), 0..=USDT_MAX_ARGS), sep in "[ \t]{1,3}") {
            let text = items.iter().map(|(t, _)| t.as_str()).collect::<Vec<_>>().join(&sep);
            let want: Vec<UsdtArg> = items.iter().map(|(_, a)| *a).collect();
            prop_assert_eq!(parse_args(&text, Arch::X86_64), Ok(want));
        }

        #[test]
        fn aarch64_round_trip(items in prop::collection::vec(arb_aarch64_arg(), 0..=USDT_MAX_ARGS)) {
            let text = items.iter().map(|(t, _)| t.as_str()).collect::<Vec<_>>().join(" ");
            let want: Vec<UsdtArg> = items.iter().map(|(_, a)| *a).collect();
            prop_assert_eq!(parse_args(&text, Arch::Aarch64), Ok(want));
        }
    }
}
