/* The memcpy reference of the same-host benchmarks (bench-memory-vs-ucx.sh,
 * perf-page.sh): one thread copying between two buffers of BUFFER bytes
 * (default 256 MiB) in blocks of BLOCK bytes for SECONDS, printing GB/s.
 * A one-block buffer is the cache-resident copy ucx_perftest's put is set
 * against. Built with cc -O2 by the scripts that run it.
 *
 *   memcpy-bench BLOCK SECONDS [BUFFER]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec / 1e9; }
int main(int argc, char **argv) {
    size_t block = strtoull(argv[1], 0, 10), total = argc > 3 ? strtoull(argv[3], 0, 10) : 256u << 20;
    double seconds = atof(argv[2]);
    char *a = malloc(total), *b = malloc(total);
    memset(a, 1, total); memset(b, 2, total);
    size_t moved = 0, at = 0;
    double start = now();
    while (now() - start < seconds) {
        memcpy(b + at, a + at, block);
        moved += block; at = (at + block) % total;
    }
    printf("%.3f\n", moved / (now() - start) / 1e9);
    return b[7] == 3;
}
