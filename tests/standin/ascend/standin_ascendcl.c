/*
 * STAND-IN libascendcl.so for memscope-bpf's tests. It is not the Ascend runtime.
 *
 * It exports the real ACL memory API (names and signatures from acl_rt.h) so that uprobes attach
 * by symbol exactly as on a machine with CANN, and it behaves the way the tracer must cope with:
 *
 * - Every public aclrtX forwards to an exported aclrtXImpl, as newer CANN does (libacl_rt.so ->
 *   libacl_rt_impl.so), so a tracer that probes both must still report one call.
 * - Device memory comes from the stand-in driver (libascend_hal.so), as the real runtime's does:
 *   aclrtMalloc asks the driver for size+32 rounded up to 32 bytes, the other mallocs for size
 *   rounded up to 32; the driver flag carries the device, device memory type, page class (from
 *   the policy) and module (APP, or the MODULE_ID attribute of aclrtMallocWithCfg). Driver
 *   exhaustion becomes ACL_ERROR_RT_MEMORY_ALLOCATION, with *devPtr untouched.
 * - The device is per thread (aclrtSetDevice), or the DEVICE_ID attribute of aclrtMallocWithCfg,
 *   or the location of a physical-memory property.
 * - The virtual-memory family reserves address space (PROT_NONE), creates physical memory with
 *   halMemCreate, and maps it with MAP_FIXED, so mapped memory is usable.
 * - aclrtSetDevice also charges the device's runtime context through the stand-in driver
 *   (standin_hal_context_charge: STANDIN_HAL_CONTEXT_MEM bytes, once per device per process,
 *   default none), memory no traced call explains; a device without room for it fails
 *   aclrtSetDevice with ACL_ERROR_RT_MEMORY_ALLOCATION.
 * - Host memory registration (aclrtHostRegister, aclrtHostRegisterV2, aclrtHostUnregister) only
 *   remembers the range: it charges no device memory, and the device alias of a registered range
 *   is its host address. A NULL pointer, a zero size, a range overlapping a registered one, or
 *   unregistering an address that is no registered range's start is ACL_ERROR_INVALID_PARAM.
 *   With STANDIN_ACL_LEDGER=<path>, each of these calls is appended to that file as one JSON
 *   line (api, tid, t0, t1, size, flag, ptr, rc; dev_ptr for aclrtHostRegister, whose type goes
 *   in flag); the runtime's other calls are logged by the workloads that make them.
 *
 * Built by `cargo xtask build` with -fno-ipa-icf (no two functions folded into one address) and
 * noinline, so each symbol is its own uprobe target.
 */
#define _GNU_SOURCE
#include "../common/standin_common.h"
#include "acl_standin.h"
#include "hal_standin.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#define STANDIN_EXPORT __attribute__((visibility("default"), noinline, used))
#define BUCKETS 4096
#define MODULE_APP 33

enum block_kind { BLOCK_HOST = 2, BLOCK_RESERVED = 3, BLOCK_MAPPED = 4, BLOCK_REGISTERED = 5 };

