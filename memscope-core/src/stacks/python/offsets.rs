//! CPython's field offsets per version, in one place: what the probe walks
//! ([`PyOffsets`]) and what userspace reads of a code object ([`CodeOffsets`]).
//!
//! The values are CPython's own layouts on 64-bit Linux, the same on x86-64 and arm64 (LP64,
//! natural alignment, and no field of these structs depends on the architecture), so one table
//! serves both. Each was checked against the interpreter's debug information (`gdb -batch -ex
//! 'p/d &((PyThreadState *)0)->native_thread_id' libpython3.X.so` for every field, on pyenv's
//! 3.9.18, 3.10.13, 3.11.7, 3.12.1 and 3.13.0): they are data, not guesses, and a test compares
//! every one with what gdb reads from the DWARF of each interpreter found on the machine. For
//! arm64, where no interpreter runs here, a second test has the cross compiler
//! (`aarch64-linux-gnu-gcc`, installed by `cargo xtask setup`) lay out the same fields from each
//! version's own headers, and compares. 3.13 also carries its
//! own `_Py_DebugOffsets` at `_PyRuntime`; its cookie is checked before the table is used.
//! Versions not listed have no Python stacks (`probes` and `trace` say so). The one thing not
//! CPython's, glibc's `struct pthread` thread-id offset (3.9, 3.10), is found per process.

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

/// How a frame says where it is, and how the code object maps that to a line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Frames {
    /// 3.11+: `_PyInterpreterFrame`, an instruction pointer into `co_code_adaptive`, and the
    /// location table.
    Interpreter,
    /// 3.10: `PyFrameObject`, `f_lasti` in code units, and `co_linetable`'s (bytes, line) pairs.
    Object310,
    /// 3.9: `PyFrameObject`, `f_lasti` in bytes, and `co_lnotab`.
    Object39,
}

/// The two tables of a version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub minor: u32,
    pub frames: Frames,
    /// `pthread_tid` is left [`NO_OFFSET`] here for 3.9 and 3.10: it is glibc's, found in each
    /// process ([`super::find`]).
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

/// 3.9 and 3.10: the thread state's frame object chain. `tstate_native_thread_id` is
/// `thread_id`; the frame's "instruction" is `f_lasti` (an `int`, read as the low half).
const fn object_walk(frame_lasti: u32) -> PyOffsets {
    PyOffsets {
        runtime_interpreters_head: 32,
        interp_threads_head: 8,
        tstate_next: 8,
        tstate_native_thread_id: 176,
        tstate_frame: 24,
        cframe_current_frame: NO_OFFSET,
        frame_code: 32,
        frame_previous: 24,
        frame_instr: frame_lasti,
        frame_owner: NO_OFFSET,
        owner_cstack: NO_OFFSET,
        pthread_tid: NO_OFFSET,
    }
}

/// 3.9 and 3.10's code object: no `co_qualname` (the name stands in), the line table at 120.
const OBJECT_CODE: CodeOffsets = CodeOffsets {
    filename: 104,
    qualname: 112,
    firstlineno: 40,
    linetable: 120,
    code_adaptive: 0,
    ascii_data: 48,
    str_length: 16,
    bytes_size: 16,
    bytes_data: 32,
};

