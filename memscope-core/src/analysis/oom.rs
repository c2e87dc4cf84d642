//! OOM forensics (msMemScope's `--analysis oom[:K]`), offline: for every failed allocation in a
//! trace, what was asked for, what the device and the caching pool held at that instant, and a
//! verdict in plain words — fragmentation (enough reserved but unused memory, no piece big
//! enough), genuinely full (and which owners hold it), the allocator's own limit, or a failure
//! the allocator recovered from. Stored as `ms_oom` and `ms_oom_blocks` (docs/db-schema.md).
//!
//! The state is rebuilt from the MALLOC/FREE rows by the fragmentation replay, not taken from the
//! tracer's online OOM_RECENT_ALLOC / OOM_TOP_ALLOC rows: those are only checked against it (are
//! the blocks they list live here?), so the analysis works on any trace, ours or msMemScope's.
//! How the rows of one failure become one incident is [`super::incidents`]'s; this module
//! reports and stores them.

use std::fmt::Write as _;
use std::path::Path;

use super::db::DumpDb;
use super::fragmentation;
use super::render::relative;
use super::AnalysisError;
use crate::printable::printable;
use crate::units::human_bytes;

pub use super::incidents::{
    Attempt, BlockInfo, Incident, Level, OwnerBytes, State, Verdict, DEFAULT_TOP_K, UNKNOWN_OWNER,
};

// ---------------------------------------------------------------- reports

pub fn text(report: &fragmentation::Report, path: &Path, device: &str) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "device {device}: {}", path.display());
    let failures: Vec<&Incident> = report.incidents.iter().filter(|i| i.verdict != Verdict::Recovered).collect();
    let recovered = report.incidents.len() - failures.len();
    if failures.is_empty() {
        let _ = writeln!(out, "  no failed allocation (no OOM_DETAIL/OOM_TRIGGER row)");
    }
    if recovered > 0 {
        let _ = writeln!(
            out,
            "  {recovered} runtime refusal(s) the allocator recovered from (it freed its cache and retried): \
             the pool runs at the device's limit"
        );
    }
    let b = |v: u64| human_bytes(v as i64);
    for inc in failures {
        let s = &inc.state;
        let when = report.start_ns.map_or_else(String::new, |t| format!("{} ", relative(inc.ts_ns - t)));
        let req = inc.req_size.map_or_else(|| "an unknown size".to_owned(), |r| format!("{} ({r} B)", b(r)));
        let _ = writeln!(out, "\n  OOM {} at {when}(ts {}, pid {}, tid {})", inc.number, inc.ts_ns, inc.pid, inc.tid);
        let _ = write!(out, "    {} could not get {req}", printable(&inc.func));
        if let Some(first) = inc.attempts.first() {
            let asked = first.req_size.map_or_else(|| "memory".to_owned(), b);
            let _ = write!(
                out,
                "; before giving up it asked the runtime for {asked} {} time(s) ({})",
                inc.attempts.len(),
                printable(&first.func)
            );
        }
        out.push('\n');
        let capacity = s.capacity.map_or_else(|| "unknown (the trace does not record it)".to_owned(), b);
        let _ = writeln!(
            out,
            "    device: capacity {capacity}; device memory of this process {}, of all traced processes {}",
            b(s.process_device),
            b(s.device_used)
        );
        if s.reserved > 0 || s.allocated > 0 {
            let piece = s.largest_free.map_or_else(|| "unknown (no segment rows)".to_owned(), b);
            let _ = writeln!(
                out,
                "    caching pool: reserved {}, allocated {}, reserved but unused {} in {} free piece(s) \
                 ({} of it inside segments in use); largest free piece {piece}",
                b(s.reserved),
                b(s.allocated),
                b(s.unused),
                s.free_pieces,
                b(s.holes)
            );
        }
        // The explanation names owners; it is stored and sent as JSON as it is.
        let _ = writeln!(out, "    verdict: {}", printable(&inc.explanation));
        let owners: Vec<String> =
            s.owners.iter().map(|o| format!("{} {} ({} blocks)", printable(&o.owner), b(o.bytes), o.blocks)).collect();
        if !owners.is_empty() {
            let _ = writeln!(out, "    owners: {}", owners.join(", "));
        }
        for (title, list) in [("largest live blocks", &s.largest), ("most recent live blocks", &s.recent)] {
            if list.is_empty() {
                continue;
            }
            let items: Vec<String> = list
                .iter()
                .map(|x| {
                    let at = report.start_ns.map_or_else(|| format!("ts {}", x.ts_ns), |t| relative(x.ts_ns - t));
                    format!("{} {} {} {at}", b(x.size), x.ptr, printable(&x.owner))
                })
                .collect();
            let _ = writeln!(out, "    {title}: {}", items.join("; "));
        }
        if inc.online_listed > 0 {
            let _ = writeln!(
                out,
                "    the tracer's online top-K rows name {} block(s), {} of them live in this replay",
                inc.online_listed, inc.online_live
            );
        }
    }
    out
}

