"""The Python API without a tracer: counters, argument checks, and what each marker form sends.

What a form "sends" is observed through the native test hook (tests/_support.recording), which
runs after the native argument checks, so the recorded (probe, args) are exactly what the probe
site would pass to the tracer.
"""

import os
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _support import _native, memscope, recording  # noqa: E402

USER = memscope.USER


class FakeStorage:
    def __init__(self, ptr):
        self.ptr = ptr

    def data_ptr(self):
        return self.ptr


class FakeTensor:
    """Tensor-like: storage at `storage_ptr`, its own data_ptr elsewhere (an offset view)."""

    def __init__(self, storage_ptr, data_ptr=None):
        self.storage_ptr = storage_ptr
        self._data_ptr = storage_ptr + 64 if data_ptr is None else data_ptr

    def untyped_storage(self):
        return FakeStorage(self.storage_ptr)

    def data_ptr(self):
        return self._data_ptr


class DataPtrOnly:
    def data_ptr(self):
        return 0x5000


class FakeDTensor:
    def __init__(self, local):
        self._local_tensor = local


def run_python(code):
    return subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=os.environ.copy())


class Untraced(unittest.TestCase):
    def test_semaphores_are_all_zero(self):
        sems = memscope.semaphores()
        self.assertEqual(sorted(sems), sorted(memscope.PROBES))
        self.assertEqual(set(sems.values()), {0})
        self.assertFalse(memscope.tracing())

    def test_wait_for_tracer_times_out(self):
        t0 = time.monotonic()
        self.assertFalse(memscope.wait_for_tracer(timeout=0.05, poll=0.01))
        self.assertLess(time.monotonic() - t0, 2.0)
        self.assertFalse(memscope.wait_for_tracer(timeout=0))
        with self.assertRaisesRegex(ValueError, "unknown probe"):
            memscope.wait_for_tracer(timeout=0, probes=["nope"])

    def test_no_calls_reach_the_hook_once_removed(self):
        with recording() as calls:
            pass
        memscope.step()
        memscope.describe_label("x")
        self.assertEqual(calls, [])

    def test_import_does_not_import_torch(self):
        r = run_python("import sys, memscope, memscope.torch, memscope.msmemscope\n"
                       "from memscope.msmemscope import describe\n"
                       "assert 'torch' not in sys.modules, 'torch was imported'\n")
        self.assertEqual(r.returncode, 0, r.stdout)


class Counters(unittest.TestCase):
    def test_step_counts_from_one_in_a_fresh_process(self):
        r = run_python("import memscope; print(memscope.step(), memscope.step(), memscope.step())")
        self.assertEqual(r.stdout.split(), ["1", "2", "3"], r.stdout)

    def test_step_increments_untraced_and_fires_its_number(self):
        a = memscope.step()
        b = memscope.step()
        self.assertEqual(b, a + 1)
        with recording() as calls:
            c = memscope.step()
        self.assertEqual(c, b + 1)
        self.assertEqual(calls, [("step", (c,))])

    def test_range_ids_increment_from_one(self):
        r = run_python("import memscope; print(memscope.range_start('a'), memscope.range_start('b'))")
        self.assertEqual(r.stdout.split(), ["1", "2"], r.stdout)
        a = memscope.range_start("a")
        with recording() as calls:
            b = memscope.range_start("b")
            memscope.range_end(b)
        self.assertEqual(b, a + 1)
        self.assertEqual(calls, [("range_start", (b, "b")), ("range_end", (b,))])

    def test_range_context_manager_closes_on_exception(self):
        with recording() as calls:
            with self.assertRaises(KeyError):
                with memscope.range("load") as rid:
                    raise KeyError("x")
        self.assertEqual(calls, [("range_start", (rid, "load")), ("range_end", (rid,))])

    def test_range_end_checks_the_id(self):
        with self.assertRaisesRegex(TypeError, "range id must be an int"):
            memscope.range_end("1")
        with self.assertRaisesRegex(ValueError, "0..2"):
            memscope.range_end(-1)

    def test_mark_and_collect(self):
        with recording() as calls:
            memscope.mark("epoch 3")
            memscope.mark("")
            memscope.start()
            memscope.stop()
        self.assertEqual(calls, [("mark", ("epoch 3",)), ("mark", ("",)), ("collect", (1,)), ("collect", (0,))])


