//! The consumer on its own: synthetic ring records replayed through the trace's path (decode →
//! apis → tracker → rows → SQLite on the store thread), for `cargo xtask bench`. It measures what
//! userspace costs per record and what it holds per live block, without BPF and without the
//! traced program competing for the CPU.
//!
//! The records are the bytes the BPF programs write for the stand-in allocation loop
//! (`tests/bench/alloc_bench.c`, built from the ABI in `memscope_common::record`): per pair, the
//! driver's `halMemAlloc` (nested in the runtime's call, so its record comes first), then
//! `aclrtMalloc`, `halMemFree` and `aclrtFree`. `live` blocks are allocated first and never
//! freed, so they are live at the stop and get their shadow frees there.
//!
//! With `stacks` (`--call-stack c` replayed), each outermost call is preceded by the stack
//! record the probe sends, one of `stacks` distinct stacks of [`STACK_FRAMES`] frames taken
//! round-robin. Their addresses are spread over the code of the C library this process maps
//! (stripped of its line tables and local symbols, as vendor libraries ship: each frame is a
//! function name and an offset, about 80 bytes of text), and the records carry this process's
//! id, so each new stack is normalized against a live process's maps and symbolized from a real
//! ELF file, as in a trace.

use std::mem::size_of;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use memscope_common::record::{CallRecord, RecordHeader, RecordKind, StackRecord, NO_MODULE, STACK_HEADER_LEN};
use memscope_core::apis::Api;
use memscope_core::ingest::clock::{self, Clock};
use memscope_core::ingest::decoder::{ConsumerStats, Decoder};
use memscope_core::ingest::recorder::Recorder;
use memscope_core::model::Tracker;
use memscope_core::raw::as_bytes;
use memscope_core::store::{Format, Meta, RunLayout, Store, Writer};

use super::procs::is_running_process;

/// The process id written in the replayed records (and in the run folder's name).
pub const PID: u32 = 4242;
/// Records generated per chunk: small, so the generator's buffer stays out of the peak memory.
const CHUNK: usize = 4096;
const RECORD: usize = size_of::<CallRecord>();
/// `MEM_DEV_VAL << MEM_VIRT_BIT | APP << 56`: device memory of device 0 for module APP, as the
/// stand-in runtime asks the driver.
const FLAG: u64 = (1 << 10) | (33 << 56);

pub struct Options {
    pub pairs: u64,
    pub live: u64,
    pub output: PathBuf,
    /// Distinct native stacks to replay (0: no stacks).
    pub stacks: u64,
}

/// Frames per replayed stack: a typical depth from a Python training loop down to the runtime.
pub const STACK_FRAMES: usize = 24;

pub struct Report {
    pub records: u64,
    /// Records the consumer could not decode or map to an API (0 when the generator is right).
    pub rejected: u64,
    pub wall: Duration,
    /// CPU time of the whole process (all threads) less the generator's own.
    pub cpu: Duration,
    /// `VmHWM`: the process's peak resident memory, in KiB.
    pub peak_rss_kib: u64,
    pub files: Vec<PathBuf>,
}

/// The records of the allocation loop, in the order one thread's ring records arrive.
struct Generator {
    mono_ns: u64,
    next: u64,
    live_left: u64,
    pairs_left: u64,
    pid: u32,
    /// Code addresses the stacks are made of (empty: no stacks).
    code: Vec<u64>,
    stacks: u64,
    /// Where each record of the chunk ends.
    ends: Vec<usize>,
}

