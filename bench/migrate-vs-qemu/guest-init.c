/*
 * /init of the Linux guest that bench/migrate-vs-qemu boots under QEMU.
 *
 * It runs the same workloads as Transit's guest firmware (crates/guest), so
 * that both systems migrate the same memory behaviour:
 *   wl=dirtier [rate_mbps=N]  increment the first byte of every 4 KiB page of
 *                             a buffer covering most of RAM, endlessly; N MiB/s
 *                             of dirtied pages at most when N > 0
 *   wl=idle                   fill the buffer with realistic, non-zero, partly
 *                             compressible content, then sleep
 * The buffer size defaults to MemAvailable minus a reserve (buf_mib=N sets it).
 * "BENCH-READY" on the console says the workload covers the whole buffer.
 * Built statically with gcc; reads its arguments from /proc/cmdline.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define PAGE 4096UL
/* Kept free for the kernel and page cache so the guest never OOMs. */
#define RESERVE_MIB 64UL

static char cmdline[4096];

/* Value of key=... on the kernel command line (a fresh copy), or dflt. */
static const char *arg(const char *key, const char *dflt)
{
    size_t n = strlen(key);
    for (char *p = cmdline; (p = strstr(p, key)) != NULL; p += n) {
        if ((p == cmdline || p[-1] == ' ') && p[n] == '=') {
            char *val = calloc(1, 128);
            size_t i = 0;
            if (!val)
                return dflt;
            for (const char *v = p + n + 1; *v && *v != ' ' && *v != '\n' && i < 127; v++)
                val[i++] = *v;
            val[i] = 0;
            return val;
        }
    }
    return dflt;
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static uint64_t mem_available_bytes(void)
{
    FILE *f = fopen("/proc/meminfo", "r");
    char line[256];
    uint64_t kib = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %lu kB", &kib) == 1)
            break;
    if (f)
        fclose(f);
    return kib * 1024;
}

static void setup_console(void)
{
    mkdir("/proc", 0755);
    mkdir("/dev", 0755);
    mount("proc", "/proc", "proc", 0, NULL);
    mount("devtmpfs", "/dev", "devtmpfs", 0, NULL);
    int fd = open("/dev/ttyS0", O_WRONLY | O_NOCTTY);
    if (fd < 0)
        fd = open("/dev/console", O_WRONLY | O_NOCTTY);
    if (fd >= 0) {
        dup2(fd, 1);
        dup2(fd, 2);
    }
    setvbuf(stdout, NULL, _IONBF, 0);
}

/* Same pattern as crates/guest/src/fill.rs: alternating runs of text-like
 * words and pseudo-random words, so about half of each page compresses. */
static void fill(uint8_t *buf, size_t len)
{
    static const char words[] = "the quick brown fox jumps over the lazy dog; migration moves memory pages ";
    const size_t wlen = sizeof words - 1;
    uint64_t x = 0x9E3779B97F4A7C15ULL;
    for (size_t page = 0; page < len / PAGE; page++) {
        uint64_t *p = (uint64_t *)(buf + page * PAGE);
        for (uint64_t i = 0; i < 512; i++) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            uint64_t v;
            if ((page + i / 64) % 2 == 0) {
                size_t o = (size_t)((i * 8 + page) % (wlen - 8));
                memcpy(&v, words + o, 8);
            } else {
                v = x | 1;
            }
            p[i] = v;
        }
    }
}

static void dirty_forever(volatile uint8_t *buf, size_t len, uint64_t rate_mib)
{
    const uint64_t pages_per_s = rate_mib * (1024 * 1024 / PAGE);
    uint64_t t0 = now_ns();
    uint64_t done = 0, passes = 0;
    for (;;) {
        for (size_t off = 0; off < len; off += PAGE) {
            buf[off]++;
            done++;
            /* Throttle from the second pass on (the first only fills RAM, as
             * Transit's dirtier): never ahead of rate * elapsed; checked
             * every 64 pages. */
            if (pages_per_s && passes && done % 64 == 0)
                while ((unsigned __int128)(now_ns() - t0) * pages_per_s / 1000000000ULL < done)
                    ;
        }
        if (++passes == 1) {
            t0 = now_ns();
            done = 0;
            printf("BENCH-READY wl=dirtier buf_mib=%zu rate_mib=%lu\n", len >> 20, rate_mib);
        }
    }
}

int main(void)
{
    setup_console();
    int fd = open("/proc/cmdline", O_RDONLY);
    if (fd >= 0) {
        ssize_t n = read(fd, cmdline, sizeof cmdline - 1);
        cmdline[n > 0 ? n : 0] = 0;
        close(fd);
    }
    const char *wl = arg("wl", "idle");
    uint64_t rate_mib = strtoull(arg("rate_mbps", "0"), NULL, 10);
    uint64_t want = strtoull(arg("buf_mib", "0"), NULL, 10) << 20;
    uint64_t avail = mem_available_bytes();
    uint64_t len = want ? want : (avail > (RESERVE_MIB << 20) * 2 ? avail - (RESERVE_MIB << 20) : avail / 2);
    len &= ~(PAGE - 1);
    printf("bench-init: wl=%s mem_available_mib=%lu buf_mib=%lu\n", wl, avail >> 20, len >> 20);

    uint8_t *buf = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (buf == MAP_FAILED) {
        printf("bench-init: mmap of %lu MiB failed: %s\n", len >> 20, strerror(errno));
        for (;;)
            pause();
    }
    if (mlock(buf, len) != 0)
        printf("bench-init: mlock failed (%s); continuing\n", strerror(errno));

    if (strcmp(wl, "dirtier") == 0)
        dirty_forever(buf, len, rate_mib);
    fill(buf, len);
    printf("BENCH-READY wl=idle buf_mib=%lu\n", len >> 20);
    for (;;)
        pause();
}
