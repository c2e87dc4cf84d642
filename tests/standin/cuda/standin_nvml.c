/*
 * STAND-IN libnvidia-ml.so.1 for memscope-bpf's tests. It is not NVIDIA's NVML, and there is no
 * GPU behind it.
 *
 * It exports the NVML functions a tracer asks for devices' and processes' memory, with the real
 * names, signatures, struct layouts and return codes (nvml.h), and answers from what the stand-in
 * driver (libcuda.so.1) really charged, in every live process that loaded it: each publishes its
 * usage in /dev/shm/memscope-standin-gpu-<pid> (../common/standin_driver_state.h). Processes that
 * are gone count for nothing, as on a real driver. It is built next to the stand-in libcuda.so.1.
 *
 * Devices: NVML index i is CUDA ordinal i (the identity: the stand-in has no PCI bus order to
 * differ by). Their number is the largest device count a live process published; with none,
 * STANDIN_CUDA_DEVICE_COUNT (default 2) of this process's environment. A device's total is the
 * driver's capacity (the largest a live process published; with none, STANDIN_CUDA_DEVICE_MEM,
 * default 8G); used is the sum over live processes of what the driver charged them on it, free
 * the rest, reserved 0 (all in bytes). nvmlDeviceGetComputeRunningProcesses_v3 (and _v2, the same
 * layout) lists the live processes with memory on the device, by pid.
 *
 * As the real NVML: every call but nvmlInit/nvmlErrorString before nvmlInit_v2 (or after the
 * matching nvmlShutdown) is NVML_ERROR_UNINITIALIZED; a process list longer than *infoCount is
 * NVML_ERROR_INSUFFICIENT_SIZE with *infoCount set to the number needed; nvmlMemory_v2_t needs
 * its version set to nvmlMemory_v2 (else NVML_ERROR_ARGUMENT_VERSION_MISMATCH). There is no
 * ledger: nothing here changes memory.
 */
#define _GNU_SOURCE
#include "../common/standin_common.h"
#include "../common/standin_driver_state.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#define NVML_EXPORT __attribute__((visibility("default"), noinline, used))

typedef int nvmlReturn_t;
#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25
#define NVML_ERROR_UNKNOWN 999

typedef struct nvmlDevice_st *nvmlDevice_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

#define NVML_STRUCT_VERSION(data, ver) (unsigned int)(sizeof(nvml##data##_v##ver##_t) | ((ver) << 24U))
#define nvmlMemory_v2 NVML_STRUCT_VERSION(Memory, 2)

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

_Static_assert(sizeof(nvmlProcessInfo_t) == 24, "nvmlProcessInfo_t is 24 bytes");
_Static_assert(sizeof(nvmlMemory_v2_t) == 40, "nvmlMemory_v2_t is 40 bytes");


/* Handles are the addresses of these; a handle's index is its offset. */
struct nvmlDevice_st {
    unsigned int index;
};
static struct nvmlDevice_st devices[STANDIN_DRIVER_MAX_DEVICES];

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned int init_count;

static void look(struct standin_driver_view *v) {
    standin_driver_look(v, "gpu", "STANDIN_CUDA_DEVICE_COUNT", "STANDIN_CUDA_DEVICE_MEM", 16);
}

static int initialized(void) {
    pthread_mutex_lock(&lock);
    int yes = init_count > 0;
    pthread_mutex_unlock(&lock);
    return yes;
}

/* The index behind a handle this library gave out, or -1. */
static int index_of(nvmlDevice_t device) {
    if (device < &devices[0] || device >= &devices[STANDIN_DRIVER_MAX_DEVICES]) {
        return -1;
    }
    return (int)(device - &devices[0]);
}

NVML_EXPORT nvmlReturn_t nvmlInit_v2(void) {
    pthread_mutex_lock(&lock);
    for (unsigned int i = 0; i < STANDIN_DRIVER_MAX_DEVICES; i++) {
        devices[i].index = i;
    }
    init_count++;
    pthread_mutex_unlock(&lock);
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlInit(void) { return nvmlInit_v2(); }

NVML_EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    return nvmlInit_v2();
}

