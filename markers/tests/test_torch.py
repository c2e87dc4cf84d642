"""memscope.torch on CPU torch: which hooks fire, in what order, and that the tags cover exactly
the storages the tracer should attribute (storage_bytes is the ground truth the tracer's own tests
compare against, so it is checked against torch's numbers here first).

Skipped, with the reason printed, where torch cannot be imported.
"""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _support import memscope, recording  # noqa: E402

try:
    import torch
    TORCH_ERROR = None
except Exception as e:  # noqa: BLE001 - any import failure means "no torch here"
    torch = None
    TORCH_ERROR = f"{type(e).__name__}: {e}"
    print(f"\n[memscope tests] torch tests skipped: torch is not importable ({TORCH_ERROR})", file=sys.stderr)

if torch is not None:
    import memscope.torch as mt

PROCESS, DETAIL_1 = memscope.PROCESS, memscope.DETAIL_1


def addr(t):
    return t.untyped_storage().data_ptr()


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def spans(calls):
    return [(p, a) for p, a in calls if p in ("tag_push", "tag_pop")]


@unittest.skipIf(torch is None, f"torch is not importable ({TORCH_ERROR})")
class StorageBytes(unittest.TestCase):
    def test_distinct_storages_only(self):
        a = torch.zeros(10, 10)  # 400 bytes
        view = a[2:5]  # same storage
        b = torch.zeros(3, dtype=torch.float64)  # 24 bytes
        step = torch.tensor(1.0)  # 0-dim: 4 bytes
        empty = torch.zeros(0)
        self.assertEqual(mt.storage_bytes([a, view, b, step, empty, 3, None]), 400 + 24 + 4)
        self.assertEqual(mt.storage_bytes([]), 0)

    def test_dtensor_like_uses_local_tensor(self):
        local = torch.zeros(5)

        class Shard(torch.Tensor):
            pass

        fake = torch.zeros(100).as_subclass(Shard)
        fake._local_tensor = local
        self.assertEqual(mt.storage_bytes([fake]), 20)
        with recording() as calls:
            memscope.describe(fake, owner="shard")
        self.assertEqual(calls, [("addr_tag", (addr(local), memscope.USER_DEFINED_1, "shard"))])


