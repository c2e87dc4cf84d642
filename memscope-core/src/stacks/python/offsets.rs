//! CPython's field offsets per version, in one place: what the probe walks
//! ([`PyOffsets`]) and what userspace reads of a code object ([`CodeOffsets`]).
//!
//! The values are CPython's own layouts on 64-bit Linux, the same on x86-64 and arm64 (LP64,
//! natural alignment, and no field of these structs depends on the architecture). Each was
//! checked against the interpreter's debug information (`gdb -batch -ex 'p/d &((PyThreadState
//! *)0)->native_thread_id' libpython3.X.so` for every field, on pyenv's 3.11.7, 3.12.1 and
//! 3.13.0): they are data, not guesses, and a test compares them with the DWARF of each
//! interpreter found on the machine. 3.13 also carries its own `_Py_DebugOffsets` at
//! `_PyRuntime`; its cookie is checked before the table is used. Versions not listed have no
//! Python stacks (`probes` and `trace` say so).

use memscope_common::python::{PyOffsets, NO_OFFSET};

/// What userspace reads of a code object and the objects it points to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CodeOffsets {
    pub filename: u64,
    pub qualname: u64,
    /// `co_firstlineno` (an `int`).
    pub firstlineno: u64,
    /// `co_linetable` (a `bytes` object: the location table).
    pub linetable: u64,
    /// `co_code_adaptive`: the bytecode, inside the code object.
    pub code_adaptive: u64,
    /// Where a compact ASCII string's characters start (`sizeof(PyASCIIObject)`).
    pub ascii_data: u64,
    /// `PyASCIIObject.length`, `PyVarObject.ob_size`.
    pub str_length: u64,
    pub bytes_size: u64,
    /// `PyBytesObject.ob_sval`.
    pub bytes_data: u64,
}

/// The two tables of a version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub minor: u32,
    pub walk: PyOffsets,
    pub code: CodeOffsets,
}

const fn code(firstlineno: u64, code_adaptive: u64, ascii_data: u64) -> CodeOffsets {
    CodeOffsets {
        filename: 112,
        qualname: 128,
        firstlineno,
        linetable: 136,
        code_adaptive,
        ascii_data,
        str_length: 16,
        bytes_size: 16,
        bytes_data: 32,
    }
}

/// `FRAME_OWNED_BY_CSTACK` (3.12+): a shim frame of the C stack, not Python code.
const OWNED_BY_CSTACK: u32 = 3;

const LAYOUTS: [Layout; 3] = [
    Layout {
        minor: 11,
        walk: PyOffsets {
            runtime_interpreters_head: 40,
            interp_threads_head: 16,
            tstate_next: 8,
            tstate_native_thread_id: 160,
            tstate_frame: 56,
            cframe_current_frame: 8,
            frame_code: 32,
            frame_previous: 48,
            frame_instr: 56,
            frame_owner: 69,
            owner_cstack: NO_OFFSET,
            _reserved: 0,
        },
        code: code(72, 184, 48),
    },
    Layout {
        minor: 12,
        walk: PyOffsets {
            runtime_interpreters_head: 40,
            interp_threads_head: 72,
            tstate_next: 8,
            tstate_native_thread_id: 144,
            tstate_frame: 56,
            cframe_current_frame: 0,
            frame_code: 0,
            frame_previous: 8,
            frame_instr: 56,
            frame_owner: 70,
            owner_cstack: OWNED_BY_CSTACK,
            _reserved: 0,
        },
        code: code(68, 192, 40),
    },
    Layout {
        minor: 13,
        walk: PyOffsets {
            runtime_interpreters_head: 632,
            interp_threads_head: 7344,
            tstate_next: 8,
            tstate_native_thread_id: 160,
            tstate_frame: 72,
            cframe_current_frame: NO_OFFSET,
            frame_code: 0,
            frame_previous: 8,
            frame_instr: 56,
            frame_owner: 70,
            owner_cstack: OWNED_BY_CSTACK,
            _reserved: 0,
        },
        code: code(68, 200, 40),
    },
];

/// The layout of CPython 3.`minor`, when this build has it.
pub fn layout(minor: u32) -> Option<&'static Layout> {
    LAYOUTS.iter().find(|l| l.minor == minor)
}

/// The minor versions with Python stacks, for messages.
pub fn supported() -> String {
    LAYOUTS.iter().map(|l| format!("3.{}", l.minor)).collect::<Vec<_>>().join(", ")
}

/// `_Py_DebugOffsets.cookie` (3.13+), at `_PyRuntime + 0`.
pub const DEBUG_COOKIE: &[u8; 8] = b"xdebugpy";
