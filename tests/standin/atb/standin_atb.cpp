/*
 * STAND-IN libatb.so for memscope-bpf's tests. It is not Ascend Transformer Boost (ATB).
 *
 * What it reproduces is what a tracer of ATB sees: the exported atb::Runner::Execute(
 * atb::RunnerVariantPack&) (the symbol msMemScope's ATB hook interposes), called with a pack
 * whose workspace fields sit where open-source ATB puts them (atb_standin.h), and a workspace the caller
 * took from torch_npu's workspace allocator, as op-plugin does for ATB operations (the caller
 * allocates: Operation::Setup says how much, Operation::Execute gets the buffer).
 *
 * The graph and its memory model. A stand-in graph operation runs five nodes over five
 * intermediate tensors of fixed sizes (in units the caller chooses) and lifetimes (the node that
 * writes a tensor to the last node that reads it):
 *
 *     tensor   size (units)   live at nodes
 *     t0       8              0..1
 *     t1       8              1..2
 *     t2       16             2..3
 *     t3       8              3..4
 *     t4       4              4..5
 *
 * Setup lays the intermediates out in one buffer according to ATB_WORKSPACE_MEM_ALLOC_ALG_TYPE,
 * read once per graph at creation:
 *   - unset, 1 or anything unknown: every intermediate gets its own range (44 units);
 *   - 2: a range is reused whole by a later tensor no larger than it once its tensor is dead
 *        (best fit, never split: 32 units);
 *   - 3 (and 0): offsets are reused wherever lifetimes do not overlap, placing the largest
 *        tensors first at the lowest free offset (24 units, the peak of live intermediate bytes).
 * This is NOT ATB's algorithm (ATB's block, heap and brute-force solvers are not reproduced, and
 * its default 1 does reuse memory); it models only the observable effect a tracer can measure:
 * the intermediate buffer size each choice asks for, which is what the advisor reasons about.
 * The kernels' own scratch is one unit. Both are rounded up to 512 bytes, and the workspace the
 * caller must provide is their sum, as ATB's Setup computes it.
 *
 * Ground truth for tests: Execute fills a StandinAtbExecution with the pack it ran with and
 * counts executions; the workload logs both. Nothing here touches device memory.
 */
#include <time.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "atb_standin.h"

#define EXPORT __attribute__((visibility("default")))

