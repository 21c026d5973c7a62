// SPDX-License-Identifier: GPL-2.0-or-later
/*
 * Memory windows through the drop-in, from the C side, on RC QPs of one
 * process on one rnicd (loopback): type 1 windows bound by ibv_bind_mw and
 * unbound by a zero-length bind; type 2 windows bound by an IBV_WR_BIND_MW
 * WR and ended by LOCAL_INV, by the peer's SEND with invalidate and by
 * ibv_dealloc_mw; each bind gives a new rkey and the old one stops working;
 * two binds of one window in one post_send chain and in one ibv_wr_*
 * batch, the second renaming the key the first gave it; the errors of bad
 * calls (unknown type, a new rkey of another family, a bind_mw on a type 2
 * window, a PD still holding a window) and a bind to an MR without
 * MW_BIND, which completes with IBV_WC_MW_BIND_ERR as in rxe. Prints
 * "ok NAME" per check, "FAIL NAME: why" and exits 1 at the first failure.
 */
#include "check.h"

/* A QP whose WRs may also be built by the ibv_wr_* calls. */
static struct ibv_qp *make_qp_ex(void)
{
	struct ibv_qp_init_attr_ex a = {
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC, .pd = pd,
		.cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1 },
		.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
		.send_ops_flags = IBV_QP_EX_WITH_BIND_MW | IBV_QP_EX_WITH_RDMA_WRITE,
	};
	struct ibv_qp *qp = ibv_create_qp_ex(ctx, &a);
	CHECK("create_qp_ex", qp && ibv_qp_to_qp_ex(qp), "errno %d", errno);
	return qp;
}

static char buf[1 << 16];
static struct ibv_mr *mr, *wmr;

/* A fresh connected pair: a writes, b owns the windows. */
static void fresh(struct ibv_qp **a, struct ibv_qp **b)
{
	*a = loopback_qp(16, 1, NULL);
	*b = loopback_qp(16, 1, NULL);
	loopback_pair(*a, *b, LOOPBACK_ACCESS, 4);
}

/* a writes 64 bytes to b's window memory (wmr) with `rkey`; the status. */
static int write_with(struct ibv_qp *a, uint32_t rkey, char fill)
{
	memset(buf, fill, 64);
	post(a, IBV_WR_RDMA_WRITE, (uintptr_t)buf, 64, mr->lkey, (uintptr_t)(buf + 32768), rkey);
	return next_wc("write").status;
}

static uint32_t bind2(struct ibv_qp *b, struct ibv_mw *mw, unsigned int access)
{
	uint32_t new_key = ibv_inc_rkey(mw->rkey);
	struct ibv_send_wr wr = { .wr_id = 5, .opcode = IBV_WR_BIND_MW, .send_flags = IBV_SEND_SIGNALED }, *bad;
	wr.bind_mw.mw = mw;
	wr.bind_mw.rkey = new_key;
	wr.bind_mw.bind_info = (struct ibv_mw_bind_info){ .mr = wmr, .addr = (uintptr_t)(buf + 32768), .length = 4096,
							   .mw_access_flags = access };
	CHECK("bind type 2", ibv_post_send(b, &wr, &bad) == 0, "post");
	struct ibv_wc wc = wait_ok("bind type 2");
	CHECK("bind type 2", wc.opcode == IBV_WC_BIND_MW && mw->rkey == new_key, "opcode %d rkey %x", wc.opcode, mw->rkey);
	return new_key;
}

