/*
 * Benchmark loop for `cargo xtask bench`: N x (aclrtMalloc + aclrtFree) on the STAND-IN runtime,
 * timed inside the process so probe attach and process start are not counted.
 * Prints one line: "ns_per_pair <value> pairs <N>".
 * `alloc_bench N LIVE` then allocates LIVE more blocks and exits with them still allocated, so the
 * tracer holds LIVE live blocks at its stop (the memory benchmark).
 */
#include "acl_standin.h"

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

int main(int argc, char **argv) {
    long pairs = argc > 1 ? atol(argv[1]) : 1000000;
    long live = argc > 2 ? atol(argv[2]) : 0;
    if (aclrtSetDevice(0) != ACL_SUCCESS) {
        fprintf(stderr, "aclrtSetDevice failed\n");
        return 1;
    }
    /* Warm the allocator and the page cache before timing. */
    for (int i = 0; i < 1000; i++) {
        void *p = NULL;
        aclrtMalloc(&p, 4096, ACL_MEM_MALLOC_HUGE_FIRST);
        aclrtFree(p);
    }
    double start = now_ns();
    for (long i = 0; i < pairs; i++) {
        void *p = NULL;
        if (aclrtMalloc(&p, 4096 + (size_t)(i & 63), ACL_MEM_MALLOC_HUGE_FIRST) != ACL_SUCCESS || aclrtFree(p) != ACL_SUCCESS) {
            fprintf(stderr, "allocation failed at %ld\n", i);
            return 1;
        }
    }
    double elapsed = now_ns() - start;
    for (long i = 0; i < live; i++) {
        void *p = NULL;
        if (aclrtMalloc(&p, 64, ACL_MEM_MALLOC_HUGE_FIRST) != ACL_SUCCESS) {
            fprintf(stderr, "live allocation failed at %ld\n", i);
            return 1;
        }
    }
    printf("ns_per_pair %.1f pairs %ld\n", pairs > 0 ? elapsed / (double)pairs : 0.0, pairs);
    return 0;
}
