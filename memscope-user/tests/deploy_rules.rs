//! docs/deploy's alert rules, evaluated by Prometheus's own rule engine: `promtool test rules`
//! on tests/deploy/alerts_test.yml (series shaped as the daemon's, the alerts each must raise).
//! Skips, saying so, where Debian's `prometheus` package (`cargo xtask setup`) is not installed.

use std::path::Path;
use std::process::Command;

#[test]
fn the_deploy_alerts_fire_on_the_series_they_are_written_for() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let run =
        match Command::new("promtool").arg("test").arg("rules").arg(root.join("tests/deploy/alerts_test.yml")).output()
        {
            Ok(run) => run,
            Err(e) => {
                eprintln!("SKIPPED: promtool ({e}): `cargo xtask setup` installs Debian's prometheus");
                return;
            }
        };
    assert!(
        run.status.success(),
        "promtool test rules:\n{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
}
