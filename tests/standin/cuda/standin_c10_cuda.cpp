/*
 * STAND-IN libc10_cuda.so for memscope-bpf's tests. It is not PyTorch.
 *
 * A small caching allocator shaped like PyTorch's CUDA one (c10/cuda/CUDACachingAllocator.cpp),
 * with what the tracer relies on in the real library:
 * - the USDT probes `pytorch:malloc(ptr, int8 device, size, stream id)` at the end of an
 *   allocation and `pytorch:free(ptr)` before a block goes back, each a 1-byte nop behind a
 *   semaphore in `.probes` (the semaphore is read first: an untraced process skips the site);
 * - the internals under their real mangled names, as local functions of `.symtab` only
 *   (hidden visibility, not stripped): `DeviceCachingAllocator::malloc/free/alloc_block/
 *   map_block/release_block`. `alloc_block` takes a segment with cudaMalloc, or, with expandable
 *   segments on, through `map_block`: 2 MiB pages of physical memory (cuMemCreate) mapped
 *   (cuMemMap) into one reserved range (cuMemAddressReserve);
 * - caching: a freed block is kept for reuse, a segment goes back only on empty_cache, or when an
 *   allocation would not fit (then the allocation is retried once before it fails).
 * Blocks are rounded to 512 bytes; a request up to 1 MiB is carved from a 2 MiB segment, one up
 * to 10 MiB from a 20 MiB one, a larger one gets a segment of its own (rounded to 2 MiB).
 *
 * Ground truth for tests: with STANDIN_C10_CUDA_LEDGER=<path>, every block and segment event is
 * appended as one JSON line (`ev`: block_malloc, block_free, segment_alloc, segment_free,
 * segment_map, segment_unmap, oom; the thread, the device, the address, the size, when the step
 * began and ended) with the device's allocated and reserved bytes right after it, as the stand-in
 * torch_npu's ledger has them. Block sizes are rounded, so a request that is a multiple of 512
 * bytes is its block's size.
 */
#include "cuda_standin.h"
#include "../common/standin_common.h"
#include "../../../markers/src/memscope/memscope_usdt.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <map>
#include <mutex>
#include <vector>

#define INTERNAL __attribute__((noinline, noclone, visibility("hidden")))
#define STANDIN_EXPORT extern "C" __attribute__((visibility("default"), noinline, used))

/* ---- USDT sites as PyTorch's static_tracepoint.h makes them: a 1-byte nop, natural sizes.
 * The note and semaphore come from our markers' header (the same SystemTap v3 format). ---- */
#define SDT_SEMAPHORE(name) MEMSCOPE_USDT_SEMAPHORE(sdt_semaphore_##name)
#define SDT_NOTE(provider, name, sem, args) _MSU_ASM_AT("nop", provider, name, sem, args)
/* nopl 0x0(%rax,%rax,1), as our markers' sites: only for the bench's comparison. arm64 has one
 * instruction size, so its sites are all the same `nop` (the arm64 VM builds this file too). */
#if defined(__x86_64__)
#define SDT_NOP5 ".byte 0x0f, 0x1f, 0x44, 0x00, 0x00"
#else
#define SDT_NOP5 "nop"
#endif
#define SDT_NOTE_AT(nop, provider, name, sem, args) _MSU_ASM_AT(nop, provider, name, sem, args)

SDT_SEMAPHORE(pytorch_malloc);
SDT_SEMAPHORE(pytorch_free);

static inline void probe_malloc(void *ptr, int8_t device, size_t size, int64_t stream) {
    if (sdt_semaphore_pytorch_malloc) {
        __asm__ __volatile__(SDT_NOTE(pytorch, malloc, sdt_semaphore_pytorch_malloc,
                                      "-8@%[p] -1@%[d] -8@%[s] -8@%[t]")
                             :
                             : [p] "nor"((int64_t)(uintptr_t)ptr), [d] "nor"(device), [s] "nor"((int64_t)size),
                               [t] "nor"(stream));
    }
}

