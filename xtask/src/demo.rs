//! `cargo xtask demo`: the README's first command. Sets up, builds, then launches the stand-in
//! training job (2 devices, 4 threads, host and virtual memory, a deliberate leak and one
//! out-of-memory, tensors on the stand-in torch_npu caching allocator) under `memscope-bpf
//! trace`, which prints the summary and the DB paths. Then a stand-in vLLM-like serving job tagged
//! with the markers package (`import memscope`), and `analyze --decompose` on its trace: who owned
//! the memory at the peak and at the end. Then `report` writes the training trace as one HTML
//! page to open in a browser. Last, the second backend: a job on the stand-in NVIDIA stack (a
//! caching allocator with PyTorch's USDT probes over cudart and libcuda), traced the same way.

use crate::util::{privileged, root, run as sh};
use crate::{build, setup};

#[derive(clap::Args)]
pub struct Options {
    /// Training steps to simulate.
    #[arg(long, default_value_t = 20)]
    pub steps: u32,
    /// Where the run folder goes.
    #[arg(long, default_value = "target/demo")]
    pub output: String,
}

pub fn run(opts: &Options) -> anyhow::Result<()> {
    setup::run(&setup::Options { check: false })?;
    let built = build::run()?;
    let root = root();
    let ledger = root.join("target/demo-ledger.jsonl");
    eprintln!("xtask demo: tracing the stand-in training job (stand-in libascendcl.so, libascend_hal.so and libtorch_npu.so, not the real CANN or torch_npu)");
    sh(privileged(built.binary.to_str().expect("utf-8 path"))
        .current_dir(&root)
        .env("ASCEND_HOME_PATH", &built.ascend_home)
        .args(["trace", "--output", &opts.output, "--lib"])
        .arg(&built.torch.with_debug)
        .arg("--")
        .arg("python3")
        .arg(root.join("tests/workloads/standin_train.py"))
        .arg("--ledger")
        .arg(&ledger)
        .args(["--steps", &opts.steps.to_string(), "--step-sleep-ms", "20"])
        .args(["--host", "--vmm", "--with-cfg", "--leak", "--fail-step", "3"])
        .arg("--torch-lib")
        .arg(&built.torch.with_debug)
        .args(["--empty-cache-every", "5"]))?;
    eprintln!("xtask demo: tracing a stand-in serving job tagged with the markers (vllm, model_weight, kv_cache, ...)");
    let serve_out = format!("{}/serve", opts.output);
    let _ = std::fs::remove_dir_all(root.join(&serve_out));
    sh(privileged(built.binary.to_str().expect("utf-8 path"))
        .current_dir(&root)
        .env("ASCEND_HOME_PATH", &built.ascend_home)
        .env("PYTHONPATH", &built.markers)
        .args(["trace", "--output", &serve_out, "--lib"])
        .arg(&built.torch.with_debug)
        .arg("--")
        .arg("python3")
        .arg(root.join("tests/workloads/standin_tags.py"))
        .args(["--scenario", "serve", "--ledger"])
        .arg(root.join("target/demo-serve-ledger.jsonl"))
        .arg("--torch-lib")
        .arg(&built.torch.with_debug))?;
    sh(std::process::Command::new(&built.binary).current_dir(&root).args([
        "analyze",
        "--decompose",
        "--depth",
        "4",
        &serve_out,
    ]))?;
    let train = newest_run(&root.join(&opts.output))?;
    let page = root.join(&opts.output).join("report.html");
    sh(std::process::Command::new(&built.binary).current_dir(&root).arg("report").arg(&train).arg("-o").arg(&page))?;
    eprintln!("xtask demo: tracing a job on the stand-in NVIDIA stack (stand-in libc10_cuda.so, libcudart and libcuda, not PyTorch's or NVIDIA's)");
    let cuda_out = format!("{}/cuda", opts.output);
    let _ = std::fs::remove_dir_all(root.join(&cuda_out));
    sh(privileged(built.binary.to_str().expect("utf-8 path"))
        .current_dir(&root)
        .env("PYTHONPATH", &built.markers)
        .env("STANDIN_CUDA_DEVICE_MEM", "1G")
        .args(["trace", "--output", &cuda_out, "--lib"])
        .arg(built.cuda.join("libc10_cuda.so"))
        .arg("--")
        .arg("python3")
        .arg(root.join("tests/workloads/standin_cuda_train.py"))
        .arg("--cuda-lib")
        .arg(&built.cuda)
        .arg("--ledger")
        .arg(root.join("target/demo-cuda-ledger.jsonl"))
        .args(["--oom-bytes", "2147483648"]))?;
    eprintln!("xtask demo: open the .db files above in MindStudio Insight, or query them with sqlite3");
    eprintln!("xtask demo: open {} in a browser: the training job's memory over time, owners, blocks", page.display());
    Ok(())
}

/// The run folder `trace` made last under `output` (earlier demos' stay beside it).
fn newest_run(output: &std::path::Path) -> anyhow::Result<std::path::PathBuf> {
    let mut runs: Vec<(std::time::SystemTime, std::path::PathBuf)> = std::fs::read_dir(output)?
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with("memscope_"))
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    runs.sort();
    runs.pop().map(|(_, p)| p).ok_or_else(|| anyhow::anyhow!("no run folder under {}", output.display()))
}
