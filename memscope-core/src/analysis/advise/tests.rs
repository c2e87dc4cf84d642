use std::path::Path;

use super::*;
use crate::analysis::fragmentation::fx::Fx;

const M: u64 = MIB;

/// The DB at `path`, opened as `advise` opens it to write its results.
fn open(path: &Path) -> DumpDb {
    DumpDb::open(path, true).unwrap()
}

fn advice(path: &Path) -> (Measured, Vec<Recommendation>) {
    let (a, _) = analyse(&open(path), "0", &Default::default()).unwrap();
    (a.measured, a.recommendations)
}

fn ids(recs: &[Recommendation]) -> Vec<&'static str> {
    recs.iter().map(|r| r.id).collect()
}

/// Three 20 MiB segments of 6 MiB blocks with 6 and 8 MiB holes (36 MiB), then two 11 MiB
/// requests that fit none: two fragmentation-forced segments.
fn holes_rows(fx: &mut Fx) {
    let bases = [0x1000_0000u64, 0x2000_0000, 0x3000_0000];
    for base in bases {
        fx.segment(1, base, 20 * M, false);
        for i in 0..3 {
            fx.block(1, base + i * 6 * M, 6 * M, "PTA");
        }
    }
    for (i, base) in bases.iter().enumerate() {
        fx.free(1, base + 12 * M, 6 * M);
        if i > 0 {
            fx.free(1, *base, 6 * M);
        }
    }
    for base in [0x4000_0000u64, 0x5000_0000] {
        fx.segment(1, base, 12 * M, false);
        fx.block(1, base, 12 * M, "PTA");
    }
}

fn holes(name: &str, conf: Option<&str>) -> std::path::PathBuf {
    let mut fx = Fx::new(name);
    if let Some(conf) = conf {
        fx.meta("env.PYTORCH_NPU_ALLOC_CONF", conf);
    }
    fx.meta("env.HCCL_BUFFSIZE", "200");
    holes_rows(&mut fx);
    fx.stop()
}

#[test]
fn holes_that_force_growth_recommend_expandable_segments() {
    let (m, recs) = advice(&holes("advise-holes", None));
    assert_eq!((m.forced_growths, m.forced_growth_bytes, m.peak_reserved), (2, 24 * M, 84 * M));
    assert_eq!(m.holes_at_peak, 36 * M);
    assert_eq!(ids(&recs), ["expandable_segments"]);
    let r = &recs[0];
    assert_eq!(
        (r.variable, r.setting.as_str(), r.value.as_deref(), r.current.as_deref()),
        (Some(ALLOC_CONF), "expandable_segments:True", Some("expandable_segments:True"), None)
    );
    assert!(r.why.contains("took 2 new segment(s) (24.0 MiB)"), "{}", r.why);
    assert!(r.why.contains("36.0 MiB (43%) were such holes"), "{}", r.why);
    assert_eq!(r.evidence["forced_growths"], 2);
}

/// A CUDA trace (`ms_meta.backend`) is advised on PyTorch's variable, with the setting it ran
/// with read from that variable (torch_npu's is not PyTorch's).
#[test]
fn a_cuda_trace_is_advised_on_pytorch_cuda_alloc_conf() {
    let mut fx = Fx::new("advise-cuda");
    fx.meta("backend", "cuda");
    fx.meta("env.PYTORCH_NPU_ALLOC_CONF", "expandable_segments:True");
    fx.meta("env.PYTORCH_CUDA_ALLOC_CONF", "roundup_power2_divisions:4");
    holes_rows(&mut fx);
    let (a, _) = analyse(&open(&fx.stop()), "0", &Default::default()).unwrap();
    assert_eq!(a.alloc_conf, "PYTORCH_CUDA_ALLOC_CONF");
    assert_eq!(ids(&a.recommendations), ["expandable_segments"]);
    let r = &a.recommendations[0];
    assert_eq!(
        (r.variable, r.value.as_deref(), r.current.as_deref()),
        (
            Some("PYTORCH_CUDA_ALLOC_CONF"),
            Some("roundup_power2_divisions:4,expandable_segments:True"),
            Some("roundup_power2_divisions:4")
        )
    );
}

