//! Privileged tests of what MindStudio Insight needs of a trace beyond its rows' values: its
//! import rules on every DB (applied by `read_output` to every test's output, and swept over the
//! whole privileged tier by xtask), the files' owner and modes under `sudo`, and attach-mode
//! traces whose threads chose their device before the attach. Ground truth: the workload's
//! ledger, Insight's rules (shared/reference/stacks-daemon-exports.md §6) and the file system.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use memscope_integration::*;

/// `nobody`: a user other than the tests' own, as `sudo` names the invoking user.
const SUDO_ID: u32 = 65534;

/// A file in a test's scratch folder naming the `uid:gid` its DBs belong to, for the sweep.
const OWNER_NOTE: &str = "expected_owner";

/// The owner a DB under the scratch folder must have: the one noted by the test that wrote it
/// ([`OWNER_NOTE`] in a folder above it), else the tests' own.
fn noted_owner(db: &Path, scratch: &Path) -> (u32, u32) {
    for dir in db.ancestors().take_while(|d| d.starts_with(scratch)) {
        if let Ok(text) = std::fs::read_to_string(dir.join(OWNER_NOTE)) {
            let (uid, gid) = text.trim().split_once(':').expect("uid:gid");
            return (uid.parse().unwrap(), gid.parse().unwrap());
        }
    }
    expected_owner()
}

fn walk(root: &Path) -> Vec<PathBuf> {
    let mut all = vec![root.to_owned()];
    let mut i = 0;
    while i < all.len() {
        if all[i].is_dir() {
            let mut more: Vec<PathBuf> = std::fs::read_dir(&all[i]).unwrap().map(|e| e.unwrap().path()).collect();
            all.append(&mut more);
        }
        i += 1;
    }
    all
}

#[test]
fn under_sudo_the_invoking_user_owns_every_folder_and_file_and_only_they_can_read_them() {
    let env = env("sudo_owner");
    std::fs::write(env.scratch.join(OWNER_NOTE), format!("{SUDO_ID}:{SUDO_ID}")).unwrap();
    let out = env.scratch.join("out/nested");
    let ledger = env.scratch.join("ledger.jsonl");
    let out_s = out.display().to_string();
    let mut args = vec!["trace".to_owned(), "--output".into(), out_s, "--".into()];
    args.extend(workload_args(&env, &ledger, &["--steps", "30", "--step-sleep-ms", "40", "--host", "--vmm"]));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let id = SUDO_ID.to_string();
    let vars: Vec<(&str, Option<&std::ffi::OsStr>)> = vec![
        ("ASCEND_HOME_PATH", Some(env.ascend_home.as_os_str())),
        ("SUDO_UID", Some(id.as_ref())),
        ("SUDO_GID", Some(id.as_ref())),
    ];
    let mut tracer = Tracer::spawn_with(&env, &args, &vars);
    tracer.wait_live(Duration::from_secs(30));
    // While tracing: the DB, its -wal and -shm, and the folders are already the user's.
    let deadline = Instant::now() + Duration::from_secs(20);
    let live_files = loop {
        let files: Vec<PathBuf> =
            walk(&out).into_iter().filter(|p| p.to_string_lossy().contains("memscope_dump_")).collect();
        if files.iter().any(|p| p.to_string_lossy().ends_with("-wal")) {
            break files;
        }
        assert!(Instant::now() < deadline, "no DB in WAL mode under {}: {files:?}", out.display());
        std::thread::sleep(Duration::from_millis(50));
    };
    for p in &live_files {
        assert_private(p, (SUDO_ID, SUDO_ID));
    }
    let (code, stderr) = tracer.finish(Duration::from_secs(120));
    assert_eq!(code, Some(0), "{stderr}");
    // The output folder the tracer created (and its parent, also created) and everything in it.
    let everything = walk(&env.scratch.join("out"));
    assert!(everything.len() > 8, "{everything:?}");
    for p in &everything {
        assert_private(p, (SUDO_ID, SUDO_ID));
    }
    let dbs = insight_dbs_under(&out);
    assert!(dbs.len() >= 3, "two devices and host memory: {dbs:?}");
    for db in &dbs {
        insight_rules_for(db, (SUDO_ID, SUDO_ID));
    }
    // An analysis that writes into the DBs afterwards (as root) keeps their owner and modes,
    // and leaves no journal behind.
    let run_dir = run_dir(&out);
    let analyze = std::process::Command::new(&env.bin)
        .args(["analyze", "--analysis", "decompose,leaks"])
        .arg(&run_dir)
        .output()
        .unwrap();
    assert!(analyze.status.success(), "{}", String::from_utf8_lossy(&analyze.stderr));
    let after = walk(&env.scratch.join("out"));
    assert_eq!(after.len(), everything.len(), "the analysis left files behind: {after:?}");
    for p in &after {
        assert_private(p, (SUDO_ID, SUDO_ID));
    }
    let conn = rusqlite::Connection::open(&dbs[0]).unwrap();
    let tables: i64 = conn
        .query_row("SELECT count(*) FROM sqlite_master WHERE name IN ('ms_decompose', 'ms_steps')", [], |r| r.get(0))
        .unwrap();
    assert_eq!(tables, 2, "the analysis did write into the DB");
}

