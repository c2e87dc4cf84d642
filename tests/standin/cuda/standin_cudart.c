/*
 * STAND-IN libcudart.so.12 for memscope-bpf's tests. It is not NVIDIA's CUDA runtime.
 *
 * Exports the runtime's memory functions with the real signatures. Each one calls the stand-in
 * driver (libcuda.so.1, loaded with dlopen as the real runtime loads it) through function
 * pointers it looked up once (the real one asks cuGetProcAddress), never through the PLT, so a
 * tracer that hooks calls instead of code would miss the nested driver calls. The device is the thread's
 * (cudaSetDevice makes the device's primary context current). `cudaFree(NULL)` does nothing but
 * return success, as programs use it to create the context.
 *
 * cudaHostRegister / cudaHostUnregister call the driver's cuMemHostRegister_v2 /
 * cuMemHostUnregister, as the real runtime does, and keep its registration errors
 * (cudaErrorHostMemoryAlreadyRegistered 712, cudaErrorHostMemoryNotRegistered 713); any other
 * failure is cudaErrorInvalidValue.
 *
 * Ground truth for tests: with STANDIN_CUDART_LEDGER=<path>, every call is appended to that file
 * as one JSON line (api, tid, device, size, ptr, rc, entry/exit wall-clock ns; cudaHostRegister
 * adds its "flags").
 */
#define _GNU_SOURCE
#include "../common/standin_common.h"
#include "cuda_standin.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define STANDIN_EXPORT __attribute__((visibility("default"), noinline, used))

static struct {
    CUresult (*retain)(CUcontext *, CUdevice);
    CUresult (*set_current)(CUcontext);
    CUresult (*alloc)(CUdeviceptr *, size_t);
    CUresult (*free)(CUdeviceptr);
    CUresult (*alloc_async)(CUdeviceptr *, size_t, CUstream);
    CUresult (*free_async)(CUdeviceptr, CUstream);
    CUresult (*alloc_managed)(CUdeviceptr *, size_t, unsigned int);
    CUresult (*alloc_host)(void **, size_t);
    CUresult (*free_host)(void *);
    CUresult (*host_register)(void *, size_t, unsigned int);
    CUresult (*host_unregister)(void *);
} driver;

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static FILE *ledger;
static __thread int current;

static void *entry(void *lib, const char *name) {
    void *f = dlsym(lib, name);
    if (f == NULL) {
        fprintf(stderr, "stand-in cudart: the driver has no %s\n", name);
        abort();
    }
    return f;
}

static void init(void) {
    /* As the real runtime does: the driver by its soname (found through this library's RUNPATH,
     * or already loaded by the program), then its entry points. */
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == NULL) {
        fprintf(stderr, "stand-in cudart: cannot load libcuda.so.1: %s\n", dlerror());
        abort();
    }
    driver.retain = entry(lib, "cuDevicePrimaryCtxRetain");
    driver.set_current = entry(lib, "cuCtxSetCurrent");
    driver.alloc = entry(lib, "cuMemAlloc_v2");
    driver.free = entry(lib, "cuMemFree_v2");
    driver.alloc_async = entry(lib, "cuMemAllocAsync");
    driver.free_async = entry(lib, "cuMemFreeAsync");
    driver.alloc_managed = entry(lib, "cuMemAllocManaged");
    driver.alloc_host = entry(lib, "cuMemAllocHost_v2");
    driver.free_host = entry(lib, "cuMemFreeHost");
    driver.host_register = entry(lib, "cuMemHostRegister_v2");
    driver.host_unregister = entry(lib, "cuMemHostUnregister");
    ledger = standin_ledger("STANDIN_CUDART_LEDGER");
}

/* One ledger line; `flags` < 0: the call takes none. */
static cudaError_t note_flags(const char *api, size_t size, const void *ptr, cudaError_t rc, unsigned long long t0,
                              long long flags) {
    if (ledger != NULL) {
        char extra[32] = "";
        if (flags >= 0) {
            snprintf(extra, sizeof extra, ",\"flags\":%lld", flags);
        }
        flockfile(ledger);
        fprintf(ledger,
                "{\"layer\":\"runtime\",\"api\":\"%s\",\"tid\":%ld,\"device\":%d,\"size\":%zu,\"ptr\":%llu,"
                "\"rc\":%d,\"t0\":%llu,\"t1\":%llu%s}\n",
                api, (long)syscall(SYS_gettid), current, size, (unsigned long long)(uintptr_t)ptr, rc, t0, standin_now_ns(),
                extra);
        fflush(ledger);
        funlockfile(ledger);
    }
    return rc;
}

static cudaError_t note(const char *api, size_t size, const void *ptr, cudaError_t rc, unsigned long long t0) {
    return note_flags(api, size, ptr, rc, t0, -1);
}

/* The driver's status as the runtime's: out of memory stays out of memory. */
static cudaError_t status(CUresult rc) {
    return rc == CUDA_SUCCESS ? cudaSuccess : rc == CUDA_ERROR_OUT_OF_MEMORY ? cudaErrorMemoryAllocation
                                                                           : cudaErrorInvalidValue;
}

