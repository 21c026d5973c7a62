// SPDX-License-Identifier: GPL-2.0-or-later
/*
 * Shared receive queues through the drop-in, from the C side: two RC QPs of
 * one process on one rnicd (loopback) receive from one SRQ; the limit
 * event; ibv_query_srq/ibv_modify_srq; and the errors real drivers give
 * (bad attributes, XRC SRQs, resizing, posting to a QP that has an SRQ,
 * a full SRQ, destroying an SRQ still in use). Prints "ok NAME" per check,
 * "FAIL NAME: why" and exits 1 at the first failure.
 */
#include "check.h"
#include <poll.h>

static char buf[1 << 16];
static struct ibv_mr *mr;

static int post_srq(struct ibv_srq *srq, uint64_t id)
{
	struct ibv_sge sge = { .addr = (uintptr_t)(buf + 32768 + id % 16 * 1024), .length = 1024, .lkey = mr->lkey };
	struct ibv_recv_wr wr = { .wr_id = id, .sg_list = &sge, .num_sge = 1 }, *bad;
	return ibv_post_srq_recv(srq, &wr, &bad);
}

/* QP `from` sends message `m` (64 bytes) to its peer; both completions come. */
static void send_one(struct ibv_qp *from, uint32_t m, uint64_t *recv_id, uint32_t *recv_qpn)
{
	memset(buf + m % 16 * 64, (int)m, 64);
	struct ibv_sge sge = { .addr = (uintptr_t)(buf + m % 16 * 64), .length = 64, .lkey = mr->lkey };
	struct ibv_send_wr wr = { .wr_id = 1000 + m, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND,
				  .send_flags = IBV_SEND_SIGNALED }, *bad;
	CHECK("post_send", ibv_post_send(from, &wr, &bad) == 0, "post_send");
	for (int k = 0; k < 2; k++) {
		struct ibv_wc wc = next_wc("srq traffic");
		CHECK("srq traffic", wc.status == IBV_WC_SUCCESS, "status %d", wc.status);
		if (wc.opcode == IBV_WC_RECV) {
			CHECK("srq traffic", wc.byte_len == 64, "byte_len %u", wc.byte_len);
			char *got = buf + 32768 + wc.wr_id % 16 * 1024;
			for (int i = 0; i < 64; i++)
				CHECK("srq traffic", got[i] == (char)m, "byte %d", i);
			*recv_id = wc.wr_id;
			*recv_qpn = wc.qp_num;
		}
	}
}

