/*
 * STAND-IN libtorch_npu.so for memscope-bpf's tests. It is not torch_npu.
 *
 * It reproduces what a tracer of torch_npu's memory sees, with torch_npu's namespaces, classes and
 * method signatures (so the mangled names are the real ones) and its visibility: the allocator
 * internals are hidden (-fvisibility=hidden) and only reachable through a split debug file, while
 * MallocBlock/FreeBlock/GetBlockPtr/GetBlockSize and at_npu::native::allocate_workspace are
 * exported, as in the torch_npu wheels.
 *
 * The caching allocator decides as torch_npu v2.7.1's does (NPUCachingAllocator.cpp; the rules and
 * their lines are listed in docs/simulate.md), so a replay of its requests can be checked against
 * what it really did:
 * - requests are padded by 32 bytes and rounded to 512; <= 1 MiB come from the small pool (2 MiB
 *   segments), larger from the large pool (20 MiB segments below 10 MiB, else rounded to 2 MiB);
 * - segments come from aclrtMallocAlign32(HUGE_FIRST) and go back with aclrtFree;
 * - cached blocks of the request's stream are reused best-fit (stream, size, address), split when
 *   the rest is worth keeping, merged with free neighbours on free;
 * - a request that finds no cached block runs the garbage collector (with a fraction and
 *   garbage_collection_threshold: unsplit large cached segments of at least the average age),
 *   then takes a segment; refused (by the device, or over STANDIN_PER_PROCESS_MEMORY_FRACTION x
 *   the device), it frees cached oversize segments (max_split_size_mb) and retries, then frees
 *   every cached unsplit segment and retries once more;
 * - emptyCache frees every cached unsplit segment, large pool first, and unmaps the whole free
 *   pages of expandable ranges;
 * - PYTORCH_NPU_ALLOC_CONF: expandable_segments:True (per pool and stream a range reserved for
 *   1 1/8 of the device, mapped in 2 MiB / 20 MiB pages with aclrtMallocPhysical + aclrtMapMem as
 *   requests need them, unmapped with aclrtUnmapMem + aclrtFreePhysical; blocks of 2 MiB or more
 *   start on 16 KiB boundaries), max_split_size_mb (cached blocks at least that big serve only
 *   requests at least that big, and less than 20 MiB smaller, and are never split),
 *   garbage_collection_threshold; expandable segments with either of the other two is refused,
 *   as torch_npu does;
 * - it calls the mstx memory-region functions only when LD_PRELOAD names a file ending in
 *   libascend_kernel_hook.so, the test torch_npu itself applies.
 * The workspace allocator keeps one grow-only block per device and stream.
 *
 * Streams (MULTI_STREAM_MEMORY_REUSE, default 1): recordStream marks a block as used by another
 * stream; a block freed while marked is not returned to the pool but waits for that stream's work
 * (torch_npu records an event and reclaims the block at a later malloc once it completed; here the
 * work completes at standin_synchronize, the test's device sync). The stand-in collective
 * (standin_comm_start / standin_comm_wait, what HCCL does) records its tensors on the
 * communication stream; at wait(), with reuse 1 or 3 it erases those marks (eraseStream) so a
 * later free returns the block at once; with 3 it also returns blocks already freed while marked;
 * with 2 it never marks; with 0 it keeps the marks, as stock PyTorch does.
 *
 * Ground truth for tests: with STANDIN_TORCH_LEDGER=<path>, every block and segment event is
 * appended as one JSON line with the allocator's own allocated/reserved counters after it.
 *
 * With STANDIN_TORCH_PAUSE=<path>, DeviceCachingAllocator::malloc waits inside (past its entry)
 * while that file exists: a test holds a call in flight while a tracer's probes come and go.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "acl_standin.h"
#include "mstx_standin.h"

#define EXPORT __attribute__((visibility("default")))
#define HIDDEN_NOINLINE __attribute__((noinline, used))

namespace {

constexpr size_t kMinBlockSize = 512;
constexpr size_t kSmallSize = 1 << 20;
constexpr size_t kSmallBuffer = 2 << 20;
constexpr size_t kLargeBuffer = 20 << 20;
constexpr size_t kMinLargeAlloc = 10 << 20;
constexpr size_t kRoundLarge = 2 << 20;

unsigned long long now_ns() {
    timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ULL + (unsigned long long)ts.tv_nsec;
}

long tid() { return (long)syscall(SYS_gettid); }

/* The allocator's own ledger. */
class Ledger {
  public:
    static Ledger &get() {
        static Ledger ledger;
        return ledger;
    }
    void line(const std::string &text) {
        if (file_ == nullptr) {
            return;
        }
        std::lock_guard<std::mutex> guard(mutex_);
        std::fputs(text.c_str(), file_);
        std::fputc('\n', file_);
        std::fflush(file_);
    }
    bool on() const { return file_ != nullptr; }

  private:
    Ledger() {
        const char *path = std::getenv("STANDIN_TORCH_LEDGER");
        if (path != nullptr && *path != '\0') {
            file_ = std::fopen(path, "a");
        }
    }
    std::FILE *file_ = nullptr;
    std::mutex mutex_;
};

/* An allocator's counters at its last event on this thread, taken under its lock: what a report
 * made inside the allocator (mstx, msMemScope) carries. Counters read after the call returns may
 * already include another thread's change, so the ledger logs both. */
struct AtEvent {
    size_t allocated = 0;
    size_t reserved = 0;
};
thread_local AtEvent at_event;

std::string fmt(const char *format, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char *format, ...) {
    char buf[512];
    va_list args;
    va_start(args, format);
    std::vsnprintf(buf, sizeof buf, format, args);
    va_end(args);
    return buf;
}

/* torch_npu's gate: mstx memory calls only when msleaks' kernel hook is preloaded. */
bool msleaks_enabled() {
    static const bool enabled = [] {
        const char *preload = std::getenv("LD_PRELOAD");
        if (preload == nullptr) {
            return false;
        }
        std::string list(preload);
        size_t start = 0;
        while (start <= list.size()) {
            size_t end = list.find_first_of(": ", start);
            std::string item = list.substr(start, end == std::string::npos ? std::string::npos : end - start);
            const std::string suffix = "libascend_kernel_hook.so";
            if (item.size() >= suffix.size() && item.compare(item.size() - suffix.size(), suffix.size(), suffix) == 0) {
                return true;
            }
            if (end == std::string::npos) {
                break;
            }
            start = end + 1;
        }
        return false;
    }();
    return enabled;
}

/* mstx, dlopened from ASCEND_HOME_PATH/lib64 as torch_npu's MstxInterface does. */
struct Mstx {
    mstxDomainHandle_t (*domain_create)(const char *) = nullptr;
    mstxMemHeapHandle_t (*heap_register)(mstxDomainHandle_t, mstxMemHeapDesc_t const *) = nullptr;
    void (*regions_register)(mstxDomainHandle_t, mstxMemRegionsRegisterBatch_t const *) = nullptr;
    void (*regions_unregister)(mstxDomainHandle_t, mstxMemRegionsUnregisterBatch_t const *) = nullptr;
    mstxDomainHandle_t caching = nullptr;
    mstxDomainHandle_t workspace = nullptr;

