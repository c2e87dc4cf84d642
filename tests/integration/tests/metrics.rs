//! Privileged test of `trace --listen`: a real Prometheus (Debian's package, started here on
//! loopback with its own config and data folder) scrapes the tracer while a stand-in job holds
//! its blocks, and a PromQL query over Prometheus's HTTP API returns the job's live bytes and
//! allocations as the job's own ledger counts them.

use std::time::{Duration, Instant};

use memscope_integration::*;

#[test]
fn prometheus_scrapes_the_jobs_live_bytes_and_allocations_as_its_ledger_counts_them() {
    let env = env("metrics_prometheus");
    if let Some(why) = prometheus_missing() {
        eprintln!("SKIPPED: {why}");
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
    let metrics = metrics_address(&tracer.stderr());
    let (status, body) = get(metrics, "/healthz").unwrap();
    assert!(status.contains(" 200 ") && body == "ok\n", "/healthz: {status} {body:?}");
    assert!(get(metrics, "/nothing").unwrap().0.contains("404"));

    let ledger = read_ledger(&ledger_path);
    let mallocs: Vec<&Entry> = ledger.iter().filter(|e| e.api == "aclrtMalloc" && e.rc == 0).collect();
    // Device memory as the driver hands it out: the stand-in runtime asks its driver for each
    // aclrtMalloc's size + 32, rounded up to 32 (standin_ascendcl.c's header), as CANN pads.
    let live_bytes: u64 = mallocs.iter().filter_map(|e| e.size).map(|n| (n + 32).div_ceil(32) * 32).sum();
    assert_eq!(mallocs.len(), 300, "the ledger's allocations");

    let (_prometheus, prometheus_addr) = start_prometheus(&env.scratch, metrics);

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
