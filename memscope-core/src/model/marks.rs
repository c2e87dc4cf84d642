//! What markers do to the live state: tag spans open and close, address tags re-own a block,
//! steps and ranges become rows, and `collect` pauses or resumes reporting.
//!
//! Markers come from two sources with the same meaning: the markers package's USDT probes and
//! mstx calls. Their range ids are separate namespaces (each counts on its own), hence the
//! source in the range key. A range is a user-level tag span on the thread that opened it and
//! is closed by id (possibly from another thread); a range named `step start` is a step marker
//! instead, as msMemScope reads it.
//!
//! Operators (markers `trace_ops()`) are the other use of markers: `OP_LAUNCH` rows for each start
//! and end, and an `ACCESS` row for each tensor an operator reads or writes, resolved to the live
//! block that holds the tensor's address with the same lookup as copies and kernel arguments, so
//! the inefficient-memory analyses count a block's uses on one footing whatever reported them. The
//! open operators are kept per thread so an access row can name its operator, as msMemScope's do;
//! the stack is kept while collection is paused (only rows are withheld), so an operator that
//! spans a `start()` still names the accesses after it.

use std::sync::Arc;

use super::event::{level, Event, Marker};
use super::output::{AccessKind, MstxKind, Output, OwnerBy};
use super::tags::{self, BlockLabels, Labels};
use super::tracker::Tracker;
use crate::apis::Api;
use crate::vocab::EventType;

/// msMemScope's step range message.
pub const STEP_RANGE: &str = "step start";

impl Tracker {
    /// Applies one marker of `event`'s thread; `api` is the mstx call it came from, if any.
    pub(super) fn apply_marker(&mut self, event: &Event, marker: &Marker, api: Option<Api>, out: &mut Vec<Output>) {
        let (pid, tid, wall_ns) = (event.pid, event.tid, event.wall_ns);
        let mstx = api.is_some();
        match marker {
            Marker::TagPush { level, label } => self.tags.push(pid, tid, *level, label),
            Marker::TagPop { level, label } => {
                self.tags.pop(pid, tid, *level, label);
            }
            Marker::AddrTag { addr, level, label } => self.retag(pid, *addr, *level, label, out),
            Marker::Step { number } => self.step(wall_ns, pid, tid, *number, out),
            Marker::Mark { message } => {
                let (kind, id, message) = (MstxKind::Mark, None, message.clone());
                out.push(Output::Mstx { wall_ns, pid, tid, api, kind, id, message });
            }
            Marker::RangeStart { id, message } => {
                if message == STEP_RANGE {
                    self.step(wall_ns, pid, tid, None, out);
                } else {
                    self.tags.push(pid, tid, level::USER_DEFINED_1, message);
                    self.ranges.insert((pid, mstx, *id), (tid, message.clone()));
                }
                let (kind, id, message) = (MstxKind::RangeStart, Some(*id), message.clone());
                out.push(Output::Mstx { wall_ns, pid, tid, api, kind, id, message });
            }
            Marker::RangeEnd { id } => {
                if let Some((opener, label)) = self.ranges.remove(&(pid, mstx, *id)) {
                    self.tags.pop(pid, opener, level::USER_DEFINED_1, &label);
                }
                let (kind, id, message) = (MstxKind::RangeEnd, Some(*id), String::new());
                out.push(Output::Mstx { wall_ns, pid, tid, api, kind, id, message });
            }
            Marker::Collect { on } => {
                self.collect.insert(pid, *on);
            }
            Marker::OpStart { name } => {
                self.ops.entry((pid, tid)).or_default().push(name.clone());
                if !self.is_paused(pid) {
                    out.push(Output::OpLaunch { wall_ns, pid, tid, start: true, name: name.clone() });
                }
            }
            Marker::OpEnd { name } => {
                self.close_op(pid, tid, name);
                if !self.is_paused(pid) {
                    out.push(Output::OpLaunch { wall_ns, pid, tid, start: false, name: name.clone() });
                }
            }
            Marker::TensorAccess { ptr, size, write, desc } => {
                if *ptr == 0 || self.is_paused(pid) {
                    return;
                }
                let Some(hit) = self.block_at(pid, *ptr) else { return };
                out.push(Output::OpAccess {
                    wall_ns,
                    pid,
                    tid,
                    device: hit.device,
                    block_type: hit.block_type,
                    block: hit.block,
                    allocation_id: hit.allocation_id,
                    pool: hit.pool,
                    addr: *ptr,
                    size: *size,
                    kind: if *write { AccessKind::Write } else { AccessKind::Read },
                    op: self.ops.get(&(pid, tid)).and_then(|stack| stack.last()).cloned(),
                    desc: desc.clone(),
                });
            }
        }
    }

