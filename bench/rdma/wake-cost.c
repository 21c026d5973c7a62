// bench/rdma/wake-cost.c: what a sleep in epoll and a wake-up by an eventfd cost, against
// spinning with sched_yield, thread to thread (docs/rnic.md, "Process model": the spin's break-even).
//   gcc -O2 -o /tmp/wake-cost bench/rdma/wake-cost.c -lpthread && /tmp/wake-cost
// Prints the round trip and the CPU per wake-up (both threads, the eventfd writes included).
#include <stdio.h>
#include <stdint.h>
#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>
static int efd[2]; static int N = 20000;
static double now(void){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
static double cpu(void){struct timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t); return t.tv_sec+t.tv_nsec*1e-9;}
static double peer_cpu;
static void pingpong(int me, int spin) {
  int ep = epoll_create1(0); struct epoll_event ev = {.events=EPOLLIN}; epoll_ctl(ep, EPOLL_CTL_ADD, efd[me], &ev);
  uint64_t v = 1;
  for (int i = 0; i < N; i++) {
    if (me == 0) write(efd[1], &v, 8);
    struct epoll_event out;
    if (spin) { while (read(efd[me], &v, 8) != 8) sched_yield(); }
    else { epoll_wait(ep, &out, 1, -1); read(efd[me], &v, 8); }
    if (me == 1) write(efd[0], &v, 8);
  }
}
static int SPIN;
static void *peer(void *a){ double c = cpu(); pingpong(1, SPIN); peer_cpu = cpu() - c; return 0; }
int main(int argc, char **argv) {
  for (SPIN = 0; SPIN < 2; SPIN++) {
    efd[0] = eventfd(0, EFD_NONBLOCK); efd[1] = eventfd(0, EFD_NONBLOCK);
    pthread_t t; double t0 = now(), c0 = cpu();
    pthread_create(&t, 0, peer, 0); pingpong(0, SPIN); pthread_join(t, 0);
    double wall = now() - t0, c = cpu() - c0;
    printf("%s: round trip %.1f us, CPU per wake-up %.1f us (both threads, incl. the write)\n", SPIN ? "spin (sched_yield)" : "sleep in epoll", wall / N * 1e6, (c + peer_cpu) / (2.0 * N) * 1e6);
    close(efd[0]); close(efd[1]);
  }
}
