//! `cargo xtask build`: the stand-in libraries, test programs and the release binary.
//!
//! Layout under target/standin/ (what tests and the demo point at):
//! - `ascend/lib64/libascendcl.so`: the stand-in runtime, which allocates through
//!   `ascend/lib64/libascend_hal.so`, the stand-in driver; `ascend` serves as ASCEND_HOME_PATH.
//! - `late/libacl_rt.so`: a second copy at another path and name, loaded late by a workload the
//!   way HCCL dlopens libacl_rt.so, to test that the tracer picks up new libraries.
//! - `bin/alloc_bench`: the benchmark's allocation loop, linked to the stand-in.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context as _;

use crate::util::{root, run as sh};

pub struct Built {
    pub binary: PathBuf,
    pub ascend_home: PathBuf,
    pub libascendcl: PathBuf,
    pub late_lib: PathBuf,
    pub alloc_bench: PathBuf,
}

const CFLAGS: &[&str] = &["-O2", "-g", "-fno-omit-frame-pointer", "-fno-ipa-icf", "-Wall", "-Wextra", "-Werror"];

/// Builds a shared library; `links` are (folder, library name) it depends on, found at run time
/// through its RUNPATH.
fn compile_library(source: &Path, out: &Path, soname: &str, links: &[(&Path, &str)]) -> anyhow::Result<()> {
    std::fs::create_dir_all(out.parent().expect("has a parent"))?;
    let mut cmd = Command::new("gcc");
    cmd.args(CFLAGS).args(["-shared", "-fPIC", "-o"]).arg(out).arg(source).arg(format!("-Wl,-soname,{soname}"));
    for (dir, name) in links {
        cmd.arg("-L").arg(dir).arg(format!("-l{name}")).arg(format!("-Wl,-rpath,{}", dir.display()));
    }
    sh(cmd.arg("-lpthread"))
}

pub fn standins() -> anyhow::Result<Built> {
    let root = root();
    let standin = root.join("target/standin");
    let sources = root.join("tests/standin/ascend");
    let ascend_home = standin.join("ascend");
    let lib64 = ascend_home.join("lib64");
    compile_library(&sources.join("standin_ascend_hal.c"), &lib64.join("libascend_hal.so"), "libascend_hal.so", &[])?;
    let libascendcl = lib64.join("libascendcl.so");
    let runtime = sources.join("standin_ascendcl.c");
    compile_library(&runtime, &libascendcl, "libascendcl.so", &[(&lib64, "ascend_hal")])?;
    let late_lib = standin.join("late/libacl_rt.so");
    compile_library(&runtime, &late_lib, "libacl_rt.so", &[(&lib64, "ascend_hal")])?;
    let alloc_bench = standin.join("bin/alloc_bench");
    std::fs::create_dir_all(alloc_bench.parent().expect("has a parent"))?;
    sh(Command::new("gcc")
        .args(CFLAGS)
        .arg("-I")
        .arg(root.join("tests/standin/ascend"))
        .arg("-o")
        .arg(&alloc_bench)
        .arg(root.join("tests/bench/alloc_bench.c"))
        .arg("-L")
        .arg(libascendcl.parent().expect("has a parent"))
        .arg(format!("-Wl,-rpath,{}", libascendcl.parent().expect("has a parent").display()))
        .arg("-lascendcl"))?;
    Ok(Built { binary: root.join("target/release/memscope-bpf"), ascend_home, libascendcl, late_lib, alloc_bench })
}

pub fn run() -> anyhow::Result<Built> {
    let built = standins()?;
    sh(Command::new("cargo").current_dir(root()).args(["build", "--release", "-p", "memscope-user"]))
        .context("building memscope-bpf failed (if the eBPF toolchain is missing, run `cargo xtask setup`)")?;
    Ok(built)
}
