//! Talking to what serves metrics: plain HTTP GETs, a real Prometheus (Debian's package) started
//! on loopback with its own config and data folder, and PromQL queries over its HTTP API, the
//! way an operator's dashboards read the series.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Kills a child process however the test ends.
pub struct Killed(pub Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `GET path` over HTTP/1.0; the status line and the body.
pub fn get(addr: SocketAddr, path: &str) -> std::io::Result<(String, String)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut reply = String::new();
    stream.read_to_string(&mut reply)?;
    let (head, body) = reply.split_once("\r\n\r\n").unwrap_or((&reply, ""));
    Ok((head.lines().next().unwrap_or_default().to_owned(), body.to_owned()))
}

/// A PromQL query's single value, once Prometheus has one.
pub fn query(prometheus: SocketAddr, promql: &str) -> Option<u64> {
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

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Whether Debian's Prometheus is installed; the reason to skip if not.
pub fn prometheus_missing() -> Option<&'static str> {
    Command::new("prometheus")
        .arg("--version")
        .output()
        .is_err()
        .then_some("prometheus is not installed (Debian's package; `cargo xtask setup` installs it)")
}

/// Starts Prometheus on a free loopback port, scraping `target` every second (job name
/// `memscope`), with its config and TSDB under `scratch`.
pub fn start_prometheus(scratch: &Path, target: SocketAddr) -> (Killed, SocketAddr) {
    let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let config = scratch.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: memscope\n    static_configs:\n      - targets: ['{target}']\n"
        ),
    )
    .unwrap();
    let child = Command::new("prometheus")
        .arg(format!("--config.file={}", config.display()))
        .arg(format!("--storage.tsdb.path={}", scratch.join("tsdb").display()))
        .arg(format!("--web.listen-address={addr}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("cannot start prometheus");
    (Killed(child), addr)
}

/// The address memscope-bpf printed it serves metrics on (`metrics: http://ADDR/metrics`).
pub fn metrics_address(stderr: &str) -> SocketAddr {
    stderr
        .lines()
        .find_map(|l| l.split("metrics: http://").nth(1)?.strip_suffix("/metrics")?.parse().ok())
        .unwrap_or_else(|| panic!("no metrics address in:\n{stderr}"))
}