pub const OOM_TABLE: &str = "ms_oom";
pub const OOM_BLOCKS_TABLE: &str = "ms_oom_blocks";
const CREATE_OOM: &str = "CREATE TABLE ms_oom (
    oom INTEGER NOT NULL, ts_ns INTEGER NOT NULL, pid INTEGER NOT NULL, tid INTEGER NOT NULL,
    func TEXT NOT NULL, level TEXT NOT NULL, req_size INTEGER, attempts INTEGER NOT NULL,
    attempt_size INTEGER, verdict TEXT NOT NULL, reserved INTEGER NOT NULL, allocated INTEGER NOT NULL,
    unused INTEGER NOT NULL, largest_free INTEGER, free_pieces INTEGER NOT NULL, holes INTEGER NOT NULL,
    process_device INTEGER NOT NULL, device_used INTEGER NOT NULL, capacity INTEGER,
    explanation TEXT NOT NULL, online_listed INTEGER NOT NULL, online_live INTEGER NOT NULL)";
const CREATE_OOM_BLOCKS: &str = "CREATE TABLE ms_oom_blocks (
    oom INTEGER NOT NULL, list TEXT NOT NULL, rank INTEGER NOT NULL, kind TEXT, pool TEXT, ptr TEXT,
    size INTEGER NOT NULL, ts_ns INTEGER, owner TEXT NOT NULL, blocks INTEGER NOT NULL)";

/// Replaces `ms_oom` and `ms_oom_blocks`; returns the rows written.
pub fn store(db: &DumpDb, incidents: &[Incident], run_wall_ns: u64) -> Result<usize, AnalysisError> {
    let tables = [(OOM_TABLE, CREATE_OOM), (OOM_BLOCKS_TABLE, CREATE_OOM_BLOCKS)];
    db.replace_tables(&tables, &[("oom_at", run_wall_ns.to_string())], |tx| {
        let mut main = tx.prepare(
            "INSERT INTO ms_oom VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, \
             ?18, ?19, ?20, ?21, ?22)",
        )?;
        let mut detail = tx.prepare("INSERT INTO ms_oom_blocks VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)")?;
        let mut rows = 0;
        let int = |v: u64| v as i64;
        for inc in incidents {
            let s = &inc.state;
            main.execute(rusqlite::params![
                inc.number as i64,
                inc.ts_ns,
                inc.pid,
                inc.tid,
                inc.func,
                inc.level.as_str(),
                inc.req_size.map(int),
                inc.attempts.len() as i64,
                inc.attempts.first().and_then(|a| a.req_size).map(int),
                inc.verdict.as_str(),
                int(s.reserved),
                int(s.allocated),
                int(s.unused),
                s.largest_free.map(int),
                int(s.free_pieces),
                int(s.holes),
                int(s.process_device),
                int(s.device_used),
                s.capacity.map(int),
                inc.explanation,
                int(inc.online_listed),
                int(inc.online_live)
            ])?;
            rows += 1;
            for (list, blocks) in [("recent", &s.recent), ("largest", &s.largest)] {
                for (rank, x) in blocks.iter().enumerate() {
                    detail.execute(rusqlite::params![
                        inc.number as i64,
                        list,
                        rank as i64 + 1,
                        x.kind,
                        x.pool,
                        x.ptr,
                        int(x.size),
                        x.ts_ns,
                        x.owner,
                        1i64
                    ])?;
                    rows += 1;
                }
            }
            for (rank, o) in s.owners.iter().enumerate() {
                detail.execute(rusqlite::params![
                    inc.number as i64,
                    "owner",
                    rank as i64 + 1,
                    Option::<&str>::None,
                    Option::<&str>::None,
                    Option::<&str>::None,
                    int(o.bytes),
                    Option::<i64>::None,
                    o.owner,
                    int(o.blocks)
                ])?;
                rows += 1;
            }
        }
        Ok(rows)
    })
}