class LabelChecks(unittest.TestCase):
    """Labels are checked the same way traced or not (the hook makes calls take the traced path)."""

    def check_both_paths(self, fn, exc, pattern):
        with self.assertRaisesRegex(exc, pattern):
            fn()
        with recording() as calls:
            with self.assertRaisesRegex(exc, pattern):
                fn()
        self.assertEqual(calls, [], "nothing is sent for a rejected call")

    def test_limit_is_128_bytes_of_utf8(self):
        with recording() as calls:
            memscope.describe_label("a" * 128)
            memscope.undescribe("é" * 64)  # 128 bytes
        self.assertEqual([c[0] for c in calls], ["tag_push", "tag_pop"])
        self.check_both_paths(lambda: memscope.describe_label("a" * 129), ValueError, "129 bytes.*limit of 128")
        # 65 characters but 130 bytes: rejected untraced too, so attaching a tracer changes nothing.
        self.check_both_paths(lambda: memscope.describe_label("é" * 65), ValueError, "130 bytes.*limit of 128")
        self.check_both_paths(lambda: memscope.mark("m" * 200), ValueError, "message is 200 bytes")

    def test_nul_empty_and_types(self):
        self.check_both_paths(lambda: memscope.describe_label("a\0b"), ValueError, "NUL")
        self.check_both_paths(lambda: memscope.mark("a\0"), ValueError, "NUL")
        self.check_both_paths(lambda: memscope.describe_label(""), ValueError, "empty")
        self.check_both_paths(lambda: memscope.describe_label(b"x"), TypeError, "must be a str, not bytes")
        self.check_both_paths(lambda: memscope.range_start(3), TypeError, "must be a str")

    def test_levels(self):
        self.check_both_paths(lambda: memscope.describe_label("x", 8), ValueError, "level 8 is out of range")
        self.check_both_paths(lambda: memscope.describe_label("x", -1), ValueError, "out of range")
        self.check_both_paths(lambda: memscope.describe_label("x", "5"), TypeError, "level must be an int")
        self.check_both_paths(lambda: memscope.describe_label("x", level=None), TypeError, "level must be an int")

    def test_keyword_parsing(self):
        with recording() as calls:
            memscope.describe_label("x", level=memscope.PROCESS)
            memscope.undescribe(label="x", level=memscope.PROCESS)
        self.assertEqual(calls, [("tag_push", (2, "x")), ("tag_pop", (2, "x"))])
        with self.assertRaisesRegex(TypeError, "unexpected keyword argument 'lvl'"):
            memscope.describe_label("x", lvl=1)
        with self.assertRaisesRegex(TypeError, "multiple values for argument 'level'"):
            memscope.describe_label("x", 1, level=1)
        with self.assertRaisesRegex(TypeError, "missing required argument 'label'"):
            memscope.describe_label(level=1)
        with self.assertRaisesRegex(TypeError, "at most 2 arguments"):
            memscope.describe_label("x", 1, 2)

    def test_addr_checks(self):
        self.check_both_paths(lambda: _native.addr_tag(-1, "x"), ValueError, "address must be in 0..2")
        self.check_both_paths(lambda: _native.addr_tag(2 ** 64, "x"), ValueError, "address must be in 0..2")
        self.check_both_paths(lambda: _native.addr_tag("1", "x"), TypeError, "address must be an int")


