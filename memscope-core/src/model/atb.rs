//! ATB operations (`atb::Runner::Execute`) as the `OP_LAUNCH` rows msMemScope writes for them: an
//! `ATB_START` at the call's entry and an `ATB_END` at its return, both carrying the workspace the
//! operation ran with.
//!
//! The record arrives at the return, after whatever the operation's own calls reported, so the
//! start is written with the entry's time rather than in arrival order; the analyses read rows in
//! time order. An operation has no device argument: its rows go to the device of the pool block
//! that holds its workspace (the caller took it from torch_npu's workspace allocator), else to the
//! thread's device, so each device's file holds the operations whose memory is on it.

use super::event::{Call, Op};
use super::output::{Output, Site};
use super::tracker::Tracker;

impl Tracker {
    pub(super) fn atb_execute(&mut self, site: Site, call: &Call, out: &mut Vec<Output>) {
        let Op::AtbExecute { runner, workspace, workspace_size, intermediate_size } = call.op else { return };
        if self.is_paused(site.pid) {
            return;
        }
        let device = workspace
            .filter(|p| *p != 0)
            .and_then(|p| self.block_at(site.pid, p))
            .map_or_else(|| self.devices.thread_device(site, call), |hit| hit.device);
        let launch = |site, start, status| Output::AtbLaunch {
            site,
            device,
            start,
            runner,
            workspace,
            workspace_size,
            intermediate_size,
            status,
        };
        out.push(launch(Site { wall_ns: call.entry_wall_ns.min(site.wall_ns), ..site }, true, None));
        out.push(launch(site, false, Some(call.status)));
    }
}

#[cfg(test)]
mod tests {
    use crate::apis::Api;
    use crate::model::{Call, DeviceKey, Event, EventKind, Marker, Op, Output, Pool, Tracker};

    fn call(wall_ns: u64, entry: u64, device: Option<u32>, status: i32, op: Op, api: Api) -> Event {
        let call = Call {
            api,
            entry_wall_ns: entry,
            status,
            out_of_memory: false,
            outer: None,
            thread_device: device,
            op,
            stack: crate::stacks::NO_STACK,
            py_stack: crate::stacks::NO_STACK,
            sample_weight: None,
            window_only: false,
            caller: None,
        };
        Event { wall_ns, pid: 100, tid: 7, kind: EventKind::Call(call) }
    }

    fn execute(wall_ns: u64, entry: u64, device: Option<u32>, workspace: u64, status: i32) -> Event {
        let op = Op::AtbExecute {
            runner: 0xabc,
            workspace: Some(workspace),
            workspace_size: Some(1 << 20),
            intermediate_size: Some(44 << 20),
        };
        call(wall_ns, entry, device, status, op, Api::AtbRunnerExecute)
    }

    fn workspace_block(device: u32, ptr: u64, size: u64) -> Event {
        let op = Op::PoolMalloc {
            pool: Pool::Workspace,
            ptr: Some(ptr),
            size: Some(size),
            req: None,
            device: Some(device),
            handle: None,
            stream: None,
        };
        call(10, 10, Some(device), 0, op, Api::WorkspaceMalloc)
    }

    /// (start, wall_ns, device, status) of the ATB rows.
    fn launches(out: &[Output]) -> Vec<(bool, u64, DeviceKey, Option<i32>)> {
        out.iter()
            .filter_map(|o| match o {
                Output::AtbLaunch {
                    site, device, start, status, runner, workspace_size, intermediate_size, ..
                } => {
                    assert_eq!((*runner, *workspace_size, *intermediate_size), (0xabc, Some(1 << 20), Some(44 << 20)));
                    Some((*start, site.wall_ns, *device, *status))
                }
                _ => None,
            })
            .collect()
    }

    fn run(t: &mut Tracker, events: &[Event]) -> Vec<Output> {
        let mut out = Vec::new();
        for e in events {
            t.apply(e.clone(), &mut out);
        }
        out
    }

    #[test]
    fn an_execution_is_a_start_at_entry_and_an_end_at_return_on_its_workspaces_device() {
        let mut t = Tracker::new();
        // The thread says device 0, but the workspace block it runs in is on device 1.
        let out = run(&mut t, &[workspace_block(1, 0x9000, 64 << 20), execute(500, 400, Some(0), 0x9000 + 512, 0)]);
        assert_eq!(launches(&out), [(true, 400, DeviceKey::Npu(1), None), (false, 500, DeviceKey::Npu(1), Some(0))]);
    }

    #[test]
    fn without_a_known_workspace_block_the_thread_device_or_unknown_is_used() {
        let mut t = Tracker::new();
        let out = run(&mut t, &[execute(500, 400, Some(2), 0x9000, 3), execute(700, 600, None, 0x9000, 0)]);
        assert_eq!(
            launches(&out),
            [
                (true, 400, DeviceKey::Npu(2), None),
                (false, 500, DeviceKey::Npu(2), Some(3)),
                (true, 600, DeviceKey::Unknown, None),
                (false, 700, DeviceKey::Unknown, Some(0)),
            ]
        );
    }

    #[test]
    fn nothing_is_reported_while_collection_is_off() {
        let mut t = Tracker::new();
        let off = Event { wall_ns: 1, pid: 100, tid: 7, kind: EventKind::Marker(Marker::Collect { on: false }) };
        let out = run(&mut t, &[off, execute(500, 400, Some(0), 0x9000, 0)]);
        assert!(launches(&out).is_empty());
    }
}
