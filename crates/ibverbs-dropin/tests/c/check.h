// SPDX-License-Identifier: GPL-2.0-or-later
/*
 * What the C checks share: CHECK and OK (print "ok NAME" per check, or
 * "FAIL NAME: why" and exit 1), the one context, PD, CQ and GID a check
 * works on, and for checks that run two RC QPs against each other on one
 * rnicd (loopback) a QP of 16 WRs each way and its connection to a peer QP
 * with local write, remote write and remote read. Each check is one
 * translation unit, so everything here is static.
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

static inline struct ibv_qp *loopback_qp(void)
{
	struct ibv_qp_init_attr a = {
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	struct ibv_qp *qp = ibv_create_qp(pd, &a);
	CHECK("create_qp", qp, "errno %d", errno);
	return qp;
}

static inline void loopback_connect(struct ibv_qp *qp, uint32_t dest)
{
	int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1, .qp_access_flags = access };
	int r = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
	CHECK("modify INIT", r == 0, "%d", r);
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = IBV_MTU_1024;
	a.dest_qp_num = dest;
	a.min_rnr_timer = 1;
	a.max_dest_rd_atomic = 4;
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
	a.max_rd_atomic = 4;
	r = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
					  IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC);
	CHECK("modify RTS", r == 0, "%d", r);
}
