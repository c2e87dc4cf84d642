/*
 * STAND-IN libcuda.so.1 for memscope-bpf's tests. It is not NVIDIA's driver.
 *
 * Exports the driver's memory functions with the real signatures. Device memory is address
 * space only (a bump allocator hands out addresses nobody touches); pinned host memory is real
 * host memory. Each device has a capacity (STANDIN_CUDA_DEVICE_MEM, default 8G) out of
 * STANDIN_CUDA_DEVICE_COUNT devices (default 2); exhaustion returns CUDA_ERROR_OUT_OF_MEMORY
 * without touching the out-pointer. The current device is the thread's context, set with
 * cuCtxSetCurrent on a context from cuDevicePrimaryCtxRetain (as cudart does).
 *
 * Ground truth for tests: with STANDIN_CUDA_LEDGER=<path>, every memory call is appended to that
 * file as one JSON line (api, tid, device, size, ptr or handle, rc, entry/exit wall-clock ns; the
 * host-memory calls that take flags add them as "flags"). The tracer never reads it; tests
 * compare its DB with it.
 *
 * Pinned host memory: cuMemAllocHost_v2 and cuMemHostAlloc allocate real host memory (freed by
 * cuMemFreeHost); cuMemHostRegister(_v2) only remembers a caller's range (a range overlapping a
 * registered one is CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, unregistering an address that is
 * no registered range's start CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED). Neither charges a device.
 *
 * The driver's own view, for the stand-in libnvidia-ml.so.1: what this process holds on each
 * device is published in /dev/shm/memscope-standin-gpu-<pid> (../common/standin_driver_state.h)
 * after every charge and refund. Memory no traced call explains: the first
 * cuDevicePrimaryCtxRetain of a device in a process charges STANDIN_CUDA_CONTEXT_MEM bytes
 * (default 0: nothing) on it, as a context takes device memory, with a ledger line of api
 * "context" (CUDA_ERROR_OUT_OF_MEMORY when the device has no room).
 */
#define _GNU_SOURCE
#include "../common/standin_common.h"
#include "../common/standin_driver_state.h"
#include "cuda_standin.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define STANDIN_EXPORT __attribute__((visibility("default"), noinline, used))
#define MAX_DEVICES 16
#define MAX_RECORDS 65536
#define VA_ALIGN ((size_t)2 << 20)

