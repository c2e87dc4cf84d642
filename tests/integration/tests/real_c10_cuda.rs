//! `probes --lib` against the real `libc10_cuda.so` of the pip `torch` wheel (the CUDA build
//! `cargo xtask test` installs into target/torch-venv). No GPU and no process are needed: what
//! the tracer says it would attach is checked against the file's own tables read with binutils
//! (`readelf -n` for the USDT notes, `readelf -sW` for `.symtab`, `nm -D` for cudart), not with
//! the tracer's ELF code. Skips, saying why, where the wheel has no libc10_cuda.so.

use std::path::PathBuf;
use std::process::Command;

use memscope_integration::*;

/// The internals that take the caching pool's segments, up to their parameter lists (which
/// differ between torch releases), spelt here from the Itanium mangling of their names.
const INTERNALS: &[(&str, &str)] = &[
    (
        "DeviceCachingAllocator::alloc_block",
        "_ZN3c104cuda20CUDACachingAllocator6Native22DeviceCachingAllocator11alloc_blockE",
    ),
    (
        "DeviceCachingAllocator::map_block",
        "_ZN3c104cuda20CUDACachingAllocator6Native22DeviceCachingAllocator9map_blockE",
    ),
];

/// The torch wheel's `lib` folder, found without importing torch.
fn torch_lib() -> Option<PathBuf> {
    let (python, _) = real_torch()?;
    let find = "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('torch').origin))";
    let out = Command::new(python).args(["-c", find]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lib = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()).join("lib");
    if !lib.join("libc10_cuda.so").is_file() {
        eprintln!("SKIPPED: {} has no libc10_cuda.so (a CPU-only torch wheel)", lib.display());
        return None;
    }
    Some(lib)
}

#[test]
fn probes_lists_pytorchs_usdt_probes_internals_and_cudart_as_the_file_has_them() {
    let Some(lib_dir) = torch_lib() else { return };
    let env = env("real_c10_cuda");
    let lib = lib_dir.join("libc10_cuda.so");
    let out = Command::new(&env.bin).args(["probes", "--lib"]).arg(&lib).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);

    // Every pytorch:malloc/free site of the notes, with its argument spec and semaphore.
    let notes: Vec<SdtNote> = sdt_notes(&lib).into_iter().filter(|n| n.provider == "pytorch").collect();
    for name in ["malloc", "free"] {
        assert!(notes.iter().any(|n| n.name == name), "readelf -n shows no pytorch:{name}; the premise changed");
    }
    for note in &notes {
        assert_ne!(note.semaphore, 0, "{note:?}: PyTorch's probes are semaphore-gated");
        let line = format!(
            "attach pytorch:{} offset {:#x}, semaphore {:#x}, args `{}`",
            note.name,
            file_offset(&lib, note.location),
            file_offset(&lib, note.semaphore),
            note.args
        );
        let words = |l: &str| l.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(text.lines().any(|l| words(l) == line), "want `{line}`:\n{text}");
    }
    assert_eq!(text.matches("attach  pytorch:").count(), notes.len(), "{text}");

    // The internals from .symtab (local functions), whatever their parameters.
    let symtab = symtab_functions(&lib);
    for (api, prefix) in INTERNALS {
        let (name, addr) = symtab
            .iter()
            .filter(|(n, _)| n.starts_with(prefix) && !n.contains('.'))
            .min_by_key(|(n, _)| n.len())
            .unwrap_or_else(|| panic!("readelf -sW shows no {prefix}...; the premise changed"));
        let offset = file_offset(&lib, *addr);
        assert!(
            listed(&text, "attach", api, name, "symtab") && text.contains(&format!("(symtab, offset {offset:#x})")),
            "want `attach {api} {name} (symtab, offset {offset:#x})`:\n{text}"
        );
    }

    // cudart, reached through the library's RPATH (pip's nvidia/*/lib), as the loader would.
    let cudart = text
        .lines()
        .find(|l| l.contains("/libcudart.so") && l.ends_with("(needed by a traced library)"))
        .unwrap_or_else(|| panic!("cudart not found through libc10_cuda's RPATH:\n{text}"));
    let cudart = PathBuf::from(cudart.trim_end_matches(" (needed by a traced library)"));
    let dynsym = exported(&cudart);
    for api in ["cudaMalloc", "cudaFree", "cudaMallocAsync", "cudaFreeAsync", "cudaSetDevice"] {
        let offset = file_offset(&cudart, dynsym[api]);
        let line = format!("{api} (dynsym, offset {offset:#x})");
        assert!(listed(&text, "attach", api, api, "dynsym") && text.contains(&line), "want `{line}`:\n{text}");
    }
}

/// `trace -- python ...` with no `--lib` and no ASCEND_HOME_PATH: the launched interpreter is
/// asked where its `torch` package is, so the wheel's libraries are probed before the job's first
/// call. Ground truth is torch's own account of the tensor it made: its storage's address and
/// size must be a `c10::alloc_cpu` block in the DB.
#[test]
fn a_launched_python_job_is_probed_through_its_torch_package_with_no_lib() {
    let Some(lib_dir) = torch_lib() else { return };
    let (python, _) = real_torch().expect("checked by torch_lib");
    let env = env("real_torch_launch");
    let out = env.scratch.join("out");
    let script = "import torch\nx = torch.ones(1 << 20)\ns = x.untyped_storage()\nprint(s.data_ptr(), s.nbytes())";
    let output = Command::new(&env.bin)
        .args(["trace", "--output", out.to_str().unwrap(), "--"])
        .arg(&python)
        .args(["-c", script])
        .env_remove("ASCEND_HOME_PATH")
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let live = stderr.lines().find(|l| l.contains(": live:")).unwrap_or_else(|| panic!("{stderr}"));
    for name in ["libc10.so", "libc10_cuda.so"] {
        assert!(live.contains(&lib_dir.join(name).display().to_string()), "{name} probed from the start: {live}");
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let mut words = stdout.split_whitespace().map(|w| w.parse::<u64>().unwrap());
    let (ptr, bytes) = (words.next().unwrap(), words.next().unwrap());
    let rows = read_output(&out);
    let block = rows
        .rows()
        .find(|r| r.event == "MALLOC" && r.name == "c10::alloc_cpu" && r.ptr_value() == Some(ptr))
        .unwrap_or_else(|| panic!("no c10::alloc_cpu block at {ptr:#x}:\n{stderr}"));
    assert_eq!(block.attr_u64("size"), Some(bytes), "{block:?}");
}