/* The driver's registration status as the runtime's: the registration errors keep their codes. */
static cudaError_t host_status(CUresult rc) {
    return rc == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED ? cudaErrorHostMemoryAlreadyRegistered
           : rc == CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED   ? cudaErrorHostMemoryNotRegistered
                                                           : status(rc);
}

STANDIN_EXPORT cudaError_t cudaSetDevice(int device) {
    pthread_once(&init_once, init);
    unsigned long long t0 = standin_now_ns();
    CUcontext ctx = NULL;
    cudaError_t rc = status(driver.retain(&ctx, device));
    if (rc == cudaSuccess) {
        driver.set_current(ctx);
        current = device;
    }
    return note("cudaSetDevice", 0, NULL, rc, t0);
}

STANDIN_EXPORT cudaError_t cudaGetDevice(int *device) {
    unsigned long long t0 = standin_now_ns();
    if (device == NULL) {
        return note("cudaGetDevice", 0, NULL, cudaErrorInvalidValue, t0);
    }
    *device = current;
    return note("cudaGetDevice", 0, NULL, cudaSuccess, t0);
}

STANDIN_EXPORT cudaError_t cudaMalloc(void **devPtr, size_t size) {
    pthread_once(&init_once, init);
    unsigned long long t0 = standin_now_ns();
    cudaError_t rc = status(driver.alloc((CUdeviceptr *)devPtr, size));
    return note("cudaMalloc", size, rc == cudaSuccess ? *devPtr : NULL, rc, t0);
}

STANDIN_EXPORT cudaError_t cudaFree(void *devPtr) {
    pthread_once(&init_once, init);
    unsigned long long t0 = standin_now_ns();
    cudaError_t rc = devPtr == NULL ? cudaSuccess : status(driver.free((CUdeviceptr)(uintptr_t)devPtr));
    return note("cudaFree", 0, devPtr, rc, t0);
}

STANDIN_EXPORT cudaError_t cudaMallocAsync(void **devPtr, size_t size, cudaStream_t stream) {
    pthread_once(&init_once, init);
    unsigned long long t0 = standin_now_ns();
    cudaError_t rc = status(driver.alloc_async((CUdeviceptr *)devPtr, size, stream));
    return note("cudaMallocAsync", size, rc == cudaSuccess ? *devPtr : NULL, rc, t0);
}

STANDIN_EXPORT cudaError_t cudaFreeAsync(void *devPtr, cudaStream_t stream) {
    pthread_once(&init_once, init);
    unsigned long long t0 = standin_now_ns();
    cudaError_t rc = devPtr == NULL ? cudaSuccess : status(driver.free_async((CUdeviceptr)(uintptr_t)devPtr, stream));
    return note("cudaFreeAsync", 0, devPtr, rc, t0);
}

STANDIN_EXPORT cudaError_t cudaMallocHost(void **ptr, size_t size) {
    pthread_once(&init_once, init);
    unsigned long long t0 = standin_now_ns();
    cudaError_t rc = status(driver.alloc_host(ptr, size));
    return note("cudaMallocHost", size, rc == cudaSuccess ? *ptr : NULL, rc, t0);
}

STANDIN_EXPORT cudaError_t cudaHostAlloc(void **pHost, size_t size, unsigned int flags) {
    (void)flags;
    pthread_once(&init_once, init);
    unsigned long long t0 = standin_now_ns();
    cudaError_t rc = status(driver.alloc_host(pHost, size));
    return note("cudaHostAlloc", size, rc == cudaSuccess ? *pHost : NULL, rc, t0);
}

STANDIN_EXPORT cudaError_t cudaFreeHost(void *ptr) {
    pthread_once(&init_once, init);
    unsigned long long t0 = standin_now_ns();
    cudaError_t rc = ptr == NULL ? cudaSuccess : status(driver.free_host(ptr));
    return note("cudaFreeHost", 0, ptr, rc, t0);
}

STANDIN_EXPORT cudaError_t cudaMallocManaged(void **devPtr, size_t size, unsigned int flags) {
    pthread_once(&init_once, init);
    unsigned long long t0 = standin_now_ns();
    cudaError_t rc = status(driver.alloc_managed((CUdeviceptr *)devPtr, size, flags));
    return note("cudaMallocManaged", size, rc == cudaSuccess ? *devPtr : NULL, rc, t0);
}

STANDIN_EXPORT cudaError_t cudaHostRegister(void *ptr, size_t size, unsigned int flags) {
    pthread_once(&init_once, init);
    unsigned long long t0 = standin_now_ns();
    cudaError_t rc = host_status(driver.host_register(ptr, size, flags));
    return note_flags("cudaHostRegister", size, ptr, rc, t0, flags);
}

STANDIN_EXPORT cudaError_t cudaHostUnregister(void *ptr) {
    pthread_once(&init_once, init);
    unsigned long long t0 = standin_now_ns();
    cudaError_t rc = host_status(driver.host_unregister(ptr));
    return note("cudaHostUnregister", 0, ptr, rc, t0);
}