/* A live allocation, mapping or physical handle. */
struct record {
    unsigned long long key; /* address or handle; 0: free slot */
    size_t size;
    int device;             /* -1: host memory */
    char kind;              /* 'a' allocation, 'h' host, 'p' physical handle, 'r' reservation,
                             * 'g' registered host range */
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct record records[MAX_RECORDS];
static size_t used[MAX_DEVICES];
static size_t capacity;
static int device_count;
static unsigned long long next_va = 0x7d0000000000ULL;
static unsigned long long next_handle = 0x1000;
static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static FILE *ledger;
static __thread int current = -1;
static size_t context_size;
static pid_t context_owner[MAX_DEVICES]; /* the process whose context is charged on each device */
static struct standin_driver_publisher publisher = {.kind = "gpu"};

static void unpublish(void) { standin_driver_unpublish(&publisher); }

static void init(void) {
    capacity = standin_parse_size(getenv("STANDIN_CUDA_DEVICE_MEM"), (size_t)8 << 30);
    device_count = (int)standin_parse_size(getenv("STANDIN_CUDA_DEVICE_COUNT"), 2);
    if (device_count < 1 || device_count > MAX_DEVICES) {
        device_count = 2;
    }
    context_size = standin_parse_size(getenv("STANDIN_CUDA_CONTEXT_MEM"), 0);
    ledger = standin_ledger("STANDIN_CUDA_LEDGER");
    publisher.device_count = (uint32_t)device_count;
    publisher.capacity = capacity;
    pthread_mutex_lock(&lock);
    standin_driver_publish_open(&publisher);
    pthread_mutex_unlock(&lock);
    atexit(unpublish);
}

/* One ledger line; `flags` < 0: the call takes none. */
static void note_flags(const char *api, int device, size_t size, unsigned long long ptr, unsigned long long handle,
                       int rc, unsigned long long t0, long long flags) {
    if (ledger == NULL) {
        return;
    }
    char extra[32] = "";
    if (flags >= 0) {
        snprintf(extra, sizeof extra, ",\"flags\":%lld", flags);
    }
    flockfile(ledger);
    fprintf(ledger,
            "{\"layer\":\"driver\",\"api\":\"%s\",\"tid\":%ld,\"device\":%d,\"size\":%zu,\"ptr\":%llu,"
            "\"handle\":%llu,\"rc\":%d,\"t0\":%llu,\"t1\":%llu%s}\n",
            api, (long)syscall(SYS_gettid), device, size, ptr, handle, rc, t0, standin_now_ns(), extra);
    fflush(ledger);
    funlockfile(ledger);
}

static void note(const char *api, int device, size_t size, unsigned long long ptr, unsigned long long handle, int rc,
                 unsigned long long t0) {
    note_flags(api, device, size, ptr, handle, rc, t0, -1);
}

static struct record *find(unsigned long long key, char kind) {
    for (size_t i = 0; i < MAX_RECORDS; i++) {
        if (records[i].key == key && records[i].kind == kind) {
            return &records[i];
        }
    }
    return NULL;
}

static struct record *slot(void) {
    return find(0, 0);
}

static unsigned long long bump(size_t size) {
    unsigned long long va = next_va;
    next_va += (size + VA_ALIGN - 1) / VA_ALIGN * VA_ALIGN + VA_ALIGN;
    return va;
}

static int device_of_thread(void) {
    return current < 0 ? 0 : current;
}

/* Takes `size` bytes of `device` (-1: host) and records them under a new key; 0 when full. */
static unsigned long long take(size_t size, int device, char kind) {
    pthread_once(&init_once, init);
    unsigned long long key = 0;
    pthread_mutex_lock(&lock);
    struct record *r = slot();
    if (r != NULL && (device < 0 || kind == 'r' || used[device] + size <= capacity)) {
        if (kind == 'h') {
            void *p = NULL;
            key = posix_memalign(&p, 4096, size ? size : 1) == 0 ? (unsigned long long)(uintptr_t)p : 0;
        } else if (kind == 'p') {
            key = next_handle++;
        } else {
            key = bump(size);
        }
        if (key != 0) {
            *r = (struct record){key, size, device, kind};
            if (device >= 0 && kind != 'r') {
                used[device] += size;
                standin_driver_publish(&publisher, (uint32_t)device, used[device]);
            }
        }
    }
    pthread_mutex_unlock(&lock);
    return key;
}

/* Gives back what `take` recorded; false for an unknown key. */
static int give(unsigned long long key, char kind, int *device, size_t *size) {
    pthread_once(&init_once, init);
    int found = 0;
    pthread_mutex_lock(&lock);
    struct record *r = find(key, kind);
    if (r != NULL) {
        *device = r->device;
        *size = r->size;
        if (r->device >= 0 && kind != 'r') {
            used[r->device] -= r->size;
            standin_driver_publish(&publisher, (uint32_t)r->device, used[r->device]);
        }
        if (kind == 'h') {
            free((void *)(uintptr_t)key);
        }
        r->key = 0;
        r->kind = 0;
        found = 1;
    }
    pthread_mutex_unlock(&lock);
    return found;
}

STANDIN_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    pthread_once(&init_once, init);
    unsigned long long t0 = standin_now_ns();
    if (pctx == NULL || dev < 0 || dev >= device_count) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (context_size > 0) {
        /* The context's own device memory, once per device per process: no memory call shows it. */
        pid_t self = getpid();
        CUresult rc = CUDA_SUCCESS;
        pthread_mutex_lock(&lock);
        int charge = context_owner[dev] != self;
        if (charge) {
            if (used[dev] + context_size <= capacity) {
                used[dev] += context_size;
                standin_driver_publish(&publisher, (uint32_t)dev, used[dev]);
                context_owner[dev] = self;
            } else {
                rc = CUDA_ERROR_OUT_OF_MEMORY;
            }
        }
        pthread_mutex_unlock(&lock);
        if (charge) {
            note("context", dev, context_size, 0, 0, rc, t0);
        }
        if (rc != CUDA_SUCCESS) {
            return rc;
        }
    }
    *pctx = (CUcontext)(uintptr_t)(dev + 1);
    return CUDA_SUCCESS;
}

