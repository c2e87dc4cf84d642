/*
 * `cargo xtask bench`'s USDT-site comparison: what one hit of PyTorch's kind of USDT site (a
 * 1-byte nop) costs a traced process, against the same probe on a 5-byte nop (our markers'
 * kind). Both sites are `pytorch:free` of the stand-in libc10_cuda.so, behind one semaphore.
 *
 * Usage: usdt_nop_bench HITS ROUNDS [--wait]. With --wait it prints "waiting" on stderr and
 * waits (at most 30 s) until a tracer raised the semaphores. Prints, per site kind, the best
 * round's nanoseconds per hit: "nop1_ns X" and "nop5_ns Y".
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

extern unsigned long long standin_c10_cuda_probe_loop(unsigned long long n, int nop5);
extern int standin_c10_cuda_probes_live(void);

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s HITS ROUNDS [--wait]\n", argv[0]);
        return 2;
    }
    unsigned long long hits = strtoull(argv[1], NULL, 10);
    int rounds = atoi(argv[2]);
    if (argc > 3 && strcmp(argv[3], "--wait") == 0) {
        fprintf(stderr, "waiting for a tracer\n");
        for (int i = 0; i < 3000 && !standin_c10_cuda_probes_live(); i++) {
            usleep(10000);
        }
        if (!standin_c10_cuda_probes_live()) {
            fprintf(stderr, "no tracer raised the semaphores within 30 s\n");
            return 1;
        }
    }
    double best[2] = {1e30, 1e30};
    for (int r = 0; r < rounds; r++) {
        for (int kind = 0; kind < 2; kind++) {
            double ns = (double)standin_c10_cuda_probe_loop(hits, kind) / (double)hits;
            if (ns < best[kind]) {
                best[kind] = ns;
            }
        }
    }
    printf("nop1_ns %.1f\nnop5_ns %.1f\n", best[0], best[1]);
    return 0;
}