/// `count` addresses spread over the code of the C library this process maps (its executable
/// mapping), and that library's path.
fn libc_code_addresses(count: usize) -> anyhow::Result<(Vec<u64>, PathBuf)> {
    let maps = std::fs::read_to_string("/proc/self/maps").context("cannot read /proc/self/maps")?;
    let libc = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| Path::new(p).file_name().is_some_and(|n| n.to_string_lossy().starts_with("libc.so")))
        .context("this process maps no libc.so")?
        .to_owned();
    let (start, end) = maps
        .lines()
        .filter(|l| l.ends_with(libc.as_str()) && l.split_whitespace().nth(1).is_some_and(|p| p.contains('x')))
        .find_map(|l| {
            let (a, b) = l.split_whitespace().next()?.split_once('-')?;
            Some((u64::from_str_radix(a, 16).ok()?, u64::from_str_radix(b, 16).ok()?))
        })
        .context("libc.so has no executable mapping in /proc/self/maps")?;
    let step = (end - start) / count as u64;
    Ok(((0..count as u64).map(|i| start + i * step + 0x40).collect(), PathBuf::from(libc)))
}

impl Generator {
    /// Stack number `n % stacks`: its three innermost frames spell the number in base
    /// `code.len()`, the rest are fixed, so that `stacks` of them are distinct.
    fn stack(&mut self, entry_ns: u64, out: &mut Vec<u8>) {
        if self.code.is_empty() {
            return;
        }
        let base = self.code.len() as u64;
        let n = self.next % self.stacks;
        let mut record = StackRecord {
            hdr: RecordHeader::new(RecordKind::Stack, entry_ns, self.pid, self.pid),
            return_address: self.code[1],
            flags: 0,
            frames: STACK_FRAMES as u32,
            ips: [0; memscope_common::record::MAX_STACK_DEPTH],
        };
        for (i, ip) in record.ips[..STACK_FRAMES].iter_mut().enumerate() {
            let digit = match i {
                0..=2 => (n / base.pow(i as u32)) % base,
                _ => i as u64 % base,
            };
            *ip = self.code[digit as usize];
        }
        out.extend_from_slice(&as_bytes(&record)[..STACK_HEADER_LEN + STACK_FRAMES * 8]);
        self.ends.push(out.len());
    }

    /// A call that ran from `entry_ns` to `return_ns`.
    fn record(
        &mut self,
        (api, outer): (Api, Option<Api>),
        args: [u64; 3],
        result: Option<u64>,
        (entry_ns, return_ns): (u64, u64),
        out: &mut Vec<u8>,
    ) {
        let mut fields = [0; memscope_common::spec::MAX_FIELDS];
        fields[0] = result.unwrap_or(0);
        out.extend_from_slice(as_bytes(&CallRecord {
            hdr: RecordHeader::new(RecordKind::Call, return_ns, self.pid, self.pid),
            spec_id: api.spec_id() as u16,
            thread_device: 0,
            entry_ns,
            args: [args[0], args[1], args[2], 0, 0, 0],
            ret: 0,
            fields,
            fields_ok: u8::from(result.is_some()),
            outer_spec: outer.map_or(0, |a| a.spec_id() as u16),
            cfg_device: -1,
            cfg_module: NO_MODULE,
            points: 0,
        }));
        self.ends.push(out.len());
    }

    /// The runtime's call, its driver call nested in it (whose record comes first, at its
    /// return), the stack before both.
    fn outer_and_nested(
        &mut self,
        (outer, inner): (Api, Api),
        (outer_args, inner_args): ([u64; 3], [u64; 3]),
        result: Option<u64>,
        out: &mut Vec<u8>,
    ) {
        self.mono_ns += 1000;
        let entry = self.mono_ns;
        self.stack(entry, out);
        self.record((inner, Some(outer)), inner_args, result, (entry + 100, entry + 400), out);
        self.record((outer, None), outer_args, result, (entry, entry + 500), out);
    }

    fn malloc(&mut self, ptr: u64, size: u64, out: &mut Vec<u8>) {
        let out_ptr = 0x7ffd_0000_1000;
        let driver_size = (size + 32).div_ceil(32) * 32;
        self.outer_and_nested(
            (Api::AclrtMalloc, Api::HalMemAlloc),
            ([out_ptr, size, 0], [out_ptr, driver_size, FLAG]),
            Some(ptr),
            out,
        );
    }

