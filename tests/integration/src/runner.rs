//! Starting things: memscope-bpf with its stderr collected line by line ([`Tracer`]), the
//! stand-in workload launched or attached to mid-run, the stand-in torch_npu scripts under
//! `trace`, and waiting for each with a deadline so a hung process fails the test instead of
//! hanging it.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::environment::{var, wall_ns, TestEnv};
use crate::ledgers::{driver_ledger_path, pool_ledger_path};
use crate::readers::{read_output, Output};

/// A running tracer with its stderr collected line by line (with arrival times).
/// `daemon` flags that probe the pool and CPU-tensor calls at all times: for the daemon tests
/// that are not about its windows (tests/windows.rs is), whose jobs may run past the default's
/// first window on a slow machine.
pub const ALWAYS_PROBED: [&str; 2] = ["--windows", "always"];

pub struct Tracer {
    pub child: Child,
    lines: Arc<Mutex<Vec<(u64, String)>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}
impl Tracer {
    pub fn spawn(env: &TestEnv, args: &[&str], extra_env: &[(&str, &Path)]) -> Self {
        let vars: Vec<(&str, Option<&std::ffi::OsStr>)> =
            extra_env.iter().map(|(k, v)| (*k, Some(v.as_os_str()))).collect();
        Self::spawn_with(env, args, &vars)
    }

    /// As [`Self::spawn`], with variables to set (`Some`) or to remove (`None`) so that a launched
    /// job does not inherit them from whoever runs the tests.
    pub fn spawn_with(env: &TestEnv, args: &[&str], vars: &[(&str, Option<&std::ffi::OsStr>)]) -> Self {
        Self::spawn_wrapped(env, &[], args, vars)
    }