    static Mstx *get() {
        static Mstx *mstx = [] () -> Mstx * {
            if (!msleaks_enabled()) {
                return nullptr;
            }
            const char *home = std::getenv("ASCEND_HOME_PATH");
            std::string path = std::string(home ? home : "") + "/lib64/libms_tools_ext.so";
            void *lib = dlopen(path.c_str(), RTLD_NOW);
            if (lib == nullptr) {
                return nullptr;
            }
            auto *m = new Mstx;
            m->domain_create = reinterpret_cast<decltype(m->domain_create)>(dlsym(lib, "mstxDomainCreateA"));
            m->heap_register = reinterpret_cast<decltype(m->heap_register)>(dlsym(lib, "mstxMemHeapRegister"));
            m->regions_register = reinterpret_cast<decltype(m->regions_register)>(dlsym(lib, "mstxMemRegionsRegister"));
            m->regions_unregister =
                reinterpret_cast<decltype(m->regions_unregister)>(dlsym(lib, "mstxMemRegionsUnregister"));
            if (!m->domain_create || !m->heap_register || !m->regions_register || !m->regions_unregister) {
                return nullptr;
            }
            m->caching = m->domain_create("ptaCaching");
            m->workspace = m->domain_create("ptaWorkspace");
            return m;
        }();
        return mstx;
    }

    void malloc_region(mstxDomainHandle_t domain, int device, const void *segment, size_t reserved, const void *ptr,
                       size_t size) {
        mstxMemVirtualRangeDesc_t heap_range{(uint32_t)device, segment, reserved};
        mstxMemHeapDesc_t heap{MSTX_MEM_HEAP_USAGE_TYPE_SUB_ALLOCATOR, MSTX_MEM_TYPE_VIRTUAL_ADDRESS, &heap_range};
        mstxMemHeapHandle_t handle = heap_register(domain, &heap);
        mstxMemVirtualRangeDesc_t range{(uint32_t)device, ptr, size};
        mstxMemRegionsRegisterBatch_t batch{handle, MSTX_MEM_TYPE_VIRTUAL_ADDRESS, 1, &range, nullptr};
        regions_register(domain, &batch);
    }

    void free_region(mstxDomainHandle_t domain, int device, const void *segment, size_t reserved, const void *ptr) {
        mstxMemVirtualRangeDesc_t heap_range{(uint32_t)device, segment, reserved};
        mstxMemHeapDesc_t heap{MSTX_MEM_HEAP_USAGE_TYPE_SUB_ALLOCATOR, MSTX_MEM_TYPE_VIRTUAL_ADDRESS, &heap_range};
        heap_register(domain, &heap);
        mstxMemRegionRef_t ref{};
        ref.refType = MSTX_MEM_REGION_REF_TYPE_POINTER;
        ref.pointer = ptr;
        mstxMemRegionsUnregisterBatch_t batch{1, &ref};
        regions_unregister(domain, &batch);
    }
};

struct Config {
    bool expandable = false;
    size_t max_split = SIZE_MAX;
    double gc_threshold = 0.0;
    double fraction = 0.0;
    bool valid = true;

    static const Config &get() {
        static Config config = [] {
            Config c;
            const char *text = std::getenv("PYTORCH_NPU_ALLOC_CONF");
            std::string conf(text ? text : "");
            size_t start = 0;
            while (start < conf.size()) {
                size_t end = conf.find(',', start);
                std::string item = conf.substr(start, end == std::string::npos ? std::string::npos : end - start);
                size_t colon = item.find(':');
                if (colon != std::string::npos) {
                    std::string key = item.substr(0, colon);
                    std::string value = item.substr(colon + 1);
                    if (key == "expandable_segments") {
                        c.expandable = value == "True";
                    } else if (key == "max_split_size_mb") {
                        size_t mib = (size_t)std::strtoull(value.c_str(), nullptr, 10);
                        if (mib <= kLargeBuffer >> 20) {
                            std::fprintf(stderr, "stand-in torch_npu: max_split_size_mb must be > %zu\n", kLargeBuffer >> 20);
                            c.valid = false;
                        }
                        c.max_split = mib << 20;
                    } else if (key == "garbage_collection_threshold") {
                        c.gc_threshold = std::strtod(value.c_str(), nullptr);
                    }
                }
                if (end == std::string::npos) {
                    break;
                }
                start = end + 1;
            }
            const char *fraction = std::getenv("STANDIN_PER_PROCESS_MEMORY_FRACTION");
            c.fraction = fraction ? std::strtod(fraction, nullptr) : 0.0;
            if (c.expandable && (c.max_split != SIZE_MAX || c.gc_threshold > 0.0)) {
                std::fprintf(stderr, "stand-in torch_npu: expandable_segments cannot be combined with "
                                     "max_split_size_mb or garbage_collection_threshold\n");
                c.valid = false;
            }
            return c;
        }();
        return config;
    }
};

/* MULTI_STREAM_MEMORY_REUSE, read once (torch_npu's default is 1). */
int reuse_mode() {
    static int mode = [] {
        const char *v = std::getenv("MULTI_STREAM_MEMORY_REUSE");
        return v != nullptr && *v != '\0' ? std::atoi(v) : 1;
    }();
    return mode;
}

/* torch_npu pads every request by 32 bytes before rounding it (AddPadSize(), but on Ascend950
 * with CANN 9.1 or later). */
constexpr size_t kPadSize = 32;

size_t round_size(size_t size) {
    size += kPadSize;
    return size < kMinBlockSize ? kMinBlockSize : (size + kMinBlockSize - 1) / kMinBlockSize * kMinBlockSize;
}

size_t allocation_size(size_t size) {
    if (size <= kSmallSize) {
        return kSmallBuffer;
    }
    if (size < kMinLargeAlloc) {
        return kLargeBuffer;
    }
    return (size + kRoundLarge - 1) / kRoundLarge * kRoundLarge;
}

}  // namespace

namespace c10 {
/* Enough of c10::DataPtr (at::DataPtr) for the ABI: returned by value (through a hidden pointer),
 * passed by reference, data first. */
struct DataPtr {
    void *data;
    void *ctx;
    void (*deleter)(void *);
    int16_t device;
    DataPtr(void *d, void *c, void (*del)(void *), int16_t dev) : data(d), ctx(c), deleter(del), device(dev) {}
    DataPtr(const DataPtr &) = delete;
    DataPtr(DataPtr &&other) noexcept : data(other.data), ctx(other.ctx), deleter(other.deleter), device(other.device) {
        other.deleter = nullptr;
    }
    ~DataPtr() {
        if (deleter) {
            deleter(ctx);
        }
    }
};

/* c10::Stream: a device (type, index) and a stream id; 16 bytes, passed by value in registers. */
struct Stream {
    int8_t device_type;
    int8_t device_index;
    int64_t id;
};
}  // namespace c10

