"""Optional end-to-end check with an independent USDT consumer: bpftrace attaches to a child
process's markers, raises the semaphores, and must read every argument as the contract says.

This proves the note layout against a real tracer without depending on memscope-bpf. It needs
root and bpftrace, so it runs only when MEMSCOPE_TEST_BPFTRACE=1 (the default test run stays
unprivileged).
"""

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _support import _native  # noqa: E402

ENABLED = os.environ.get("MEMSCOPE_TEST_BPFTRACE") == "1"
WHY_NOT = ("set MEMSCOPE_TEST_BPFTRACE=1 to run" if not ENABLED else
           "needs root" if os.geteuid() != 0 else
           "bpftrace not installed" if not shutil.which("bpftrace") else
           "probes not compiled on this platform" if not _native.PROBES_COMPILED else None)

CHILD = textwrap.dedent("""
    import sys, memscope
    print("ready", flush=True)
    if not memscope.wait_for_tracer(timeout=30):
        sys.exit("tracer never attached")
    print("sems", min(memscope.semaphores().values()), flush=True)
    with memscope.describe("span"):
        memscope.describe(0xabc000, owner="blk-\u00e9", level=memscope.DETAIL_1)
    memscope.step()
    rid = memscope.range_start("r")
    memscope.range_end(rid)
    memscope.mark("m")
    memscope.start()
    memscope.stop()
    from memscope import _native
    _native.op_start("aten.mm.default")
    _native.tensor_access(0xabc010, 128, 1, "float32[4,8]")
    _native.op_end("aten.mm.default")
""")

SCRIPT = """
usdt:{so}:memscope:tag_push {{ printf("tag_push %d %s\\n", arg0, str(arg1)); }}
usdt:{so}:memscope:tag_pop {{ printf("tag_pop %d %s\\n", arg0, str(arg1)); }}
usdt:{so}:memscope:addr_tag {{ printf("addr_tag %x %d %s\\n", arg0, arg1, str(arg2)); }}
usdt:{so}:memscope:step {{ printf("step %d\\n", arg0); }}
usdt:{so}:memscope:mark {{ printf("mark %s\\n", str(arg0)); }}
usdt:{so}:memscope:range_start {{ printf("range_start %d %s\\n", arg0, str(arg1)); }}
usdt:{so}:memscope:range_end {{ printf("range_end %d\\n", arg0); }}
usdt:{so}:memscope:collect {{ printf("collect %d\\n", arg0); }}
usdt:{so}:memscope:op_start {{ printf("op_start %s\\n", str(arg0)); }}
usdt:{so}:memscope:op_end {{ printf("op_end %s\\n", str(arg0)); }}
usdt:{so}:memscope:tensor_access {{ printf("tensor_access %x %d %d %s\\n", arg0, arg1, arg2, str(arg3)); }}
"""


@unittest.skipIf(WHY_NOT, WHY_NOT)
class Bpftrace(unittest.TestCase):
    def test_bpftrace_reads_every_probe(self):
        with tempfile.TemporaryDirectory() as tmp:
            script = os.path.join(tmp, "m.bt")
            with open(script, "w") as f:
                f.write(SCRIPT.format(so=os.path.realpath(_native.__file__)))
            child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
            try:
                self.assertEqual(child.stdout.readline().strip(), "ready")  # the .so is mapped now
                bt = subprocess.Popen(["bpftrace", "-p", str(child.pid), script], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
                child_out, _ = child.communicate(timeout=60)
                bt_out, _ = bt.communicate(timeout=30)
            finally:
                if child.poll() is None:
                    child.kill()
            self.assertEqual(child.returncode, 0, child_out + bt_out)
            self.assertIn("sems 1", child_out, "bpftrace raised every semaphore")
            lines = [line for line in bt_out.splitlines() if line.split(" ")[0] in _native.PROBES]
            self.assertEqual(lines, [
                "tag_push 5 span", "addr_tag abc000 3 blk-\u00e9", "tag_pop 5 span", "step 1", "range_start 1 r",
                "range_end 1", "mark m", "collect 1", "collect 0", "op_start aten.mm.default",
                "tensor_access abc010 128 1 float32[4,8]", "op_end aten.mm.default",
            ], bt_out)


if __name__ == "__main__":
    unittest.main()