/// msMemScope's `oom:K` K: 1..=1000.
pub fn parse_top_k(text: &str) -> Result<usize, String> {
    match text.trim().parse::<usize>() {
        Ok(k) if (1..=1000).contains(&k) => Ok(k),
        _ => {
            Err(format!("`oom:{text}`: K must be a whole number from 1 to 1000 (how many blocks to list), e.g. oom:10"))
        }
    }
}

#[cfg(test)]
mod tests {
    use rusqlite::Connection;
    use serde_json::json;

    use super::*;
    use crate::analysis::fragmentation::fx::Fx;
    use crate::analysis::fragmentation::Reason;

    const M: u64 = 1 << 20;
    const ALLOC: &str = "DeviceCachingAllocator::malloc";

    /// What `analyze --analysis oom:K` prints and stores for one DB.
    struct Output {
        text: String,
        json: serde_json::Value,
        note: Option<String>,
    }

    /// `analyze --analysis oom:K` on one DB through the analysis contract: stores when `write`,
    /// and renders both reports (each from its own run, as `analyze` builds only one).
    fn for_analyze(path: &Path, device: &str, k: usize, write: bool, at: u64) -> Result<Output, AnalysisError> {
        use crate::analysis::contract::{run, Oom};
        let db = DumpDb::open(path, write)?;
        let text = run::<Oom>(&db, device, &k, false, None)?.text.unwrap_or_default();
        let out = run::<Oom>(&db, device, &k, true, write.then_some(at))?;
        Ok(Output { text, json: out.json.into_iter().next().unwrap_or_default(), note: out.stored })
    }

    fn incidents(path: &Path, k: usize) -> Vec<Incident> {
        fragmentation::analyse(
            &DumpDb::open_read(path).unwrap(),
            fragmentation::Options { top_k: k, sample_every: None },
        )
        .unwrap()
        .incidents
    }

    /// Two 20 MiB segments with 6 MiB holes (16 MiB reserved but unused, pieces of 8, 6 and 2).
    fn fragmented(fx: &mut Fx) {
        for base in [0x1000_0000u64, 0x2000_0000] {
            fx.segment(1, base, 20 * M, false);
            for i in 0..3 {
                fx.block(1, base + i * 6 * M, 6 * M, if i == 1 { "PTA@weight" } else { "PTA@act" });
            }
        }
        fx.free(1, 0x1000_0000 + 12 * M, 6 * M);
        fx.free(1, 0x2000_0000, 6 * M);
    }