int main(void)
{
	setvbuf(stdout, NULL, _IONBF, 0);
	open_device();
	pd = ibv_alloc_pd(ctx);
	cq = ibv_create_cq(ctx, 256, NULL, NULL, 0);
	mr = ibv_reg_mr(pd, buf, sizeof(buf), IBV_ACCESS_LOCAL_WRITE);
	CHECK("objects", pd && cq && mr, "errno %d", errno);
	struct ibv_device_attr da;
	CHECK("query_device", ibv_query_device(ctx, &da) == 0 && da.max_srq > 0 && da.max_srq_wr > 0 &&
				      da.max_srq_sge > 0, "max_srq %d max_srq_wr %d", da.max_srq, da.max_srq_wr);

	/* Bad attributes. */
	struct ibv_srq_init_attr ia = { .attr = { .max_wr = 0, .max_sge = 1 } };
	CHECK("create_srq max_wr 0", !ibv_create_srq(pd, &ia) && errno == EINVAL, "errno %d", errno);
	ia.attr.max_wr = da.max_srq_wr + 1;
	CHECK("create_srq too deep", !ibv_create_srq(pd, &ia) && errno == EINVAL, "errno %d", errno);
	ia.attr = (struct ibv_srq_attr){ .max_wr = 8, .max_sge = da.max_srq_sge + 1 };
	CHECK("create_srq too many SGEs", !ibv_create_srq(pd, &ia) && errno == EINVAL, "errno %d", errno);
	CHECK("create_srq NULL pd", !ibv_create_srq(NULL, &ia) && errno == EINVAL, "errno %d", errno);
	struct ibv_srq_init_attr_ex ix = { .attr = { .max_wr = 8, .max_sge = 1 },
					   .comp_mask = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD |
							IBV_SRQ_INIT_ATTR_CQ,
					   .srq_type = IBV_SRQT_XRC, .pd = pd, .cq = cq };
	CHECK("create_srq_ex XRC", !ibv_create_srq_ex(ctx, &ix) && errno == EOPNOTSUPP, "errno %d", errno);
	OK("bad attributes");

	/* One SRQ for two QPs (through ibv_create_srq_ex, basic type). */
	ix = (struct ibv_srq_init_attr_ex){ .srq_context = (void *)0x5151, .attr = { .max_wr = 8, .max_sge = 1 },
					    .comp_mask = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD,
					    .srq_type = IBV_SRQT_BASIC, .pd = pd };
	struct ibv_srq *srq = ibv_create_srq_ex(ctx, &ix);
	CHECK("create_srq_ex", srq && srq->srq_context == (void *)0x5151 && srq->pd == pd, "errno %d", errno);
	struct ibv_srq_attr sa;
	CHECK("query_srq", ibv_query_srq(srq, &sa) == 0 && sa.max_wr >= 8 && sa.max_sge >= 1 && sa.srq_limit == 0,
	      "max_wr %u", sa.max_wr);
	struct ibv_qp *a = loopback_qp(16, 1, NULL), *b = loopback_qp(16, 1, srq), *c = loopback_qp(16, 1, srq);
	struct ibv_qp *a2 = loopback_qp(16, 1, NULL);
	/* SENDs only: local write, no RDMA READ or atomic. */
	loopback_pair(a, b, IBV_ACCESS_LOCAL_WRITE, 0);
	loopback_pair(a2, c, IBV_ACCESS_LOCAL_WRITE, 0);
	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr qi;
	CHECK("query_qp srq", ibv_query_qp(b, &qa, IBV_QP_STATE, &qi) == 0 && qi.srq == srq, "srq %p", (void *)qi.srq);
	/* A QP on an SRQ has no receive queue: its receive caps read 0 (as
	 * create reports them, and rxe does). */
	memset(&qa, 0xff, sizeof(qa));
	memset(&qi, 0xff, sizeof(qi));
	CHECK("query_qp srq caps", ibv_query_qp(b, &qa, IBV_QP_CAP, &qi) == 0 && qa.cap.max_recv_wr == 0 &&
					  qa.cap.max_recv_sge == 0 && qi.cap.max_recv_wr == 0 && qi.cap.max_recv_sge == 0 &&
					  qa.cap.max_send_wr >= 16 && qi.cap.max_send_wr >= 16,
	      "recv wr %u sge %u, init %u %u", qa.cap.max_recv_wr, qa.cap.max_recv_sge, qi.cap.max_recv_wr,
	      qi.cap.max_recv_sge);
	struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = 64, .lkey = mr->lkey };
	struct ibv_recv_wr rw = { .wr_id = 1, .sg_list = &sge, .num_sge = 1 }, *bad;
	CHECK("post_recv on a QP with an SRQ", ibv_post_recv(b, &rw, &bad) == EINVAL && bad == &rw, "no EINVAL");
	OK("srq and qps");

	struct ibv_sge two[2] = { sge, sge };
	struct ibv_recv_wr rw2 = { .wr_id = 9, .sg_list = two, .num_sge = 2 };
	CHECK("post_srq_recv too many SGEs", ibv_post_srq_recv(srq, &rw2, &bad) == EINVAL && bad == &rw2, "no EINVAL");
	for (uint64_t i = 0; i < 8; i++)
		CHECK("post_srq_recv", post_srq(srq, i) == 0, "wr %lu", (unsigned long)i);
	CHECK("post_srq_recv full", post_srq(srq, 8) == ENOMEM, "no ENOMEM");
	/* Messages by either QP take the SRQ's receives in order. */
	uint64_t id;
	uint32_t qpn;
	for (uint32_t m = 0; m < 4; m++) {
		send_one(m % 2 ? a2 : a, m, &id, &qpn);
		CHECK("srq order", id == m && qpn == (m % 2 ? c : b)->qp_num, "message %u took wr %lu on %u", m,
		      (unsigned long)id, qpn);
	}
	OK("traffic over the srq");

	/* The limit: armed at 4 with 4 posted, the next message leaves fewer
	 * and fires it, once. */
	sa.srq_limit = 4;
	CHECK("modify_srq limit", ibv_modify_srq(srq, &sa, IBV_SRQ_LIMIT) == 0, "modify");
	CHECK("query_srq limit", ibv_query_srq(srq, &sa) == 0 && sa.srq_limit == 4, "limit %u", sa.srq_limit);
	sa.max_wr = 64;
	CHECK("modify_srq resize", ibv_modify_srq(srq, &sa, IBV_SRQ_MAX_WR) == EINVAL, "resize not refused");
	sa.srq_limit = 9;
	CHECK("modify_srq limit > max_wr", ibv_modify_srq(srq, &sa, IBV_SRQ_LIMIT) == EINVAL, "no EINVAL");
	send_one(a, 4, &id, &qpn);
	struct pollfd p = { .fd = ctx->async_fd, .events = POLLIN };
	CHECK("limit event", poll(&p, 1, 5000) == 1, "async fd not readable");
	struct ibv_async_event ev;
	CHECK("limit event", ibv_get_async_event(ctx, &ev) == 0 && ev.event_type == IBV_EVENT_SRQ_LIMIT_REACHED &&
				     ev.element.srq == srq, "event %d", ev.event_type);
	ibv_ack_async_event(&ev);
	CHECK("limit disarmed", ibv_query_srq(srq, &sa) == 0 && sa.srq_limit == 0, "limit %u", sa.srq_limit);
	OK("limit event");

	CHECK("destroy_srq busy", ibv_destroy_srq(srq) == EBUSY, "not EBUSY");
	CHECK("destroy qps", !ibv_destroy_qp(a) && !ibv_destroy_qp(b) && !ibv_destroy_qp(c) && !ibv_destroy_qp(a2),
	      "destroy_qp");
	CHECK("destroy_srq", ibv_destroy_srq(srq) == 0, "destroy_srq");
	CHECK("dealloc_pd in use", ibv_dereg_mr(mr) == 0 && ibv_destroy_cq(cq) == 0 && ibv_dealloc_pd(pd) == 0,
	      "teardown");
	OK("destroy");
	ibv_close_device(ctx);
	printf("all ok\n");
	return 0;
}
