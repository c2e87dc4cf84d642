//! Privileged tests of `report`: traced stand-in jobs written as HTML pages, opened in headless
//! Chromium (no console error, no network request), read back from the DOM the way a user reads
//! the page. Ground truth: the workloads' ledgers (which tensor had which owner, by construction)
//! and the stand-in allocator's own ledger (each block's size, in the order it handed them out
//! and took them back), never the tracer.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use memscope_integration::*;

/// Live bytes per owner-tree node (`""` the family's total, `PTA`, `PTA@vllm`, ...).
type Nodes = BTreeMap<String, u64>;

/// The allocator's block events in order, each with the owner the workload gave its tensor:
/// (allocated?, ptr, size, owner).
fn block_events(pool: &[PoolEntry], ledger: &Path) -> Vec<(bool, u64, u64, String)> {
    let tensors: Vec<serde_json::Value> = std::fs::read_to_string(ledger)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|v: &serde_json::Value| v["kind"] == "tensor")
        .collect();
    let (mut next, mut live) = (0, BTreeMap::new());
    let mut out = Vec::new();
    for e in pool.iter().filter(|e| e.device == 0) {
        match e.ev.as_str() {
            "block_malloc" => {
                let t = &tensors[next];
                next += 1;
                assert_eq!(t["ptr"].as_u64(), Some(e.ptr), "the ledgers disagree on the {next}th tensor");
                let owner = t["owner"].as_str().unwrap().to_owned();
                live.insert(e.ptr, (e.size.unwrap(), owner.clone()));
                out.push((true, e.ptr, e.size.unwrap(), owner));
            }
            "block_free" => {
                let (size, owner) = live.remove(&e.ptr).expect("a freed block was allocated");
                out.push((false, e.ptr, size, owner));
            }
            _ => {}
        }
    }
    out
}

/// The owner tree after the first `n` block events.
fn tree_after(events: &[(bool, u64, u64, String)], n: usize) -> Nodes {
    let mut live: BTreeMap<u64, (u64, &str)> = BTreeMap::new();
    for (alloc, ptr, size, owner) in &events[..n] {
        if *alloc {
            live.insert(*ptr, (*size, owner));
        } else {
            live.remove(ptr);
        }
    }
    let mut nodes = Nodes::new();
    for (size, owner) in live.values() {
        *nodes.entry(String::new()).or_default() += size;
        let levels: Vec<&str> = owner.split('@').collect();
        for depth in 1..=levels.len() {
            *nodes.entry(levels[..depth].join("@")).or_default() += size;
        }
    }
    nodes
}

fn nodes_of(v: &serde_json::Value) -> Nodes {
    v.as_object().unwrap().iter().map(|(k, b)| (k.clone(), b.as_u64().unwrap())).collect()
}

/// The owner tree as the page lists it (path -> bytes).
const TREE: &str = "Object.fromEntries([...document.querySelectorAll('#tree-table tr[data-path]')].map(r => [r.dataset.path, +r.dataset.bytes]))";

fn report(env: &TestEnv, inputs: &[&Path], name: &str) -> std::path::PathBuf {
    let page = env.scratch.join(name);
    let out = Command::new(&env.bin).arg("report").args(inputs).arg("-o").arg(&page).output().unwrap();
    assert!(out.status.success(), "report failed: {}", String::from_utf8_lossy(&out.stderr));
    page
}