namespace c10_npu {
/* c10_npu::NPUStream wraps a c10::Stream; trivially copyable, so passed in two registers. */
class NPUStream {
  public:
    explicit NPUStream(c10::Stream s) : stream_(s) {}
    int64_t id() const { return stream_.id; }

  private:
    c10::Stream stream_;
};
}  // namespace c10_npu

namespace c10_npu {
namespace NPUCachingAllocator {

namespace {

struct BlockPool;
struct ExpandableSegment;

struct Block {
    int device;
    aclrtStream stream;
    size_t size;
    size_t requested_size;
    BlockPool *pool;
    void *ptr;
    bool allocated;
    Block *prev;
    Block *next;
    void *segment = nullptr;  // start of the segment (or of the expandable range) it lies in
    bool mapped = true;
    ExpandableSegment *expandable = nullptr;  // the reserved range it lies in, when expandable
    size_t gc_count = 0;                      // free-block searches of its pool since it was last used
    std::set<int64_t> stream_uses{};          // other streams it was recorded on (recordStream)
    bool pending = false;                     // freed while marked: waiting for those streams' work

    Block(int device_, aclrtStream stream_, size_t size_, BlockPool *pool_, void *ptr_)
        : device(device_), stream(stream_), size(size_), requested_size(0), pool(pool_), ptr(ptr_), allocated(false),
          prev(nullptr), next(nullptr), segment(ptr_) {}
    bool is_split() const { return prev != nullptr || next != nullptr; }
};

/* torch_npu's BlockComparatorSize: stream, then size, then address. */
struct BySize {
    bool operator()(const Block *a, const Block *b) const {
        if (a->stream != b->stream) {
            return (uintptr_t)a->stream < (uintptr_t)b->stream;
        }
        if (a->size != b->size) {
            return a->size < b->size;
        }
        return (uintptr_t)a->ptr < (uintptr_t)b->ptr;
    }
};

/* BlockComparatorAddress: stream, then address (the unmapped ranges). */
struct ByAddress {
    bool operator()(const Block *a, const Block *b) const {
        if (a->stream != b->stream) {
            return (uintptr_t)a->stream < (uintptr_t)b->stream;
        }
        return (uintptr_t)a->ptr < (uintptr_t)b->ptr;
    }
};

struct BlockPool {
    std::set<Block *, BySize> blocks;
    std::set<Block *, ByAddress> unmapped;
    bool is_small;
};

/* A reserved address range of one pool and stream, mapped page by page on demand. */
struct ExpandableSegment {
    char *base = nullptr;
    size_t page = 0;
    std::vector<aclrtDrvMemHandle> handles;  // one per page of the range; null: not mapped
};

}  // namespace

struct Stats {
    size_t allocated = 0;
    size_t reserved = 0;
};

class DeviceCachingAllocator {
  public:
    explicit DeviceCachingAllocator(int device) : device_(device) {
        small_.is_small = true;
        large_.is_small = false;
    }
    Block *malloc(int device, size_t size, aclrtStream stream, uint8_t allocator_type = 0);
    void free(Block *block, uint8_t allocator_type = 0);
    void emptyCache();
    void recordStream(Block *block, int64_t stream);
    void eraseStream(Block *block, int64_t stream);
    void release_pending(void *ptr);
    void released_event(const Block *block);
    void synchronize();
    Stats stats() {
        std::lock_guard<std::recursive_mutex> guard(mutex_);
        return stats_;
    }

  private:
    Block *get_free_block(BlockPool &pool, size_t size, aclrtStream stream);
    Block *alloc_block(BlockPool &pool, size_t size, size_t alloc_size, aclrtStream stream);
    Block *find_expandable(BlockPool &pool, size_t size, aclrtStream stream);
    bool map_block(Block *block, size_t size);
    Block *alloc_expandable(BlockPool &pool, size_t size, aclrtStream stream);
    void unmap_block(Block *block);
    void garbage_collect();
    bool release_available(BlockPool &pool, size_t size, aclrtStream stream);
    void release_cached();
    void release_block(Block *block);
    bool should_split(const Block *block, size_t size) const;
    Block *align_base(BlockPool &pool, Block *block, size_t size);
    void merge(Block *dst, Block *src);
    size_t allowed() const;
    // `t0`: taken before the runtime call the step made, so a test can place that call's row
    // between `t0` and `t` however long the call took.
    void segment_event(const char *ev, void *ptr, size_t size, unsigned long long t0);
    void free_block(Block *block);

