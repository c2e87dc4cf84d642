#!/usr/bin/env bash
# The GPU check: traces a short real PyTorch training loop on an NVIDIA GPU with memscope-bpf
# and checks the trace against PyTorch's own numbers (tests/gpu/README.md says what and how).
# Not part of CI. Run as root from the repository root, after `cargo xtask build`:
#
#   sudo tests/gpu/run.sh [PYTHON]        # PYTHON: an interpreter with a CUDA torch (default python3)
#
# Prints one PASS/FAIL line per check and exits non-zero if any failed; under 5 minutes.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
python=${1:-python3}
bin=${MEMSCOPE_BIN:-$root/target/release/memscope-bpf}
markers=${MEMSCOPE_MARKERS:-$root/target/markers}
out=$(mktemp -d /tmp/memscope-gpu-check.XXXXXX)

fail() { echo "FAIL  $*"; exit 1; }
[ "$(id -u)" = 0 ] || fail "run as root (the tracer loads BPF): sudo $0"
[ -x "$bin" ] || fail "no $bin: run \`cargo xtask build\` first"
[ -d "$markers/memscope" ] || fail "no markers package in $markers: run \`cargo xtask build\` first"
"$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
    || fail "$python has no torch that sees a CUDA GPU"
echo "PASS  a CUDA GPU and torch: $("$python" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))')"
c10_cuda=$("$python" -c 'import importlib.util, os; print(os.path.join(os.path.dirname(importlib.util.find_spec("torch").origin), "lib", "libc10_cuda.so"))')
[ -f "$c10_cuda" ] || fail "no $c10_cuda: this torch is not a CUDA build"

status=0
for conf in "" "expandable_segments:True"; do
    label=${conf:-default settings}
    dir="$out/${conf:+expandable}${conf:-default}"
    mkdir -p "$dir"
    echo "---- PYTORCH_CUDA_ALLOC_CONF=${conf} ($label)"
    if ! PYTORCH_CUDA_ALLOC_CONF=$conf PYTHONPATH="$markers${PYTHONPATH:+:$PYTHONPATH}" timeout 120 \
        "$bin" trace --output "$dir/trace" -- "$python" "$here/train.py" --ledger "$dir/ledger.json" \
        > "$dir/trace.log" 2>&1; then
        echo "FAIL  the traced training loop did not finish (see $dir/trace.log):"
        tail -5 "$dir/trace.log"
        status=1
        continue
    fi
    echo "PASS  the training loop ran under the tracer"
    "$python" "$here/verify.py" "$dir/trace" "$dir/ledger.json" || status=1
done
echo "traces and ledgers kept in $out"
exit $status
