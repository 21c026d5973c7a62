// SPDX-License-Identifier: GPL-2.0-or-later
/*
 * Two threads posting chains to one queue at once, as programs whose
 * threads share a QP (or whose helper thread reposts receives) do: every
 * failed post must name in *bad_wr exactly the first WR not posted (a
 * program reposts from there), the queue must never hold more than its
 * depth, and one chain's WRs must stay together in the queue.
 *
 * Receives (on an RC QP's receive queue, then on an SRQ): in each of many
 * rounds both threads post chains of 3 until ENOMEM, reposting from
 * *bad_wr; the queue is then full, so the WRs they count as posted must
 * be exactly its depth. The main thread then consumes them with as many
 * SENDs from a peer QP and checks the receive completions: every WR
 * counted, once, in each thread's order, each chain's posted WRs side by
 * side. Sends (a queue 16 deep, whose ring is as deep, so that a full
 * ring shows): both threads post chains of 3 RDMA WRITEs until each has
 * posted its share, reposting from *bad_wr after ENOMEM, while the main
 * thread polls; the completions, in queue order, must hold each thread's
 * WRs once each, in its order, each chain's posted WRs side by side.
 *
 * Prints "ok NAME" per check, "FAIL NAME: why" and exits 1 at the first
 * failure.
 */
#include "check.h"
#include <pthread.h>
#include <sched.h>

#define CHAIN 3
#define ROUNDS 300
#define SENDS_PER_THREAD 20000

static char buf[8192];
static struct ibv_mr *mr;
static pthread_barrier_t start, done;

/* Where the threads post: a QP's receive queue, an SRQ or a QP's send queue. */
static struct ibv_qp *recv_qp, *send_qp;
static struct ibv_srq *srq;

/* One posting thread; its WRs' ids are (id << 32 | seq), seq counting the
 * WRs it has posted. */
struct poster {
	uint64_t id;
	uint64_t seq;
	/* This round's WRs posted. */
	uint32_t round;
	/* Sequence numbers at which a post call began (its chain's first
	 * posted WR); the other posted WRs must follow their predecessor. */
	unsigned char *first;
	size_t first_len;
	/* ENOMEM failures, and those that posted part of the chain. */
	long full, partial;
	/* A failure that is not ENOMEM, or a bad_wr outside the chain. */
	int err;
	long bad_at;
};

static const char *check_name(void)
{
	return send_qp ? "concurrent post_send" : srq ? "concurrent post_srq_recv" : "concurrent post_recv";
}

/* One post call of a chain of `len` WRs (at most CHAIN), the first
 * numbered me->seq: the number of WRs it posted (as *bad_wr says), or -1
 * (me->err set). */
static int post_chain(struct poster *me, int len, int *full)
{
	struct ibv_recv_wr rw[CHAIN];
	struct ibv_send_wr sw[CHAIN];
	struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = 8, .lkey = mr->lkey };
	void *bad = NULL, *chain = send_qp ? (void *)sw : (void *)rw;
	size_t size = send_qp ? sizeof(sw[0]) : sizeof(rw[0]);
	int rc;
	for (int i = 0; i < len; i++) {
		uint64_t id = me->id << 32 | (me->seq + i);
		rw[i] = (struct ibv_recv_wr){ .wr_id = id, .next = i + 1 < len ? &rw[i + 1] : NULL };
		sw[i] = (struct ibv_send_wr){ .wr_id = id, .next = i + 1 < len ? &sw[i + 1] : NULL, .sg_list = &sge,
					      .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE, .send_flags = IBV_SEND_SIGNALED };
		sw[i].wr.rdma.remote_addr = (uintptr_t)buf + 4096;
		sw[i].wr.rdma.rkey = mr->rkey;
	}
	if (send_qp)
		rc = ibv_post_send(send_qp, sw, (struct ibv_send_wr **)&bad);
	else if (srq)
		rc = ibv_post_srq_recv(srq, rw, (struct ibv_recv_wr **)&bad);
	else
		rc = ibv_post_recv(recv_qp, rw, (struct ibv_recv_wr **)&bad);
	*full = rc == ENOMEM;
	if (rc == 0)
		return len;
	long at = ((char *)bad - (char *)chain) / (long)size;
	if (rc != ENOMEM || (char *)bad < (char *)chain || at >= len || (char *)chain + at * size != (char *)bad) {
		me->bad_at = bad ? at : -1;
		__atomic_store_n(&me->err, rc ? rc : -1, __ATOMIC_SEQ_CST);
		return -1;
	}
	return (int)at;
}

/* Posts one call's chain of `len` WRs and counts what it posted; false
 * once it failed. */
static int post_counted(struct poster *me, int len)
{
	int full, n = post_chain(me, len, &full);
	if (n < 0)
		return 0;
	if (n > 0) {
		CHECK(check_name(), me->seq < me->first_len, "too many WRs posted");
		me->first[me->seq] = 1;
	}
	me->seq += n;
	me->round += n;
	if (full) {
		me->full++;
		me->partial += n > 0;
	}
	return !full;
}