#[test]
fn the_report_shows_the_ledgers_owners_and_peak_and_a_click_shows_that_instants_tree() {
    let env = env("report_serve");
    let Some(chromium) = chromium() else { return };
    // The serving scenario stays a second at its `serving` point: a plateau wide enough to click.
    let extra = ["--scenario", "serve", "--linger", "1.5"];
    let (out, ledger) = trace_standin_run(&env, "standin_tags.py", "tags.jsonl", "out", &extra, &[]);
    let events = block_events(&read_pool_ledger(&pool_ledger_path(&ledger)), &ledger);
    let run_dir = out.db("device_0").ancestors().nth(3).unwrap().to_owned();
    let page = report(&env, &[&run_dir], "report.html");

    // The peak by the allocator's ledger: the most bytes live after any event, first reached.
    let totals: Vec<u64> = (0..=events.len()).map(|n| tree_after(&events, n).get("").copied().unwrap_or(0)).collect();
    let peak = *totals.iter().max().unwrap();
    let peak_n = totals.iter().position(|&t| t == peak).unwrap();
    let shot = env.scratch.join("report.png");
    let evals = [
        "family=(document.querySelector('#family-picker [data-pick=PTA]').click(), document.querySelector('#family-picker .on').dataset.pick)",
        "peak=+document.getElementById('peak-bytes').dataset.bytes",
        "at=document.getElementById('tree-title').dataset.at",
        &format!("tree={TREE}"),
        "icicle=document.querySelectorAll('#tree .node[data-path]').length",
        "legend=[...document.querySelectorAll('#legend li[data-owner]')].map(l => l.dataset.owner)",
        "origin=DATA.runs[0].origin_ns",
        "start=DATA.runs[0].devices[0].start",
        "end=DATA.runs[0].devices[0].end",
        // The blocks table filtered as a user types, then sorted by size ascending.
        "filtered=(() => { const f = document.getElementById('block-filter'); f.value = 'kv_cache'; f.dispatchEvent(new Event('input')); return [...document.querySelectorAll('#blocks tbody tr')].map(r => [r.children[1].textContent, r.children[2].textContent]); })()",
        "sorted=(() => { const h = document.querySelector('#blocks th[data-key=size]'); h.click(); return [...document.querySelectorAll('#blocks tbody tr')].map(r => +r.dataset.size); })()",
        "capture=document.getElementById('capture-note') && document.getElementById('capture-note').textContent",
    ];
    let seen = visit(
        &chromium,
        &page,
        &Visit { evals: evals.iter().map(|s| s.to_string()).collect(), screenshot: Some(&shot), ..Visit::default() },
    );
    let dom = &seen["dom"];
    eprintln!("screenshot: {}", shot.display());
    assert_eq!(dom["family"], "PTA", "{dom}");
    assert_eq!(dom["peak"].as_u64(), Some(peak), "the page's peak against the allocator's ledger: {dom}");
    assert_eq!(dom["at"], "peak");
    assert_eq!(nodes_of(&dom["tree"]), tree_after(&events, peak_n), "the tree at the peak");
    assert!(dom["icicle"].as_u64().unwrap() >= 4, "{dom}");
    let mut owners: Vec<&str> = events.iter().map(|e| e.3.as_str()).collect();
    owners.sort_unstable();
    owners.dedup();
    let mut legend: Vec<&str> = dom["legend"].as_array().unwrap().iter().map(|o| o.as_str().unwrap()).collect();
    legend.sort_unstable();
    assert_eq!(legend, owners, "every owner the scenario gave is in the legend");
    // Typing `kv_cache` leaves the kv cache's blocks: the PTA tensors the scenario made for it
    // and the pool segments (HAL) taken for them.
    let kv_tensors = events.iter().filter(|e| e.0 && e.3 == "PTA@vllm@kv_cache").count();
    let filtered = dom["filtered"].as_array().unwrap();
    assert!(filtered.iter().all(|r| r[0].as_str().unwrap().contains("kv_cache")), "{filtered:?}");
    assert_eq!(filtered.iter().filter(|r| r[1] == "PTA").count(), kv_tensors, "{filtered:?}");
    let sorted: Vec<u64> = dom["sorted"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert!(sorted.len() == filtered.len() && sorted.windows(2).all(|w| w[0] <= w[1]), "{sorted:?}");

    // A click in the middle of the `serving` plateau.
    let origin: i64 = dom["origin"].as_str().unwrap().parse().unwrap();
    let (start, end) = (dom["start"].as_i64().unwrap(), dom["end"].as_i64().unwrap());
    let lines: Vec<serde_json::Value> =
        std::fs::read_to_string(&ledger).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let serving = lines.iter().find(|l| l["kind"] == "point" && l["name"] == "serving").unwrap()["t"].as_i64().unwrap();
    let fraction = ((serving + 750_000_000 - origin - start) as f64) / ((end - start) as f64);
    let after = [
        "at=document.getElementById('tree-title').dataset.at",
        "t=+document.getElementById('tree-title').dataset.t",
        &format!("tree={TREE}"),
    ];
    let evals = vec![evals[0].to_owned()];
    let clicked = visit(
        &chromium,
        &page,
        &Visit {
            evals,
            clicks: vec![fraction],
            after: after.iter().map(|s| s.to_string()).collect(),
            ..Visit::default()
        },
    );
    let click = &clicked["clicks"][0];
    assert_eq!(click["at"], "picked", "{click}");
    // The instant the page says it shows, in the DB's time: how many block events had happened.
    let at_ns = origin + click["t"].as_i64().unwrap();
    let conn = rusqlite::Connection::open(out.db("device_0")).unwrap();
    let happened: i64 = conn
        .query_row(
            "SELECT count(*) FROM memscope_dump WHERE \"Event Type\" = 'PTA' AND Event IN ('MALLOC', 'FREE') \
             AND Attr NOT LIKE '%shadow%' AND \"Timestamp(ns)\" <= ?1",
            [at_ns],
            |r| r.get(0),
        )
        .unwrap();
    let truth = tree_after(&events, happened as usize);
    assert_eq!(nodes_of(&click["tree"]), truth, "the tree at the clicked instant ({} block events in)", happened);
    assert!(truth.contains_key("PTA@vllm@kv_cache") && !truth.contains_key("PTA@vllm@profile_run"), "{truth:?}");

    // Our trace lacks nothing; the same rows as msMemScope's DB (no ms_meta) say what they lack.
    assert_eq!(dom["capture"], serde_json::Value::Null, "{dom}");
    // (Named so that the sweep of the tracer's own DBs, `insight.rs`, leaves this copy alone.)
    let foreign = env.scratch.join("msmemscope_copy.db");
    std::fs::copy(out.db("device_0"), &foreign).unwrap();
    rusqlite::Connection::open(&foreign).unwrap().execute_batch("DROP TABLE ms_meta").unwrap();
    let page = report(&env, &[&foreign], "msmemscope.html");
    let evals = vec!["capture=document.getElementById('capture-note').textContent".to_owned()];
    let seen = visit(&chromium, &page, &Visit { evals, ..Visit::default() });
    let note = seen["dom"]["capture"].as_str().unwrap_or_default().to_owned();
    assert!(note.starts_with("This trace is msMemScope's capture") && note.contains("pool segments"), "{note}");
}

#[test]
fn two_runs_compared_show_what_grew_by_the_leaky_runs_ledger() {
    let env = env("report_compare");
    let Some(chromium) = chromium() else { return };
    let steps = ["--steps", "6"];
    let clean = [&["--variant", "clean"][..], &steps[..]].concat();
    let leaky = [&["--variant", "leaky"][..], &steps[..]].concat();
    let (a, _) = trace_standin_run(&env, "standin_leaky.py", "clean.jsonl", "out-clean", &clean, &[]);
    let (b, ledger) = trace_standin_run(&env, "standin_leaky.py", "leaky.jsonl", "out-leaky", &leaky, &[]);
    // B's leak analysis, stored in its DB: the page shows it with B's run.
    let analyzed =
        Command::new(&env.bin).args(["analyze", "--analysis", "leaks"]).arg(b.db("device_0")).output().unwrap();
    assert!(analyzed.status.success(), "{}", String::from_utf8_lossy(&analyzed.stderr));
    let page = report(&env, &[a.db("device_0"), b.db("device_0")], "compare.html");

    // What the leaky run kept of kv_cache by the end of its last step: the allocator's sizes of
    // the tensors the workload leaked on purpose.
    let pool = read_pool_ledger(&pool_ledger_path(&ledger));
    let leaked_tensors: Vec<serde_json::Value> = std::fs::read_to_string(&ledger)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["kind"] == "tensor" && v["leak"] == true && v["owner"] == "PTA@kv_cache")
        .collect();
    let leaked: u64 = leaked_tensors
        .iter()
        .map(|v| {
            let ptr = v["ptr"].as_u64().unwrap();
            pool.iter().rev().find(|e| e.ev == "block_malloc" && e.ptr == ptr).and_then(|e| e.size).unwrap()
        })
        .sum();
    assert!(leaked >= 5 * (2 << 20), "{leaked}");
    let evals = [
        "shown=!document.getElementById('compare-section').hidden",
        "grew=Object.fromEntries([...document.querySelectorAll('#grew tr[data-owner]')].map(r => [r.dataset.owner, +r.dataset.diff]))",
        "summary=document.getElementById('compare-summary').textContent",
        "runs=document.querySelectorAll('#run-picker [data-pick]').length",
        "b=(document.querySelectorAll('#run-picker [data-pick]')[1].click(), document.querySelector('#run-picker .on').dataset.pick)",
        "leaks=[...document.querySelectorAll('table[data-table=ms_leaks] tbody tr')].map(r => r.textContent)",
    ];
    let shot = env.scratch.join("compare.png");
    let seen = visit(
        &chromium,
        &page,
        &Visit { evals: evals.iter().map(|s| s.to_string()).collect(), screenshot: Some(&shot), ..Visit::default() },
    );
    let dom = &seen["dom"];
    assert_eq!(dom["shown"], true, "{dom}");
    assert_eq!(dom["runs"], 2, "{dom}");
    assert_eq!(dom["grew"]["PTA@kv_cache"].as_u64(), Some(leaked), "kv_cache grew by the leaked blocks: {dom}");
    assert!(dom["summary"].as_str().unwrap().contains("end of step 6"), "{dom}");
    // B's leak candidates in the page: every tensor the workload leaked on purpose that then
    // lived through a whole step (msMemScope's rule; the one born in the last step did not).
    assert!(dom["b"].as_str().unwrap().starts_with("B: "), "{dom}");
    let rows: Vec<&str> = dom["leaks"].as_array().unwrap().iter().map(|r| r.as_str().unwrap()).collect();
    let candidates: Vec<&serde_json::Value> = leaked_tensors.iter().filter(|v| v["step"].as_u64() < Some(6)).collect();
    assert_eq!(candidates.len(), 4, "{candidates:?}");
    for v in candidates {
        let ptr = format!("0x{:016x}", v["ptr"].as_u64().unwrap());
        assert!(
            rows.iter().any(|r| r.contains(&ptr) && r.contains("candidate")),
            "leak {ptr} not in the page: {rows:?}"
        );
    }
    // Same seed, same steps: nothing else the workload names changed.
    for owner in ["PTA@weight", "PTA@optimizer_state", "PTA@carry", "PTA@activation"] {
        assert!(dom["grew"].get(owner).is_none(), "{owner} did not change: {dom}");
    }
}