#[test]
fn the_current_setting_is_respected() {
    // Already on: nothing to say.
    let (_, recs) = advice(&holes("advise-on", Some("expandable_segments:True")));
    assert!(recs.is_empty(), "{recs:?}");
    // Other keys are kept; the ones torch_npu refuses with expandable segments are dropped.
    let (_, recs) = advice(&holes("advise-merge", Some("max_split_size_mb:128,roundup_power2_divisions:4")));
    assert_eq!(ids(&recs), ["expandable_segments"]);
    assert_eq!(recs[0].value.as_deref(), Some("roundup_power2_divisions:4,expandable_segments:True"));
    assert_eq!(recs[0].current.as_deref(), Some("max_split_size_mb:128,roundup_power2_divisions:4"));
    assert!(recs[0].why.contains("max_split_size_mb removed"), "{}", recs[0].why);
}

fn bigsplit(name: &str, conf: Option<&str>) -> std::path::PathBuf {
    let mut fx = Fx::new(name);
    if let Some(conf) = conf {
        fx.meta("env.PYTORCH_NPU_ALLOC_CONF", conf);
    }
    fx.segment(1, 0x1000_0000, 96 * M, false);
    fx.block(1, 0x1000_0000, 96 * M, "PTA");
    fx.free(1, 0x1000_0000, 96 * M);
    for i in 0..8 {
        fx.block(1, 0x1000_0000 + i * 4 * M, 4 * M, "PTA");
    }
    fx.segment(1, 0x2000_0000, 96 * M, false);
    fx.block(1, 0x2000_0000, 96 * M, "PTA");
    fx.stop()
}

#[test]
fn big_segments_held_by_small_blocks_recommend_max_split_size() {
    let (m, recs) = advice(&bigsplit("advise-bigsplit", None));
    assert_eq!(m.pinned_big_growths, 1);
    assert_eq!(ids(&recs), ["max_split_size_mb"]);
    assert_eq!(recs[0].value.as_deref(), Some("max_split_size_mb:64"));
    assert!(recs[0].why.contains("the smallest 96.0 MiB"), "{}", recs[0].why);
    // Not with expandable segments (refused together), nor when already set.
    assert!(advice(&bigsplit("advise-bigsplit-exp", Some("expandable_segments:True"))).1.is_empty());
    assert!(advice(&bigsplit("advise-bigsplit-set", Some("max_split_size_mb:200"))).1.is_empty());
}

/// Per step, two blocks bigger than the last step's; from step 2 on, each step's first
/// allocation frees the cached (too small) segments at the ceiling and takes a new one.
fn pressure(name: &str, steps: u64, empty_cache_fits: bool) -> std::path::PathBuf {
    let mut fx = Fx::new(name);
    let mut live: Vec<(u64, u64)> = Vec::new();
    for s in 0..steps {
        let size = if empty_cache_fits { 40 * M } else { (40 + 8 * s) * M };
        for (ptr, sz) in live.drain(..) {
            fx.hal_free(1, ptr, sz);
        }
        for i in 0..2 {
            let ptr = 0x1000_0000 * (s + 1) + i * 0x100_0000;
            fx.segment(1, ptr, size, false);
            fx.block(1, ptr, size, "PTA");
            live.push((ptr, size));
        }
        fx.step(s as i64 + 1);
        for &(ptr, sz) in &live {
            fx.free(1, ptr, sz);
        }
    }
    fx.stop()
}

#[test]
fn repeated_flushes_at_the_ceiling_recommend_garbage_collection() {
    let (m, recs) = advice(&pressure("advise-gc", 4, false));
    assert_eq!(m.flushes_at_ceiling, 3, "{m:?}");
    assert_eq!(ids(&recs), ["garbage_collection_threshold"]);
    // At most 2 x 64 MiB allocated against a ceiling of 2 x 56 MiB reserved.
    assert_eq!(recs[0].setting, "garbage_collection_threshold:0.9");
    assert!(recs[0].why.contains("3 time(s)"), "{}", recs[0].why);
    // Once is not a pattern; and emptying a cache that could have served the next request is
    // the program's own empty_cache(), not a ceiling.
    assert!(advice(&pressure("advise-gc-once", 2, false)).1.is_empty());
    let (m, recs) = advice(&pressure("advise-gc-fits", 4, true));
    assert_eq!((m.flushes_at_ceiling, recs.len()), (0, 0));
}

#[test]
fn processes_sharing_a_device_get_fractions() {
    let mut fx = Fx::new("advise-shared");
    for (pid, base, size) in [(10, 0x1000_0000u64, 60 * M), (11, 0x2000_0000, 20 * M)] {
        fx.segment(pid, base, size, false);
        fx.block(pid, base, size, "PTA");
    }
    let path = fx.stop();
    let (_, recs) = advice(&path);
    assert_eq!(ids(&recs), ["per_process_memory_fraction"]);
    // Host memory has no device allocator to configure (msLeaks wrote it as HAL rows of `host`).
    for host in ["host", "cpu"] {
        assert!(analyse(&open(&path), host, &Default::default()).unwrap().0.recommendations.is_empty(), "{host}");
    }
    let r = &recs[0];
    assert_eq!(r.variable, None);
    assert_eq!(
        r.setting,
        "torch_npu.npu.set_per_process_memory_fraction(0.71) in pid 10, set_per_process_memory_fraction(0.23) in pid 11"
    );
}

