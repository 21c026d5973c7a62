// SPDX-License-Identifier: GPL-2.0-or-later
/*
 * A libibverbs program that checks the drop-in from the C side, built
 * against the system's <infiniband/verbs.h>: two RC QPs of one process on
 * one rnicd (loopback) move data between ordinary buffers (malloc'd at an
 * odd address, memalign'd, on the stack, mmap'd), then bad calls get the
 * errors real drivers give, and a forked child gets its own copy of
 * registered memory, QPs that fail raise asynchronous events, and MRs keep
 * their keys across ibv_rereg_mr. Prints "ok NAME" per check, "FAIL NAME: why" and exits
 * 1 at the first failure.
 */
#include "check.h"
#include <dirent.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

/* Exported by libibverbs, declared only in rdma-core's driver headers. */
const char *ibv_get_sysfs_path(void);

/* The layouts the inline functions of verbs.h rely on. */
_Static_assert(sizeof(struct verbs_context) == 648, "verbs_context");
_Static_assert(sizeof(struct ibv_context) == 328, "ibv_context");

/* The loopback QPs also take each other's atomics. */
#define RDMA_ACCESS (LOOPBACK_ACCESS | IBV_ACCESS_REMOTE_ATOMIC)

/* The next asynchronous event, waiting for the context's async fd as a
 * program polling it would (at most 5 s). */
static struct ibv_async_event next_async_event(const char *what)
{
	struct pollfd p = { .fd = ctx->async_fd, .events = POLLIN };
	CHECK(what, poll(&p, 1, 5000) == 1, "async fd not readable");
	struct ibv_async_event ev;
	CHECK(what, ibv_get_async_event(ctx, &ev) == 0, "errno %d", errno);
	return ev;
}

/* How many file descriptors the program has open; those below 1024 are
 * marked in `open` (when not NULL). */
static int open_fds(char open[1024])
{
	DIR *d = opendir("/proc/self/fd");
	CHECK("/proc/self/fd", d, "errno %d", errno);
	if (open)
		memset(open, 0, 1024);
	int n = 0;
	struct dirent *e;
	while ((e = readdir(d))) {
		int fd = atoi(e->d_name);
		if (e->d_name[0] == '.' || fd == dirfd(d))
			continue;
		n++;
		if (open && fd < 1024)
			open[fd] = 1;
	}
	closedir(d);
	return n;
}

/* ibv_open_device short of file descriptors (RLIMIT_NOFILE leaving none
 * free, then one more each round until it succeeds) fails at each of its
 * steps in turn, and leaves none of its own open. */
static void open_device_short_of_fds(void)
{
	int n;
	struct ibv_device **list = ibv_get_device_list(&n);
	CHECK("device list", list && n == 1, "n=%d", n);
	struct rlimit old;
	CHECK("getrlimit", getrlimit(RLIMIT_NOFILE, &old) == 0, "errno %d", errno);
	char open[1024];
	int before = open_fds(open), failed = 0;
	struct ibv_context *c = NULL;
	for (int lim = 0, spare = 0; lim < 1024 && !c; lim++) {
		/* A limit of `lim` leaves free the descriptors below it. */
		if (open[lim])
			continue;
		struct rlimit r = { .rlim_cur = (rlim_t)lim, .rlim_max = old.rlim_max };
		CHECK("setrlimit", setrlimit(RLIMIT_NOFILE, &r) == 0, "errno %d", errno);
		c = ibv_open_device(list[0]);
		CHECK("setrlimit", setrlimit(RLIMIT_NOFILE, &old) == 0, "errno %d", errno);
		failed += !c;
		CHECK("close_device", !c || ibv_close_device(c) == 0, "close");
		int now = open_fds(NULL);
		CHECK("open_device short of fds", now == before, "%d fds open after %s with %d free, %d before", now,
		      c ? "success" : "failure", spare, before);
		spare++;
	}
	CHECK("open_device short of fds", c && failed > 0, "opened %d after %d failures", !!c, failed);
	ibv_free_device_list(list);
	OK("open_device short of fds leaves none open");
}

