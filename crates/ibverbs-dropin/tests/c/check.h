// SPDX-License-Identifier: GPL-2.0-or-later
/*
 * What the C checks share: CHECK and OK (print "ok NAME" per check, or
 * "FAIL NAME: why" and exit 1), the one context, PD, CQ and GID a check
 * works on (open_device), and for checks that run RC QPs against each
 * other on one rnicd (loopback) the QP (its depth, SGEs and SRQ), its
 * connection to a peer QP (the access it grants, its RDMA READ and atomic
 * depth), waiting for a completion and posting one send WR. Each check is
 * one translation unit, so everything here is static.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <infiniband/verbs.h>

#define CHECK(name, cond, ...)                                                                                         \
	do {                                                                                                           \
		if (!(cond)) {                                                                                         \
			printf("FAIL %s: ", name);                                                                     \
			printf(__VA_ARGS__);                                                                           \
			printf("\n");                                                                                  \
			exit(1);                                                                                       \
		}                                                                                                      \
	} while (0)
#define OK(name) printf("ok %s\n", name)

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static struct ibv_cq *cq;
static union ibv_gid gid;

/* What most loopback connections grant the peer QP. */
#define LOOPBACK_ACCESS (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ)

/* Opens the one device (rnicd) into `ctx` and reads its GID into `gid`. */
static inline void open_device(void)
{
	int n;
	struct ibv_device **list = ibv_get_device_list(&n);
	CHECK("device list", list && n == 1, "n=%d", n);
	ctx = ibv_open_device(list[0]);
	CHECK("open", ctx, "errno %d", errno);
	ibv_free_device_list(list);
	CHECK("query_gid", ibv_query_gid(ctx, 1, 0, &gid) == 0, "gid");
}

/* An RC QP on `cq` with `depth` WRs and `sges` SGEs each way; on `srq`
 * (when not NULL) it has no receive queue of its own. */
static inline struct ibv_qp *loopback_qp(uint32_t depth, uint32_t sges, struct ibv_srq *srq)
{
	struct ibv_qp_init_attr a = {
		.send_cq = cq, .recv_cq = cq, .srq = srq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = depth, .max_recv_wr = depth, .max_send_sge = sges, .max_recv_sge = sges },
	};
	struct ibv_qp *qp = ibv_create_qp(pd, &a);
	CHECK("create_qp", qp, "errno %d", errno);
	CHECK("create_qp caps", !srq || (a.cap.max_recv_wr == 0 && a.cap.max_recv_sge == 0),
	      "a QP on an SRQ has no receive queue");
	return qp;
}

/* Takes `qp` through INIT, RTR and RTS to the QP `dest` of the same rnicd:
 * it grants its peer `access` and has `rd_depth` RDMA READs and atomics
 * in flight each way (0: none). */
static inline void loopback_connect(struct ibv_qp *qp, uint32_t dest, int access, uint8_t rd_depth)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1, .qp_access_flags = access };
	int r = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
	CHECK("modify INIT", r == 0, "%d", r);
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = IBV_MTU_1024;
	a.dest_qp_num = dest;
	a.min_rnr_timer = 1;
	a.max_dest_rd_atomic = rd_depth;
	a.ah_attr.is_global = 1;
	a.ah_attr.grh.dgid = gid;
	a.ah_attr.grh.hop_limit = 64;
	a.ah_attr.port_num = 1;
	r = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
					  IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
	CHECK("modify RTR", r == 0, "%d", r);
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.max_rd_atomic = rd_depth;
	r = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
					  IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC);
	CHECK("modify RTS", r == 0, "%d", r);
}

/* Connects `a` and `b` to each other (loopback_connect both ways). */
static inline void loopback_pair(struct ibv_qp *a, struct ibv_qp *b, int access, uint8_t rd_depth)
{
	loopback_connect(a, b->qp_num, access, rd_depth);
	loopback_connect(b, a->qp_num, access, rd_depth);
}

/* The next completion on `cq`, whatever its status. */
static inline struct ibv_wc next_wc(const char *what)
{
	struct ibv_wc wc;
	for (long i = 0; i < 2000000000L; i++) {
		int n = ibv_poll_cq(cq, 1, &wc);
		CHECK(what, n >= 0, "poll_cq %d", n);
		if (n == 1)
			return wc;
	}
	CHECK(what, 0, "no completion");
	return wc;
}

/* The next completion on `cq`, which must be a success. */
static inline struct ibv_wc wait_ok(const char *what)
{
	struct ibv_wc wc = next_wc(what);
	CHECK(what, wc.status == IBV_WC_SUCCESS, "status %d (%s)", wc.status, ibv_wc_status_str(wc.status));
	return wc;
}

/* Posts one signaled send WR of opcode `op` with one SGE; `raddr` and
 * `rkey` name the remote memory of an RDMA operation. */
static inline void post(struct ibv_qp *qp, enum ibv_wr_opcode op, uint64_t addr, uint32_t len, uint32_t lkey,
			uint64_t raddr, uint32_t rkey)
{
	struct ibv_sge sge = { .addr = addr, .length = len, .lkey = lkey };
	struct ibv_send_wr wr = { .wr_id = op, .sg_list = &sge, .num_sge = 1, .opcode = op,
				  .send_flags = IBV_SEND_SIGNALED }, *bad;
	wr.wr.rdma.remote_addr = raddr;
	wr.wr.rdma.rkey = rkey;
	CHECK("post_send", ibv_post_send(qp, &wr, &bad) == 0, "opcode %d", op);
}