    fn free(&mut self, ptr: u64, out: &mut Vec<u8>) {
        self.outer_and_nested((Api::AclrtFree, Api::HalMemFree), ([ptr, 0, 0], [ptr, 0, 0]), None, out);
    }

    /// The next records (up to about [`CHUNK`], back to back); empty at the end.
    fn fill(&mut self, out: &mut Vec<u8>) {
        out.clear();
        self.ends.clear();
        while out.len() < CHUNK * RECORD && (self.live_left > 0 || self.pairs_left > 0) {
            let size = 4096 + (self.next & 63);
            if self.live_left > 0 {
                // Live blocks at increasing addresses, as an allocator hands out fresh memory.
                let ptr = 0x1000_0000_0000 + self.next * 0x1200;
                self.malloc(ptr, size, out);
                self.live_left -= 1;
            } else {
                // A pair reuses one address, as the stand-in's allocator does for a freed block.
                let ptr = 0x2000_0000_0000;
                self.malloc(ptr, size, out);
                self.free(ptr, out);
                self.pairs_left -= 1;
            }
            self.next += 1;
        }
    }
}

fn thread_cpu() -> Duration {
    cpu_clock(libc::CLOCK_THREAD_CPUTIME_ID)
}

fn process_cpu() -> Duration {
    cpu_clock(libc::CLOCK_PROCESS_CPUTIME_ID)
}

