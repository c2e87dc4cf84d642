/*
 * STAND-IN libascend_hal.so for memscope-bpf's tests. It is not the Ascend driver.
 *
 * Exports the driver's memory functions with the real signatures, each forwarding to an exported
 * `...Inner` (as newer drivers do, for interposers). Device memory is host memory; each device
 * has a capacity (STANDIN_ACL_DEVICE_MEM, default 8G) out of STANDIN_ACL_DEVICE_COUNT devices
 * (default 2), and exhaustion returns DRV_ERROR_OUT_OF_MEMORY without touching the out-pointer.
 * Physical handles are memfds.
 *
 * Ground truth for tests: with STANDIN_HAL_LEDGER=<path>, every call is appended to that file as
 * one JSON line (api, tid, size, flag, ptr/handle, rc, entry/exit wall-clock ns). The tracer never
 * reads it; tests compare its DB with it.
 *
 * The driver's own view, for the stand-in libdcmi.so: what this process holds on each device is
 * published in /dev/shm/memscope-standin-npu-<pid> (../common/standin_driver_state.h) after
 * every charge and refund. Memory no traced call explains: `standin_hal_context_charge` (not a
 * HAL symbol, so the tracer never probes it; the stand-in runtime calls it from aclrtSetDevice)
 * charges STANDIN_HAL_CONTEXT_MEM bytes (default 0: nothing) once per device per process, as a
 * runtime context takes device memory, with a ledger line of api "context".
 */
#define _GNU_SOURCE
#include "../common/standin_common.h"
#include "../common/standin_driver_state.h"
#include "hal_standin.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define STANDIN_EXPORT __attribute__((visibility("default"), noinline, used))
#define MAX_DEVICES 64
#define BUCKETS 4096

struct drv_mem_handle {
    int fd;
    size_t size;
    uint32_t device;
};