STANDIN_EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
    current = (int)(uintptr_t)ctx - 1;
    return CUDA_SUCCESS;
}

static CUresult alloc_device(const char *api, CUdeviceptr *dptr, size_t size, char kind) {
    unsigned long long t0 = standin_now_ns();
    int device = kind == 'h' ? -1 : device_of_thread();
    unsigned long long ptr = (dptr == NULL || size == 0) ? 0 : take(size, device, kind);
    CUresult rc = (dptr == NULL || size == 0) ? CUDA_ERROR_INVALID_VALUE : ptr ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
    if (rc == CUDA_SUCCESS) {
        *dptr = ptr;
    }
    note(api, device, size, ptr, 0, rc, t0);
    return rc;
}

static CUresult free_device(const char *api, unsigned long long ptr, char kind) {
    unsigned long long t0 = standin_now_ns();
    int device = -1;
    size_t size = 0;
    CUresult rc = give(ptr, kind, &device, &size) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    note(api, device, size, ptr, 0, rc, t0);
    return rc;
}

STANDIN_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    return alloc_device("cuMemAlloc_v2", dptr, bytesize, 'a');
}

STANDIN_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) {
    return free_device("cuMemFree_v2", dptr, 'a');
}

STANDIN_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    (void)hStream;
    return alloc_device("cuMemAllocAsync", dptr, bytesize, 'a');
}

STANDIN_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
    (void)hStream;
    return free_device("cuMemFreeAsync", dptr, 'a');
}

STANDIN_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    (void)flags;
    return alloc_device("cuMemAllocManaged", dptr, bytesize, 'a');
}

STANDIN_EXPORT CUresult cuMemAllocHost_v2(void **pp, size_t bytesize) {
    return alloc_device("cuMemAllocHost_v2", (CUdeviceptr *)pp, bytesize, 'h');
}

STANDIN_EXPORT CUresult cuMemFreeHost(void *p) {
    return free_device("cuMemFreeHost", (unsigned long long)(uintptr_t)p, 'h');
}

STANDIN_EXPORT CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags) {
    unsigned long long t0 = standin_now_ns();
    const unsigned int known = CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_WRITECOMBINED;
    int valid = pp != NULL && bytesize != 0 && (Flags & ~known) == 0;
    unsigned long long ptr = valid ? take(bytesize, -1, 'h') : 0;
    CUresult rc = !valid ? CUDA_ERROR_INVALID_VALUE : ptr ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
    if (rc == CUDA_SUCCESS) {
        *pp = (void *)(uintptr_t)ptr;
    }
    note_flags("cuMemHostAlloc", -1, bytesize, ptr, 0, rc, t0, Flags);
    return rc;
}

