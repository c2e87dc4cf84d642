//! `--owner-rules FILE` and `--step-frame FILE:FUNCTION`: the rules `trace` applies to Python
//! stacks (docs/owners.md), read and checked before anything is attached, and shown by
//! `probes --owner-rules`.

use std::path::Path;

use anyhow::Context as _;
use memscope_core::infer::rules::Pattern;
use memscope_core::infer::{Reader, StepRule};

/// `--step-frame`'s value.
pub fn parse_step_frame(text: &str) -> Result<Pattern, String> {
    Pattern::parse(text).ok_or_else(|| format!("`{text}` is not FILE:FUNCTION (e.g. `train.py:train_step`)"))
}

/// The owner rules in force: `--owner-rules`' (read and checked before anything is attached),
/// then the built-in ones.
pub fn read(file: Option<&Path>, step_frame: Option<Pattern>) -> anyhow::Result<Reader> {
    let step_rule = step_frame.map_or(StepRule::ForwardAfterOptimizer, StepRule::Frame);
    let Some(file) = file else { return Ok(Reader::new(Vec::new(), step_rule)) };
    let text = memscope_core::files::read_text(file, 1 << 20)
        .with_context(|| format!("cannot read the owner rules {}", file.display()))?;
    Reader::with_user_rules(&text, step_rule).with_context(|| {
        format!(
            "the owner rules {} are not valid (the built-in table shows the format: probes --owner-rules)",
            file.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bad rules file stops `trace` before anything is attached, naming the file and the line;
    /// a good one's rules come before the built-in ones.
    #[test]
    fn owner_rules_files_are_checked_and_come_first() {
        let dir = std::env::temp_dir().join(format!("memscope-owner-rules-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bad = dir.join("bad.rules");
        std::fs::write(&bad, "# mine\ntorch/nn/modules/:__init__ frozen\nnot a rule\n").unwrap();
        let err = format!("{:#}", read(Some(&bad), None).unwrap_err());
        assert!(err.contains("bad.rules") && err.contains("line 3: `not` has no `:FUNCTION`"), "{err}");
        let good = dir.join("good.rules");
        std::fs::write(&good, "torch/nn/modules/:__init__ frozen phase=init\n").unwrap();
        let reader = read(Some(&good), Some(Pattern::parse("train.py:step").unwrap())).unwrap();
        let text = "/v/site-packages/torch/nn/modules/linear.py(106): Linear.__init__\n/job/train.py(9): step";
        let reading = reader.read(text);
        assert_eq!(reading.owner.map(|o| o.join("@")).as_deref(), Some("frozen"), "the user's rule wins");
        assert!(reading.in_step_frame);
        let missing = format!("{:#}", read(Some(&dir.join("none.rules")), None).unwrap_err());
        assert!(missing.contains("cannot read the owner rules"), "{missing}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
