/*
 * The STAND-IN drivers' own view of device memory, shared across processes, for memscope-bpf's
 * tests. Not a driver interface: nothing real has this file; only the stand-ins read and write it.
 *
 * A real driver knows what every process holds on every device, and its management library
 * (DCMI on Ascend, NVML on NVIDIA) answers from that. The stand-in drivers (libascend_hal.so,
 * libcuda.so.1) are libraries inside each process, so each publishes its process's usage in a
 * shared-memory file, and the stand-in management libraries (libdcmi.so, libnvidia-ml.so.1, loaded
 * by the tracer, another process) read every live process's file:
 *
 *   /dev/shm/memscope-standin-<kind>-<pid>      kind: "npu" (libascend_hal.so) or "gpu" (libcuda.so.1)
 *
 * created 0644 by the driver at its init (and by a forked child at its first charge or refund:
 * the parent's devices are not the child's), mapped MAP_SHARED, unlinked at the process's exit.
 * `used[d]` is what the driver charged on device d (every charge and refund, before the call
 * returns), written with __atomic_store_n and read with __atomic_load_n.
 *
 * A reader skips the file of a process that is gone (kill(pid, 0) fails with ESRCH), a zombie, or
 * a process that merely reuses a dead one's pid (its start time differs): a real driver frees a
 * process's memory when it exits and counts no dead process. Readers never unlink other
 * processes' files.
 */
#ifndef MEMSCOPE_STANDIN_DRIVER_STATE_H
#define MEMSCOPE_STANDIN_DRIVER_STATE_H

#include "standin_common.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#define STANDIN_DRIVER_STATE_MAGIC 0x315453565244534dULL /* the bytes "MSDRVST1" */
#define STANDIN_DRIVER_MAX_DEVICES 64
#define STANDIN_DRIVER_STATE_DIR "/dev/shm"
#define STANDIN_DRIVER_STATE_PREFIX "memscope-standin-"

struct standin_driver_state {
    uint64_t magic;        /* STANDIN_DRIVER_STATE_MAGIC, stored last (release) once the rest is set */
    uint32_t device_count; /* the driver's devices */
    uint32_t pid;          /* the process whose usage this is */
    uint64_t capacity;     /* bytes per device */
    uint64_t used[STANDIN_DRIVER_MAX_DEVICES]; /* bytes the driver charged this process, per device */
    uint64_t start_time;   /* the process's start time (/proc/<pid>/stat field 22), 0 unknown: a
                            * stand-in extension after the fixed part, so that a reused pid is not
                            * mistaken for the process that published */
};

/* ---- shared ---- */

/* The start time (clock ticks after boot) of `pid` from /proc/<pid>/stat, and its state letter
 * in *state (0 when unreadable); 0 when the process or its stat file is not there. */
static inline uint64_t standin_process_start_time(pid_t pid, char *state) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    if (state != NULL) {
        *state = 0;
    }
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        return 0;
    }
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    char *p = strrchr(buf, ')'); /* the command name may hold spaces and parentheses */
    if (p == NULL || p[1] != ' ') {
        return 0;
    }
    p += 2; /* field 3: the state */
    if (state != NULL) {
        *state = *p;
    }
    for (int field = 3; field < 22 && p != NULL; field++) {
        p = strchr(p, ' ');
        if (p != NULL) {
            p++;
        }
    }
    return p != NULL ? strtoull(p, NULL, 10) : 0;
}

static inline void standin_driver_state_path(char *out, size_t len, const char *kind, pid_t pid) {
    snprintf(out, len, STANDIN_DRIVER_STATE_DIR "/" STANDIN_DRIVER_STATE_PREFIX "%s-%d", kind, (int)pid);
}

/* ---- writer (the stand-in drivers) ---- */

/* One process's publication. Callers serialise calls to standin_driver_publish (the drivers hold
 * their allocation lock). */
