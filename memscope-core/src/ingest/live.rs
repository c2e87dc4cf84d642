//! A job's memory as it runs, for the daemon's metrics: live bytes by device, family and owner,
//! and the live bytes at each step boundary, judged by the same degradation test as
//! `analyze --analysis leaks` ([`crate::analysis::degradation::trend`]).
//!
//! It is fed the facts the model hands the store ([`Output`]), one by one, so it agrees with the
//! job's DB rows (owners, retags, sampling weights) without reading the DB back, and costs one
//! hash operation per block. The offline [`crate::analysis::steps::Timeline`] replays rows instead and
//! keeps every boundary; a daemon runs for months, so here the boundaries are thinned evenly
//! (every other one kept, each time [`MAX_POINTS`] is reached), which is what the offline test
//! does to a long series too ([`crate::analysis::degradation`]).
//!
//! Boundaries are the ones the offline analysis finds: `memscope.step()`, mstx `step start`
//! ranges, or `--step-marker` marks. A job that never marks a step gets one boundary per time
//! window instead, so an unmarked job's growth is still judged; its first real step replaces
//! the windows.

use std::collections::{BTreeMap, HashMap};

use foldhash::fast::RandomState;
use serde::Serialize;

use crate::analysis::blocks::{Family, UNKNOWN_OWNER};
use crate::analysis::degradation::{self, Trend};
use crate::analysis::steps::STEP_RANGE;
use crate::model::event::{DeviceKey, Space};
use crate::model::output::{block_weight, MstxKind, Output, Owner};

/// Boundaries kept per series: the trend test is quadratic in them.
pub const MAX_POINTS: usize = 512;

/// How a job's steps are told apart.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    /// Boundaries ending steps up to this one are the warm-up (as `--warmup-steps`).
    pub warmup_steps: u64,
    /// Steps start at MSTX marks with this message (as `--step-marker`).
    pub step_marker: Option<String>,
    /// A job with no step marked yet gets a boundary every this many nanoseconds.
    pub window_ns: u64,
    /// The trends are computed again at most this often (they are quadratic in the points).
    pub trend_every_ns: u64,
}

/// Where a job's boundaries come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StepSource {
    Markers,
    Window,
}

impl StepSource {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Markers => "markers",
            Self::Window => "window",
        }
    }
}

/// One owner's live memory on one device (`owner` is `other` for the owners past the top N).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnerLive {
    pub device: DeviceKey,
    pub family: Family,
    pub owner: String,
    pub bytes: i64,
    pub blocks: u64,
}

/// The degradation verdict of one device's family.
#[derive(Clone, Debug, PartialEq)]
pub struct SeriesTrend {
    pub device: DeviceKey,
    pub family: Family,
    pub trend: Trend,
}

/// A live block: what it counts for, under which owner.
#[derive(Clone, Copy, Debug)]
struct Held {
    device: DeviceKey,
    slot: u32,
    bytes: i64,
}

/// Live bytes at boundaries, thinned evenly: point `i` is the `i × stride`-th boundary. A
/// device first seen late has 0 bytes at the boundaries before, as its DB's replay would.
#[derive(Debug, Default)]
struct Series {
    steps: Vec<u64>,
    /// Per device, the live bytes of each family (by `Family as usize`) at each of `steps`.
    bytes: BTreeMap<DeviceKey, Vec<[i64; 3]>>,
    stride: u64,
    seen: u64,
}

impl Series {
    fn push(&mut self, step: u64, totals: &BTreeMap<(DeviceKey, Family), i64>) {
        let stride = self.stride.max(1);
        self.seen += 1;
        if !(self.seen - 1).is_multiple_of(stride) {
            return;
        }
        let before = self.steps.len();
        self.steps.push(step);
        for (&(device, family), &bytes) in totals {
            let points = self.bytes.entry(device).or_insert_with(|| vec![[0; 3]; before]);
            if points.len() == before {
                points.push([0; 3]);
            }
            points[before][family as usize] = bytes;
        }
        for points in self.bytes.values_mut() {
            points.resize(before + 1, [0; 3]);
        }
        if self.steps.len() > MAX_POINTS {
            thin(&mut self.steps);
            self.bytes.values_mut().for_each(thin);
            self.stride = stride * 2;
        }
    }

