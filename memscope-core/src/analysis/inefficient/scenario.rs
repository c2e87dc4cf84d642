//! Synthetic traces whose ground truth is their construction: each block is placed so that,
//! by the definition's wording, it must or must not be flagged; the analysis is never asked.

use std::collections::HashMap;
use std::path::PathBuf;

use crate::analysis::testdb::{dir, TestDb};
use crate::store::Attr;

/// One thing a program does.
#[derive(Clone, Copy, Debug)]
pub enum Act {
    Malloc(u64, u64),
    Read(u64),
    Write(u64),
    Free(u64),
    Wait(i64),
}

/// A trace being written: one process at a time, 10 ns per row unless told to wait.
pub struct Trace {
    db: TestDb,
    pub now: i64,
    pub pid: i64,
    next_alloc: u64,
    /// Live blocks: (pid, ptr) -> Event Type and pool.
    live: HashMap<(i64, u64), (&'static str, Option<&'static str>)>,
}

pub const START_NS: i64 = 1_000_000_000;

impl Trace {
    pub fn new(name: &str) -> Self {
        let db = TestDb::create(&dir(&format!("ineff-{name}")).join("memscope_dump_1.db"));
        db.conn().execute_batch("BEGIN").unwrap();
        let mut t = Self { db, now: START_NS, pid: 1, next_alloc: 1, live: HashMap::new() };
        t.db.system("START_TRACE", t.now);
        t
    }

    fn tick(&mut self) -> i64 {
        self.now += 10;
        self.now
    }

    pub fn wait(&mut self, ns: i64) {
        self.now += ns;
    }

    pub fn row(&mut self, event: &str, event_type: &str, ptr: Option<u64>, attr: Attr) {
        let ts = self.tick();
        self.db.row(event, event_type, ts, self.pid, ptr, attr);
    }

    pub fn start(&mut self) {
        self.row("OP_LAUNCH", "ATEN_START", None, Attr::new());
    }

    pub fn end(&mut self) {
        self.row("OP_LAUNCH", "ATEN_END", None, Attr::new());
    }

    /// An aten op doing `acts`.
    pub fn op(&mut self, acts: &[Act]) {
        self.start();
        self.acts(acts);
        self.end();
    }

    pub fn acts(&mut self, acts: &[Act]) {
        for act in acts {
            match *act {
                Act::Malloc(p, s) => self.malloc(p, s),
                Act::Read(p) => self.access("READ", p),
                Act::Write(p) => self.access("WRITE", p),
                Act::Free(p) => self.free(p),
                Act::Wait(ns) => self.wait(ns),
            }
        }
    }

    /// A block of torch_npu's caching pool.
    pub fn malloc(&mut self, ptr: u64, size: u64) {
        self.malloc_as("PTA", Some("caching"), ptr, size);
    }

    pub fn malloc_as(&mut self, event_type: &'static str, pool: Option<&'static str>, ptr: u64, size: u64) {
        let owner = if event_type == "HAL" { "CANN@APP" } else { "PTA@test" };
        let attr = Attr::new()
            .addr("addr", ptr)
            .with("size", size)
            .with("allocation_id", self.next_alloc)
            .with_opt("pool", pool)
            .with("owner", owner);
        self.next_alloc += 1;
        self.live.insert((self.pid, ptr), (event_type, pool));
        self.row("MALLOC", event_type, Some(ptr), attr);
    }

    pub fn free(&mut self, ptr: u64) {
        let (event_type, pool) = self.live.remove(&(self.pid, ptr)).expect("free of a live block");
        let attr = Attr::new().addr("addr", ptr).with("size", 1u64).with_opt("pool", pool);
        self.row("FREE", event_type, Some(ptr), attr);
    }

    /// A FREE row the tracer writes for memory from before the trace.
    pub fn free_unmatched(&mut self, ptr: u64) {
        let attr = Attr::new().addr("addr", ptr).with("size", 0u64).with("pool", "caching").with("unmatched", "true");
        self.row("FREE", "PTA", Some(ptr), attr);
    }

    pub fn access(&mut self, kind: &str, addr: u64) {
        let attr = Attr::new().addr("addr", addr).with("size", 4u64).with("type", "PTA");
        self.row("ACCESS", kind, Some(addr), attr);
    }

    /// STOP_TRACE, then a shadow FREE for every block still live, as `trace` writes them.
    pub fn finish(mut self) -> PathBuf {
        let stop = self.tick();
        self.db.system("STOP_TRACE", stop);
        let mut live: Vec<_> = self.live.drain().collect();
        live.sort_by_key(|(k, _)| *k);
        for ((pid, ptr), (event_type, _)) in live {
            self.pid = pid;
            let attr = Attr::new().addr("addr", ptr).with("size", 1u64).with("shadow", "true");
            self.db.row("FREE", event_type, stop + 1, pid, Some(ptr), attr);
        }
        self.db.conn().execute_batch("COMMIT").unwrap();
        self.db.path.clone()
    }
}

pub const A: u64 = 0x1000;
pub const B: u64 = 0x2000;
pub const C: u64 = 0x3000;

/// B (1 MiB) early: C is freed between its allocation and first use; 5 us then pass and
/// two APIs until its last use (long idle at 1 us, temporarily idle at 1 API). A and C are
/// used in consecutive APIs and freed in the API of their last use: never flagged.
pub fn small_trace(name: &str) -> PathBuf {
    let mut t = Trace::new(name);
    t.op(&[Act::Malloc(A, 64), Act::Write(A), Act::Malloc(C, 32), Act::Write(C)]);
    t.op(&[Act::Malloc(B, 1 << 20), Act::Read(A)]);
    t.op(&[Act::Read(C), Act::Free(C)]);
    t.op(&[Act::Write(B), Act::Read(A), Act::Free(A)]);
    t.wait(5_000);
    t.op(&[]);
    t.op(&[Act::Read(B), Act::Free(B)]);
    t.finish()
}
