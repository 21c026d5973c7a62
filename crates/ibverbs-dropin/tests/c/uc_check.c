// SPDX-License-Identifier: GPL-2.0-or-later
/*
 * UC QPs through the drop-in: two UC QPs of one process on one rnicd
 * (loopback) connected with UC's attributes; a SEND of several packets, a
 * SEND with immediate, an RDMA WRITE and one with immediate, through
 * ibv_post_send and through the ibv_wr_* builders, every byte checked;
 * READ, atomics and SEND with invalidate refused EINVAL at post, RC-only
 * attributes refused by ibv_modify_qp, UC's send_ops_flags.
 */
#include "check.h"

#define BUF (64 * 1024)
static char src[BUF], dst[BUF];

static struct ibv_qp *uc_qp(int extended)
{
	struct ibv_qp_init_attr_ex a = {
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_UC, .pd = pd,
		.cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 2, .max_recv_sge = 1 },
		.comp_mask = IBV_QP_INIT_ATTR_PD,
	};
	if (extended) {
		a.comp_mask |= IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
		a.send_ops_flags = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM | IBV_QP_EX_WITH_RDMA_WRITE |
				   IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM;
	}
	struct ibv_qp *qp = ibv_create_qp_ex(ctx, &a);
	CHECK("create UC QP", qp && qp->qp_type == IBV_QPT_UC && qp->state == IBV_QPS_RESET, "errno %d", errno);
	return qp;
}

static void uc_connect(struct ibv_qp *qp, uint32_t dest)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1,
				 .qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE };
	int r = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
	CHECK("UC INIT", r == 0, "%d", r);
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = IBV_MTU_1024;
	a.dest_qp_num = dest;
	a.ah_attr.is_global = 1;
	a.ah_attr.grh.dgid = gid;
	a.ah_attr.grh.hop_limit = 64;
	a.ah_attr.port_num = 1;
	/* RC's responder attributes are not UC's. */
	r = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
					  IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
	CHECK("UC RTR with RC attributes", r == EINVAL, "%d", r);
	r = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN);
	CHECK("UC RTR", r == 0, "%d", r);
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	r = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT);
	CHECK("UC RTS with a timeout", r == EINVAL, "%d", r);
	r = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN);
	CHECK("UC RTS", r == 0, "%d", r);
}

static struct ibv_wc wait_one(void)
{
	struct ibv_wc wc;
	int n, spins = 0;
	while ((n = ibv_poll_cq(cq, 1, &wc)) == 0)
		CHECK("completion in time", ++spins < 50000000, "none");
	CHECK("poll", n == 1 && wc.status == IBV_WC_SUCCESS, "n %d status %s", n, ibv_wc_status_str(wc.status));
	return wc;
}