    int device_;
    std::recursive_mutex mutex_;
    BlockPool small_;
    BlockPool large_;
    Stats stats_;
    std::vector<ExpandableSegment *> expandables_;
    std::vector<Block *> pending_;  // freed while marked, in free order
};

void DeviceCachingAllocator::segment_event(const char *ev, void *ptr, size_t size, unsigned long long t0) {
    if (Ledger::get().on()) {
        Ledger::get().line(fmt("{\"ev\": \"%s\", \"tid\": %ld, \"t0\": %llu, \"t\": %llu, \"device\": %d, \"ptr\": %llu, "
                               "\"size\": %zu, \"allocated\": %zu, \"reserved\": %zu}",
                               ev, tid(), t0, now_ns(), device_, (unsigned long long)(uintptr_t)ptr, size, stats_.allocated,
                               stats_.reserved));
    }
}

/* The bytes the per-process fraction allows; 0: no fraction set. */
size_t DeviceCachingAllocator::allowed() const {
    const Config &config = Config::get();
    if (config.fraction <= 0.0) {
        return 0;
    }
    size_t free_bytes = 0, total = 0;
    aclrtGetMemInfo(ACL_HBM_MEM, &free_bytes, &total);
    return (size_t)(config.fraction * (double)total);
}

bool DeviceCachingAllocator::should_split(const Block *block, size_t size) const {
    size_t remaining = block->size - size;
    if (block->pool->is_small || Config::get().expandable) {
        return remaining >= kMinBlockSize;
    }
    return size < Config::get().max_split && remaining > kSmallSize;
}

Block *DeviceCachingAllocator::get_free_block(BlockPool &pool, size_t size, aclrtStream stream) {
    if (Config::get().fraction > 0.0 && Config::get().gc_threshold > 0.0) {
        for (Block *b : pool.blocks) {
            b->gc_count++;
        }
    }
    Block key(device_, stream, size, &pool, nullptr);
    auto it = pool.blocks.lower_bound(&key);
    if (it == pool.blocks.end() || (*it)->stream != stream) {
        return nullptr;
    }
    if ((*it)->expandable != nullptr) {
        // A block followed by unmapped room counts at the size it can grow to.
        auto reach = [](const Block *b) { return b->size + (b->next && !b->next->mapped ? b->next->size : 0); };
        auto next = std::next(it);
        while ((*it)->expandable && next != pool.blocks.end() && (*next)->stream == stream && reach(*next) < reach(*it)) {
            it = next++;
        }
    }
    size_t max_split = Config::get().max_split;
    if (size < max_split && (*it)->size >= max_split) {
        return nullptr;
    }
    if (size >= max_split && (*it)->size >= size + kLargeBuffer) {
        return nullptr;
    }
    Block *block = *it;
    block->gc_count = 0;
    pool.blocks.erase(it);
    return block;
}

Block *DeviceCachingAllocator::alloc_block(BlockPool &pool, size_t size, size_t alloc_size, aclrtStream stream) {
    size_t limit = allowed();
    if (limit > 0 && stats_.reserved + alloc_size > limit) {
        return nullptr;
    }
    if (Config::get().expandable) {
        return alloc_expandable(pool, size, stream);
    }
    void *ptr = nullptr;
    unsigned long long t0 = now_ns();
    if (aclrtMallocAlign32(&ptr, alloc_size, ACL_MEM_MALLOC_HUGE_FIRST) != ACL_SUCCESS) {
        return nullptr;
    }
    stats_.reserved += alloc_size;
    segment_event("segment_alloc", ptr, alloc_size, t0);
    return new Block(device_, stream, alloc_size, &pool, ptr);
}

/* The lowest unmapped room of the stream (with the free block before it) that holds `size`,
 * or a new range reserved for 1 1/8 of the device. */
Block *DeviceCachingAllocator::find_expandable(BlockPool &pool, size_t size, aclrtStream stream) {
    auto usable = [](const Block *b) { return b != nullptr && !b->allocated && b->stream_uses.empty() && !b->pending; };
    Block key(device_, stream, 0, &pool, nullptr);
    for (auto it = pool.unmapped.lower_bound(&key); it != pool.unmapped.end() && (*it)->stream == stream; ++it) {
        Block *c = usable((*it)->prev) ? (*it)->prev : *it;
        size_t bytes = 0;
        for (Block *b = c; bytes < size && usable(b); b = b->next) {
            bytes += b->size;
        }
        if (bytes >= size) {
            return c;
        }
    }
    auto *seg = new ExpandableSegment;
    seg->page = pool.is_small ? kSmallBuffer : kLargeBuffer;
    size_t free_bytes = 0, total = 0;
    aclrtGetMemInfo(ACL_HBM_MEM, &free_bytes, &total);
    size_t pages = (total + total / 8 + seg->page - 1) / seg->page;
    void *base = nullptr;
    if (aclrtReserveMemAddress(&base, pages * seg->page, 0, nullptr, 1) != ACL_SUCCESS) {
        delete seg;
        return nullptr;
    }
    seg->base = static_cast<char *>(base);
    seg->handles.assign(pages, nullptr);
    expandables_.push_back(seg);
    Block *range = new Block(device_, stream, pages * seg->page, &pool, base);
    range->segment = base;
    range->mapped = false;
    range->expandable = seg;
    pool.unmapped.insert(range);
    return range;
}

/* Maps the pages under the first `size` bytes of an unmapped block; the mapped part joins its
 * free neighbours and the free set. */
bool DeviceCachingAllocator::map_block(Block *block, size_t size) {
    ExpandableSegment *seg = block->expandable;
    size_t first = (size_t)(static_cast<char *>(block->ptr) - seg->base) / seg->page;
    size_t end = std::min((size_t)(static_cast<char *>(block->ptr) - seg->base + size + seg->page - 1) / seg->page,
                          seg->handles.size());
    for (size_t i = first; i < end; i++) {
        aclrtPhysicalMemProp prop{};
        prop.memAttr = ACL_HBM_MEM_HUGE;
        prop.location.id = (uint32_t)device_;
        prop.location.type = ACL_MEM_LOCATION_TYPE_DEVICE;
        if (aclrtMallocPhysical(&seg->handles[i], seg->page, &prop, 0) != ACL_SUCCESS) {
            for (size_t j = first; j < i; j++) {
                aclrtFreePhysical(seg->handles[j]);
                seg->handles[j] = nullptr;
            }
            seg->handles[i] = nullptr;
            return false;
        }
    }
    for (size_t i = first; i < end; i++) {
        unsigned long long t0 = now_ns();
        aclrtMapMem(seg->base + i * seg->page, seg->page, 0, seg->handles[i], 0);
        stats_.reserved += seg->page;
        segment_event("segment_map", seg->base + i * seg->page, seg->page, t0);
    }
    BlockPool &pool = *block->pool;
    pool.unmapped.erase(block);
    size_t mapped = (end - first) * seg->page;
    if (mapped < block->size) {
        Block *rest = new Block(device_, block->stream, block->size - mapped, &pool, static_cast<char *>(block->ptr) + mapped);
        rest->segment = seg->base;
        rest->mapped = false;
        rest->expandable = seg;
        rest->prev = block;
        rest->next = block->next;
        if (block->next) {
            block->next->prev = rest;
        }
        block->next = rest;
        pool.unmapped.insert(rest);
        block->size = mapped;
    }
    block->mapped = true;
    merge(block, block->prev);
    merge(block, block->next);
    pool.blocks.insert(block);
    return true;
}

Block *DeviceCachingAllocator::alloc_expandable(BlockPool &pool, size_t size, aclrtStream stream) {
    Block *candidate = find_expandable(pool, size, stream);
    if (candidate == nullptr) {
        return nullptr;
    }
    if (!candidate->mapped && !map_block(candidate, std::min(candidate->size, size))) {
        return nullptr;
    }
    while (candidate->size < size) {
        Block *next = candidate->next;
        if (next == nullptr || !map_block(next, std::min(size - candidate->size, next->size))) {
            return nullptr;
        }
        candidate = next;  // it took in the free block before it
    }
    pool.blocks.erase(candidate);
    return candidate;
}

/* Unmaps the whole pages inside a free expandable block; the bytes around them stay free. */
void DeviceCachingAllocator::unmap_block(Block *block) {
    ExpandableSegment *seg = block->expandable;
    uintptr_t start = (uintptr_t)block->ptr, stop = start + block->size, base = (uintptr_t)seg->base;
    size_t first = (start - base + seg->page - 1) / seg->page;
    size_t end = (stop - base) / seg->page;
    if (first >= end) {
        return;
    }
    BlockPool &pool = *block->pool;
    pool.blocks.erase(block);
    char *from = seg->base + first * seg->page, *to = seg->base + end * seg->page;
    if ((uintptr_t)from > start) {
        Block *before = new Block(device_, block->stream, (uintptr_t)from - start, &pool, block->ptr);
        before->segment = seg->base;
        before->expandable = seg;
        before->prev = block->prev;
        before->next = block;
        if (block->prev) {
            block->prev->next = before;
        }
        block->prev = before;
        pool.blocks.insert(before);
    }
    if ((uintptr_t)to < stop) {
        Block *after = new Block(device_, block->stream, stop - (uintptr_t)to, &pool, to);
        after->segment = seg->base;
        after->expandable = seg;
        after->prev = block;
        after->next = block->next;
        if (block->next) {
            block->next->prev = after;
        }
        block->next = after;
        pool.blocks.insert(after);
    }
    for (size_t i = first; i < end; i++) {
        unsigned long long t0 = now_ns();
        aclrtUnmapMem(seg->base + i * seg->page);
        aclrtFreePhysical(seg->handles[i]);
        seg->handles[i] = nullptr;
        stats_.reserved -= seg->page;
        segment_event("segment_unmap", seg->base + i * seg->page, seg->page, t0);
    }
    block->ptr = from;
    block->size = (size_t)(to - from);
    block->mapped = false;
    merge(block, block->prev);
    merge(block, block->next);
    pool.unmapped.insert(block);
}

/* Joins the free neighbour `src` into `dst` (both mapped, or both unmapped). */
void DeviceCachingAllocator::merge(Block *dst, Block *src) {
    if (src == nullptr || src->allocated || src->pending || !src->stream_uses.empty() || src->mapped != dst->mapped) {
        return;
    }
    if (dst->prev == src) {
        dst->ptr = src->ptr;
        dst->prev = src->prev;
        if (dst->prev) {
            dst->prev->next = dst;
        }
    } else {
        dst->next = src->next;
        if (dst->next) {
            dst->next->prev = dst;
        }
    }
    dst->size += src->size;
    BlockPool &pool = *src->pool;
    if (src->mapped) {
        pool.blocks.erase(src);
    } else {
        pool.unmapped.erase(src);
    }
    delete src;
}

void DeviceCachingAllocator::release_block(Block *block) {
    block->pool->blocks.erase(block);
    unsigned long long t0 = now_ns();
    aclrtFree(block->ptr);
    stats_.reserved -= block->size;
    segment_event("segment_free", block->ptr, block->size, t0);
    delete block;
}

/* Past garbage_collection_threshold x the allowed bytes, the large pool's unsplit cached
 * segments waiting at least the average time go, pass after pass, until the excess is back. */
void DeviceCachingAllocator::garbage_collect() {
    size_t threshold = (size_t)(Config::get().gc_threshold * (double)allowed());
    if (stats_.reserved <= threshold) {
        return;
    }
    size_t target = stats_.reserved - threshold, reclaimed = 0;
    double total_age = 0.0;
    int count = 0;
    for (Block *b : large_.blocks) {
        if (!b->is_split()) {
            total_age += (double)b->gc_count;
            count++;
        }
    }
    bool freed = true;
    while (reclaimed < target && freed && count > 0) {
        double threshold_age = total_age / count;
        freed = false;
        std::vector<Block *> old;
        for (Block *b : large_.blocks) {
            if (!b->is_split() && (double)b->gc_count >= threshold_age) {
                old.push_back(b);
            }
        }
        for (Block *b : old) {
            freed = true;
            reclaimed += b->size;
            total_age -= (double)b->gc_count;
            count--;
            release_block(b);
        }
    }
}

/* With max_split_size_mb set: one cached oversize segment big enough, or the largest ones of
 * the stream, largest first, until their bytes cover the request. */
bool DeviceCachingAllocator::release_available(BlockPool &pool, size_t size, aclrtStream stream) {
    size_t max_split = Config::get().max_split;
    if (max_split == SIZE_MAX) {
        return false;
    }
    Block key(device_, stream, std::max(size, max_split), &pool, nullptr);
    auto it = pool.blocks.lower_bound(&key);
    if (it != pool.blocks.end() && (*it)->stream == stream) {
        release_block(*it);
        return true;
    }
    size_t released = 0;
    while (it != pool.blocks.begin() && released < key.size) {
        --it;
        if ((*it)->size < max_split || (*it)->stream != stream) {
            break;
        }
        Block *b = *it;
        released += b->size;
        release_block(b);
        it = pool.blocks.lower_bound(&key);
    }
    return released >= key.size;
}

/* Every cached segment not split, large pool first; the free pages of expandable ranges. */
void DeviceCachingAllocator::release_cached() {
    for (BlockPool *pool : {&large_, &small_}) {
        std::vector<Block *> whole, expandable;
        for (Block *b : pool->blocks) {
            if (b->expandable != nullptr) {
                expandable.push_back(b);
            } else if (!b->is_split()) {
                whole.push_back(b);
            }
        }
        for (Block *b : whole) {
            release_block(b);
        }
        for (Block *b : expandable) {
            unmap_block(b);
        }
    }
}

/* torch_npu's base-address alignment (expandable segments, requests of 2 MiB or more): a block
 * not on a 16 KiB boundary leaves its first bytes free before the aligned rest. */
Block *DeviceCachingAllocator::align_base(BlockPool &pool, Block *block, size_t size) {
    constexpr uintptr_t kAlign = 16 << 10;
    uintptr_t at = (uintptr_t)block->ptr;
    if (size < kRoundLarge || !Config::get().expandable || at % kAlign == 0) {
        return block;
    }
    size_t offset = kAlign - at % kAlign;
    if (offset + size > block->size) {
        return block;
    }
    Block *rest = new Block(device_, block->stream, block->size - offset, &pool, (char *)block->ptr + offset);
    rest->segment = block->segment;
    rest->expandable = block->expandable;
    rest->next = block->next;
    if (rest->next) {
        rest->next->prev = rest;
    }
    rest->prev = block;
    block->next = rest;
    block->size = offset;
    pool.blocks.insert(block);
    return rest;
}

/* STANDIN_TORCH_PAUSE (see the top). */
static void pause_while_asked() {
    static const char *path = std::getenv("STANDIN_TORCH_PAUSE");
    while (path != nullptr && *path != '\0' && access(path, F_OK) == 0) {
        usleep(10000);
    }
}

HIDDEN_NOINLINE Block *DeviceCachingAllocator::malloc(int device, size_t orig_size, aclrtStream stream,
                                                      uint8_t allocator_type) {
    (void)allocator_type;
    pause_while_asked();
    std::lock_guard<std::recursive_mutex> guard(mutex_);
    if (!Config::get().valid || device != device_) {
        return nullptr;
    }
    size_t size = round_size(orig_size);
    BlockPool &pool = size <= kSmallSize ? small_ : large_;
    size_t alloc_size = allocation_size(size);
    Block *block = get_free_block(pool, size, stream);
    if (block == nullptr) {
        if (Config::get().fraction > 0.0 && Config::get().gc_threshold > 0.0) {
            garbage_collect();
        }
        block = alloc_block(pool, size, alloc_size, stream);
        if (block == nullptr && release_available(pool, size, stream)) {
            block = alloc_block(pool, size, alloc_size, stream);
        }
        if (block == nullptr) {
            release_cached();
            block = alloc_block(pool, size, alloc_size, stream);
        }
    }
    at_event = AtEvent{stats_.allocated, stats_.reserved};
    if (block == nullptr) {
        if (Ledger::get().on()) {
            Ledger::get().line(fmt("{\"ev\": \"oom\", \"tid\": %ld, \"t\": %llu, \"device\": %d, \"req\": %zu, "
                                   "\"allocated\": %zu, \"reserved\": %zu}",
                                   tid(), now_ns(), device_, orig_size, stats_.allocated, stats_.reserved));
        }
        return nullptr;
    }
    block = align_base(pool, block, size);
    if (should_split(block, size)) {
        Block *rest = new Block(device_, stream, block->size - size, &pool, (char *)block->ptr + size);
        rest->segment = block->segment;
        rest->expandable = block->expandable;
        rest->prev = block;
        rest->next = block->next;
        if (block->next) {
            block->next->prev = rest;
        }
        block->next = rest;
        block->size = size;
        pool.blocks.insert(rest);
    }
    block->allocated = true;
    block->requested_size = orig_size;
    stats_.allocated += block->size;
    if (Mstx *m = Mstx::get()) {
        m->malloc_region(m->caching, device_, block->segment, stats_.reserved, block->ptr, block->size);
    }
    at_event = AtEvent{stats_.allocated, stats_.reserved};
    return block;
}

HIDDEN_NOINLINE void DeviceCachingAllocator::free(Block *block, uint8_t allocator_type) {
    (void)allocator_type;
    std::lock_guard<std::recursive_mutex> guard(mutex_);
    if (!block->stream_uses.empty()) {
        // Still in use by another stream's work: it stays allocated until that work completes.
        block->pending = true;
        pending_.push_back(block);
        at_event = AtEvent{stats_.allocated, stats_.reserved};
        return;
    }
    free_block(block);
}

void DeviceCachingAllocator::free_block(Block *block) {
    block->pending = false;
    block->stream_uses.clear();
    block->allocated = false;
    stats_.allocated -= block->size;
    void *ptr = block->ptr;
    void *segment = block->segment;
    merge(block, block->prev);
    merge(block, block->next);
    block->pool->blocks.insert(block);
    if (Mstx *m = Mstx::get()) {
        m->free_region(m->caching, device_, segment, stats_.reserved, ptr);
    }
    at_event = AtEvent{stats_.allocated, stats_.reserved};
}

void DeviceCachingAllocator::emptyCache() {
    std::lock_guard<std::recursive_mutex> guard(mutex_);
    release_cached();
}

void DeviceCachingAllocator::recordStream(Block *block, int64_t stream) {
    std::lock_guard<std::recursive_mutex> guard(mutex_);
    block->stream_uses.insert(stream);
}

void DeviceCachingAllocator::eraseStream(Block *block, int64_t stream) {
    std::lock_guard<std::recursive_mutex> guard(mutex_);
    block->stream_uses.erase(stream);
}

void DeviceCachingAllocator::release_pending(void *ptr) {
    std::lock_guard<std::recursive_mutex> guard(mutex_);
    auto it = std::find_if(pending_.begin(), pending_.end(), [ptr](const Block *b) { return b->ptr == ptr; });
    if (it != pending_.end()) {
        Block *block = *it;
        pending_.erase(it);
        released_event(block);
        free_block(block);
    }
}

/* Every stream's work completed: the blocks waiting for it go back to the pool. */
void DeviceCachingAllocator::synchronize() {
    std::lock_guard<std::recursive_mutex> guard(mutex_);
    std::vector<Block *> done;
    done.swap(pending_);
    for (Block *b : done) {
        released_event(b);
        free_block(b);
    }
}

/* The ledger's record of a block that waited for another stream going back to the pool. */
void DeviceCachingAllocator::released_event(const Block *block) {
    if (Ledger::get().on()) {
        Ledger::get().line(fmt("{\"ev\": \"deferred_release\", \"tid\": %ld, \"t\": %llu, \"device\": %d, \"size\": %zu, "
                               "\"ptr\": %llu, \"allocated\": %zu, \"reserved\": %zu}",
                               tid(), now_ns(), device_, block->size, (unsigned long long)(uintptr_t)block->ptr,
                               stats_.allocated - block->size, stats_.reserved));
    }
}

class NpuCachingAllocator {
  public:
    HIDDEN_NOINLINE void malloc(void **devPtr, int device, size_t size, aclrtStream stream);
    HIDDEN_NOINLINE void free(void *ptr);
    void emptyCache();
    DeviceCachingAllocator &device(int d);
    Block *lookup(void *ptr) {
        std::lock_guard<std::mutex> guard(mutex_);
        auto it = allocated_.find(ptr);
        return it == allocated_.end() ? nullptr : it->second;
    }
    void remember(Block *b) {
        std::lock_guard<std::mutex> guard(mutex_);
        allocated_[b->ptr] = b;
    }
    Block *forget(void *ptr) {
        std::lock_guard<std::mutex> guard(mutex_);
        auto it = allocated_.find(ptr);
        if (it == allocated_.end()) {
            return nullptr;
        }
        Block *b = it->second;
        allocated_.erase(it);
        return b;
    }
    std::vector<DeviceCachingAllocator *> all_devices() {
        std::lock_guard<std::mutex> guard(mutex_);
        return devices_;
    }

