//! Privileged test of `trace --listen`: a real Prometheus (Debian's package, started here on
//! loopback with its own config and data folder) scrapes the tracer while a stand-in job holds
//! its blocks, and a PromQL query over Prometheus's HTTP API returns the job's live bytes and
//! allocations as the job's own ledger counts them.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use memscope_integration::*;

/// Kills Prometheus however the test ends.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `GET path` over HTTP/1.0; the status line and the body.
fn get(addr: SocketAddr, path: &str) -> std::io::Result<(String, String)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut reply = String::new();
    stream.read_to_string(&mut reply)?;
    let (head, body) = reply.split_once("\r\n\r\n").unwrap_or((&reply, ""));
    Ok((head.lines().next().unwrap_or_default().to_owned(), body.to_owned()))
}

/// A PromQL query's single value, once Prometheus has one.
fn query(prometheus: SocketAddr, promql: &str) -> Option<u64> {
    let mut encoded = String::new();
    for b in promql.bytes() {
        match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' => encoded.push(b as char),
            _ => encoded.push_str(&format!("%{b:02X}")),
        }
    }
    let (_, body) = get(prometheus, &format!("/api/v1/query?query={encoded}")).ok()?;
    let reply: serde_json::Value = serde_json::from_str(&body).ok()?;
    let result = reply["data"]["result"].as_array()?;
    assert!(result.len() <= 1, "{promql}: one series expected, got {reply}");
    result.first()?["value"][1].as_str()?.parse().ok()
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn prometheus_scrapes_the_jobs_live_bytes_and_allocations_as_its_ledger_counts_them() {
    let env = env("metrics_prometheus");
    if Command::new("prometheus").arg("--version").output().is_err() {
        eprintln!("SKIPPED: prometheus is not installed (Debian's package; `cargo xtask setup` installs it)");
        return;
    }
    let (out, ledger_path, ready) =
        (env.scratch.join("out"), env.scratch.join("ledger.jsonl"), env.scratch.join("ready"));
    let s = |p: &std::path::Path| p.display().to_string();
    let hold = env.workload.with_file_name("standin_hold.py");
    let args = [
        "trace",
        "--output",
        &s(&out),
        "--listen",
        "127.0.0.1:0",
        "--",
        "python3",
        &s(&hold),
        "--ledger",
        &s(&ledger_path),
        "--blocks",
        "300",
        "--size",
        "8192",
        "--ready-file",
        &s(&ready),
        "--hold",
        "120",
    ];
    let mut tracer = Tracer::spawn(&env, &args, &[("ASCEND_HOME_PATH", &env.ascend_home)]);
    tracer.wait_live(Duration::from_secs(60));
    let deadline = Instant::now() + Duration::from_secs(60);
    while !ready.exists() {
        assert!(tracer.child.try_wait().unwrap().is_none(), "tracer exited early:\n{}", tracer.stderr());
        assert!(Instant::now() < deadline, "the workload did not allocate its blocks:\n{}", tracer.stderr());
        std::thread::sleep(Duration::from_millis(50));
    }
    let stderr = tracer.stderr();
    let metrics: SocketAddr = stderr
        .lines()
        .find_map(|l| l.split("metrics: http://").nth(1)?.strip_suffix("/metrics")?.parse().ok())
        .unwrap_or_else(|| panic!("no metrics address in:\n{stderr}"));
    let (status, body) = get(metrics, "/healthz").unwrap();
    assert!(status.contains(" 200 ") && body == "ok\n", "/healthz: {status} {body:?}");
    assert!(get(metrics, "/nothing").unwrap().0.contains("404"));

    let ledger = read_ledger(&ledger_path);
    let mallocs: Vec<&Entry> = ledger.iter().filter(|e| e.api == "aclrtMalloc" && e.rc == 0).collect();
    // Device memory as the driver hands it out: the stand-in runtime asks its driver for each
    // aclrtMalloc's size + 32, rounded up to 32 (standin_ascendcl.c's header), as CANN pads.
    let live_bytes: u64 = mallocs.iter().filter_map(|e| e.size).map(|n| (n + 32).div_ceil(32) * 32).sum();
    assert_eq!(mallocs.len(), 300, "the ledger's allocations");

    let prometheus_addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let config = env.scratch.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: memscope\n    static_configs:\n      - targets: ['{metrics}']\n"
        ),
    )
    .unwrap();
    let prometheus = Command::new("prometheus")
        .arg(format!("--config.file={}", config.display()))
        .arg(format!("--storage.tsdb.path={}", env.scratch.join("tsdb").display()))
        .arg(format!("--web.listen-address={prometheus_addr}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("cannot start prometheus");
    let _prometheus = Killed(prometheus);

    // What the scraped series say, once Prometheus has scraped (every second).
    let live = r#"memscope_live_bytes{job="memscope",device="0"}"#;
    let allocations = r#"memscope_allocations_total{job="memscope",device="0"}"#;
    let want = (Some(live_bytes), Some(mallocs.len() as u64));
    let deadline = Instant::now() + Duration::from_secs(60);
    let got = loop {
        // A scrape taken before the tracer had drained the last calls is older than the ledger.
        let got = (query(prometheus_addr, live), query(prometheus_addr, allocations));
        if got == want || Instant::now() > deadline {
            break got;
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    assert_eq!(got, want, "(live bytes, allocations) by Prometheus against the ledger:\n{}", tracer.stderr());
    assert_eq!(query(prometheus_addr, r#"memscope_records_lost_total{job="memscope"}"#), Some(0));

    tracer.signal(libc::SIGTERM);
    // The workload shares the tracer's stderr: it goes too, so the reader sees the pipe close.
    let workload: i32 = std::fs::read_to_string(&ready).unwrap().trim().parse().unwrap();
    // SAFETY: plain kill(2).
    unsafe { libc::kill(workload, libc::SIGKILL) };
    let (code, stderr) = tracer.finish(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{stderr}");
}
