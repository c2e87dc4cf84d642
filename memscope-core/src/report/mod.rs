//! `report`: one trace (or two, compared) as the data a self-contained HTML page draws. Every
//! figure is aggregated here, in Rust, so the page stays quick on a 10 M-row trace: the curves
//! keep each interval's highest and lowest instant ([`curves`]), the blocks table the largest
//! blocks ([`blocks`]), the result tables a row limit ([`findings`]), and [`DeviceReport::
//! summarised`] says in words what was cut, for the page to show. [`html`] writes the page.
//!
//! Times travel as ns after the run's origin (its earliest row, `origin_ns`, kept as text):
//! JavaScript's numbers hold ns since the epoch only to a quarter of a microsecond.

pub mod blocks;
pub mod compare;
pub mod curves;
pub mod findings;
pub mod flame;
pub mod html;

use serde::Serialize;

use crate::analysis::db::DumpDb;
use crate::analysis::decompose::{self, By, ByReplay, Family};
use crate::analysis::instants::{self, Instant};
use crate::analysis::pass::{self, Consumer};
use crate::analysis::py_stacks;
use crate::analysis::ranks;
use crate::analysis::steps::{self, StepDb, StepPoint, Timeline};
use crate::analysis::AnalysisError;
use crate::cluster::identity::Identity;

/// How much of a trace the page gets.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// Intervals the curves are cut into (each keeps two instants).
    pub buckets: usize,
    /// Blocks listed in the table.
    pub top_blocks: usize,
    /// Rows kept per result table.
    pub finding_rows: usize,
    /// Steps, marks and OOMs drawn, each; step ends kept (evenly sampled beyond).
    pub max_instants: usize,
}

impl Default for Options {
    fn default() -> Self {
        Self { buckets: 1000, top_blocks: 1000, finding_rows: 2000, max_instants: 2000 }
    }
}

/// A pool's reserved (or allocated) bytes over time, summed over the processes of the device.
#[derive(Clone, Debug, Serialize)]
pub struct Reserved {
    pub name: String,
    pub points: Vec<(i64, i64)>,
    pub changes: usize,
}

/// The live memory at a step's end, owners by the report's owner index.
#[derive(Clone, Debug, Serialize)]
pub struct StepEnd {
    pub step: u64,
    pub t: i64,
    /// Live bytes per family: HAL, PTA, HOST.
    pub totals: [i64; 3],
    pub owners: Vec<(u32, i64)>,
}

