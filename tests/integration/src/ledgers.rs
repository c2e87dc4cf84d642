//! The workloads' own ground truth: the ledgers the stand-in workload (every call it made), the
//! stand-in driver (`STANDIN_HAL_LEDGER`) and the stand-in torch_npu allocator
//! (`STANDIN_TORCH_LEDGER`) write independently of the tracer, where they are and how to read them.

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// One call the workload made, as it logged it.
#[derive(Clone, Debug, Deserialize)]
pub struct Entry {
    pub api: String,
    pub rc: i64,
    pub tid: u32,
    pub t0: u64,
    pub t1: u64,
    #[serde(default)]
    pub device: Option<serde_json::Value>,
    #[serde(default)]
    pub size: Option<u64>,
    #[serde(default)]
    pub ptr: Option<u64>,
    #[serde(default)]
    pub handle: Option<u64>,
    #[serde(default)]
    pub via: Option<String>,
    #[serde(default)]
    pub lib: Option<String>,
    #[serde(default)]
    pub flag: Option<u64>,
}
impl Entry {
    /// The device as the DB's `Device Id` column writes it.
    pub fn device_id(&self) -> Option<String> {
        match &self.device {
            Some(serde_json::Value::Number(n)) => Some(n.to_string()),
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            _ => None,
        }
    }
}
pub fn read_ledger(path: &Path) -> Vec<Entry> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("ledger {}: {e}", path.display()));
    text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad ledger line {l}: {e}"))).collect()
}
/// Where the stand-in driver logs, next to a workload ledger.
pub fn driver_ledger_path(ledger: &Path) -> PathBuf {
    ledger.with_extension("driver.jsonl")
}
/// One call the stand-in driver logged (STANDIN_HAL_LEDGER): its own truth, below the runtime.
#[derive(Clone, Debug, Deserialize)]
pub struct DriverEntry {
    pub api: String,
    pub tid: u32,
    pub t0: u64,
    pub t1: u64,
    pub size: u64,
    pub flag: u64,
    pub ptr: u64,
    pub rc: i64,
    pub device: i64,
}
pub fn read_driver_ledger(path: &Path) -> Vec<DriverEntry> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("driver ledger {}: {e}", path.display()));
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad driver ledger line {l}: {e}")))
        .collect()
}
/// One event the stand-in torch_npu allocator logged (STANDIN_TORCH_LEDGER), with its own
/// allocated/reserved counters right after it.
#[derive(Clone, Debug, Deserialize)]
pub struct PoolEntry {
    pub ev: String,
    #[serde(default)]
    pub pool: Option<String>,
    pub tid: u32,
    #[serde(default)]
    pub t0: Option<u64>,
    #[serde(default)]
    pub t1: Option<u64>,
    #[serde(default)]
    pub t: Option<u64>,
    pub device: i64,
    #[serde(default)]
    pub size: Option<u64>,
    #[serde(default)]
    pub ptr: u64,
    /// The allocator's counters at the event, taken under its lock.
    pub allocated: u64,
    pub reserved: u64,
    /// The same counters read after the call returned (block events only).
    #[serde(default)]
    pub allocated_after: Option<u64>,
    #[serde(default)]
    pub reserved_after: Option<u64>,
}
impl PoolEntry {
    /// The (allocated, reserved) pairs a row may carry for this event. A probe fires at the
    /// call's return, after the allocator let go of its lock, so another thread's change in
    /// between (an empty_cache, a segment of its own) can be in the row, as it is in the
    /// counters read after the return. Without contention both pairs are equal.
    pub fn counter_pairs(&self) -> Vec<(u64, u64)> {
        let mut pairs = vec![(self.allocated, self.reserved)];
        if let (Some(a), Some(r)) = (self.allocated_after, self.reserved_after) {
            pairs.push((a, r));
        }
        pairs
    }
}
pub fn read_pool_ledger(path: &Path) -> Vec<PoolEntry> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("allocator ledger {}: {e}", path.display()));
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad allocator ledger line {l}: {e}")))
        .collect()
}
/// Where the stand-in allocator logs, next to a workload ledger.
pub fn pool_ledger_path(ledger: &Path) -> PathBuf {
    ledger.with_extension("torch.jsonl")
}

/// A line of tests/workloads/standin_leaky.py's ledger: a tensor, a free, a device buffer or a
/// step, with the owner, the step it was made in and whether it leaks on purpose.
#[derive(Debug, Deserialize)]
pub struct LoopLine {
    pub kind: String,
    #[serde(default)]
    pub ptr: u64,
    #[serde(default)]
    pub owner: String,
    #[serde(default)]
    pub step: u64,
    #[serde(default)]
    pub leak: bool,
    #[serde(default)]
    pub t0: u64,
    #[serde(default)]
    pub t1: u64,
}

pub fn read_loop_ledger(path: &Path) -> Vec<LoopLine> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("ledger {}: {e}", path.display()));
    text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad ledger line {l}: {e}"))).collect()
}

/// The allocator's block size for `line`'s tensor: its block made while the workload's call ran.
pub fn loop_block_size(pool: &[PoolEntry], line: &LoopLine) -> u64 {
    pool.iter()
        .find(|e| e.ev == "block_malloc" && e.ptr == line.ptr && e.t0 >= Some(line.t0) && e.t1 <= Some(line.t1))
        .and_then(|e| e.size)
        .unwrap_or_else(|| panic!("no allocator block for {line:?}"))
}
