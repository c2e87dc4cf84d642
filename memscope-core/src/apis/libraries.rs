//! Libraries that take accelerator memory themselves, straight from the runtime or the driver,
//! known by the file that holds the traced call's caller ([`super::with_caller`]).
//!
//! Communication and math libraries do not go through the framework's allocator: HCCL takes its
//! communicators' buffers with `aclrtMalloc(WithCfg)`, NCCL (with its runtime linked in) with
//! `cuMemAlloc` / `cuMemCreate` and pins host memory with `cuMemHostAlloc`, cuBLAS and cuDNN take
//! workspaces of their own. Their rows would read `CANN@APP` or `CUDA@DRIVER` and the memory
//! would be nobody's in particular; one frame, the caller's address, says whose it is. A file
//! that is none of these leaves the owner as the allocator's.

use std::path::Path;

/// A library known to take memory itself. Its label is the owner's second level, as msMemScope
/// names HCCL's memory (`CANN@HCCL`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Library {
    Hccl,
    Nccl,
    Cublas,
    Cudnn,
}

/// File-name prefixes, each before `.so` or a version's `-`/`_`/`.`: HCCL ships as libhccl.so
/// and, since CANN 8, its platform part as libhcomm.so; cuBLAS as libcublas.so.12 and
/// libcublasLt.so.12; cuDNN's engines as libcudnn_*.so.9.
const NAMES: &[(&str, Library)] = &[
    ("libhccl", Library::Hccl),
    ("libhcomm", Library::Hccl),
    ("libnccl", Library::Nccl),
    ("libcublasLt", Library::Cublas),
    ("libcublas", Library::Cublas),
    ("libcudnn", Library::Cudnn),
];

impl Library {
    /// The owner label's part (`CANN@HCCL`, `CUDA@NCCL`, `HOST@NCCL`).
    pub fn label(self) -> &'static str {
        match self {
            Self::Hccl => "HCCL",
            Self::Nccl => "NCCL",
            Self::Cublas => "CUBLAS",
            Self::Cudnn => "CUDNN",
        }
    }

    /// The library a mapped file is, by its name: `libnccl.so.2` and `libhccl.so` are, while
    /// `libncclx_plugin.so` (a prefix followed by more of a name) is not.
    pub fn of_file(path: &Path) -> Option<Self> {
        let name = path.file_name()?.to_str()?;
        NAMES.iter().find_map(|&(prefix, lib)| {
            let rest = name.strip_prefix(prefix)?;
            let next = rest.chars().next()?;
            matches!(next, '.' | '-' | '_').then_some(lib)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_library_is_known_by_its_file_name_whatever_its_version_or_folder() {
        let of = |p: &str| Library::of_file(Path::new(p));
        assert_eq!(of("/usr/local/Ascend/ascend-toolkit/latest/lib64/libhccl.so"), Some(Library::Hccl));
        assert_eq!(of("/opt/cann/lib64/libhcomm.so"), Some(Library::Hccl));
        assert_eq!(of("/venv/nvidia/nccl/lib/libnccl.so.2"), Some(Library::Nccl));
        assert_eq!(of("/venv/nvidia/cublas/lib/libcublasLt.so.12"), Some(Library::Cublas));
        assert_eq!(of("libcublas.so.12.4.5.8"), Some(Library::Cublas));
        assert_eq!(of("libcudnn_engines_precompiled.so.9"), Some(Library::Cudnn));
        assert_eq!(of("/usr/lib/libncclx_plugin.so"), None, "another name sharing the prefix");
        assert_eq!(of("/usr/lib/libascendcl.so"), None);
        assert_eq!(of("libnccl"), None, "no extension: not a shared object's name");
        assert_eq!(of("/"), None);
    }
}