    /// Closes the innermost open operator of that name on the thread (and any left open inside
    /// it, whose end was lost); an end with no matching start changes nothing.
    fn close_op(&mut self, pid: u32, tid: u32, name: &str) {
        let Some(stack) = self.ops.get_mut(&(pid, tid)) else { return };
        if let Some(i) = stack.iter().rposition(|n| n == name) {
            stack.truncate(i);
        }
        if stack.is_empty() {
            self.ops.remove(&(pid, tid));
        }
    }

    fn step(&mut self, wall_ns: u64, pid: u32, tid: u32, number: Option<u64>, out: &mut Vec<Output>) {
        self.inference.marked_step(pid);
        let last = self.steps.entry(pid).or_default();
        *last = number.unwrap_or(*last + 1);
        out.push(Output::Step { wall_ns, pid, tid, number: *last, inferred: false });
    }

    /// Gives the block that holds `addr` the tag's label at its level. A pool block wins over
    /// the device block it lies in (msMemScope tags pool blocks only; we also tag device and host
    /// blocks when no pool block holds the address, which is what CPU tensors need). The exact
    /// start is the common case (a tensor's storage is its block); otherwise the block whose
    /// range holds the address.
    fn retag(&mut self, pid: u32, addr: u64, level: u8, label: &str, out: &mut Vec<Output>) {
        let Some(slot) = tags::tag_level(level) else { return };

        if let Some(key) = self.pools.holding(pid, addr) {
            let block = self.pools.block_mut(&key).expect("found above");
            let inferred = self.inference.is_inferred(&block.labels);
            let Some(labels) = relabelled(&block.labels, inferred, slot, label) else { return };
            block.labels = Some(labels);
            if !block.hidden {
                let owner = tags::owner_path(block.pool.owner(), tags::of(&block.labels));
                let (device, event_type, by) = (block.device, EventType::Pta, OwnerBy::Marker);
                out.push(Output::Retag { device, pid, event_type, ptr: key.1, owner, by });
            }
            return;
        }

        let Some(key) = self.blocks.holding(pid, addr) else { return };
        let block = self.blocks.get_mut(&key).expect("found above");
        let inferred = self.inference.is_inferred(&block.labels);
        let Some(labels) = relabelled(&block.labels, inferred, slot, label) else { return };
        block.labels = Some(labels);
        if !block.hidden {
            let owner = block.base.owner(tags::of(&block.labels));
            let (device, event_type, by) = (block.device, key.1.event_type(), OwnerBy::Marker);
            out.push(Output::Retag { device, pid, event_type, ptr: key.2, owner, by });
        }
    }
}