@unittest.skipIf(torch is None, f"torch is not importable ({TORCH_ERROR})")
class AutoTag(unittest.TestCase):
    def test_tags_parameters_now(self):
        m = model()
        with recording() as calls:
            h = mt.auto_tag(m)
        h.remove()
        expected = [("addr_tag", (addr(p), DETAIL_1, "weight")) for p in m.parameters()]
        self.assertEqual(calls, expected)

    def test_untraced_does_not_walk(self):
        m = model()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with mt.auto_tag(m, opt):  # no hook, no tracer: nothing is sent, nothing fails
            m(torch.randn(2, 8)).sum().backward()
            opt.step()

    def test_forward_backward_and_optimizer_step(self):
        m = model()
        opt = torch.optim.Adam(m.parameters(), lr=1e-3)
        x = torch.randn(4, 8)
        with recording() as calls:
            handle = mt.auto_tag(m, opt)
            calls.clear()
            loss = m(x).sum()
            fwd = list(calls)
            loss.backward()
            bwd = calls[len(fwd):]
            opt.step()
            step_tags = calls[len(fwd) + len(bwd):]
        handle.remove()

        self.assertEqual(fwd, [("tag_push", (PROCESS, "activation")), ("tag_pop", (PROCESS, "activation"))])
        self.assertEqual(bwd, [("tag_push", (PROCESS, "backward")), ("tag_pop", (PROCESS, "backward"))])

        params = list(m.parameters())
        grads = [p.grad for p in params]
        states = [v for p in params for v in opt.state[p].values()]
        self.assertTrue(any(s.dim() == 0 for s in states), "Adam keeps a 0-dim step tensor")
        by_label = {}
        for probe, (a, level, label) in step_tags:
            self.assertEqual((probe, level), ("addr_tag", DETAIL_1))
            by_label.setdefault(label, []).append(a)
        self.assertEqual(by_label["weight"], [addr(p) for p in params])
        self.assertEqual(by_label["gradient"], [addr(g) for g in grads])
        self.assertEqual(sorted(by_label["optimizer_state"]), sorted({addr(s) for s in states}))
        # Every distinct storage is tagged exactly once, so the tagged bytes are the ground truth.
        tagged = [a for addrs in by_label.values() for a in addrs]
        self.assertEqual(len(tagged), len(set(tagged)))
        everything = params + grads + states
        self.assertEqual(sum(t.untyped_storage().nbytes() for t in {addr(t): t for t in everything}.values()),
                         mt.storage_bytes(everything))

    def test_hooks_removed(self):
        m = model()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        h = mt.auto_tag(m, opt)
        h.remove()
        with recording() as calls:
            m(torch.randn(2, 8)).sum().backward()
            opt.step()
        self.assertEqual(calls, [])

    def test_forward_exception_still_pops(self):
        m = model()
        with recording() as calls:
            with mt.auto_tag(m):
                calls.clear()
                with self.assertRaises(RuntimeError):
                    m(torch.randn(2, 3))  # wrong width
        self.assertEqual(spans(calls), [("tag_push", (PROCESS, "activation")), ("tag_pop", (PROCESS, "activation"))])

    def test_failed_backward_is_closed_at_next_forward(self):
        m = model()

        def explode(grad):
            raise RuntimeError("bad grad")

        with recording() as calls:
            with mt.auto_tag(m):
                calls.clear()
                out = m(torch.randn(2, 8))
                m[0].weight.register_hook(explode)
                with self.assertRaisesRegex(RuntimeError, "bad grad"):
                    out.sum().backward()
                m(torch.randn(2, 8))
        self.assertEqual(spans(calls), [
            ("tag_push", (PROCESS, "activation")), ("tag_pop", (PROCESS, "activation")),
            ("tag_push", (PROCESS, "backward")),
            ("tag_pop", (PROCESS, "backward")),  # closed by the next forward
            ("tag_push", (PROCESS, "activation")), ("tag_pop", (PROCESS, "activation")),
        ])

    def test_spans_balance_over_a_few_training_steps(self):
        m = model()
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        with recording() as calls:
            with mt.auto_tag(m, opt):
                for _ in range(3):
                    opt.zero_grad()
                    m(torch.randn(4, 8)).pow(2).mean().backward()
                    opt.step()
                    memscope.step()
        depth = {}
        for probe, (level, label) in spans(calls):
            depth[label] = depth.get(label, 0) + (1 if probe == "tag_push" else -1)
            self.assertGreaterEqual(depth[label], 0)
        self.assertEqual(depth, {"activation": 0, "backward": 0})
        labels = {a[2] for p, a in calls if p == "addr_tag"}
        self.assertEqual(labels, {"weight", "gradient", "optimizer_state"})

    def test_wrong_arguments(self):
        with self.assertRaisesRegex(TypeError, "torch.nn.Module"):
            mt.auto_tag(object())
        with self.assertRaisesRegex(TypeError, "register_step_post_hook"):
            mt.auto_tag(model(), object())


if __name__ == "__main__":
    unittest.main()


def ops_of(calls):
    """The trace_ops probes among the recorded calls."""
    return [(p, a) for p, a in calls if p in ("op_start", "op_end", "tensor_access")]


