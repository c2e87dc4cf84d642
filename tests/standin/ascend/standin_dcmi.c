/*
 * STAND-IN libdcmi.so for memscope-bpf's tests. It is not Huawei's DCMI (the Ascend device
 * management library behind npu-smi), and there is no NPU behind it.
 *
 * It exports the DCMI functions a tracer asks for devices' and processes' memory, with the real
 * names, signatures, struct layouts and return codes (dcmi_interface_api.h), and answers from what
 * the stand-in driver (libascend_hal.so) really charged, in every live process that loaded it:
 * each publishes its usage in /dev/shm/memscope-standin-npu-<pid>
 * (../common/standin_driver_state.h). Processes that are gone count for nothing, as on a real
 * driver. It is built next to the stand-in libascend_hal.so, where a tracer looks for it.
 *
 * Topology (deliberately not the identity, so that a tracer assuming card id == logical id is
 * caught): logical device L (the driver's and the runtime's device number) is card 2*L+1, chip
 * (device_id) 0 of it: one chip per card. The number of devices is the largest device count a
 * live process published; with none, STANDIN_ACL_DEVICE_COUNT (default 2) of this process's
 * environment, so that a query before the job starts sees the cards.
 *
 * Memory: a device's total is the driver's capacity (the largest a live process published; with
 * none, STANDIN_ACL_DEVICE_MEM, default 8G); its usage is the sum over live processes of what the
 * driver charged them on it. dcmi_get_device_hbm_info reports both in MB (bytes / 2^20 rounded
 * down), as the real driver does; dcmi_get_device_resource_info and dcmi_get_npu_proc_mem_info
 * list each live process with memory on the device, in bytes, at most MAX_PROC_NUM_IN_DEVICE (64),
 * by pid.
 *
 * Return codes (the real ones): DCMI_OK 0; DCMI_ERR_CODE_INVALID_PARAMETER -8001 for a NULL
 * pointer or a list too short; DCMI_ERR_CODE_INVALID_DEVICE_ID -8007 for a chip other than 0 of a
 * card; DCMI_ERR_CODE_DEVICE_NOT_EXIST -8008 for a card or logical id that does not exist.
 * dcmi_init is not required first (harmless, returns DCMI_OK). There is no ledger: nothing here
 * changes memory.
 */
#define _GNU_SOURCE
#include "../common/standin_common.h"
#include "../common/standin_driver_state.h"

#include <stdint.h>
#include <stdlib.h>

#define DCMI_EXPORT __attribute__((visibility("default"), noinline, used))

#define DCMI_OK 0
#define DCMI_ERROR_CODE_BASE (-8000)
#define DCMI_ERR_CODE_INVALID_PARAMETER (DCMI_ERROR_CODE_BASE - 1)
#define DCMI_ERR_CODE_INVALID_DEVICE_ID (DCMI_ERROR_CODE_BASE - 7)
#define DCMI_ERR_CODE_DEVICE_NOT_EXIST (DCMI_ERROR_CODE_BASE - 8)

#define MAX_CARD_NUM 64
#define MAX_PROC_NUM_IN_DEVICE 64

struct dcmi_hbm_info {
    unsigned long long memory_size;  /* MB */
    unsigned int freq;               /* MHz */
    unsigned long long memory_usage; /* MB */
    int temp;
    unsigned int bandwith_util_rate;
};

struct dcmi_proc_mem_info {
    int proc_id;
    unsigned long proc_mem_usage; /* bytes */
};

static void look(struct standin_driver_view *v) {
    standin_driver_look(v, "npu", "STANDIN_ACL_DEVICE_COUNT", "STANDIN_ACL_DEVICE_MEM", MAX_CARD_NUM);
}

static uint32_t device_count(void) {
    struct standin_driver_view *v = malloc(sizeof *v);
    if (v == NULL) {
        return 0;
    }
    look(v);
    uint32_t n = v->devices;
    free(v);
    return n;
}

/* The logical id of (card, chip), or a DCMI error (negative). */
static int logical_of(int card_id, int device_id, uint32_t devices) {
    if (card_id < 1 || card_id % 2 != 1 || (uint32_t)(card_id - 1) / 2 >= devices) {
        return DCMI_ERR_CODE_DEVICE_NOT_EXIST;
    }
    if (device_id != 0) {
        return DCMI_ERR_CODE_INVALID_DEVICE_ID;
    }
    return (card_id - 1) / 2;
}

DCMI_EXPORT int dcmi_init(void) { return DCMI_OK; }

