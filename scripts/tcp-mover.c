/* The TCP references of the performance page and the TCP benchmarks: the
 * same work ferry's TCP transport does, with no protocol, over loopback.
 *
 *   tcp-mover bw PAIRS BLOCK SIZE SECONDS
 *       PAIRS sender processes, each connected to a receiver process of
 *       its own. Each pair sweeps its 1/PAIRS share of a SIZE-byte buffer
 *       (each side's own) in BLOCK-byte send() and recv() calls, offset
 *       after offset, as `ferry bench --streams PAIRS --block ... --size
 *       SIZE` writes its region over its connections; a buffer larger
 *       than the caches costs what ferry's does. Prints the GB/s received
 *       by all receivers together, over the same SECONDS.
 *
 *   tcp-mover pingpong LEN SECONDS [spin]
 *       One process per side: a blocking send() of LEN bytes and a
 *       blocking recv() of the LEN-byte answer, over one connection with
 *       TCP_NODELAY, for SECONDS. Prints the median round trip in
 *       microseconds: what one small request and its answer cost with no
 *       protocol and no runtime. With `spin`, both sides receive in a
 *       MSG_DONTWAIT loop instead of sleeping in recv(), as ferry's TCP
 *       busy-polling does (FERRY_TCP_BUSY_POLL_US, on by default): the
 *       wake-up a sleeping receiver pays is then not in the round trip.
 *
 * iperf3 sends one cache-hot buffer and sockperf's ping-pong takes its own
 * paths; they stay beside these as context. Built with cc -O2 by the
 * scripts that run it. Loopback (127.0.0.1) only.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static void die(const char *what) {
    perror(what);
    exit(1);
}

/* A listening socket on 127.0.0.1, any port; the port in *port. */
static int listener(uint16_t *port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) || listen(fd, 64) ||
        getsockname(fd, (struct sockaddr *)&a, &len))
        die("listen");
    *port = ntohs(a.sin_port);
    return fd;
}

static int dial(uint16_t port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a)) die("connect");
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
}

/* A share of `len` bytes, touched so that no page fault is measured. */
static char *share(size_t len) {
    char *p = mmap(0, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) die("mmap");
    memset(p, 0x5a, len);
    return p;
}

static int bw(unsigned pairs, size_t block, size_t size, double seconds) {
    size_t part = size / pairs;
    if (block > part) block = part;
    uint16_t port;
    int lfd = listener(&port);
    /* Each receiver writes its byte count, then its end time, here. */
    int results[2], go[2], ready[2];
    if (pipe(results) || pipe(go) || pipe(ready)) die("pipe");
    for (unsigned i = 0; i < 2 * pairs; i++) {
        pid_t pid = fork();
        if (pid < 0) die("fork");
        if (pid) continue;
        char *buf = share(part);
        char start;
        if (i % 2 == 0) { /* a receiver: takes one connection, reads to EOF */
            int fd = accept(lfd, 0, 0);
            if (fd < 0) die("accept");
            uint64_t got = 0;
            size_t at = 0;
            for (;;) {
                size_t want = block - at % block;
                if (want > part - at) want = part - at;
                ssize_t n = recv(fd, buf + at, want, 0);
                if (n <= 0) break;
                got += n;
                at = (at + n) % part;
            }
            /* One write: the receivers' results must not interleave. */
            struct { uint64_t got; double end; } result = {got, now()};
            if (write(results[1], &result, sizeof result) != sizeof result) die("write");
            _exit(0);
        }
        int fd = dial(port); /* a sender: connected, waits for the start, sweeps */
        if (write(ready[1], "r", 1) != 1 || read(go[0], &start, 1) != 1) die("start");
        double until = now() + seconds;
        size_t at = 0;
        while (now() < until) {
            size_t off = 0;
            while (off < block) {
                ssize_t n = send(fd, buf + at + off, block - off, 0);
                if (n <= 0) die("send");
                off += n;
            }
            at = (at + block) % (part - part % block);
        }
        close(fd);
        _exit(0);
    }
    close(lfd);
    /* Every sender is connected: start them at once. */
    for (unsigned i = 0; i < pairs; i++) {
        char r;
        if (read(ready[0], &r, 1) != 1) die("read ready");
    }
    double started = now();
    char starts[256];
    memset(starts, 1, sizeof starts);
    if (write(go[1], starts, (size_t)pairs) != (ssize_t)pairs) die("write");
    uint64_t total = 0;
    double last = started;
    for (unsigned i = 0; i < pairs; i++) {
        struct { uint64_t got; double end; } result;
        if (read(results[0], &result, sizeof result) != sizeof result) die("read results");
        total += result.got;
        if (result.end > last) last = result.end;
    }
    while (wait(0) > 0) {
    }
    printf("%.3f\n", total / (last - started) / 1e9);
    return 0;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Receives spinning (MSG_DONTWAIT in a loop) instead of sleeping. */
static int spin;

static void exactly(int fd, char *buf, size_t len, int sending) {
    size_t off = 0;
    while (off < len) {
        ssize_t n = sending ? send(fd, buf + off, len - off, 0)
                            : recv(fd, buf + off, len - off, spin ? MSG_DONTWAIT : 0);
        if (n < 0 && !sending && spin && errno == EAGAIN) continue;
        if (n <= 0) {
            if (!sending && n == 0) _exit(0);
            die(sending ? "send" : "recv");
        }
        off += n;
    }
}

static int pingpong(size_t len, double seconds) {
    uint16_t port;
    int lfd = listener(&port);
    pid_t pid = fork();
    if (pid < 0) die("fork");
    char *buf = share(len > 0 ? len : 1);
    if (pid == 0) { /* the answering side: echoes until EOF */
        int fd = accept(lfd, 0, 0), one = 1;
        if (fd < 0) die("accept");
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        for (;;) {
            exactly(fd, buf, len, 0);
            exactly(fd, buf, len, 1);
        }
    }
    close(lfd);
    int fd = dial(port);
    size_t cap = 1 << 22, n = 0;
    double *rtt = malloc(cap * sizeof *rtt), until = now() + seconds;
    while (n < cap && now() < until) {
        double t = now();
        exactly(fd, buf, len, 1);
        exactly(fd, buf, len, 0);
        rtt[n++] = now() - t;
    }
    close(fd);
    waitpid(pid, 0, 0);
    qsort(rtt, n, sizeof *rtt, cmp);
    printf("%.2f\n", rtt[n / 2] * 1e6);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 6 && strcmp(argv[1], "bw") == 0) {
        int pairs = atoi(argv[2]);
        if (pairs < 1 || pairs > 256) return 2;
        return bw(pairs, strtoull(argv[3], 0, 10), strtoull(argv[4], 0, 10), atof(argv[5]));
    }
    if ((argc == 4 || argc == 5) && strcmp(argv[1], "pingpong") == 0) {
        spin = argc == 5 && strcmp(argv[4], "spin") == 0;
        return pingpong(strtoull(argv[2], 0, 10), atof(argv[3]));
    }
    fprintf(stderr, "usage: tcp-mover bw PAIRS BLOCK SIZE SECONDS | pingpong LEN SECONDS [spin]\n");
    return 2;
}
