//! `cargo xtask build`: the stand-in libraries, test programs and the release binary.
//!
//! Layout under target/standin/ (what tests and the demo point at):
//! - `ascend/lib64/libascendcl.so`: the stand-in runtime, which allocates through
//!   `ascend/lib64/libascend_hal.so`, the stand-in driver; `ascend` serves as ASCEND_HOME_PATH.
//!   Beside them `ascend/lib64/libhccl.so`, the stand-in HCCL (communicators whose buffers it
//!   takes from the runtime itself, `tests/standin/ascend/standin_hccl.c`).
//!   Beside the driver, `ascend/lib64/libdcmi.so`: the stand-in device management library, which
//!   answers devices' and processes' memory from what the stand-in driver charged in every live
//!   process (`tests/standin/common/standin_driver_state.h`), as a tracer finds DCMI next to the
//!   driver the target maps.
//! - `late/libacl_rt.so`: a second copy at another path and name, loaded late by a workload the
//!   way HCCL dlopens libacl_rt.so, to test that the tracer picks up new libraries.
//! - `bin/alloc_bench`: the benchmark's allocation loop, linked to the stand-in.
//! - `bin/usdt_nop_bench`: the benchmark's USDT-site loop, linked to the stand-in libc10_cuda.so.
//! - `bin/stack_chain`, `bin/stack_chain_nofp`: a call chain known by construction
//!   (`tests/standin/stacks/`), its library `stacks/libstackchain.so` built with frame pointers and
//!   `stacks_nofp/libstackchain.so` without, for the native-stack tests.
//! - `atb/libatb.so`: the stand-in Ascend Transformer Boost (a graph runner whose workspace the
//!   caller takes from the stand-in torch_npu), with its DWARF kept so the tracer reads the
//!   workspace fields' offsets from it.
//! - `cuda/lib/`: the NVIDIA stand-ins (`tests/standin/cuda/`): `libcuda.so.1` (the driver),
//!   `libcudart.so.12` (the runtime, calling the driver through function pointers) and
//!   `libc10_cuda.so` (a caching allocator with PyTorch's USDT probes and internal names, kept in
//!   `.symtab` only), each findable from the next through DT_NEEDED and RUNPATH; beside them
//!   `libnvidia-ml.so.1` (NVML, answering from what the stand-in libcuda.so.1 charged in every
//!   live process); `libnccl.so.2` (NCCL, taking its buffers from the driver itself); and
//!   `bin/static_cudart`, a program with the stand-in runtime compiled in
//!   (`cudart_static`).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context as _;

use crate::util::{root, run as sh};

#[derive(Clone)]
pub struct Built {
    pub binary: PathBuf,
    pub ascend_home: PathBuf,
    pub libascendcl: PathBuf,
    pub late_lib: PathBuf,
    pub alloc_bench: PathBuf,
    pub torch: TorchBuild,
    /// The stand-in `libatb.so`.
    pub atb: PathBuf,
    /// The folder of the NVIDIA stand-ins (`libc10_cuda.so` and what it needs).
    pub cuda: PathBuf,
    /// `bin/usdt_nop_bench`: hits of a 1-byte-nop and a 5-byte-nop USDT site, timed.
    pub usdt_bench: PathBuf,
    /// The markers package (`markers/`) installed into a folder for PYTHONPATH.
    pub markers: PathBuf,
}

/// The stand-in torch_npu, stripped like the wheels, in three arrangements of its debug file.
#[derive(Clone)]
pub struct TorchBuild {
    /// `libtorch_npu.so` with `libtorch_npu.so.debug` beside it (found through .gnu_debuglink).
    pub with_debug: PathBuf,
    /// The same stripped file with no debug file anywhere it would be looked for.
    pub without_debug: PathBuf,
    /// A debug folder holding the debug file under `.build-id/xx/yyyy.debug` (for --debug-dir).
    pub debug_store: PathBuf,
    /// An empty library named like msLeaks' kernel hook (preloading it turns torch_npu's mstx on).
    pub kernel_hook: PathBuf,
}

const CFLAGS: &[&str] = &["-O2", "-g", "-fno-omit-frame-pointer", "-fno-ipa-icf", "-Wall", "-Wextra", "-Werror"];

/// Builds a shared library; `links` are (folder, library name) it depends on, found at run time
/// through its RUNPATH.
fn compile_library(
    tc: Toolchain,
    source: &Path,
    out: &Path,
    soname: &str,
    links: &[(&Path, &str)],
) -> anyhow::Result<()> {
    std::fs::create_dir_all(out.parent().expect("has a parent"))?;
    let mut cmd = tc.tool("gcc");
    cmd.args(CFLAGS).args(["-shared", "-fPIC", "-o"]).arg(out).arg(source).arg(format!("-Wl,-soname,{soname}"));
    for (dir, name) in links {
        cmd.arg("-L").arg(dir).arg(format!("-l{name}")).arg(format!("-Wl,-rpath,{}", dir.display()));
    }
    sh(cmd.arg("-lpthread"))
}