class OperatorProbes(unittest.TestCase):
    """The probes memscope.torch.trace_ops fires. Their text comes from the framework, so it is
    clipped to 128 bytes (on a character boundary) rather than rejected; types and the access
    kind are checked the same way traced or not."""

    def test_sends_name_and_tensor_in_contract_order(self):
        with recording() as calls:
            _native.op_start("aten.mm.default")
            _native.tensor_access(0x7F0000001000, 128, 0, "float32[4,8]")
            _native.tensor_access(2 ** 64 - 1, 0, True, "")
            _native.op_end("aten.mm.default")
        self.assertEqual(calls, [("op_start", ("aten.mm.default",)),
                                 ("tensor_access", (0x7F0000001000, 128, 0, "float32[4,8]")),
                                 ("tensor_access", (2 ** 64 - 1, 0, 1, "")),
                                 ("op_end", ("aten.mm.default",))])

    def test_long_text_is_clipped_on_a_character_boundary(self):
        with recording() as calls:
            _native.op_start("a" * 300)
            _native.op_end("é" * 65)  # 130 bytes: 64 characters fit
            _native.tensor_access(1, 1, 1, "x" * 127 + "é")  # 129 bytes: the é does not fit
            _native.tensor_access(1, 1, 1, "a\0b")  # the C string ends at the NUL
        sent = [c[1][-1] for c in calls]
        self.assertEqual(sent, ["a" * 128, "é" * 64, "x" * 127, "a"])

    def test_checks_on_both_paths(self):
        for fn, exc, pattern in [
            (lambda: _native.op_start(b"x"), TypeError, "operator name must be a str"),
            (lambda: _native.op_end(None), TypeError, "operator name must be a str"),
            (lambda: _native.tensor_access(1, 1, 2, "x"), ValueError, "kind must be 0 \\(read\\) or 1"),
            (lambda: _native.tensor_access(1, 1, 2 ** 80, "x"), ValueError, "kind must be 0"),
            (lambda: _native.tensor_access(1, 1, 0.0, "x"), TypeError, "kind must be an int"),
            (lambda: _native.tensor_access(-1, 1, 0, "x"), ValueError, "address must be in 0..2"),
            (lambda: _native.tensor_access(1, -1, 0, "x"), ValueError, "size must be in 0..2"),
            (lambda: _native.tensor_access(1, 1, 0, 3), TypeError, "description must be a str"),
            (lambda: _native.tensor_access(1, 1, 0), TypeError, "takes 4 arguments"),
        ]:
            with self.subTest(pattern=pattern):
                with self.assertRaisesRegex(exc, pattern):
                    fn()
                with recording() as calls:
                    with self.assertRaisesRegex(exc, pattern):
                        fn()
                self.assertEqual(calls, [])

    def test_untraced_sends_nothing(self):
        self.assertFalse(_native._enabled("op_start"))
        self.assertIsNone(_native.op_start("aten.mm.default"))
        self.assertIsNone(_native.tensor_access(1, 2, 1, "x"))


class DescribeForms(unittest.TestCase):
    def test_with(self):
        with recording() as calls:
            with memscope.describe("outer"):
                with memscope.describe(owner="inner", level=memscope.PROCESS):
                    pass
        self.assertEqual(calls, [("tag_push", (USER, "outer")), ("tag_push", (2, "inner")),
                                 ("tag_pop", (2, "inner")), ("tag_pop", (USER, "outer"))])

    def test_with_pops_on_exception(self):
        with recording() as calls:
            with self.assertRaises(ZeroDivisionError):
                with memscope.describe("boom"):
                    1 / 0
        self.assertEqual(calls, [("tag_push", (USER, "boom")), ("tag_pop", (USER, "boom"))])

    def test_decorator(self):
        @memscope.describe("work")
        def work(x, y=1):
            """doc"""
            memscope.mark("inside")
            if x < 0:
                raise ValueError("neg")
            return x + y

        self.assertEqual(work.__name__, "work")
        self.assertEqual(work.__doc__, "doc")
        with recording() as calls:
            self.assertEqual(work(2, y=3), 5)
            with self.assertRaises(ValueError):
                work(-1)
        push, pop, inside = ("tag_push", (USER, "work")), ("tag_pop", (USER, "work")), ("mark", ("inside",))
        self.assertEqual(calls, [push, inside, pop, push, inside, pop])

    def test_decorator_rejects_bad_labels_and_generators_up_front(self):
        with self.assertRaisesRegex(ValueError, "limit of 128"):
            memscope.describe("x" * 200)(lambda: None)

        def gen():
            yield 1

        with self.assertRaisesRegex(TypeError, "generator"):
            memscope.describe("g")(gen)

    def test_explicit_start_stop_and_functions(self):
        with recording() as calls:
            d = memscope.describe("explicit").start()
            d.stop()
            memscope.describe_label("fn")
            memscope.undescribe("fn")
        self.assertEqual(calls, [("tag_push", (USER, "explicit")), ("tag_pop", (USER, "explicit")),
                                 ("tag_push", (USER, "fn")), ("tag_pop", (USER, "fn"))])

    def test_describers_are_shared_and_read_only(self):
        self.assertIs(memscope.describe("same"), memscope.describe(owner="same"))
        d = memscope.describe("same")
        self.assertEqual((d.label, d.level), ("same", USER))
        with self.assertRaises(AttributeError):
            d.label = "other"
        self.assertEqual(memscope.describe("lvl", level=memscope.PROCESS).level, memscope.PROCESS)

    def test_address_tagging(self):
        with recording() as calls:
            self.assertIsNone(memscope.describe(0x1000, owner="buf"))
            memscope.describe(FakeTensor(0x2000), owner="t", level=memscope.DETAIL_1)
            memscope.describe(DataPtrOnly(), owner="d")
            memscope.describe(FakeDTensor(FakeTensor(0x3000)), owner="shard")
            memscope.describe(0, owner="empty")  # nothing to tag
            memscope.describe(FakeTensor(0, 0), owner="empty")
        self.assertEqual(calls, [("addr_tag", (0x1000, memscope.USER_DEFINED_1, "buf")),
                                 ("addr_tag", (0x2000, memscope.DETAIL_1, "t")),
                                 ("addr_tag", (0x5000, memscope.USER_DEFINED_1, "d")),
                                 ("addr_tag", (0x3000, memscope.USER_DEFINED_1, "shard"))])
        with self.assertRaisesRegex(ValueError, "limit of 128"):
            memscope.describe(0, owner="x" * 129)  # checked even when there is nothing to tag

    def test_misuse(self):
        with self.assertRaisesRegex(TypeError, "needs a label"):
            memscope.describe()
        with self.assertRaisesRegex(TypeError, "both as the first argument and as owner"):
            memscope.describe("a", owner="b")
        with self.assertRaisesRegex(TypeError, "needs owner="):
            memscope.describe(0x1000)
        with self.assertRaisesRegex(TypeError, "cannot tag a list"):
            memscope.describe([1], owner="x")


