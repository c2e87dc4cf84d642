//! A block's site: the innermost frame of the job's own code, the line a user can change.
//!
//! Not the job's: generated code (`<frozen ...>`, `<string>`, torch.fx's `<eval_with_key>`),
//! inductor's output under `/tmp/torchinductor_*`, the standard library (`lib/python3.N/`),
//! installed packages (`site-packages`, Debian's `dist-packages`) and the frameworks that often
//! run from a source checkout (Megatron, MindSpeed), whose folders are named here
//! (owners-from-frames.md §5). memray decides by `sysconfig` paths of the running interpreter;
//! the tracer sees only the file names, so it decides by their shape.

use super::frames;

/// Folders of libraries, wherever they are installed or checked out.
const LIBRARIES: &[&str] = &[
    "torch/",
    "torch_npu/",
    "vllm/",
    "vllm_ascend/",
    "megatron/",
    "mindspeed/",
    "mindspeed_llm/",
    "deepspeed/",
    "transformers/",
    "accelerate/",
    "lightning/",
    "pytorch_lightning/",
    "memscope/",
];

/// Whether a frame's file is the job's own code.
pub fn is_own(file: &str) -> bool {
    if file.starts_with('<') || file.starts_with("/tmp/torchinductor_") {
        return false;
    }
    if file.contains("/site-packages/") || file.contains("/dist-packages/") || is_stdlib(file) {
        return false;
    }
    !LIBRARIES.iter().any(|lib| file.starts_with(lib) || file.contains(&format!("/{lib}")))
}

/// `.../lib/python3.N/x.py` (not its packages, checked before).
fn is_stdlib(file: &str) -> bool {
    file.split('/').collect::<Vec<_>>().windows(2).any(|w| {
        w[0] == "lib"
            && w[1].strip_prefix("python3.").is_some_and(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
    })
}

/// The site of a stack's text: its innermost own frame, as `file:line function`. Not the
/// stack's own `file(line): function` form: msMemScope's CSV form of an Attr value takes no
/// parentheses, and a site is on most rows of a Python job.
pub fn of(text: &str) -> Option<String> {
    let own = frames(text).find(|f| is_own(f.file))?;
    Some(format!("{}:{} {}", own.file, own.line, own.function))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_jobs_own_files() {
        for own in ["/home/u/job/train.py", "train.py", "/srv/python3.12-tools/run.py", "/opt/lib/mytorch/x.py"] {
            assert!(is_own(own), "{own}");
        }
        for not in [
            "<frozen runpy>",
            "<eval_with_key>.3",
            "/root/.pyenv/versions/3.12.7/lib/python3.12/threading.py",
            "/usr/lib/python3.11/runpy.py",
            "/venv/lib/python3.12/site-packages/numpy/core/x.py",
            "/usr/lib/python3/dist-packages/torch/nn/modules/module.py",
            "/home/u/Megatron-LM/megatron/core/optimizer/optimizer.py",
            "/tmp/torchinductor_root/ab/cab.py",
        ] {
            assert!(!is_own(not), "{not}");
        }
    }

    #[test]
    fn the_site_is_the_innermost_own_frame() {
        let text = "/v/lib/python3.12/site-packages/torch/optim/adam.py(168): Adam._init_group\n\
                    /job/train.py(40): train_step\n/job/train.py(90): main";
        assert_eq!(of(text).as_deref(), Some("/job/train.py:40 train_step"));
        assert_eq!(of("/usr/lib/python3.12/threading.py(10): run"), None);
    }
}