#[test]
fn a_clean_pool_and_an_empty_trace_get_no_advice() {
    let mut fx = Fx::new("advise-clean");
    for step in 0..3 {
        for i in 0..5u64 {
            if step == 0 && i == 0 {
                fx.segment(1, 0x1000_0000, 20 * M, false);
            }
            fx.block(1, 0x1000_0000 + i * 4 * M, 4 * M, "PTA");
        }
        fx.step(step + 1);
        for i in 0..5u64 {
            fx.free(1, 0x1000_0000 + i * 4 * M, 4 * M);
        }
    }
    let path = fx.stop();
    let (advice, report) = analyse(&open(&path), "0", &Default::default()).unwrap();
    assert!(advice.recommendations.is_empty());
    assert!(text(&advice, &report).contains("advice: nothing to change"));
    let (advice, report) = analyse(&open(&Fx::new("advise-empty").stop()), "0", &Default::default()).unwrap();
    assert!(advice.recommendations.is_empty());
    assert!(text(&advice, &report).contains("no caching-pool memory"));
}

#[test]
fn an_oom_from_fragmentation_recommends_expandable_segments() {
    let mut fx = Fx::new("advise-oom");
    fx.segment(1, 0x1000_0000, 20 * M, false);
    for i in 0..4 {
        fx.block(1, 0x1000_0000 + i * 5 * M, 5 * M, "PTA");
    }
    fx.free(1, 0x1000_0000, 5 * M);
    fx.free(1, 0x1000_0000 + 10 * M, 5 * M);
    fx.oom(1, "aclrtMallocAlign32", 20 * M);
    fx.oom(1, "DeviceCachingAllocator::malloc", 8 * M);
    let (m, recs) = advice(&fx.stop());
    assert_eq!((m.ooms, m.fragmentation_ooms), (1, 1));
    assert_eq!(ids(&recs), ["expandable_segments"]);
    assert!(recs[0].why.contains("1 allocation(s) failed with enough reserved but unused memory"));
}

#[test]
fn conflicting_recommendations_say_so() {
    // Holes and a pinned big segment in one trace: both fire, and torch_npu takes only one.
    let mut fx = Fx::new("advise-both");
    holes_rows(&mut fx);
    fx.segment(1, 0x6000_0000, 64 * M, false);
    fx.block(1, 0x6000_0000, 4 * M, "PTA");
    fx.segment(1, 0x7000_0000, 64 * M, false);
    fx.block(1, 0x7000_0000, 64 * M, "PTA");
    let (_, recs) = advice(&fx.stop());
    assert_eq!(ids(&recs), ["expandable_segments", "max_split_size_mb"]);
    assert_eq!(recs[0].conflicts_with, ["max_split_size_mb"]);
    assert_eq!(recs[1].conflicts_with, ["expandable_segments"]);
}

/// A job whose ATB graph asks for `intermediate` bytes of intermediates next to 32 MiB of
/// weights and a 20 MiB activation segment, with ATB_WORKSPACE_MEM_ALLOC_ALG_TYPE and
/// ATB_WORKSPACE_MEM_ALLOC_GLOBAL as given.
fn atb_job(name: &str, intermediate: u64, alg: Option<&str>, global: Option<&str>) -> std::path::PathBuf {
    let mut fx = Fx::new(name);
    if let Some(v) = alg {
        fx.meta("env.ATB_WORKSPACE_MEM_ALLOC_ALG_TYPE", v);
    }
    if let Some(v) = global {
        fx.meta("env.ATB_WORKSPACE_MEM_ALLOC_GLOBAL", v);
    }
    fx.hal(1, 0x1000_0000, 32 * M, "CANN@APP");
    let block = (intermediate + M + 32).div_ceil(2 * M) * 2 * M;
    fx.hal(1, 0x2000_0000, block, "CANN@APP");
    for _ in 0..3 {
        fx.segment(1, 0x3000_0000, 20 * M, false);
        fx.block(1, 0x3000_0000, 4 * M, "PTA");
        fx.atb(1, 0x55, M, intermediate);
        fx.atb(1, 0x66, M / 2, intermediate / 4);
        fx.free(1, 0x3000_0000, 4 * M);
        fx.hal_free(1, 0x3000_0000, 20 * M);
    }
    fx.stop()
}

