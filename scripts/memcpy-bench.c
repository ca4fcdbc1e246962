/* The memcpy reference of the same-host benchmarks (bench-memory-vs-ucx.sh,
 * perf-page.sh, bench-nixl-backend.sh): one thread copying between two
 * buffers of BUFFER bytes (default 256 MiB) in blocks of BLOCK bytes for
 * SECONDS, printing GB/s. A one-block buffer is the cache-resident copy
 * ucx_perftest's put is set against. Built with cc -O2 by the scripts that
 * run it.
 *
 * With `pvm`, the copies are the kernel's: process_vm_writev into this
 * same process, in the calls ferry makes for memory it did not allocate
 * (NIXL's): up to 1,024 blocks and 1 MiB a call, a longer block in 1 MiB
 * calls. That is the ceiling of one thread copying between two processes
 * without a shared mapping.
 *
 *   memcpy-bench BLOCK SECONDS [BUFFER [pvm]]
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec / 1e9; }
int main(int argc, char **argv) {
    size_t block = strtoull(argv[1], 0, 10), total = argc > 3 ? strtoull(argv[3], 0, 10) : 256u << 20;
    double seconds = atof(argv[2]);
    char *a = malloc(total), *b = malloc(total);
    memset(a, 1, total); memset(b, 2, total);
    size_t moved = 0, at = 0;
    int pvm = argc > 4 && strcmp(argv[4], "pvm") == 0;
    struct iovec from[1024], to[1024];
    double start = now();
    while (now() - start < seconds) {
        if (!pvm) {
            memcpy(b + at, a + at, block);
            moved += block; at = (at + block) % total;
            continue;
        }
        size_t bytes = 0, piece = block < (1u << 20) ? block : 1u << 20;
        int n = 0;
        while (n < 1024 && bytes + piece <= (1u << 20) && at + piece <= total) {
            from[n].iov_base = a + at; to[n].iov_base = b + at;
            from[n].iov_len = to[n].iov_len = piece;
            n++; bytes += piece; at += piece;
        }
        if (at + piece > total) at = 0;
        if (n && process_vm_writev(getpid(), from, n, to, n, 0) != (ssize_t)bytes) { perror("process_vm_writev"); return 1; }
        moved += bytes;
    }
    printf("%.3f\n", moved / (now() - start) / 1e9);
    return b[7] == 3;
}