/// The thread of each row the trace placed on a device by a driver flag (the earliest, per thread).
fn first_named(out: &Output) -> std::collections::HashMap<u32, u64> {
    let mut first = std::collections::HashMap::new();
    for r in out.call_rows() {
        if r.event == "MALLOC" && r.attr.contains_key("flag") && r.device != "N/A" {
            first.entry(r.tid).and_modify(|t: &mut u64| *t = (*t).min(r.ts)).or_insert(r.ts);
        }
    }
    first
}

#[test]
fn attached_to_threads_that_chose_their_device_before_the_trace_every_db_opens_in_insight() {
    let env = env("attach_device_learnt");
    let ledger_path = env.scratch.join("ledger.jsonl");
    // No set-device calls after the attach: only the calls themselves name the device.
    let run = trace_attached_mid_run(
        &env,
        &ledger_path,
        &["--duration", "8", "--step-sleep-ms", "10", "--host", "--vmm", "--with-cfg", "--keep-weights"],
    );
    let ledger = read_ledger(&ledger_path);
    let out = &run.out;
    assert_attached(&ledger, out, run.start, run.live, u64::MAX);
    assert!(
        out.files.keys().all(|k| k.starts_with("device_") || k == UNKNOWN_DEVICE),
        "no other files: {:?}",
        out.files.keys()
    );
    assert!(out.files.contains_key("device_0") && out.files.contains_key("device_1"), "{:?}", out.files.keys());
    assert!(!out.run_dir.join("device_unknown").exists(), "a device_unknown folder Insight cannot import");
    // Once a thread's call named its device, none of its later rows lacks one: the device is
    // learnt, and the ledger agrees with it.
    let named = first_named(out);
    assert!(!named.is_empty(), "driver flags name the devices");
    // A block allocated before its thread named a device lives in the unknown-device file, and
    // its later ACCESS and FREE rows stay beside its MALLOC (Insight pairs them within a file).
    let unknown_blocks: std::collections::HashSet<&str> = out
        .files
        .get(UNKNOWN_DEVICE)
        .map(|(_, rows)| {
            rows.iter()
                .filter(|r| r.event == "MALLOC")
                .filter_map(|r| r.attr.get("allocation_id"))
                .map(String::as_str)
                .collect()
        })
        .unwrap_or_default();
    for r in out.rows().chain(&out.untracked) {
        let Some(&from) = named.get(&r.tid) else { continue };
        let of_unknown_block = matches!(r.event.as_str(), "ACCESS" | "FREE")
            && r.device == "N/A"
            && r.attr.get("allocation_id").is_some_and(|id| unknown_blocks.contains(id.as_str()));
        if r.ts > from && !of_unknown_block && !matches!(r.event.as_str(), "SYSTEM" | "MSTX" | "OP_LAUNCH") {
            assert_ne!(r.device, "N/A", "thread {} named its device at {from}, yet: {r:?}", r.tid);
        }
    }
    let device_of_thread: std::collections::HashMap<u32, String> = ledger
        .iter()
        .filter(|e| e.api == "aclrtMalloc" && e.rc == 0)
        .filter_map(|e| Some((e.tid, e.device_id()?)))
        .collect();
    for r in out.call_rows().into_iter().filter(|r| r.event == "MALLOC" && r.event_type == "HAL") {
        if named.get(&r.tid).is_some_and(|t| r.ts > *t) && !r.attr.contains_key("flag") && r.name == "aclrtMalloc" {
            assert_eq!(Some(&r.device), device_of_thread.get(&r.tid), "a learnt device is the thread's: {r:?}");
        }
    }
    // Frees of blocks born before the attach are in our own table, counted in the summary.
    for f in &out.untracked {
        assert_eq!((f.event.as_str(), f.attr.get("unmatched").map(String::as_str)), ("FREE", Some("true")), "{f:?}");
    }
    assert_eq!(summary_untracked_frees(&run.stderr), out.untracked.len() as u64, "{}", run.stderr);
}

/// Run by `cargo xtask test` after the privileged tier: every DB named for Insight that the
/// tier's tests wrote (under `MEMSCOPE_SCRATCH`, modified since `MEMSCOPE_SWEEP_SINCE`) passes
/// Insight's import rules, so no test's output escapes them.
#[test]
#[ignore = "run by `cargo xtask test` after the privileged tier"]
fn every_db_the_privileged_tier_wrote_passes_insights_import_rules() {
    let scratch = var("MEMSCOPE_SCRATCH");
    let since: u64 = std::env::var("MEMSCOPE_SWEEP_SINCE").ok().and_then(|s| s.parse().ok()).unwrap_or(0);
    let dbs: Vec<PathBuf> = insight_dbs_under(&scratch)
        .into_iter()
        .filter(|p| std::fs::metadata(p).unwrap().mtime() as u64 >= since)
        .collect();
    assert!(!dbs.is_empty(), "no DB under {} since {since}", scratch.display());
    eprintln!("checking {} DBs under {} written since {since} (unix s)", dbs.len(), scratch.display());
    for db in &dbs {
        insight_rules_for(db, noted_owner(db, &scratch));
    }
}
