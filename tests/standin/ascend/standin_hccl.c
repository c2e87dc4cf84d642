/*
 * STAND-IN libhccl.so for memscope-bpf's tests. It is not HCCL.
 *
 * It exports HCCL's communicator calls (names and signatures from hccl.h) and takes memory the
 * way HCCL does, itself, from the runtime: a communicator holds two CCL buffers of
 * HCCL_BUFFSIZE MB each (HCCL's variable; default 200, as HCCL's) on the calling thread's
 * device with aclrtMalloc, and a host buffer of 1 MiB with aclrtMallocHost. HcclCommDestroy
 * gives them back (aclrtFree, aclrtFreeHost). Each buffer taken or given back is a line of
 * STANDIN_COMM_LEDGER (standin_comm.h): the tracer must name these blocks HCCL's from the
 * address its calls come from, since nothing in the calls themselves says who made them.
 *
 * Only one rank: the root info is an opaque block, and every communicator has one rank.
 */
#include "../common/standin_comm.h"
#include "acl_standin.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef enum { HCCL_SUCCESS = 0, HCCL_E_PARA = 1, HCCL_E_MEMORY = 12, HCCL_E_RUNTIME = 5 } HcclResult;
typedef void *HcclComm;
#define HCCL_ROOT_INFO_BYTES 4108
typedef struct HcclRootInfoDef {
    char internal[HCCL_ROOT_INFO_BYTES];
} HcclRootInfo;

struct comm {
    int32_t device;
    size_t buffer_size;
    void *buffers[2];
    void *host;
};

#define HOST_BUFFER ((size_t)1 << 20)

STANDIN_EXPORT HcclResult HcclGetRootInfo(HcclRootInfo *rootInfo) {
    if (rootInfo == NULL) {
        return HCCL_E_PARA;
    }
    memset(rootInfo->internal, 0, sizeof rootInfo->internal);
    memcpy(rootInfo->internal, "standin", 7);
    return HCCL_SUCCESS;
}

static HcclResult take(struct comm *c) {
    for (int i = 0; i < 2; i++) {
        unsigned long long t0 = standin_now_ns();
        aclError rc = aclrtMalloc(&c->buffers[i], c->buffer_size, ACL_MEM_MALLOC_HUGE_FIRST);
        comm_note("hccl", "aclrtMalloc", "device", c->device, c->buffer_size,
                  rc == ACL_SUCCESS ? (uintptr_t)c->buffers[i] : 0, rc, t0);
        if (rc != ACL_SUCCESS) {
            c->buffers[i] = NULL;
            return HCCL_E_MEMORY;
        }
    }
    unsigned long long t0 = standin_now_ns();
    aclError rc = aclrtMallocHost(&c->host, HOST_BUFFER);
    comm_note("hccl", "aclrtMallocHost", "host", -1, HOST_BUFFER, rc == ACL_SUCCESS ? (uintptr_t)c->host : 0, rc, t0);
    if (rc != ACL_SUCCESS) {
        c->host = NULL;
        return HCCL_E_MEMORY;
    }
    return HCCL_SUCCESS;
}

static void give_back(struct comm *c) {
    for (int i = 0; i < 2; i++) {
        if (c->buffers[i] != NULL) {
            unsigned long long t0 = standin_now_ns();
            aclError rc = aclrtFree(c->buffers[i]);
            comm_note("hccl", "aclrtFree", "device", c->device, c->buffer_size, (uintptr_t)c->buffers[i], rc, t0);
        }
    }
    if (c->host != NULL) {
        unsigned long long t0 = standin_now_ns();
        aclError rc = aclrtFreeHost(c->host);
        comm_note("hccl", "aclrtFreeHost", "host", -1, HOST_BUFFER, (uintptr_t)c->host, rc, t0);
    }
}

STANDIN_EXPORT HcclResult HcclCommInitRootInfo(uint32_t nRanks, const HcclRootInfo *rootInfo, uint32_t rank,
                                               HcclComm *comm) {
    if (rootInfo == NULL || comm == NULL || nRanks != 1 || rank != 0) {
        return HCCL_E_PARA;
    }
    struct comm *c = calloc(1, sizeof *c);
    if (c == NULL) {
        return HCCL_E_MEMORY;
    }
    if (aclrtGetDevice(&c->device) != ACL_SUCCESS) {
        free(c);
        return HCCL_E_RUNTIME;
    }
    c->buffer_size = standin_parse_size(getenv("HCCL_BUFFSIZE"), 200) << 20;
    HcclResult rc = take(c);
    if (rc != HCCL_SUCCESS) {
        give_back(c);
        free(c);
        return rc;
    }
    *comm = c;
    return HCCL_SUCCESS;
}

STANDIN_EXPORT HcclResult HcclCommDestroy(HcclComm comm) {
    if (comm == NULL) {
        return HCCL_E_PARA;
    }
    give_back(comm);
    free(comm);
    return HCCL_SUCCESS;
}