static void write_between(const char *name, char *src, char *dst, size_t len, struct ibv_qp *qp)
{
	struct ibv_mr *smr = ibv_reg_mr(pd, src, len, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_mr *dmr = ibv_reg_mr(pd, dst, len, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	CHECK(name, smr && dmr, "reg_mr errno %d", errno);
	for (size_t i = 0; i < len; i++)
		src[i] = (char)(i * 7 + len);
	memset(dst, 0, len);
	struct ibv_sge sge = { .addr = (uintptr_t)src, .length = (uint32_t)len, .lkey = smr->lkey };
	struct ibv_send_wr wr = { .wr_id = 1, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
				  .send_flags = IBV_SEND_SIGNALED }, *bad;
	wr.wr.rdma.remote_addr = (uintptr_t)dst;
	wr.wr.rdma.rkey = dmr->rkey;
	CHECK(name, ibv_post_send(qp, &wr, &bad) == 0, "post_send");
	struct ibv_wc wc = next_wc(name);
	CHECK(name, wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RDMA_WRITE, "status %d opcode %d",
	      wc.status, wc.opcode);
	CHECK(name, memcmp(src, dst, len) == 0, "data differs");
	CHECK(name, ibv_dereg_mr(smr) == 0 && ibv_dereg_mr(dmr) == 0, "dereg");
	/* The buffers are still the program's memory after deregistration. */
	dst[0] ^= 1;
	src[len - 1] ^= 1;
	OK(name);
}

int main(void)
{
	setvbuf(stdout, NULL, _IONBF, 0);
	open_device_short_of_fds();
	open_device();
	CHECK("device name", !strcmp(ibv_get_device_name(ctx->device), "rnic0"), "%s", ibv_get_device_name(ctx->device));
	struct ibv_port_attr pa;
	CHECK("query_port", ibv_query_port(ctx, 1, &pa) == 0 && pa.state == IBV_PORT_ACTIVE &&
				    pa.link_layer == IBV_LINK_LAYER_ETHERNET, "state %d", pa.state);
	CHECK("query_gid", gid.raw[10] == 0xff, "not an IPv4-mapped GID");
	CHECK("query_gid past the table", ibv_query_gid(ctx, 1, pa.gid_tbl_len, &gid) != 0 &&
						  ibv_query_gid(ctx, 1, 0, &gid) == 0, "no error");
	struct ibv_device_attr_ex dx;
	CHECK("query_device_ex", ibv_query_device_ex(ctx, NULL, &dx) == 0 && dx.phys_port_cnt_ex == 1, "ex");
	OK("queries");

	pd = ibv_alloc_pd(ctx);
	CHECK("alloc_pd", pd, "errno %d", errno);
	struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
	CHECK("channel", ch, "errno %d", errno);
	cq = ibv_create_cq(ctx, 256, (void *)0x1234, ch, 0);
	CHECK("create_cq", cq, "errno %d", errno);
	struct ibv_qp *a = loopback_qp(64, 2, NULL), *b = loopback_qp(64, 2, NULL);
	loopback_pair(a, b, RDMA_ACCESS, 4);
	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr qi;
	CHECK("query_qp", ibv_query_qp(a, &qa, IBV_QP_STATE | IBV_QP_DEST_QPN, &qi) == 0 &&
				  qa.qp_state == IBV_QPS_RTS && qa.dest_qp_num == b->qp_num &&
				  qi.cap.max_send_wr >= 64, "state %d", qa.qp_state);
	OK("loopback connect");

	/* ibv_query_qp's init_attr reports sq_sig_all as the QP was created. */
	{
		struct ibv_qp_init_attr ia = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC, .sq_sig_all = 1,
					       .cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1,
							.max_recv_sge = 1 } };
		struct ibv_qp *s = ibv_create_qp(pd, &ia);
		CHECK("sq_sig_all", s, "errno %d", errno);
		memset(&qi, 0xff, sizeof(qi));
		CHECK("sq_sig_all", ibv_query_qp(s, &qa, IBV_QP_CAP, &qi) == 0 && qi.sq_sig_all == 1, "sq_sig_all %d",
		      qi.sq_sig_all);
		memset(&qi, 0xff, sizeof(qi));
		CHECK("sq_sig_all 0", ibv_query_qp(a, &qa, IBV_QP_CAP, &qi) == 0 && qi.sq_sig_all == 0, "sq_sig_all %d",
		      qi.sq_sig_all);
		CHECK("sq_sig_all", ibv_destroy_qp(s) == 0, "destroy");
		OK("query_qp sq_sig_all");
	}

	/* Ordinary memory of every kind. */
	char *heap = malloc(100000 + 3);
	write_between("malloc unaligned", heap + 3, heap + 3 + 50000, 50000 - 8, a);
	char *al;
	CHECK("memalign", posix_memalign((void **)&al, 4096, 1 << 20) == 0, "memalign");
	char *al2 = aligned_alloc(4096, 1 << 20);
	write_between("memalign", al, al2, 1 << 20, b);
	char stack[3000], stack2[3000];
	write_between("stack", stack, stack2, sizeof(stack), a);
	char *m = mmap(NULL, 1 << 21, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	write_between("mmap", m, m + (1 << 20) + 100, 300000, b);
	/* The same pages registered twice, then in an overlapping range. */
	write_between("overlap", al + 10, al + 4000, 3000, a);

	/* SEND/RECV with immediate data, completion channel events. */
	{
		char *s = malloc(64), *r = malloc(64);
		struct ibv_mr *sm = ibv_reg_mr(pd, s, 64, 0), *rm = ibv_reg_mr(pd, r, 64, IBV_ACCESS_LOCAL_WRITE);
		strcpy(s, "hello through rnicd");
		struct ibv_sge rs = { (uintptr_t)r, 64, rm->lkey }, ss = { (uintptr_t)s, 20, sm->lkey };
		struct ibv_recv_wr rw = { .wr_id = 7, .sg_list = &rs, .num_sge = 1 }, *rbad;
		CHECK("post_recv", ibv_post_recv(b, &rw, &rbad) == 0, "post_recv");
		CHECK("req_notify", ibv_req_notify_cq(cq, 0) == 0, "arm");
		struct ibv_send_wr sw = { .wr_id = 8, .sg_list = &ss, .num_sge = 1, .opcode = IBV_WR_SEND_WITH_IMM,
					  .send_flags = IBV_SEND_SIGNALED, .imm_data = htobe32(0xabcdef01) }, *sbad;
		CHECK("post_send", ibv_post_send(a, &sw, &sbad) == 0, "post_send");
		struct ibv_cq *ecq;
		void *ectx;
		CHECK("get_cq_event", ibv_get_cq_event(ch, &ecq, &ectx) == 0 && ecq == cq && ectx == (void *)0x1234,
		      "event");
		ibv_ack_cq_events(cq, 1);
		int got = 0;
		while (got < 2) {
			struct ibv_wc wc = next_wc("send/recv");
			CHECK("send/recv", wc.status == IBV_WC_SUCCESS, "status %d", wc.status);
			if (wc.wr_id == 7) {
				CHECK("recv imm", wc.opcode == IBV_WC_RECV && (wc.wc_flags & IBV_WC_WITH_IMM) &&
							  be32toh(wc.imm_data) == 0xabcdef01 && wc.byte_len == 20 &&
							  wc.qp_num == b->qp_num,
				      "opcode %d flags %x imm %x len %u", wc.opcode, wc.wc_flags, be32toh(wc.imm_data),
				      wc.byte_len);
				CHECK("recv data", !strcmp(r, "hello through rnicd"), "%s", r);
			}
			got++;
		}
		ibv_dereg_mr(sm);
		ibv_dereg_mr(rm);
		OK("send/recv with imm and a channel event");
	}

	/* Zero-length WRs without an SGE list (sg_list NULL, num_sge 0, as
	 * programs legally pass them): two receives, then a SEND and a WRITE
	 * with immediate consuming them, all four completing. */
	{
		char *z = malloc(64);
		struct ibv_mr *zm = ibv_reg_mr(pd, z, 64, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
		CHECK("empty WRs", zm, "reg_mr errno %d", errno);
		struct ibv_recv_wr r1 = { .wr_id = 31, .sg_list = NULL, .num_sge = 0 };
		struct ibv_recv_wr r0 = { .wr_id = 30, .sg_list = NULL, .num_sge = 0, .next = &r1 }, *rbad;
		CHECK("empty post_recv", ibv_post_recv(b, &r0, &rbad) == 0, "post_recv");
		struct ibv_send_wr s1 = { .wr_id = 33, .sg_list = NULL, .num_sge = 0, .opcode = IBV_WR_RDMA_WRITE_WITH_IMM,
					  .send_flags = IBV_SEND_SIGNALED, .imm_data = htobe32(0x5eed) };
		struct ibv_send_wr s0 = { .wr_id = 32, .sg_list = NULL, .num_sge = 0, .opcode = IBV_WR_SEND,
					  .send_flags = IBV_SEND_SIGNALED, .next = &s1 }, *sbad;
		s1.wr.rdma.remote_addr = (uintptr_t)z;
		s1.wr.rdma.rkey = zm->rkey;
		CHECK("empty post_send", ibv_post_send(a, &s0, &sbad) == 0, "post_send");
		int seen = 0;
		for (int k = 0; k < 4; k++) {
			struct ibv_wc wc = wait_ok("empty WRs");
			CHECK("empty WRs", wc.wr_id >= 30 && wc.wr_id <= 33 && !(seen & (1 << (wc.wr_id - 30))), "wr_id %lu",
			      (unsigned long)wc.wr_id);
			seen |= 1 << (wc.wr_id - 30);
			if (wc.wr_id == 30)
				CHECK("empty SEND received", wc.opcode == IBV_WC_RECV && wc.byte_len == 0 &&
								     !(wc.wc_flags & IBV_WC_WITH_IMM),
				      "opcode %d len %u", wc.opcode, wc.byte_len);
			if (wc.wr_id == 31)
				CHECK("empty WRITE with imm received",
				      wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM && wc.byte_len == 0 &&
					      (wc.wc_flags & IBV_WC_WITH_IMM) && be32toh(wc.imm_data) == 0x5eed,
				      "opcode %d len %u imm %x", wc.opcode, wc.byte_len, be32toh(wc.imm_data));
			if (wc.wr_id == 32)
				CHECK("empty SEND", wc.opcode == IBV_WC_SEND, "opcode %d", wc.opcode);
			if (wc.wr_id == 33)
				CHECK("empty WRITE with imm", wc.opcode == IBV_WC_RDMA_WRITE, "opcode %d", wc.opcode);
		}
		ibv_dereg_mr(zm);
		free(z);
		OK("zero-length SEND, WRITE with imm and receives without an SGE list");
	}

	/* READ and atomics. */
	{
		uint64_t *t = aligned_alloc(64, 4096), *l = aligned_alloc(64, 4096);
		t[0] = 40;
		struct ibv_mr *tm = ibv_reg_mr(pd, t, 4096,
					       IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC);
		struct ibv_mr *lm = ibv_reg_mr(pd, l, 4096, IBV_ACCESS_LOCAL_WRITE);
		struct ibv_sge s = { (uintptr_t)l, 8, lm->lkey };
		struct ibv_send_wr w = { .wr_id = 9, .sg_list = &s, .num_sge = 1, .opcode = IBV_WR_ATOMIC_FETCH_AND_ADD,
					 .send_flags = IBV_SEND_SIGNALED }, *bad;
		w.wr.atomic.remote_addr = (uintptr_t)t;
		w.wr.atomic.rkey = tm->rkey;
		w.wr.atomic.compare_add = 2;
		CHECK("fetch_add", ibv_post_send(a, &w, &bad) == 0, "post");
		struct ibv_wc wc = next_wc("fetch_add");
		CHECK("fetch_add", wc.status == 0 && l[0] == 40 && t[0] == 42, "status %d old %lu new %lu", wc.status,
		      (unsigned long)l[0], (unsigned long)t[0]);
		w.opcode = IBV_WR_RDMA_READ;
		w.wr.rdma.remote_addr = (uintptr_t)t;
		w.wr.rdma.rkey = tm->rkey;
		l[0] = 0;
		CHECK("read", ibv_post_send(a, &w, &bad) == 0, "post");
		wc = next_wc("read");
		CHECK("read", wc.status == 0 && l[0] == 42, "status %d value %lu", wc.status, (unsigned long)l[0]);
		OK("read and atomics");

		/* A deregistered rkey: the requester sees a remote access error
		 * (and its QP goes to ERR, so a pair of its own). */
		struct ibv_qp *x = loopback_qp(8, 2, NULL), *y = loopback_qp(8, 2, NULL);
		loopback_pair(x, y, RDMA_ACCESS, 4);
		uint32_t old = tm->rkey;
		ibv_dereg_mr(tm);
		w.wr.rdma.rkey = old;
		CHECK("stale rkey", ibv_post_send(x, &w, &bad) == 0, "post");
		wc = next_wc("stale rkey");
		CHECK("stale rkey", wc.status == IBV_WC_REM_ACCESS_ERR, "status %d", wc.status);
		CHECK("stale rkey", ibv_query_qp(x, &qa, IBV_QP_STATE, &qi) == 0 && qa.qp_state == IBV_QPS_ERR, "state %d",
		      qa.qp_state);
		/* As libibverbs' ibv_query_qp: asked for the state, it updates
		 * qp->state (rnicd moved the QP to ERR on its own). */
		CHECK("query_qp updates qp->state", x->state == IBV_QPS_ERR, "state %d", x->state);
		/* Both QPs went to ERR on their own: the requester on the NAK
		 * (QP_FATAL), the responder on the access violation
		 * (QP_ACCESS_ERR), in either order. */
		int fatal = 0, access = 0;
		for (int i = 0; i < 2; i++) {
			struct ibv_async_event ev = next_async_event("async event");
			fatal += ev.event_type == IBV_EVENT_QP_FATAL && ev.element.qp == x;
			access += ev.event_type == IBV_EVENT_QP_ACCESS_ERR && ev.element.qp == y;
			ibv_ack_async_event(&ev);
		}
		CHECK("async events", fatal == 1 && access == 1, "fatal %d access %d", fatal, access);
		CHECK("async events acked", x->events_completed == 1 && y->events_completed == 1, "acked");
		struct pollfd pf = { .fd = ctx->async_fd, .events = POLLIN };
		CHECK("async fd quiet", poll(&pf, 1, 0) == 0, "still readable");
		OK("a failed QP raises its asynchronous event");
		CHECK("stale rkey", ibv_destroy_qp(x) == 0 && ibv_destroy_qp(y) == 0, "destroy");
		OK("deregistered rkey gives REM_ACCESS_ERR");

		/* ibv_rereg_mr keeps the keys: new access, then a new range. */
		uint64_t *u = aligned_alloc(64, 4096), *v = aligned_alloc(64, 4096);
		u[0] = 7;
		v[0] = 8;
		struct ibv_mr *um = ibv_reg_mr(pd, u, 4096, IBV_ACCESS_LOCAL_WRITE);
		CHECK("rereg", um, "errno %d", errno);
		uint32_t lkey = um->lkey, rkey = um->rkey;
		CHECK("rereg access", ibv_rereg_mr(um, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0,
						   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ) == 0,
		      "errno %d", errno);
		CHECK("rereg keeps keys", um->lkey == lkey && um->rkey == rkey, "keys changed");
		w.opcode = IBV_WR_RDMA_READ;
		w.wr.rdma.remote_addr = (uintptr_t)u;
		w.wr.rdma.rkey = rkey;
		l[0] = 0;
		CHECK("read after rereg", ibv_post_send(a, &w, &bad) == 0, "post");
		wc = next_wc("read after rereg");
		CHECK("read after rereg", wc.status == 0 && l[0] == 7, "status %d value %lu", wc.status,
		      (unsigned long)l[0]);
		CHECK("rereg translation", ibv_rereg_mr(um, IBV_REREG_MR_CHANGE_TRANSLATION, NULL, v, 4096, 0) == 0,
		      "errno %d", errno);
		CHECK("rereg translation", um->addr == v && um->rkey == rkey, "mr not moved");
		w.wr.rdma.remote_addr = (uintptr_t)v;
		CHECK("read new range", ibv_post_send(a, &w, &bad) == 0, "post");
		wc = next_wc("read new range");
		CHECK("read new range", wc.status == 0 && l[0] == 8, "status %d value %lu", wc.status,
		      (unsigned long)l[0]);
		CHECK("rereg bad flags", ibv_rereg_mr(um, 1 << 5, NULL, NULL, 0, 0) == IBV_REREG_MR_ERR_INPUT &&
						 errno == EINVAL,
		      "errno %d", errno);
		CHECK("rereg access without flag",
		      ibv_rereg_mr(um, 0, NULL, NULL, 0, IBV_ACCESS_LOCAL_WRITE) == IBV_REREG_MR_ERR_INPUT, "accepted");
		CHECK("rereg dereg", ibv_dereg_mr(um) == 0, "dereg");
		CHECK("rereg old range", u[0] == 7 && v[0] == 8, "data");
		free(u);
		free(v);
		OK("rereg_mr keeps lkey and rkey");
		ibv_dereg_mr(lm);
	}

	/* ibv_resize_cq within the CQ's ring; the errors kernel drivers give. */
	{
		struct ibv_cq *rc = ibv_create_cq(ctx, 16, NULL, NULL, 0);
		CHECK("resize_cq", rc, "errno %d", errno);
		CHECK("resize_cq smaller", ibv_resize_cq(rc, 4) == 0 && rc->cqe >= 4, "cqe %d", rc->cqe);
		CHECK("resize_cq 0", ibv_resize_cq(rc, 0) == EINVAL, "accepted");
		CHECK("resize_cq past the device", ibv_resize_cq(rc, 1 << 30) == EINVAL, "accepted");
		CHECK("resize_cq larger", ibv_resize_cq(rc, 100) == 0 && rc->cqe >= 100, "cqe %d", rc->cqe);
		CHECK("resize_cq destroy", ibv_destroy_cq(rc) == 0, "destroy");
		OK("resize_cq");
	}

	/* UD: datagrams between two QPs of this process, through ibv_post_send's
	 * wr.ud and through ibv_wr_set_ud_addr; the GRH in front of the data. */
	{
		struct ibv_cq *ucq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
		struct ibv_qp_init_attr_ex ua = {
			.send_cq = ucq, .recv_cq = ucq, .qp_type = IBV_QPT_UD, .cap = { 8, 8, 1, 1, 0 },
			.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS, .pd = pd,
			.send_ops_flags = IBV_QP_EX_WITH_SEND,
		};
		struct ibv_qp *us = ibv_create_qp_ex(ctx, &ua), *ur = ibv_create_qp_ex(ctx, &ua);
		CHECK("UD create", us && ur && us->qp_type == IBV_QPT_UD, "errno %d", errno);
		char *ub = calloc(1, 4096);
		struct ibv_mr *um = ibv_reg_mr(pd, ub, 4096, IBV_ACCESS_LOCAL_WRITE);
		struct ibv_sge ss = { (uintptr_t)ub, 64, um->lkey }, rs = { (uintptr_t)ub + 1024, 40 + 64, um->lkey };
		struct ibv_send_wr sw = { .wr_id = 1, .sg_list = &ss, .num_sge = 1, .opcode = IBV_WR_SEND,
					  .send_flags = IBV_SEND_SIGNALED }, *sbad;
		struct ibv_recv_wr rw = { .wr_id = 2, .sg_list = &rs, .num_sge = 1 }, *rbad;
		CHECK("UD recv in RESET", ibv_post_recv(ur, &rw, &rbad) == EINVAL, "accepted");
		for (int i = 0; i < 2; i++) {
			struct ibv_qp *q = i ? ur : us;
			struct ibv_qp_attr x = { .qp_state = IBV_QPS_INIT, .port_num = 1, .qkey = 0x11 };
			CHECK("UD INIT without QKEY", ibv_modify_qp(q, &x, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT) ==
							      EINVAL, "accepted");
			CHECK("UD INIT", ibv_modify_qp(q, &x, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY) == 0,
			      "init");
			x.qp_state = IBV_QPS_RTR;
			CHECK("UD RTR", ibv_modify_qp(q, &x, IBV_QP_STATE) == 0, "rtr");
			CHECK("UD send before RTS", i || ibv_post_send(q, &sw, &sbad) == EINVAL, "accepted");
			x.qp_state = IBV_QPS_RTS;
			CHECK("UD RTS", ibv_modify_qp(q, &x, IBV_QP_STATE | IBV_QP_SQ_PSN) == 0, "rts");
		}
		struct ibv_qp_attr qx;
		struct ibv_qp_init_attr qix;
		CHECK("UD query", ibv_query_qp(ur, &qx, IBV_QP_QKEY, &qix) == 0 && qx.qkey == 0x11 &&
					  qix.qp_type == IBV_QPT_UD, "qkey %u", qx.qkey);
		struct ibv_ah_attr uaa = { .is_global = 1, .port_num = 1, .grh = { .dgid = gid, .hop_limit = 64 } };
		struct ibv_ah *uah = ibv_create_ah(pd, &uaa);
		memset(ub, 0x5a, 64);
		for (int way = 0; way < 2; way++) {
			memset(ub + 1024, 0, 40 + 64);
			CHECK("UD post_recv", ibv_post_recv(ur, &rw, &rbad) == 0, "post");
			if (way == 0) {
				sw.wr.ud.ah = NULL;
				CHECK("UD send without AH", ibv_post_send(us, &sw, &sbad) == EINVAL, "accepted");
				sw.wr.ud.ah = uah;
				sw.wr.ud.remote_qpn = ur->qp_num;
				sw.wr.ud.remote_qkey = 0x11;
				CHECK("UD post_send", ibv_post_send(us, &sw, &sbad) == 0, "post");
			} else {
				struct ibv_qp_ex *qx2 = ibv_qp_to_qp_ex(us);
				ibv_wr_start(qx2);
				qx2->wr_id = 1;
				qx2->wr_flags = IBV_SEND_SIGNALED;
				ibv_wr_send(qx2);
				ibv_wr_set_ud_addr(qx2, uah, ur->qp_num, 0x80000000); /* the QP's own Q_Key */
				ibv_wr_set_sge(qx2, um->lkey, (uintptr_t)ub, 64);
				CHECK("UD wr_complete", ibv_wr_complete(qx2) == 0, "complete");
			}
			int got = 0;
			for (long spin = 0; got != 3 && spin < 2000000000L; spin++) {
				struct ibv_wc wc;
				if (ibv_poll_cq(ucq, 1, &wc) != 1)
					continue;
				CHECK("UD completion", wc.status == IBV_WC_SUCCESS, "status %d", wc.status);
				if (wc.opcode == IBV_WC_RECV) {
					CHECK("UD recv wc", wc.byte_len == 40 + 64 && (wc.wc_flags & IBV_WC_GRH) &&
								    wc.src_qp == us->qp_num && wc.qp_num == ur->qp_num,
					      "len %u flags %u src %u", wc.byte_len, wc.wc_flags, wc.src_qp);
					got |= 2;
				} else {
					got |= 1;
				}
			}
			CHECK("UD both completions", got == 3, "got %d", got);
			CHECK("UD data after the GRH", !memcmp(ub + 1024 + 40, ub, 64), "data");
			CHECK("UD GRH is IPv4", ub[1024 + 20] == 0x45 && !memcmp(ub + 1024 + 32, gid.raw + 12, 4), "grh");
		}
		/* A UD message is at most the port's active MTU (1024 on the
		 * testbed's 1500-byte link): that much arrives in one datagram, one
		 * byte more completes with LOC_LEN_ERR and sends nothing. */
		{
			struct ibv_port_attr pa;
			CHECK("UD query_port", ibv_query_port(ctx, 1, &pa) == 0, "query");
			uint32_t mtu = 128u << pa.active_mtu;
			char *big = calloc(1, 16384);
			struct ibv_mr *bm = ibv_reg_mr(pd, big, 16384, IBV_ACCESS_LOCAL_WRITE);
			memset(big, 0x3c, mtu + 1);
			struct ibv_sge bs = { (uintptr_t)big, mtu, bm->lkey }, br = { (uintptr_t)big + 8192, 40 + 4096 + 1, bm->lkey };
			struct ibv_recv_wr bw = { .wr_id = 7, .sg_list = &br, .num_sge = 1 };
			CHECK("UD MTU post_recv", ibv_post_recv(ur, &bw, &rbad) == 0, "post");
			struct ibv_send_wr mw = sw;
			mw.sg_list = &bs;
			mw.wr_id = 8;
			for (int over = 0; over < 2; over++) {
				bs.length = mtu + over;
				mw.wr_id = 8 + over;
				CHECK("UD MTU post_send", ibv_post_send(us, &mw, &sbad) == 0, "post");
			}
			int sent = 0, len_err = 0, recvd = 0;
			for (long spin = 0; sent + len_err + recvd < 3 && spin < 2000000000L; spin++) {
				struct ibv_wc wc;
				if (ibv_poll_cq(ucq, 1, &wc) != 1)
					continue;
				if (wc.opcode == IBV_WC_RECV) {
					CHECK("UD MTU recv", wc.status == IBV_WC_SUCCESS && wc.byte_len == 40 + mtu,
					      "status %d len %u", wc.status, wc.byte_len);
					recvd++;
				} else if (wc.wr_id == 8) {
					CHECK("UD MTU send", wc.status == IBV_WC_SUCCESS, "status %d", wc.status);
					sent++;
				} else {
					CHECK("UD past the MTU", wc.wr_id == 9 && wc.status == IBV_WC_LOC_LEN_ERR,
					      "wr %lu status %d", (unsigned long)wc.wr_id, wc.status);
					len_err++;
				}
			}
			CHECK("UD MTU completions", sent == 1 && len_err == 1 && recvd == 1, "%d %d %d", sent, len_err, recvd);
			CHECK("UD MTU data", !memcmp(big + 8192 + 40, big, mtu), "data");
			usleep(100000);
			struct ibv_wc wc;
			CHECK("UD nothing past the MTU arrives", ibv_poll_cq(ucq, 1, &wc) == 0, "wr %lu", (unsigned long)wc.wr_id);
			struct ibv_qp_attr qa;
			struct ibv_qp_init_attr qi;
			CHECK("UD QP carries on", ibv_query_qp(us, &qa, IBV_QP_STATE, &qi) == 0 && qa.qp_state == IBV_QPS_RTS,
			      "state %d", qa.qp_state);
			ibv_dereg_mr(bm);
			free(big);
		}
		/* A shrink is judged against the completions of WRs already
		 * posted, right after posting them (rnicd takes them first). */
		{
			struct ibv_send_wr chain[8];
			for (int i = 0; i < 8; i++) {
				chain[i] = sw;
				chain[i].wr_id = 100 + i;
				chain[i].next = i < 7 ? &chain[i + 1] : NULL;
			}
			CHECK("UD 8 sends", ibv_post_send(us, chain, &sbad) == 0, "post");
			CHECK("resize_cq below posted sends", ibv_resize_cq(ucq, 4) == EINVAL, "accepted");
			struct ibv_wc wcs[8];
			int n = 0;
			for (long spin = 0; n < 8 && spin < 2000000000L; spin++) {
				int k = ibv_poll_cq(ucq, 8 - n, wcs + n);
				CHECK("UD 8 sends poll", k >= 0, "poll %d", k);
				n += k;
			}
			CHECK("UD 8 sends complete", n == 8 && wcs[7].wr_id == 107 && wcs[7].status == IBV_WC_SUCCESS, "n %d", n);
			CHECK("resize_cq shrink once polled", ibv_resize_cq(ucq, 4) == 0 && ucq->cqe >= 4, "cqe %d", ucq->cqe);
		}
		sw.opcode = IBV_WR_RDMA_WRITE;
		CHECK("UD RDMA WRITE", ibv_post_send(us, &sw, &sbad) == EINVAL, "accepted");
		CHECK("UD destroy", ibv_destroy_qp(us) == 0 && ibv_destroy_qp(ur) == 0 && ibv_destroy_ah(uah) == 0 &&
					    ibv_dereg_mr(um) == 0 && ibv_destroy_cq(ucq) == 0, "destroy");
		free(ub);
		OK("UD datagrams, GRH, wr.ud and ibv_wr_set_ud_addr");
	}

	/* More completions than a CQ holds: IBV_EVENT_CQ_ERR on that CQ. */
	{
		struct ibv_cq *small = ibv_create_cq(ctx, 2, NULL, NULL, 0), *keep = cq;
		CHECK("cq overrun", small && small->cqe == 2, "errno %d", errno);
		cq = small;
		struct ibv_qp *x = loopback_qp(8, 2, NULL), *y = loopback_qp(8, 2, NULL);
		cq = keep;
		loopback_pair(x, y, RDMA_ACCESS, 4);
		uint64_t *m = aligned_alloc(64, 4096);
		struct ibv_mr *mm = ibv_reg_mr(pd, m, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
		CHECK("cq overrun", mm, "errno %d", errno);
		struct ibv_sge sg = { (uintptr_t)m, 8, mm->lkey };
		struct ibv_send_wr w = { .sg_list = &sg, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
					 .send_flags = IBV_SEND_SIGNALED }, *bad;
		w.wr.rdma.remote_addr = (uintptr_t)(m + 8);
		w.wr.rdma.rkey = mm->rkey;
		for (int i = 0; i < 4; i++)
			CHECK("cq overrun", ibv_post_send(x, &w, &bad) == 0, "post %d", i);
		struct ibv_async_event ev = next_async_event("cq overrun");
		CHECK("cq overrun", ev.event_type == IBV_EVENT_CQ_ERR && ev.element.cq == small, "event %d",
		      ev.event_type);
		ibv_ack_async_event(&ev);
		CHECK("cq overrun", small->async_events_completed == 1, "acked");
		CHECK("cq overrun", ibv_destroy_qp(x) == 0 && ibv_destroy_qp(y) == 0 && ibv_destroy_cq(small) == 0,
		      "destroy");
		ibv_dereg_mr(mm);
		free(m);
		OK("CQ overrun raises IBV_EVENT_CQ_ERR");
	}

	/* The extended API: ibv_cq_ex polling and the ibv_wr_* builders. */
	{
		struct ibv_cq_init_attr_ex ca = { .cqe = 64, .wc_flags = IBV_WC_EX_WITH_BYTE_LEN | IBV_WC_EX_WITH_IMM |
									 IBV_WC_EX_WITH_QP_NUM };
		struct ibv_cq_ex *cqx = ibv_create_cq_ex(ctx, &ca);
		CHECK("create_cq_ex", cqx, "errno %d", errno);
		struct ibv_cq_init_attr_ex bad_ca = { .cqe = 64, .wc_flags = IBV_WC_EX_WITH_COMPLETION_TIMESTAMP };
		CHECK("cq_ex timestamps", !ibv_create_cq_ex(ctx, &bad_ca) && errno == EOPNOTSUPP, "errno %d", errno);
		struct ibv_qp_init_attr_ex qa_ex = {
			.send_cq = ibv_cq_ex_to_cq(cqx), .recv_cq = ibv_cq_ex_to_cq(cqx), .qp_type = IBV_QPT_RC,
			.cap = { 16, 16, 2, 2, 64 }, .comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
			.pd = pd, .send_ops_flags = IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_SEND_WITH_IMM,
		};
		struct ibv_qp *p = ibv_create_qp_ex(ctx, &qa_ex), *q = ibv_create_qp_ex(ctx, &qa_ex);
		CHECK("create_qp_ex", p && q, "errno %d", errno);
		qa_ex.send_ops_flags = IBV_QP_EX_WITH_TSO;
		CHECK("qp_ex TSO", !ibv_create_qp_ex(ctx, &qa_ex) && errno == EOPNOTSUPP, "errno %d", errno);
		loopback_pair(p, q, RDMA_ACCESS, 4);
		struct ibv_qp_ex *px = ibv_qp_to_qp_ex(p);
		CHECK("qp_to_qp_ex", px && !ibv_qp_to_qp_ex(a), "qp_ex");
		char *src = malloc(8192), *dst = malloc(8192), *rbuf = malloc(64);
		memset(src, 0x5a, 8192);
		memset(dst, 0, 8192);
		struct ibv_mr *sm = ibv_reg_mr(pd, src, 8192, IBV_ACCESS_LOCAL_WRITE);
		struct ibv_mr *dm = ibv_reg_mr(pd, dst, 8192, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
		struct ibv_mr *rm = ibv_reg_mr(pd, rbuf, 64, IBV_ACCESS_LOCAL_WRITE);
		struct ibv_sge rs = { (uintptr_t)rbuf, 64, rm->lkey };
		struct ibv_recv_wr rw = { .wr_id = 21, .sg_list = &rs, .num_sge = 1 }, *rbad;
		CHECK("qp_ex post_recv", ibv_post_recv(q, &rw, &rbad) == 0, "post_recv");
		ibv_wr_start(px);
		px->wr_id = 20;
		px->wr_flags = IBV_SEND_SIGNALED;
		ibv_wr_rdma_write(px, dm->rkey, (uintptr_t)dst);
		ibv_wr_set_sge(px, sm->lkey, (uintptr_t)src, 8192);
		px->wr_id = 22;
		ibv_wr_send_imm(px, htobe32(77));
		ibv_wr_set_inline_data(px, "inline!", 8);
		CHECK("wr_complete", ibv_wr_complete(px) == 0, "complete");
		int seen = 0, tries = 0;
		while (seen < 3 && tries++ < 100000000) {
			struct ibv_poll_cq_attr pa2 = {};
			if (ibv_start_poll(cqx, &pa2) != 0)
				continue;
			do {
				CHECK("cq_ex status", cqx->status == IBV_WC_SUCCESS, "status %d", cqx->status);
				if (cqx->wr_id == 21)
					CHECK("cq_ex recv", ibv_wc_read_opcode(cqx) == IBV_WC_RECV &&
								    ibv_wc_read_byte_len(cqx) == 8 &&
								    be32toh(ibv_wc_read_imm_data(cqx)) == 77 &&
								    ibv_wc_read_qp_num(cqx) == q->qp_num && !strcmp(rbuf, "inline!"),
					      "opcode %d", ibv_wc_read_opcode(cqx));
				seen++;
			} while (ibv_next_poll(cqx) == 0);
			ibv_end_poll(cqx);
		}
		CHECK("cq_ex completions", seen == 3, "saw %d", seen);
		CHECK("wr write data", memcmp(src, dst, 8192) == 0, "data");
		CHECK("qp_ex teardown", ibv_destroy_qp(p) == 0 && ibv_destroy_qp(q) == 0 &&
						ibv_destroy_cq(ibv_cq_ex_to_cq(cqx)) == 0, "destroy");
		ibv_dereg_mr(sm);
		ibv_dereg_mr(dm);
		ibv_dereg_mr(rm);
		OK("ibv_qp_ex builders and ibv_cq_ex polling");
	}

	/* Bad calls. */
	{
		errno = 0;
		CHECK("reg_mr NULL pd", !ibv_reg_mr(NULL, heap, 10, 0) && errno == EINVAL, "errno %d", errno);
		CHECK("reg_mr unmapped", !ibv_reg_mr(pd, (void *)4096, 4096, 0) && errno == EFAULT, "errno %d", errno);
		CHECK("reg_mr remote write without local", !ibv_reg_mr(pd, heap, 10, IBV_ACCESS_REMOTE_WRITE) &&
								    errno == EINVAL, "errno %d", errno);
		struct ibv_qp_attr qa2 = { .qp_state = IBV_QPS_RTS };
		CHECK("modify bad mask", ibv_modify_qp(a, &qa2, IBV_QP_STATE | (1 << 30)) == EINVAL, "mask");
		struct ibv_qp_attr rtr = { .qp_state = IBV_QPS_RTR };
		CHECK("modify bad transition", ibv_modify_qp(a, &rtr, IBV_QP_STATE) == EINVAL, "transition");
		CHECK("state kept", ibv_query_qp(a, &rtr, IBV_QP_STATE, &qi) == 0 && rtr.qp_state == IBV_QPS_RTS, "%d",
		      rtr.qp_state);
		/* The mask bits rnicd has no use for, as ib_modify_qp_is_ok
		 * judges them: IBV_QP_CAP in no transition, EN_SQD_ASYNC_NOTIFY
		 * not at all (no IBV_EVENT_SQ_DRAINED would come), CUR_STATE and
		 * PATH_MIG_STATE only where the spec's table takes them. */
		{
			struct ibv_qp *x = loopback_qp(4, 1, NULL), *y = loopback_qp(4, 1, NULL);
			struct ibv_qp_attr m = { .qp_state = IBV_QPS_INIT, .port_num = 1,
						 .cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1,
							  .max_recv_sge = 1 } };
			int init_mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
			CHECK("RESET->INIT with IBV_QP_CAP", ibv_modify_qp(x, &m, init_mask | IBV_QP_CAP) == EINVAL, "accepted");
			m.cur_qp_state = IBV_QPS_RESET;
			CHECK("RESET->INIT with CUR_STATE", ibv_modify_qp(x, &m, init_mask | IBV_QP_CUR_STATE) == EINVAL,
			      "accepted");
			m.path_mig_state = IBV_MIG_MIGRATED;
			CHECK("RESET->INIT with PATH_MIG_STATE",
			      ibv_modify_qp(x, &m, init_mask | IBV_QP_PATH_MIG_STATE) == EINVAL, "accepted");
			CHECK("still RESET", ibv_query_qp(x, &m, IBV_QP_STATE, &qi) == 0 && m.qp_state == IBV_QPS_RESET,
			      "state %d", m.qp_state);
			loopback_pair(x, y, LOOPBACK_ACCESS, 1);
			m = (struct ibv_qp_attr){ .qp_state = IBV_QPS_SQD, .en_sqd_async_notify = 1 };
			CHECK("RTS->SQD with EN_SQD_ASYNC_NOTIFY",
			      ibv_modify_qp(x, &m, IBV_QP_STATE | IBV_QP_EN_SQD_ASYNC_NOTIFY) == EINVAL, "accepted");
			CHECK("still RTS", ibv_query_qp(x, &m, IBV_QP_STATE, &qi) == 0 && m.qp_state == IBV_QPS_RTS,
			      "state %d", m.qp_state);
			m = (struct ibv_qp_attr){ .qp_state = IBV_QPS_RTS, .cur_qp_state = IBV_QPS_RTS,
						  .path_mig_state = IBV_MIG_MIGRATED };
			CHECK("RTS->RTS with CUR_STATE and PATH_MIG_STATE",
			      ibv_modify_qp(x, &m, IBV_QP_STATE | IBV_QP_CUR_STATE | IBV_QP_PATH_MIG_STATE) == 0, "refused");
			m.cur_qp_state = IBV_QPS_INIT;
			CHECK("CUR_STATE INIT->RTS", ibv_modify_qp(x, &m, IBV_QP_STATE | IBV_QP_CUR_STATE) == EINVAL,
			      "accepted");
			m.qp_state = IBV_QPS_SQD;
			CHECK("RTS->SQD", ibv_modify_qp(x, &m, IBV_QP_STATE) == 0, "refused");
			CHECK("SQD->SQD with PATH_MIG_STATE", ibv_modify_qp(x, &m, IBV_QP_STATE | IBV_QP_PATH_MIG_STATE) == 0,
			      "refused");
			m.cur_qp_state = IBV_QPS_SQD;
			CHECK("SQD->SQD with CUR_STATE", ibv_modify_qp(x, &m, IBV_QP_STATE | IBV_QP_CUR_STATE) == EINVAL,
			      "accepted");
			m = (struct ibv_qp_attr){ .qp_state = IBV_QPS_RTS, .cur_qp_state = IBV_QPS_SQD };
			CHECK("SQD->RTS with CUR_STATE", ibv_modify_qp(x, &m, IBV_QP_STATE | IBV_QP_CUR_STATE) == 0,
			      "refused");
			CHECK("back in RTS", ibv_query_qp(x, &m, IBV_QP_STATE, &qi) == 0 && m.qp_state == IBV_QPS_RTS,
			      "state %d", m.qp_state);
			CHECK("destroy", ibv_destroy_qp(x) == 0 && ibv_destroy_qp(y) == 0, "destroy");
			OK("modify_qp's CAP, EN_SQD_ASYNC_NOTIFY, CUR_STATE and PATH_MIG_STATE");
		}
		struct ibv_qp *c = loopback_qp(4, 2, NULL);
		{
			struct ibv_qp_attr ia = { .qp_state = IBV_QPS_INIT, .port_num = 1 };
			CHECK("init", ibv_modify_qp(c, &ia, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
								   IBV_QP_ACCESS_FLAGS) == 0, "init");
			struct ibv_qp_attr ra = { .qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_1024, .dest_qp_num = 1,
						  .max_dest_rd_atomic = 1, .min_rnr_timer = 1 };
			ra.ah_attr.is_global = 1;
			ra.ah_attr.grh.dgid = gid;
			ra.ah_attr.grh.sgid_index = 5;
			ra.ah_attr.port_num = 1;
			int rtr_mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
				       IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
			CHECK("bad sgid index", ibv_modify_qp(c, &ra, rtr_mask) == EINVAL, "sgid");
			ra.ah_attr.grh.sgid_index = 0;
			ra.ah_attr.is_global = 0;
			CHECK("no GRH on RoCE", ibv_modify_qp(c, &ra, rtr_mask) == EINVAL, "grh");
			CHECK("missing RTR attributes", ibv_modify_qp(c, &ra, IBV_QP_STATE) == EINVAL, "mask");
		}
		struct ibv_mr *hm = ibv_reg_mr(pd, heap, 4096, IBV_ACCESS_LOCAL_WRITE);
		struct ibv_sge s = { (uintptr_t)heap, 8, hm->lkey };
		struct ibv_recv_wr r[9], *rbad = NULL;
		for (int i = 0; i < 9; i++)
			r[i] = (struct ibv_recv_wr){ .wr_id = i, .sg_list = &s, .num_sge = 1, .next = i < 8 ? &r[i + 1] : NULL };
		uint32_t cap = 0;
		CHECK("query caps", ibv_query_qp(c, &qa2, IBV_QP_CAP, &(struct ibv_qp_init_attr){}) == 0, "query");
		cap = qa2.cap.max_recv_wr;
		struct ibv_sge many[32];
		for (int i = 0; i < 32; i++)
			many[i] = s;
		struct ibv_recv_wr toomany = { .sg_list = many, .num_sge = (int)qa2.cap.max_recv_sge + 1 };
		CHECK("too many SGEs", ibv_post_recv(c, &toomany, &rbad) == EINVAL && rbad == &toomany, "sge");
		if (cap < 9) {
			CHECK("more WRs than the queue holds", ibv_post_recv(c, &r[0], &rbad) == ENOMEM && rbad == &r[cap],
			      "bad_wr at %ld of cap %u", rbad ? (long)(rbad - r) : -1L, cap);
		}
		struct ibv_send_wr bw = { .sg_list = &s, .num_sge = 1, .opcode = 77 }, *sbad;
		CHECK("bad opcode", ibv_post_send(c, &bw, &sbad) == EINVAL && sbad == &bw, "opcode");
		/* Inline data from more SGEs than the QP takes: EINVAL as well (as
		 * rxe), though their bytes (none) fit inline. */
		{
			struct ibv_qp_attr aa;
			struct ibv_qp_init_attr ai;
			CHECK("inline SGEs", ibv_query_qp(a, &aa, IBV_QP_CAP, &ai) == 0 && aa.cap.max_send_sge < 32,
			      "max_send_sge %u", aa.cap.max_send_sge);
			struct ibv_sge empty[32];
			for (int i = 0; i < 32; i++)
				empty[i] = (struct ibv_sge){ (uintptr_t)heap, 0, hm->lkey };
			struct ibv_send_wr iw = { .wr_id = 40, .sg_list = empty, .num_sge = (int)aa.cap.max_send_sge + 1,
						  .opcode = IBV_WR_RDMA_WRITE, .send_flags = IBV_SEND_INLINE }, *ibad = NULL;
			iw.wr.rdma.remote_addr = (uintptr_t)heap;
			iw.wr.rdma.rkey = hm->rkey;
			CHECK("inline with too many SGEs", ibv_post_send(a, &iw, &ibad) == EINVAL && ibad == &iw,
			      "not refused");
		}
		/* A negative count polls nothing and is no error: 0, as rxe and
		 * mlx5 return. */
		struct ibv_wc nw;
		int np = ibv_poll_cq(cq, -1, &nw), np2 = ibv_poll_cq(cq, -5, NULL);
		CHECK("poll_cq negative count", np == 0 && np2 == 0, "%d %d", np, np2);
		bw.opcode = IBV_WR_LOCAL_INV; /* no memory windows on this device */
		CHECK("LOCAL_INV", ibv_post_send(c, &bw, &sbad) == EINVAL && sbad == &bw, "opcode");
		CHECK("dealloc busy pd", ibv_dealloc_pd(pd) == EBUSY, "ebusy");
		CHECK("destroy busy cq", ibv_destroy_cq(cq) == EBUSY, "ebusy");
		CHECK("destroy busy channel", ibv_destroy_comp_channel(ch) == EBUSY, "ebusy");
		struct ibv_qp_init_attr raw = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RAW_PACKET,
						.cap = { 1, 1, 1, 1, 0 } };
		CHECK("raw packet QP", !ibv_create_qp(pd, &raw) && errno == EOPNOTSUPP, "errno %d", errno);
		/* Basic SRQs work (srq_check.c); XRC ones do not. */
		struct ibv_srq_init_attr_ex xrc = { .attr = { 1, 1, 0 }, .srq_type = IBV_SRQT_XRC, .pd = pd, .cq = cq,
						    .comp_mask = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD |
								 IBV_SRQ_INIT_ATTR_CQ };
		CHECK("xrc srq", !ibv_create_srq_ex(ctx, &xrc) && errno == EOPNOTSUPP, "errno %d", errno);
		union ibv_gid mgid = {};
		CHECK("multicast", ibv_attach_mcast(c, &mgid, 0) == EOPNOTSUPP, "mcast");
		struct ibv_ah_attr aha = { .is_global = 1, .port_num = 1, .grh = { .dgid = gid, .hop_limit = 64 } };
		struct ibv_ah *ah = ibv_create_ah(pd, &aha);
		CHECK("address handle", ah && ah->pd == pd && ah->context == ctx, "errno %d", errno);
		CHECK("destroy address handle", ibv_destroy_ah(ah) == 0, "destroy");
		struct ibv_pd *ahpd = ibv_alloc_pd(ctx);
		ah = ibv_create_ah(ahpd, &aha);
		CHECK("an address handle holds its PD", ah && ibv_dealloc_pd(ahpd) == EBUSY && ibv_destroy_ah(ah) == 0 &&
				 ibv_dealloc_pd(ahpd) == 0, "ebusy");
		aha.is_global = 0;
		CHECK("address handle without GRH", !ibv_create_ah(pd, &aha) && errno == EINVAL, "errno %d", errno);
		aha.is_global = 1;
		aha.grh.sgid_index = 200;
		CHECK("address handle past the GID table", !ibv_create_ah(pd, &aha) && errno == EINVAL, "errno %d", errno);
		CHECK("sysfs path", !strcmp(ibv_get_sysfs_path(), "/sys"), "path");
		CHECK("destroy qp", ibv_destroy_qp(c) == 0, "destroy");
		ibv_dereg_mr(hm);
		OK("bad calls");
	}

	/* fork: the child gets its own copy of registered memory. */
	{
		char *f = aligned_alloc(4096, 8192);
		strcpy(f, "parent");
		struct ibv_mr *fm = ibv_reg_mr(pd, f, 8192, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
		pid_t p = fork();
		if (p == 0) {
			int same = !strcmp(f, "parent");
			strcpy(f, "child");
			_exit(same ? 0 : 3);
		}
		int st;
		waitpid(p, &st, 0);
		CHECK("fork", WIFEXITED(st) && WEXITSTATUS(st) == 0 && !strcmp(f, "parent"), "parent sees '%s'", f);
		/* rnicd still writes into the parent's pages. */
		write_between("after fork", heap, f + 100, 1000, a);
		ibv_dereg_mr(fm);
		OK("fork");
	}

	/* munmap of a registered range, then deregistration. */
	{
		char *u = mmap(NULL, 65536, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		struct ibv_mr *um = ibv_reg_mr(pd, u, 65536, IBV_ACCESS_LOCAL_WRITE);
		CHECK("munmap", um && munmap(u, 65536) == 0 && ibv_dereg_mr(um) == 0, "dereg after munmap");
		OK("munmap before dereg");
	}

	CHECK("destroy", ibv_destroy_qp(a) == 0 && ibv_destroy_qp(b) == 0 && ibv_destroy_cq(cq) == 0 &&
				 ibv_destroy_comp_channel(ch) == 0 && ibv_dealloc_pd(pd) == 0 && ibv_close_device(ctx) == 0,
	      "teardown");
	OK("teardown");
	printf("all ok\n");
	return 0;
}