static inline void probe_free(void *ptr) {
    if (sdt_semaphore_pytorch_free) {
        __asm__ __volatile__(SDT_NOTE(pytorch, free, sdt_semaphore_pytorch_free, "-8@%[p]")
                             :
                             : [p] "nor"((int64_t)(uintptr_t)ptr));
    }
}

/* The same probe on a 5-byte nop: `cargo xtask bench` times a hit of each kind. */
static inline void probe_free_nop5(void *ptr) {
    if (sdt_semaphore_pytorch_free) {
        __asm__ __volatile__(SDT_NOTE_AT(SDT_NOP5, pytorch, free, sdt_semaphore_pytorch_free, "-8@%[p]")
                             :
                             : [p] "nor"((int64_t)(uintptr_t)ptr));
    }
}

/* ---- the ledger ---- */
static FILE *ledger_file() {
    static FILE *file = standin_ledger("STANDIN_C10_CUDA_LEDGER");
    return file;
}

namespace c10 {
namespace cuda {
namespace CUDACachingAllocator {
namespace Native {
namespace {

constexpr size_t kPage = (size_t)2 << 20;

struct Segment {
    uintptr_t base;
    size_t size;
    size_t carved;
    int live;
    bool small;
    std::vector<CUmemGenericAllocationHandle> pages; /* expandable segments only */
};

struct Block {
    uintptr_t ptr;
    size_t size;
    Segment *segment;
    bool allocated;
};

struct AllocParams {
    size_t size;
    bool small;
    Segment *segment;
};

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

}  // namespace

class DeviceCachingAllocator {
  public:
    /* One ledger line: `t0` when the step began (its end is now). */
    void note(const char *ev, unsigned long long t0, uintptr_t ptr, size_t size) const;
    explicit DeviceCachingAllocator(int device) : device_(device) {}
    INTERNAL Block *malloc(size_t size, cudaStream_t stream);
    INTERNAL void free(Block *block);
    INTERNAL bool alloc_block(AllocParams &params, bool is_retry);
    INTERNAL bool map_block(Segment *segment, size_t size);
    INTERNAL void release_block(Segment *segment);
    void empty_cache();
    bool expandable = false;
    unsigned long long allocated = 0, reserved = 0;