    fn family(&self, device: DeviceKey, family: Family) -> Vec<(u64, i64)> {
        let points = self.bytes.get(&device).map_or(&[][..], Vec::as_slice);
        self.steps.iter().zip(points).map(|(s, b)| (*s, b[family as usize])).collect()
    }
}

/// Keeps every other element, the first among them.
fn thin<T>(v: &mut Vec<T>) {
    let mut i = 0;
    v.retain(|_| {
        i += 1;
        i % 2 == 1
    });
}

/// The live view of one job.
#[derive(Debug)]
pub struct LiveView {
    options: Options,
    blocks: HashMap<(Family, u32, u64), Held, RandomState>,
    /// Owner paths by slot, and slots by path.
    owners: Vec<(Family, Owner)>,
    slots: HashMap<Owner, [Option<u32>; 3], RandomState>,
    /// Live bytes and blocks by (device, owner slot).
    live: HashMap<(DeviceKey, u32), (i64, u64), RandomState>,
    /// Live bytes by device and family; a pair once seen stays (at 0 when nothing is live).
    totals: BTreeMap<(DeviceKey, Family), i64>,
    series: Series,
    /// The step running now (at least 1), as the offline detector numbers it.
    current: Option<u64>,
    /// A `STEP` waiting to learn whether its `step start` twin follows: (number, time, pid).
    pending: Option<(u64, u64, u32)>,
    source: Option<StepSource>,
    window_origin: Option<u64>,
    trends: Vec<SeriesTrend>,
    trends_at: Option<u64>,
    /// Boundaries since the trends were computed.
    stale: bool,
}

impl LiveView {
    pub fn new(options: Options) -> Self {
        Self {
            options,
            blocks: HashMap::default(),
            owners: Vec::new(),
            slots: HashMap::default(),
            live: HashMap::default(),
            totals: BTreeMap::new(),
            series: Series::default(),
            current: None,
            pending: None,
            source: None,
            window_origin: None,
            trends: Vec::new(),
            trends_at: None,
            stale: false,
        }
    }

    /// Takes one fact in, in the order the model made them.
    pub fn observe(&mut self, output: &Output) {
        if let Some((number, ts, pid)) = self.pending.take() {
            let twin = matches!(output, Output::Mstx { kind: MstxKind::RangeStart, message, wall_ns, pid: p, .. }
                if message == STEP_RANGE && *wall_ns == ts && *p == pid);
            // A `step start` range names the step it starts; a bare `step()` the one it ends.
            self.boundary(Some(if twin { number } else { number.saturating_add(1) }));
            if twin {
                return;
            }
        }
        match output {
            Output::Malloc { site, device, space, ptr, size, req_size, owner, .. } => {
                let family = if *space == Space::Device { Family::Hal } else { Family::Host };
                let device = if *space == Space::Device { *device } else { DeviceKey::Cpu };
                let bytes = block_weight(site, *size, Some(*req_size)).unwrap_or(*size);
                let owner = owner.as_deref().unwrap_or(UNKNOWN_OWNER);
                self.hold((family, site.pid, *ptr), device, owner, bytes);
            }
            Output::PoolMalloc { site, device, ptr, size, req_size, owner, .. } => {
                let bytes = block_weight(site, *size, *req_size).unwrap_or(*size);
                self.hold((Family::Pta, site.pid, *ptr), *device, owner, bytes);
            }
            Output::Free { site, space, ptr, .. } => {
                let family = if *space == Space::Device { Family::Hal } else { Family::Host };
                self.release((family, site.pid, *ptr));
            }
            Output::PoolFree { site, ptr, .. } => {
                self.release((Family::Pta, site.pid, *ptr));
            }
            Output::Retag { pid, event_type, ptr, owner, .. } => {
                if let Some(family) = Family::of(event_type.as_str()) {
                    if let Some(held) = self.release((family, *pid, *ptr)) {
                        self.hold((family, *pid, *ptr), held.device, owner, held.bytes as u64);
                    }
                }
            }
            Output::Step { number, wall_ns, pid, .. } if self.options.step_marker.is_none() => {
                self.pending = Some((*number, *wall_ns, *pid));
            }
            Output::Mstx { kind: MstxKind::Mark | MstxKind::RangeStart, message, .. }
                if self.options.step_marker.as_deref() == Some(message.as_str()) =>
            {
                self.boundary(None);
            }
            _ => {}
        }
    }