#[test]
fn large_atb_intermediates_under_the_default_algorithm_recommend_alg_type_3() {
    let path = atb_job("advise-atb", 44 * M, None, None);
    let (advised, report) = analyse(&open(&path), "0", &Default::default()).unwrap();
    let recs = &advised.recommendations;
    assert_eq!(ids(recs), [ATB_ALG_RULE]);
    let r = &recs[0];
    assert_eq!(
        (r.variable, r.setting.as_str(), r.value.as_deref(), r.current.as_deref()),
        (Some(ATB_ALG_TYPE), "ATB_WORKSPACE_MEM_ALLOC_ALG_TYPE=3", Some("3"), None)
    );
    // Peak: 32 MiB weights + a 46 MiB workspace block + the 20 MiB segment.
    assert_eq!(
        (r.evidence["peak_bytes"].as_u64(), r.evidence["largest_intermediate"].as_u64()),
        (Some(98 * M), Some(44 * M))
    );
    assert_eq!((r.evidence["executions"].as_u64(), r.evidence["operations"].as_u64()), (Some(6), Some(2)));
    assert_eq!(r.evidence["ops"][0]["op"], "Runner@0x55");
    assert!(r.why.contains("44.0 MiB of intermediate tensors"), "{}", r.why);
    assert!(r.why.contains("45% of the peak of 98.0 MiB device memory (HAL blocks)"), "{}", r.why);
    assert!(r.why.contains("was unset (ATB's default, 1)"), "{}", r.why);
    assert!(r.why.contains("ATB_WORKSPACE_MEM_ALLOC_GLOBAL is unset: set it to 1"), "{}", r.why);
    let shown = text(&advised, &report);
    assert!(shown.contains("ATB_WORKSPACE_MEM_ALLOC_ALG_TYPE=3"), "{shown}");
    assert!(shown.contains("ATB: 6 execution(s) of 2 operation(s)"), "{shown}");

    // The default written out is replaced too; GLOBAL already on is not mentioned.
    let (_, recs) = advice(&atb_job("advise-atb-1", 44 * M, Some("1"), Some("1")));
    assert_eq!(ids(&recs), [ATB_ALG_RULE]);
    assert_eq!(recs[0].current.as_deref(), Some("1"));
    assert!(recs[0].why.contains("was 1 (ATB's default)"), "{}", recs[0].why);
    assert!(!recs[0].why.contains("GLOBAL"), "{}", recs[0].why);
}

#[test]
fn atb_alg_type_is_never_recommended_when_chosen_or_when_intermediates_are_small() {
    for set in ["3", "2", "0"] {
        let (m, recs) = advice(&atb_job(&format!("advise-atb-set{set}"), 44 * M, Some(set), None));
        assert!(m.atb.significant(), "the evidence is there");
        assert!(recs.is_empty(), "{set} is a choice: {recs:?}");
    }
    // 2.75 MiB of intermediates next to 56 MiB: under the 10% share.
    let (m, recs) = advice(&atb_job("advise-atb-small", 2816 << 10, None, None));
    assert_eq!(m.atb.executions, 6);
    assert!(!m.atb.significant() && recs.is_empty(), "{recs:?}");
    // No ATB at all: nothing measured, nothing said.
    let (advised, report) = analyse(&open(&holes("advise-no-atb", None)), "0", &Default::default()).unwrap();
    assert_eq!(advised.measured.atb.executions, 0);
    assert!(!text(&advised, &report).contains("ATB:"));
}

#[test]
fn alloc_conf_round_trips() {
    let c = AllocConf::parse("expandable_segments:True, max_split_size_mb:64,bogus");
    assert_eq!(c.get("max_split_size_mb"), Some("64"));
    assert!(c.expandable());
    assert_eq!(c.with("max_split_size_mb", "32", &["expandable_segments"]).to_string(), "max_split_size_mb:32");
    assert_eq!(AllocConf::parse("").to_string(), "");
    assert_eq!(split_limit_mib(96), 64);
    assert_eq!(split_limit_mib(24), 21);
    assert_eq!(split_limit_mib(4096), 4096);
}

