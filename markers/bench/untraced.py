"""Cost of memscope's markers with no tracer attached, printed as JSON.

The markers are meant to stay in production scripts, so the number that matters is the untraced
cost next to the cheapest possible Python->C call. Each case runs `--calls` times per round
(default 1M) and the best of `--rounds` rounds is kept (the minimum is the least disturbed by
other load). `ns_per_call` includes the timing loop; `loop_ns` is the empty loop, and `net_ns`
is the difference, i.e. what the marker itself costs.

Run: PYTHONPATH=<install dir> python3 markers/bench/untraced.py [--rounds 7] [--calls 1000000]

With `--wait-tracer SECONDS` it first waits for a tracer to attach (printing its pid on stderr
so one can be started), which gives the traced cost for comparison; use fewer `--calls` then.

With `--torch` (a Python with torch) it also times one small CPU operator bare and inside
`memscope.torch.trace_ops()`: the dispatch mode's own cost per operator, which dwarfs the probes'.
"""

import argparse
import json
import platform
import sys
import timeit

import memscope
from memscope import _native

SETUP = (
    "import memscope\n"
    "from memscope import _native\n"
    "step = memscope.step\n"
    "push = memscope.describe_label\n"
    "pop = memscope.undescribe\n"
    "describe = memscope.describe\n"
    "mark = memscope.mark\n"
    "range_start = memscope.range_start\n"
    "range_end = memscope.range_end\n"
    "noop = _native._noop\n"
    "op_start = _native.op_start\n"
    "op_end = _native.op_end\n"
    "access = _native.tensor_access\n"
    "t = ()\n"
)

# name -> (statement, marker calls per statement)
CASES = {
    "empty_loop": ("pass", 1),
    "baseline_len_tuple": ("len(t)", 1),
    "baseline_native_noop": ("noop()", 1),
    "step": ("step()", 1),
    "describe_label+undescribe_pair": ("push('x'); pop('x')", 1),
    "describe_label_or_undescribe_per_call": ("push('x'); pop('x')", 2),
    "with_describe_block": ("with describe('x'):\n    pass", 1),
    "describe_addr": ("describe(12345, owner='x')", 1),
    "mark": ("mark('x')", 1),
    "range_start+range_end_pair": ("range_end(range_start('x'))", 1),
    "op_start+op_end_pair": ("op_start('aten.mm.default'); op_end('aten.mm.default')", 1),
    "tensor_access": ("access(140000000000000, 128, 0, 'float32[4,8]')", 1),
}

TORCH_SETUP = (
    "import torch, memscope.torch\n"
    "torch.set_num_threads(1)\n"
    "x = torch.ones(16)\n"
    "add = torch.add\n"
)

# name -> statement; run once per round without and once with trace_ops() entered around the loop.
TORCH_CASES = {"torch_add_16_floats": "add(x, 1)"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=1_000_000)
    ap.add_argument("--wait-tracer", type=float, default=0.0, metavar="SECONDS",
                    help="wait this long for a tracer to attach before measuring")
    ap.add_argument("--cases", help="comma-separated subset of: " + ", ".join(CASES))
    ap.add_argument("--torch", action="store_true", help="also time an operator inside trace_ops() (needs torch)")
    a = ap.parse_args()
    cases = dict(CASES)
    if a.cases:
        wanted = a.cases.split(",")
        unknown = [c for c in wanted if c not in CASES]
        if unknown:
            sys.exit(f"unknown case(s) {unknown}; choose from {list(CASES)}")
        cases = {k: v for k, v in CASES.items() if k in wanted or k == "empty_loop"}

    if a.wait_tracer:
        import os
        print(f"pid {os.getpid()}: waiting up to {a.wait_tracer}s for a tracer", file=sys.stderr, flush=True)
        if not memscope.wait_for_tracer(timeout=a.wait_tracer):
            sys.exit("no tracer attached: its semaphores stayed 0")

    if _native.tracing():
        print("warning: a tracer is attached; these are traced numbers", file=sys.stderr)
    results = {}
    for name, (stmt, per) in cases.items():
        best = min(timeit.repeat(stmt, SETUP, repeat=a.rounds, number=a.calls))
        results[name] = best / a.calls / per * 1e9
    loop = results["empty_loop"]
    out = {
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "probes_compiled": bool(_native.PROBES_COMPILED),
        "tracing": _native.tracing(),
        "rounds": a.rounds,
        "calls_per_round": a.calls,
        "loop_ns": round(loop, 1),
        "ns_per_call": {k: round(v, 1) for k, v in results.items() if k != "empty_loop"},
        "net_ns": {k: round(v - loop / CASES[k][1], 1) for k, v in results.items() if k != "empty_loop"},
        "memscope_file": memscope.__file__,
    }
    if a.torch:
        calls = max(1, a.calls // 20)  # an operator costs microseconds
        per_op = {}
        for name, stmt in TORCH_CASES.items():
            bare = min(timeit.repeat(stmt, TORCH_SETUP, repeat=a.rounds, number=calls)) / calls * 1e9
            mode = TORCH_SETUP + "mode = memscope.torch.trace_ops(); mode.__enter__()\n"
            traced = min(timeit.repeat(stmt, mode, repeat=a.rounds, number=calls)) / calls * 1e9
            per_op[name] = {"bare_ns": round(bare, 1), "in_trace_ops_ns": round(traced, 1),
                            "overhead_ns": round(traced - bare, 1)}
        out["trace_ops_per_operator"] = per_op
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