    /// The end of one event's facts: a `STEP` with no twin after it is a boundary now.
    pub fn settle(&mut self) {
        if let Some((number, _, _)) = self.pending.take() {
            self.boundary(Some(number.saturating_add(1)));
        }
    }

    /// Time passes: a job with no step marked gets its window boundaries, and the trends are
    /// brought up to date when they are due.
    pub fn tick(&mut self, now_ns: u64) {
        self.settle();
        if self.source != Some(StepSource::Markers) && self.options.window_ns > 0 {
            let origin = *self.window_origin.get_or_insert(now_ns);
            let windows = now_ns.saturating_sub(origin) / self.options.window_ns;
            let mut ended = self.current.map_or(0, |c| c - 1);
            while ended < windows {
                ended += 1;
                self.current = Some(ended + 1);
                self.source = Some(StepSource::Window);
                self.record(ended);
            }
        }
        let due = self.trends_at.is_none_or(|at| now_ns.saturating_sub(at) >= self.options.trend_every_ns);
        if self.stale && due {
            let series = &self.series;
            self.trends = self
                .totals
                .keys()
                .map(|&(device, family)| SeriesTrend {
                    device,
                    family,
                    trend: degradation::trend(&series.family(device, family)),
                })
                .collect();
            self.trends_at = Some(now_ns);
            self.stale = false;
        }
    }

    /// The `top` owners by live bytes, each on its device, and the rest summed per device and
    /// family as `other`; largest first.
    pub fn owners(&self, top: usize) -> Vec<OwnerLive> {
        let mut all: Vec<_> = self.live.iter().map(|(k, v)| (*k, *v)).collect();
        all.sort_by(|a, b| b.1 .0.cmp(&a.1 .0).then_with(|| a.0.cmp(&b.0)));
        let mut out: Vec<OwnerLive> = Vec::new();
        let mut other: BTreeMap<(DeviceKey, Family), (i64, u64)> = BTreeMap::new();
        for (i, ((device, slot), (bytes, blocks))) in all.into_iter().enumerate() {
            let (family, owner) = &self.owners[slot as usize];
            if i < top {
                out.push(OwnerLive { device, family: *family, owner: owner.to_string(), bytes, blocks });
            } else {
                let e = other.entry((device, *family)).or_default();
                (e.0, e.1) = (e.0 + bytes, e.1 + blocks);
            }
        }
        out.extend(other.into_iter().map(|((device, family), (bytes, blocks))| OwnerLive {
            device,
            family,
            owner: OTHER.to_owned(),
            bytes,
            blocks,
        }));
        out
    }

    /// Each device's families' verdicts, as of the last [`Self::tick`] that computed them.
    pub fn trends(&self) -> &[SeriesTrend] {
        &self.trends
    }

    /// The last boundary: the step that ended there, and where the boundaries come from.
    pub fn step(&self) -> Option<(u64, StepSource)> {
        self.current.map(|c| c - 1).zip(self.source)
    }

    fn hold(&mut self, key: (Family, u32, u64), device: DeviceKey, owner: &str, bytes: u64) {
        // An address handed out again before its free was seen: the old block is gone.
        self.release(key);
        let slot = self.slot(key.0, owner);
        let bytes = i64::try_from(bytes).unwrap_or(i64::MAX);
        self.blocks.insert(key, Held { device, slot, bytes });
        let e = self.live.entry((device, slot)).or_default();
        (e.0, e.1) = (e.0 + bytes, e.1 + 1);
        *self.totals.entry((device, key.0)).or_default() += bytes;
    }