@unittest.skipIf(torch is None, f"torch is not importable ({TORCH_ERROR})")
class TraceOps(unittest.TestCase):
    """What memscope.torch.trace_ops sends per operator (see the module docstring's rules)."""

    def test_reads_writes_views_factories_and_out(self):
        a, b = torch.randn(4, 8), torch.randn(8, 3)
        c = torch.empty(4, 3)
        with recording() as calls:
            with mt.trace_ops():
                d = a @ b
                d.add_(1)
                torch.mm(a, b, out=c)
                a.view(8, 4)
                z = torch.zeros_like(a)
                torch.empty(3)
                m = torch.max(a, dim=1)
                cat = torch.cat([a, a])
        R, W = 0, 1
        A, B = (a.data_ptr(), 128, "float32[4,8]"), (b.data_ptr(), 96, "float32[8,3]")

        def acc(kind, t):
            return ("tensor_access", (t[0], t[1], kind, t[2]))

        def t(x):
            return (x.data_ptr(), x.nbytes, f"{str(x.dtype)[6:]}[{','.join(map(str, x.shape))}]")

        def op(name, *accesses):
            return [("op_start", (name,)), *accesses, ("op_end", (name,))]

        self.assertEqual(ops_of(calls), [
            *op("aten.mm.default", acc(R, A), acc(R, B), acc(W, t(d))),
            *op("aten.add_.Tensor", acc(W, t(d))),  # self is written; the aliasing return adds nothing
            *op("aten.mm.out", acc(R, A), acc(R, B), acc(W, t(c))),  # out= is a write
            *op("aten.view.default"),  # a view touches no memory
            *op("aten.zeros_like.default", acc(W, t(z))),  # the template's data is not read
            *op("aten.empty.memory_format"),  # allocated, not written
            *op("aten.max.dim", acc(R, A), acc(W, t(m.values)), acc(W, t(m.indices))),
            *op("aten.cat.default", acc(R, A), acc(R, A), acc(W, t(cat))),  # a list argument is flattened
        ])
        self.assertEqual(t(m.indices)[2], "int64[4]")

    def test_views_are_sent_at_their_own_data_pointer(self):
        a = torch.randn(10, 10)
        row = a[3]
        with recording() as calls:
            with mt.trace_ops():
                row.sum()
        reads = [args for p, args in calls if p == "tensor_access" and args[2] == 0]
        self.assertEqual(reads, [(a.data_ptr() + 3 * 10 * 4, 40, 0, "float32[10]")],
                         "inside the storage's block, the tensor's own bytes")

    def test_op_end_fires_when_the_operator_raises(self):
        a, b = torch.randn(2, 3), torch.randn(2, 3)
        with recording() as calls:
            with mt.trace_ops():
                with self.assertRaises(RuntimeError):
                    torch.mm(a, b)
        names = [(p, args[0]) for p, args in calls if p != "tensor_access"]
        self.assertEqual(names, [("op_start", "aten.mm.default"), ("op_end", "aten.mm.default")])

    def test_untraced_sends_nothing_and_results_are_unchanged(self):
        torch.manual_seed(0)
        m = model()
        x = torch.randn(5, 8)
        want = m(x).sum()
        # No hook, no tracer: the probes' wrappers must not even be called (their semaphore is
        # read once per operator), which the module-level names let us observe.
        calls = []
        saved = mt._op_start, mt._op_end, mt._tensor_access
        mt._op_start = mt._op_end = mt._tensor_access = lambda *a: calls.append(a)
        try:
            with mt.trace_ops():
                got = m(x).sum()
        finally:
            mt._op_start, mt._op_end, mt._tensor_access = saved
        self.assertEqual(calls, [])
        self.assertTrue(torch.equal(want, got))

    def test_training_step_is_balanced_and_every_access_is_a_live_tensor(self):
        m = model()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        x, y = torch.randn(5, 8), torch.randn(5, 4)
        with recording() as calls:
            with mt.trace_ops():
                loss = torch.nn.functional.mse_loss(m(x), y)
                loss.backward()
                opt.step()
        stack, names = [], []
        for p, args in calls:
            if p == "op_start":
                stack.append(args[0])
                names.append(args[0])
            elif p == "op_end":
                self.assertEqual(stack.pop(), args[0])
            elif p == "tensor_access":
                self.assertTrue(stack, "accesses happen inside an operator")
                self.assertIn(args[2], (0, 1))
                self.assertGreater(args[0], 0)
                self.assertGreater(args[1], 0)
        self.assertEqual(stack, [])
        self.assertTrue(all(n.count(".") >= 2 for n in names), f"namespace.op.overload: {names}")
        self.assertIn("aten.addmm.default", names)
        self.assertTrue(any("backward" in n for n in names), "the backward pass is seen on this thread")
        weights = {p.data_ptr() for p in m.parameters()}
        written = {args[0] for p, args in calls if p == "tensor_access" and args[2] == 1}
        self.assertTrue(weights <= written, "the optimizer's in-place updates write every weight")