    /// As [`Self::spawn_with`], started through `wrapper` (e.g. `setpriv ... --`), which is
    /// given memscope-bpf's path and `args`.
    pub fn spawn_wrapped(
        env: &TestEnv,
        wrapper: &[&str],
        args: &[&str],
        vars: &[(&str, Option<&std::ffi::OsStr>)],
    ) -> Self {
        let mut cmd = match wrapper.split_first() {
            Some((program, rest)) => {
                let mut cmd = Command::new(program);
                cmd.args(rest).arg(&env.bin);
                cmd
            }
            None => Command::new(&env.bin),
        };
        cmd.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        for (k, v) in vars {
            match v {
                Some(v) => cmd.env(k, v),
                None => cmd.env_remove(k),
            };
        }
        let mut child = cmd.spawn().expect("start memscope-bpf");
        let stderr = child.stderr.take().unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&lines);
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                sink.lock().unwrap().push((wall_ns(), line));
            }
        });
        Self { child, lines, reader: Some(reader) }
    }

    /// Waits for the "live:" line; returns when it arrived (wall ns).
    pub fn wait_live(&mut self, timeout: Duration) -> u64 {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some((at, _)) = self.lines.lock().unwrap().iter().find(|(_, l)| l.contains(": live:")) {
                return *at;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                std::thread::sleep(Duration::from_millis(100));
                panic!("tracer exited ({status}) before going live:\n{}", self.stderr());
            }
            assert!(Instant::now() < deadline, "tracer not live after {timeout:?}:\n{}", self.stderr());
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn stderr(&self) -> String {
        self.lines.lock().unwrap().iter().map(|(_, l)| l.as_str()).collect::<Vec<_>>().join("\n")
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: plain kill(2) on our child.
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }

    /// Waits for exit (with a deadline) and returns (exit code, stderr).
    pub fn finish(mut self, timeout: Duration) -> (Option<i32>, String) {
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("tracer did not exit within {timeout:?}:\n{}", self.stderr());
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        (status.code(), self.stderr())
    }
}
/// A test that panics while its tracer runs leaves no tracer behind (its probes would stay on
/// the stand-in libraries, and a daemon's on every later test's jobs).
impl Drop for Tracer {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
/// The workload command line (for launch mode or a plain spawn).
pub fn workload_args(env: &TestEnv, ledger: &Path, extra: &[&str]) -> Vec<String> {
    let mut v =
        vec!["python3".to_owned(), env.workload.display().to_string(), "--ledger".into(), ledger.display().to_string()];
    v.extend(extra.iter().map(|s| (*s).to_owned()));
    v
}
/// Starts the workload directly (for attach mode).
pub fn spawn_workload(env: &TestEnv, ledger: &Path, extra: &[&str]) -> Child {
    let args = workload_args(env, ledger, extra);
    Command::new(&args[0])
        .args(&args[1..])
        .env("ASCEND_HOME_PATH", &env.ascend_home)
        .env("STANDIN_HAL_LEDGER", driver_ledger_path(ledger))
        .env("STANDIN_TORCH_LEDGER", pool_ledger_path(ledger))
        .spawn()
        .expect("start workload")
}
/// A trace attached by pid to a workload already running.
pub struct AttachedRun {
    /// Wall-clock ns just before the tracer was started.
    pub start: u64,
    /// Wall-clock ns when the tracer said its probes were live.
    pub live: u64,
    pub stderr: String,
    pub out: Output,
}
/// Starts the workload with `extra`, lets it run 1.5 s, attaches `trace --pid` (no other
/// flags: the tracer must find everything itself), waits for the workload and the tracer to
/// exit successfully, and reads the output.
pub fn trace_attached_mid_run(env: &TestEnv, ledger: &Path, extra: &[&str]) -> AttachedRun {
    let out = env.scratch.join("out");
    let mut workload = spawn_workload(env, ledger, extra);
    std::thread::sleep(Duration::from_millis(1500));
    let start = wall_ns();
    let pid = workload.id().to_string();
    let out_s = out.display().to_string();
    let mut tracer = Tracer::spawn(env, &["trace", "--pid", &pid, "--output", &out_s], &[]);
    let live = tracer.wait_live(Duration::from_secs(30));
    assert_eq!(wait_child(&mut workload, Duration::from_secs(60)), 0);
    let (code, stderr) = tracer.finish(Duration::from_secs(30));
    assert_eq!(code, Some(0), "{stderr}");
    AttachedRun { start, live, stderr, out: read_output(&out) }
}
pub fn wait_child(child: &mut Child, timeout: Duration) -> i32 {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s.code().unwrap_or(-1);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("workload did not finish within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
/// Launches a workload script from tests/workloads (`script`) on the stand-in torch_npu under
/// `trace --lib <torch>`, with `--torch-lib` and `--ledger` (a file in the scratch folder named
/// `ledger`), the markers on PYTHONPATH and the allocator's ledger next to it; waits for both to
/// exit successfully. Returns the output and the ledger's path.
pub fn trace_standin_script(env: &TestEnv, script: &str, ledger: &str) -> (Output, PathBuf) {
    trace_standin_run(env, script, ledger, "out", &[], &[])
}
/// As [`trace_standin_script`], into `env.scratch/<out>`, with `extra` arguments for the script
/// and `vars` set in its environment.
pub fn trace_standin_run(
    env: &TestEnv,
    script: &str,
    ledger: &str,
    out: &str,
    extra: &[&str],
    vars: &[(&str, &str)],
) -> (Output, PathBuf) {
    let job_env: Vec<(&str, Option<&str>)> = vars.iter().map(|(k, v)| (*k, Some(*v))).collect();
    trace_standin_run_with(env, script, ledger, out, extra, &[], &job_env)
}
/// As [`trace_standin_run`], also probing `libs` from the start (`--lib`), and with the job's
/// environment changed: `Some` sets a variable, `None` removes it.
pub fn trace_standin_run_with(
    env: &TestEnv,
    script: &str,
    ledger: &str,
    out: &str,
    extra: &[&str],
    libs: &[&Path],
    job_env: &[(&str, Option<&str>)],
) -> (Output, PathBuf) {
    trace_standin_with_options(env, script, ledger, out, &[], extra, libs, job_env)
}
/// As [`trace_standin_run_with`], with `options` for `trace` itself (`--owner-rules FILE`).
#[expect(clippy::too_many_arguments, reason = "the knobs the helpers above default")]
pub fn trace_standin_with_options(
    env: &TestEnv,
    script: &str,
    ledger: &str,
    out: &str,
    options: &[&str],
    extra: &[&str],
    libs: &[&Path],
    job_env: &[(&str, Option<&str>)],
) -> (Output, PathBuf) {
    let torch = var("MEMSCOPE_TORCH_WITH_DEBUG");
    let markers = var("MEMSCOPE_MARKERS");
    let workload = var("MEMSCOPE_TAGS_WORKLOAD").with_file_name(script);
    let ledger = env.scratch.join(ledger);
    let pool = pool_ledger_path(&ledger);
    let out = env.scratch.join(out);
    let (out_s, torch_s, ledger_s, workload_s) = (
        out.display().to_string(),
        torch.display().to_string(),
        ledger.display().to_string(),
        workload.display().to_string(),
    );
    let lib_args: Vec<String> = libs.iter().map(|l| l.display().to_string()).collect();
    let mut args = vec!["trace", "--output", &out_s, "--lib", &torch_s];
    for lib in &lib_args {
        args.extend(["--lib", lib.as_str()]);
    }
    args.extend_from_slice(options);
    args.extend(["--", "python3", &workload_s, "--torch-lib", &torch_s, "--ledger", &ledger_s]);
    args.extend_from_slice(extra);
    let mut vars: Vec<(&str, Option<&std::ffi::OsStr>)> = vec![
        ("ASCEND_HOME_PATH", Some(env.ascend_home.as_os_str())),
        ("PYTHONPATH", Some(markers.as_os_str())),
        ("STANDIN_TORCH_LEDGER", Some(pool.as_os_str())),
    ];
    vars.extend(job_env.iter().map(|(k, v)| (*k, v.map(std::ffi::OsStr::new))));
    let (code, stderr) = Tracer::spawn_with(env, &args, &vars).finish(Duration::from_secs(120));
    assert_eq!(code, Some(0), "{stderr}");
    (read_output(&out), ledger)
}
/// Waits for a workload to write `path` (non-empty) and returns its text; fails if the workload
/// exits first or `timeout` passes.
pub fn wait_for_file(path: &Path, child: &mut Child, timeout: Duration) -> String {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(text) = std::fs::read_to_string(path) {
            if !text.is_empty() {
                return text;
            }
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("workload exited ({status}) before writing {}", path.display());
        }
        assert!(Instant::now() < deadline, "no {} after {timeout:?}", path.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}
/// `memscope-bpf advise OUT --json --device 0`, as a user runs it on a trace's folder: the advice
/// for device 0.
pub fn advise_device0(env: &TestEnv, out: &Output) -> serde_json::Value {
    let dir = out.run_dir.to_str().unwrap();
    let run = Command::new(&env.bin).args(["advise", dir, "--json", "--device", "0"]).output().unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let all: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    all.as_array().expect("one element per DB")[0].clone()
}