    fn release(&mut self, key: (Family, u32, u64)) -> Option<Held> {
        let held = self.blocks.remove(&key)?;
        if let Some(e) = self.live.get_mut(&(held.device, held.slot)) {
            (e.0, e.1) = (e.0 - held.bytes, e.1.saturating_sub(1));
            if e.1 == 0 {
                self.live.remove(&(held.device, held.slot));
            }
        }
        *self.totals.entry((held.device, key.0)).or_default() -= held.bytes;
        Some(held)
    }

    fn slot(&mut self, family: Family, owner: &str) -> u32 {
        // Looked up by `&str`: a block's owner is found without making a key.
        if let Some(slot) = self.slots.get(owner).and_then(|s| s[family as usize]) {
            return slot;
        }
        let slot = self.owners.len() as u32;
        let owner = Owner::from(owner);
        self.owners.push((family, owner.clone()));
        self.slots.entry(owner).or_default()[family as usize] = Some(slot);
        slot
    }

    /// A marked boundary; `starts` is the step it starts (`None`: the next one), as the offline
    /// detector counts (a boundary that starts no later step than the current one is a twin).
    fn boundary(&mut self, starts: Option<u64>) {
        if self.source != Some(StepSource::Markers) {
            // The first real step: the time windows so far are replaced by steps.
            self.series = Series::default();
            self.current = None;
            self.source = Some(StepSource::Markers);
        }
        let starts = starts.unwrap_or_else(|| self.current.map_or(1, |c| c + 1)).max(1);
        if self.current.is_some_and(|c| starts <= c) {
            return;
        }
        self.current = Some(starts);
        self.record(starts - 1);
    }

    /// The live bytes of every device's families at the boundary that ended `ended`.
    fn record(&mut self, ended: u64) {
        if ended < self.options.warmup_steps {
            return;
        }
        self.series.push(ended, &self.totals);
        self.stale = true;
    }
}