  private:
    std::mutex mutex_;
    std::unordered_map<void *, Block *> allocated_;
    std::vector<DeviceCachingAllocator *> devices_;
};

NpuCachingAllocator caching_allocator;

DeviceCachingAllocator &NpuCachingAllocator::device(int d) {
    std::lock_guard<std::mutex> guard(mutex_);
    while ((int)devices_.size() <= d) {
        devices_.push_back(new DeviceCachingAllocator((int)devices_.size()));
    }
    return *devices_[d];
}

void NpuCachingAllocator::malloc(void **devPtr, int device_id, size_t size, aclrtStream stream) {
    Block *block = device(device_id).malloc(device_id, size, stream, 0);
    *devPtr = block ? block->ptr : nullptr;
    if (block) {
        remember(block);
    }
}

void NpuCachingAllocator::free(void *ptr) {
    Block *block = forget(ptr);
    if (block) {
        device(block->device).free(block, 0);
    }
}

void NpuCachingAllocator::emptyCache() {
    std::vector<DeviceCachingAllocator *> all;
    {
        std::lock_guard<std::mutex> guard(mutex_);
        all = devices_;
    }
    for (auto *d : all) {
        d->emptyCache();
    }
}

/* torch_npu's stream marks, exported (the Python bindings and ProcessGroupHCCL call them):
 * recordStream before a collective on another stream, eraseStream once it was waited for. */
EXPORT __attribute__((noinline)) void recordStream(const c10::DataPtr &ptr, NPUStream stream) {
    if (Block *block = caching_allocator.lookup(ptr.data)) {
        caching_allocator.device(block->device).recordStream(block, stream.id());
    }
}

EXPORT __attribute__((noinline)) void eraseStream(const c10::DataPtr &ptr, NPUStream stream) {
    if (Block *block = caching_allocator.lookup(ptr.data)) {
        caching_allocator.device(block->device).eraseStream(block, stream.id());
        return;
    }
    // Freed already, waiting for the stream: only reuse mode 3 hands such blocks back now.
    if (reuse_mode() == 3) {
        for (auto *d : caching_allocator.all_devices()) {
            d->release_pending(ptr.data);
        }
    }
}

/* The external (torchair) path, exported. */
EXPORT void *MallocBlock(size_t size, void *stream, int device) {
    if (device < 0) {
        int32_t current = 0;
        aclrtGetDevice(&current);
        device = current;
    }
    Block *block = caching_allocator.device(device).malloc(device, size, stream, 1);
    return block;
}

EXPORT void FreeBlock(void *handle) {
    Block *block = static_cast<Block *>(handle);
    caching_allocator.device(block->device).free(block, 1);
}

EXPORT void *GetBlockPtr(const void *handle) { return static_cast<const Block *>(handle)->ptr; }

EXPORT size_t GetBlockSize(const void *handle) { return static_cast<const Block *>(handle)->size; }

}  // namespace NPUCachingAllocator

namespace NPUWorkspaceAllocator {

/* One grow-only block per stream, as torch_npu's workspace allocator. */
class DeviceWorkspaceAllocator {
  public:
    explicit DeviceWorkspaceAllocator(int device_id) : device(device_id) {}
    HIDDEN_NOINLINE void *malloc(size_t size, aclrtStream stream);
    HIDDEN_NOINLINE void free(void *ptr);
    size_t allocated = 0;
    size_t reserved = 0;