int main(void)
{
	setvbuf(stdout, NULL, _IONBF, 0);
	open_device();
	pd = ibv_alloc_pd(ctx);
	cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
	struct ibv_mr *smr = ibv_reg_mr(pd, src, sizeof(src), access);
	struct ibv_mr *dmr = ibv_reg_mr(pd, dst, sizeof(dst), access);
	CHECK("objects", pd && cq && smr && dmr, "errno %d", errno);
	for (int i = 0; i < BUF; i++)
		src[i] = (char)(i * 7 + 3);

	/* UC's send_ops_flags: no READ or atomics. */
	struct ibv_qp_init_attr_ex bad = {
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_UC, .pd = pd, .cap = { 1, 1, 1, 1, 0 },
		.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
		.send_ops_flags = IBV_QP_EX_WITH_RDMA_READ,
	};
	CHECK("UC with READ ops", !ibv_create_qp_ex(ctx, &bad) && errno == EOPNOTSUPP, "errno %d", errno);

	struct ibv_qp *a = uc_qp(0), *b = uc_qp(1);
	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr qi;
	CHECK("query UC", ibv_query_qp(a, &qa, IBV_QP_STATE, &qi) == 0 && qa.qp_state == IBV_QPS_RESET &&
				  qi.qp_type == IBV_QPT_UC, "state %d type %d", qa.qp_state, qi.qp_type);
	uc_connect(a, b->qp_num);
	uc_connect(b, a->qp_num);
	OK("UC connect");

	/* A SEND of several packets (two SGEs), then one with immediate. */
	struct ibv_sge rs = { (uintptr_t)dst, 16384, dmr->lkey };
	struct ibv_recv_wr rw = { .wr_id = 1, .sg_list = &rs, .num_sge = 1 }, *rbad;
	CHECK("post_recv", ibv_post_recv(b, &rw, &rbad) == 0, "recv");
	struct ibv_sge ss[2] = { { (uintptr_t)src, 3000, smr->lkey }, { (uintptr_t)src + 8192, 2000, smr->lkey } };
	struct ibv_send_wr sw = { .wr_id = 2, .sg_list = ss, .num_sge = 2, .opcode = IBV_WR_SEND,
				  .send_flags = IBV_SEND_SIGNALED }, *sbad;
	CHECK("post_send", ibv_post_send(a, &sw, &sbad) == 0, "send");
	struct ibv_wc w1 = wait_one(), w2 = wait_one();
	struct ibv_wc rc = w1.wr_id == 1 ? w1 : w2;
	CHECK("SEND received", rc.wr_id == 1 && rc.opcode == IBV_WC_RECV && rc.byte_len == 5000 &&
				       rc.qp_num == b->qp_num && !memcmp(dst, src, 3000) &&
				       !memcmp(dst + 3000, src + 8192, 2000),
	      "wr_id %lu len %u", (unsigned long)rc.wr_id, rc.byte_len);
	OK("UC SEND");

	/* WRITE with immediate through the ibv_wr_* builders of the other QP. */
	memset(dst, 0, BUF);
	rw.wr_id = 3;
	CHECK("post_recv", ibv_post_recv(a, &rw, &rbad) == 0, "recv");
	struct ibv_qp_ex *bx = ibv_qp_to_qp_ex(b);
	ibv_wr_start(bx);
	bx->wr_id = 4;
	bx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write_imm(bx, dmr->rkey, (uintptr_t)dst + 100, htobe32(0x1234));
	ibv_wr_set_sge(bx, smr->lkey, (uintptr_t)src, 9000);
	CHECK("wr_complete", ibv_wr_complete(bx) == 0, "wr");
	w1 = wait_one();
	w2 = wait_one();
	rc = w1.wr_id == 3 ? w1 : w2;
	CHECK("WRITE with immediate", rc.wr_id == 3 && rc.opcode == IBV_WC_RECV_RDMA_WITH_IMM &&
					      rc.byte_len == 9000 && (rc.wc_flags & IBV_WC_WITH_IMM) &&
					      rc.imm_data == htobe32(0x1234) && !memcmp(dst + 100, src, 9000),
	      "wr_id %lu opcode %d len %u", (unsigned long)rc.wr_id, rc.opcode, rc.byte_len);
	OK("UC WRITE with immediate");

	/* Not UC operations: refused at post, nothing posted. */
	sw.num_sge = 1;
	int ops[] = { IBV_WR_RDMA_READ, IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_ATOMIC_FETCH_AND_ADD, IBV_WR_SEND_WITH_INV };
	for (unsigned i = 0; i < sizeof(ops) / sizeof(ops[0]); i++) {
		sw.opcode = ops[i];
		ss[0].length = 8;
		CHECK("UC refuses READ/atomics/SEND_INV", ibv_post_send(a, &sw, &sbad) == EINVAL && sbad == &sw,
		      "opcode %d", ops[i]);
	}
	ibv_wr_start(bx);
	ibv_wr_rdma_read(bx, dmr->rkey, (uintptr_t)dst);
	ibv_wr_set_sge(bx, smr->lkey, (uintptr_t)src, 8);
	CHECK("UC refuses wr_rdma_read", ibv_wr_complete(bx) == EINVAL, "wr");
	struct ibv_wc none;
	CHECK("nothing completed", ibv_poll_cq(cq, 1, &none) == 0, "a completion");
	CHECK("still RTS", ibv_query_qp(a, &qa, IBV_QP_STATE, &qi) == 0 && qa.qp_state == IBV_QPS_RTS, "state");
	OK("UC refusals");

	CHECK("destroy", !ibv_destroy_qp(a) && !ibv_destroy_qp(b), "destroy");
	printf("all ok\n");
	return 0;
}