const LAYOUTS: [Layout; 5] = [
    Layout { minor: 9, frames: Frames::Object39, walk: object_walk(104), code: OBJECT_CODE },
    Layout { minor: 10, frames: Frames::Object310, walk: object_walk(96), code: OBJECT_CODE },
    Layout {
        minor: 11,
        frames: Frames::Interpreter,
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
            pthread_tid: NO_OFFSET,
        },
        code: code(72, 184, 48),
    },
    Layout {
        minor: 12,
        frames: Frames::Interpreter,
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
            pthread_tid: NO_OFFSET,
        },
        code: code(68, 192, 40),
    },
    Layout {
        minor: 13,
        frames: Frames::Interpreter,
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
            pthread_tid: NO_OFFSET,
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

#[cfg(test)]
mod tests {
    //! The table against each interpreter's own debug information, read by gdb (an independent
    //! reader of the DWARF), for every pyenv CPython 3.9+ on the machine.

    use std::path::PathBuf;

    use super::*;

    /// 3.9 and 3.10's fields, by their names there.
    fn object_fields(l: &Layout) -> Vec<(String, u64)> {
        let (w, c) = (&l.walk, &l.code);
        let table = if l.minor == 9 { "co_lnotab" } else { "co_linetable" };
        vec![
            ("&((_PyRuntimeState*)0)->interpreters.head".to_owned(), u64::from(w.runtime_interpreters_head)),
            ("&((PyInterpreterState*)0)->tstate_head".into(), u64::from(w.interp_threads_head)),
            ("&((PyThreadState*)0)->next".into(), u64::from(w.tstate_next)),
            ("&((PyThreadState*)0)->thread_id".into(), u64::from(w.tstate_native_thread_id)),
            ("&((PyThreadState*)0)->frame".into(), u64::from(w.tstate_frame)),
            ("&((PyFrameObject*)0)->f_back".into(), u64::from(w.frame_previous)),
            ("&((PyFrameObject*)0)->f_code".into(), u64::from(w.frame_code)),
            ("&((PyFrameObject*)0)->f_lasti".into(), u64::from(w.frame_instr)),
            ("&((PyCodeObject*)0)->co_filename".into(), c.filename),
            ("&((PyCodeObject*)0)->co_name".into(), c.qualname),
            ("&((PyCodeObject*)0)->co_firstlineno".into(), c.firstlineno),
            (format!("&((PyCodeObject*)0)->{table}"), c.linetable),
            ("sizeof(PyASCIIObject)".into(), c.ascii_data),
            ("&((PyBytesObject*)0)->ob_sval".into(), c.bytes_data),
        ]
    }

    /// (C expression of the offset, the table's value) for a version's layout.
    fn fields(l: &Layout) -> Vec<(String, u64)> {
        if l.frames != Frames::Interpreter {
            return object_fields(l);
        }
        let w = &l.walk;
        let c = &l.code;
        let frame = if l.minor >= 13 { "f_executable" } else { "f_code" };
        let instr = if l.minor >= 13 { "instr_ptr" } else { "prev_instr" };
        let mut v = vec![
            ("&((_PyRuntimeState*)0)->interpreters.head".to_owned(), u64::from(w.runtime_interpreters_head)),
            ("&((PyInterpreterState*)0)->threads.head".into(), u64::from(w.interp_threads_head)),
            ("&((PyThreadState*)0)->next".into(), u64::from(w.tstate_next)),
            ("&((PyThreadState*)0)->native_thread_id".into(), u64::from(w.tstate_native_thread_id)),
            (format!("&((_PyInterpreterFrame*)0)->{frame}"), u64::from(w.frame_code)),
            ("&((_PyInterpreterFrame*)0)->previous".into(), u64::from(w.frame_previous)),
            (format!("&((_PyInterpreterFrame*)0)->{instr}"), u64::from(w.frame_instr)),
            ("&((_PyInterpreterFrame*)0)->owner".into(), u64::from(w.frame_owner)),
            ("&((PyCodeObject*)0)->co_filename".into(), c.filename),
            ("&((PyCodeObject*)0)->co_qualname".into(), c.qualname),
            ("&((PyCodeObject*)0)->co_firstlineno".into(), c.firstlineno),
            ("&((PyCodeObject*)0)->co_linetable".into(), c.linetable),
            ("&((PyCodeObject*)0)->co_code_adaptive".into(), c.code_adaptive),
            ("sizeof(PyASCIIObject)".into(), c.ascii_data),
            ("&((PyASCIIObject*)0)->length".into(), c.str_length),
            ("&((PyBytesObject*)0)->ob_sval".into(), c.bytes_data),
        ];
        if l.minor >= 13 {
            v.push(("&((PyThreadState*)0)->current_frame".into(), u64::from(w.tstate_frame)));
        } else {
            v.push(("&((PyThreadState*)0)->cframe".into(), u64::from(w.tstate_frame)));
            v.push(("&((_PyCFrame*)0)->current_frame".into(), u64::from(w.cframe_current_frame)));
        }
        v
    }

    /// `&((T*)0)->a.b` as `__builtin_offsetof(T, a.b)`, which a cross compiler folds to a
    /// constant; `sizeof(...)` as it is.
    fn as_offsetof(expr: &str) -> String {
        let Some(rest) = expr.strip_prefix("&((") else { return expr.to_owned() };
        let (ty, member) = rest.split_once("*)0)->").expect("an `&((T*)0)->member` expression");
        format!("__builtin_offsetof({ty}, {member})")
    }

    /// What `compiler` makes of each field with version `minor`'s installed headers (in
    /// `include`): a C file whose globals are the offsets, compiled to an object whose data the
    /// values are read back from (the target's code never runs).
    fn compiled_offsets(compiler: &str, include: &std::path::Path, minor: u32, exprs: &[String]) -> Vec<u64> {
        use object::{Object as _, ObjectSection as _, ObjectSymbol as _};
        let dir = std::env::temp_dir().join(format!("memscope-py-offsets-{}-{minor}-{compiler}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut c = String::from("#define Py_BUILD_CORE 1\n#include <Python.h>\n");
        if minor < 11 {
            // `PyFrameObject`'s fields (opaque from 3.11 on, where `_PyInterpreterFrame` is read).
            c.push_str("#include <frameobject.h>\n");
        }
        let mut internal = vec!["pycore_runtime.h", "pycore_interp.h"];
        if minor >= 11 {
            internal.push("pycore_frame.h");
        }
        for h in internal {
            c.push_str(&format!("#include <internal/{h}>\n"));
        }
        for (i, expr) in exprs.iter().enumerate() {
            c.push_str(&format!("unsigned long long field_{i} = {};\n", as_offsetof(expr)));
        }
        let (src, obj) = (dir.join("offsets.c"), dir.join("offsets.o"));
        std::fs::write(&src, c).unwrap();
        let out = std::process::Command::new(compiler)
            // Offsets of 0 stay in .data, where their bytes are.
            .args(["-std=gnu11", "-c", "-O0", "-w", "-fno-zero-initialized-in-bss", "-I"])
            .arg(include)
            .arg(&src)
            .arg("-o")
            .arg(&obj)
            .output()
            .unwrap();
        assert!(out.status.success(), "{compiler} on 3.{minor}'s headers:\n{}", String::from_utf8_lossy(&out.stderr));
        let data = std::fs::read(&obj).unwrap();
        let file = object::File::parse(&*data).unwrap();
        let values = (0..exprs.len())
            .map(|i| {
                let sym = file.symbols().find(|s| s.name() == Ok(&format!("field_{i}"))).expect("the field's symbol");
                let section = file.section_by_index(sym.section_index().unwrap()).unwrap();
                let bytes = section.data().unwrap();
                let at = sym.address() as usize;
                u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap())
            })
            .collect();
        std::fs::remove_dir_all(&dir).unwrap();
        values
    }

    /// The one table is arm64's too: the cross compiler lays out every field from each pyenv
    /// version's own headers, and each is the table's value (and the same compile for x86-64
    /// agrees with gdb's reading above, so the method is sound).
    #[test]
    fn the_table_is_each_versions_arm64_layout_too() {
        let cross = "aarch64-linux-gnu-gcc";
        if std::process::Command::new(cross).arg("--version").output().is_err() {
            eprintln!("skipped: no {cross} (cargo xtask setup installs gcc-aarch64-linux-gnu)");
            return;
        }
        let mut checked = 0;
        for l in &LAYOUTS {
            let Some(python) = crate::stacks::python::tests::pyenv(l.minor) else {
                eprintln!("skipped 3.{}: no pyenv CPython 3.{}", l.minor, l.minor);
                continue;
            };
            let include = python.parent().unwrap().parent().unwrap().join(format!("include/python3.{}", l.minor));
            let fields = fields(l);
            let exprs: Vec<String> = fields.iter().map(|(e, _)| e.clone()).collect();
            for compiler in [cross, "gcc"] {
                let values = compiled_offsets(compiler, &include, l.minor, &exprs);
                for ((expr, ours), theirs) in fields.iter().zip(values) {
                    assert_eq!(*ours, theirs, "3.{} with {compiler}: {expr}", l.minor);
                }
            }
            checked += 1;
        }
        if checked == 0 {
            eprintln!("skipped: no pyenv CPython 3.9-3.13 here");
        }
    }

    fn libpython(minor: u32) -> Option<PathBuf> {
        let python = crate::stacks::python::tests::pyenv(minor)?;
        let lib = python.parent()?.parent()?.join(format!("lib/libpython3.{minor}.so"));
        lib.is_file().then_some(lib)
    }

    #[test]
    fn the_table_is_each_interpreters_own_layout() {
        if std::process::Command::new("gdb").arg("--version").output().is_err() {
            eprintln!("skipped: no gdb to read the interpreters' DWARF");
            return;
        }
        for l in &LAYOUTS {
            let Some(lib) = libpython(l.minor) else {
                eprintln!("skipped 3.{}: no pyenv libpython3.{}.so", l.minor, l.minor);
                continue;
            };
            let fields = fields(l);
            let mut cmd = std::process::Command::new("gdb");
            cmd.arg("-batch");
            for (expr, _) in &fields {
                cmd.args(["-ex", &format!("p/d {expr}")]);
            }
            let out = cmd.arg(&lib).output().unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            let values: Vec<u64> = text.lines().filter_map(|l| l.split(" = ").nth(1)?.trim().parse().ok()).collect();
            assert_eq!(values.len(), fields.len(), "gdb read every field of 3.{}:\n{text}", l.minor);
            for ((expr, ours), theirs) in fields.iter().zip(values) {
                assert_eq!(*ours, theirs, "3.{}: {expr}", l.minor);
            }
        }
    }
}