  private:
    Block *carve(Segment *segment, size_t size);
    int device_;
    std::vector<Segment *> segments_;
    std::multimap<size_t, Block *> cached_;
    CUdeviceptr va_base_ = 0;
    size_t va_used_ = 0;
};

void DeviceCachingAllocator::note(const char *ev, unsigned long long t0, uintptr_t ptr, size_t size) const {
    FILE *f = ledger_file();
    if (f == nullptr) {
        return;
    }
    unsigned long long t = standin_now_ns();
    std::fprintf(f,
                 "{\"ev\":\"%s\",\"pool\":\"caching\",\"tid\":%ld,\"device\":%d,\"ptr\":%llu,\"size\":%zu,"
                 "\"allocated\":%llu,\"reserved\":%llu,\"t0\":%llu,\"t1\":%llu,\"t\":%llu}\n",
                 ev, (long)syscall(SYS_gettid), device_, (unsigned long long)ptr, size, allocated, reserved, t0, t,
                 t);
    std::fflush(f);
}

Block *DeviceCachingAllocator::carve(Segment *segment, size_t size) {
    Block *block = new Block{segment->base + segment->carved, size, segment, true};
    segment->carved += size;
    return block;
}

Block *DeviceCachingAllocator::malloc(size_t size, cudaStream_t stream) {
    (void)stream;
    size_t rounded = round_up(size ? size : 1, 512);
    bool small = rounded <= ((size_t)1 << 20);
    Block *block = nullptr;
    for (auto it = cached_.lower_bound(rounded); it != cached_.end(); ++it) {
        if (it->second->segment->small == small) {
            block = it->second;
            cached_.erase(it);
            block->allocated = true;
            break;
        }
    }
    for (size_t i = 0; block == nullptr && i < segments_.size(); i++) {
        Segment *s = segments_[i];
        if (s->small == small && s->size - s->carved >= rounded) {
            block = carve(s, rounded);
        }
    }
    if (block == nullptr) {
        size_t segment_size = small ? kPage : rounded < ((size_t)10 << 20) ? ((size_t)20 << 20) : round_up(rounded, kPage);
        AllocParams params{segment_size, small, nullptr};
        unsigned long long t0 = standin_now_ns();
        if (!alloc_block(params, false)) {
            empty_cache();
            if (!alloc_block(params, true)) {
                note("oom", t0, 0, rounded);
                return nullptr;
            }
        }
        block = carve(params.segment, rounded);
    }
    block->segment->live++;
    allocated += block->size;
    return block;
}

void DeviceCachingAllocator::free(Block *block) {
    block->allocated = false;
    block->segment->live--;
    allocated -= block->size;
    cached_.emplace(block->size, block);
}

bool DeviceCachingAllocator::alloc_block(AllocParams &params, bool is_retry) {
    (void)is_retry;
    Segment *segment = new Segment{0, params.size, 0, 0, params.small, {}};
    unsigned long long t0 = standin_now_ns();
    bool ok;
    if (expandable) {
        ok = map_block(segment, params.size);
    } else {
        void *ptr = nullptr;
        ok = cudaMalloc(&ptr, params.size) == cudaSuccess;
        segment->base = (uintptr_t)ptr;
    }
    if (!ok) {
        delete segment;
        return false;
    }
    segments_.push_back(segment);
    params.segment = segment;
    reserved += segment->size;
    if (segment->pages.empty()) {
        note("segment_alloc", t0, segment->base, segment->size);
    }
    return true;
}

bool DeviceCachingAllocator::map_block(Segment *segment, size_t size) {
    if (va_base_ == 0 && cuMemAddressReserve(&va_base_, (size_t)64 << 30, kPage, 0, 0) != CUDA_SUCCESS) {
        return false;
    }
    segment->base = va_base_ + va_used_;
    CUmemAllocationProp prop{};
    prop.type = 1;
    prop.location.type = 1;
    prop.location.id = device_;
    for (size_t off = 0; off < size; off += kPage) {
        unsigned long long t0 = standin_now_ns();
        CUmemGenericAllocationHandle handle = 0;
        if (cuMemCreate(&handle, kPage, &prop, 0) != CUDA_SUCCESS) {
            for (size_t i = 0; i < segment->pages.size(); i++) {
                cuMemUnmap(segment->base + i * kPage, kPage);
                cuMemRelease(segment->pages[i]);
            }
            return false;
        }
        cuMemMap(segment->base + off, kPage, 0, handle, 0);
        segment->pages.push_back(handle);
        note("segment_map", t0, segment->base + off, kPage);
    }
    va_used_ += size;
    return true;
}

void DeviceCachingAllocator::release_block(Segment *segment) {
    unsigned long long t0 = standin_now_ns();
    if (segment->pages.empty()) {
        cudaFree((void *)segment->base);
        reserved -= segment->size;
        note("segment_free", t0, segment->base, segment->size);
        return;
    }
    for (size_t i = 0; i < segment->pages.size(); i++) {
        t0 = standin_now_ns();
        cuMemUnmap(segment->base + i * kPage, kPage);
        cuMemRelease(segment->pages[i]);
        reserved -= kPage;
        note("segment_unmap", t0, segment->base + i * kPage, kPage);
    }
}

void DeviceCachingAllocator::empty_cache() {
    std::vector<Segment *> kept;
    for (Segment *s : segments_) {
        if (s->live > 0) {
            kept.push_back(s);
            continue;
        }
        for (auto it = cached_.begin(); it != cached_.end();) {
            if (it->second->segment == s) {
                delete it->second;
                it = cached_.erase(it);
            } else {
                ++it;
            }
        }
        release_block(s);
        delete s;
    }
    segments_ = kept;
}

}  // namespace Native
}  // namespace CUDACachingAllocator
}  // namespace cuda
}  // namespace c10

