/* A sandbox with a large heap for bench/mount-gvisor.sh: what a restore has to bring back
 * is mostly memory, none of it zero and none of it repeated.
 *
 *   heap_counter PROGRESS MIB
 *
 * It fills MIB MiB of heap with a xorshift64* stream from a seed known only at run time
 * (time and pid), so no two pages are alike and `runsc checkpoint
 * --exclude-committed-zero-pages` keeps every one. It then records a checksum of each of
 * 256 slices of the heap (one 8-byte word of every 4 KiB page; slice k holds the pages p
 * with p % 256 == k) and every 100 ms increments a counter, checks one slice (count % 256)
 * against its record, and appends "count=<n> seed=<seed> check=ok|bad pid=<pid>" to
 * PROGRESS (opened, appended, closed each tick, so no descriptor has to survive a restore).
 * A restored copy must go on counting from where it was with the same seed and check=ok;
 * a fresh start would begin at count=1 with another seed. A tick reads 1/256 of the heap's
 * pages, not all of them: the time until the counter continues after a restore is the
 * restore's, not a pass over a gigabyte.
 *
 * Build: gcc -O2 -static -o heap_counter heap_counter.c
 */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define SLICES 256u
#define PAGE 4096u

static uint64_t slice_sum(const unsigned char *heap, size_t pages, size_t k) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t p = k; p < pages; p += SLICES) {
        uint64_t w;
        __builtin_memcpy(&w, heap + p * PAGE, 8);
        h = (h ^ w) * 0x100000001b3ull;
    }
    return h;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: heap_counter PROGRESS MIB\n");
        return 2;
    }
    const char *out = argv[1];
    size_t mib = strtoull(argv[2], NULL, 10);
    size_t bytes = mib << 20, pages = bytes / PAGE;
    if (mib == 0) return 2;
    unsigned char *heap = malloc(bytes);
    if (!heap) return 2;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    uint64_t x = (uint64_t)now.tv_nsec ^ ((uint64_t)now.tv_sec << 20) ^ ((uint64_t)getpid() << 40);
    x |= 1;
    uint64_t seed = x;
    for (size_t i = 0; i < bytes; i += 8) {
        x ^= x >> 12; x ^= x << 25; x ^= x >> 27;
        uint64_t v = x * 0x2545F4914F6CDD1Dull;
        __builtin_memcpy(heap + i, &v, 8);
    }
    static uint64_t sums[SLICES];
    for (size_t k = 0; k < SLICES; k++) sums[k] = slice_sum(heap, pages, k);
    for (uint64_t count = 1;; count++) {
        size_t k = count % SLICES;
        const char *check = slice_sum(heap, pages, k) == sums[k] ? "ok" : "bad";
        char line[160];
        int n = snprintf(line, sizeof line, "count=%llu seed=%016llx check=%s pid=%d\n",
                         (unsigned long long)count, (unsigned long long)seed, check, (int)getpid());
        int fd = open(out, O_WRONLY | O_APPEND | O_CREAT, 0644);
        if (fd >= 0) {
            if (write(fd, line, (size_t)n) != n) { /* best effort: the next tick tries again */ }
            close(fd);
        }
        struct timespec d = {0, 100 * 1000 * 1000};
        nanosleep(&d, NULL);
    }
}