/// A block's labels with `label` at `slot`, as its own copy (the old one may be shared with
/// other blocks); `None` when the block already has that label there. Labels the rules inferred
/// give way to the marker's whole: markers win, and the two do not mix in one path.
fn relabelled(labels: &BlockLabels, inferred: bool, slot: usize, label: &str) -> Option<Arc<Labels>> {
    let labels = if inferred { tags::of(&None) } else { tags::of(labels) };
    if labels[slot].as_deref() == Some(label) && !inferred {
        return None;
    }
    let mut changed = labels.clone();
    changed[slot] = Some(Arc::from(label));
    Some(Arc::new(changed))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Call, DeviceKey, EventKind, Op, Pool, Space};

    fn at(tid: u32, wall_ns: u64, kind: EventKind) -> Event {
        Event { wall_ns, pid: 100, tid, kind }
    }

    fn marker(tid: u32, m: Marker) -> Event {
        at(tid, 1, EventKind::Marker(m))
    }

    fn call(tid: u32, api: Api, op: Op) -> Event {
        let call = Call {
            api,
            entry_wall_ns: 0,
            status: 0,
            out_of_memory: false,
            outer: None,
            thread_device: Some(0),
            op,
            stack: crate::stacks::NO_STACK,
            py_stack: crate::stacks::NO_STACK,
            sample_weight: None,
            window_only: false,
            caller: None,
        };
        at(tid, 2, EventKind::Call(call))
    }

    fn pool_malloc(tid: u32, ptr: u64, size: u64) -> Event {
        call(tid, Api::DeviceCachingAllocatorMalloc, crate::model::testing::pool_malloc_op(ptr, size))
    }

    fn cpu_malloc(tid: u32, ptr: u64, size: u64) -> Event {
        let op = Op::Malloc {
            space: Space::Cpu,
            size,
            ptr: Some(ptr),
            policy: None,
            device: None,
            module: None,
            driver: None,
        };
        call(tid, Api::C10AllocCpu, op)
    }

    fn push(tid: u32, level: u8, label: &str) -> Event {
        marker(tid, Marker::TagPush { level, label: label.into() })
    }

    fn run(tracker: &mut Tracker, events: &[Event]) -> Vec<Output> {
        let mut out = Vec::new();
        for e in events {
            tracker.apply(e.clone(), &mut out);
        }
        out
    }

    fn owners(out: &[Output]) -> Vec<String> {
        out.iter()
            .filter_map(|o| match o {
                Output::PoolMalloc { owner, .. } => Some(owner.to_string()),
                Output::Malloc { owner, .. } => owner.as_deref().map(str::to_owned),
                Output::Retag { owner, .. } => Some(format!("retag:{owner}")),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn spans_are_per_thread_and_address_tags_win() {
        let mut t = Tracker::new();
        let out = run(
            &mut t,
            &[
                push(1, level::COMPONENT, "vllm"),
                push(1, level::DETAIL_1, "model_weight"),
                pool_malloc(1, 0x1000, 64),
                pool_malloc(2, 0x2000, 64),
                marker(1, Marker::TagPop { level: level::DETAIL_1, label: "model_weight".into() }),
                pool_malloc(1, 0x3000, 64),
                marker(2, Marker::AddrTag { addr: 0x2010, level: level::DETAIL_1, label: "kv_cache".into() }),
                marker(2, Marker::AddrTag { addr: 0x2010, level: level::DETAIL_1, label: "kv_cache".into() }),
                marker(2, Marker::AddrTag { addr: 0x9999, level: level::DETAIL_1, label: "nothing".into() }),
            ],
        );
        assert_eq!(
            owners(&out),
            ["PTA@vllm@model_weight", "PTA", "PTA@vllm", "retag:PTA@kv_cache"],
            "thread 2 has no spans; the tag inside a block re-owns it once; no block, no retag"
        );
    }

    #[test]
    fn blocks_born_under_the_same_spans_share_labels_and_a_retag_changes_only_its_block() {
        let mut t = Tracker::new();
        let out = run(
            &mut t,
            &[
                push(1, level::COMPONENT, "vllm"),
                pool_malloc(1, 0x1000, 64),
                pool_malloc(1, 0x2000, 64),
                cpu_malloc(1, 0x9000, 32),
                marker(1, Marker::AddrTag { addr: 0x1000, level: level::DETAIL_1, label: "kv_cache".into() }),
                marker(1, Marker::AddrTag { addr: 0x9000, level: level::DETAIL_1, label: "weight".into() }),
                pool_malloc(1, 0x3000, 64),
            ],
        );
        assert_eq!(
            owners(&out),
            ["PTA@vllm", "PTA@vllm", "HOST@vllm", "retag:PTA@vllm@kv_cache", "retag:HOST@vllm@weight", "PTA@vllm"]
        );
        let labels = |ptr| t.pools.table()[&(100, ptr)].labels.clone().expect("labelled");
        assert!(Arc::ptr_eq(&labels(0x2000), &labels(0x3000)), "one copy for the blocks of one span");
        assert!(!Arc::ptr_eq(&labels(0x1000), &labels(0x2000)), "the retagged block has its own");
        // The other blocks kept their owner: tagging them with the same label again re-owns them.
        let out = run(
            &mut t,
            &[marker(1, Marker::AddrTag { addr: 0x2000, level: level::DETAIL_1, label: "kv_cache".into() })],
        );
        assert_eq!(owners(&out), ["retag:PTA@vllm@kv_cache"]);
        let out = run(
            &mut t,
            &[marker(1, Marker::AddrTag { addr: 0x1000, level: level::DETAIL_1, label: "kv_cache".into() })],
        );
        assert!(out.is_empty(), "already its label: {out:?}");
    }

    #[test]
    fn cpu_blocks_are_host_owned_and_tagged_by_address() {
        let mut t = Tracker::new();
        let out = run(
            &mut t,
            &[
                cpu_malloc(1, 0x5000, 32),
                marker(1, Marker::AddrTag { addr: 0x5000, level: level::DETAIL_1, label: "weight".into() }),
            ],
        );
        assert_eq!(owners(&out), ["HOST", "retag:HOST@weight"]);
        assert!(matches!(out[1], Output::Retag { event_type: EventType::Host, ptr: 0x5000, .. }));
        let out = run(
            &mut t,
            &[
                cpu_malloc(1, 0x9000, 32),
                marker(1, Marker::AddrTag { addr: 0x9000 + 31, level: level::DETAIL_1, label: "grad".into() }),
                marker(1, Marker::AddrTag { addr: 0x9000 + 32, level: level::DETAIL_1, label: "past".into() }),
            ],
        );
        assert_eq!(owners(&out), ["HOST", "retag:HOST@grad"], "inside the block, not one past its end");
    }

    #[test]
    fn ranges_are_spans_closed_by_id_and_step_start_counts_steps() {
        let mut t = Tracker::new();
        let out = run(
            &mut t,
            &[
                marker(1, Marker::RangeStart { id: 7, message: "prefill".into() }),
                pool_malloc(1, 0x1000, 8),
                marker(2, Marker::RangeEnd { id: 7 }),
                pool_malloc(1, 0x2000, 8),
                marker(1, Marker::RangeStart { id: 8, message: STEP_RANGE.into() }),
                marker(1, Marker::Step { number: None }),
                marker(1, Marker::Step { number: Some(10) }),
            ],
        );
        assert_eq!(owners(&out), ["PTA@prefill", "PTA"]);
        let steps: Vec<u64> =
            out.iter().filter_map(|o| if let Output::Step { number, .. } = o { Some(*number) } else { None }).collect();
        assert_eq!(steps, [1, 2, 10]);
        assert!(out.iter().any(|o| matches!(o, Output::Mstx { kind: MstxKind::RangeEnd, id: Some(7), .. })));
    }

    #[test]
    fn blocks_born_while_paused_are_never_reported() {
        let mut t = Tracker::new();
        let free = |ptr| {
            call(
                1,
                Api::DeviceCachingAllocatorFree,
                Op::PoolFree { pool: Pool::Caching, ptr: Some(ptr), handle: None, size: None, device: Some(0) },
            )
        };
        let out = run(
            &mut t,
            &[
                pool_malloc(1, 0x1000, 8),
                marker(1, Marker::Collect { on: false }),
                pool_malloc(1, 0x2000, 8),
                free(0x1000),
                free(0x2000),
                marker(1, Marker::Collect { on: true }),
                pool_malloc(1, 0x3000, 8),
            ],
        );
        let reported: Vec<(bool, u64)> = out
            .iter()
            .filter_map(|o| match o {
                Output::PoolMalloc { ptr, .. } => Some((true, *ptr)),
                Output::PoolFree { ptr, .. } => Some((false, *ptr)),
                _ => None,
            })
            .collect();
        assert_eq!(reported, [(true, 0x1000), (false, 0x1000), (true, 0x3000)]);
        let stats = t.pools().next().unwrap().1;
        assert_eq!(stats.used, 8, "the counters still follow the allocator while paused");
    }

    fn op(tid: u32, start: bool, name: &str) -> Event {
        let name = name.to_owned();
        marker(tid, if start { Marker::OpStart { name } } else { Marker::OpEnd { name } })
    }

    fn tensor(tid: u32, ptr: u64, write: bool) -> Event {
        marker(tid, Marker::TensorAccess { ptr, size: 16, write, desc: Some("float32[2,2]".into()) })
    }

    /// (op row or access) as text: `start:aten.mm`, `R:aten.mm@0x5000+16`.
    fn op_rows(out: &[Output]) -> Vec<String> {
        out.iter()
            .filter_map(|o| match o {
                Output::OpLaunch { start, name, .. } => {
                    Some(format!("{}:{name}", if *start { "start" } else { "end" }))
                }
                Output::OpAccess { kind, op, block, addr, .. } => Some(format!(
                    "{}:{}@{block:#x}+{}",
                    if *kind == AccessKind::Write { "W" } else { "R" },
                    op.as_deref().unwrap_or("-"),
                    addr - block
                )),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn operators_become_launch_rows_and_tensor_uses_accesses_of_live_blocks() {
        let mut t = Tracker::new();
        let out = run(
            &mut t,
            &[
                cpu_malloc(1, 0x5000, 64),
                pool_malloc(1, 0x9000, 32),
                op(1, true, "aten.mm.default"),
                tensor(1, 0x5000, false),
                tensor(1, 0x5010, false),
                tensor(2, 0x9008, true),
                tensor(1, 0x7000, false),
                tensor(1, 0, false),
                tensor(1, 0x9000, true),
                op(1, false, "aten.mm.default"),
                tensor(1, 0x5000, true),
            ],
        );
        assert_eq!(
            op_rows(&out),
            [
                "start:aten.mm.default",
                "R:aten.mm.default@0x5000+0",
                "R:aten.mm.default@0x5000+16",
                "W:-@0x9000+8",
                "W:aten.mm.default@0x9000+0",
                "end:aten.mm.default",
                "W:-@0x5000+0",
            ],
            "the block holding each address, named by the thread's open operator; no block, no row"
        );
        let host = out.iter().find(|o| matches!(o, Output::OpAccess { .. })).unwrap();
        let Output::OpAccess { block_type, pool, device, allocation_id, size, desc, .. } = host else { unreachable!() };
        assert_eq!(
            (*block_type, *pool, *device, *allocation_id, *size),
            (EventType::Host, None, DeviceKey::Cpu, 1, 16)
        );
        assert_eq!(desc.as_deref(), Some("float32[2,2]"));
        let pta = out.iter().filter(|o| matches!(o, Output::OpAccess { block_type: EventType::Pta, .. })).count();
        assert_eq!(pta, 2, "a pool block wins over the device block around it");
        assert!(t.ops.is_empty(), "balanced operators leave no stack behind");
    }

    #[test]
    fn operator_stacks_are_per_thread_survive_a_pause_and_close_by_name() {
        let mut t = Tracker::new();
        let out = run(
            &mut t,
            &[
                cpu_malloc(1, 0x5000, 64),
                op(1, true, "outer"),
                op(1, true, "inner"),
                op(2, true, "other"),
                marker(1, Marker::Collect { on: false }),
                op(1, true, "hidden"),
                tensor(1, 0x5000, false),
                marker(1, Marker::Collect { on: true }),
                tensor(1, 0x5000, false),
                op(1, false, "hidden"),
                op(1, false, "never-started"),
                op(1, false, "outer"),
                tensor(1, 0x5000, true),
                tensor(2, 0x5000, true),
            ],
        );
        assert_eq!(
            op_rows(&out),
            [
                "start:outer",
                "start:inner",
                "start:other",
                "R:hidden@0x5000+0",
                "end:hidden",
                "end:never-started",
                "end:outer",
                "W:-@0x5000+0",
                "W:other@0x5000+0",
            ],
            "nothing while paused; closing `outer` also closes the `inner` whose end was lost"
        );
        run(&mut t, &[at(2, 3, EventKind::Exit)]);
        assert!(t.ops.is_empty(), "an exited process leaves no open operators");
    }

    #[test]
    fn waiting_for_start_reports_only_after_the_programs_start() {
        let mut t = Tracker::paused_until_start();
        let out = run(
            &mut t,
            &[pool_malloc(1, 0x1000, 8), marker(1, Marker::Collect { on: true }), pool_malloc(1, 0x2000, 8)],
        );
        let reported: Vec<u64> =
            out.iter().filter_map(|o| if let Output::PoolMalloc { ptr, .. } = o { Some(*ptr) } else { None }).collect();
        assert_eq!(reported, [0x2000]);
    }
}