using c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator;

static std::mutex mutex;
static std::map<int, DeviceCachingAllocator *> allocators;
static std::map<uintptr_t, std::pair<int, c10::cuda::CUDACachingAllocator::Native::Block *>> live;
static bool expandable_segments;

static DeviceCachingAllocator *allocator(int device) {
    DeviceCachingAllocator *&a = allocators[device];
    if (a == nullptr) {
        a = new DeviceCachingAllocator(device);
        a->expandable = expandable_segments;
    }
    return a;
}

/* NativeCachingAllocator::allocate: on the device's allocator, with the thread on that device. */
STANDIN_EXPORT void *standin_c10_cuda_allocate(size_t size, int device) {
    unsigned long long t0 = standin_now_ns();
    std::lock_guard<std::mutex> guard(mutex);
    int current = -1;
    if (cudaGetDevice(&current) != cudaSuccess || current != device) {
        cudaSetDevice(device);
    }
    auto *block = allocator(device)->malloc(size, nullptr);
    if (block == nullptr) {
        return nullptr;
    }
    live[block->ptr] = {device, block};
    probe_malloc((void *)block->ptr, (int8_t)device, size, 0);
    allocator(device)->note("block_malloc", t0, block->ptr, block->size);
    return (void *)block->ptr;
}

/* local_raw_delete. */
STANDIN_EXPORT void standin_c10_cuda_free(void *ptr) {
    unsigned long long t0 = standin_now_ns();
    std::lock_guard<std::mutex> guard(mutex);
    probe_free(ptr);
    auto it = live.find((uintptr_t)ptr);
    if (it == live.end()) {
        return;
    }
    DeviceCachingAllocator *a = allocator(it->second.first);
    size_t size = it->second.second->size;
    a->free(it->second.second);
    a->note("block_free", t0, (uintptr_t)ptr, size);
    live.erase(it);
}

STANDIN_EXPORT void standin_c10_cuda_empty_cache(void) {
    std::lock_guard<std::mutex> guard(mutex);
    for (auto &[device, a] : allocators) {
        a->empty_cache();
    }
}

/* PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, for allocators made from now on. */
STANDIN_EXPORT void standin_c10_cuda_set_expandable(int on) {
    std::lock_guard<std::mutex> guard(mutex);
    expandable_segments = on != 0;
}

/* Whether a tracer raised both semaphores (its probes are live). */
STANDIN_EXPORT int standin_c10_cuda_probes_live(void) {
    return sdt_semaphore_pytorch_malloc > 0 && sdt_semaphore_pytorch_free > 0;
}

/* For the bench: `n` hits of the free probe's 1-byte-nop site (`nop5` 0) or of its 5-byte-nop
 * twin, with a null pointer (a free of nothing: the tracer records it and changes nothing);
 * returns the nanoseconds the loop took. */
STANDIN_EXPORT unsigned long long standin_c10_cuda_probe_loop(unsigned long long n, int nop5) {
    unsigned long long t0 = standin_now_ns();
    for (unsigned long long i = 0; i < n; i++) {
        if (nop5) {
            probe_free_nop5(nullptr);
        } else {
            probe_free(nullptr);
        }
    }
    return standin_now_ns() - t0;
}

/* torch.cuda.memory_allocated() / memory_reserved() of a device. */
STANDIN_EXPORT void standin_c10_cuda_stats(int device, unsigned long long *allocated, unsigned long long *reserved) {
    std::lock_guard<std::mutex> guard(mutex);
    DeviceCachingAllocator *a = allocator(device);
    *allocated = a->allocated;
    *reserved = a->reserved;
}