DCMI_EXPORT int dcmi_get_card_list(int *card_num, int *card_list, int list_len) {
    if (card_num == NULL || card_list == NULL || list_len <= 0) {
        return DCMI_ERR_CODE_INVALID_PARAMETER;
    }
    uint32_t devices = device_count();
    if ((uint32_t)list_len < devices) {
        return DCMI_ERR_CODE_INVALID_PARAMETER;
    }
    for (uint32_t l = 0; l < devices; l++) {
        card_list[l] = (int)(2 * l + 1);
    }
    *card_num = (int)devices;
    return DCMI_OK;
}

DCMI_EXPORT int dcmi_get_card_num_list(int *card_num, int *card_list, int list_len) {
    return dcmi_get_card_list(card_num, card_list, list_len);
}

DCMI_EXPORT int dcmi_get_device_num_in_card(int card_id, int *device_num) {
    if (device_num == NULL) {
        return DCMI_ERR_CODE_INVALID_PARAMETER;
    }
    int l = logical_of(card_id, 0, device_count());
    if (l < 0) {
        return l;
    }
    *device_num = 1;
    return DCMI_OK;
}

DCMI_EXPORT int dcmi_get_device_logic_id(int *device_logic_id, int card_id, int device_id) {
    if (device_logic_id == NULL) {
        return DCMI_ERR_CODE_INVALID_PARAMETER;
    }
    int l = logical_of(card_id, device_id, device_count());
    if (l < 0) {
        return l;
    }
    *device_logic_id = l;
    return DCMI_OK;
}

DCMI_EXPORT int dcmi_get_card_id_device_id_from_logicid(int *card_id, int *device_id, unsigned int device_logic_id) {
    if (card_id == NULL || device_id == NULL) {
        return DCMI_ERR_CODE_INVALID_PARAMETER;
    }
    if (device_logic_id >= device_count()) {
        return DCMI_ERR_CODE_DEVICE_NOT_EXIST;
    }
    *card_id = (int)(2 * device_logic_id + 1);
    *device_id = 0;
    return DCMI_OK;
}

/* The node's view now (the caller frees it) and the logical id of (card, chip) in `*l`, an
 * error code when there is no such device; NULL when it cannot be allocated. */
static struct standin_driver_view *view_of(int card_id, int device_id, int *l) {
    struct standin_driver_view *v = malloc(sizeof *v);
    if (v != NULL) {
        look(v);
        *l = logical_of(card_id, device_id, v->devices);
    }
    return v;
}

DCMI_EXPORT int dcmi_get_device_hbm_info(int card_id, int device_id, struct dcmi_hbm_info *hbm_info) {
    int l = 0;
    struct standin_driver_view *v = hbm_info == NULL ? NULL : view_of(card_id, device_id, &l);
    if (v == NULL) {
        return DCMI_ERR_CODE_INVALID_PARAMETER;
    }
    if (l >= 0) {
        uint64_t used = 0;
        for (size_t i = 0; i < v->n; i++) {
            used += v->procs[i].used[l];
        }
        hbm_info->memory_size = v->capacity >> 20;
        hbm_info->freq = 1600;
        hbm_info->memory_usage = used >> 20;
        hbm_info->temp = 40;
        hbm_info->bandwith_util_rate = 0;
    }
    free(v);
    return l < 0 ? l : DCMI_OK;
}

DCMI_EXPORT int dcmi_get_npu_proc_mem_info(int card_id, int device_id, struct dcmi_proc_mem_info *proc_info,
                                           int *proc_num) {
    int l = 0;
    struct standin_driver_view *v =
        proc_info == NULL || proc_num == NULL ? NULL : view_of(card_id, device_id, &l);
    if (v == NULL) {
        return DCMI_ERR_CODE_INVALID_PARAMETER;
    }
    if (l >= 0) {
        int n = 0;
        for (size_t i = 0; i < v->n && n < MAX_PROC_NUM_IN_DEVICE; i++) {
            if (v->procs[i].used[l] > 0) {
                proc_info[n].proc_id = (int)v->procs[i].pid;
                proc_info[n].proc_mem_usage = (unsigned long)v->procs[i].used[l];
                n++;
            }
        }
        *proc_num = n;
    }
    free(v);
    return l < 0 ? l : DCMI_OK;
}

DCMI_EXPORT int dcmi_get_device_resource_info(int card_id, int device_id, struct dcmi_proc_mem_info *proc_info,
                                              int *proc_num) {
    return dcmi_get_npu_proc_mem_info(card_id, device_id, proc_info, proc_num);
}
