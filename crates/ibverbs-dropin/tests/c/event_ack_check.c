// SPDX-License-Identifier: GPL-2.0-or-later
/*
 * Destroying an object waits for its events to be acknowledged, as in
 * libibverbs: an event thread gets an event (a CQ's completion event, a
 * QP's IBV_EVENT_QP_FATAL or QP_ACCESS_ERR, an SRQ's limit event), sleeps
 * 200 ms and acks it, while the main thread destroys the object the event
 * names; the destroy must return only after the ack (which writes into
 * the object). Prints "ok NAME" per check, "FAIL NAME: why" and exits 1
 * at the first failure.
 */
#include "check.h"
#include <poll.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>

static char buf[1 << 16];
static struct ibv_mr *mr;

/* What the event thread got and when it acked. */
struct waiter {
	struct ibv_comp_channel *ch; /* a CQ event from here, else an async event */
	struct ibv_cq *cq;
	void *cq_context;
	struct ibv_async_event ev;
	int got, acked, failed;
};

static void *event_thread(void *p)
{
	struct waiter *w = p;
	int r;
	if (w->ch) {
		r = ibv_get_cq_event(w->ch, &w->cq, &w->cq_context);
	} else {
		struct pollfd pf = { .fd = ctx->async_fd, .events = POLLIN };
		r = poll(&pf, 1, 5000) == 1 ? ibv_get_async_event(ctx, &w->ev) : -1;
	}
	if (r) {
		__atomic_store_n(&w->failed, 1, __ATOMIC_SEQ_CST);
		return NULL;
	}
	__atomic_store_n(&w->got, 1, __ATOMIC_SEQ_CST);
	usleep(200000);
	__atomic_store_n(&w->acked, 1, __ATOMIC_SEQ_CST);
	if (w->ch)
		ibv_ack_cq_events(w->cq, 1);
	else
		ibv_ack_async_event(&w->ev);
	return NULL;
}

/* Starts the event thread and waits (at most 5 s) until it holds its event. */
static void start(const char *what, pthread_t *t, struct waiter *w)
{
	CHECK(what, pthread_create(t, NULL, event_thread, w) == 0, "pthread_create");
	for (int i = 0; i < 5000 && !__atomic_load_n(&w->got, __ATOMIC_SEQ_CST); i++) {
		CHECK(what, !__atomic_load_n(&w->failed, __ATOMIC_SEQ_CST), "no event (errno %d)", errno);
		usleep(1000);
	}
	CHECK(what, __atomic_load_n(&w->got, __ATOMIC_SEQ_CST), "no event");
}

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

/* The destroy `r` (begun at `t0`) returned 0 after the thread's ack. */
static void returned_after_ack(const char *what, int r, double t0, pthread_t t, struct waiter *w)
{
	int acked = __atomic_load_n(&w->acked, __ATOMIC_SEQ_CST);
	double waited = now() - t0;
	CHECK(what, r == 0, "destroy returned %d", r);
	CHECK(what, acked, "destroy returned after %.0f ms, before the event's ack", waited * 1e3);
	CHECK(what, pthread_join(t, NULL) == 0, "join");
}

/* A completion event: the CQ's destroy waits for ibv_ack_cq_events. */
static void cq_event(void)
{
	struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
	CHECK("cq event", ch, "errno %d", errno);
	cq = ibv_create_cq(ctx, 16, (void *)0xc0ffee, ch, 0);
	CHECK("cq event", cq, "errno %d", errno);
	struct ibv_qp *a = loopback_qp(4, 1, NULL), *b = loopback_qp(4, 1, NULL);
	loopback_pair(a, b, LOOPBACK_ACCESS, 0);
	CHECK("cq event", ibv_req_notify_cq(cq, 0) == 0, "arm");
	post(a, IBV_WR_RDMA_WRITE, (uintptr_t)buf, 64, mr->lkey, (uintptr_t)buf + 1024, mr->rkey);
	struct waiter w = { .ch = ch };
	pthread_t t;
	start("cq event", &t, &w);
	CHECK("cq event", w.cq == cq && w.cq_context == (void *)0xc0ffee, "event for %p", (void *)w.cq);
	wait_ok("cq event");
	CHECK("cq event", ibv_destroy_qp(a) == 0 && ibv_destroy_qp(b) == 0, "destroy_qp");
	double t0 = now();
	int r = ibv_destroy_cq(cq);
	returned_after_ack("destroy_cq waits for ibv_ack_cq_events", r, t0, t, &w);
	CHECK("cq event", ibv_destroy_comp_channel(ch) == 0, "destroy channel");
	OK("destroy_cq waits for ibv_ack_cq_events");
}

/* A QP moved to ERR by an RDMA READ with a bad rkey: the requester gets
 * IBV_EVENT_QP_FATAL, the responder IBV_EVENT_QP_ACCESS_ERR. The thread
 * takes the first of them; the QP it names is destroyed meanwhile, which
 * must wait for the ack; then the other event is taken and acked. */