    #[test]
    fn the_allocators_give_up_absorbs_its_runtime_refusals_and_explains_fragmentation() {
        let mut fx = Fx::new("oom-frag");
        fragmented(&mut fx);
        fx.hal(1, 0x9000_0000, 3 * M, "CANN@HCCL");
        // One failure: the runtime refuses the 12 MiB segment twice, then the allocator gives up.
        fx.oom(1, "aclrtMallocAlign32", 12 * M);
        fx.oom(1, "aclrtMallocAlign32", 12 * M);
        fx.oom(1, ALLOC, 11 * M);
        let path = fx.stop();
        let all = incidents(&path, 2);
        assert_eq!(all.len(), 1, "{all:#?}");
        let inc = &all[0];
        assert_eq!((inc.number, inc.level, inc.verdict), (1, Level::Allocator, Verdict::Fragmentation));
        assert_eq!(inc.req_size, Some(11 * M));
        assert_eq!(inc.attempts.len(), 2);
        assert_eq!(inc.attempts[0].func, "aclrtMallocAlign32");
        let s = &inc.state;
        assert_eq!((s.reserved, s.allocated, s.unused), (40 * M, 24 * M, 16 * M));
        assert_eq!((s.largest_free, s.free_pieces, s.holes), (Some(8 * M), 3, 16 * M));
        assert_eq!((s.process_device, s.device_used, s.capacity), (43 * M, 43 * M, None));
        // Owners and top-K over pool blocks and device memory outside the pools.
        let owners: Vec<(&str, u64, u64)> = s.owners.iter().map(|o| (o.owner.as_str(), o.bytes, o.blocks)).collect();
        assert_eq!(owners, [("PTA@act", 12 * M, 2), ("PTA@weight", 12 * M, 2)], "K = 2, ties by name");
        assert_eq!(s.recent[0].owner, "CANN@HCCL");
        assert_eq!((s.recent[0].kind, s.recent[0].size), ("HAL", 3 * M));
        assert_eq!(s.recent[1].ptr, format!("0x{:016x}", 0x2000_0000u64 + 12 * M));
        assert_eq!(s.largest.iter().map(|b| b.size).collect::<Vec<_>>(), [6 * M, 6 * M]);
        assert!(
            inc.explanation.starts_with(
                "fragmentation: 16.0 MiB reserved but unused, the largest free piece is 8.0 MiB < 11.0 MiB requested"
            ),
            "{}",
            inc.explanation
        );
        assert!(inc.explanation.contains("expandable_segments:True"));
    }

    #[test]
    fn genuinely_full_names_the_owners_and_a_silent_refusal_is_the_allocators_limit() {
        let mut fx = Fx::new("oom-full");
        fx.segment(1, 0x1000_0000, 20 * M, false);
        fx.block(1, 0x1000_0000, 16 * M, "PTA@weight");
        fx.block(1, 0x1000_0000 + 16 * M, 4 * M, "PTA@act");
        fx.oom(1, "aclrtMallocAlign32", 20 * M);
        fx.oom(1, ALLOC, 8 * M);
        fx.step(1);
        // Later the allocator refuses without asking the runtime: its own limit.
        fx.oom(1, ALLOC, 8 * M);
        let all = incidents(&fx.stop(), 10);
        assert_eq!(all.iter().map(|i| i.verdict).collect::<Vec<_>>(), [Verdict::Full, Verdict::Limit]);
        assert!(all[0].explanation.contains("genuinely full: only 0 B reserved but unused for 8.0 MiB"));
        assert!(all[0].explanation.contains("PTA@weight (16.0 MiB), PTA@act (4.0 MiB)"), "{}", all[0].explanation);
        assert!(all[1].explanation.contains("set_per_process_memory_fraction"), "{}", all[1].explanation);
        assert_eq!(all[1].attempts, []);
    }

    #[test]
    fn owners_reach_the_text_escaped_and_the_json_and_table_exact() {
        let evil = "PTA@x\u{1b}[2J\nmemscope-bpf: forged";
        let mut fx = Fx::new("oom-escaped");
        fx.segment(1, 0x1000_0000, 20 * M, false);
        fx.block(1, 0x1000_0000, 20 * M, evil);
        fx.oom(1, "aclrtMallocAlign32", 20 * M);
        fx.oom(1, ALLOC, 8 * M);
        let path = fx.stop();
        let out = for_analyze(&path, "0", 5, true, 1).unwrap();
        assert!(!out.text.contains('\u{1b}') && !out.text.contains("\nmemscope-bpf: forged"), "{}", out.text);
        let shown = "PTA@x\\u{1b}[2J\\nmemscope-bpf: forged";
        for line in ["    verdict: ", "    owners: ", "    largest live blocks: "] {
            let line = out.text.lines().find(|l| l.starts_with(line)).unwrap();
            assert!(line.contains(shown), "{line}");
        }
        assert!(out.json.to_string().contains(&serde_json::to_string(evil).unwrap()));
        let conn = Connection::open(&path).unwrap();
        let stored: String = conn.query_row("SELECT owner FROM ms_oom_blocks LIMIT 1", [], |r| r.get(0)).unwrap();
        assert_eq!(stored, evil);
    }

