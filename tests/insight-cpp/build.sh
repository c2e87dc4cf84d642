#!/usr/bin/env bash
# Builds insight-harness: MindStudio Insight's own memscope server sources, unmodified, from the
# checkout named by INSIGHT_SRC, with our stand-ins for its framework (stub/) and our main.cpp.
#
#   INSIGHT_SRC=/path/to/msinsight-checkout tests/insight-cpp/build.sh [OUT]
#
# OUT defaults to target/insight-cpp/insight-harness (under the repo root). Needs g++ (C++17),
# SQLite's headers and library (Debian: libsqlite3-dev) and rapidjson's headers (Debian:
# rapidjson-dev); RAPIDJSON_INCLUDE names another folder holding rapidjson/document.h (such as
# an Insight checkout's downloaded third_party). Prints the binary's path on success.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${1:-$root/target/insight-cpp/insight-harness}"

: "${INSIGHT_SRC:?set INSIGHT_SRC to a MindStudio Insight checkout (its root folder)}"
mod="$INSIGHT_SRC/server/src/modules/memscope"
[ -d "$mod" ] || { echo "no $mod: INSIGHT_SRC must be an Insight checkout's root" >&2; exit 1; }

# Insight's sources compiled as they are.
sources=(
    "$mod/database/MemScopeDatabase.cpp"
    "$mod/parser/MemScopeParser.cpp"
    "$mod/service/MemScopeEntities.cpp"
    "$mod/handler/QueryMemScopePythonTraceHandler.cpp"
)

includes=(-I"$here/stub")
for d in "$mod" "$mod/parser" "$mod/database" "$mod/protocol" "$mod/handler" "$mod/service"; do
    includes+=(-I"$d")
done
rj=""
for cand in "${RAPIDJSON_INCLUDE:-}" /usr/include /usr/local/include \
    "$INSIGHT_SRC/server/third_party/rapidjson/include"; do
    if [ -n "$cand" ] && [ -f "$cand/rapidjson/document.h" ]; then rj="$cand"; break; fi
done
[ -n "$rj" ] || { echo "rapidjson headers not found: install rapidjson-dev or set RAPIDJSON_INCLUDE" >&2; exit 1; }
includes+=(-isystem "$rj")

mkdir -p "$(dirname "$out")"
obj="$(dirname "$out")/obj"
mkdir -p "$obj"
cxx="${CXX:-g++}"
flags=(-std=c++17 -O1 -g -Wno-deprecated-declarations)
objs=()
for src in "${sources[@]}" "$here/stub/insight_stubs.cpp" "$here/main.cpp"; do
    o="$obj/$(basename "$src" .cpp).o"
    "$cxx" "${flags[@]}" "${includes[@]}" -c "$src" -o "$o"
    objs+=("$o")
done
"$cxx" "${objs[@]}" -o "$out" -lsqlite3 -pthread
echo "$out"
