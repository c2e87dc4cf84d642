//! The rules that join markers and inference (`tags`, `inferred`) for every kind of block: the
//! labels a new block takes (markers win), what its rows say of them, the owner a block that
//! did not outlive its phase takes at its free, and the steps found from the frames.

use super::output::{BlockFrom, Output, OwnerBy, Site};
use super::tags::BlockLabels;
use super::tracker::Tracker;
use crate::infer::Reader;
use crate::stacks::NO_STACK;

/// What a new block takes: its labels, and what its row says of them.
pub(super) struct NewOwner {
    pub(super) labels: BlockLabels,
    pub(super) from: BlockFrom,
}

impl Tracker {
    /// The rules (built-in, the user's `--owner-rules`) and how steps are found.
    pub fn set_owner_rules(&mut self, reader: Reader) {
        self.inference.set_reader(reader);
    }

    /// A new Python stack: read once, for every block born under it.
    pub fn learn_py_stack(&mut self, id: crate::stacks::StackId, text: &str) {
        self.inference.learn(id, text);
    }

    /// The labels of a block `site` allocates: the thread's marker spans when any is open, else
    /// the rules' reading of its Python stack.
    pub(super) fn new_owner(&mut self, site: Site) -> NewOwner {
        let (inferred, code_site, main_thread) = self.inference.born(site.py_stack);
        let (labels, owner_by) = match (self.tags.block_labels(site.pid, site.tid), inferred) {
            (Some(labels), _) => (Some(labels), OwnerBy::Marker),
            (None, Some(labels)) => (Some(labels), OwnerBy::Inferred),
            (None, None) => (None, OwnerBy::Allocator),
        };
        NewOwner { labels, from: BlockFrom { owner_by, site: code_site, main_thread } }
    }

