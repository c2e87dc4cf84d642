//! The daemon's filter flags: which processes it traces. They are given on the command line and
//! in a file (`--filters FILE`, read again on SIGHUP so an operator can change them without a
//! restart); both are parsed by the same clap definition, so a line of the file is exactly a
//! flag of the command line, with the same checks and the same words in its errors.

use std::path::{Path, PathBuf};

use clap::Parser as _;

use super::rules::{self, RuleError};
use crate::attach::loader::Admission;

/// The filter flags (`memscope-bpf daemon --help` shows them among the others).
#[derive(clap::Args, Clone, Debug, Default, PartialEq, Eq)]
pub struct Filters {
    /// Trace only processes inside this cgroup (v2), given as /proc/PID/cgroup shows it
    /// (/kubepods.slice) or as a folder under the cgroup2 mount. Repeatable, at most 8: a
    /// process inside any of them is traced. Checked in the kernel at a process's first call.
    #[arg(long = "cgroup", value_name = "PATH")]
    pub cgroups: Vec<PathBuf>,

    /// Never trace processes inside this cgroup (v2), given as --cgroup is. Repeatable, at most
    /// 8; wins over --cgroup. Checked in the kernel at a process's first call.
    #[arg(long = "exclude-cgroup", value_name = "PATH")]
    pub exclude_cgroups: Vec<PathBuf>,

    /// Trace only this running process and the processes it forks (torchrun's workers, a
    /// DataLoader's). Repeatable. The other rules still apply to them.
    #[arg(long = "pid", value_name = "PID")]
    pub pids: Vec<u32>,

    /// Trace only processes of this command name, as /proc/PID/comm shows it (cut to 15 bytes).
    /// Repeatable. Judged as --exclude-comm is: at exec, at the start and on SIGHUP; a process
    /// forked from one not traced is not traced either, until it execs.
    #[arg(long = "comm", value_name = "NAME")]
    pub comms: Vec<String>,

    /// Never trace processes of this command name, as /proc/PID/comm shows it (cut to 15
    /// bytes). Repeatable. Checked in the kernel when a process execs, and here at the start
    /// (and on SIGHUP) for the processes already running.
    #[arg(long = "exclude-comm", value_name = "NAME")]
    pub exclude_comms: Vec<String>,

    /// Never trace this process (until it execs another program). Repeatable.
    #[arg(long = "exclude-pid", value_name = "PID")]
    pub exclude_pids: Vec<u32>,
}

/// One line of a filter file, parsed as the command line would be.
#[derive(clap::Parser)]
#[command(name = "filter file", no_binary_name = true, disable_help_flag = true)]
struct Line {
    #[command(flatten)]
    filters: Filters,
}

#[derive(Debug, thiserror::Error)]
pub enum FilterFileError {
    #[error("cannot read the filter file {path}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path} line {line}: {why} (each line is one filter flag and its value, as `--exclude-comm python3.8`)")]
    Line { path: PathBuf, line: usize, why: String },
}

impl Filters {
    /// Every list of `other` added to this one's.
    pub fn extend(&mut self, other: Filters) {
        self.cgroups.extend(other.cgroups);
        self.exclude_cgroups.extend(other.exclude_cgroups);
        self.pids.extend(other.pids);
        self.comms.extend(other.comms);
        self.exclude_comms.extend(other.exclude_comms);
        self.exclude_pids.extend(other.exclude_pids);
    }

    /// The rules as the kernel and the judge of running processes take them, checked.
    pub fn admission(&self) -> Result<Admission, RuleError> {
        let (allow_comms, deny_comms) = rules::name_rules(&self.comms, &self.exclude_comms)?;
        Ok(Admission {
            cgroups: rules::cgroup_rules("--cgroup", &self.cgroups)?,
            deny_cgroups: rules::cgroup_rules("--exclude-cgroup", &self.exclude_cgroups)?,
            deny_comms,
            allow_comms,
            allow_pids: rules::pid_rules(&self.pids, &self.exclude_pids)?,
            deny_pids: self.exclude_pids.clone(),
        })
    }
}

/// The flags of a filter file.
pub fn read_file(path: &Path) -> Result<Filters, FilterFileError> {
    // A filter file is a few lines; 1 MiB is far past any real one.
    let text = memscope_core::files::read_text(path, 1 << 20)
        .map_err(|source| FilterFileError::Read { path: path.to_owned(), source })?;
    parse_text(&text).map_err(|(line, why)| FilterFileError::Line { path: path.to_owned(), line, why })
}

/// The flags of a filter file's text; an error is the line (from 1) and why.
fn parse_text(text: &str) -> Result<Filters, (usize, String)> {
    let mut filters = Filters::default();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        // The flag, then its value whole (a cgroup path may hold spaces).
        let words: Vec<&str> = match line.split_once(char::is_whitespace) {
            Some((flag, value)) => vec![flag, value.trim()],
            None => vec![line],
        };
        let parsed = Line::try_parse_from(&words).map_err(|e| (i + 1, first_line(&e.to_string())))?;
        filters.extend(parsed.filters);
    }
    Ok(filters)
}

/// clap's message without its `error: ` prefix and usage lines.
fn first_line(text: &str) -> String {
    text.lines().next().unwrap_or_default().trim_start_matches("error: ").to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_holds_the_command_lines_flags_one_per_line() {
        let text = "# filters for node 7\n\n--exclude-comm python3.8\n--cgroup /kubepods.slice/pod one\n\
                    --exclude-pid 12\n  --comm train  \n";
        let got = parse_text(text).unwrap();
        assert_eq!(got.exclude_comms, ["python3.8"]);
        assert_eq!(got.cgroups, [PathBuf::from("/kubepods.slice/pod one")]);
        assert_eq!(got.exclude_pids, [12]);
        assert_eq!(got.comms, ["train"]);
    }

    #[test]
    fn a_bad_line_is_named_with_clap_s_reason() {
        let (line, why) = parse_text("--comm a\n--exclude-pid twelve\n").unwrap_err();
        assert_eq!(line, 2);
        assert!(why.contains("twelve") && why.contains("--exclude-pid"), "{why}");
        let (line, why) = parse_text("--comm a\n\n--no-such-flag x\n").unwrap_err();
        assert_eq!(line, 3);
        assert!(why.contains("--no-such-flag"), "{why}");
        let err = read_file(Path::new("/no/such/filters")).unwrap_err().to_string();
        assert!(err.contains("/no/such/filters"), "{err}");
    }

    /// The deployment's filter file (docs/deploy/filters, the DaemonSet's ConfigMap) is one the
    /// daemon reads, with the rules the deployment notes describe.
    #[test]
    fn the_deployments_filter_file_parses() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/deploy/filters");
        let got = read_file(&path).unwrap();
        assert_eq!(got.cgroups, [PathBuf::from("/kubepods.slice")]);
        assert_eq!(got.exclude_comms, ["kubelet"]);
        let manifest = std::fs::read_to_string(path.with_file_name("daemonset.yaml")).unwrap();
        assert!(manifest.contains("--filters=/etc/memscope/filters") && manifest.contains("name: memscope-filters"));
    }

    #[test]
    fn file_and_command_line_add_up() {
        let mut cli = Filters { exclude_comms: vec!["a".into()], ..Filters::default() };
        cli.extend(parse_text("--exclude-comm b\n--comm c").unwrap());
        assert_eq!(cli.exclude_comms, ["a", "b"]);
        assert_eq!(cli.comms, ["c"]);
    }
}
