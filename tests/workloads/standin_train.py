#!/usr/bin/env python3
"""A simulated training job on the STAND-IN Ascend runtime (tests only).

It drives the stand-in libascendcl.so through ctypes the way a training job drives the real one:
each worker thread selects its device and allocates weights once, then per step allocates and
frees activations (through the malloc variants), copies and sets memory. Switches add host
allocations, expandable-segment style virtual memory, a deliberate leak, an allocation failure,
calls straight into the `...Impl` symbols, and a second copy of the library loaded late.

It writes its own ledger: one JSON object per line for every runtime call it made, with the API,
device, requested size, returned pointer or handle, return code, kernel thread id and entry/exit
wall-clock times. Tests compare the tracer's DB with this ledger; the ledger never comes from the
tracer.
"""

import argparse
import ctypes
import json
import os
import random
import sys
import threading
import time

ACL_RT_MEM_ATTR_MODULE_ID = 1
ACL_RT_MEM_ATTR_DEVICE_ID = 2
MODULE_HCCL = 3  # module id used by the collective-communication buffers in the workload


class MallocAttrValue(ctypes.Union):
    _fields_ = [("moduleId", ctypes.c_uint16), ("deviceId", ctypes.c_uint32), ("rsv", ctypes.c_uint8 * 8)]


class MallocAttribute(ctypes.Structure):
    _fields_ = [("attr", ctypes.c_int), ("value", MallocAttrValue)]


class MallocConfig(ctypes.Structure):
    _fields_ = [("attrs", ctypes.POINTER(MallocAttribute)), ("numAttrs", ctypes.c_size_t)]


class MemLocation(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint32), ("type", ctypes.c_int)]


class PhysicalMemProp(ctypes.Structure):
    _fields_ = [
        ("handleType", ctypes.c_uint32),
        ("allocationType", ctypes.c_uint32),
        ("memAttr", ctypes.c_uint32),
        ("location", MemLocation),
        ("reserve", ctypes.c_uint64),
    ]


assert ctypes.sizeof(MallocAttribute) == 12
assert PhysicalMemProp.location.offset + MemLocation.id.offset == 12


def load_hal(runtime_path):
    """The stand-in driver next to the runtime (as the runtime itself finds it)."""
    lib = ctypes.CDLL(os.path.join(os.path.dirname(runtime_path), "libascend_hal.so"))
    vpp = ctypes.POINTER(ctypes.c_void_p)
    for name, args in {
        "halMemAlloc": [vpp, ctypes.c_ulonglong, ctypes.c_ulonglong],
        "halMemFree": [ctypes.c_void_p],
    }.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_int
    return lib


MODULE_HCCP = 28  # what a direct driver allocation (communication buffers) is attributed to


def load_torch(path):
    """The stand-in libtorch_npu.so: its tensor front end (what torch's tensor code calls)."""
    lib = ctypes.CDLL(path)
    sz = ctypes.c_size_t
    vp = ctypes.c_void_p
    for name, args, res in [
        ("standin_tensor_alloc", [sz, ctypes.c_int], vp),
        ("standin_tensor_free", [vp], None),
        ("standin_empty_cache", [], None),
        ("standin_external_alloc", [sz, ctypes.c_int, ctypes.POINTER(vp)], vp),
        ("standin_external_free", [vp], None),
        ("standin_workspace_alloc", [sz, ctypes.c_int], vp),
        ("standin_workspace_ptr", [vp], vp),
        ("standin_workspace_free", [vp, ctypes.c_int], None),
    ]:
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = res
    return lib