struct block {
    uintptr_t addr;
    size_t size;
    enum block_kind kind;
    struct block *next;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct block *table[BUCKETS];
static __thread int32_t current_device = -1;

static size_t bucket_of(uintptr_t addr) { return (addr >> 5) % BUCKETS; }

static void insert_block(uintptr_t addr, size_t size, enum block_kind kind) {
    struct block *b = malloc(sizeof *b);
    b->addr = addr;
    b->size = size;
    b->kind = kind;
    pthread_mutex_lock(&lock);
    size_t i = bucket_of(addr);
    b->next = table[i];
    table[i] = b;
    pthread_mutex_unlock(&lock);
}

/* Unlinks and returns the block, or NULL. */
static struct block *take_block(uintptr_t addr, enum block_kind kind) {
    struct block *found = NULL;
    pthread_mutex_lock(&lock);
    for (struct block **at = &table[bucket_of(addr)]; *at != NULL; at = &(*at)->next) {
        if ((*at)->addr == addr && (*at)->kind == kind) {
            found = *at;
            *at = found->next;
            break;
        }
    }
    pthread_mutex_unlock(&lock);
    return found;
}

static int valid_device(int32_t device) { return device >= 0 && (uint32_t)device < standin_hal_device_count(); }

static size_t round32(size_t n) { return (n + 31) & ~(size_t)31; }

static unsigned long long page_bits(aclrtMemMallocPolicy policy) {
    switch ((int)policy & 0xff) {
    case ACL_MEM_MALLOC_HUGE_FIRST:
    case ACL_MEM_MALLOC_HUGE_ONLY:
    case ACL_MEM_MALLOC_HUGE_FIRST_P2P:
    case ACL_MEM_MALLOC_HUGE_ONLY_P2P:
        return MEM_PAGE_HUGE;
    case ACL_MEM_MALLOC_HUGE1G_ONLY:
    case ACL_MEM_MALLOC_HUGE1G_ONLY_P2P:
        return MEM_PAGE_GIANT;
    default:
        return 0;
    }
}

static aclError device_malloc(void **devPtr, size_t size, int32_t device, aclrtMemMallocPolicy policy,
                              unsigned module, int padded) {
    if (devPtr == NULL || size == 0) {
        return ACL_ERROR_INVALID_PARAM;
    }
    if (!valid_device(device)) {
        return device < 0 ? ACL_ERROR_RT_CONTEXT_NULL : ACL_ERROR_INVALID_PARAM;
    }
    size_t driver_size = padded ? round32(size + 32) : round32(size);
    unsigned long long flag = (unsigned long long)device | (MEM_DEV_VAL << MEM_VIRT_BIT) | page_bits(policy) |
                              ((unsigned long long)module << MEM_MODULE_SHIFT);
    void *p = NULL;
    drvError_t rc = halMemAlloc(&p, driver_size, flag);
    if (rc == DRV_ERROR_OUT_OF_MEMORY) {
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    if (rc != DRV_ERROR_NONE) {
        return ACL_ERROR_INVALID_PARAM;
    }
    *devPtr = p;
    return ACL_SUCCESS;
}

/* ---- device selection ---- */

STANDIN_EXPORT aclError aclrtSetDeviceImpl(int32_t deviceId) {
    if (!valid_device(deviceId)) {
        return ACL_ERROR_INVALID_PARAM;
    }
    /* The device's context: its memory once per process, through the driver. */
    if (standin_hal_context_charge((uint32_t)deviceId) == DRV_ERROR_OUT_OF_MEMORY) {
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
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
    return device_malloc(devPtr, size, current_device, policy, MODULE_APP, 1);
}

STANDIN_EXPORT aclError aclrtMallocAlign32Impl(void **devPtr, size_t size, aclrtMemMallocPolicy policy) {
    return device_malloc(devPtr, size, current_device, policy, MODULE_APP, 0);
}

STANDIN_EXPORT aclError aclrtMallocCachedImpl(void **devPtr, size_t size, aclrtMemMallocPolicy policy) {
    aclError rc = device_malloc(devPtr, size, current_device, policy, MODULE_APP, 0);
    return rc;
}

STANDIN_EXPORT aclError aclrtMallocWithCfgImpl(void **devPtr, size_t size, aclrtMemMallocPolicy policy,
                                               aclrtMallocConfig *cfg) {
    int32_t device = current_device;
    unsigned module = MODULE_APP;
    if (cfg != NULL && cfg->attrs != NULL) {
        for (size_t i = 0; i < cfg->numAttrs; i++) {
            if (cfg->attrs[i].attr == ACL_RT_MEM_ATTR_DEVICE_ID) {
                device = (int32_t)cfg->attrs[i].value.deviceId;
            } else if (cfg->attrs[i].attr == ACL_RT_MEM_ATTR_MODULE_ID) {
                module = cfg->attrs[i].value.moduleId;
            }
        }
    }
    return device_malloc(devPtr, size, device, policy, module, 0);
}

STANDIN_EXPORT aclError aclrtFreeImpl(void *devPtr) {
    return halMemFree(devPtr) == DRV_ERROR_NONE ? ACL_SUCCESS : ACL_ERROR_INVALID_PARAM;
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
    insert_block((uintptr_t)p, size, BLOCK_HOST);
    *hostPtr = p;
    return ACL_SUCCESS;
}

STANDIN_EXPORT aclError aclrtFreeHostImpl(void *hostPtr) {
    struct block *b = take_block((uintptr_t)hostPtr, BLOCK_HOST);
    if (b == NULL) {
        return ACL_ERROR_INVALID_PARAM;
    }
    free(hostPtr);
    free(b);
    return ACL_SUCCESS;
}

/* ---- host memory registration ---- */

static pthread_once_t ledger_once = PTHREAD_ONCE_INIT;
static FILE *ledger;

static void open_ledger(void) { ledger = standin_ledger("STANDIN_ACL_LEDGER"); }

static aclError note(const char *api, unsigned long long t0, const void *ptr, uint64_t size, unsigned long long flag,
                     const void *dev_ptr, int with_dev_ptr, aclError rc) {
    pthread_once(&ledger_once, open_ledger);
    if (ledger == NULL) {
        return rc;
    }
    char extra[48] = "";
    if (with_dev_ptr) {
        snprintf(extra, sizeof extra, ", \"dev_ptr\": %llu", (unsigned long long)(uintptr_t)dev_ptr);
    }
    flockfile(ledger);
    fprintf(ledger,
            "{\"api\": \"%s\", \"tid\": %ld, \"t0\": %llu, \"t1\": %llu, \"size\": %llu, \"flag\": %llu, "
            "\"ptr\": %llu, \"rc\": %d%s}\n",
            api, (long)syscall(SYS_gettid), t0, standin_now_ns(), (unsigned long long)size, flag,
            (unsigned long long)(uintptr_t)ptr, rc, extra);
    fflush(ledger);
    funlockfile(ledger);
    return rc;
}

/* Remembers [ptr, ptr+size) as registered; ACL_ERROR_INVALID_PARAM when it overlaps a range
 * already registered. */
static aclError register_range(void *ptr, uint64_t size) {
    uintptr_t start = (uintptr_t)ptr, end = start + size;
    if (ptr == NULL || size == 0 || end < start) {
        return ACL_ERROR_INVALID_PARAM;
    }
    struct block *b = malloc(sizeof *b);
    if (b == NULL) {
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    aclError rc = ACL_SUCCESS;
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < BUCKETS && rc == ACL_SUCCESS; i++) {
        for (struct block *at = table[i]; at != NULL; at = at->next) {
            if (at->kind == BLOCK_REGISTERED && start < at->addr + at->size && at->addr < end) {
                rc = ACL_ERROR_INVALID_PARAM;
                break;
            }
        }
    }
    if (rc == ACL_SUCCESS) {
        b->addr = start;
        b->size = (size_t)size;
        b->kind = BLOCK_REGISTERED;
        size_t i = bucket_of(start);
        b->next = table[i];
        table[i] = b;
    }
    pthread_mutex_unlock(&lock);
    if (rc != ACL_SUCCESS) {
        free(b);
    }
    return rc;
}

STANDIN_EXPORT aclError aclrtHostRegisterImpl(void *ptr, uint64_t size, aclrtHostRegisterType type, void **devPtr) {
    unsigned long long t0 = standin_now_ns();
    aclError rc = ACL_SUCCESS;
    if (devPtr == NULL || (type != ACL_HOST_REGISTER_MAPPED && type != ACL_HOST_REGISTER_IOMEMORY &&
                           type != ACL_HOST_REGISTER_READONLY)) {
        rc = ACL_ERROR_INVALID_PARAM;
    } else {
        rc = register_range(ptr, size);
    }
    if (rc == ACL_SUCCESS) {
        *devPtr = ptr; /* the device reaches it at its host address */
    }
    return note("aclrtHostRegister", t0, ptr, size, (unsigned long long)type, rc == ACL_SUCCESS ? ptr : NULL, 1, rc);
}

STANDIN_EXPORT aclError aclrtHostRegisterV2Impl(void *ptr, uint64_t size, uint32_t flag) {
    unsigned long long t0 = standin_now_ns();
    const uint32_t known = ACL_HOST_REG_MAPPED | ACL_HOST_REG_IOMEMORY | ACL_HOST_REG_READONLY | ACL_HOST_REG_PINNED;
    aclError rc = (flag & ~known) != 0 ? ACL_ERROR_INVALID_PARAM : register_range(ptr, size);
    return note("aclrtHostRegisterV2", t0, ptr, size, flag, NULL, 0, rc);
}

STANDIN_EXPORT aclError aclrtHostUnregisterImpl(void *ptr) {
    unsigned long long t0 = standin_now_ns();
    struct block *b = ptr == NULL ? NULL : take_block((uintptr_t)ptr, BLOCK_REGISTERED);
    aclError rc = b != NULL ? ACL_SUCCESS : ACL_ERROR_INVALID_PARAM;
    uint64_t size = b != NULL ? b->size : 0;
    free(b);
    return note("aclrtHostUnregister", t0, ptr, size, 0, NULL, 0, rc);
}

/* ---- queries and copies ---- */

STANDIN_EXPORT aclError aclrtGetMemInfoImpl(aclrtMemAttr attr, size_t *free_bytes, size_t *total) {
    (void)attr;
    if (!valid_device(current_device) || standin_hal_mem_info((uint32_t)current_device, free_bytes, total) != 0) {
        return ACL_ERROR_RT_CONTEXT_NULL;
    }
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

STANDIN_EXPORT aclError aclrtMemcpyAsyncImpl(void *dst, size_t destMax, const void *src, size_t count,
                                             aclrtMemcpyKind kind, void *stream) {
    (void)stream;
    /* The stand-in's "device" is host memory, so the copy completes at once. */
    return aclrtMemcpyImpl(dst, destMax, src, count, kind);
}

/* ---- kernels ---- */

/* A function handle remembers its kernel's name; launching checks the handle and the argument
 * buffer and otherwise does nothing (there is no device to run on). */
struct standin_function {
    char name[128];
};

STANDIN_EXPORT aclError aclrtBinaryGetFunctionImpl(const aclrtBinHandle binHandle, const char *kernelName,
                                                  aclrtFuncHandle *funcHandle) {
    (void)binHandle;
    if (kernelName == NULL || funcHandle == NULL) {
        return ACL_ERROR_INVALID_PARAM;
    }
    struct standin_function *f = calloc(1, sizeof *f);
    if (f == NULL) {
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    snprintf(f->name, sizeof f->name, "%s", kernelName);
    *funcHandle = f;
    return ACL_SUCCESS;
}

STANDIN_EXPORT aclError aclrtLaunchKernelImpl(aclrtFuncHandle funcHandle, uint32_t blockDim, const void *argsData,
                                             size_t argsSize, void *stream) {
    (void)blockDim;
    (void)stream;
    if (funcHandle == NULL || (argsSize > 0 && argsData == NULL)) {
        return ACL_ERROR_INVALID_PARAM;
    }
    return ACL_SUCCESS;
}

/* An argument list being built: the appended parameters, packed as the kernel will see them. */
struct standin_args {
    aclrtFuncHandle function;
    unsigned char data[4096];
    size_t len;
    int final;
};

STANDIN_EXPORT aclError aclrtKernelArgsInitImpl(aclrtFuncHandle funcHandle, aclrtArgsHandle *argsHandle) {
    if (funcHandle == NULL || argsHandle == NULL) {
        return ACL_ERROR_INVALID_PARAM;
    }
    struct standin_args *a = calloc(1, sizeof *a);
    if (a == NULL) {
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    a->function = funcHandle;
    *argsHandle = a;
    return ACL_SUCCESS;
}

STANDIN_EXPORT aclError aclrtKernelArgsAppendImpl(aclrtArgsHandle argsHandle, void *param, size_t paramSize,
                                                 aclrtParamHandle *paramHandle) {
    struct standin_args *a = argsHandle;
    if (a == NULL || param == NULL || a->final || paramSize > sizeof a->data - a->len) {
        return ACL_ERROR_INVALID_PARAM;
    }
    memcpy(a->data + a->len, param, paramSize);
    if (paramHandle != NULL) {
        *paramHandle = a->data + a->len;
    }
    a->len += paramSize;
    return ACL_SUCCESS;
}

STANDIN_EXPORT aclError aclrtKernelArgsFinalizeImpl(aclrtArgsHandle argsHandle) {
    struct standin_args *a = argsHandle;
    if (a == NULL) {
        return ACL_ERROR_INVALID_PARAM;
    }
    a->final = 1;
    return ACL_SUCCESS;
}

STANDIN_EXPORT aclError aclrtLaunchKernelWithConfigImpl(aclrtFuncHandle funcHandle, uint32_t blockDim, void *stream,
                                                       aclrtLaunchKernelCfg *cfg, aclrtArgsHandle argsHandle,
                                                       void *reserve) {
    (void)blockDim;
    (void)stream;
    (void)cfg;
    (void)reserve;
    struct standin_args *a = argsHandle;
    if (funcHandle == NULL || a == NULL || !a->final || a->function != funcHandle) {
        return ACL_ERROR_INVALID_PARAM;
    }
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
    /* Device ranges start on 2 MiB (a huge page), as the driver's do: torch_npu's base-address
     * alignment of expandable blocks depends on it. The slack around the aligned range is
     * given back. */
    const size_t huge = (size_t)2 << 20;
    void *raw = mmap(expectPtr, size + huge, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) {
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    uintptr_t start = ((uintptr_t)raw + huge - 1) & ~(uintptr_t)(huge - 1);
    if (start > (uintptr_t)raw) {
        munmap(raw, start - (uintptr_t)raw);
    }
    size_t tail = (uintptr_t)raw + size + huge - (start + size);
    if (tail > 0) {
        munmap((void *)(start + size), tail);
    }
    void *p = (void *)start;
    insert_block((uintptr_t)p, size, BLOCK_RESERVED);
    *virPtr = p;
    return ACL_SUCCESS;
}

STANDIN_EXPORT aclError aclrtReleaseMemAddressImpl(void *virPtr) {
    struct block *b = take_block((uintptr_t)virPtr, BLOCK_RESERVED);
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
    if (handle == NULL || prop == NULL || size == 0) {
        return ACL_ERROR_INVALID_PARAM;
    }
    struct drv_mem_prop drv = {0};
    drv.side = MEM_DEV_SIDE;
    drv.devid = prop->location.id;
    drv.module_id = MODULE_APP;
    drv.pg_type = prop->memAttr == ACL_HBM_MEM_HUGE1G ? MEM_GIANT_PAGE_TYPE
                  : prop->memAttr == ACL_HBM_MEM_HUGE  ? MEM_HUGE_PAGE_TYPE
                                                       : MEM_NORMAL_PAGE_TYPE;
    drv_mem_handle_t *h = NULL;
    drvError_t rc = halMemCreate(&h, size, &drv, 0);
    if (rc == DRV_ERROR_OUT_OF_MEMORY) {
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    if (rc != DRV_ERROR_NONE) {
        return ACL_ERROR_INVALID_PARAM;
    }
    *handle = h;
    return ACL_SUCCESS;
}

STANDIN_EXPORT aclError aclrtFreePhysicalImpl(aclrtDrvMemHandle handle) {
    return halMemRelease(handle) == DRV_ERROR_NONE ? ACL_SUCCESS : ACL_ERROR_INVALID_PARAM;
}

STANDIN_EXPORT aclError aclrtMapMemImpl(void *virPtr, size_t size, size_t offset, aclrtDrvMemHandle handle,
                                        uint64_t flags) {
    (void)flags;
    size_t physical = 0;
    int fd = standin_hal_handle_fd(handle, &physical);
    if (virPtr == NULL || fd < 0 || offset + size > physical) {
        return ACL_ERROR_INVALID_PARAM;
    }
    void *p = mmap(virPtr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, (off_t)offset);
    if (p == MAP_FAILED) {
        return ACL_ERROR_INVALID_PARAM;
    }
    insert_block((uintptr_t)virPtr, size, BLOCK_MAPPED);
    return ACL_SUCCESS;
}

STANDIN_EXPORT aclError aclrtUnmapMemImpl(void *virPtr) {
    struct block *b = take_block((uintptr_t)virPtr, BLOCK_MAPPED);
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
STANDIN_EXPORT aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count,
                                         aclrtMemcpyKind kind, void *stream) {
    return aclrtMemcpyAsyncImpl(dst, destMax, src, count, kind, stream);
}
STANDIN_EXPORT aclError aclrtBinaryGetFunction(const aclrtBinHandle binHandle, const char *kernelName,
                                               aclrtFuncHandle *funcHandle) {
    return aclrtBinaryGetFunctionImpl(binHandle, kernelName, funcHandle);
}
STANDIN_EXPORT aclError aclrtLaunchKernel(aclrtFuncHandle funcHandle, uint32_t blockDim, const void *argsData,
                                          size_t argsSize, void *stream) {
    return aclrtLaunchKernelImpl(funcHandle, blockDim, argsData, argsSize, stream);
}
STANDIN_EXPORT aclError aclrtKernelArgsInit(aclrtFuncHandle funcHandle, aclrtArgsHandle *argsHandle) {
    return aclrtKernelArgsInitImpl(funcHandle, argsHandle);
}
STANDIN_EXPORT aclError aclrtKernelArgsAppend(aclrtArgsHandle argsHandle, void *param, size_t paramSize,
                                              aclrtParamHandle *paramHandle) {
    return aclrtKernelArgsAppendImpl(argsHandle, param, paramSize, paramHandle);
}
STANDIN_EXPORT aclError aclrtKernelArgsFinalize(aclrtArgsHandle argsHandle) {
    return aclrtKernelArgsFinalizeImpl(argsHandle);
}
STANDIN_EXPORT aclError aclrtLaunchKernelWithConfig(aclrtFuncHandle funcHandle, uint32_t blockDim, void *stream,
                                                    aclrtLaunchKernelCfg *cfg, aclrtArgsHandle argsHandle,
                                                    void *reserve) {
    return aclrtLaunchKernelWithConfigImpl(funcHandle, blockDim, stream, cfg, argsHandle, reserve);
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
STANDIN_EXPORT aclError aclrtHostRegister(void *ptr, uint64_t size, aclrtHostRegisterType type, void **devPtr) {
    return aclrtHostRegisterImpl(ptr, size, type, devPtr);
}
STANDIN_EXPORT aclError aclrtHostRegisterV2(void *ptr, uint64_t size, uint32_t flag) {
    return aclrtHostRegisterV2Impl(ptr, size, flag);
}
STANDIN_EXPORT aclError aclrtHostUnregister(void *ptr) { return aclrtHostUnregisterImpl(ptr); }