  private:
    struct Slot {
        void *ptr = nullptr;
        size_t size = 0;
        size_t in_use = 0;
    };
    int device;  // named as in torch_npu, whose DWARF the tracer reads it by
    std::mutex mutex_;
    std::unordered_map<aclrtStream, Slot> slots_;
    std::unordered_map<void *, aclrtStream> owner_;
};

void *DeviceWorkspaceAllocator::malloc(size_t size, aclrtStream stream) {
    std::lock_guard<std::mutex> guard(mutex_);
    Slot &slot = slots_[stream];
    if (slot.in_use != 0) {
        return nullptr;  // one use at a time per stream
    }
    if (size > slot.size) {
        if (slot.ptr != nullptr) {
            aclrtFree(slot.ptr);
            reserved -= slot.size;
            owner_.erase(slot.ptr);
        }
        size_t alloc = (size + 32 + kSmallBuffer - 1) / kSmallBuffer * kSmallBuffer;
        void *p = nullptr;
        if (aclrtMallocAlign32(&p, alloc, ACL_MEM_MALLOC_HUGE_ONLY) != ACL_SUCCESS) {
            slot = Slot{};
            return nullptr;
        }
        slot.ptr = p;
        slot.size = alloc;
        reserved += alloc;
        owner_[p] = stream;
    }
    slot.in_use = size;
    allocated += size;
    if (Mstx *m = Mstx::get()) {
        m->malloc_region(m->workspace, device, slot.ptr, reserved, slot.ptr, size);
    }
    at_event = AtEvent{allocated, reserved};
    return slot.ptr;
}

void DeviceWorkspaceAllocator::free(void *ptr) {
    std::lock_guard<std::mutex> guard(mutex_);
    auto it = owner_.find(ptr);
    if (it == owner_.end()) {
        return;
    }
    Slot &slot = slots_[it->second];
    allocated -= slot.in_use;
    slot.in_use = 0;
    if (Mstx *m = Mstx::get()) {
        m->free_region(m->workspace, device, slot.ptr, reserved, ptr);
    }
    at_event = AtEvent{allocated, reserved};
}

std::mutex workspace_mutex;
std::vector<DeviceWorkspaceAllocator *> workspaces;

DeviceWorkspaceAllocator &workspace(int device) {
    std::lock_guard<std::mutex> guard(workspace_mutex);
    while ((int)workspaces.size() <= device) {
        workspaces.push_back(new DeviceWorkspaceAllocator((int)workspaces.size()));
    }
    return *workspaces[device];
}

}  // namespace NPUWorkspaceAllocator
}  // namespace c10_npu