struct allocation {
    uintptr_t addr;
    size_t size;
    int device; /* -1: host memory */
    struct allocation *next;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct allocation *table[BUCKETS];
static size_t used[MAX_DEVICES];
static size_t capacity;
static uint32_t device_count;
static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static FILE *ledger;
static size_t context_size;
static pid_t context_owner[MAX_DEVICES]; /* the process whose context is charged on each device */
static struct standin_driver_publisher publisher = {.kind = "npu"};

static void unpublish(void) { standin_driver_unpublish(&publisher); }

static void init(void) {
    capacity = standin_parse_size(getenv("STANDIN_ACL_DEVICE_MEM"), (size_t)8 << 30);
    device_count = (uint32_t)standin_parse_size(getenv("STANDIN_ACL_DEVICE_COUNT"), 2);
    if (device_count < 1 || device_count > MAX_DEVICES) {
        device_count = 2;
    }
    context_size = standin_parse_size(getenv("STANDIN_HAL_CONTEXT_MEM"), 0);
    ledger = standin_ledger("STANDIN_HAL_LEDGER");
    publisher.device_count = device_count;
    publisher.capacity = capacity;
    pthread_mutex_lock(&lock);
    standin_driver_publish_open(&publisher);
    pthread_mutex_unlock(&lock);
    atexit(unpublish);
}

static void record(const char *api, unsigned long long t0, unsigned long long size, unsigned long long flag,
                   const void *ptr, int rc, int device) {
    if (ledger == NULL) {
        return;
    }
    pthread_mutex_lock(&lock);
    fprintf(ledger,
            "{\"api\": \"%s\", \"tid\": %ld, \"t0\": %llu, \"t1\": %llu, \"size\": %llu, \"flag\": %llu, "
            "\"ptr\": %llu, \"rc\": %d, \"device\": %d}\n",
            api, (long)syscall(SYS_gettid), t0, standin_now_ns(), size, flag, (unsigned long long)(uintptr_t)ptr, rc, device);
    fflush(ledger);
    pthread_mutex_unlock(&lock);
}

static size_t bucket_of(uintptr_t addr) { return (addr >> 5) % BUCKETS; }

/* Reserves capacity on a device, with `lock` held; 0 on success. */
static int charge_locked(uint32_t device, size_t size) {
    if (size > capacity - used[device]) {
        return -1;
    }
    used[device] += size;
    standin_driver_publish(&publisher, device, used[device]);
    return 0;
}

/* Reserves capacity on a device; 0 on success. */
static int charge(uint32_t device, size_t size) {
    pthread_mutex_lock(&lock);
    int ok = charge_locked(device, size);
    pthread_mutex_unlock(&lock);
    return ok;
}

static void refund_locked(uint32_t device, size_t size) {
    used[device] -= size;
    standin_driver_publish(&publisher, device, used[device]);
}

static void refund(uint32_t device, size_t size) {
    pthread_mutex_lock(&lock);
    refund_locked(device, size);
    pthread_mutex_unlock(&lock);
}

STANDIN_EXPORT drvError_t halMemAllocInner(void **pp, unsigned long long size, unsigned long long flag) {
    pthread_once(&init_once, init);
    unsigned long long t0 = standin_now_ns();
    uint32_t device = (uint32_t)(flag & MEM_DEVICE_MASK);
    unsigned long long type = (flag >> MEM_VIRT_BIT) & 0xf;
    int host = type == MEM_HOST_VAL;
    drvError_t rc = DRV_ERROR_NONE;
    void *p = NULL;
    if (pp == NULL || size == 0 || (!host && device >= device_count)) {
        rc = DRV_ERROR_INVALID_VALUE;
    } else if (!host && charge(device, size) != 0) {
        rc = DRV_ERROR_OUT_OF_MEMORY;
    } else if (posix_memalign(&p, 512, size) != 0) {
        if (!host) {
            refund(device, size);
        }
        rc = DRV_ERROR_OUT_OF_MEMORY;
    } else {
        struct allocation *a = malloc(sizeof *a);
        a->addr = (uintptr_t)p;
        a->size = size;
        a->device = host ? -1 : (int)device;
        pthread_mutex_lock(&lock);
        size_t i = bucket_of(a->addr);
        a->next = table[i];
        table[i] = a;
        pthread_mutex_unlock(&lock);
        *pp = p;
    }
    record("halMemAlloc", t0, size, flag, rc == DRV_ERROR_NONE ? p : NULL, rc, host ? -1 : (int)device);
    return rc;
}

STANDIN_EXPORT drvError_t halMemFreeInner(void *pp) {
    pthread_once(&init_once, init);
    unsigned long long t0 = standin_now_ns();
    struct allocation *found = NULL;
    pthread_mutex_lock(&lock);
    for (struct allocation **at = &table[bucket_of((uintptr_t)pp)]; *at != NULL; at = &(*at)->next) {
        if ((*at)->addr == (uintptr_t)pp) {
            found = *at;
            *at = found->next;
            if (found->device >= 0) {
                refund_locked((uint32_t)found->device, found->size);
            }
            break;
        }
    }
    pthread_mutex_unlock(&lock);
    drvError_t rc = found != NULL ? DRV_ERROR_NONE : DRV_ERROR_INVALID_VALUE;
    record("halMemFree", t0, found ? found->size : 0, 0, pp, rc, found ? found->device : -1);
    if (found != NULL) {
        free(pp);
        free(found);
    }
    return rc;
}

STANDIN_EXPORT drvError_t halMemCreateInner(drv_mem_handle_t **handle, size_t size, const struct drv_mem_prop *prop,
                                            uint64_t flag) {
    pthread_once(&init_once, init);
    unsigned long long t0 = standin_now_ns();
    drvError_t rc = DRV_ERROR_NONE;
    drv_mem_handle_t *h = NULL;
    if (handle == NULL || prop == NULL || size == 0 || prop->devid >= device_count) {
        rc = DRV_ERROR_INVALID_VALUE;
    } else if (charge(prop->devid, size) != 0) {
        rc = DRV_ERROR_OUT_OF_MEMORY;
    } else {
        int fd = memfd_create("standin-hal-physical", MFD_CLOEXEC);
        if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
            if (fd >= 0) {
                close(fd);
            }
            refund(prop->devid, size);
            rc = DRV_ERROR_OUT_OF_MEMORY;
        } else {
            h = malloc(sizeof *h);
            h->fd = fd;
            h->size = size;
            h->device = prop->devid;
            *handle = h;
        }
    }
    record("halMemCreate", t0, size, flag, h, rc, prop != NULL ? (int)prop->devid : -1);
    return rc;
}