NVML_EXPORT nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&lock);
    nvmlReturn_t rc = init_count > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
    if (init_count > 0) {
        init_count--;
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

NVML_EXPORT const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount) {
    if (!initialized()) {
        return NVML_ERROR_UNINITIALIZED;
    }
    if (deviceCount == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    struct standin_driver_view *v = malloc(sizeof *v);
    if (v == NULL) {
        return NVML_ERROR_UNKNOWN;
    }
    look(v);
    *deviceCount = v->devices;
    free(v);
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount) { return nvmlDeviceGetCount_v2(deviceCount); }

NVML_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!initialized()) {
        return NVML_ERROR_UNINITIALIZED;
    }
    unsigned int count = 0;
    nvmlReturn_t rc = nvmlDeviceGetCount_v2(&count);
    if (rc != NVML_SUCCESS) {
        return rc;
    }
    if (device == NULL || index >= count) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *device = &devices[index];
    return NVML_SUCCESS;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    if (!initialized()) {
        return NVML_ERROR_UNINITIALIZED;
    }
    int i = index_of(device);
    if (i < 0 || index == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *index = (unsigned int)i;
    return NVML_SUCCESS;
}

/* Total and used bytes of a device, summed over live processes. */
static nvmlReturn_t memory_of(nvmlDevice_t device, unsigned long long *total, unsigned long long *used) {
    if (!initialized()) {
        return NVML_ERROR_UNINITIALIZED;
    }
    int i = index_of(device);
    if (i < 0) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    struct standin_driver_view *v = malloc(sizeof *v);
    if (v == NULL) {
        return NVML_ERROR_UNKNOWN;
    }
    look(v);
    nvmlReturn_t rc = (uint32_t)i < v->devices ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS) {
        unsigned long long sum = 0;
        for (size_t p = 0; p < v->n; p++) {
            sum += v->procs[p].used[i];
        }
        *total = v->capacity;
        *used = sum;
    }
    free(v);
    return rc;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    if (memory == NULL) {
        return initialized() ? NVML_ERROR_INVALID_ARGUMENT : NVML_ERROR_UNINITIALIZED;
    }
    unsigned long long total = 0, used = 0;
    nvmlReturn_t rc = memory_of(device, &total, &used);
    if (rc == NVML_SUCCESS) {
        memory->total = total;
        memory->used = used;
        memory->free = used < total ? total - used : 0;
    }
    return rc;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    if (memory == NULL) {
        return initialized() ? NVML_ERROR_INVALID_ARGUMENT : NVML_ERROR_UNINITIALIZED;
    }
    if (memory->version != nvmlMemory_v2) {
        return initialized() ? NVML_ERROR_ARGUMENT_VERSION_MISMATCH : NVML_ERROR_UNINITIALIZED;
    }
    unsigned long long total = 0, used = 0;
    nvmlReturn_t rc = memory_of(device, &total, &used);
    if (rc == NVML_SUCCESS) {
        memory->total = total;
        memory->reserved = 0;
        memory->used = used;
        memory->free = used < total ? total - used : 0;
    }
    return rc;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                                  nvmlProcessInfo_t *infos) {
    if (!initialized()) {
        return NVML_ERROR_UNINITIALIZED;
    }
    int i = index_of(device);
    if (i < 0 || infoCount == NULL || (*infoCount > 0 && infos == NULL)) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    struct standin_driver_view *v = malloc(sizeof *v);
    if (v == NULL) {
        return NVML_ERROR_UNKNOWN;
    }
    look(v);
    nvmlReturn_t rc = NVML_SUCCESS;
    if ((uint32_t)i >= v->devices) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else {
        unsigned int needed = 0;
        for (size_t p = 0; p < v->n; p++) {
            needed += v->procs[p].used[i] > 0;
        }
        if (needed > *infoCount) {
            rc = NVML_ERROR_INSUFFICIENT_SIZE;
        } else {
            unsigned int n = 0;
            for (size_t p = 0; p < v->n; p++) {
                if (v->procs[p].used[i] > 0) {
                    infos[n].pid = v->procs[p].pid;
                    infos[n].usedGpuMemory = v->procs[p].used[i];
                    infos[n].gpuInstanceId = 0xFFFFFFFFu;
                    infos[n].computeInstanceId = 0xFFFFFFFFu;
                    n++;
                }
            }
        }
        *infoCount = needed;
    }
    free(v);
    return rc;
}

NVML_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                                  nvmlProcessInfo_t *infos) {
    return nvmlDeviceGetComputeRunningProcesses_v3(device, infoCount, infos);
}
