/*
 * STAND-IN libnccl.so.2 for memscope-bpf's tests. It is not NCCL.
 *
 * It exports NCCL's communicator and memory calls (names and signatures from nccl.h) and takes
 * memory the way NCCL does with its CUDA runtime linked in: straight from the driver
 * (libcuda.so.1), so no runtime call is made and the driver's calls come from this file.
 * - ncclCommInitAll: per device of the list, the device's primary context made current (as the
 *   linked-in runtime does), then NCCL_BUFFSIZE bytes (NCCL's variable; default 4 MiB, as
 *   NCCL's) of device memory with cuMemAlloc_v2 and 1 MiB of pinned host memory with
 *   cuMemHostAlloc (portable, device-mapped), as NCCL pins its proxy buffers.
 * - ncclMemAlloc: device memory for user buffers through the driver's virtual memory calls, as
 *   NCCL's: cuMemCreate on the current device, cuMemAddressReserve, cuMemMap (the size rounded up
 *   to 2 MiB). ncclMemFree unmaps, releases and frees the range.
 * - ncclCommDestroy gives a communicator's memory back (cuMemFree_v2, cuMemFreeHost).
 * Each buffer taken or given back is a line of STANDIN_COMM_LEDGER (standin_comm.h). The tracer
 * must name this memory NCCL's from the address its driver calls come from.
 */
#include "../common/standin_comm.h"
#include "cuda_standin.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef enum { ncclSuccess = 0, ncclUnhandledCudaError = 1, ncclSystemError = 2, ncclInvalidArgument = 4 } ncclResult_t;
typedef struct ncclComm *ncclComm_t;

struct ncclComm {
    int device;
    size_t buffer_size;
    CUdeviceptr buffer;
    void *host;
};

#define HOST_BUFFER ((size_t)1 << 20)
#define GRANULE ((size_t)2 << 20)
#define MAX_RANGES 64

/* ncclMemAlloc's ranges, for ncclMemFree. */
static struct range {
    CUdeviceptr va;
    size_t size;
    CUmemGenericAllocationHandle handle;
    int device;
} ranges[MAX_RANGES];
static pthread_mutex_t ranges_lock = PTHREAD_MUTEX_INITIALIZER;
static __thread int current_device;

static ncclResult_t make_current(int device) {
    CUcontext ctx;
    if (cuDevicePrimaryCtxRetain(&ctx, device) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
        return ncclUnhandledCudaError;
    }
    current_device = device;
    return ncclSuccess;
}

static ncclResult_t take(struct ncclComm *c) {
    unsigned long long t0 = standin_now_ns();
    CUresult rc = cuMemAlloc_v2(&c->buffer, c->buffer_size);
    comm_note("nccl", "cuMemAlloc_v2", "device", c->device, c->buffer_size, rc == CUDA_SUCCESS ? c->buffer : 0, rc, t0);
    if (rc != CUDA_SUCCESS) {
        c->buffer = 0;
        return ncclUnhandledCudaError;
    }
    t0 = standin_now_ns();
    rc = cuMemHostAlloc(&c->host, HOST_BUFFER, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP);
    comm_note("nccl", "cuMemHostAlloc", "host", -1, HOST_BUFFER, rc == CUDA_SUCCESS ? (uintptr_t)c->host : 0, rc, t0);
    if (rc != CUDA_SUCCESS) {
        c->host = NULL;
        return ncclUnhandledCudaError;
    }
    return ncclSuccess;
}

static void give_back(struct ncclComm *c) {
    if (c->buffer != 0) {
        unsigned long long t0 = standin_now_ns();
        CUresult rc = cuMemFree_v2(c->buffer);
        comm_note("nccl", "cuMemFree_v2", "device", c->device, c->buffer_size, c->buffer, rc, t0);
    }
    if (c->host != NULL) {
        unsigned long long t0 = standin_now_ns();
        CUresult rc = cuMemFreeHost(c->host);
        comm_note("nccl", "cuMemFreeHost", "host", -1, HOST_BUFFER, (uintptr_t)c->host, rc, t0);
    }
}