struct standin_driver_publisher {
    const char *kind;
    uint32_t device_count;
    uint64_t capacity;
    pid_t owner;                                 /* the process the mapping belongs to; 0: none yet */
    struct standin_driver_state *state;          /* NULL when the file could not be made */
    uint64_t last[STANDIN_DRIVER_MAX_DEVICES];   /* the driver's counters as last published */
    uint64_t base[STANDIN_DRIVER_MAX_DEVICES];   /* counters inherited at fork: not this process's */
};

/* Set in a forked child (pthread_atfork), so the next publication makes the child's own file. */
static int standin_driver_forked __attribute__((unused));
static inline void standin_driver_on_fork(void) { standin_driver_forked = 1; }

/* Creates (or truncates) this process's file and maps it; on failure the driver goes on
 * unpublished. */
static inline void standin_driver_publish_open(struct standin_driver_publisher *p) {
    pid_t self = getpid();
    if (p->owner == 0) {
        pthread_atfork(NULL, NULL, standin_driver_on_fork);
    }
    standin_driver_forked = 0;
    if (p->owner != 0 && p->owner != self) {
        /* A forked child: the mapping is the parent's. What the driver counted before the fork is
         * the parent's memory, not the child's. */
        if (p->state != NULL) {
            munmap(p->state, sizeof *p->state);
        }
        memcpy(p->base, p->last, sizeof p->base);
    }
    p->owner = self;
    p->state = NULL;
    char path[128];
    standin_driver_state_path(path, sizeof path, p->kind, self);
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0) {
        return;
    }
    struct standin_driver_state *s = NULL;
    if (fchmod(fd, 0644) == 0 && ftruncate(fd, (off_t)sizeof *s) == 0) {
        void *m = mmap(NULL, sizeof *s, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        s = m == MAP_FAILED ? NULL : m;
    }
    close(fd);
    if (s == NULL) {
        unlink(path);
        return;
    }
    s->device_count = p->device_count;
    s->pid = (uint32_t)self;
    s->capacity = p->capacity;
    for (uint32_t d = 0; d < STANDIN_DRIVER_MAX_DEVICES; d++) {
        uint64_t mine = p->last[d] > p->base[d] ? p->last[d] - p->base[d] : 0;
        __atomic_store_n(&s->used[d], mine, __ATOMIC_RELAXED);
    }
    s->start_time = standin_process_start_time(self, NULL);
    __atomic_store_n(&s->magic, STANDIN_DRIVER_STATE_MAGIC, __ATOMIC_RELEASE);
    p->state = s;
}

/* The driver's counter for `device` is now `value` bytes. */
static inline void standin_driver_publish(struct standin_driver_publisher *p, uint32_t device, uint64_t value) {
    if (device >= STANDIN_DRIVER_MAX_DEVICES) {
        return;
    }
    if (p->owner == 0 || standin_driver_forked) {
        standin_driver_publish_open(p);
    }
    p->last[device] = value;
    if (p->state != NULL) {
        uint64_t mine = value > p->base[device] ? value - p->base[device] : 0;
        __atomic_store_n(&p->state->used[device], mine, __ATOMIC_RELEASE);
    }
}

/* At exit: removes this process's own file (never another's; a forked child that never
 * published owns none). */
static inline void standin_driver_unpublish(struct standin_driver_publisher *p) {
    if (p->owner == getpid() && p->state != NULL) {
        char path[128];
        standin_driver_state_path(path, sizeof path, p->kind, p->owner);
        unlink(path);
    }
}

/* ---- reader (the stand-in management libraries) ---- */

/* A copy of one live process's state. */
struct standin_driver_usage {
    uint32_t pid;
    uint32_t device_count;
    uint64_t capacity;
    uint64_t used[STANDIN_DRIVER_MAX_DEVICES];
};

/* Whether the process that published `s` is still running: not gone (ESRCH), not a zombie, and
 * not another process under a reused pid. */
static inline int standin_driver_state_live(const struct standin_driver_state *s) {
    pid_t pid = (pid_t)s->pid;
    if (pid <= 0 || (kill(pid, 0) != 0 && errno == ESRCH)) {
        return 0;
    }
    char state = 0;
    uint64_t start = standin_process_start_time(pid, &state);
    if (state == 'Z' || state == 'X') {
        return 0;
    }
    return s->start_time == 0 || start == 0 || start == s->start_time;
}