class TensorJob:
    """A training loop's tensors on the stand-in caching allocator. The allocator writes the
    ledger of its blocks and segments itself (STANDIN_TORCH_LEDGER)."""

    def __init__(self, torch, device, rng, args):
        self.torch = torch
        self.device = device
        self.rng = rng
        self.args = args
        self.weights = []
        self.optimizer_state = []
        self.grads = []

    def tensor(self, size):
        return self.torch.standin_tensor_alloc(size, self.device)

    def free(self, ptr):
        if ptr:
            self.torch.standin_tensor_free(ptr)

    def step(self, step):
        t = self.torch
        if step == 0:
            self.weights = [self.tensor(n) for n in (4 << 20, 1536 << 10, 300 << 10, 12 << 10)]
        for g in self.grads:  # zero_grad(set_to_none=True)
            self.free(g)
        activations = [self.tensor(self.rng.choice([700, 64 << 10, 900 << 10, 3 << 20, 11 << 20])) for _ in range(6)]
        ws = t.standin_workspace_alloc(self.rng.choice([1 << 20, 3 << 20, 5 << 20]), self.device)
        t.standin_workspace_free(ws, self.device)
        for a in reversed(activations):  # backward frees activations
            self.free(a)
        self.grads = [self.tensor(n) for n in (4 << 20, 1536 << 10, 300 << 10, 12 << 10)]
        if step == 0:
            self.optimizer_state = [self.tensor(n) for n in (4 << 20, 4 << 20, 1536 << 10, 1536 << 10)]
        handle = ctypes.c_void_p(0)
        if t.standin_external_alloc(256 << 10, self.device, ctypes.byref(handle)):
            t.standin_external_free(handle)
        if self.args.pta_oom_step == step:
            t.standin_tensor_alloc(self.args.fail_size, self.device)  # the allocator gives up: null
        if self.args.empty_cache_every and step % self.args.empty_cache_every == self.args.empty_cache_every - 1:
            t.standin_empty_cache()

    def finish(self):
        if self.args.keep_weights:
            return
        for p in self.weights + self.optimizer_state + self.grads:
            self.free(p)


def load(path):
    lib = ctypes.CDLL(path)
    vpp = ctypes.POINTER(ctypes.c_void_p)
    sz = ctypes.c_size_t
    sigs = {
        "aclrtSetDevice": [ctypes.c_int32],
        "aclrtGetDevice": [ctypes.POINTER(ctypes.c_int32)],
        "aclrtMalloc": [vpp, sz, ctypes.c_int],
        "aclrtMallocAlign32": [vpp, sz, ctypes.c_int],
        "aclrtMallocCached": [vpp, sz, ctypes.c_int],
        "aclrtMallocWithCfg": [vpp, sz, ctypes.c_int, ctypes.POINTER(MallocConfig)],
        "aclrtFree": [ctypes.c_void_p],
        "aclrtMallocHost": [vpp, sz],
        "aclrtFreeHost": [ctypes.c_void_p],
        "aclrtMemcpy": [ctypes.c_void_p, sz, ctypes.c_void_p, sz, ctypes.c_int],
        "aclrtMemset": [ctypes.c_void_p, sz, ctypes.c_int32, sz],
        "aclrtGetMemInfo": [ctypes.c_int, ctypes.POINTER(sz), ctypes.POINTER(sz)],
        "aclrtReserveMemAddress": [vpp, sz, sz, ctypes.c_void_p, ctypes.c_uint64],
        "aclrtReleaseMemAddress": [ctypes.c_void_p],
        "aclrtMallocPhysical": [vpp, sz, ctypes.POINTER(PhysicalMemProp), ctypes.c_uint64],
        "aclrtFreePhysical": [ctypes.c_void_p],
        "aclrtMapMem": [ctypes.c_void_p, sz, sz, ctypes.c_void_p, ctypes.c_uint64],
        "aclrtUnmapMem": [ctypes.c_void_p],
    }
    for name, args in sigs.items():
        for symbol in (name, name + "Impl"):
            fn = getattr(lib, symbol)
            fn.argtypes = args
            fn.restype = ctypes.c_int
    return lib


class Ledger:
    """Every call, per thread, merged at the end."""

    def __init__(self, main_lib):
        self.lock = threading.Lock()
        self.entries = []
        self.main_lib = main_lib

    def call(self, lib, api, *args, via_impl=False, **fields):
        fn = getattr(lib, api + ("Inner" if getattr(lib, "is_hal", False) else "Impl") if via_impl else api)
        t0 = time.time_ns()
        rc = fn(*args)
        t1 = time.time_ns()
        entry = {"api": api, "rc": rc, "tid": threading.get_native_id(), "t0": t0, "t1": t1}
        if via_impl:
            entry["via"] = "impl"
        if lib is not self.main_lib and not getattr(lib, "is_hal", False):
            entry["lib"] = "late"
        entry.update(fields)
        with self.lock:
            self.entries.append(entry)
        return rc, entry

    def dump(self, path):
        with open(path, "w") as f:
            for e in sorted(self.entries, key=lambda e: e["t0"]):
                f.write(json.dumps(e) + "\n")