int main(void)
{
	setvbuf(stdout, NULL, _IONBF, 0);
	open_device();
	pd = ibv_alloc_pd(ctx);
	cq = ibv_create_cq(ctx, 256, NULL, NULL, 0);
	mr = ibv_reg_mr(pd, buf, 32768, IBV_ACCESS_LOCAL_WRITE);
	/* The windows' MR grants no remote access itself. */
	wmr = ibv_reg_mr(pd, buf + 32768, 32768, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND);
	CHECK("objects", pd && cq && mr && wmr, "errno %d", errno);
	struct ibv_device_attr da;
	CHECK("query_device", ibv_query_device(ctx, &da) == 0 && (da.device_cap_flags & IBV_DEVICE_MEM_WINDOW),
	      "no IBV_DEVICE_MEM_WINDOW");

	/* Refusals. */
	CHECK("alloc_mw type 3", !ibv_alloc_mw(pd, 3) && errno == EINVAL, "errno %d", errno);
	struct ibv_mw *w1 = ibv_alloc_mw(pd, IBV_MW_TYPE_1), *w2 = ibv_alloc_mw(pd, IBV_MW_TYPE_2);
	CHECK("alloc_mw", w1 && w2 && w1->type == IBV_MW_TYPE_1 && w1->pd == pd && w1->rkey != w2->rkey, "errno %d", errno);
	CHECK("dealloc_pd with windows", ibv_dealloc_pd(pd) == EBUSY, "not EBUSY");
	struct ibv_qp *a, *b;
	fresh(&a, &b);
	struct ibv_mw_bind mb = { .wr_id = 1, .send_flags = IBV_SEND_SIGNALED,
				  .bind_info = { .mr = mr, .addr = (uintptr_t)buf, .length = 4096,
						 .mw_access_flags = IBV_ACCESS_REMOTE_WRITE } };
	CHECK("bind_mw on a type 2 window", ibv_bind_mw(b, w2, &mb) == EINVAL, "not EINVAL");
	struct ibv_send_wr wr = { .opcode = IBV_WR_BIND_MW }, *bad;
	wr.bind_mw.mw = w2;
	wr.bind_mw.rkey = w2->rkey + 0x100;
	wr.bind_mw.bind_info = (struct ibv_mw_bind_info){ .mr = wmr, .addr = (uintptr_t)(buf + 32768), .length = 64 };
	CHECK("new rkey of another family", ibv_post_send(b, &wr, &bad) == EINVAL && bad == &wr, "not EINVAL");
	/* An MR without MW_BIND: posted, then failed in its completion as in
	 * rxe (IBV_WC_MW_BIND_ERR), which moves the QP to the error state;
	 * the window keeps its new rkey, bound to nothing. */
	uint32_t old = w1->rkey;
	CHECK("bind_mw MR without MW_BIND", ibv_bind_mw(b, w1, &mb) == 0 && w1->rkey == ibv_inc_rkey(old), "post");
	struct ibv_wc wc = next_wc("bind_mw MR without MW_BIND");
	CHECK("bind_mw MR without MW_BIND", wc.status == IBV_WC_MW_BIND_ERR && wc.opcode == IBV_WC_BIND_MW && wc.wr_id == 1,
	      "status %d (%s) opcode %d", wc.status, ibv_wc_status_str(wc.status), wc.opcode);
	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr qia;
	CHECK("QP in error after MW_BIND_ERR", !ibv_query_qp(b, &qa, IBV_QP_STATE, &qia) && qa.qp_state == IBV_QPS_ERR,
	      "state %d", qa.qp_state);
	OK("refusals");

	/* Type 1: bound by ibv_bind_mw with a new rkey; the peer writes through it. */
	fresh(&a, &b);
	old = w1->rkey;
	mb.bind_info = (struct ibv_mw_bind_info){ .mr = wmr, .addr = (uintptr_t)(buf + 32768), .length = 4096,
						  .mw_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE };
	CHECK("bind_mw", ibv_bind_mw(b, w1, &mb) == 0 && w1->rkey == ibv_inc_rkey(old), "rkey %x", w1->rkey);
	wc = wait_ok("bind_mw");
	CHECK("bind_mw", wc.opcode == IBV_WC_BIND_MW && wc.wr_id == 1, "opcode %d", wc.opcode);
	CHECK("write through type 1", write_with(a, w1->rkey, 'x') == IBV_WC_SUCCESS && buf[32768 + 63] == 'x',
	      "not written");
	/* Unbound by a zero-length bind: the next write is refused. */
	mb.bind_info = (struct ibv_mw_bind_info){ .mr = wmr };
	CHECK("zero-length bind", ibv_bind_mw(b, w1, &mb) == 0, "bind");
	wait_ok("zero-length bind");
	CHECK("write after unbind", write_with(a, w1->rkey, 'y') == IBV_WC_REM_ACCESS_ERR && buf[32768] == 'x',
	      "not refused");
	OK("type 1 window");

	/* Type 2: bound by a WR; the old rkey is refused, the new one writes. */
	fresh(&a, &b);
	old = w2->rkey;
	uint32_t k = bind2(b, w2, IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE);
	CHECK("write through type 2", write_with(a, k, 'p') == IBV_WC_SUCCESS && buf[32768] == 'p', "not written");
	CHECK("write with the old rkey", write_with(a, old, 'q') == IBV_WC_REM_ACCESS_ERR && buf[32768] == 'p',
	      "not refused");
	/* Two binds of the window in one chain: the second renames the key the
	 * first gives it (as mlx5, which names a window by its index); the
	 * last key writes, the ones before are refused. */
	fresh(&a, &b);
	old = w2->rkey;
	uint32_t k1 = ibv_inc_rkey(old), k2 = ibv_inc_rkey(k1);
	struct ibv_send_wr chain[2];
	for (int i = 0; i < 2; i++) {
		chain[i] = (struct ibv_send_wr){ .wr_id = 20 + i, .opcode = IBV_WR_BIND_MW,
						 .send_flags = IBV_SEND_SIGNALED, .next = i ? NULL : &chain[1] };
		chain[i].bind_mw.mw = w2;
		chain[i].bind_mw.rkey = i ? k2 : k1;
		chain[i].bind_mw.bind_info = (struct ibv_mw_bind_info){ .mr = wmr, .addr = (uintptr_t)(buf + 32768),
									 .length = 4096,
									 .mw_access_flags = IBV_ACCESS_REMOTE_WRITE |
											    IBV_ACCESS_LOCAL_WRITE };
	}
	CHECK("two binds in a chain", ibv_post_send(b, chain, &bad) == 0 && w2->rkey == k2, "post, rkey %x", w2->rkey);
	for (int i = 0; i < 2; i++) {
		wc = wait_ok("two binds in a chain");
		CHECK("two binds in a chain", wc.opcode == IBV_WC_BIND_MW && wc.wr_id == 20u + i, "wr_id %lu",
		      (unsigned long)wc.wr_id);
	}
	CHECK("chain: write with the last rkey", write_with(a, k2, 'c') == IBV_WC_SUCCESS && buf[32768] == 'c',
	      "not written");
	CHECK("chain: write with the first rkey", write_with(a, k1, 'd') == IBV_WC_REM_ACCESS_ERR && buf[32768] == 'c',
	      "not refused");
	/* The same in one ibv_wr_* batch, on a QP made for the builders. */
	a = loopback_qp(16, 1, NULL);
	b = make_qp_ex();
	loopback_pair(a, b, LOOPBACK_ACCESS, 4);
	struct ibv_qp_ex *bx = ibv_qp_to_qp_ex(b);
	k1 = ibv_inc_rkey(w2->rkey);
	k2 = ibv_inc_rkey(k1);
	struct ibv_mw_bind_info bi = { .mr = wmr, .addr = (uintptr_t)(buf + 32768), .length = 4096,
				       .mw_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE };
	ibv_wr_start(bx);
	bx->wr_id = 30;
	bx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_bind_mw(bx, w2, k1, &bi);
	bx->wr_id = 31;
	ibv_wr_bind_mw(bx, w2, k2, &bi);
	CHECK("two binds in a batch", ibv_wr_complete(bx) == 0 && w2->rkey == k2, "complete, rkey %x", w2->rkey);
	for (int i = 0; i < 2; i++) {
		wc = wait_ok("two binds in a batch");
		CHECK("two binds in a batch", wc.opcode == IBV_WC_BIND_MW && wc.wr_id == 30u + i, "wr_id %lu",
		      (unsigned long)wc.wr_id);
	}
	CHECK("batch: write with the last rkey", write_with(a, k2, 'e') == IBV_WC_SUCCESS && buf[32768] == 'e',
	      "not written");
	OK("two binds of one window in one post");

	/* LOCAL_INV ends it. */
	fresh(&a, &b);
	k = bind2(b, w2, IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE);
	struct ibv_send_wr inv = { .wr_id = 6, .opcode = IBV_WR_LOCAL_INV, .send_flags = IBV_SEND_SIGNALED };
	inv.invalidate_rkey = k;
	CHECK("local_inv", ibv_post_send(b, &inv, &bad) == 0, "post");
	wc = wait_ok("local_inv");
	CHECK("local_inv", wc.opcode == IBV_WC_LOCAL_INV, "opcode %d", wc.opcode);
	CHECK("write after local_inv", write_with(a, k, 'r') == IBV_WC_REM_ACCESS_ERR, "not refused");
	/* The peer's SEND with invalidate ends it. */
	fresh(&a, &b);
	k = bind2(b, w2, IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE);
	struct ibv_sge rs = { .addr = (uintptr_t)(buf + 16384), .length = 64, .lkey = mr->lkey };
	struct ibv_recv_wr rw = { .wr_id = 7, .sg_list = &rs, .num_sge = 1 }, *rbad;
	CHECK("post_recv", ibv_post_recv(b, &rw, &rbad) == 0, "post_recv");
	struct ibv_send_wr si = { .wr_id = 8, .opcode = IBV_WR_SEND_WITH_INV, .send_flags = IBV_SEND_SIGNALED };
	si.invalidate_rkey = k;
	CHECK("send_with_inv", ibv_post_send(a, &si, &bad) == 0, "post");
	wait_ok("send_with_inv");
	wait_ok("send_with_inv");
	CHECK("write after send_with_inv", write_with(a, k, 's') == IBV_WC_REM_ACCESS_ERR, "not refused");
	/* ibv_dealloc_mw ends it. */
	fresh(&a, &b);
	k = bind2(b, w2, IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE);
	CHECK("write before dealloc", write_with(a, k, 't') == IBV_WC_SUCCESS, "not written");
	CHECK("dealloc_mw", ibv_dealloc_mw(w2) == 0 && ibv_dealloc_mw(w1) == 0, "dealloc");
	CHECK("write after dealloc", write_with(a, k, 'u') == IBV_WC_REM_ACCESS_ERR && buf[32768] == 't',
	      "not refused");
	OK("type 2 window");

	CHECK("teardown", !ibv_dereg_mr(mr) && !ibv_dereg_mr(wmr), "dereg");
	printf("all ok\n");
	return 0;
}
