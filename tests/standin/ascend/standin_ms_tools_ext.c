/*
 * STAND-IN libms_tools_ext.so for memscope-bpf's tests. It is not MindStudio's mstx library.
 *
 * The real library dispatches to whatever tool injected itself; with none, calls do nothing.
 * This one does the same: it exports the real names and signatures (so uprobes attach as on a real
 * machine), hands out distinct domain and heap handles, and otherwise ignores the calls.
 */
#include "mstx_standin.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define STANDIN_EXPORT __attribute__((visibility("default"), noinline, used))

struct mstxDomainRegistration_st {
    char name[64];
};
struct mstxMemHeap_st {
    int unused;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static mstxRangeId next_range = 1;

STANDIN_EXPORT void mstxMarkA(const char *message, aclrtStream stream) {
    (void)message;
    (void)stream;
}

STANDIN_EXPORT mstxRangeId mstxRangeStartA(const char *message, aclrtStream stream) {
    (void)message;
    (void)stream;
    pthread_mutex_lock(&lock);
    mstxRangeId id = next_range++;
    pthread_mutex_unlock(&lock);
    return id;
}

STANDIN_EXPORT void mstxRangeEnd(mstxRangeId id) { (void)id; }

/* Domain forms share the id counter, as one tool-side range table would. */
STANDIN_EXPORT void mstxDomainMarkA(mstxDomainHandle_t domain, const char *message, aclrtStream stream) {
    (void)domain;
    (void)message;
    (void)stream;
}

STANDIN_EXPORT mstxRangeId mstxDomainRangeStartA(mstxDomainHandle_t domain, const char *message, aclrtStream stream) {
    (void)domain;
    return mstxRangeStartA(message, stream);
}

STANDIN_EXPORT void mstxDomainRangeEnd(mstxDomainHandle_t domain, mstxRangeId id) {
    (void)domain;
    (void)id;
}

STANDIN_EXPORT mstxDomainHandle_t mstxDomainCreateA(const char *name) {
    mstxDomainHandle_t d = calloc(1, sizeof *d);
    if (name != NULL) {
        strncpy(d->name, name, sizeof d->name - 1);
    }
    return d;
}

STANDIN_EXPORT void mstxDomainDestroy(mstxDomainHandle_t domain) { free(domain); }

STANDIN_EXPORT mstxMemHeapHandle_t mstxMemHeapRegister(mstxDomainHandle_t domain, mstxMemHeapDesc_t const *desc) {
    (void)domain;
    (void)desc;
    return calloc(1, sizeof(mstxMemHeap_t));
}

STANDIN_EXPORT void mstxMemHeapUnregister(mstxDomainHandle_t domain, mstxMemHeapHandle_t heap) {
    (void)domain;
    free(heap);
}

STANDIN_EXPORT void mstxMemRegionsRegister(mstxDomainHandle_t domain, mstxMemRegionsRegisterBatch_t const *desc) {
    (void)domain;
    (void)desc;
}

STANDIN_EXPORT void mstxMemRegionsUnregister(mstxDomainHandle_t domain, mstxMemRegionsUnregisterBatch_t const *desc) {
    (void)domain;
    (void)desc;
}
