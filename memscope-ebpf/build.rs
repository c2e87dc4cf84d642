//! Rebuild the eBPF object when bpf-linker changes: it is the linker for the bpf target, and
//! cargo does not track linkers on its own.
fn main() {
    if let Ok(linker) = which::which("bpf-linker") {
        println!("cargo:rerun-if-changed={}", linker.display());
    }
}
