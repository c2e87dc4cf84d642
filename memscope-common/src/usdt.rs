//! USDT probe specs: how the USDT probe program reads one call site's arguments.
//!
//! A USDT note describes each argument as `[-]size@location` in the assembler's syntax (a
//! register, a memory operand, an immediate). Userspace decodes that text once per call site into
//! a [`UsdtSpec`], stores it in an array map and attaches the site with the spec's index as the
//! cookie; the BPF side then only follows numbers. One probe can have many call sites with
//! different argument locations, so specs are per site (deduplicated by content), not per probe.

/// Size of the USDT spec array map.
pub const MAX_USDT_SPECS: u32 = 256;

/// Arguments read per site (our markers use at most four; libbpf allows twelve).
pub const USDT_MAX_ARGS: usize = 6;

/// Bytes of a probe's string argument kept in a record, NUL included: labels are at most 128
/// characters (msMemScope's limit), padded to a multiple of 8.
pub const USDT_TEXT_LEN: usize = 136;

/// Where an argument lives.
pub mod arg_kind {
    /// Unused argument slot.
    pub const NONE: u8 = 0;
    /// `$imm`: the value is `val_off`.
    pub const CONST: u8 = 1;
    /// `%reg`: the value of the register at `reg_off` in `pt_regs`.
    pub const REG: u8 = 2;
    /// `off(%reg)`: 8 bytes read at `reg + val_off`.
    pub const REG_DEREF: u8 = 3;
    /// `off(%base,%index,scale)`: 8 bytes read at `base + (index << scale_shift) + val_off`.
    pub const SIB: u8 = 4;
}

/// One decoded argument location. After reading 8 bytes (register or memory), the value is
/// shifted left then right by `bitshift` (arithmetically when `signed`), which keeps the low
/// `size` bytes with the right extension — sub-registers and narrow memory operands alike.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct UsdtArg {
    /// The immediate, or the memory operand's displacement.
    pub val_off: i64,
    /// Byte offset of the base register in the architecture's `pt_regs`.
    pub reg_off: u16,
    /// Byte offset of the index register (`SIB` only).
    pub idx_reg_off: u16,
    /// An [`arg_kind`] value.
    pub kind: u8,
    /// 1: sign-extend.
    pub signed: u8,
    /// `64 - 8 * size`.
    pub bitshift: u8,
    /// log2 of the SIB scale (0..=3).
    pub scale_shift: u8,
}

/// One call site's argument locations and what the record should carry.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct UsdtSpec {
    pub args: [UsdtArg; USDT_MAX_ARGS],
    /// Arguments the note declares (at most [`USDT_MAX_ARGS`] are read).
    pub arg_count: u32,
    /// Index of the argument that points to a NUL-terminated string copied into the record, or
    /// -1. Chosen by userspace from the probe's name, not from the note.
    pub text_arg: i32,
    /// Userspace's id for the probe's meaning (tag push, step, ...); copied into the record.
    pub probe: u32,
    pub _reserved: u32,
}

impl UsdtSpec {
    pub const EMPTY: Self = Self {
        args: [UsdtArg { val_off: 0, reg_off: 0, idx_reg_off: 0, kind: 0, signed: 0, bitshift: 0, scale_shift: 0 };
            USDT_MAX_ARGS],
        arg_count: 0,
        text_arg: -1,
        probe: 0,
        _reserved: 0,
    };
}

const _: () = assert!(core::mem::size_of::<UsdtArg>() == 16);
const _: () = assert!(core::mem::size_of::<UsdtSpec>() == 16 * USDT_MAX_ARGS + 16);