/// The owner label of the owners past the top N.
pub const OTHER: &str = "other";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::degradation::Verdict;
    use crate::apis::Api;
    use crate::model::event::Pool;
    use crate::model::output::{Origin, Site};

    const MIB: u64 = 1 << 20;
    const PID: u32 = 7;

    fn options() -> Options {
        Options { warmup_steps: 1, step_marker: None, window_ns: 0, trend_every_ns: 0 }
    }

    fn site(api: Api, weight: Option<u64>) -> Site {
        Site { weight, ..Site::of(api, 1, PID, PID) }
    }

    fn pool_malloc(ptr: u64, size: u64, req: u64, owner: &str, weight: Option<u64>) -> Output {
        Output::PoolMalloc {
            site: site(Api::DeviceCachingAllocatorMalloc, weight),
            device: DeviceKey::Npu(0),
            pool: Pool::Caching,
            ptr,
            size,
            req_size: Some(req),
            stream: None,
            allocation_id: ptr,
            used: 0,
            total: 0,
            owner: owner.into(),
            from: Default::default(),
        }
    }

    fn pool_free(ptr: u64) -> Output {
        Output::PoolFree {
            site: site(Api::DeviceCachingAllocatorFree, None),
            device: DeviceKey::Npu(0),
            pool: Pool::Caching,
            ptr,
            size: None,
            allocation_id: None,
            used: 0,
            total: 0,
            shadow: false,
            implied: false,
            stream_uses: 0,
        }
    }

    fn hal_malloc(ptr: u64, size: u64) -> Output {
        Output::Malloc {
            site: site(Api::AclrtMalloc, None),
            device: DeviceKey::Npu(0),
            space: Space::Device,
            ptr,
            size,
            req_size: size,
            allocation_id: ptr,
            used: 0,
            origin: Origin::Direct { policy: None, module: None, driver: None },
            owner: None,
            segment: None,
            from: Default::default(),
        }
    }

    fn step(number: u64, wall_ns: u64) -> Output {
        Output::Step { wall_ns, pid: PID, tid: PID, number, inferred: false }
    }

    fn feed(view: &mut LiveView, outputs: &[Output]) {
        for o in outputs {
            view.observe(o);
        }
        view.settle();
    }

    fn trend_of(view: &LiveView, family: Family) -> Trend {
        view.trends().iter().find(|t| t.family == family && t.device == DeviceKey::Npu(0)).unwrap().trend
    }

    #[test]
    fn owners_count_live_blocks_at_their_weight_follow_retags_and_sum_the_rest_as_other() {
        let mut view = LiveView::new(options());
        feed(
            &mut view,
            &[
                pool_malloc(0x1000, 4 * MIB, 4 * MIB, "PTA@weight", None),
                pool_malloc(0x2000, 2 * MIB, 2 * MIB, "PTA@kv_cache", None),
                pool_malloc(0x3000, 2 * MIB, 2 * MIB, "PTA@kv_cache", None),
                // Sampled: 4 intervals of 512 KiB for a 100 KiB request held in a 128 KiB block.
                pool_malloc(0x4000, 128 << 10, 100 << 10, "PTA@activation", Some(4 * (512 << 10))),
                hal_malloc(0x9000, MIB),
                pool_free(0x3000),
                Output::Retag {
                    device: DeviceKey::Npu(0),
                    pid: PID,
                    event_type: crate::vocab::EventType::Pta,
                    ptr: 0x1000,
                    owner: "PTA@model_weight".into(),
                    by: crate::model::OwnerBy::Marker,
                },
                // A free of a block never seen changes nothing.
                pool_free(0x7777),
            ],
        );
        let sampled = (4 * (512u64 << 10) * (128 << 10) / (100 << 10)) as i64;
        let got: Vec<(String, i64, u64)> = view.owners(2).into_iter().map(|o| (o.owner, o.bytes, o.blocks)).collect();
        assert_eq!(
            got,
            [
                ("PTA@model_weight".to_owned(), 4 * MIB as i64, 1),
                ("PTA@activation".to_owned(), sampled, 1),
                // The HAL buffer and the kv_cache block, each in its family's `other`.
                (OTHER.to_owned(), MIB as i64, 1),
                (OTHER.to_owned(), 2 * MIB as i64, 1),
            ]
        );
        let all = view.owners(10);
        assert!(all.iter().all(|o| o.owner != "PTA@weight"), "the retag moved the block: {all:?}");
        assert_eq!(all.iter().find(|o| o.owner == UNKNOWN_OWNER).map(|o| o.family), Some(Family::Hal));
    }

    /// A training loop's outputs: per step, temporaries freed within it, and (when `leak`) one
    /// 2 MiB block kept; a 1 MiB HAL buffer kept at step 3.
    fn training(view: &mut LiveView, steps: u64, leak: bool) {
        let mut ptr = 0x10_0000;
        for s in 1..=steps {
            for k in 0..3 {
                ptr += 0x1000;
                feed(view, &[pool_malloc(ptr, (1 + k) * MIB, (1 + k) * MIB, "PTA@activation", None), pool_free(ptr)]);
            }
            if leak && s >= 2 {
                ptr += 0x1000;
                feed(view, &[pool_malloc(ptr, 2 * MIB, 2 * MIB, "PTA@kv_cache", None)]);
            }
            if s == 3 {
                feed(view, &[hal_malloc(0xdead_0000, MIB)]);
            }
            feed(view, &[step(s, 100 * s)]);
        }
        view.tick(1);
    }

    #[test]
    fn a_block_kept_every_step_is_a_sustained_rise_and_a_buffer_kept_once_is_not() {
        let mut leaky = LiveView::new(options());
        training(&mut leaky, 14, true);
        let pta = trend_of(&leaky, Family::Pta);
        assert_eq!(pta.verdict, Verdict::SustainedRise, "{pta:?}");
        // Boundaries ending steps 1..=14 (step 1 is the warm-up's end, the baseline); 2 MiB a step.
        assert_eq!(pta.points, 14);
        assert_eq!(pta.slope, (2 * MIB) as f64);
        // The series is the loop's own ledger: 2 MiB kept at each step from the second on.
        let kept: Vec<(u64, i64)> = (1..=14).map(|s| (s, (2 * MIB * (s - 1)) as i64)).collect();
        assert_eq!(leaky.series.family(DeviceKey::Npu(0), Family::Pta), kept);
        let hal: Vec<(u64, i64)> = (1..=14).map(|s| (s, if s >= 3 { MIB as i64 } else { 0 })).collect();
        assert_eq!(leaky.series.family(DeviceKey::Npu(0), Family::Hal), hal);
        assert_ne!(trend_of(&leaky, Family::Hal).verdict, Verdict::SustainedRise);
        assert_eq!(leaky.step(), Some((14, StepSource::Markers)));

        let mut clean = LiveView::new(options());
        training(&mut clean, 14, false);
        assert_eq!(trend_of(&clean, Family::Pta).verdict, Verdict::NoTrend);
    }

    #[test]
    fn a_step_start_range_and_its_step_row_are_one_boundary_numbered_as_offline() {
        let mut view = LiveView::new(Options { warmup_steps: 0, ..options() });
        let range = |ts| Output::Mstx {
            wall_ns: ts,
            pid: PID,
            tid: PID,
            api: None,
            kind: MstxKind::RangeStart,
            id: Some(1),
            message: STEP_RANGE.to_owned(),
        };
        // mstx `step start` ranges: the tracker numbers each the step it starts.
        feed(&mut view, &[step(1, 10), range(10)]);
        assert_eq!(view.step(), Some((0, StepSource::Markers)));
        feed(&mut view, &[step(2, 20), range(20)]);
        assert_eq!(view.step(), Some((1, StepSource::Markers)));
        // `memscope.step()` numbers the step it ends.
        feed(&mut view, &[step(5, 30)]);
        assert_eq!(view.step(), Some((5, StepSource::Markers)));
        view.tick(1);
        assert_eq!(trend_of_points(&view), [0, 1, 5]);
    }

    fn trend_of_points(view: &LiveView) -> Vec<u64> {
        view.series.steps.clone()
    }

    #[test]
    fn without_steps_each_window_is_a_boundary_until_the_first_step_replaces_them() {
        let window = 1_000_000_000;
        let mut view = LiveView::new(Options { window_ns: window, ..options() });
        feed(&mut view, &[pool_malloc(0x1000, MIB, MIB, "PTA@x", None)]);
        view.tick(5 * window);
        assert_eq!(view.step(), None, "the first tick starts the clock");
        view.tick(5 * window + window / 2);
        assert_eq!(view.step(), None);
        view.tick(8 * window + 1);
        assert_eq!(view.step(), Some((3, StepSource::Window)));
        assert_eq!(trend_of_points(&view), [1, 2, 3]);
        feed(&mut view, &[step(1, 9)]);
        assert_eq!(view.step(), Some((1, StepSource::Markers)));
        view.tick(20 * window);
        assert_eq!(view.step(), Some((1, StepSource::Markers)), "no windows once steps are marked");
        assert_eq!(trend_of_points(&view), [1]);
    }

    #[test]
    fn a_long_run_keeps_evenly_spaced_boundaries_from_its_first_on() {
        let mut view = LiveView::new(Options { warmup_steps: 0, ..options() });
        feed(&mut view, &[pool_malloc(0x1000, MIB, MIB, "PTA@x", None)]);
        for s in 0..5000 {
            feed(&mut view, &[step(s, s)]);
        }
        let points = trend_of_points(&view);
        assert!(points.len() <= MAX_POINTS && points.len() > MAX_POINTS / 2, "{}", points.len());
        assert_eq!(points[0], 0);
        let gaps: std::collections::BTreeSet<u64> = points.windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(gaps.len(), 1, "uneven: {gaps:?}");
    }
}