static void *recv_poster(void *p)
{
	struct poster *me = p;
	for (int r = 0; r < ROUNDS; r++) {
		pthread_barrier_wait(&start);
		me->round = 0;
		while (!me->err && post_counted(me, CHAIN))
			;
		pthread_barrier_wait(&done);
	}
	return NULL;
}

static void *send_poster(void *p)
{
	struct poster *me = p;
	while (!me->err && me->seq < SENDS_PER_THREAD)
		if (!post_counted(me, SENDS_PER_THREAD - me->seq < CHAIN ? (int)(SENDS_PER_THREAD - me->seq) : CHAIN))
			sched_yield();
	return NULL;
}

static void new_poster(struct poster *p, uint64_t id, size_t wrs)
{
	*p = (struct poster){ .id = id, .first = calloc(wrs + CHAIN, 1), .first_len = wrs + CHAIN };
	CHECK("calloc", p->first, "no memory");
}

/* A completion of WR `wr_id` (in queue order): the next WR of its thread,
 * and, unless its call's chain began there, right after its predecessor
 * in the queue. `prev` is the previous completion's wr_id (or ~0). */
static void check_order(struct poster *p, uint64_t *next, uint64_t wr_id, uint64_t prev)
{
	const char *what = check_name();
	uint64_t t = wr_id >> 32, seq = wr_id & 0xffffffff;
	CHECK(what, t < 2, "wr_id %#lx", (unsigned long)wr_id);
	CHECK(what, seq == next[t], "thread %lu: WR %lu completed, %lu expected (posted %lu)", (unsigned long)t,
	      (unsigned long)seq, (unsigned long)next[t], (unsigned long)p[t].seq);
	next[t]++;
	CHECK(what, p[t].first[seq] || prev == wr_id - 1,
	      "thread %lu: WR %lu of a chain not after WR %lu in the queue (after %#lx)", (unsigned long)t,
	      (unsigned long)seq, (unsigned long)seq - 1, (unsigned long)prev);
}

/* The depth the QP's receive or send queue really has. */
static uint32_t depth_of(struct ibv_qp *qp, int send)
{
	struct ibv_qp_attr a;
	struct ibv_qp_init_attr ia;
	CHECK("query_qp", ibv_query_qp(qp, &a, IBV_QP_CAP, &ia) == 0, "query");
	return send ? a.cap.max_send_wr : a.cap.max_recv_wr;
}

/* Receives, posted by two threads into a queue `depth` deep and consumed
 * by SENDs from `sender`. */
static void receives(uint32_t depth, struct ibv_qp *sender)
{
	const char *what = check_name();
	struct poster p[2];
	pthread_t t[2];
	new_poster(&p[0], 0, (size_t)ROUNDS * depth);
	new_poster(&p[1], 1, (size_t)ROUNDS * depth);
	CHECK(what, pthread_barrier_init(&start, NULL, 3) == 0 && pthread_barrier_init(&done, NULL, 3) == 0, "barrier");
	for (int i = 0; i < 2; i++)
		CHECK(what, pthread_create(&t[i], NULL, recv_poster, &p[i]) == 0, "pthread_create");
	uint64_t next[2] = { 0, 0 };
	struct ibv_send_wr *sends = calloc(depth, sizeof(*sends)), *bad;
	for (uint32_t i = 0; i < depth; i++)
		sends[i] = (struct ibv_send_wr){ .wr_id = ~0ull, .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED,
						 .next = i + 1 < depth ? &sends[i + 1] : NULL };
	for (int r = 0; r < ROUNDS; r++) {
		pthread_barrier_wait(&start);
		pthread_barrier_wait(&done);
		for (int i = 0; i < 2; i++)
			CHECK(what, !p[i].err, "round %d: thread %d: error %d, bad_wr at %ld", r, i, p[i].err, p[i].bad_at);
		/* Both stopped at ENOMEM: the queue is full, of what they
		 * counted as posted and nothing else. */
		CHECK(what, p[0].round + p[1].round == depth, "round %d: %u + %u WRs posted in a queue %u deep", r,
		      p[0].round, p[1].round, depth);
		CHECK(what, ibv_post_send(sender, sends, &bad) == 0, "post_send");
		uint64_t prev = ~0ull;
		for (uint32_t got = 0; got < 2 * depth;) {
			struct ibv_wc wc = wait_ok(what);
			got++;
			if (wc.opcode != IBV_WC_RECV)
				continue;
			check_order(p, next, wc.wr_id, prev);
			prev = wc.wr_id;
		}
	}
	for (int i = 0; i < 2; i++)
		CHECK(what, pthread_join(t[i], NULL) == 0 && next[i] == p[i].seq, "thread %d: %lu of %lu received", i,
		      (unsigned long)next[i], (unsigned long)p[i].seq);
	printf("%s: %u deep, %ld and %ld ENOMEMs, %ld and %ld of them after part of the chain\n", what, depth, p[0].full,
	       p[1].full, p[0].partial, p[1].partial);
	pthread_barrier_destroy(&start);
	pthread_barrier_destroy(&done);
	free(sends);
	free(p[0].first);
	free(p[1].first);
	OK(what);
}