STANDIN_EXPORT CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags) {
    pthread_once(&init_once, init);
    unsigned long long t0 = standin_now_ns();
    const unsigned int known = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP |
                               CU_MEMHOSTREGISTER_IOMEMORY | CU_MEMHOSTREGISTER_READ_ONLY;
    unsigned long long start = (unsigned long long)(uintptr_t)p, end = start + bytesize;
    CUresult rc = CUDA_SUCCESS;
    if (p == NULL || bytesize == 0 || end < start || (Flags & ~known) != 0) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        pthread_mutex_lock(&lock);
        for (size_t i = 0; i < MAX_RECORDS; i++) {
            if (records[i].kind == 'g' && start < records[i].key + records[i].size && records[i].key < end) {
                rc = CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
                break;
            }
        }
        struct record *r = rc == CUDA_SUCCESS ? slot() : NULL;
        if (r != NULL) {
            *r = (struct record){start, bytesize, -1, 'g'};
        } else if (rc == CUDA_SUCCESS) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        }
        pthread_mutex_unlock(&lock);
    }
    note_flags("cuMemHostRegister_v2", -1, bytesize, start, 0, rc, t0, Flags);
    return rc;
}

STANDIN_EXPORT CUresult cuMemHostRegister(void *p, size_t bytesize, unsigned int Flags) {
    return cuMemHostRegister_v2(p, bytesize, Flags);
}

STANDIN_EXPORT CUresult cuMemHostUnregister(void *p) {
    pthread_once(&init_once, init);
    unsigned long long t0 = standin_now_ns();
    size_t size = 0;
    CUresult rc = CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
    if (p == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        pthread_mutex_lock(&lock);
        struct record *r = find((unsigned long long)(uintptr_t)p, 'g');
        if (r != NULL) {
            size = r->size;
            r->key = 0;
            r->kind = 0;
            rc = CUDA_SUCCESS;
        }
        pthread_mutex_unlock(&lock);
    }
    note("cuMemHostUnregister", -1, size, (unsigned long long)(uintptr_t)p, 0, rc, t0);
    return rc;
}

STANDIN_EXPORT CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                            unsigned long long flags) {
    (void)alignment, (void)addr, (void)flags;
    unsigned long long t0 = standin_now_ns();
    unsigned long long va = (ptr == NULL || size == 0) ? 0 : take(size, device_of_thread(), 'r');
    CUresult rc = va ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (rc == CUDA_SUCCESS) {
        *ptr = va;
    }
    note("cuMemAddressReserve", device_of_thread(), size, va, 0, rc, t0);
    return rc;
}

STANDIN_EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    (void)size;
    return free_device("cuMemAddressFree", ptr, 'r');
}

STANDIN_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                                    unsigned long long flags) {
    (void)flags;
    unsigned long long t0 = standin_now_ns();
    pthread_once(&init_once, init);
    int device = prop == NULL ? -1 : prop->location.id;
    int valid = handle != NULL && size != 0 && device >= 0 && device < device_count;
    unsigned long long h = valid ? take(size, device, 'p') : 0;
    CUresult rc = !valid ? CUDA_ERROR_INVALID_VALUE : h ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
    if (rc == CUDA_SUCCESS) {
        *handle = h;
    }
    note("cuMemCreate", device, size, 0, h, rc, t0);
    return rc;
}

STANDIN_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    unsigned long long t0 = standin_now_ns();
    int device = -1;
    size_t size = 0;
    CUresult rc = give(handle, 'p', &device, &size) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    note("cuMemRelease", device, size, 0, handle, rc, t0);
    return rc;
}

STANDIN_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                                 unsigned long long flags) {
    (void)offset, (void)flags;
    unsigned long long t0 = standin_now_ns();
    pthread_once(&init_once, init);
    pthread_mutex_lock(&lock);
    struct record *h = find(handle, 'p');
    int device = h ? h->device : -1;
    pthread_mutex_unlock(&lock);
    CUresult rc = h ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    note("cuMemMap", device, size, ptr, handle, rc, t0);
    return rc;
}

STANDIN_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    unsigned long long t0 = standin_now_ns();
    note("cuMemUnmap", device_of_thread(), size, ptr, 0, CUDA_SUCCESS, t0);
    return CUDA_SUCCESS;
}
