//! The VM figures (`cargo xtask bench --vm-only`): what tracing adds per aclrtMalloc+aclrtFree
//! pair, and how long a SIGTERM takes to a complete DB, measured by one shell script inside each
//! machine and on the host in the same run. TCG emulates every instruction, so a VM's absolute
//! times say little; each figure stands as a ratio to the host's, beside the ratio of the
//! untraced loop (how much slower the emulated machine is at anything).
//!
//! A shell script rather than the bench's Rust: it is the one thing both the host and the arm64
//! machine can run, with the same release binary (the host takes its own architecture's).

use std::fmt::Write as _;
use std::path::Path;

use crate::build::Built;

pub struct Params {
    pub pairs: u64,
    /// Live blocks the traced job holds when the tracer gets its SIGTERM.
    pub blocks: u64,
    pub rounds: usize,
}

/// The script: `$MEMSCOPE_BIN` is the tracer; it prints `FIGURE NAME VALUE` lines.
pub fn script(built: &Built, root: &Path, p: &Params) -> String {
    let hold = root.join("tests/workloads/standin_hold.py");
    let mut s = String::new();
    let _ = write!(
        s,
        "fig=${{MEMSCOPE_FIGURES:-/tmp/figures}}\n\
\
         pair() {{ sed -n 's/^ns_per_pair \\([0-9.]*\\).*/\\1/p'; }}\n\
         i=0\n\
         while [ $i -lt {rounds} ]; do\n\
         i=$((i + 1)); rm -rf \"$fig\"; mkdir -p \"$fig\"\n\
         echo \"FIGURE untraced_ns $('{bench}' {pairs} | pair)\"\n\
         echo \"FIGURE traced_ns $(\"$MEMSCOPE_BIN\" trace --quiet --output \"$fig/t\" --lib '{lib}' -- '{bench}' {pairs} | pair)\"\n\
         ASCEND_HOME_PATH='{home}' \"$MEMSCOPE_BIN\" trace --quiet --output \"$fig/s\" -- python3 '{hold}' --ledger \"$fig/ledger\" \
         --blocks {blocks} --hold 600 --ready-file \"$fig/ready\" 2>\"$fig/stderr\" &\n\
         tracer=$!\n\
         while [ ! -s \"$fig/ready\" ] && kill -0 $tracer 2>/dev/null; do sleep 0.1; done\n\
         sleep 2\n\
         t0=$(date +%s%N); kill -TERM $tracer; wait $tracer; rc=$?; t1=$(date +%s%N)\n\
         kill -KILL \"$(cat \"$fig/ready\")\" 2>/dev/null\n\
         if [ $rc -eq 0 ]; then echo \"FIGURE stop_ms $(( (t1 - t0) / 1000000 ))\"; else echo \"FIGURE failed stop rc=$rc\"; cat \"$fig/stderr\"; fi\n\
         done\n",
        home = built.ascend_home.display(),
        rounds = p.rounds,
        bench = built.alloc_bench.display(),
        pairs = p.pairs,
        lib = built.libascendcl.display(),
        hold = hold.display(),
        blocks = p.blocks,
    );
    s
}

/// The median of each figure in a script's output; `None` for one it did not print.
pub struct Figures {
    pub untraced_ns: Option<f64>,
    pub traced_ns: Option<f64>,
    pub stop_ms: Option<f64>,
}

impl Figures {
    pub fn parse(output: &str) -> Self {
        let median = |name: &str| {
            let mut v: Vec<f64> = output
                .lines()
                .filter_map(|l| l.trim_end().strip_prefix("FIGURE ")?.strip_prefix(name)?.trim().parse().ok())
                .collect();
            v.sort_by(f64::total_cmp);
            (!v.is_empty()).then(|| v[v.len() / 2])
        };
        Self { untraced_ns: median("untraced_ns "), traced_ns: median("traced_ns "), stop_ms: median("stop_ms ") }
    }

    /// Nanoseconds tracing adds per pair.
    pub fn added_ns(&self) -> Option<f64> {
        Some(self.traced_ns? - self.untraced_ns?)
    }
}

/// The results section: the host and each machine, each VM figure also as a ratio to the host's.
pub fn table(p: &Params, host: (&str, &Figures), machines: &[(String, Figures)]) -> String {
    let fmt = |v: Option<f64>| v.map_or("–".to_owned(), |v| format!("{v:.0}"));
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.1}x", a / b),
        _ => "–".to_owned(),
    };
    let mut md = format!(
        "\n## Inside the VMs (TCG), against the host\n\nCommand: `cargo xtask bench --vm-only --vm-pairs {} --vm-blocks {} \
         --rounds {}` (the release binary; {} aclrtMalloc+aclrtFree pairs per run; the stop with {} live \
         blocks). Medians of {} runs. A VM's ratio is its figure over the host's in the same run; the \
         untraced loop's ratio is how much slower the emulated machine is at anything.\n\n\
         | machine | untraced ns per pair | added by `trace` | SIGTERM to exit, ms | untraced ratio | added ratio | stop ratio |\n\
         |---|---|---|---|---|---|---|\n",
        p.pairs, p.blocks, p.rounds, p.pairs, p.blocks, p.rounds
    );
    let _ = writeln!(
        md,
        "| host, {} | {} | {} | {} | 1 | 1 | 1 |",
        host.0,
        fmt(host.1.untraced_ns),
        fmt(host.1.added_ns()),
        fmt(host.1.stop_ms)
    );
    for (name, f) in machines {
        let _ = writeln!(
            md,
            "| {name} | {} | {} | {} | {} | {} | {} |",
            fmt(f.untraced_ns),
            fmt(f.added_ns()),
            fmt(f.stop_ms),
            ratio(f.untraced_ns, host.1.untraced_ns),
            ratio(f.added_ns(), host.1.added_ns()),
            ratio(f.stop_ms, host.1.stop_ms),
        );
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_of_each_figure_and_a_missing_one_stays_missing() {
        let out = "FIGURE untraced_ns 100.5\nnoise\nFIGURE traced_ns 900\nFIGURE untraced_ns 300\n\
                   FIGURE untraced_ns 200\nFIGURE traced_ns 1100\nFIGURE traced_ns 1000\nFIGURE failed stop rc=1\n";
        let f = Figures::parse(out);
        assert_eq!(f.untraced_ns, Some(200.0));
        assert_eq!(f.added_ns(), Some(800.0));
        assert_eq!(f.stop_ms, None);
    }
}
