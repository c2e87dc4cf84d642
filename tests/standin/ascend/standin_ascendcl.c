/*
 * STAND-IN libascendcl.so for memscope-bpf's tests. It is not the Ascend runtime.
 *
 * It exports the real ACL memory API (names and signatures from acl_rt.h) so that uprobes attach
 * by symbol exactly as on a machine with CANN, and it behaves the way the tracer must cope with:
 *
 * - Every public aclrtX forwards to an exported aclrtXImpl, as newer CANN does (libacl_rt.so ->
 *   libacl_rt_impl.so), so a tracer that probes both must still report one call.
 * - Device memory is real host memory, so copies and memsets work; each device has a capacity
 *   (STANDIN_ACL_DEVICE_MEM, default 8G; suffixes K/M/G) and STANDIN_ACL_DEVICE_COUNT devices
 *   (default 2). Exhaustion returns ACL_ERROR_RT_MEMORY_ALLOCATION and leaves *devPtr untouched.
 * - The device is per thread (aclrtSetDevice), or the DEVICE_ID attribute of aclrtMallocWithCfg,
 *   or the location of a physical-memory property.
 * - The virtual-memory family reserves address space (PROT_NONE), backs physical handles with
 *   memfds, and maps/unmaps them with MAP_FIXED, so mapped memory is usable.
 *
 * Built by `cargo xtask build` with -fno-ipa-icf (no two functions folded into one address) and
 * noinline, so each symbol is its own uprobe target.
 */
#define _GNU_SOURCE
#include "acl_standin.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define STANDIN_EXPORT __attribute__((visibility("default"), noinline, used))
#define MAX_DEVICES 64
#define BUCKETS 4096

enum block_kind { BLOCK_DEVICE = 1, BLOCK_HOST = 2, BLOCK_RESERVED = 3, BLOCK_MAPPED = 4 };

struct block {
    uintptr_t addr;
    size_t size;
    int32_t device;
    enum block_kind kind;
    struct block *next;
};

