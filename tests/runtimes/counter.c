/* A small stateful program for checkpoint/restore round trips (gVisor runsc, CRIU).
 *
 * It fills a heap buffer with bytes from a seed that is only known at run time (time and
 * pid), records the buffer's checksum, then every 100 ms increments a counter, checksums
 * the buffer again and appends "count=<n> sum0=<first checksum> sum=<now> pid=<pid>" to
 * the file named by argv[1] (opened, appended, closed each tick, so no descriptor has to
 * survive a restore). A restored copy must go on counting from where it was and still
 * find sum == sum0: its heap came back intact. A fresh start would begin at count=1
 * with a different sum0.
 *
 * With a second argument "fork", each tick also forks a child that checksums the heap
 * itself and exits 0 if it matches, 1 if not; the line then ends in " child=ok" or
 * " child=bad". A lazily restored parent's child sees the heap through the lazy-pages
 * server too (the pages neither process had touched yet are missing in both). While its
 * children find the heap intact the parent does not read it itself (its sum is sum0): a
 * parent that read the heap right after a restore (a dump caught mid-tick) would fault
 * it all in before the next child, which then had nothing left to fault.
 *
 * Build: gcc -O2 -static -o counter counter.c
 */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/wait.h>
#include <unistd.h>

/* The heap's size: 8 MiB unless built with -DHEAP_MIB=N (bench/fleet.sh --heap-mib). */
#ifndef HEAP_MIB
#define HEAP_MIB 8u
#endif
#define HEAP_BYTES ((HEAP_MIB) << 20)

static uint64_t fnv1a(const unsigned char *p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

int main(int argc, char **argv) {
    const char *out = argc > 1 ? argv[1] : "/out/progress";
    int forking = argc > 2 && strcmp(argv[2], "fork") == 0;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    uint64_t x = (uint64_t)now.tv_nsec ^ ((uint64_t)now.tv_sec << 20) ^ ((uint64_t)getpid() << 40);
    x |= 1;
    unsigned char *heap = malloc(HEAP_BYTES);
    if (!heap) return 2;
    for (size_t i = 0; i < HEAP_BYTES; i += 8) {
        x ^= x >> 12; x ^= x << 25; x ^= x >> 27;
        uint64_t v = x * 0x2545F4914F6CDD1Dull;
        memcpy(heap + i, &v, 8);
    }
    uint64_t sum0 = fnv1a(heap, HEAP_BYTES);
    for (uint64_t count = 1;; count++) {
        /* The child is forked before the parent reads the heap this tick: after a lazy
         * restore, the child's first look at pages neither process has touched yet. */
        const char *child = "";
        int child_ok = 0;
        if (forking) {
            pid_t c = fork();
            if (c == 0) _exit(fnv1a(heap, HEAP_BYTES) == sum0 ? 0 : 1);
            int st = 0;
            child = c < 0 ? " child=nofork" : waitpid(c, &st, 0) != c ? " child=lost"
                  : WIFEXITED(st) && WEXITSTATUS(st) == 0 ? " child=ok" : " child=bad";
            child_ok = strcmp(child, " child=ok") == 0;
        }
        uint64_t sum = child_ok ? sum0 : fnv1a(heap, HEAP_BYTES);
        char line[200];
        int n = snprintf(line, sizeof line, "count=%llu sum0=%016llx sum=%016llx pid=%d%s\n",
                         (unsigned long long)count, (unsigned long long)sum0,
                         (unsigned long long)sum, (int)getpid(), child);
        int fd = open(out, O_WRONLY | O_APPEND | O_CREAT, 0644);
        if (fd >= 0) {
            if (write(fd, line, (size_t)n) != n) { /* best effort: the next tick tries again */ }
            close(fd);
        }
        struct timespec d = {0, 100 * 1000 * 1000};
        nanosleep(&d, NULL);
    }
}