STANDIN_EXPORT ncclResult_t ncclCommInitAll(ncclComm_t *comm, int ndev, const int *devlist) {
    if (comm == NULL || ndev <= 0) {
        return ncclInvalidArgument;
    }
    size_t buffer_size = standin_parse_size(getenv("NCCL_BUFFSIZE"), (size_t)4 << 20);
    for (int i = 0; i < ndev; i++) {
        struct ncclComm *c = calloc(1, sizeof *c);
        if (c == NULL) {
            return ncclSystemError;
        }
        c->device = devlist != NULL ? devlist[i] : i;
        c->buffer_size = buffer_size;
        ncclResult_t rc = make_current(c->device);
        if (rc == ncclSuccess) {
            rc = take(c);
        }
        if (rc != ncclSuccess) {
            give_back(c);
            free(c);
            return rc;
        }
        comm[i] = c;
    }
    return ncclSuccess;
}

STANDIN_EXPORT ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    if (comm == NULL) {
        return ncclInvalidArgument;
    }
    give_back(comm);
    free(comm);
    return ncclSuccess;
}

static struct range *free_slot(void) {
    for (int i = 0; i < MAX_RANGES; i++) {
        if (ranges[i].va == 0) {
            return &ranges[i];
        }
    }
    return NULL;
}

STANDIN_EXPORT ncclResult_t ncclMemAlloc(void **ptr, size_t size) {
    if (ptr == NULL || size == 0) {
        return ncclInvalidArgument;
    }
    size_t rounded = (size + GRANULE - 1) / GRANULE * GRANULE;
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = 1; /* CU_MEM_ALLOCATION_TYPE_PINNED */
    prop.location.type = 1; /* CU_MEM_LOCATION_TYPE_DEVICE */
    prop.location.id = current_device;
    struct range r = {.size = rounded, .device = current_device};
    unsigned long long t0 = standin_now_ns();
    CUresult rc = cuMemCreate(&r.handle, rounded, &prop, 0);
    if (rc == CUDA_SUCCESS) {
        rc = cuMemAddressReserve(&r.va, rounded, 0, 0, 0);
        if (rc == CUDA_SUCCESS) {
            rc = cuMemMap(r.va, rounded, 0, r.handle, 0);
        }
    }
    comm_note("nccl", "ncclMemAlloc", "device", r.device, rounded, rc == CUDA_SUCCESS ? r.va : 0, rc, t0);
    if (rc != CUDA_SUCCESS) {
        return ncclUnhandledCudaError;
    }
    pthread_mutex_lock(&ranges_lock);
    struct range *slot = free_slot();
    if (slot != NULL) {
        *slot = r;
    }
    pthread_mutex_unlock(&ranges_lock);
    if (slot == NULL) {
        return ncclSystemError;
    }
    *ptr = (void *)(uintptr_t)r.va;
    return ncclSuccess;
}

STANDIN_EXPORT ncclResult_t ncclMemFree(void *ptr) {
    struct range r = {0};
    pthread_mutex_lock(&ranges_lock);
    for (int i = 0; i < MAX_RANGES; i++) {
        if (ranges[i].va != 0 && ranges[i].va == (uintptr_t)ptr) {
            r = ranges[i];
            ranges[i].va = 0;
        }
    }
    pthread_mutex_unlock(&ranges_lock);
    if (r.va == 0) {
        return ncclInvalidArgument;
    }
    unsigned long long t0 = standin_now_ns();
    CUresult rc = cuMemUnmap(r.va, r.size);
    if (rc == CUDA_SUCCESS) {
        rc = cuMemRelease(r.handle);
    }
    if (rc == CUDA_SUCCESS) {
        rc = cuMemAddressFree(r.va, r.size);
    }
    comm_note("nccl", "ncclMemFree", "device", r.device, r.size, r.va, rc, t0);
    return rc == CUDA_SUCCESS ? ncclSuccess : ncclUnhandledCudaError;
}
