#!/usr/bin/env python3
"""Tagged jobs on the STAND-IN torch_npu allocator (tests only): who owns each tensor.

Two scenarios, both using our markers package (`import memscope`) and the stand-in mstx library:
- `train`: two threads (one per device) allocate tensors inside tag spans of every kind at the
  same time — plain, nested, system levels, repeated labels, address tags that override spans,
  mstx ranges, a span opened by the other thread, and a stretch where recording is paused.
- `serve`: a vLLM-like serving job: `vllm` component, model weights, a profile run, a KV cache
  tagged by address after allocation, and per-request activations.

The ledger (JSON lines) names, for every tensor, the owner path the scenario gave it by
construction, with its pointer, thread and wall-clock times; a `point` line marks instants at
which the test checks the owner decomposition. The allocator's own ledger
(STANDIN_TORCH_LEDGER) gives each block's size. Neither comes from the tracer.
"""

import argparse
import ctypes
import json
import os
import sys
import threading
import time

import memscope

L = memscope  # levels: memscope.COMPONENT, PROCESS, DETAIL_1, ...


def now():
    return time.time_ns()


class Job:
    def __init__(self, args):
        home = os.environ["ASCEND_HOME_PATH"]
        self.acl = ctypes.CDLL(os.path.join(home, "lib64", "libascendcl.so"))
        self.acl.aclrtSetDevice.argtypes = [ctypes.c_int32]
        self.mstx = ctypes.CDLL(os.path.join(home, "lib64", "libms_tools_ext.so"))
        self.mstx.mstxRangeStartA.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
        self.mstx.mstxRangeStartA.restype = ctypes.c_uint64
        self.mstx.mstxRangeEnd.argtypes = [ctypes.c_uint64]
        self.mstx.mstxMarkA.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
        self.mstx.mstxDomainCreateA.argtypes = [ctypes.c_char_p]
        self.mstx.mstxDomainCreateA.restype = ctypes.c_void_p
        self.mstx.mstxDomainMarkA.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        self.mstx.mstxDomainRangeStartA.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        self.mstx.mstxDomainRangeStartA.restype = ctypes.c_uint64
        self.mstx.mstxDomainRangeEnd.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
        self.torch = ctypes.CDLL(args.torch_lib)
        self.torch.standin_tensor_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int]
        self.torch.standin_tensor_alloc.restype = ctypes.c_void_p
        self.torch.standin_tensor_free.argtypes = [ctypes.c_void_p]
        self.lines = []
        self.lock = threading.Lock()
        self.errors = []

    def log(self, **fields):
        with self.lock:
            self.lines.append(fields)

    def tensor(self, device, size, owner, recorded=True):
        t0 = now()
        ptr = self.torch.standin_tensor_alloc(size, device)
        t1 = now()
        if not ptr:
            raise RuntimeError(f"stand-in allocator returned null for {size} bytes")
        self.log(kind="tensor", ptr=ptr, req=size, device=device, tid=threading.get_native_id(),
                 owner=owner, recorded=recorded, t0=t0, t1=t1)
        return ptr

    def free(self, ptr):
        t0 = now()
        self.torch.standin_tensor_free(ptr)
        self.log(kind="free", ptr=ptr, tid=threading.get_native_id(), t0=t0, t1=now())

    def point(self, name):
        self.log(kind="point", name=name, t=now())

    def dump(self, path):
        with open(path, "w") as f:
            for line in self.lines:
                f.write(json.dumps(line) + "\n")


