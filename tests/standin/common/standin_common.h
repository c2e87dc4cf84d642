/*
 * Helpers every STAND-IN library of memscope-bpf's tests shares: the wall clock their ledgers
 * stamp calls with, the ledger file named by an environment variable, and sizes given in the
 * environment (`8G`, `512M`).
 */
#ifndef MEMSCOPE_STANDIN_COMMON_H
#define MEMSCOPE_STANDIN_COMMON_H

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

/* Wall-clock nanoseconds (CLOCK_REALTIME), as the tracer's rows are stamped. */
static inline unsigned long long standin_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ULL + (unsigned long long)ts.tv_nsec;
}

/* A byte count with an optional k/m/g suffix; `fallback` when unset or empty. */
static inline size_t standin_parse_size(const char *text, size_t fallback) {
    if (text == NULL || *text == '\0') {
        return fallback;
    }
    char *end = NULL;
    unsigned long long value = strtoull(text, &end, 10);
    switch (end ? *end : '\0') {
    case 'k': case 'K': value <<= 10; break;
    case 'm': case 'M': value <<= 20; break;
    case 'g': case 'G': value <<= 30; break;
    default: break;
    }
    return (size_t)value;
}

/* The ledger the environment variable `var` names, opened for appending; NULL when unset. */
static inline FILE *standin_ledger(const char *var) {
    const char *path = getenv(var);
    return path != NULL && *path != '\0' ? fopen(path, "a") : NULL;
}

#endif