fn cpu_clock(id: libc::clockid_t) -> Duration {
    // SAFETY: zeroed timespec is a valid out-parameter.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer, known clock id.
    unsafe { libc::clock_gettime(id, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// `VmHWM` of this process, in KiB (0 if /proc cannot say).
pub fn peak_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn store(output: &Path, pid: u32, start_wall: u64) -> anyhow::Result<Writer> {
    let layout = RunLayout::create(output, pid, (start_wall / 1_000_000_000) as i64, "ascend")?;
    let meta: Meta = vec![("tool".into(), "memscope-bpf bench-consumer".into())];
    Ok(Writer::start(Store::new(layout, Format::Db, start_wall, meta)))
}

/// Replays the records and closes the DB as a trace's stop does.
pub fn run(opts: &Options) -> anyhow::Result<Report> {
    let clock = Clock::calibrate();
    let start_wall = clock::wall_ns();
    // Stacks are normalized against the records' process: with stacks, that is this one.
    let (pid, code) =
        if opts.stacks == 0 { (PID, Vec::new()) } else { (std::process::id(), libc_code_addresses(64)?.0) };
    let mut recorder = Recorder::new(Tracker::new(), store(&opts.output, pid, start_wall)?, is_running_process);
    let mut decoder = Decoder::new(clock);
    let mut stats = ConsumerStats::default();
    let mut generator = Generator {
        mono_ns: clock::monotonic_ns(),
        next: 0,
        live_left: opts.live,
        pairs_left: opts.pairs,
        pid,
        code,
        stacks: opts.stacks,
        ends: Vec::new(),
    };
    let mut chunk = Vec::with_capacity((CHUNK + 4) * RECORD);
    let (started, cpu_start) = (Instant::now(), process_cpu());
    let mut generating = Duration::ZERO;
    loop {
        let before = thread_cpu();
        generator.fill(&mut chunk);
        generating += thread_cpu() - before;
        if chunk.is_empty() {
            break;
        }
        let mut start = 0;
        for &end in &generator.ends {
            decoder.feed(&chunk[start..end], &mut stats, &mut |e| recorder.on_event(e));
            start = end;
        }
        if let Some(e) = recorder.error.take() {
            return Err(e.into());
        }
    }
    let Recorder { mut tracker, mut store, .. } = recorder;
    let stop_wall = clock::wall_ns();
    store.stopping()?;
    tracker.finish(stop_wall, |output| {
        store.write_output(&output, (memscope_core::stacks::NO_STACK, memscope_core::stacks::NO_STACK))
    })?;
    let written = store.finish(stop_wall, Vec::new(), Vec::new()).context("cannot finish the DB")?;
    Ok(Report {
        records: stats.records,
        rejected: stats.undecodable + stats.unknown_api,
        wall: started.elapsed(),
        cpu: (process_cpu() - cpu_start).saturating_sub(generating),
        peak_rss_kib: peak_rss_kib(),
        files: written.into_iter().map(|w| w.path).collect(),
    })
}

#[cfg(test)]
mod tests {
    use rusqlite::Connection;

    use super::*;

    fn count(db: &Connection, sql: &str) -> i64 {
        db.query_row(sql, [], |r| r.get(0)).unwrap()
    }

    #[test]
    fn every_generated_call_becomes_the_rows_the_loop_would_write() {
        let dir = std::env::temp_dir().join(format!("memscope-replay-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let report = run(&Options { pairs: 3000, live: 700, output: dir.clone(), stacks: 0 }).unwrap();
        assert_eq!(report.records, (3000 * 4 + 700 * 2), "4 records per pair, 2 per live block");
        assert_eq!(report.rejected, 0);
        assert_eq!(report.files.len(), 1, "all on device 0: {:?}", report.files);
        let db = Connection::open(&report.files[0]).unwrap();
        // The generator's ledger: one MALLOC per pair and live block, a FREE per pair, and a
        // shadow FREE per live block; the driver calls are folded into the runtime's rows.
        assert_eq!(count(&db, "SELECT count(*) FROM memscope_dump WHERE Event = 'MALLOC'"), 3700);
        assert_eq!(count(&db, "SELECT count(*) FROM memscope_dump WHERE Event = 'FREE'"), 3700);
        assert_eq!(count(&db, "SELECT count(*) FROM memscope_dump WHERE Name LIKE 'hal%'"), 0);
        assert_eq!(
            count(&db, "SELECT count(*) FROM memscope_dump WHERE Event = 'FREE' AND Attr LIKE '%\"shadow\"%'"),
            700
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn replayed_stacks_reach_every_row_and_stay_as_distinct_as_generated() {
        let dir = std::env::temp_dir().join(format!("memscope-replay-stacks-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let report = run(&Options { pairs: 400, live: 0, output: dir.clone(), stacks: 7 }).unwrap();
        assert_eq!(report.records, 400 * 6, "4 calls and 2 stacks per pair");
        assert_eq!(report.rejected, 0);
        let db = Connection::open(&report.files[0]).unwrap();
        // Every call's row has its stack; the trace's own SYSTEM rows have none.
        let sql = "SELECT count(*) FROM memscope_dump WHERE Event IN ('MALLOC', 'FREE') AND \"Call Stack(C)\" = ''";
        assert_eq!(count(&db, sql), 0);
        assert_eq!(count(&db, "SELECT count(*) FROM memscope_dump WHERE Event IN ('MALLOC', 'FREE')"), 800);
        assert_eq!(
            count(&db, "SELECT count(DISTINCT \"Call Stack(C)\") FROM memscope_dump WHERE Event IN ('MALLOC', 'FREE')"),
            7
        );
        assert_eq!(count(&db, "SELECT count(*) FROM ms_stacks"), 7);
        // Normalized to the C library's file, every frame (and the caller's, put back), and
        // symbolized from it (how many frames get a function depends on whether its debug file
        // is installed; its exported functions name some in any case).
        let (_, libc) = libc_code_addresses(1).unwrap();
        let in_libc = format!("SELECT count(*) FROM ms_frames WHERE depth = 0 AND path = '{}'", libc.display());
        let all = "SELECT count(*) FROM ms_frames WHERE depth = 0";
        assert!(count(&db, all) >= 7 * STACK_FRAMES as i64);
        assert_eq!(count(&db, &in_libc), count(&db, all), "frames in {}", libc.display());
        assert!(count(&db, &format!("{in_libc} AND symbol IS NOT NULL")) > 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