namespace at {
using c10::DataPtr;
}  // namespace at

namespace {
struct WorkspaceUse {
    int device;
    void *ptr;
};
void workspace_delete(void *ctx) {
    auto *use = static_cast<WorkspaceUse *>(ctx);
    c10_npu::NPUWorkspaceAllocator::workspace(use->device).free(use->ptr);
    delete use;
}
}  // namespace

namespace at_npu {
namespace native {
EXPORT at::DataPtr allocate_workspace(uint64_t size, void *stream) {
    int32_t device = 0;
    aclrtGetDevice(&device);
    void *p = c10_npu::NPUWorkspaceAllocator::workspace(device).malloc(size, stream);
    if (p == nullptr) {
        return at::DataPtr(nullptr, nullptr, nullptr, (int16_t)device);
    }
    return at::DataPtr(p, new WorkspaceUse{device, p}, workspace_delete, (int16_t)device);
}
}  // namespace native
}  // namespace at_npu

/* ---- the test's "framework" front end: what torch's tensor code does, plus the ledger ---- */

using c10_npu::NPUCachingAllocator::caching_allocator;

namespace {
/* The counters at the event (under the allocator's lock) and after the call returned. */
std::string counters(size_t allocated_after, size_t reserved_after) {
    return fmt("\"allocated\": %zu, \"reserved\": %zu, \"allocated_after\": %zu, \"reserved_after\": %zu", at_event.allocated,
               at_event.reserved, allocated_after, reserved_after);
}
std::string counters(int device) {
    auto stats = caching_allocator.device(device).stats();
    return counters(stats.allocated, stats.reserved);
}
}  // namespace

