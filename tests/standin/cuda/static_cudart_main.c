/*
 * A STAND-IN program that links the stand-in CUDA runtime statically (its source compiled in, as
 * `cudart_static` is), for memscope-bpf's tests: the runtime's functions are the executable's own,
 * found only in its `.symtab`; the driver stays the shared stand-in libcuda.so.1.
 *
 * It selects device 1, takes 4 MiB and 1 MiB of device memory and 64 KiB of pinned host memory,
 * and gives them back. The stand-ins' ledgers (STANDIN_CUDART_LEDGER, STANDIN_CUDA_LEDGER) are
 * the ground truth.
 */
#include <stdio.h>

#include "cuda_standin.h"

static int check(cudaError_t rc, const char *what) {
    if (rc != cudaSuccess) {
        fprintf(stderr, "%s returned %d\n", what, rc);
    }
    return rc != cudaSuccess;
}

int main(void) {
    void *a = NULL, *b = NULL, *h = NULL;
    int failed = check(cudaSetDevice(1), "cudaSetDevice");
    failed |= check(cudaMalloc(&a, 4 << 20), "cudaMalloc");
    failed |= check(cudaMalloc(&b, 1 << 20), "cudaMalloc");
    failed |= check(cudaMallocHost(&h, 64 << 10), "cudaMallocHost");
    failed |= check(cudaFree(a), "cudaFree");
    failed |= check(cudaFree(b), "cudaFree");
    failed |= check(cudaFreeHost(h), "cudaFreeHost");
    return failed;
}
