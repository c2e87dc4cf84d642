//! A real PyTorch for the third-party check: a virtual environment under target/ with the
//! `torch` wheel from PyPI, whose `libc10.so` exports the CPU allocator the tracer probes.
//!
//! Best effort like the torch_npu wheel: without network the test that needs it skips and says
//! why. The wheel is large (about 5 GB installed with its CUDA dependencies, which a CPU run
//! never loads but `import torch` requires), so it is installed once per checkout and reused.

use std::path::PathBuf;
use std::process::Command;

use crate::util::{root, run as sh};

/// Pinned so a CI run is reproducible (`MEMSCOPE_TORCH_VERSION` to change).
const DEFAULT_VERSION: &str = "2.15.0";

pub fn version() -> String {
    std::env::var("MEMSCOPE_TORCH_VERSION").unwrap_or_else(|_| DEFAULT_VERSION.to_owned())
}

fn works(python: &PathBuf) -> bool {
    Command::new(python)
        .args(["-c", "import torch, sys; sys.exit(0 if torch.__version__.startswith(sys.argv[1]) else 1)"])
        .arg(version())
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The venv's python with `torch` importable, or why there is none (a warning, not an error).
pub fn python() -> Result<PathBuf, String> {
    let venv = root().join("target/torch-venv");
    let python = venv.join("bin/python");
    if python.is_file() && works(&python) {
        return Ok(python);
    }
    let version = version();
    eprintln!(
        "xtask: installing torch {version} from PyPI into {} for the real-PyTorch test (large; once)",
        venv.display()
    );
    let _ = std::fs::remove_dir_all(&venv);
    sh(Command::new("python3").args(["-m", "venv"]).arg(&venv))
        .map_err(|e| format!("cannot create a virtual environment (python3-venv missing?): {e:#}"))?;
    // No pip cache: it would keep a second copy of the ~3 GB of wheels outside target/ (a CI
    // machine's disk is small).
    sh(Command::new(&python)
        .args(["-m", "pip", "install", "--quiet", "--no-cache-dir"])
        .arg(format!("torch=={version}")))
    .map_err(|e| format!("pip install torch=={version} failed (no network?): {e:#}"))?;
    if works(&python) {
        Ok(python)
    } else {
        Err(format!("torch {version} was installed in {} but does not import", venv.display()))
    }
}