extern "C" {

/* A tensor's storage: NpuCachingAllocator::malloc, as torch's allocate() calls it. */
EXPORT void *standin_tensor_alloc(size_t size, int device) {
    unsigned long long t0 = now_ns();
    void *p = nullptr;
    caching_allocator.malloc(&p, device, size, nullptr);
    if (Ledger::get().on() && p != nullptr) {
        auto *block = caching_allocator.lookup(p);
        Ledger::get().line(fmt("{\"ev\": \"block_malloc\", \"pool\": \"caching\", \"tid\": %ld, \"t0\": %llu, \"t1\": %llu, "
                               "\"device\": %d, \"req\": %zu, \"size\": %zu, \"ptr\": %llu, %s}",
                               tid(), t0, now_ns(), device, size, block->size, (unsigned long long)(uintptr_t)p,
                               counters(device).c_str()));
    }
    return p;
}

/* CPython's functions a thread of its own needs to hold a thread state, as the autograd
 * engine's device threads do (torch's PythonEngine::thread_init): handed in by the caller, so
 * the library does not link libpython. */
struct PythonThreadApi {
    int (*gil_ensure)(void);
    void *(*save_thread)(void);
    void (*restore_thread)(void *);
    void (*gil_release)(int);
};

/* A tensor's storage made on a new thread while the caller waits, as a GPU or NPU backward
 * makes gradients on the engine's thread while the Python caller blocks in `backward`. With
 * `python`, the thread holds a Python thread state with no frame (the engine's threads); with
 * NULL it has none (a C++ worker). Returns the storage. */
EXPORT void *standin_tensor_alloc_on_thread(size_t size, int device, const PythonThreadApi *python) {
    void *p = nullptr;
    std::thread worker([&] {
        int gil = 0;
        void *state = nullptr;
        if (python != nullptr) {
            gil = python->gil_ensure();
            state = python->save_thread();
        }
        // A new thread has no current device: the engine's threads set theirs first too.
        if (aclrtSetDevice(device) == 0) {
            p = standin_tensor_alloc(size, device);
        }
        if (python != nullptr) {
            python->restore_thread(state);
            python->gil_release(gil);
        }
    });
    worker.join();
    return p;
}

EXPORT void standin_tensor_free(void *ptr) {
    unsigned long long t0 = now_ns();
    auto *block = caching_allocator.lookup(ptr);
    int device = block ? block->device : 0;
    size_t size = block ? block->size : 0;
    caching_allocator.free(ptr);
    if (Ledger::get().on() && block != nullptr) {
        // A block freed while marked stays (not merged, not deleted) until its stream's work ends.
        Ledger::get().line(fmt("{\"ev\": \"block_free\", \"pool\": \"caching\", \"tid\": %ld, \"t0\": %llu, \"t1\": %llu, "
                               "\"device\": %d, \"size\": %zu, \"ptr\": %llu, \"deferred\": %s, %s}",
                               tid(), t0, now_ns(), device, size, (unsigned long long)(uintptr_t)ptr,
                               block->pending ? "true" : "false", counters(device).c_str()));
    }
}

EXPORT void standin_empty_cache(void) { caching_allocator.emptyCache(); }

/* What ProcessGroupHCCL does around a collective on its communication stream (id 1): mark the
 * tensors used there (unless reuse mode 2 avoids the marks), and at work.wait() erase the marks
 * (reuse modes 1 and 3). The tensors of the collective in flight, per thread. */
thread_local std::vector<void *> comm_tensors;

EXPORT void standin_comm_start(void *ptr, int device) {
    c10::DataPtr dp(ptr, nullptr, nullptr, (int16_t)device);
    c10_npu::NPUStream comm(c10::Stream{20, (int8_t)device, 1});
    if (reuse_mode() != 2) {
        c10_npu::NPUCachingAllocator::recordStream(dp, comm);
    }
    comm_tensors.push_back(ptr);
}

EXPORT void standin_comm_wait(int device) {
    int mode = reuse_mode();
    c10_npu::NPUStream comm(c10::Stream{20, (int8_t)device, 1});
    if (mode == 1 || mode == 3) {
        for (void *ptr : comm_tensors) {
            c10::DataPtr dp(ptr, nullptr, nullptr, (int16_t)device);
            c10_npu::NPUCachingAllocator::eraseStream(dp, comm);
        }
    }
    comm_tensors.clear();
}

/* A device synchronize: every stream's work is done. */
EXPORT void standin_synchronize(int device) { caching_allocator.device(device).synchronize(); }

EXPORT void standin_stats(int device, size_t *allocated, size_t *reserved) {
    auto stats = caching_allocator.device(device).stats();
    *allocated = stats.allocated;
    *reserved = stats.reserved;
}

/* The external (torchair) path: MallocBlock + GetBlockPtr, FreeBlock. */
EXPORT void *standin_external_alloc(size_t size, int device, void **handle) {
    unsigned long long t0 = now_ns();
    void *h = c10_npu::NPUCachingAllocator::MallocBlock(size, nullptr, device);
    *handle = h;
    if (h == nullptr) {
        return nullptr;
    }
    // The block's size first: the allocator pads and rounds the request, and a consumer that
    // sizes its buffer from the handle asks before it takes the address.
    size_t block_size = c10_npu::NPUCachingAllocator::GetBlockSize(h);
    void *p = c10_npu::NPUCachingAllocator::GetBlockPtr(h);
    if (Ledger::get().on()) {
        Ledger::get().line(fmt("{\"ev\": \"block_malloc\", \"pool\": \"external\", \"tid\": %ld, \"t0\": %llu, \"t1\": %llu, "
                               "\"device\": %d, \"req\": %zu, \"size\": %zu, \"ptr\": %llu, \"handle\": %llu, %s}",
                               tid(), t0, now_ns(), device, size, block_size, (unsigned long long)(uintptr_t)p,
                               (unsigned long long)(uintptr_t)h, counters(device).c_str()));
    }
    return p;
}

EXPORT void standin_external_free(void *handle) {
    unsigned long long t0 = now_ns();
    void *p = c10_npu::NPUCachingAllocator::GetBlockPtr(handle);
    size_t size = c10_npu::NPUCachingAllocator::GetBlockSize(handle);
    int device = static_cast<c10_npu::NPUCachingAllocator::Block *>(handle)->device;
    c10_npu::NPUCachingAllocator::FreeBlock(handle);
    if (Ledger::get().on()) {
        Ledger::get().line(fmt("{\"ev\": \"block_free\", \"pool\": \"external\", \"tid\": %ld, \"t0\": %llu, \"t1\": %llu, "
                               "\"device\": %d, \"size\": %zu, \"ptr\": %llu, %s}",
                               tid(), t0, now_ns(), device, size, (unsigned long long)(uintptr_t)p, counters(device).c_str()));
    }
}

/* A workspace use: allocate_workspace, then the DataPtr's end. */
EXPORT void *standin_workspace_alloc(size_t size, int device) {
    unsigned long long t0 = now_ns();
    auto *holder = new at::DataPtr(at_npu::native::allocate_workspace(size, nullptr));
    auto &ws = c10_npu::NPUWorkspaceAllocator::workspace(device);
    if (Ledger::get().on() && holder->data != nullptr) {
        Ledger::get().line(fmt("{\"ev\": \"block_malloc\", \"pool\": \"workspace\", \"tid\": %ld, \"t0\": %llu, \"t1\": %llu, "
                               "\"device\": %d, \"req\": %zu, \"size\": %zu, \"ptr\": %llu, %s}",
                               tid(), t0, now_ns(), device, size, size, (unsigned long long)(uintptr_t)holder->data,
                               counters(ws.allocated, ws.reserved).c_str()));
    }
    return holder;
}

EXPORT void *standin_workspace_ptr(void *holder) { return static_cast<at::DataPtr *>(holder)->data; }

EXPORT void standin_workspace_free(void *holder, int device) {
    unsigned long long t0 = now_ns();
    auto *dp = static_cast<at::DataPtr *>(holder);
    void *p = dp->data;
    delete dp;
    auto &ws = c10_npu::NPUWorkspaceAllocator::workspace(device);
    if (Ledger::get().on() && p != nullptr) {
        Ledger::get().line(fmt("{\"ev\": \"block_free\", \"pool\": \"workspace\", \"tid\": %ld, \"t0\": %llu, \"t1\": %llu, "
                               "\"device\": %d, \"ptr\": %llu, %s}",
                               tid(), t0, now_ns(), device, (unsigned long long)(uintptr_t)p,
                               counters(ws.allocated, ws.reserved).c_str()));
    }
}

}  // extern "C"
