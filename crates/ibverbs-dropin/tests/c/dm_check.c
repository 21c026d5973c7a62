// SPDX-License-Identifier: GPL-2.0-or-later
/*
 * Device memory through the drop-in, from the C side: ibv_alloc_dm and its
 * refusals (no size, too big, unknown comp_mask, the context's pool
 * exhausted), copies in and out with their bounds and 4-byte rule, DM MRs
 * (zero-based only, inside the DM), and traffic on two RC QPs of one
 * process on one rnicd (loopback): a SEND from device memory, an RDMA
 * WRITE into it and an RDMA READ from it by the peer, each checked byte for
 * byte; freeing a DM with an MR on it is EBUSY. Prints "ok NAME" per check,
 * "FAIL NAME: why" and exits 1 at the first failure.
 */
#include "check.h"

#define DM_LEN 8192
static char buf[1 << 16];
static char pattern[DM_LEN], back[DM_LEN];

int main(void)
{
	setvbuf(stdout, NULL, _IONBF, 0);
	open_device();
	pd = ibv_alloc_pd(ctx);
	cq = ibv_create_cq(ctx, 256, NULL, NULL, 0);
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, sizeof(buf), IBV_ACCESS_LOCAL_WRITE);
	CHECK("objects", pd && cq && mr, "errno %d", errno);
	struct ibv_device_attr_ex dx;
	CHECK("query_device_ex", ibv_query_device_ex(ctx, NULL, &dx) == 0 && dx.max_dm_size >= 2 * DM_LEN,
	      "max_dm_size %lu", (unsigned long)dx.max_dm_size);
	uint64_t max = dx.max_dm_size;

	/* Refusals. */
	struct ibv_alloc_dm_attr da = { .length = 0 };
	CHECK("alloc_dm length 0", !ibv_alloc_dm(ctx, &da) && errno == EINVAL, "errno %d", errno);
	da.length = max + 1;
	CHECK("alloc_dm too big", !ibv_alloc_dm(ctx, &da) && errno == ENOMEM, "errno %d", errno);
	da = (struct ibv_alloc_dm_attr){ .length = 64, .comp_mask = 1 };
	CHECK("alloc_dm comp_mask", !ibv_alloc_dm(ctx, &da) && errno == EINVAL, "errno %d", errno);
	da = (struct ibv_alloc_dm_attr){ .length = 64, .log_align_req = 13 };
	CHECK("alloc_dm alignment past a page", !ibv_alloc_dm(ctx, &da) && errno == EINVAL, "errno %d", errno);
	/* The pool: all of it in one DM, then nothing more until it is freed. */
	da = (struct ibv_alloc_dm_attr){ .length = max };
	struct ibv_dm *all = ibv_alloc_dm(ctx, &da);
	CHECK("alloc_dm whole pool", all, "errno %d", errno);
	da.length = 4;
	CHECK("alloc_dm pool exhausted", !ibv_alloc_dm(ctx, &da) && errno == ENOMEM, "errno %d", errno);
	CHECK("free_dm", ibv_free_dm(all) == 0, "free");
	OK("alloc refusals and pool");

	/* Copies: in and out, with bounds and the 4-byte rule. */
	da = (struct ibv_alloc_dm_attr){ .length = DM_LEN, .log_align_req = 6 };
	struct ibv_dm *dm = ibv_alloc_dm(ctx, &da);
	CHECK("alloc_dm", dm && dm->context == ctx, "errno %d", errno);
	for (int i = 0; i < DM_LEN; i++)
		pattern[i] = (char)(i * 7 + 3);
	CHECK("memcpy_to_dm", ibv_memcpy_to_dm(dm, 0, pattern, DM_LEN) == 0, "to");
	CHECK("memcpy_from_dm", ibv_memcpy_from_dm(back, dm, 0, DM_LEN) == 0 && !memcmp(back, pattern, DM_LEN),
	      "data differs");
	CHECK("memcpy_from_dm part", ibv_memcpy_from_dm(back, dm, 100, 40) == 0 && !memcmp(back, pattern + 100, 40),
	      "data differs");
	CHECK("memcpy_to_dm unaligned offset", ibv_memcpy_to_dm(dm, 3, pattern, 4) == EINVAL, "not EINVAL");
	CHECK("memcpy_to_dm unaligned length", ibv_memcpy_to_dm(dm, 0, pattern, 3) == EINVAL, "not EINVAL");
	CHECK("memcpy_to_dm past the end", ibv_memcpy_to_dm(dm, DM_LEN - 4, pattern, 8) == EFAULT, "not EFAULT");
	CHECK("memcpy_from_dm past the end", ibv_memcpy_from_dm(back, dm, DM_LEN + 4, 4) == EFAULT, "not EFAULT");
	OK("copies");

	/* DM MRs: zero-based only, inside the DM. */
	int acc = IBV_ACCESS_ZERO_BASED | IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
	CHECK("reg_dm_mr without ZERO_BASED",
	      !ibv_reg_dm_mr(pd, dm, 0, DM_LEN, IBV_ACCESS_LOCAL_WRITE) && errno == EINVAL, "errno %d", errno);
	CHECK("reg_dm_mr past the end", !ibv_reg_dm_mr(pd, dm, 4, DM_LEN, acc) && errno == EINVAL, "errno %d", errno);
	struct ibv_mr *empty = ibv_reg_dm_mr(pd, dm, 8, 0, acc);
	CHECK("reg_dm_mr empty", empty && empty->length == 0, "errno %d", errno);
	/* The MR covers the DM's second half: address 0 is DM offset 4096. */
	struct ibv_mr *dmr = ibv_reg_dm_mr(pd, dm, 4096, 4096, acc);
	CHECK("reg_dm_mr", dmr && dmr->addr == NULL && dmr->length == 4096, "errno %d", errno);
	CHECK("free_dm with an MR", ibv_free_dm(dm) == EBUSY, "not EBUSY");
	OK("dm mrs");

	struct ibv_qp *a = loopback_qp(16, 1, NULL), *b = loopback_qp(16, 1, NULL);
	loopback_pair(a, b, LOOPBACK_ACCESS, 4);

	/* SEND from device memory (DM offset 4096 + 256, 1000 bytes) into b's buffer. */
	struct ibv_sge rs = { .addr = (uintptr_t)buf, .length = 4096, .lkey = mr->lkey };
	struct ibv_recv_wr rw = { .wr_id = 77, .sg_list = &rs, .num_sge = 1 }, *rbad;
	CHECK("post_recv", ibv_post_recv(b, &rw, &rbad) == 0, "post_recv");
	post(a, IBV_WR_SEND, 256, 1000, dmr->lkey, 0, 0);
	for (int k = 0; k < 2; k++) {
		struct ibv_wc wc = wait_ok("send from dm");
		if (wc.opcode == IBV_WC_RECV)
			CHECK("send from dm", wc.byte_len == 1000, "byte_len %u", wc.byte_len);
	}
	CHECK("send from dm", !memcmp(buf, pattern + 4096 + 256, 1000), "data differs");
	OK("send from device memory");

	/* RDMA WRITE by b into a's DM MR at address 512 (DM offset 4608). */
	for (int i = 0; i < 2048; i++)
		buf[8192 + i] = (char)(255 - i);
	post(b, IBV_WR_RDMA_WRITE, (uintptr_t)(buf + 8192), 2048, mr->lkey, 512, dmr->rkey);
	wait_ok("write into dm");
	CHECK("write into dm", ibv_memcpy_from_dm(back, dm, 4608, 2048) == 0 && !memcmp(back, buf + 8192, 2048),
	      "data differs");
	CHECK("write into dm", ibv_memcpy_from_dm(back, dm, 4096, 512) == 0 && !memcmp(back, pattern + 4096, 512),
	      "bytes before the write changed");
	OK("rdma write into device memory");

	/* RDMA READ by b of a's DM MR, addresses 3000..4096 (the MR's end). */
	post(b, IBV_WR_RDMA_READ, (uintptr_t)(buf + 16384), 1096, mr->lkey, 3000, dmr->rkey);
	wait_ok("read from dm");
	CHECK("read from dm", !memcmp(buf + 16384, pattern + 4096 + 3000, 1096), "data differs");
	/* Past the MR's end: the responder refuses, the requester sees a remote access error. */
	post(b, IBV_WR_RDMA_READ, (uintptr_t)(buf + 16384), 8, mr->lkey, 4092, dmr->rkey);
	struct ibv_wc wc = next_wc("read past the mr");
	CHECK("read past the mr", wc.status == IBV_WC_REM_ACCESS_ERR, "status %d", wc.status);
	OK("rdma read from device memory");

	/* An empty DM MR grants nothing: a WRITE of 4 bytes to it is refused. */
	struct ibv_qp *c = loopback_qp(16, 1, NULL), *d = loopback_qp(16, 1, NULL);
	loopback_pair(c, d, LOOPBACK_ACCESS, 4);
	post(c, IBV_WR_RDMA_WRITE, (uintptr_t)buf, 4, mr->lkey, 0, empty->rkey);
	wc = next_wc("write to an empty mr");
	CHECK("write to an empty mr", wc.status == IBV_WC_REM_ACCESS_ERR, "status %d", wc.status);
	CHECK("dereg empty mr", ibv_dereg_mr(empty) == 0 && !ibv_destroy_qp(c) && !ibv_destroy_qp(d), "dereg");
	OK("empty dm mr");

	CHECK("dereg dm mr", ibv_dereg_mr(dmr) == 0, "dereg");
	CHECK("free_dm", ibv_free_dm(dm) == 0, "free");
	CHECK("teardown", !ibv_destroy_qp(a) && !ibv_destroy_qp(b) && !ibv_dereg_mr(mr) && !ibv_destroy_cq(cq) &&
				  !ibv_dealloc_pd(pd),
	      "teardown");
	OK("free");
	ibv_close_device(ctx);
	printf("all ok\n");
	return 0;
}
