//! A training job's request stream, made up, for timing the replay (`cargo xtask bench`):
//! weights taken once and kept, then per step activations of varied sizes on the compute
//! stream, a few gradients on a second stream, most freed at the step's end, some kept a step
//! longer. Deterministic (a xorshift generator with a fixed seed), so each run replays the same.

use super::trace::{Step, Timed, Trace};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A size between 1 KiB and 32 MiB, smaller ones more likely (a tensor-size mix).
    fn size(&mut self) -> u64 {
        let shift = 10 + self.next() % 15;
        (1 << shift) + self.next() % (1 << shift)
    }
}

/// About `requests` requests (and their frees), in time order, on one process.
pub fn trace(requests: u64) -> Trace {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut t = Trace::default();
    let mut ts = 0i64;
    let mut next_ptr = 1u64 << 32;
    let mut push = |t: &mut Trace, step: Step| {
        ts += 1000;
        t.steps.push(Timed { ts, pid: 1, step, site: 0 });
    };
    let mut alloc = |t: &mut Trace, rng: &mut Rng, stream: u64| {
        next_ptr += 1 << 12;
        let (req, ptr) = (rng.size(), next_ptr);
        push(t, Step::Alloc { req, stream, ptr, rounded: false, block: 0 });
        ptr
    };
    let weights = (requests / 1000).clamp(1, 500);
    for _ in 0..weights {
        alloc(&mut t, &mut rng, 0);
    }
    let mut kept: Vec<u64> = Vec::new();
    let mut made = weights;
    while made < requests {
        let step: Vec<u64> = (0..200).map(|i| alloc(&mut t, &mut rng, u64::from(i % 10 == 0))).collect();
        made += 200;
        for ptr in kept.drain(..) {
            t.steps.push(Timed {
                ts: t.steps.last().map_or(0, |s| s.ts + 1),
                pid: 1,
                step: Step::Free { ptr },
                site: 0,
            });
        }
        for (i, ptr) in step.into_iter().enumerate() {
            if i % 7 == 0 {
                kept.push(ptr);
            } else {
                t.steps.push(Timed {
                    ts: t.steps.last().map_or(0, |s| s.ts + 1),
                    pid: 1,
                    step: Step::Free { ptr },
                    site: 0,
                });
            }
        }
    }
    t
}
