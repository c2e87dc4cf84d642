//! A trace DB in the formats other tools open, so habits from CUDA work on Ascend traces:
//! [`memory_viz`], the snapshot PyTorch's `torch.cuda.memory._snapshot()` returns, which
//! PyTorch's memory_viz page and `torch/cuda/_memory_viz.py` read; [`perfetto`], the Chrome
//! JSON trace Perfetto's UI and `chrome://tracing` open; [`frames`], recorded call stacks as the
//! snapshot's frames.

pub mod frames;
pub mod memory_viz;
pub mod perfetto;