class Job:
    def __init__(self, args, lib):
        self.args = args
        self.lib = lib
        self.ledger = Ledger(lib)
        self.hal = load_hal(args.lib)
        self.hal.is_hal = True
        self.torch = load_torch(args.torch_lib) if args.torch_lib else None
        self.stop_at = time.monotonic() + args.duration if args.duration else None
        self.errors = []

    def running(self, step):
        if self.stop_at is not None:
            return time.monotonic() < self.stop_at
        return step < self.args.steps

    # -- device memory --

    def malloc(self, lib, api, size, device, via_impl=False):
        p = ctypes.c_void_p(0)
        if api == "aclrtMallocWithCfg":
            attrs = (MallocAttribute * 2)()
            attrs[0].attr = ACL_RT_MEM_ATTR_DEVICE_ID
            attrs[0].value.deviceId = device
            attrs[1].attr = ACL_RT_MEM_ATTR_MODULE_ID
            attrs[1].value.moduleId = MODULE_HCCL
            cfg = MallocConfig(attrs, 2)
            rc, e = self.ledger.call(lib, api, ctypes.byref(p), size, 0x1000, ctypes.byref(cfg),
                                     via_impl=via_impl, device=device, size=size, module=MODULE_HCCL)
        else:
            rc, e = self.ledger.call(lib, api, ctypes.byref(p), size, 0, via_impl=via_impl,
                                     device=device, size=size)
        e["ptr"] = p.value if rc == 0 else None
        return e["ptr"]

    def free(self, lib, ptr, size, device, via_impl=False):
        rc, _ = self.ledger.call(lib, "aclrtFree", ctypes.c_void_p(ptr), via_impl=via_impl,
                                 ptr=ptr, size=size, device=device)
        if rc != 0:
            self.errors.append(f"aclrtFree({ptr:#x}) failed: {rc}")

    # -- threads --

    def worker(self, device, index):
        try:
            self._worker(device, index)
        except Exception as e:  # surfaced by main()
            self.errors.append(f"worker {device}/{index}: {e!r}")

    def _worker(self, device, index):
        args = self.args
        lib = self.lib
        rng = random.Random(args.seed * 1000 + device * 10 + index)
        rc, _ = self.ledger.call(lib, "aclrtSetDevice", device, device=device)
        if rc != 0:
            raise RuntimeError(f"aclrtSetDevice({device}) = {rc}")
        weights = []
        for i in range(3):
            size = (1 << 20) * (i + 1) + 4096 * index
            weights.append((self.malloc(lib, "aclrtMallocAlign32", size, device), size))
        step = 0
        late_lib = None
        peer_bufs = []
        tensors = TensorJob(self.torch, device, rng, args) if self.torch is not None and index == 0 else None
        while self.running(step):
            if args.set_device_every_step:
                self.ledger.call(lib, "aclrtSetDevice", device, device=device)
            if args.late_lib and step == args.late_lib_step and late_lib is None:
                late_lib = self.late_lib(device)
            use = late_lib if late_lib is not None and index == 0 else lib
            acts = []
            variants = ["aclrtMalloc", "aclrtMallocAlign32", "aclrtMallocCached"]
            for k in range(args.blocks_per_step):
                api = variants[(step + k) % len(variants)]
                size = rng.choice([512, 4096, 65536, 1 << 20, 3 << 20]) + rng.randrange(0, 512)
                via_impl = args.impl_direct and k == 0
                ptr = self.malloc(use, api, size, device, via_impl=via_impl)
                if ptr is not None:
                    acts.append((ptr, size))
            if args.with_cfg:
                # A communication buffer placed on the peer device through the DEVICE_ID
                # attribute: the thread's own device is not where it lives.
                peer = (device + 1) % args.devices
                ptr = self.malloc(use, "aclrtMallocWithCfg", 1 << 16, peer)
                if ptr is not None:
                    peer_bufs.append((ptr, 1 << 16, peer))
            if len(acts) >= 2:
                a, b = acts[0], acts[1]
                n = min(a[1], b[1])
                self.ledger.call(use, "aclrtMemset", ctypes.c_void_p(a[0]), a[1], 7, n, ptr=a[0], size=n, device=device)
                self.ledger.call(use, "aclrtMemcpy", ctypes.c_void_p(b[0]), b[1], ctypes.c_void_p(a[0]), n, 3,
                                 ptr=b[0], size=n, device=device)
            if args.fail_step == step and index == 0:
                # Ask for more than the device has: the runtime must refuse (207001).
                self.malloc(use, "aclrtMalloc", args.fail_size, device)
            if args.leak and index == 0:
                self.malloc(use, "aclrtMalloc", 64 << 10, device)  # never freed
            if args.driver_direct and index == 0:
                self.driver_cycle(device)
            if tensors is not None:
                tensors.step(step)
            got = ctypes.c_int32(-1)
            self.ledger.call(use, "aclrtGetDevice", ctypes.byref(got), device=device)
            rng.shuffle(acts)
            for k, (ptr, size) in enumerate(acts):
                self.free(use, ptr, size, device, via_impl=args.impl_direct and k == 0)
            for ptr, size, peer in peer_bufs:
                self.free(use, ptr, size, peer)
            peer_bufs.clear()
            step += 1
            if args.step_sleep_ms:
                time.sleep(args.step_sleep_ms / 1000)
        if tensors is not None:
            tensors.finish()
        if not args.keep_weights:
            for ptr, size in weights:
                self.free(lib, ptr, size, device)

    def driver_cycle(self, device):
        """A direct driver allocation and free, as HCCL makes for its buffers."""
        hal = self.hal
        p = ctypes.c_void_p(0)
        size = 256 << 10
        flag = device | (1 << 10) | (1 << 17) | (MODULE_HCCP << 56)
        rc, e = self.ledger.call(hal, "halMemAlloc", ctypes.byref(p), size, flag, size=size, device=device, flag=flag)
        e["ptr"] = p.value if rc == 0 else None
        if rc == 0:
            self.ledger.call(hal, "halMemFree", p, ptr=p.value, size=size, device=device)

    def late_lib(self, device):
        """Loads a second copy of the runtime (as HCCL dlopens libacl_rt.so) and selects the
        thread's device in it: the copy keeps its own per-thread state."""
        lib = load(self.args.late_lib)
        self.ledger.call(lib, "aclrtSetDevice", device, device=device)
        return lib

    def host_and_vmm(self):
        args = self.args
        lib = self.lib
        step = 0
        while self.running(step):
            if args.host:
                p = ctypes.c_void_p(0)
                size = 256 << 10
                rc, e = self.ledger.call(lib, "aclrtMallocHost", ctypes.byref(p), size, size=size, device="cpu")
                e["ptr"] = p.value if rc == 0 else None
                if rc == 0:
                    self.ledger.call(lib, "aclrtFreeHost", p, ptr=p.value, size=size, device="cpu")
            if args.vmm:
                self.vmm_cycle(step)
            step += 1
            if args.step_sleep_ms:
                time.sleep(args.step_sleep_ms / 1000)

    def vmm_cycle(self, step):
        """One expandable-segment lifetime: reserve, back with physical pages, map, use, undo."""
        lib = self.lib
        seg = 2 << 20
        count = 3
        device = step % self.args.devices
        # The calling thread's current device is another one: the physical memory's own
        # location (prop->location.id) is what counts.
        other = (device + 1) % self.args.devices
        self.ledger.call(lib, "aclrtSetDevice", other, device=other)
        va = ctypes.c_void_p(0)
        rc, e = self.ledger.call(lib, "aclrtReserveMemAddress", ctypes.byref(va), seg * 8, 0, None, 1, size=seg * 8)
        e["ptr"] = va.value if rc == 0 else None
        if rc != 0:
            return
        handles = []
        for i in range(count):
            h = ctypes.c_void_p(0)
            prop = PhysicalMemProp(0, 0, 4, MemLocation(device, 1), 0)
            rc, e = self.ledger.call(lib, "aclrtMallocPhysical", ctypes.byref(h), seg, ctypes.byref(prop), 0,
                                     size=seg, device=device)
            e["handle"] = h.value if rc == 0 else None
            if rc == 0:
                handles.append(h.value)
        for i, h in enumerate(handles):
            self.ledger.call(lib, "aclrtMapMem", ctypes.c_void_p(va.value + i * seg), seg, 0, ctypes.c_void_p(h), 0,
                             ptr=va.value + i * seg, size=seg, handle=h, device=device)
        if handles:
            # The mapped memory is real: write through it.
            ctypes.memset(va.value, 1, seg * len(handles))
        for i, h in enumerate(handles):
            self.ledger.call(lib, "aclrtUnmapMem", ctypes.c_void_p(va.value + i * seg), ptr=va.value + i * seg,
                             size=seg, device=device)
            self.ledger.call(lib, "aclrtFreePhysical", ctypes.c_void_p(h), handle=h, device=device)
        self.ledger.call(lib, "aclrtReleaseMemAddress", va, ptr=va.value)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    home = os.environ.get("ASCEND_HOME_PATH", "")
    ap.add_argument("--lib", default=os.path.join(home, "lib64", "libascendcl.so") if home else None,
                    help="stand-in libascendcl.so (default: $ASCEND_HOME_PATH/lib64/libascendcl.so)")
    ap.add_argument("--ledger", required=True, help="where to write the JSON-lines ledger")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--threads-per-device", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--duration", type=float, default=0, help="run for this many seconds instead of --steps")
    ap.add_argument("--step-sleep-ms", type=float, default=0)
    ap.add_argument("--blocks-per-step", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--leak", action="store_true", help="thread 0 of each device leaks 64 KiB per step")
    ap.add_argument("--keep-weights", action="store_true", help="never free the weights (live at exit)")
    ap.add_argument("--fail-step", type=int, default=-1, help="at this step, request --fail-size bytes")
    ap.add_argument("--fail-size", type=int, default=1 << 50)
    ap.add_argument("--host", action="store_true", help="pinned host allocations on the main thread")
    ap.add_argument("--vmm", action="store_true", help="expandable-segment cycles on the main thread")
    ap.add_argument("--with-cfg", action="store_true", help="aclrtMallocWithCfg with DEVICE_ID and MODULE_ID")
    ap.add_argument("--impl-direct", action="store_true", help="some calls go straight to aclrtXImpl")
    ap.add_argument("--set-device-every-step", action="store_true")
    ap.add_argument("--driver-direct", action="store_true", help="thread 0 of each device also calls the driver directly")
    ap.add_argument("--torch-lib", help="stand-in libtorch_npu.so: thread 0 of each device runs tensors on its allocator")
    ap.add_argument("--empty-cache-every", type=int, default=0, help="torch_npu.npu.empty_cache() every N steps")
    ap.add_argument("--pta-oom-step", type=int, default=-1, help="at this step, a tensor of --fail-size bytes")
    ap.add_argument("--late-lib", help="a second copy of the library, loaded at --late-lib-step")
    ap.add_argument("--late-lib-step", type=int, default=3)
    ap.add_argument("--ready-file", help="write the pid here once started")
    ap.add_argument("--start-delay", type=float, default=0, help="sleep this long before the first call")
    args = ap.parse_args()
    if not args.lib:
        ap.error("no library: pass --lib or set ASCEND_HOME_PATH")

    lib = load(args.lib)
    job = Job(args, lib)
    if args.ready_file:
        with open(args.ready_file, "w") as f:
            f.write(str(os.getpid()))
    if args.start_delay:
        time.sleep(args.start_delay)
    threads = [threading.Thread(target=job.worker, args=(d, i)) for d in range(args.devices)
               for i in range(args.threads_per_device)]
    if args.host or args.vmm:
        threads.append(threading.Thread(target=job.host_and_vmm))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    job.ledger.dump(args.ledger)
    if job.errors:
        print("\n".join(job.errors), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