class TestHook(unittest.TestCase):
    def test_returns_previous_and_propagates_errors(self):
        def boom(probe, args):
            raise RuntimeError("hook says no")

        self.assertIsNone(_native._set_test_hook(boom))
        try:
            with self.assertRaisesRegex(RuntimeError, "hook says no"):
                memscope.mark("x")
        finally:
            self.assertIs(_native._set_test_hook(None), boom)
        with self.assertRaises(TypeError):
            _native._set_test_hook(3)
        self.assertFalse(_native._enabled("step"))
        with recording():
            self.assertTrue(_native._enabled("step"))
        with self.assertRaisesRegex(ValueError, "no memscope probe"):
            _native._enabled("nope")


class MsMemScopeCompat(unittest.TestCase):
    def test_config(self):
        from memscope import msmemscope

        msmemscope.config(events="alloc,free", analysis="leaks", call_stack="c:10,python:5", output_path="/tmp/x",
                          data_format="db", output="o", device="npu:0", level="op", watch="start", format="db")
        self.assertEqual(msmemscope.get_config()["events"], "alloc,free")
        with self.assertRaisesRegex(TypeError, "must be a str"):
            msmemscope.config(level=0)
        with self.assertRaisesRegex(ValueError, "unknown option 'colour'"):
            msmemscope.config(colour="red")
        with self.assertRaisesRegex(TypeError, "keyword arguments only"):
            msmemscope.config("x")

    def test_collection_and_step(self):
        from memscope import msmemscope

        with recording() as calls:
            msmemscope.start()
            n = msmemscope.step()
            msmemscope.stop()
        self.assertEqual(calls, [("collect", (1,)), ("step", (n,)), ("collect", (0,))])

    def test_describer_forms(self):
        import memscope.msmemscope.describe as describe

        @describe.describer(owner="deco")
        def f():
            return 7

        with recording() as calls:
            self.assertEqual(f(), 7)
            with describe.describer(owner="with"):
                pass
            d = describe.describer(owner="explicit")
            d.__enter__()
            d.__exit__(None, None, None)
            describe.describer(FakeTensor(0x7000), owner="tensor")
            describe.describer(0x8000, owner="addr")
        self.assertEqual(calls, [
            ("tag_push", (USER, "deco")), ("tag_pop", (USER, "deco")),
            ("tag_push", (USER, "with")), ("tag_pop", (USER, "with")),
            ("tag_push", (USER, "explicit")), ("tag_pop", (USER, "explicit")),
            ("addr_tag", (0x7000, memscope.USER_DEFINED_1, "tensor")),
            ("addr_tag", (0x8000, memscope.USER_DEFINED_1, "addr")),
        ])


if __name__ == "__main__":
    unittest.main()