static void qp_event(void)
{
	cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	CHECK("qp event", cq, "errno %d", errno);
	struct ibv_qp *x = loopback_qp(4, 1, NULL), *y = loopback_qp(4, 1, NULL);
	loopback_pair(x, y, LOOPBACK_ACCESS, 1);
	post(x, IBV_WR_RDMA_READ, (uintptr_t)buf, 64, mr->lkey, (uintptr_t)buf + 1024, mr->rkey ^ 0x5a5a00);
	struct ibv_wc wc = next_wc("qp event");
	CHECK("qp event", wc.status == IBV_WC_REM_ACCESS_ERR, "status %d", wc.status);
	struct waiter w = { 0 };
	pthread_t t;
	start("qp event", &t, &w);
	struct ibv_qp *named = w.ev.element.qp;
	CHECK("qp event", (w.ev.event_type == IBV_EVENT_QP_FATAL && named == x) ||
				  (w.ev.event_type == IBV_EVENT_QP_ACCESS_ERR && named == y),
	      "event %d for %p", w.ev.event_type, (void *)named);
	double t0 = now();
	int r = ibv_destroy_qp(named);
	returned_after_ack("destroy_qp waits for ibv_ack_async_event", r, t0, t, &w);
	struct ibv_qp *other = named == x ? y : x;
	struct pollfd pf = { .fd = ctx->async_fd, .events = POLLIN };
	struct ibv_async_event ev;
	CHECK("qp event", poll(&pf, 1, 5000) == 1 && ibv_get_async_event(ctx, &ev) == 0 && ev.element.qp == other,
	      "second event for %p", (void *)ev.element.qp);
	ibv_ack_async_event(&ev);
	CHECK("qp event", other->events_completed == 1, "acked %u", other->events_completed);
	CHECK("qp event", ibv_destroy_qp(other) == 0 && ibv_destroy_cq(cq) == 0, "teardown");
	OK("destroy_qp waits for ibv_ack_async_event");
}

/* An SRQ's limit event: the SRQ's destroy waits for its ack. */
static void srq_event(void)
{
	cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	struct ibv_srq_init_attr ia = { .attr = { .max_wr = 4, .max_sge = 1 } };
	struct ibv_srq *srq = ibv_create_srq(pd, &ia);
	CHECK("srq event", cq && srq, "errno %d", errno);
	struct ibv_qp *a = loopback_qp(4, 1, NULL), *b = loopback_qp(4, 1, srq);
	loopback_pair(a, b, IBV_ACCESS_LOCAL_WRITE, 0);
	struct ibv_sge rs = { .addr = (uintptr_t)buf + 4096, .length = 64, .lkey = mr->lkey };
	struct ibv_recv_wr rw = { .wr_id = 1, .sg_list = &rs, .num_sge = 1 }, *rbad;
	for (int i = 0; i < 2; i++)
		CHECK("srq event", ibv_post_srq_recv(srq, &rw, &rbad) == 0, "post_srq_recv");
	struct ibv_srq_attr sa = { .srq_limit = 2 };
	CHECK("srq event", ibv_modify_srq(srq, &sa, IBV_SRQ_LIMIT) == 0, "arm the limit");
	post(a, IBV_WR_SEND, (uintptr_t)buf, 64, mr->lkey, 0, 0);
	for (int i = 0; i < 2; i++)
		wait_ok("srq event");
	struct waiter w = { 0 };
	pthread_t t;
	start("srq event", &t, &w);
	CHECK("srq event", w.ev.event_type == IBV_EVENT_SRQ_LIMIT_REACHED && w.ev.element.srq == srq, "event %d",
	      w.ev.event_type);
	CHECK("srq event", ibv_destroy_qp(a) == 0 && ibv_destroy_qp(b) == 0, "destroy_qp");
	double t0 = now();
	int r = ibv_destroy_srq(srq);
	returned_after_ack("destroy_srq waits for ibv_ack_async_event", r, t0, t, &w);
	CHECK("srq event", ibv_destroy_cq(cq) == 0, "teardown");
	OK("destroy_srq waits for ibv_ack_async_event");
}

int main(void)
{
	setvbuf(stdout, NULL, _IONBF, 0);
	open_device();
	pd = ibv_alloc_pd(ctx);
	CHECK("alloc_pd", pd, "errno %d", errno);
	mr = ibv_reg_mr(pd, buf, sizeof(buf), LOOPBACK_ACCESS);
	CHECK("reg_mr", mr, "errno %d", errno);
	cq_event();
	qp_event();
	srq_event();
	CHECK("teardown", ibv_dereg_mr(mr) == 0 && ibv_dealloc_pd(pd) == 0 && ibv_close_device(ctx) == 0, "teardown");
	printf("all ok\n");
	return 0;
}