namespace {

constexpr uint64_t kAlign = 512;
constexpr int kNodes = 5;

struct Intermediate {
    uint64_t units;
    int first;
    int last;
};

constexpr Intermediate kGraph[] = {{8, 0, 1}, {8, 1, 2}, {16, 2, 3}, {8, 3, 4}, {4, 4, 5}};
constexpr size_t kTensors = sizeof kGraph / sizeof kGraph[0];

uint64_t align(uint64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

bool overlap(const Intermediate &a, const Intermediate &b) { return a.first <= b.last && b.first <= a.last; }

/* ATB_WORKSPACE_MEM_ALLOC_ALG_TYPE as the stand-in understands it (see the header comment). */
int alg_type() {
    const char *v = std::getenv("ATB_WORKSPACE_MEM_ALLOC_ALG_TYPE");
    if (v == nullptr || *v == '\0') {
        return 1;
    }
    char *end = nullptr;
    long n = std::strtol(v, &end, 10);
    if (*end != '\0' || n < 0 || n > 3) {
        return 1;
    }
    return (int)n;
}

uint64_t own_ranges() {
    uint64_t sum = 0;
    for (const auto &t : kGraph) {
        sum += t.units;
    }
    return sum;
}

uint64_t whole_range_reuse() {
    struct Range {
        uint64_t units;
        int free_after;  // the last node of the tensor holding it
    };
    std::vector<Range> ranges;
    for (const auto &t : kGraph) {
        Range *best = nullptr;
        for (auto &r : ranges) {
            if (r.free_after < t.first && r.units >= t.units && (best == nullptr || r.units < best->units)) {
                best = &r;
            }
        }
        if (best != nullptr) {
            best->free_after = t.last;
        } else {
            ranges.push_back(Range{t.units, t.last});
        }
    }
    uint64_t sum = 0;
    for (const auto &r : ranges) {
        sum += r.units;
    }
    return sum;
}

uint64_t lifetime_reuse() {
    size_t order[kTensors];
    for (size_t i = 0; i < kTensors; ++i) {
        order[i] = i;
    }
    // Largest first; ties in node order.
    for (size_t i = 1; i < kTensors; ++i) {
        for (size_t j = i; j > 0 && kGraph[order[j]].units > kGraph[order[j - 1]].units; --j) {
            size_t t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    }
    uint64_t offset[kTensors] = {};
    bool placed[kTensors] = {};
    uint64_t end = 0;
    for (size_t k = 0; k < kTensors; ++k) {
        const Intermediate &t = kGraph[order[k]];
        uint64_t at = 0;
        for (bool moved = true; moved;) {
            moved = false;
            for (size_t o = 0; o < kTensors; ++o) {
                const Intermediate &u = kGraph[o];
                if (placed[o] && overlap(t, u) && at < offset[o] + u.units && offset[o] < at + t.units) {
                    at = offset[o] + u.units;
                    moved = true;
                }
            }
        }
        offset[order[k]] = at;
        placed[order[k]] = true;
        if (at + t.units > end) {
            end = at + t.units;
        }
    }
    return end;
}

uint64_t intermediate_units(int alg) {
    switch (alg) {
    case 0:
    case 3:
        return lifetime_reuse();
    case 2:
        return whole_range_reuse();
    default:
        return own_ranges();
    }
}

unsigned long long now_ns() {
    timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ULL + (unsigned long long)ts.tv_nsec;
}

/* A graph operation: its runner and the sizes its Setup computed. */
struct Graph {
    atb::Runner runner;
    uint64_t unit;
    int alg;
    uint64_t workspace;
    uint64_t intermediate;
    Graph(uint64_t unit_bytes, int alg_value)
        : runner("StandinGraphRunner"),
          unit(unit_bytes),
          alg(alg_value),
          workspace(align(unit_bytes)),
          intermediate(align(intermediate_units(alg_value) * unit_bytes)) {}
};

}  // namespace

namespace atb {

Runner::Runner(const std::string &name) : name_(name) {}

Runner::~Runner() = default;

/* The traced function. The "kernels" only check that the workspace they were given is there. */
__attribute__((noinline)) Status Runner::Execute(RunnerVariantPack &runnerVariantPack) {
    ++executeCount_;
    if (runnerVariantPack.workspaceBuffer == nullptr && runnerVariantPack.workspaceBufferSize != 0) {
        return 1;
    }
    if (runnerVariantPack.intermediateBuffer == nullptr && runnerVariantPack.intermediateBufferSize != 0) {
        return 1;
    }
    for (int node = 0; node < kNodes; ++node) {
        asm volatile("" ::: "memory");
    }
    return 0;
}

}  // namespace atb

extern "C" {

/* What one Execute ran with, as the stand-in saw it. */
struct StandinAtbExecution {
    uint64_t runner;
    uint64_t workspace_ptr;
    uint64_t workspace_size;
    uint64_t intermediate_ptr;
    uint64_t intermediate_size;
    uint64_t execute_count;
    uint64_t t0;
    uint64_t t1;
    int32_t status;
    int32_t alg_type;
};

/* A graph operation whose tensors are `unit_bytes` per unit (see the header comment). */
EXPORT void *standin_atb_graph_create(uint64_t unit_bytes) { return new Graph(unit_bytes, alg_type()); }

EXPORT void standin_atb_graph_destroy(void *graph) { delete static_cast<Graph *>(graph); }

/* Setup: the workspace the caller must provide (kernels' scratch + intermediates), and its parts. */
EXPORT uint64_t standin_atb_graph_setup(void *graph, uint64_t *workspace_size, uint64_t *intermediate_size,
                                        int32_t *alg) {
    const Graph *g = static_cast<const Graph *>(graph);
    *workspace_size = g->workspace;
    *intermediate_size = g->intermediate;
    *alg = g->alg;
    return g->workspace + g->intermediate;
}

/* Execute on the caller's workspace of `size` bytes (at least what Setup asked for). */
EXPORT int32_t standin_atb_graph_execute(void *graph, void *workspace, uint64_t size, StandinAtbExecution *out) {
    Graph *g = static_cast<Graph *>(graph);
    if (size < g->workspace + g->intermediate) {
        return 1;
    }
    auto *pack = new atb::RunnerVariantPack();
    auto *base = static_cast<uint8_t *>(workspace);
    pack->workspaceBuffer = base;
    pack->workspaceBufferSize = g->workspace;
    pack->intermediateBuffer = base + g->workspace;
    pack->intermediateBufferSize = g->intermediate;
    uint64_t t0 = now_ns();
    atb::Status st = g->runner.Execute(*pack);
    uint64_t t1 = now_ns();
    *out = StandinAtbExecution{(uint64_t)(uintptr_t)&g->runner,
                               (uint64_t)(uintptr_t)pack->workspaceBuffer,
                               pack->workspaceBufferSize,
                               (uint64_t)(uintptr_t)pack->intermediateBuffer,
                               pack->intermediateBufferSize,
                               g->runner.executeCount(),
                               t0,
                               t1,
                               st,
                               g->alg};
    delete pack;
    return st;
}

}  // extern "C"
