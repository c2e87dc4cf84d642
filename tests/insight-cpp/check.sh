#!/usr/bin/env bash
# Opt-in check: builds insight-harness from the Insight checkout in INSIGHT_SRC, writes the test
# DB (make_test_db.py, with the touching-intervals thread), runs Insight's code on it and
# compares the slices it draws with the expected ones. Skips (exit 0) without INSIGHT_SRC.
#
#   INSIGHT_SRC=/path/to/msinsight-checkout tests/insight-cpp/check.sh
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -z "${INSIGHT_SRC:-}" ]; then
    echo "insight-cpp: INSIGHT_SRC not set, skipped"
    exit 0
fi
bin="$("$here/build.sh")"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 "$here/make_test_db.py" "$work/test.db" --expected "$work/expected.jsonl" --with-touching
INSIGHT_HARNESS_QUIET=1 "$bin" "$work/test.db" > "$work/out.jsonl"
grep '"kind":"slice"' "$work/out.jsonl" > "$work/slices.jsonl" || true
if diff -u "$work/expected.jsonl" "$work/slices.jsonl"; then
    echo "insight-cpp: $(wc -l < "$work/slices.jsonl") slices as expected"
    echo "1 passed, 0 failed"
else
    echo "insight-cpp: Insight drew other slices than expected (diff above)"
    echo "0 passed, 1 failed"
    exit 1
fi