    #[test]
    fn a_refusal_the_allocator_recovers_from_is_not_a_failure() {
        let mut fx = Fx::new("oom-recovered");
        fx.segment(1, 0x1000_0000, 20 * M, false);
        fx.block(1, 0x1000_0000, 20 * M, "PTA");
        fx.free(1, 0x1000_0000, 20 * M);
        fx.oom(1, "aclrtMallocAlign32", 40 * M);
        fx.hal_free(1, 0x1000_0000, 20 * M); // the allocator empties its cache...
        fx.segment(1, 0x2000_0000, 40 * M, false); // ...and the retry succeeds
        fx.block(1, 0x2000_0000, 40 * M, "PTA");
        let report =
            fragmentation::analyse(&DumpDb::open_read(&fx.stop()).unwrap(), fragmentation::Options::default()).unwrap();
        assert_eq!(report.incidents.len(), 1);
        assert_eq!(report.incidents[0].verdict, Verdict::Recovered);
        assert!(report.samples.iter().all(|s| s.reason != Reason::Oom), "a recovery is no OOM sample");
        assert_eq!(report.flushes.len(), 1);
        let text = text(&report, Path::new("x.db"), "0");
        assert!(text.contains("no failed allocation") && text.contains("1 runtime refusal(s) the allocator recovered"));
    }

    /// PyTorch's CUDA allocator writes no give-up row: its refusals inside `alloc_block` that it
    /// does not recover from (the thread's next pool row is a free, not the block) are its
    /// give-up, one incident with the earlier refusal as an attempt.
    #[test]
    fn segment_refusals_the_pool_did_not_recover_from_are_its_give_up() {
        let mut fx = Fx::new("oom-cuda");
        fx.segment(1, 0x1000_0000, 20 * M, false);
        fx.block(1, 0x1000_0000, 12 * M, "PTA@weight");
        fx.pool_refusal(1, "cudaMalloc", 2048 * M);
        fx.pool_refusal(1, "cudaMalloc", 2048 * M); // the retry after emptying the cache
        fx.free(1, 0x1000_0000, 12 * M); // the program goes on without the block
                                         // A refusal outside the pool still stands alone, with the driver's name.
        fx.oom(1, "cuMemAlloc_v2", 64 * M);
        let all = incidents(&fx.stop(), 10);
        let got: Vec<(Level, Verdict, usize)> = all.iter().map(|i| (i.level, i.verdict, i.attempts.len())).collect();
        assert_eq!(got, [(Level::Allocator, Verdict::Full, 1), (Level::Driver, Verdict::DeviceFull, 0)]);
        assert!(all[0].explanation.starts_with("genuinely full"), "{}", all[0].explanation);
    }

    #[test]
    fn refusals_outside_the_allocator_stand_alone() {
        let mut fx = Fx::new("oom-runtime");
        fx.hal(1, 0x9000_0000, 30 * M, "CANN@HCCL");
        fx.oom(1, "aclrtMalloc", 64 * M);
        fx.hal(1, 0x9100_0000, 2 * M, "CANN@APP"); // the program goes on: the refusal was its own
        fx.oom(1, "halMemAlloc", 64 * M); // the last row of the trace
        let all = incidents(&fx.stop(), 10);
        let got: Vec<(Level, Verdict, u64)> = all.iter().map(|i| (i.level, i.verdict, i.state.device_used)).collect();
        assert_eq!(got, [(Level::Runtime, Verdict::DeviceFull, 30 * M), (Level::Driver, Verdict::DeviceFull, 32 * M)]);
        assert!(all[0].explanation.starts_with("the runtime refused 64.0 MiB outside the caching allocator"));
    }

