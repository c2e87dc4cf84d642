//! `probes --lib` against the real `libtorch_npu.so` from torch_npu's PyPI wheel (fetched by
//! `cargo xtask test` into target/wheels). No process and no Ascend hardware are needed: the
//! test checks what the tracer says it can attach to against the file's own tables, read with
//! binutils (`nm -D`, `readelf`), not with the tracer's ELF code. Skips, saying why, when the
//! wheel could not be fetched.

use std::path::{Path, PathBuf};
use std::process::Command;

use memscope_integration::*;

/// Exported allocator entry points (the fallback source of PTA blocks).
const EXPORTED: &[(&str, &str)] = &[
    ("MallocBlock", "_ZN7c10_npu19NPUCachingAllocator11MallocBlockEmPvi"),
    ("FreeBlock", "_ZN7c10_npu19NPUCachingAllocator9FreeBlockEPv"),
    ("GetBlockPtr", "_ZN7c10_npu19NPUCachingAllocator11GetBlockPtrEPKv"),
    ("GetBlockSize", "_ZN7c10_npu19NPUCachingAllocator12GetBlockSizeEPKv"),
    ("allocate_workspace", "_ZN6at_npu6native18allocate_workspaceEmPv"),
];

/// The allocator internals (the preferred source), hidden in release builds.
const INTERNAL: &[(&str, &str)] = &[
    ("DeviceCachingAllocator::malloc", "_ZN7c10_npu19NPUCachingAllocator22DeviceCachingAllocator6mallocEimPvh"),
    ("NpuCachingAllocator::malloc", "_ZN7c10_npu19NPUCachingAllocator19NpuCachingAllocator6mallocEPPvimS2_"),
    ("DeviceWorkspaceAllocator::malloc", "_ZN7c10_npu21NPUWorkspaceAllocator24DeviceWorkspaceAllocator6mallocEmPv"),
];

/// The library `cargo xtask test` fetched into `var`, or a skip saying why not.
fn real_library(var: &str) -> Option<PathBuf> {
    match std::env::var_os(var) {
        Some(p) if Path::new(&p).is_file() => Some(PathBuf::from(p)),
        _ => {
            let why = std::env::var(format!("{var}_MISSING")).unwrap_or_else(|_| "not fetched".into());
            eprintln!("SKIPPED: the real libtorch_npu.so ({var}) is not here ({why}); `cargo xtask test` fetches it from PyPI");
            None
        }
    }
}

#[test]
fn probes_reports_what_the_real_torch_npu_library_allows() {
    let Some(lib) = real_library("MEMSCOPE_REAL_TORCH_NPU") else { return };
    let env = env("real_torch_npu");
    let out = Command::new(&env.bin).args(["probes", "--lib"]).arg(&lib).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_probes_of_the_release_library(&lib, &String::from_utf8_lossy(&out.stdout));
}

/// The aarch64 wheel's library (Kunpeng servers), read from this x86-64 machine with `--arch
/// aarch64`: the same probe points as the x86-64 one, at the offsets of the aarch64 file's own
/// tables (binutils read any ELF machine); without `--arch` it is refused, naming both.
#[test]
fn probes_reads_the_real_aarch64_torch_npu_library_as_an_aarch64_machine_would() {
    let Some(lib) = real_library("MEMSCOPE_REAL_TORCH_NPU_AARCH64") else { return };
    assert!(tool(&["readelf", "-hW"], &lib).contains("AArch64"), "the aarch64 wheel's library");
    let env = env("real_torch_npu_aarch64");
    let out = Command::new(&env.bin).args(["probes", "--arch", "aarch64", "--lib"]).arg(&lib).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    if std::env::consts::ARCH != "aarch64" {
        assert!(text.starts_with("read as aarch64 files (--arch aarch64)"), "{text}");
        let refused = Command::new(&env.bin).args(["probes", "--lib"]).arg(&lib).output().unwrap();
        let said = String::from_utf8_lossy(&refused.stdout);
        assert!(!refused.status.success(), "{said}");
        assert!(said.contains("a 64-bit aarch64 ELF file, not a 64-bit x86-64") && said.contains("--arch"), "{said}");
    }
    assert_probes_of_the_release_library(&lib, &text);
}

/// What `probes --lib` must say of torch_npu's release library, checked against the file's own
/// tables read with binutils.
fn assert_probes_of_the_release_library(lib: &Path, text: &str) {
    let dynsym = exported(lib);
    for (api, symbol) in EXPORTED {
        let addr = *dynsym.get(*symbol).unwrap_or_else(|| panic!("the real library no longer exports {symbol}"));
        let offset = file_offset(lib, addr);
        let line = format!("{symbol} (dynsym, offset {offset:#x})");
        assert!(
            listed(text, "attach", api, symbol, "dynsym") && text.contains(&line),
            "want `attach {api} {line}`:\n{text}"
        );
    }
    // Release builds hide the internals and ship no .symtab; with no debug file the tracer must
    // say they are missing and why, and fall back to the exported and mstx paths.
    let sections = tool(&["readelf", "-SW"], lib);
    assert!(!sections.contains(".symtab"), "this wheel has a symbol table; the test's premise changed");
    for (api, symbol) in INTERNAL {
        assert!(!dynsym.contains_key(*symbol), "{symbol} is exported by this wheel");
        assert!(listed(text, "missing", api, symbol, "hidden"), "want `missing {api} {symbol} (hidden...`:\n{text}");
    }
    let build_id = tool(&["readelf", "-n"], lib)
        .lines()
        .find_map(|l| l.trim().strip_prefix("Build ID: ").map(str::to_owned))
        .expect("the wheel's library has a build id");
    assert!(text.contains("debug file: not found") && text.contains(&build_id), "{text}");
    assert!(text.contains("through the exported MallocBlock/FreeBlock"), "{text}");
}