#[test]
fn settings_come_from_ms_meta_and_the_advice_is_stored() {
    let path = holes("advise-store", Some("garbage_collection_threshold:0.7"));
    let (advice, report) = analyse(&open(&path), "0", &Default::default()).unwrap();
    assert_eq!(advice.settings.get("HCCL_BUFFSIZE").map(String::as_str), Some("200"));
    for run in 0..2 {
        store(&open(&path), &advice, &report, 5 + run).unwrap();
    }
    let conn = rusqlite::Connection::open(&path).unwrap();
    let count = |sql: &str| -> i64 { conn.query_row(sql, [], |r| r.get(0)).unwrap() };
    assert_eq!(count("SELECT count(*) FROM ms_advice"), 1);
    assert_eq!(count("SELECT count(*) FROM ms_fragmentation"), report.samples.len() as i64);
    assert_eq!(
        count("SELECT count(*) FROM ms_fragmentation WHERE reason = 'peak_reserved' AND reserved = 88080384"),
        1
    );
    let value: String = conn.query_row("SELECT value FROM ms_advice", [], |r| r.get(0)).unwrap();
    assert_eq!(value, "expandable_segments:True");
    assert_eq!(count("SELECT count(*) FROM ms_meta WHERE key = 'advise_at' AND value = '6'"), 1);
    // No ms_meta (msMemScope's DBs): settings unknown, nothing stamped.
    conn.execute_batch("DROP TABLE ms_meta").unwrap();
    assert!(read_settings(&open(&path)).unwrap().is_empty());
    store(&open(&path), &advice, &report, 9).unwrap();
}

/// The target's own setting reaches a terminal escaped; the advice's data keeps it exact.
#[test]
fn the_targets_settings_are_escaped_in_the_text_only() {
    let conf = "roundup_power2_divisions:4\u{1b}[2J\nforged";
    let (advice, report) = analyse(&open(&holes("advise-escape", Some(conf))), "0", &Default::default()).unwrap();
    let shown = text(&advice, &report);
    assert!(!shown.contains('\u{1b}') && !shown.contains("\nforged"), "{shown}");
    let escaped = "roundup_power2_divisions:4\\u{1b}[2J\\nforged";
    assert!(shown.contains(&format!("PYTORCH_NPU_ALLOC_CONF `{escaped}`")), "{shown}");
    assert!(shown.contains(&format!("1. PYTORCH_NPU_ALLOC_CONF={escaped},expandable_segments:True")), "{shown}");
    let value = advice.recommendations[0].value.as_deref();
    assert_eq!(value, Some(format!("{conf},expandable_segments:True").as_str()));
}

/// Every recommended allocator setting is replayed and ranked, after the replay under the job's
/// own settings is checked against the segments the trace recorded.
#[test]
fn recommendations_carry_their_replayed_figures() {
    let (advice, report) = analyse(&open(&holes("advise-predict", None)), "0", &Default::default()).unwrap();
    let sim = advice.simulation.as_ref().expect("the trace has pool requests");
    // The fixture's blocks carry only their sizes, which the allocator rounded: replayed as such.
    assert!(sim.reproduction.agrees && sim.reproduction.recorded_segments == 5, "{:?}", sim.reproduction);
    let rec = advice.recommendations.iter().find(|r| r.id == "expandable_segments").unwrap();
    let predicted = rec.predicted.as_ref().expect("an allocator setting is replayed");
    assert_eq!(rec.predicted_rank, Some(1));
    assert!(predicted.peak_reserved_bytes < sim.recorded.peak_reserved_bytes, "{predicted:?} vs {:?}", sim.recorded);
    let shown = text(&advice, &report);
    assert!(shown.contains("would give (replayed): peak reserved"), "{shown}");
    assert!(shown.contains("replay matches the recorded run: 5/5 segments"), "{shown}");
}

/// The replay's curves are stored for the report: the run as recorded, as replayed, and each
/// recommendation's predicted one.
#[test]
fn the_replay_s_curves_are_stored_by_series() {
    let path = holes("advise-curves", None);
    let (advice, report) = analyse(&open(&path), "0", &Default::default()).unwrap();
    store(&open(&path), &advice, &report, 1).unwrap();
    let conn = rusqlite::Connection::open(&path).unwrap();
    let series: Vec<(String, i64)> = conn
        .prepare("SELECT series, max(reserved) FROM ms_simulation GROUP BY series ORDER BY series")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let sim = advice.simulation.as_ref().unwrap();
    let predicted = advice.recommendations[0].predicted.as_ref().unwrap();
    assert_eq!(
        series,
        [
            ("advised: expandable_segments:True".to_owned(), predicted.peak_reserved_bytes as i64),
            ("recorded".to_owned(), sim.recorded.peak_reserved_bytes as i64),
            ("replayed as run".to_owned(), sim.baseline.as_ref().unwrap().figures.peak_reserved_bytes as i64),
        ]
    );
}