    #[test]
    fn a_big_enough_cached_piece_the_allocator_did_not_use_is_named() {
        let mut fx = Fx::new("oom-unusable");
        fx.segment(1, 0x1000_0000, 20 * M, false);
        fx.block(1, 0x1000_0000, 2 * M, "PTA");
        fx.oom(1, ALLOC, 4 * M);
        let all = incidents(&fx.stop(), 10);
        assert_eq!(all[0].verdict, Verdict::CachedUnusable);
    }

    #[test]
    fn online_top_k_rows_are_checked_against_the_replay() {
        let mut fx = Fx::new("oom-online");
        fragmented(&mut fx);
        fx.oom(1, ALLOC, 11 * M);
        for ptr in [0x1000_0000u64, 0x1000_0000 + 12 * M] {
            let attr = json!({"pool": "caching", "ptr": format!("0x{ptr:016x}"), "size": "6291456"});
            fx.row("OOM_DETAIL", "OOM_TOP_ALLOC", "x", 1, 1, None, attr);
        }
        let all = incidents(&fx.stop(), 10);
        assert_eq!((all[0].online_listed, all[0].online_live), (2, 1), "the second was freed before the failure");
    }

    fn table(path: &Path, sql: &str) -> Vec<Vec<String>> {
        let conn = Connection::open(path).unwrap();
        let mut stmt = conn.prepare(sql).unwrap();
        let n = stmt.column_count();
        stmt.query_map([], |r| {
            Ok((0..n)
                .map(|i| match r.get_ref(i).unwrap() {
                    rusqlite::types::ValueRef::Null => "NULL".to_owned(),
                    rusqlite::types::ValueRef::Integer(v) => v.to_string(),
                    v => v.as_str().unwrap_or("").to_owned(),
                })
                .collect())
        })
        .unwrap()
        .map(Result::unwrap)
        .collect()
    }

    #[test]
    fn tables_are_replaced_on_every_run_and_no_write_changes_nothing() {
        let mut fx = Fx::new("oom-store");
        fragmented(&mut fx);
        fx.oom(1, "aclrtMallocAlign32", 12 * M);
        fx.oom(1, ALLOC, 11 * M);
        let path = fx.stop();
        let before = std::fs::read(&path).unwrap();
        let out = for_analyze(&path, "0", 2, false, 1).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), before, "--no-write");
        assert!(out.note.is_none());
        assert_eq!(out.json["incidents"][0]["verdict"], "fragmentation");
        assert_eq!(out.json["incidents"][0]["state"]["largest_free"], 8 * M);
        assert!(out.text.contains("OOM 1 at +"), "{}", out.text);
        for run in 0..2 {
            let out = for_analyze(&path, "0", 2, true, 7 + run).unwrap();
            assert!(out.note.unwrap().contains("ms_oom"));
        }
        let main = table(&path, "SELECT oom, func, level, req_size, attempts, attempt_size, verdict, reserved, allocated, largest_free, capacity FROM ms_oom");
        let want = [
            "1",
            ALLOC,
            "allocator",
            "11534336",
            "1",
            "12582912",
            "fragmentation",
            "41943040",
            "25165824",
            "8388608",
            "NULL",
        ];
        assert_eq!(main, [want.map(str::to_owned).to_vec()], "one run's rows only");
        let lists = table(&path, "SELECT list, count(*) FROM ms_oom_blocks GROUP BY list ORDER BY list");
        assert_eq!(lists, [["largest", "2"], ["owner", "2"], ["recent", "2"]].map(|r| r.map(str::to_owned).to_vec()));
        assert_eq!(table(&path, "SELECT value FROM ms_meta WHERE key = 'oom_at'"), [["8".to_owned()]]);
    }

    #[test]
    fn top_k_is_msmemscopes() {
        assert_eq!(parse_top_k("10"), Ok(10));
        assert_eq!(parse_top_k("1000"), Ok(1000));
        for bad in ["0", "1001", "x", "", "-1"] {
            assert!(parse_top_k(bad).unwrap_err().contains("from 1 to 1000"), "{bad}");
        }
    }
}
