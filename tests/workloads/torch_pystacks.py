"""Python stacks with REAL PyTorch: a CPU tensor of a size no other allocation has, made from a
call chain known by construction. The ledger (--ledger) is the interpreter's own account, from
`traceback.extract_stack()` at the call: `alloc <data_ptr> <nbytes>`, then `frame
<file>:<line>:<function>` innermost first (this script's frames only), then `end`.
"""

import argparse
import time
import traceback

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--ledger", required=True)
parser.add_argument("--wait", type=float, default=1.5, help="seconds for the tracer to find libc10 and the interpreter")
args = parser.parse_args()
NBYTES = 1_234_567
kept = []


def make_tensor():
    here = traceback.extract_stack()
    line = here[-1].lineno + 2  # the torch.empty call, two lines down
    t = torch.empty(NBYTES, dtype=torch.uint8)
    kept.append(t)
    frames = [(__file__, line, "make_tensor")] + [(f.filename, f.lineno, f.name) for f in reversed(here[:-1]) if f.filename == __file__]
    with open(args.ledger, "w") as out:
        out.write(f"alloc {t.untyped_storage().data_ptr():#x} {NBYTES}\n")
        for file, no, name in frames:
            out.write(f"frame {file}:{no}:{name}\n")
        out.write("end\n")


class Trainer:
    def setup(self):
        make_tensor()


time.sleep(args.wait)
Trainer().setup()
time.sleep(0.3)
