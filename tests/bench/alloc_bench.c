/*
 * Benchmark loop for `cargo xtask bench`: N x (aclrtMalloc + aclrtFree) on the STAND-IN runtime,
 * timed inside the process so probe attach and process start are not counted.
 * Prints one line: "ns_per_pair <value> pairs <N>".
 * `alloc_bench N LIVE` then allocates LIVE more blocks and exits with them still allocated, so the
 * tracer holds LIVE live blocks at its stop (the memory benchmark); `alloc_bench N LIVE THREADS
 * RATE` runs the loop on THREADS threads at RATE pairs/s (the loss-by-rate benchmark).
 */
#include "acl_standin.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

struct worker {
    long pairs;
    double period_ns; /* 0: as fast as it goes */
    int failed;
};

/* One thread's share of the loop, paced to one pair per period when a rate is asked for. */
static void *run_pairs(void *arg) {
    struct worker *w = arg;
    if (aclrtSetDevice(0) != ACL_SUCCESS) {
        w->failed = 1;
        return NULL;
    }
    double start = now_ns();
    for (long i = 0; i < w->pairs; i++) {
        while (w->period_ns > 0 && now_ns() < start + (double)i * w->period_ns) {
        }
        void *p = NULL;
        if (aclrtMalloc(&p, 4096 + (size_t)(i & 63), ACL_MEM_MALLOC_HUGE_FIRST) != ACL_SUCCESS || aclrtFree(p) != ACL_SUCCESS) {
            fprintf(stderr, "allocation failed at %ld\n", i);
            w->failed = 1;
            return NULL;
        }
    }
    return NULL;
}

int main(int argc, char **argv) {
    long pairs = argc > 1 ? atol(argv[1]) : 1000000;
    long live = argc > 2 ? atol(argv[2]) : 0;
    /* `alloc_bench N LIVE THREADS RATE`: N pairs shared by THREADS threads, offered at RATE pairs/s
     * in all (0: as fast as they go). Prints the call rate offered (4 traced calls per pair). */
    long threads = argc > 3 ? atol(argv[3]) : 1;
    double rate = argc > 4 ? atof(argv[4]) : 0;
    if (threads < 1 || threads > 64) {
        fprintf(stderr, "threads must be 1..64\n");
        return 1;
    }
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
    struct worker workers[64];
    pthread_t ids[64];
    double start = now_ns();
    for (long t = 0; t < threads; t++) {
        workers[t] = (struct worker){pairs / threads + (t < pairs % threads), rate > 0 ? 1e9 * threads / rate : 0, 0};
        if (threads == 1) {
            run_pairs(&workers[0]);
        } else if (pthread_create(&ids[t], NULL, run_pairs, &workers[t]) != 0) {
            fprintf(stderr, "pthread_create failed\n");
            return 1;
        }
    }
    for (long t = 0; t < threads && threads > 1; t++) {
        pthread_join(ids[t], NULL);
    }
    double elapsed = now_ns() - start;
    for (long t = 0; t < threads; t++) {
        if (workers[t].failed) {
            return 1;
        }
    }
    for (long i = 0; i < live; i++) {
        void *p = NULL;
        if (aclrtMalloc(&p, 64, ACL_MEM_MALLOC_HUGE_FIRST) != ACL_SUCCESS) {
            fprintf(stderr, "live allocation failed at %ld\n", i);
            return 1;
        }
    }
    printf("ns_per_pair %.1f pairs %ld calls_per_s %.0f\n", pairs > 0 ? elapsed / (double)pairs : 0.0, pairs,
           pairs > 0 ? 4e9 * (double)pairs / elapsed : 0.0);
    return 0;
}