    /// An allocation with a Python stack moves its process's phase on, and may start a step.
    /// The boundary is found where the step *starts*, so its row is numbered as the step it
    /// ends, as `msmemscope.step()` numbers its own: the first ends step 0, the set-up.
    pub(super) fn observe_allocation(&mut self, site: Site, out: &mut Vec<Output>) {
        if site.py_stack == NO_STACK || !self.inference.observe(site.pid, site.py_stack, site.wall_ns) {
            return;
        }
        let paused = self.is_paused(site.pid);
        let started = self.steps.entry(site.pid).or_default();
        let ended = *started;
        *started += 1;
        if !paused {
            let (wall_ns, pid, tid, number) = (site.wall_ns, site.pid, site.tid, ended);
            out.push(Output::Step { wall_ns, pid, tid, number, inferred: true });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apis::Api;
    use crate::model::event::{Marker, Op, Pool};
    use crate::model::testing::call;
    use crate::model::{Event, EventKind};
    use crate::stacks::StackId;

    const TORCH: &str = "/venv/lib/python3.12/site-packages/torch";

    /// The Python stacks of a training loop, by id: what each phase's allocations run under.
    fn stacks() -> Vec<(StackId, String)> {
        let job = |line: u32| format!("/job/train.py({line}): main");
        vec![
            (1, format!("{TORCH}/nn/modules/linear.py(106): Linear.__init__\n{}", job(10))),
            (2, format!("/job/train.py(30): Net.forward\n{TORCH}/nn/modules/module.py(1784): Module._call_impl\n{}", job(20))),
            (3, format!("{TORCH}/autograd/graph.py(829): _engine_run_backward\n{TORCH}/_tensor.py(647): Tensor.backward\n{}", job(21))),
            (4, format!("{TORCH}/optim/adam.py(168): Adam._init_group\n{TORCH}/optim/optimizer.py(526): Optimizer.profile_hook_step.<locals>.wrapper\n{}", job(22))),
            (5, job(23)),
        ]
    }

    fn alloc(ptr: u64, size: u64, py: StackId) -> Event {
        let op = crate::model::testing::pool_malloc_op(ptr, size);
        with_py(call(Api::DeviceCachingAllocatorMalloc, 1, Some(0), 0, op), py)
    }

    fn free(ptr: u64) -> Event {
        let op = Op::PoolFree { pool: Pool::Caching, ptr: Some(ptr), handle: None, size: None, device: Some(0) };
        call(Api::DeviceCachingAllocatorFree, 1, Some(0), 0, op)
    }

    fn with_py(mut e: Event, py: StackId) -> Event {
        if let EventKind::Call(c) = &mut e.kind {
            c.py_stack = py;
        }
        e
    }

    /// Blocks born (ptr, owner, owner_source), retags at frees (ptr, owner), steps (number, inferred).
    type Seen = (Vec<(u64, String, Option<&'static str>)>, Vec<(u64, String)>, Vec<(u64, bool)>);

    fn run(events: &[Event]) -> Seen {
        let mut t = Tracker::new();
        for (id, text) in stacks() {
            t.learn_py_stack(id, &text);
        }
        let mut out = Vec::new();
        for e in events {
            t.apply(e.clone(), &mut out);
        }
        let (mut born, mut retags, mut steps) = (Vec::new(), Vec::new(), Vec::new());
        for o in out {
            match o {
                Output::PoolMalloc { ptr, owner, from, .. } => {
                    born.push((ptr, owner.to_string(), from.owner_by.as_str()))
                }
                Output::Retag { ptr, owner, by, .. } => {
                    assert_eq!(by, OwnerBy::Inferred);
                    retags.push((ptr, owner));
                }
                Output::Step { number, inferred, .. } => steps.push((number, inferred)),
                _ => {}
            }
        }
        (born, retags, steps)
    }

    /// One step: forward (an activation kept for backward, a temporary), backward (a gradient
    /// kept, a temporary), the optimizer (state kept, a workspace), then the loop's own tensor.
    fn step(k: u64) -> Vec<Event> {
        let a = k * 0x1000;
        vec![
            alloc(a + 1, 10, 2),
            alloc(a + 2, 20, 2),
            free(a + 2),
            alloc(a + 3, 30, 3),
            free(a + 1),
            alloc(a + 4, 40, 3),
            free(a + 4),
            alloc(a + 5, 50, 4),
            alloc(a + 6, 60, 4),
            free(a + 6),
            alloc(a + 7, 70, 5),
        ]
    }

    #[test]
    fn owners_follow_the_frames_and_temporaries_are_told_apart_by_lifetime() {
        let mut events = vec![alloc(0x10, 8, 1)];
        events.extend(step(1));
        events.extend(step(2));
        let (born, retags, steps) = run(&events);
        let owner_of = |ptr: u64| born.iter().find(|b| b.0 == ptr).map(|b| b.1.as_str()).unwrap();
        assert_eq!(owner_of(0x10), "PTA@weight");
        assert_eq!(
            [0x1001, 0x1003, 0x1005, 0x1007].map(owner_of),
            ["PTA@activation", "PTA@gradient", "PTA@optimizer_state", "PTA"]
        );
        assert!(born.iter().all(|b| b.2 == if b.1 == "PTA" { None } else { Some("inferred") }), "{born:?}");
        // Freed within their phase: the temporaries; the activation freed in backward is not.
        let want = |a: u64| {
            vec![
                (a + 2, "PTA@forward_temporary".to_owned()),
                (a + 4, "PTA@backward_temporary".into()),
                (a + 6, "PTA@optimizer_workspace".into()),
            ]
        };
        assert_eq!(retags, [want(0x1000), want(0x2000)].concat());
        // A boundary at the first forward (ending the set-up, step 0), then at each forward after
        // the optimizer.
        assert_eq!(steps, [(0, true), (1, true)]);
    }

    #[test]
    fn markers_win_over_rules_and_over_inferred_steps() {
        let mut events = Vec::new();
        let marker = |m: Marker| Event { wall_ns: 1, pid: 100, tid: 1, kind: EventKind::Marker(m) };
        events.push(marker(Marker::Step { number: None }));
        events.push(marker(Marker::TagPush { level: crate::model::level::DETAIL_1, label: "kv".into() }));
        events.push(alloc(0x10, 8, 2));
        events.push(marker(Marker::TagPop { level: crate::model::level::DETAIL_1, label: "kv".into() }));
        events.extend(step(1));
        // An address tag on an inferred block replaces the inferred owner whole.
        events.push(marker(Marker::AddrTag {
            addr: 0x1003,
            level: crate::model::level::DETAIL_1,
            label: "weight".into(),
        }));
        let mut t = Tracker::new();
        for (id, text) in stacks() {
            t.learn_py_stack(id, &text);
        }
        let mut out = Vec::new();
        for e in events {
            t.apply(e, &mut out);
        }
        let born: Vec<_> = out
            .iter()
            .filter_map(|o| match o {
                Output::PoolMalloc { ptr, owner, from, .. } => Some((*ptr, owner.to_string(), from.owner_by)),
                _ => None,
            })
            .collect();
        assert_eq!(born[0], (0x10, "PTA@kv".to_owned(), OwnerBy::Marker));
        let steps = out.iter().filter(|o| matches!(o, Output::Step { .. })).count();
        assert_eq!(steps, 1, "the marker's step only");
        let retag = out.iter().rev().find_map(|o| match o {
            Output::Retag { ptr: 0x1003, owner, by, .. } => Some((owner.clone(), *by)),
            _ => None,
        });
        assert_eq!(retag, Some(("PTA@weight".to_owned(), OwnerBy::Marker)));
    }
}