struct physical {
    int fd;
    size_t size;
    int32_t device;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct block *table[BUCKETS];
static size_t used[MAX_DEVICES];
static size_t capacity;
static int32_t device_count;
static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static __thread int32_t current_device = -1;

static size_t parse_size(const char *text, size_t fallback) {
    if (text == NULL || *text == '\0') {
        return fallback;
    }
    char *end = NULL;
    unsigned long long value = strtoull(text, &end, 10);
    switch (end ? *end : '\0') {
    case 'k': case 'K': value <<= 10; break;
    case 'm': case 'M': value <<= 20; break;
    case 'g': case 'G': value <<= 30; break;
    default: break;
    }
    return (size_t)value;
}

static void init(void) {
    capacity = parse_size(getenv("STANDIN_ACL_DEVICE_MEM"), (size_t)8 << 30);
    device_count = (int32_t)parse_size(getenv("STANDIN_ACL_DEVICE_COUNT"), 2);
    if (device_count < 1 || device_count > MAX_DEVICES) {
        device_count = 2;
    }
}

static size_t bucket_of(uintptr_t addr) { return (addr >> 5) % BUCKETS; }

/* Caller holds the lock. */
static void insert_block(uintptr_t addr, size_t size, int32_t device, enum block_kind kind) {
    struct block *b = malloc(sizeof *b);
    b->addr = addr;
    b->size = size;
    b->device = device;
    b->kind = kind;
    size_t i = bucket_of(addr);
    b->next = table[i];
    table[i] = b;
}

/* Caller holds the lock. Unlinks and returns the block, or NULL. */
static struct block *take_block(uintptr_t addr, enum block_kind kind) {
    struct block **at = &table[bucket_of(addr)];
    for (; *at != NULL; at = &(*at)->next) {
        if ((*at)->addr == addr && (*at)->kind == kind) {
            struct block *found = *at;
            *at = found->next;
            return found;
        }
    }
    return NULL;
}

static int valid_device(int32_t device) { return device >= 0 && device < device_count; }

/* Reserves capacity on a device; 0 on success. */
static int charge(int32_t device, size_t size) {
    int ok = 0;
    pthread_mutex_lock(&lock);
    if (size > capacity - used[device]) {
        ok = -1;
    } else {
        used[device] += size;
    }
    pthread_mutex_unlock(&lock);
    return ok;
}

static aclError device_malloc(void **devPtr, size_t size, int32_t device) {
    pthread_once(&init_once, init);
    if (devPtr == NULL || size == 0) {
        return ACL_ERROR_INVALID_PARAM;
    }
    if (!valid_device(device)) {
        return device < 0 ? ACL_ERROR_RT_CONTEXT_NULL : ACL_ERROR_INVALID_PARAM;
    }
    if (charge(device, size) != 0) {
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    void *p = NULL;
    if (posix_memalign(&p, 512, size) != 0) {
        pthread_mutex_lock(&lock);
        used[device] -= size;
        pthread_mutex_unlock(&lock);
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    pthread_mutex_lock(&lock);
    insert_block((uintptr_t)p, size, device, BLOCK_DEVICE);
    pthread_mutex_unlock(&lock);
    *devPtr = p;
    return ACL_SUCCESS;
}

/* ---- device selection ---- */

STANDIN_EXPORT aclError aclrtSetDeviceImpl(int32_t deviceId) {
    pthread_once(&init_once, init);
    if (!valid_device(deviceId)) {
        return ACL_ERROR_INVALID_PARAM;
    }
    current_device = deviceId;
    return ACL_SUCCESS;
}

STANDIN_EXPORT aclError aclrtGetDeviceImpl(int32_t *deviceId) {
    if (deviceId == NULL) {
        return ACL_ERROR_INVALID_PARAM;
    }
    if (current_device < 0) {
        return ACL_ERROR_RT_CONTEXT_NULL;
    }
    *deviceId = current_device;
    return ACL_SUCCESS;
}

/* ---- device memory ---- */

STANDIN_EXPORT aclError aclrtMallocImpl(void **devPtr, size_t size, aclrtMemMallocPolicy policy) {
    (void)policy;
    /* The real runtime pads by 32 bytes plus alignment; callers see only what they asked for. */
    return device_malloc(devPtr, size, current_device);
}

STANDIN_EXPORT aclError aclrtMallocAlign32Impl(void **devPtr, size_t size, aclrtMemMallocPolicy policy) {
    (void)policy;
    return device_malloc(devPtr, size, current_device);
}

STANDIN_EXPORT aclError aclrtMallocCachedImpl(void **devPtr, size_t size, aclrtMemMallocPolicy policy) {
    (void)policy;
    return device_malloc(devPtr, size, current_device);
}

STANDIN_EXPORT aclError aclrtMallocWithCfgImpl(void **devPtr, size_t size, aclrtMemMallocPolicy policy,
                                               aclrtMallocConfig *cfg) {
    (void)policy;
    int32_t device = current_device;
    if (cfg != NULL && cfg->attrs != NULL) {
        for (size_t i = 0; i < cfg->numAttrs; i++) {
            if (cfg->attrs[i].attr == ACL_RT_MEM_ATTR_DEVICE_ID) {
                device = (int32_t)cfg->attrs[i].value.deviceId;
            }
            /* MODULE_ID only labels the owner on a real machine; nothing to do here. */
        }
    }
    return device_malloc(devPtr, size, device);
}

STANDIN_EXPORT aclError aclrtFreeImpl(void *devPtr) {
    pthread_once(&init_once, init);
    pthread_mutex_lock(&lock);
    struct block *b = take_block((uintptr_t)devPtr, BLOCK_DEVICE);
    if (b != NULL) {
        used[b->device] -= b->size;
    }
    pthread_mutex_unlock(&lock);
    if (b == NULL) {
        return ACL_ERROR_INVALID_PARAM;
    }
    free(devPtr);
    free(b);
    return ACL_SUCCESS;
}

/* ---- host memory ---- */

STANDIN_EXPORT aclError aclrtMallocHostImpl(void **hostPtr, size_t size) {
    if (hostPtr == NULL || size == 0) {
        return ACL_ERROR_INVALID_PARAM;
    }
    void *p = malloc(size);
    if (p == NULL) {
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    pthread_mutex_lock(&lock);
    insert_block((uintptr_t)p, size, -1, BLOCK_HOST);
    pthread_mutex_unlock(&lock);
    *hostPtr = p;
    return ACL_SUCCESS;
}

STANDIN_EXPORT aclError aclrtFreeHostImpl(void *hostPtr) {
    pthread_mutex_lock(&lock);
    struct block *b = take_block((uintptr_t)hostPtr, BLOCK_HOST);
    pthread_mutex_unlock(&lock);
    if (b == NULL) {
        return ACL_ERROR_INVALID_PARAM;
    }
    free(hostPtr);
    free(b);
    return ACL_SUCCESS;
}

/* ---- queries and copies ---- */

STANDIN_EXPORT aclError aclrtGetMemInfoImpl(aclrtMemAttr attr, size_t *free_bytes, size_t *total) {
    (void)attr;
    pthread_once(&init_once, init);
    if (!valid_device(current_device) || free_bytes == NULL || total == NULL) {
        return ACL_ERROR_RT_CONTEXT_NULL;
    }
    pthread_mutex_lock(&lock);
    *free_bytes = capacity - used[current_device];
    pthread_mutex_unlock(&lock);
    *total = capacity;
    return ACL_SUCCESS;
}

STANDIN_EXPORT aclError aclrtMemcpyImpl(void *dst, size_t destMax, const void *src, size_t count,
                                        aclrtMemcpyKind kind) {
    (void)kind;
    if (dst == NULL || src == NULL || count > destMax) {
        return ACL_ERROR_INVALID_PARAM;
    }
    memmove(dst, src, count);
    return ACL_SUCCESS;
}

STANDIN_EXPORT aclError aclrtMemsetImpl(void *devPtr, size_t maxCount, int32_t value, size_t count) {
    if (devPtr == NULL || count > maxCount) {
        return ACL_ERROR_INVALID_PARAM;
    }
    memset(devPtr, value, count);
    return ACL_SUCCESS;
}

/* ---- virtual memory (expandable segments) ---- */

STANDIN_EXPORT aclError aclrtReserveMemAddressImpl(void **virPtr, size_t size, size_t alignment,
                                                   void *expectPtr, uint64_t flags) {
    (void)alignment;
    (void)flags;
    if (virPtr == NULL || size == 0) {
        return ACL_ERROR_INVALID_PARAM;
    }
    void *p = mmap(expectPtr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    pthread_mutex_lock(&lock);
    insert_block((uintptr_t)p, size, -1, BLOCK_RESERVED);
    pthread_mutex_unlock(&lock);
    *virPtr = p;
    return ACL_SUCCESS;
}

STANDIN_EXPORT aclError aclrtReleaseMemAddressImpl(void *virPtr) {
    pthread_mutex_lock(&lock);
    struct block *b = take_block((uintptr_t)virPtr, BLOCK_RESERVED);
    pthread_mutex_unlock(&lock);
    if (b == NULL) {
        return ACL_ERROR_INVALID_PARAM;
    }
    munmap(virPtr, b->size);
    free(b);
    return ACL_SUCCESS;
}

STANDIN_EXPORT aclError aclrtMallocPhysicalImpl(aclrtDrvMemHandle *handle, size_t size,
                                                const aclrtPhysicalMemProp *prop, uint64_t flags) {
    (void)flags;
    pthread_once(&init_once, init);
    if (handle == NULL || prop == NULL || size == 0) {
        return ACL_ERROR_INVALID_PARAM;
    }
    int32_t device = (int32_t)prop->location.id;
    if (!valid_device(device)) {
        return ACL_ERROR_INVALID_PARAM;
    }
    if (charge(device, size) != 0) {
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    int fd = memfd_create("standin-acl-physical", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
        if (fd >= 0) {
            close(fd);
        }
        pthread_mutex_lock(&lock);
        used[device] -= size;
        pthread_mutex_unlock(&lock);
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    struct physical *phys = malloc(sizeof *phys);
    phys->fd = fd;
    phys->size = size;
    phys->device = device;
    *handle = phys;
    return ACL_SUCCESS;
}

STANDIN_EXPORT aclError aclrtFreePhysicalImpl(aclrtDrvMemHandle handle) {
    struct physical *phys = handle;
    if (phys == NULL) {
        return ACL_ERROR_INVALID_PARAM;
    }
    pthread_mutex_lock(&lock);
    used[phys->device] -= phys->size;
    pthread_mutex_unlock(&lock);
    close(phys->fd);
    free(phys);
    return ACL_SUCCESS;
}

STANDIN_EXPORT aclError aclrtMapMemImpl(void *virPtr, size_t size, size_t offset, aclrtDrvMemHandle handle,
                                        uint64_t flags) {
    (void)flags;
    struct physical *phys = handle;
    if (virPtr == NULL || phys == NULL || offset + size > phys->size) {
        return ACL_ERROR_INVALID_PARAM;
    }
    void *p = mmap(virPtr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, phys->fd, (off_t)offset);
    if (p == MAP_FAILED) {
        return ACL_ERROR_INVALID_PARAM;
    }
    pthread_mutex_lock(&lock);
    insert_block((uintptr_t)virPtr, size, phys->device, BLOCK_MAPPED);
    pthread_mutex_unlock(&lock);
    return ACL_SUCCESS;
}

STANDIN_EXPORT aclError aclrtUnmapMemImpl(void *virPtr) {
    pthread_mutex_lock(&lock);
    struct block *b = take_block((uintptr_t)virPtr, BLOCK_MAPPED);
    pthread_mutex_unlock(&lock);
    if (b == NULL) {
        return ACL_ERROR_INVALID_PARAM;
    }
    /* Back to reserved-but-inaccessible address space, as after aclrtReserveMemAddress. */
    mmap(virPtr, b->size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    free(b);
    return ACL_SUCCESS;
}

/* ---- public entry points: one-line forwarders, as libacl_rt.so is in newer CANN ---- */

STANDIN_EXPORT aclError aclrtSetDevice(int32_t deviceId) { return aclrtSetDeviceImpl(deviceId); }
STANDIN_EXPORT aclError aclrtGetDevice(int32_t *deviceId) { return aclrtGetDeviceImpl(deviceId); }
STANDIN_EXPORT aclError aclrtMalloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy) {
    return aclrtMallocImpl(devPtr, size, policy);
}
STANDIN_EXPORT aclError aclrtMallocAlign32(void **devPtr, size_t size, aclrtMemMallocPolicy policy) {
    return aclrtMallocAlign32Impl(devPtr, size, policy);
}
STANDIN_EXPORT aclError aclrtMallocCached(void **devPtr, size_t size, aclrtMemMallocPolicy policy) {
    return aclrtMallocCachedImpl(devPtr, size, policy);
}
STANDIN_EXPORT aclError aclrtMallocWithCfg(void **devPtr, size_t size, aclrtMemMallocPolicy policy,
                                           aclrtMallocConfig *cfg) {
    return aclrtMallocWithCfgImpl(devPtr, size, policy, cfg);
}
STANDIN_EXPORT aclError aclrtFree(void *devPtr) { return aclrtFreeImpl(devPtr); }
STANDIN_EXPORT aclError aclrtMallocHost(void **hostPtr, size_t size) { return aclrtMallocHostImpl(hostPtr, size); }
STANDIN_EXPORT aclError aclrtFreeHost(void *hostPtr) { return aclrtFreeHostImpl(hostPtr); }
STANDIN_EXPORT aclError aclrtGetMemInfo(aclrtMemAttr attr, size_t *free_bytes, size_t *total) {
    return aclrtGetMemInfoImpl(attr, free_bytes, total);
}
STANDIN_EXPORT aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count,
                                    aclrtMemcpyKind kind) {
    return aclrtMemcpyImpl(dst, destMax, src, count, kind);
}
STANDIN_EXPORT aclError aclrtMemset(void *devPtr, size_t maxCount, int32_t value, size_t count) {
    return aclrtMemsetImpl(devPtr, maxCount, value, count);
}
STANDIN_EXPORT aclError aclrtReserveMemAddress(void **virPtr, size_t size, size_t alignment, void *expectPtr,
                                               uint64_t flags) {
    return aclrtReserveMemAddressImpl(virPtr, size, alignment, expectPtr, flags);
}
STANDIN_EXPORT aclError aclrtReleaseMemAddress(void *virPtr) { return aclrtReleaseMemAddressImpl(virPtr); }
STANDIN_EXPORT aclError aclrtMallocPhysical(aclrtDrvMemHandle *handle, size_t size, const aclrtPhysicalMemProp *prop,
                                            uint64_t flags) {
    return aclrtMallocPhysicalImpl(handle, size, prop, flags);
}
STANDIN_EXPORT aclError aclrtFreePhysical(aclrtDrvMemHandle handle) { return aclrtFreePhysicalImpl(handle); }
STANDIN_EXPORT aclError aclrtMapMem(void *virPtr, size_t size, size_t offset, aclrtDrvMemHandle handle,
                                    uint64_t flags) {
    return aclrtMapMemImpl(virPtr, size, offset, handle, flags);
}
STANDIN_EXPORT aclError aclrtUnmapMem(void *virPtr) { return aclrtUnmapMemImpl(virPtr); }