/// The compilers and binutils the stand-ins are built with: the host's, or Debian's cross tools
/// for the arm64 VM, whose programs then run on the same Debian's arm64 libc.
#[derive(Clone, Copy)]
pub struct Toolchain {
    prefix: &'static str,
}

impl Toolchain {
    pub const HOST: Self = Self { prefix: "" };
    pub const AARCH64: Self = Self { prefix: "aarch64-linux-gnu-" };

    fn tool(self, name: &str) -> Command {
        Command::new(format!("{}{name}", self.prefix))
    }
}

pub fn standins() -> anyhow::Result<Built> {
    standins_in(Toolchain::HOST, &root().join("target/standin"))
}

/// Every stand-in built with `tc` under `standin` (their RUNPATHs name that folder, so they run
/// where they were built, or at the same path on another machine).
pub fn standins_in(tc: Toolchain, standin: &Path) -> anyhow::Result<Built> {
    let root = root();
    let standin = standin.to_owned();
    let sources = root.join("tests/standin/ascend");
    let ascend_home = standin.join("ascend");
    let lib64 = ascend_home.join("lib64");
    compile_library(
        tc,
        &sources.join("standin_ascend_hal.c"),
        &lib64.join("libascend_hal.so"),
        "libascend_hal.so",
        &[],
    )?;
    compile_library(tc, &sources.join("standin_dcmi.c"), &lib64.join("libdcmi.so"), "libdcmi.so", &[])?;
    let libascendcl = lib64.join("libascendcl.so");
    let runtime = sources.join("standin_ascendcl.c");
    compile_library(tc, &runtime, &libascendcl, "libascendcl.so", &[(&lib64, "ascend_hal")])?;
    compile_library(
        tc,
        &sources.join("standin_hccl.c"),
        &lib64.join("libhccl.so"),
        "libhccl.so",
        &[(&lib64, "ascendcl")],
    )?;
    let late_lib = standin.join("late/libacl_rt.so");
    compile_library(tc, &runtime, &late_lib, "libacl_rt.so", &[(&lib64, "ascend_hal")])?;
    compile_library(
        tc,
        &sources.join("standin_ms_tools_ext.c"),
        &lib64.join("libms_tools_ext.so"),
        "libms_tools_ext.so",
        &[],
    )?;
    let torch = torch_npu(tc, &root, &standin, &lib64)?;
    let atb = atb(tc, &root, &standin)?;
    let cuda = cuda(tc, &root, &standin)?;
    let alloc_bench = standin.join("bin/alloc_bench");
    std::fs::create_dir_all(alloc_bench.parent().expect("has a parent"))?;
    sh(tc
        .tool("gcc")
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
    stack_chain(tc, &root, &standin, &lib64)?;
    let usdt_bench = standin.join("bin/usdt_nop_bench");
    sh(tc
        .tool("gcc")
        .args(CFLAGS)
        .arg("-o")
        .arg(&usdt_bench)
        .arg(root.join("tests/bench/usdt_nop_bench.c"))
        .arg("-L")
        .arg(&cuda)
        .arg(format!("-Wl,-rpath,{}", cuda.display()))
        .arg("-lc10_cuda"))?;
    Ok(Built {
        binary: root.join("target/release/memscope-bpf"),
        ascend_home,
        libascendcl,
        late_lib,
        alloc_bench,
        torch,
        atb,
        cuda,
        usdt_bench,
        markers: PathBuf::new(),
    })
}

/// The stack-chain program twice: its library with frame pointers (`bin/stack_chain`) and
/// without (`bin/stack_chain_nofp`); the program itself keeps them, and exports its symbols
/// (`-rdynamic`) so glibc's `backtrace_symbols` in its ledger names `main` too.
fn stack_chain(tc: Toolchain, root: &Path, standin: &Path, lib64: &Path) -> anyhow::Result<()> {
    let sources = root.join("tests/standin/stacks");
    for (lib_dir, frame_pointers, exe) in [("stacks", true, "stack_chain"), ("stacks_nofp", false, "stack_chain_nofp")]
    {
        let dir = standin.join(lib_dir);
        std::fs::create_dir_all(&dir)?;
        let lib = dir.join("libstackchain.so");
        let fp = if frame_pointers { "-fno-omit-frame-pointer" } else { "-fomit-frame-pointer" };
        sh(tc
            .tool("gcc")
            .args(["-O2", "-g", fp, "-fno-ipa-icf", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC"])
            .arg("-I")
            .arg(root.join("tests/standin/ascend"))
            .arg("-o")
            .arg(&lib)
            .arg(sources.join("stack_chain.c"))
            .arg("-Wl,-soname,libstackchain.so")
            .arg("-L")
            .arg(lib64)
            .arg("-lascendcl")
            .arg(format!("-Wl,-rpath,{}", lib64.display())))?;
        let bin = standin.join("bin").join(exe);
        std::fs::create_dir_all(bin.parent().expect("has a parent"))?;
        sh(tc
            .tool("gcc")
            .args(CFLAGS)
            .arg("-rdynamic")
            .arg("-o")
            .arg(&bin)
            .arg(sources.join("stack_chain_main.c"))
            .arg("-L")
            .arg(&dir)
            .arg("-lstackchain")
            .arg(format!("-Wl,-rpath,{}", dir.display())))?;
    }
    Ok(())
}

/// The build id of an ELF file, as `readelf -n` prints it.
fn build_id(file: &Path) -> anyhow::Result<String> {
    let out = Command::new("readelf").arg("-n").arg(file).output().context("readelf")?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.trim().strip_prefix("Build ID: ").map(str::to_owned))
        .with_context(|| format!("{} has no build id", file.display()))
}

fn torch_npu(tc: Toolchain, root: &Path, standin: &Path, lib64: &Path) -> anyhow::Result<TorchBuild> {
    let dir = standin.join("torch_npu");
    let build = dir.join("build");
    std::fs::create_dir_all(&build)?;
    let full = build.join("libtorch_npu.so");
    sh(tc
        .tool("g++")
        .args([
            "-std=c++17",
            "-O2",
            "-g",
            "-fPIC",
            "-shared",
            "-fvisibility=hidden",
            "-fno-omit-frame-pointer",
            "-fno-ipa-icf",
        ])
        .args(["-Wall", "-Wextra", "-Werror", "-Wl,--build-id=sha1", "-Wl,-soname,libtorch_npu.so"])
        .arg("-I")
        .arg(root.join("tests/standin/ascend"))
        .arg("-o")
        .arg(&full)
        .arg(root.join("tests/standin/torch_npu/standin_torch_npu.cpp"))
        .arg("-L")
        .arg(lib64)
        .arg("-lascendcl")
        .arg(format!("-Wl,-rpath,{}", lib64.display()))
        .args(["-ldl", "-lpthread"]))?;
    // As the wheels are made: the debug info goes to its own file, the library keeps .dynsym and a
    // .gnu_debuglink naming that file.
    let debug = build.join("libtorch_npu.so.debug");
    sh(tc.tool("objcopy").arg("--only-keep-debug").arg(&full).arg(&debug))?;
    let with_debug = dir.join("with-debug/libtorch_npu.so");
    let without_debug = dir.join("no-debug/libtorch_npu.so");
    for target in [&with_debug, &without_debug] {
        std::fs::create_dir_all(target.parent().expect("has a parent"))?;
        sh(tc
            .tool("objcopy")
            .arg("--strip-all")
            .arg(format!("--add-gnu-debuglink={}", debug.display()))
            .arg(&full)
            .arg(target))?;
    }
    std::fs::copy(&debug, dir.join("with-debug/libtorch_npu.so.debug"))?;
    let id = build_id(&with_debug)?;
    let debug_store = dir.join("debug-store");
    let in_store = debug_store.join(".build-id").join(&id[..2]).join(format!("{}.debug", &id[2..]));
    std::fs::create_dir_all(in_store.parent().expect("has a parent"))?;
    std::fs::copy(&debug, &in_store)?;
    let kernel_hook = standin.join("msleaks/libascend_kernel_hook.so");
    compile_library(
        tc,
        &root.join("tests/standin/ascend/standin_kernel_hook.c"),
        &kernel_hook,
        "libascend_kernel_hook.so",
        &[],
    )?;
    Ok(TorchBuild { with_debug, without_debug, debug_store, kernel_hook })
}

/// The stand-in ATB. Not built with hidden visibility: ATB exports `atb::Runner::Execute` (it is
/// what msMemScope's hook interposes), and not stripped, so its DWARF describes
/// `RunnerVariantPack` as a debug file would.
fn atb(tc: Toolchain, root: &Path, standin: &Path) -> anyhow::Result<PathBuf> {
    let out = standin.join("atb/libatb.so");
    std::fs::create_dir_all(out.parent().expect("has a parent"))?;
    sh(tc
        .tool("g++")
        .args(["-std=c++17", "-O2", "-g", "-fPIC", "-shared", "-fno-omit-frame-pointer", "-fno-ipa-icf"])
        .args(["-Wall", "-Wextra", "-Werror", "-Wl,-soname,libatb.so"])
        .arg("-o")
        .arg(&out)
        .arg(root.join("tests/standin/atb/standin_atb.cpp")))?;
    Ok(out)
}

/// The NVIDIA stand-ins in one folder, each linked to the one below it by its real soname, with
/// the unversioned names beside them for the linker.
fn cuda(tc: Toolchain, root: &Path, standin: &Path) -> anyhow::Result<PathBuf> {
    let sources = root.join("tests/standin/cuda");
    let lib = standin.join("cuda/lib");
    std::fs::create_dir_all(&lib)?;
    let link = |versioned: &str, plain: &str| -> anyhow::Result<()> {
        let at = lib.join(plain);
        let _ = std::fs::remove_file(&at);
        std::os::unix::fs::symlink(versioned, &at)?;
        Ok(())
    };
    compile_library(tc, &sources.join("standin_cuda.c"), &lib.join("libcuda.so.1"), "libcuda.so.1", &[])?;
    link("libcuda.so.1", "libcuda.so")?;
    compile_library(tc, &sources.join("standin_nvml.c"), &lib.join("libnvidia-ml.so.1"), "libnvidia-ml.so.1", &[])?;
    link("libnvidia-ml.so.1", "libnvidia-ml.so")?;
    let cudart = lib.join("libcudart.so.12");
    compile_library(tc, &sources.join("standin_cudart.c"), &cudart, "libcudart.so.12", &[(&lib, "cuda")])?;
    link("libcudart.so.12", "libcudart.so")?;
    // NCCL's runtime is linked in: it calls the driver itself.
    compile_library(tc, &sources.join("standin_nccl.c"), &lib.join("libnccl.so.2"), "libnccl.so.2", &[(&lib, "cuda")])?;
    link("libnccl.so.2", "libnccl.so")?;
    // Hidden internals, not stripped: local functions of `.symtab`, as in the PyPI wheel.
    sh(tc
        .tool("g++")
        .args(["-std=c++17", "-O2", "-g", "-fPIC", "-shared", "-fno-omit-frame-pointer", "-fno-ipa-icf"])
        .args(["-Wall", "-Wextra", "-Werror", "-Wl,-soname,libc10_cuda.so"])
        .arg("-I")
        .arg(&sources)
        .arg("-o")
        .arg(lib.join("libc10_cuda.so"))
        .arg(sources.join("standin_c10_cuda.cpp"))
        .arg("-L")
        .arg(&lib)
        .args(["-lcudart", "-lcuda"])
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-lpthread"))?;
    // A program with the runtime compiled in (as `cudart_static`): its functions in `.symtab` only.
    let program = standin.join("bin/static_cudart");
    std::fs::create_dir_all(program.parent().expect("has a parent"))?;
    sh(tc
        .tool("gcc")
        .args(CFLAGS)
        .arg("-I")
        .arg(&sources)
        .arg("-o")
        .arg(&program)
        .arg(sources.join("static_cudart_main.c"))
        .arg(sources.join("standin_cudart.c"))
        .arg("-L")
        .arg(&lib)
        // The runtime reaches the driver through dlsym only, as the real one does: keep the
        // DT_NEEDED entry the linker would drop as unused.
        .args(["-Wl,--no-as-needed", "-lcuda", "-Wl,--as-needed"])
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .args(["-ldl", "-lpthread"]))?;
    Ok(lib)
}

/// Installs the markers package into target/markers (its C extension is built on the way), as
/// a user's `pip install` would, without network or build isolation.
fn markers(root: &Path) -> anyhow::Result<PathBuf> {
    let dest = root.join("target/markers");
    let _ = std::fs::remove_dir_all(&dest);
    sh(Command::new("python3")
        .args(["-m", "pip", "install", "--quiet", "--no-build-isolation", "--no-deps", "--target"])
        .arg(&dest)
        .arg(root.join("markers")))
    .context("building the markers package (markers/) failed; it needs python3 with its headers and setuptools")?;
    Ok(dest)
}

pub fn run() -> anyhow::Result<Built> {
    let mut built = standins()?;
    built.markers = markers(&root())?;
    // The driver's helper (memscope-driver-query) goes beside the binary, where it looks.
    sh(Command::new("cargo").current_dir(root()).args([
        "build",
        "--release",
        "-p",
        "memscope-user",
        "-p",
        "memscope-driver",
    ]))
    .context("building memscope-bpf failed (if the eBPF toolchain is missing, run `cargo xtask setup`)")?;
    Ok(built)
}