static inline int standin_driver_usage_by_pid(const void *a, const void *b) {
    uint32_t x = ((const struct standin_driver_usage *)a)->pid, y = ((const struct standin_driver_usage *)b)->pid;
    return (x > y) - (x < y);
}

/* Every live process's usage of `kind` ("npu", "gpu"), by pid, at most `max`; returns how many. */
static inline size_t standin_driver_states_read(const char *kind, struct standin_driver_usage *out, size_t max) {
    char prefix[64];
    snprintf(prefix, sizeof prefix, STANDIN_DRIVER_STATE_PREFIX "%s-", kind);
    size_t prefix_len = strlen(prefix), n = 0;
    DIR *dir = opendir(STANDIN_DRIVER_STATE_DIR);
    if (dir == NULL) {
        return 0;
    }
    struct dirent *e;
    while (n < max && (e = readdir(dir)) != NULL) {
        if (strncmp(e->d_name, prefix, prefix_len) != 0) {
            continue;
        }
        char *end = NULL;
        unsigned long pid = strtoul(e->d_name + prefix_len, &end, 10);
        if (end == e->d_name + prefix_len || *end != '\0') {
            continue;
        }
        int fd = openat(dirfd(dir), e->d_name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
        if (fd < 0) {
            continue;
        }
        struct stat st;
        const struct standin_driver_state *s = NULL;
        if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && (size_t)st.st_size >= sizeof *s) {
            void *m = mmap(NULL, sizeof *s, PROT_READ, MAP_SHARED, fd, 0);
            s = m == MAP_FAILED ? NULL : m;
        }
        close(fd);
        if (s == NULL) {
            continue;
        }
        if (__atomic_load_n(&s->magic, __ATOMIC_ACQUIRE) == STANDIN_DRIVER_STATE_MAGIC && s->pid == pid &&
            s->device_count <= STANDIN_DRIVER_MAX_DEVICES && standin_driver_state_live(s)) {
            struct standin_driver_usage *u = &out[n++];
            u->pid = s->pid;
            u->device_count = s->device_count;
            u->capacity = s->capacity;
            for (uint32_t d = 0; d < STANDIN_DRIVER_MAX_DEVICES; d++) {
                u->used[d] = __atomic_load_n(&s->used[d], __ATOMIC_ACQUIRE);
            }
        }
        munmap((void *)s, sizeof *s);
    }
    closedir(dir);
    qsort(out, n, sizeof *out, standin_driver_usage_by_pid);
    return n;
}

/* Every live process's usage of one kind's devices, the device count and capacity they imply,
 * read afresh per call (a query is rare; the files change with every allocation). With no live
 * process, the count and capacity come from the caller's own environment (`count_var`,
 * `mem_var`; 2 devices of 8G by default), as a node's management library knows its cards
 * before any job runs. */
#define STANDIN_DRIVER_VIEW_PROCESSES 1024
struct standin_driver_view {
    size_t n;
    uint32_t devices;
    uint64_t capacity;
    struct standin_driver_usage procs[STANDIN_DRIVER_VIEW_PROCESSES];
};

static inline void standin_driver_look(struct standin_driver_view *v, const char *kind, const char *count_var,
                                       const char *mem_var, uint32_t max_devices) {
    v->n = standin_driver_states_read(kind, v->procs, STANDIN_DRIVER_VIEW_PROCESSES);
    v->devices = 0;
    v->capacity = 0;
    for (size_t i = 0; i < v->n; i++) {
        if (v->procs[i].device_count > v->devices) {
            v->devices = v->procs[i].device_count;
        }
        if (v->procs[i].capacity > v->capacity) {
            v->capacity = v->procs[i].capacity;
        }
    }
    if (v->n == 0) {
        v->devices = (uint32_t)standin_parse_size(getenv(count_var), 2);
        if (v->devices < 1 || v->devices > max_devices) {
            v->devices = 2;
        }
        v->capacity = standin_parse_size(getenv(mem_var), (size_t)8 << 30);
    }
}

#endif