#[derive(Clone, Debug, Serialize)]
pub struct DeviceReport {
    pub device: String,
    pub db: String,
    /// The trace's first and last instants, ns after the origin.
    pub start: i64,
    pub end: i64,
    /// (family, owner path) by index.
    pub owners: Vec<(&'static str, String)>,
    /// The family whose live bytes are the device's footprint: HAL, else PTA, else HOST.
    pub peak_family: Option<&'static str>,
    pub curves: Vec<curves::Curve>,
    pub reserved: Vec<Reserved>,
    /// Steps, marks and OOMs (ts relative).
    pub instants: Vec<Instant>,
    pub steps: Vec<StepEnd>,
    pub blocks: blocks::Table,
    /// Each family's bytes at its peak by Python stack, where the trace read stacks.
    pub flames: Vec<flame::Flame>,
    pub findings: Vec<findings::Finding>,
    /// What was summarised, in words.
    pub summarised: Vec<String>,
    /// For msMemScope's capture, what its data lacks ([`DumpDb::capture_note`]).
    pub capture: Option<String>,
    /// Its step ends and peaks, for the Ranks section ([`ranks`]).
    #[serde(skip)]
    pub profile: ranks::Profile,
}

/// The earliest `Timestamp(ns)` of a DB: the run's origin is the earliest of its devices'.
pub fn first_ts(db: &DumpDb) -> Result<Option<i64>, AnalysisError> {
    let sql = format!("SELECT min(\"Timestamp(ns)\") FROM \"{}\"", db.table());
    db.conn()
        .query_row(&sql, [], |r| r.get(0))
        .map_err(|source| AnalysisError::Read { path: db.path().to_owned(), source })
}

/// Keeps at most `max` of `items`, evenly spread, the last always; says so in `notes`.
fn sample<T>(items: Vec<T>, max: usize, what: &str, notes: &mut Vec<String>) -> Vec<T> {
    let n = items.len();
    if n <= max || max == 0 {
        return items;
    }
    notes.push(format!("{what}: {max} of {n} drawn, evenly spread"));
    let keep: std::collections::BTreeSet<usize> = (0..max).map(|i| i * (n - 1) / (max - 1).max(1)).collect();
    items.into_iter().enumerate().filter(|(i, _)| keep.contains(i)).map(|(_, x)| x).collect()
}

/// Maps the step replay's owner slots onto the decomposition's owner indices.
fn step_end(p: &StepPoint, steps: &Timeline, owners: &mut Vec<(&'static str, String)>, origin: i64) -> StepEnd {
    let owners = p
        .owners
        .iter()
        .map(|o| {
            let (family, name) = steps.owner(o.slot);
            let i = match owners.iter().position(|(f, n)| *f == family.as_str() && n == name) {
                Some(i) => i,
                None => {
                    owners.push((family.as_str(), name.to_owned()));
                    owners.len() - 1
                }
            };
            (i as u32, o.bytes)
        })
        .collect();
    StepEnd { step: p.step.unwrap_or(0), t: p.ts - origin, totals: p.totals, owners }
}

/// Everything the page shows of one device's DB.
pub fn device(db: &DumpDb, device: &str, origin: i64, options: &Options) -> Result<DeviceReport, AnalysisError> {
    let mut notes = Vec::new();
    let step_db = StepDb::new(db)?;
    // One pass feeds the replays: reading the rows is most of the cost.
    let mut changes = decompose::TimelineReplay::default();
    let mut step_replay = steps::Replay::new(&step_db, None, blocks::TopBlocks::new(options.top_blocks))?;
    let mut instant_reader = instants::Reader::default();
    let mut by_stack = if py_stacks::present(db)? { Some(ByReplay::new(db, By::Stack)?) } else { None };
    let mut consumers: Vec<&mut dyn Consumer> = vec![&mut changes, &mut step_replay, &mut instant_reader];
    consumers.extend(by_stack.as_mut().map(|r| r as &mut dyn Consumer));
    pass::run(db, &mut consumers)?;
    let timeline = changes.finish();
    let (steps, top) = step_replay.finish_unmarked();
    let end_ns = steps.end_point().map_or(origin, |p| p.ts);
    let start_ns = steps.start_ns().unwrap_or(origin);
    let bounds = (start_ns.min(end_ns), end_ns);

    let curves = curves::curves(&timeline, origin, bounds, options.buckets);
    let profile = ranks::Profile::of(&timeline, &steps);
    for c in curves.iter().filter(|c| c.t.len() < c.instants) {
        notes.push(format!(
            "{} memory over time: {} instants drawn as {} (each of {} intervals keeps its highest and lowest; every peak is exact)",
            c.family,
            c.instants,
            c.t.len(),
            options.buckets
        ));
    }
    let flames = by_stack.map(|r| flame::flames(r, &curves, origin, &mut notes)).unwrap_or_default();
    let mut owners: Vec<(&'static str, String)> =
        timeline.owners.iter().map(|(f, p)| (f.as_str(), p.clone())).collect();
    drop(timeline);

    let read = instant_reader.finish();
    let reserved = reserved_lines(&read.reserved, origin, bounds, options.buckets, &mut notes);
    let mut marks: Vec<Instant> = Vec::new();
    for kind in [instants::Kind::Step, instants::Kind::Mark, instants::Kind::Oom] {
        let of_kind: Vec<Instant> = read.instants.iter().filter(|i| i.kind == kind).cloned().collect();
        let what = match kind {
            instants::Kind::Step => "step boundaries",
            instants::Kind::Mark => "marks",
            instants::Kind::Oom => "OOMs",
        };
        marks.extend(sample(of_kind, options.max_instants, what, &mut notes));
    }
    marks.iter_mut().for_each(|i| i.ts -= origin);
    marks.sort_by_key(|i| i.ts);

    let ends: Vec<StepEnd> = steps.points.iter().map(|p| step_end(p, &steps, &mut owners, origin)).collect();
    let ends = sample(ends, options.max_instants, "step ends", &mut notes);
    let blocks = top.table(&step_db, &steps, origin)?;
    if (blocks.rows.len() as u64) < blocks.blocks {
        notes.push(format!(
            "blocks: the {} largest of {} listed; the other {} are only counted",
            blocks.rows.len(),
            blocks.blocks,
            blocks.blocks - blocks.rows.len() as u64
        ));
    }
    let findings = findings::read(db, options.finding_rows, origin)?;
    for f in findings.iter().filter(|f| f.total > f.rows.len() as u64) {
        notes.push(format!("{}: the first {} of {} rows", f.table, f.rows.len(), f.total));
    }
    let peak_family = [Family::Hal, Family::Pta, Family::Host]
        .into_iter()
        .find(|f| curves.iter().any(|c| c.family == f.as_str()))
        .map(Family::as_str);
    Ok(DeviceReport {
        device: device.to_owned(),
        db: db.path().display().to_string(),
        start: bounds.0 - origin,
        end: bounds.1 - origin,
        owners,
        peak_family,
        curves,
        reserved,
        instants: marks,
        steps: ends,
        blocks,
        flames,
        findings,
        summarised: notes,
        capture: db.capture_note()?,
        profile,
    })
}

/// Per pool, its reserved and its allocated bytes (as torch_npu counts them) summed over
/// processes, thinned like the curves.
fn reserved_lines(
    changes: &[instants::Reserved],
    origin: i64,
    bounds: (i64, i64),
    buckets: usize,
    notes: &mut Vec<String>,
) -> Vec<Reserved> {
    let mut pools: Vec<&str> = changes.iter().map(|r| r.pool.as_str()).collect();
    pools.sort_unstable();
    pools.dedup();
    let mut out = Vec::new();
    for pool in pools {
        for (what, value) in
            [("reserved", (|r: &instants::Reserved| Some(r.total)) as fn(&_) -> _), ("allocated", |r| r.used)]
        {
            let mut per_pid: std::collections::BTreeMap<i64, i64> = Default::default();
            let mut points: Vec<(i64, i64)> = Vec::new();
            for r in changes.iter().filter(|r| r.pool == pool) {
                let Some(v) = value(r) else { continue };
                if per_pid.insert(r.pid, v) != Some(v) {
                    points.push((r.ts, per_pid.values().sum()));
                }
            }
            if points.is_empty() {
                continue;
            }
            let thinned = curves::thin(&points, origin, bounds, buckets);
            let name = format!("PTA {pool} {what}");
            if thinned.len() < points.len() {
                notes.push(format!("{name}: {} changes drawn as {}", points.len(), thinned.len()));
            }
            out.push(Reserved { name, points: thinned, changes: points.len() });
        }
    }
    out
}

/// One trace: its devices.
#[derive(Clone, Debug, Serialize)]
pub struct Run {
    /// What the page calls it: the path given.
    pub label: String,
    /// The run's time zero, `Timestamp(ns)` as text.
    pub origin_ns: String,
    pub devices: Vec<DeviceReport>,
    /// The rank and job the run's trace recorded (a run of one DB).
    #[serde(skip)]
    pub identity: Option<Identity>,
}

/// What the page is given.
#[derive(Clone, Debug, Serialize)]
pub struct Page {
    pub tool: &'static str,
    pub version: &'static str,
    /// One run, or two to compare (A, B).
    pub runs: Vec<Run>,
    /// With two runs: their devices paired.
    pub compare: Vec<compare::Pair>,
    /// With a job's ranks as runs: the ranks compared.
    pub ranks: Option<ranks::Comparison>,
}

/// The runs as the ranks of jobs, each device of each run a rank.
pub fn ranks(runs: &[Run]) -> ranks::Comparison {
    let members: Vec<ranks::Member> = runs
        .iter()
        .flat_map(|r| {
            r.devices.iter().map(|d| ranks::Member {
                label: if r.devices.len() == 1 { r.label.clone() } else { format!("{} device {}", r.label, d.device) },
                device: d.device.clone(),
                identity: r.identity.clone().unwrap_or_default(),
                profile: d.profile.clone(),
            })
        })
        .collect();
    ranks::compare_ranks(&members)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::steps::testrows::step;
    use crate::analysis::testdb::{dir, TestDb};

    const T0: i64 = 1_767_225_600_000_000_000;

    /// Two steps; `kept` bytes of `owner` allocated in step 2 and never freed.
    fn trace(path: &std::path::Path, owner: &'static str, kept: u64) -> TestDb {
        let mut db = TestDb::create(path);
        db.system("START_TRACE", T0);
        db.malloc("PTA", T0 + 10, 0x1000, 4096, Some("PTA@model@weight"));
        for (i, size) in [100u64, 300, 200].into_iter().enumerate() {
            let ptr = 0x9000 + i as u64 * 0x1000;
            db.malloc("PTA", T0 + 20 + i as i64, ptr, size, Some("PTA@act"));
            db.free("PTA", T0 + 30 + i as i64, ptr);
        }
        step(&mut db, T0 + 40, 1);
        if kept > 0 {
            db.malloc("PTA", T0 + 50, 0x5000, kept, Some(owner));
        }
        step(&mut db, T0 + 60, 2);
        db.system("STOP_TRACE", T0 + 70);
        db
    }

    #[test]
    fn a_device_report_keeps_the_largest_blocks_counts_the_rest_and_says_so() {
        let db = trace(&dir("report-device").join("d.db"), "PTA@kv", 1000);
        db.conn().execute_batch("CREATE TABLE ms_oom (oom INTEGER, ts_ns INTEGER, verdict TEXT)").unwrap();
        db.conn().execute("INSERT INTO ms_oom VALUES (1, ?1, 'device_full')", [T0 + 55]).unwrap();
        let open = DumpDb::open_read(&db.path).unwrap();
        let options = Options { top_blocks: 2, ..Options::default() };
        let r = device(&open, "0", T0, &options).unwrap();
        assert_eq!(r.blocks.blocks, 5);
        let sizes: Vec<i64> = r.blocks.rows.iter().map(|b| b.size).collect();
        assert_eq!(sizes, [4096, 1000]);
        assert_eq!(r.blocks.rows[1].free, None, "the kv block is live at the end");
        assert_eq!(r.blocks.rows[1].birth_step, Some(2));
        assert!(r.summarised.iter().any(|n| n.contains("2 largest of 5")), "{:?}", r.summarised);
        let pta = r.curves.iter().find(|c| c.family == "PTA").unwrap();
        assert_eq!((pta.peak, pta.peak_t), (4096 + 1000, 50), "the weight and the kept block: {pta:?}");
        assert_eq!(pta.total[3], 4096 + 600, "the three activations live at once");
        let oom = r.findings.iter().find(|f| f.table == "ms_oom").unwrap();
        assert!(oom.present);
        use serde_json::Value;
        assert_eq!(oom.rows, [vec![Value::from(1), Value::from(55), Value::from("device_full")]]);
        assert!(!r.findings.iter().find(|f| f.table == "ms_leaks").unwrap().present);
        assert_eq!(r.steps.iter().map(|s| s.step).collect::<Vec<_>>(), [1, 2]);
        assert_eq!((r.start, r.end), (0, 70));
        assert_eq!(r.capture, None, "our own trace lacks nothing");
        // msMemScope's DB (no ms_meta): the page says what its data lacks.
        db.conn().execute_batch("DROP TABLE ms_meta").unwrap();
        let r = device(&DumpDb::open_read(&db.path).unwrap(), "0", T0, &options).unwrap();
        let note = r.capture.expect("msMemScope's capture is said");
        assert!(note.contains("pool segments") && !note.contains("no owner"), "every block has an owner: {note}");
    }

    #[test]
    fn compared_runs_list_the_owner_that_grew_at_the_last_common_step() {
        let base = dir("report-compare");
        let (a, b) = (trace(&base.join("a.db"), "PTA@kv", 0), trace(&base.join("b.db"), "PTA@kv", 2048));
        let (a, b) = (DumpDb::open_read(&a.path).unwrap(), DumpDb::open_read(&b.path).unwrap());
        let ra = device(&a, "0", T0, &Options::default()).unwrap();
        let rb = device(&b, "0", T0, &Options::default()).unwrap();
        let pairs = compare::pairs(&[ra], &[rb]);
        assert_eq!(pairs.len(), 1);
        assert_eq!(pairs[0].step, Some(2));
        let grew = &pairs[0].owners;
        assert_eq!(grew.len(), 1, "{grew:?}");
        assert_eq!((grew[0].owner.as_str(), grew[0].a, grew[0].b, grew[0].diff), ("PTA@kv", 0, 2048, 2048));
    }
}
