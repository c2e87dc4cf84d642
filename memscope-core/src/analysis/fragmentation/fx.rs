use std::path::PathBuf;

use rusqlite::params;
use serde_json::json;

use crate::analysis::testdb::{dir, TestDb};

pub const START: i64 = 1_000_000_000_000;

pub struct Fx {
    db: TestDb,
    id: i64,
    /// The next row's timestamp; each row advances it by 1 µs.
    pub ts: i64,
}

impl Fx {
    pub fn new(name: &str) -> Self {
        let db = TestDb::create(&dir(name).join("memscope_dump_1.db"));
        let mut fx = Self { db, id: 1, ts: START };
        fx.row("SYSTEM", "START_TRACE", "START_TRACE", 1, 1, None, json!({"tool": "memscope-bpf"}));
        fx
    }

    #[expect(clippy::too_many_arguments, reason = "one row's columns")]
    pub fn row(
        &mut self,
        event: &str,
        ty: &str,
        name: &str,
        pid: i64,
        tid: i64,
        ptr: Option<u64>,
        attr: serde_json::Value,
    ) {
        let ptr = ptr.map_or_else(|| "N/A".to_owned(), |p| format!("0x{p:016x}"));
        self.db
            .conn()
            .execute(
                "INSERT INTO memscope_dump VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, '0', ?8, ?9, '', '')",
                params![self.id, event, ty, name, self.ts, pid, tid, ptr, attr.to_string()],
            )
            .unwrap();
        self.id += 1;
        self.ts += 1000;
    }

    /// A caching-pool segment (`aclrtMallocAlign32`, or a mapped expandable page).
    pub fn segment(&mut self, pid: i64, ptr: u64, size: u64, vmm: bool) {
        let mut attr = json!({"addr": format!("0x{ptr:x}"), "size": size.to_string(), "owner": "CANN@APP",
                              "segment": "caching"});
        if vmm {
            attr["vmm"] = json!("true");
        }
        self.row("MALLOC", "HAL", if vmm { "aclrtMapMem" } else { "aclrtMallocAlign32" }, pid, pid, Some(ptr), attr);
    }

    pub fn hal(&mut self, pid: i64, ptr: u64, size: u64, owner: &str) {
        let attr = json!({"size": size.to_string(), "owner": owner});
        self.row("MALLOC", "HAL", "aclrtMalloc", pid, pid, Some(ptr), attr);
    }

    pub fn hal_free(&mut self, pid: i64, ptr: u64, size: u64) {
        self.row("FREE", "HAL", "aclrtFree", pid, pid, Some(ptr), json!({"size": size.to_string()}));
    }

    pub fn block(&mut self, pid: i64, ptr: u64, size: u64, owner: &str) {
        let attr = json!({"size": size.to_string(), "pool": "caching", "owner": owner});
        self.row("MALLOC", "PTA", "DeviceCachingAllocator::malloc", pid, pid, Some(ptr), attr);
    }

    pub fn free(&mut self, pid: i64, ptr: u64, size: u64) {
        let attr = json!({"size": size.to_string(), "pool": "caching"});
        self.row("FREE", "PTA", "DeviceCachingAllocator::free", pid, pid, Some(ptr), attr);
    }

    /// An OOM_TRIGGER row, named as the tracer names the failing function.
    pub fn oom(&mut self, pid: i64, name: &str, req: u64) {
        let attr = json!({"func": name, "req_size": req.to_string(), "status": "207001"});
        self.row("OOM_DETAIL", "OOM_TRIGGER", name, pid, pid, None, attr);
    }

    /// An OOM_TRIGGER row of a runtime refusal made while the caching pool was taking a
    /// segment (PyTorch's CUDA allocator: `cudaMalloc` inside its `alloc_block`).
    pub fn pool_refusal(&mut self, pid: i64, name: &str, req: u64) {
        let attr = json!({"func": name, "req_size": req.to_string(), "status": "2", "segment": "caching"});
        self.row("OOM_DETAIL", "OOM_TRIGGER", name, pid, pid, None, attr);
    }

    pub fn step(&mut self, n: i64) {
        self.row("SYSTEM", "STEP", &n.to_string(), 1, 1, None, json!({}));
    }

    /// An ATB operation's ATB_START and ATB_END rows, as the tracer writes them.
    pub fn atb(&mut self, pid: i64, runner: u64, workspace: u64, intermediate: u64) {
        let attr = json!({"workspace_ptr": "0x0000000000009000", "workspace_size": workspace.to_string(),
                          "intermediate_size": intermediate.to_string(), "runner": format!("0x{runner:016x}")});
        for ty in ["ATB_START", "ATB_END"] {
            self.row("OP_LAUNCH", ty, "atb::Runner::Execute", pid, pid, None, attr.clone());
        }
    }

    pub fn meta(&mut self, key: &str, value: &str) {
        self.db.conn().execute("INSERT INTO ms_meta VALUES (?1, ?2)", params![key, value]).unwrap();
    }

    pub fn path(&self) -> PathBuf {
        self.db.path.clone()
    }

    /// STOP_TRACE, and the file's path.
    pub fn stop(mut self) -> PathBuf {
        self.row("SYSTEM", "STOP_TRACE", "STOP_TRACE", 1, 1, None, json!({}));
        self.db.path.clone()
    }
}
