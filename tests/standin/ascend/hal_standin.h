/*
 * STAND-IN for the Ascend driver header (ascend_hal.h), for tests only: the memory functions
 * memscope-bpf traces, with the real names, signatures and struct layouts. Not the driver.
 */
#ifndef MEMSCOPE_HAL_STANDIN_H
#define MEMSCOPE_HAL_STANDIN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef int drvError_t;
#define DRV_ERROR_NONE 0
#define DRV_ERROR_INVALID_VALUE 3
#define DRV_ERROR_INVALID_HANDLE 4
#define DRV_ERROR_OUT_OF_MEMORY 6

/* halMemAlloc flag layout (as decoded by msMemScope): device in bits 0-9, memory type in bits
 * 10-13, huge page bit 17, giant page bit 31, module id in bits 56-63. */
#define MEM_DEVICE_MASK 0x3ffULL
#define MEM_VIRT_BIT 10
#define MEM_SVM_VAL 0x0ULL
#define MEM_DEV_VAL 0x1ULL
#define MEM_HOST_VAL 0x2ULL
#define MEM_DVPP_VAL 0x3ULL
#define MEM_PAGE_HUGE (1ULL << 17)
#define MEM_PAGE_GIANT (1ULL << 31)
#define MEM_MODULE_SHIFT 56

enum drv_mem_side { MEM_HOST_SIDE = 0, MEM_DEV_SIDE, MEM_HOST_NUMA_SIDE, MEM_MAX_SIDE };
enum drv_mem_pg_type { MEM_NORMAL_PAGE_TYPE = 0, MEM_HUGE_PAGE_TYPE, MEM_GIANT_PAGE_TYPE, MEM_MAX_PAGE_TYPE };

struct drv_mem_prop {
    uint32_t side;
    uint32_t devid;
    uint32_t module_id;
    uint32_t pg_type;
    uint32_t mem_type;
    uint64_t reserve;
};

typedef struct drv_mem_handle drv_mem_handle_t;

drvError_t halMemAlloc(void **pp, unsigned long long size, unsigned long long flag);
drvError_t halMemFree(void *pp);
drvError_t halMemCreate(drv_mem_handle_t **handle, size_t size, const struct drv_mem_prop *prop, uint64_t flag);
drvError_t halMemRelease(drv_mem_handle_t *handle);

/* Stand-in only: the memfd and size behind a handle, so the stand-in runtime can map it. */
int standin_hal_handle_fd(drv_mem_handle_t *handle, size_t *size);
/* Stand-in only: a device's free and total bytes, for aclrtGetMemInfo. */
int standin_hal_mem_info(uint32_t device, size_t *free_bytes, size_t *total);
/* Stand-in only: number of devices. */
uint32_t standin_hal_device_count(void);
/* Stand-in only: charges a runtime context's device memory (STANDIN_HAL_CONTEXT_MEM bytes, default
 * 0) once per device per process; DRV_ERROR_OUT_OF_MEMORY when the device has no room. */
drvError_t standin_hal_context_charge(uint32_t device);

#ifdef __cplusplus
}
#endif

#endif
