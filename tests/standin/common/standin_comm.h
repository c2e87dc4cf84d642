/*
 * What the STAND-IN communication libraries (libhccl.so, libnccl.so.2) share: each buffer they
 * take is one line in the ledger STANDIN_COMM_LEDGER names, as the tests' ground truth for the
 * memory a library takes itself.
 */
#ifndef MEMSCOPE_STANDIN_COMM_H
#define MEMSCOPE_STANDIN_COMM_H

#include "standin_common.h"

#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#define STANDIN_EXPORT __attribute__((visibility("default"), noinline, used))

static pthread_mutex_t comm_ledger_lock = PTHREAD_MUTEX_INITIALIZER;

/* One line: the library, the call it made, the memory's space ("device" or "host"), the
 * device (-1 for host memory), the bytes asked for, the address (or 0), and the call's status. */
static void comm_note(const char *lib, const char *api, const char *space, int device, size_t size,
                      unsigned long long ptr, int rc, unsigned long long t0) {
    unsigned long long t1 = standin_now_ns();
    pthread_mutex_lock(&comm_ledger_lock);
    FILE *ledger = standin_ledger("STANDIN_COMM_LEDGER");
    if (ledger != NULL) {
        fprintf(ledger,
                "{\"lib\":\"%s\",\"api\":\"%s\",\"space\":\"%s\",\"device\":%d,\"size\":%zu,\"ptr\":%llu,"
                "\"rc\":%d,\"tid\":%ld,\"t0\":%llu,\"t1\":%llu}\n",
                lib, api, space, device, size, ptr, rc, (long)syscall(SYS_gettid), t0, t1);
        fclose(ledger);
    }
    pthread_mutex_unlock(&comm_ledger_lock);
}

#endif