def train_thread(job, device, barrier, pre_attach):
    job.acl.aclrtSetDevice(device)
    T = lambda size, owner, **kw: job.tensor(device, size, owner, **kw)  # noqa: E731
    keep = []
    if pre_attach and device == 0:
        # Opened before the tracer attached: the tracer never sees the push (with no tracer the
        # probe does not even fire), so tensors inside carry nothing of it (documented).
        memscope.describe_label("pre_attach")
    wait_for_tracer(job)
    barrier.wait()
    if pre_attach and device == 0:
        keep.append(T(64 << 10, "PTA"))
        memscope.undescribe("pre_attach")
    with memscope.describe("model_weight"):
        keep += [T(2 << 20, "PTA@model_weight"), T(512 << 10, "PTA@model_weight")]
    with memscope.describe(owner="outer"):
        with memscope.describe("inner"):
            keep.append(T(1 << 20, "PTA@outer@inner"))
        keep.append(T(300 << 10, "PTA@outer"))
    # One thread's span is not the other's: both allocate while only thread 0 has it open.
    if device == 0:
        memscope.describe_label("thread0_only")
    barrier.wait()
    keep.append(T(96 << 10, "PTA@thread0_only" if device == 0 else "PTA"))
    barrier.wait()
    if device == 0:
        memscope.undescribe("thread0_only")
    # System levels are ordered by level, not by opening order; user labels follow.
    memscope.describe_label("backward", L.PROCESS)
    memscope.describe_label("fsdp", L.COMPONENT)
    with memscope.describe("u1"):
        keep.append(T(128 << 10, "PTA@fsdp@backward@u1"))
    memscope.undescribe("fsdp", L.COMPONENT)
    memscope.undescribe("backward", L.PROCESS)
    # A repeated label is counted: it stays until closed as often as opened.
    memscope.describe_label("grad", L.DETAIL_1)
    memscope.describe_label("grad", L.DETAIL_1)
    memscope.undescribe("grad", L.DETAIL_1)
    keep.append(T(40 << 10, "PTA@grad"))
    memscope.undescribe("grad", L.DETAIL_1)
    keep.append(T(44 << 10, "PTA"))
    # Address tags win over spans, at their level, also when the address is inside the block.
    with memscope.describe("act"):
        kv = T(256 << 10, "PTA@kv_cache")
        w = T(192 << 10, "PTA@weight@act")  # levels order the path, not time
    memscope.describe(kv, owner="kv_cache")
    memscope.describe(w + 64, owner="weight", level=L.DETAIL_1)
    keep += [kv, w]
    # mstx ranges are spans; a `step start` range is a step, not a span.
    for step in range(2):
        sid = job.mstx.mstxRangeStartA(b"step start", None)
        rid = job.mstx.mstxRangeStartA(f"prefill{device}".encode(), None)
        tmp = T(700 << 10, f"PTA@prefill{device}")
        job.mstx.mstxRangeEnd(rid)
        job.free(tmp)
        job.mstx.mstxRangeEnd(sid)
        memscope.step()
    # The domain forms behave the same.
    domain = job.mstx.mstxDomainCreateA(f"user{device}".encode())
    rid = job.mstx.mstxDomainRangeStartA(domain, f"decode{device}".encode(), None)
    keep.append(T(72 << 10, f"PTA@decode{device}"))
    job.mstx.mstxDomainRangeEnd(domain, rid)
    job.mstx.mstxDomainMarkA(domain, f"dmark{device}".encode(), None)
    job.mstx.mstxMarkA(f"checkpoint{device}".encode(), None)
    memscope.mark(f"saved{device}")
    # Paused: blocks born now are not recorded at all (nor their frees).
    barrier.wait()
    if device == 0:
        memscope.stop()
    barrier.wait()
    if device == 0:
        hidden = T(80 << 10, "PTA", recorded=False)
        job.free(hidden)
    barrier.wait()
    if device == 0:
        memscope.start()
    barrier.wait()
    if device == 0:
        job.point("train")
    barrier.wait()
    for p in keep:
        job.free(p)


def wait_for_tracer(job):
    """Until every probe's semaphore is up (the tracer attaches them one by one), plus a moment
    for the last attachment to complete."""
    deadline = time.monotonic() + job.tracer_timeout
    while not all(v > 0 for v in memscope._native.semaphores().values()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no tracer attached to the markers within {job.tracer_timeout} s "
                               f"(semaphores {memscope._native.semaphores()})")
        time.sleep(0.01)
    time.sleep(0.1)


def serve(job, requests, linger=0.0):
    wait_for_tracer(job)
    device = 0
    job.acl.aclrtSetDevice(device)
    memscope.describe_label("vllm", L.COMPONENT)
    with memscope.describe("model_weight", level=L.DETAIL_1):
        weights = [job.tensor(device, n, "PTA@vllm@model_weight") for n in (4 << 20, 1 << 20, 768 << 10)]
    with memscope.describe("profile_run", level=L.PROCESS):
        peak = [job.tensor(device, n, "PTA@vllm@profile_run") for n in (3 << 20, 2 << 20)]
        job.point("profile_run")
        for p in peak:
            job.free(p)
    # The KV cache is allocated first and tagged by address afterwards (as vLLM's worker does
    # after sizing it from the profile run).
    kv = [job.tensor(device, 512 << 10, "PTA@vllm@kv_cache") for _ in range(6)]
    for p in kv:
        memscope.describe(p, owner="kv_cache", level=L.DETAIL_1)
    for r in range(requests):
        with memscope.describe("activation", level=L.DETAIL_1):
            acts = [job.tensor(device, n, "PTA@vllm@activation") for n in (200 << 10, 900 << 10)]
            if r == requests // 2:
                job.point("serving")
                time.sleep(linger)
            for p in acts:
                job.free(p)
        memscope.step()
    memscope.undescribe("vllm", L.COMPONENT)
    for p in kv + weights:
        job.free(p)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", choices=["train", "serve"], required=True)
    ap.add_argument("--torch-lib", required=True)
    ap.add_argument("--ledger", required=True)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--linger", type=float, default=0.0,
                    help="serve: stay this long at the `serving` point (a wide plateau on a timeline)")
    ap.add_argument("--ready-file", help="write the pid here once started")
    ap.add_argument("--pre-attach", action="store_true",
                    help="open a span before waiting for the tracer (attach-mode behaviour)")
    ap.add_argument("--tracer-timeout", type=float, default=30.0)
    args = ap.parse_args()

    job = Job(args)
    if args.ready_file:
        with open(args.ready_file, "w") as f:
            f.write(str(os.getpid()))
    barrier = threading.Barrier(2)
    job.tracer_timeout = args.tracer_timeout
    if args.scenario == "train":
        threads = [threading.Thread(target=lambda d=d: run_guarded(job, train_thread, job, d, barrier, args.pre_attach))
                   for d in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        run_guarded(job, serve, job, args.requests, args.linger)
    job.dump(args.ledger)
    if job.errors:
        print("\n".join(job.errors), file=sys.stderr)
        return 1
    return 0


def run_guarded(job, fn, *a):
    try:
        fn(*a)
    except Exception as e:  # surfaced by main()
        job.errors.append(f"{fn.__name__}: {e!r}")


if __name__ == "__main__":
    sys.exit(main())
