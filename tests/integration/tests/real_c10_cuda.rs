//! `probes --lib` against the real `libc10_cuda.so` of the pip `torch` wheel (the CUDA build
//! `cargo xtask test` installs into target/torch-venv). No GPU and no process are needed: what
//! the tracer says it would attach is checked against the file's own tables read with binutils
//! (`readelf -n` for the USDT notes, `readelf -sW` for `.symtab`, `nm -D` for cudart), not with
//! the tracer's ELF code. Skips, saying why, where the wheel has no libc10_cuda.so.

use std::path::{Path, PathBuf};
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
    let notes = assert_c10_cuda_probes(&lib, &text);
    for name in ["malloc", "free"] {
        assert!(notes.iter().any(|n| n.name == name), "readelf -n shows no pytorch:{name}; the premise changed");
    }
    assert_c10_cpu_probes(&lib_dir.join("libc10.so"), &text);

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

/// The aarch64 wheel's `libc10_cuda.so` and `libc10.so` (an aarch64 NVIDIA machine: GH200),
/// fetched by `cargo xtask test` as two members of the wheel, read here with `--arch aarch64`:
/// the same internals and CPU allocator as on x86-64 at the aarch64 files' own offsets, and
/// exactly the USDT sites its notes have (this release's aarch64 build has none, and the output
/// says what that costs).
#[test]
fn probes_reads_the_real_aarch64_torch_libraries_as_an_aarch64_machine_would() {
    let Some(dir) = std::env::var_os("MEMSCOPE_REAL_TORCH_AARCH64").map(PathBuf::from) else {
        let why = std::env::var("MEMSCOPE_REAL_TORCH_AARCH64_MISSING").unwrap_or_else(|_| "not fetched".into());
        eprintln!("SKIPPED: no aarch64 torch libraries: {why}");
        return;
    };
    let env = env("real_c10_cuda_aarch64");
    let lib = dir.join("libc10_cuda.so");
    let header =
        String::from_utf8_lossy(&Command::new("readelf").arg("-hW").arg(&lib).output().unwrap().stdout).into_owned();
    assert!(header.contains("AArch64"), "{header}");
    let out = Command::new(&env.bin).args(["probes", "--arch", "aarch64", "--lib"]).arg(&lib).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let notes = assert_c10_cuda_probes(&lib, &text);
    if notes.is_empty() {
        assert!(text.contains("no pytorch:malloc/free USDT sites in this build"), "{text}");
    }
    assert_c10_cpu_probes(&dir.join("libc10.so"), &text);
}

/// `probes` on a `libc10_cuda.so` lists every pytorch USDT site of its notes and the caching
/// allocator's internals of its `.symtab`, at the file's own offsets; returns the notes.
fn assert_c10_cuda_probes(lib: &Path, text: &str) -> Vec<SdtNote> {
    // Every pytorch:malloc/free site of the notes, with its argument spec and semaphore.
    let notes: Vec<SdtNote> = sdt_notes(lib).into_iter().filter(|n| n.provider == "pytorch").collect();
    for note in &notes {
        assert_ne!(note.semaphore, 0, "{note:?}: PyTorch's probes are semaphore-gated");
        let line = format!(
            "attach pytorch:{} offset {:#x}, semaphore {:#x}, args `{}`",
            note.name,
            file_offset(lib, note.location),
            file_offset(lib, note.semaphore),
            note.args
        );
        let words = |l: &str| l.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(text.lines().any(|l| words(l) == line), "want `{line}`:\n{text}");
    }
    assert_eq!(text.matches("attach  pytorch:").count(), notes.len(), "{text}");

    // The internals from .symtab (local functions), whatever their parameters.
    let symtab = symtab_functions(lib);
    for (api, prefix) in INTERNALS {
        let (name, addr) = symtab
            .iter()
            .filter(|(n, _)| n.starts_with(prefix) && !n.contains('.'))
            .min_by_key(|(n, _)| n.len())
            .unwrap_or_else(|| panic!("readelf -sW shows no {prefix}...; the premise changed"));
        let offset = file_offset(lib, *addr);
        assert!(
            listed(text, "attach", api, name, "symtab") && text.contains(&format!("(symtab, offset {offset:#x})")),
            "want `attach {api} {name} (symtab, offset {offset:#x})`:\n{text}"
        );
    }
    notes
}

/// The CPU allocator of `libc10.so` (reached from libc10_cuda's DT_NEEDED), at its exports'
/// offsets.
fn assert_c10_cpu_probes(lib: &Path, text: &str) {
    assert!(text.contains(&format!("{} (needed by a traced library)", lib.display())), "{text}");
    let dynsym = exported(lib);
    for (api, symbol) in [("c10::alloc_cpu", "_ZN3c109alloc_cpuEm"), ("c10::free_cpu", "_ZN3c108free_cpuEPv")] {
        let offset = file_offset(lib, dynsym[symbol]);
        let line = format!("{symbol} (dynsym, offset {offset:#x})");
        assert!(listed(text, "attach", api, symbol, "dynsym") && text.contains(&line), "want `{line}`:\n{text}");
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
