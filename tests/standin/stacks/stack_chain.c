/*
 * A call chain known by construction, for the native-stack tests: main -> chain_outer ->
 * chain_middle -> (inlined chain_step) -> chain_inner -> aclrtMalloc of the STAND-IN runtime.
 * The chain lives in libstackchain.so, built twice: with frame pointers and with
 * -fomit-frame-pointer (as vendor libraries are), so a frame-pointer walk through it breaks.
 *
 * The ledger (argv[2]) is the ground truth, from glibc's own unwinder (backtrace(), which reads
 * .eh_frame and needs no frame pointers), taken just before each aclrtMalloc:
 *   alloc <ptr> <size> <tid>
 *   frame <backtrace_symbols line>     (innermost first, starting at chain_inner)
 *   line chain_inner <file>:<line>     (the aclrtMalloc call's place, from __LINE__)
 *   line chain_step <file>:<line>      (the inlined call into chain_inner)
 *   end
 */
#define _GNU_SOURCE
#include "acl_standin.h"

#include <execinfo.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

static FILE *ledger;

static void record_backtrace(void) {
    void *frames[64];
    int n = backtrace(frames, 64);
    char **names = backtrace_symbols(frames, n);
    /* Frame 0 is this function. */
    for (int i = 1; i < n; i++) {
        fprintf(ledger, "frame %s\n", names ? names[i] : "?");
    }
    free(names);
}

__attribute__((noinline)) void *chain_inner(size_t size) {
    void *p = NULL;
    record_backtrace();
    int line = __LINE__ + 1;
    if (aclrtMalloc(&p, size, ACL_MEM_MALLOC_HUGE_FIRST) != ACL_SUCCESS) {
        return NULL;
    }
    fprintf(ledger, "alloc %p %zu %ld\nline chain_inner %s:%d\n", p, size, (long)syscall(SYS_gettid), __FILE__, line);
    return p;
}

static inline __attribute__((always_inline)) void *chain_step(size_t size) {
    fprintf(ledger, "line chain_step %s:%d\n", __FILE__, __LINE__ + 1);
    void *p = chain_inner(size + 1);
    return p;
}

__attribute__((noinline)) void *chain_middle(size_t size) {
    void *p = chain_step(size);
    __asm__ volatile("" ::: "memory"); /* keep the call above a call, not a tail call */
    return p;
}

__attribute__((noinline)) void *chain_outer(size_t size) {
    void *p = chain_middle(size);
    __asm__ volatile("" ::: "memory");
    return p;
}

/* The program: `stack_chain COUNT LEDGER [HOLD_MS]`: HOLD_MS keeps the process alive after its
 * allocations (a tracer reads a process's mappings while it lives). */
int chain_main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: stack_chain COUNT LEDGER [HOLD_MS]\n");
        return 2;
    }
    ledger = fopen(argv[2], "w");
    if (!ledger || aclrtSetDevice(0) != ACL_SUCCESS) {
        return 1;
    }
    int count = atoi(argv[1]);
    for (int i = 0; i < count; i++) {
        void *p = chain_outer(4096 * (size_t)(i + 1));
        fprintf(ledger, "end\n");
        if (!p || aclrtFree(p) != ACL_SUCCESS) {
            return 1;
        }
    }
    fclose(ledger);
    if (argc > 3) {
        usleep((useconds_t)atoi(argv[3]) * 1000);
    }
    return 0;
}