/* Sends: two threads post RDMA WRITEs on `qp` while this one polls. */
static void sends(void)
{
	const char *what = check_name();
	struct poster p[2];
	pthread_t t[2];
	new_poster(&p[0], 0, SENDS_PER_THREAD);
	new_poster(&p[1], 1, SENDS_PER_THREAD);
	uint64_t *order = calloc(2 * SENDS_PER_THREAD, sizeof(*order));
	CHECK("calloc", order, "no memory");
	for (int i = 0; i < 2; i++)
		CHECK(what, pthread_create(&t[i], NULL, send_poster, &p[i]) == 0, "pthread_create");
	for (long got = 0; got < 2L * SENDS_PER_THREAD;) {
		for (int i = 0; i < 2; i++)
			CHECK(what, !__atomic_load_n(&p[i].err, __ATOMIC_SEQ_CST), "thread %d: error %d, bad_wr at %ld", i,
			      p[i].err, p[i].bad_at);
		struct ibv_wc wc;
		int n = ibv_poll_cq(cq, 1, &wc);
		CHECK(what, n >= 0, "poll_cq %d", n);
		if (n == 0)
			continue;
		CHECK(what, wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RDMA_WRITE, "status %d opcode %d",
		      wc.status, wc.opcode);
		order[got++] = wc.wr_id;
	}
	for (int i = 0; i < 2; i++)
		CHECK(what, pthread_join(t[i], NULL) == 0 && p[i].seq == SENDS_PER_THREAD && !p[i].err,
		      "thread %d: %lu posted, error %d", i, (unsigned long)p[i].seq, p[i].err);
	/* Completions come in queue order: each thread's WRs once each, in
	 * its order, each chain's side by side. */
	uint64_t next[2] = { 0, 0 };
	for (long i = 0; i < 2L * SENDS_PER_THREAD; i++)
		check_order(p, next, order[i], i ? order[i - 1] : ~0ull);
	struct ibv_wc wc;
	CHECK(what, ibv_poll_cq(cq, 1, &wc) == 0, "a completion more: wr_id %#lx", (unsigned long)wc.wr_id);
	printf("%s: %u deep, %ld and %ld ENOMEMs, %ld and %ld of them after part of the chain\n", what,
	       depth_of(send_qp, 1), p[0].full, p[1].full, p[0].partial, p[1].partial);
	free(order);
	free(p[0].first);
	free(p[1].first);
	OK(what);
}

int main(void)
{
	setvbuf(stdout, NULL, _IONBF, 0);
	open_device();
	pd = ibv_alloc_pd(ctx);
	cq = ibv_create_cq(ctx, 4096, NULL, NULL, 0);
	mr = ibv_reg_mr(pd, buf, sizeof(buf), LOOPBACK_ACCESS);
	CHECK("objects", pd && cq && mr, "errno %d", errno);

	/* A receive queue 100 deep (its ring holds 128): posts from two
	 * threads must not fill the ring past the queue. */
	struct ibv_qp *a = loopback_qp(100, 1, NULL), *b = loopback_qp(100, 1, NULL);
	loopback_pair(a, b, LOOPBACK_ACCESS, 0);
	recv_qp = b;
	receives(depth_of(b, 0), a);
	recv_qp = NULL;

	/* An SRQ 100 deep, consumed by SENDs to a QP on it. */
	struct ibv_srq_init_attr sa = { .attr = { .max_wr = 100, .max_sge = 1 } };
	srq = ibv_create_srq(pd, &sa);
	CHECK("create_srq", srq, "errno %d", errno);
	struct ibv_qp *c = loopback_qp(100, 1, NULL), *d = loopback_qp(100, 1, srq);
	loopback_pair(c, d, LOOPBACK_ACCESS, 0);
	receives(sa.attr.max_wr, c);
	CHECK("destroy", ibv_destroy_qp(c) == 0 && ibv_destroy_qp(d) == 0 && ibv_destroy_srq(srq) == 0, "srq");
	srq = NULL;

	/* A send queue 16 deep (its ring holds as many). */
	struct ibv_qp *e = loopback_qp(16, 1, NULL), *f = loopback_qp(16, 1, NULL);
	loopback_pair(e, f, LOOPBACK_ACCESS, 0);
	send_qp = e;
	sends();
	send_qp = NULL;

	CHECK("teardown", ibv_destroy_qp(a) == 0 && ibv_destroy_qp(b) == 0 && ibv_destroy_qp(e) == 0 &&
				  ibv_destroy_qp(f) == 0 && ibv_dereg_mr(mr) == 0 && ibv_destroy_cq(cq) == 0 &&
				  ibv_dealloc_pd(pd) == 0 && ibv_close_device(ctx) == 0,
	      "teardown");
	printf("all ok\n");
	return 0;
}