STANDIN_EXPORT drvError_t halMemReleaseInner(drv_mem_handle_t *handle) {
    unsigned long long t0 = standin_now_ns();
    if (handle == NULL) {
        record("halMemRelease", t0, 0, 0, handle, DRV_ERROR_INVALID_HANDLE, -1);
        return DRV_ERROR_INVALID_HANDLE;
    }
    refund(handle->device, handle->size);
    record("halMemRelease", t0, handle->size, 0, handle, DRV_ERROR_NONE, (int)handle->device);
    close(handle->fd);
    free(handle);
    return DRV_ERROR_NONE;
}

STANDIN_EXPORT drvError_t halMemAlloc(void **pp, unsigned long long size, unsigned long long flag) {
    return halMemAllocInner(pp, size, flag);
}
STANDIN_EXPORT drvError_t halMemFree(void *pp) { return halMemFreeInner(pp); }
STANDIN_EXPORT drvError_t halMemCreate(drv_mem_handle_t **handle, size_t size, const struct drv_mem_prop *prop,
                                       uint64_t flag) {
    return halMemCreateInner(handle, size, prop, flag);
}
STANDIN_EXPORT drvError_t halMemRelease(drv_mem_handle_t *handle) { return halMemReleaseInner(handle); }

STANDIN_EXPORT int standin_hal_handle_fd(drv_mem_handle_t *handle, size_t *size) {
    if (handle == NULL) {
        return -1;
    }
    if (size != NULL) {
        *size = handle->size;
    }
    return handle->fd;
}

STANDIN_EXPORT int standin_hal_mem_info(uint32_t device, size_t *free_bytes, size_t *total) {
    pthread_once(&init_once, init);
    if (device >= device_count || free_bytes == NULL || total == NULL) {
        return -1;
    }
    pthread_mutex_lock(&lock);
    *free_bytes = capacity - used[device];
    pthread_mutex_unlock(&lock);
    *total = capacity;
    return 0;
}

STANDIN_EXPORT uint32_t standin_hal_device_count(void) {
    pthread_once(&init_once, init);
    return device_count;
}

/* Stand-in only (no HAL symbol, so never probed): the device memory a runtime context takes
 * without any memory call the tracer sees, STANDIN_HAL_CONTEXT_MEM bytes, charged once per device
 * per process (later calls for the device do nothing), with a ledger line of api "context". */
STANDIN_EXPORT drvError_t standin_hal_context_charge(uint32_t device) {
    pthread_once(&init_once, init);
    unsigned long long t0 = standin_now_ns();
    if (device >= device_count) {
        return DRV_ERROR_INVALID_VALUE;
    }
    if (context_size == 0) {
        return DRV_ERROR_NONE;
    }
    pid_t self = getpid();
    pthread_mutex_lock(&lock);
    int already = context_owner[device] == self;
    drvError_t rc = DRV_ERROR_NONE;
    if (!already) {
        if (charge_locked(device, context_size) == 0) {
            context_owner[device] = self;
        } else {
            rc = DRV_ERROR_OUT_OF_MEMORY;
        }
    }
    pthread_mutex_unlock(&lock);
    if (!already) {
        record("context", t0, context_size, 0, NULL, rc, (int)device);
    }
    return rc;
}
