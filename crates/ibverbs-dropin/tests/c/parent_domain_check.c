// SPDX-License-Identifier: GPL-2.0-or-later
/*
 * Thread and parent domains through the drop-in: a parent domain with
 * allocators gives each QP's two rings their memory (the allocator sees the
 * page size as alignment and the QP resource type; the ring's shared pages
 * are then mapped there), RC traffic between two QPs made on it, and the
 * memory going back to `free` when the QPs are destroyed; an allocator
 * answering IBV_ALLOCATOR_USE_DEFAULT or NULL; the references a parent
 * domain holds (its PD and thread domain EBUSY meanwhile) and bad calls.
 */
#include "check.h"
#include <sys/mman.h>

#define MAXR 8
static struct {
	void *ptr;
	size_t size;
} allocs[MAXR];
static int nalloc, nfree, answer_default, answer_null;
static int my_context;

static void *my_alloc(struct ibv_pd *p, void *pd_context, size_t size, size_t alignment, uint64_t type)
{
	CHECK("alloc args", pd_context == &my_context && alignment == 4096 && type == 1 && size % 4096 == 0,
	      "ctx %p align %zu type %lu size %zu", pd_context, alignment, (unsigned long)type, size);
	(void)p;
	if (answer_default)
		return IBV_ALLOCATOR_USE_DEFAULT;
	if (answer_null)
		return NULL;
	void *m;
	CHECK("posix_memalign", posix_memalign(&m, alignment, size) == 0, "memalign");
	memset(m, 0xa5, size);
	CHECK("alloc room", nalloc < MAXR, "too many");
	allocs[nalloc].ptr = m;
	allocs[nalloc++].size = size;
	return m;
}

static void my_free(struct ibv_pd *p, void *pd_context, void *ptr, uint64_t type)
{
	(void)p;
	CHECK("free args", pd_context == &my_context && type == 1, "ctx %p", pd_context);
	int found = 0;
	for (int i = 0; i < nalloc; i++)
		found |= allocs[i].ptr == ptr;
	CHECK("free of an allocated ring", found, "%p", ptr);
	nfree++;
	free(ptr);
}

static char buf[8192];

int main(void)
{
	setvbuf(stdout, NULL, _IONBF, 0);
	open_device();
	struct ibv_pd *prot = ibv_alloc_pd(ctx);
	cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	CHECK("objects", prot && cq, "errno %d", errno);

	struct ibv_td_init_attr ta = { 0 };
	struct ibv_td *td = ibv_alloc_td(ctx, &ta);
	CHECK("alloc_td", td, "errno %d", errno);
	struct ibv_parent_domain_init_attr pa = {
		.pd = prot, .td = td, .alloc = my_alloc, .free = my_free, .pd_context = &my_context,
		.comp_mask = IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS | IBV_PARENT_DOMAIN_INIT_ATTR_PD_CONTEXT,
	};
	struct ibv_pd *parent = ibv_alloc_parent_domain(ctx, &pa);
	CHECK("alloc_parent_domain", parent && parent->context == ctx, "errno %d", errno);
	CHECK("PD held", ibv_dealloc_pd(prot) == EBUSY, "dealloc");
	CHECK("TD held", ibv_dealloc_td(td) == EBUSY, "dealloc_td");
	OK("parent domain");

	/* Bad calls. */
	struct ibv_parent_domain_init_attr bad = { .pd = parent };
	CHECK("parent of a parent", !ibv_alloc_parent_domain(ctx, &bad) && errno == EINVAL, "errno %d", errno);
	bad = (struct ibv_parent_domain_init_attr){ .pd = prot, .comp_mask = 1 << 5 };
	CHECK("unknown comp_mask", !ibv_alloc_parent_domain(ctx, &bad) && errno == EINVAL, "errno %d", errno);
	bad = (struct ibv_parent_domain_init_attr){ .pd = prot, .comp_mask = IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS };
	CHECK("allocators missing", !ibv_alloc_parent_domain(ctx, &bad) && errno == EINVAL, "errno %d", errno);
	struct ibv_cq_init_attr_ex cqa = { .cqe = 16, .parent_domain = prot, .comp_mask = IBV_CQ_INIT_ATTR_MASK_PD };
	CHECK("CQ on a plain PD", !ibv_create_cq_ex(ctx, &cqa) && errno == EINVAL, "errno %d", errno);
	cqa.parent_domain = parent;
	struct ibv_cq_ex *cqx = ibv_create_cq_ex(ctx, &cqa);
	CHECK("CQ on a parent domain", cqx, "errno %d", errno);
	CHECK("destroy CQ", ibv_destroy_cq(ibv_cq_ex_to_cq(cqx)) == 0, "destroy");
	OK("bad calls");

	/* Two RC QPs on the parent domain: each ring in the allocator's memory. */
	pd = parent;
	struct ibv_qp *a = loopback_qp(16, 1, NULL), *b = loopback_qp(16, 1, NULL);
	CHECK("four rings allocated", nalloc == 4 && nfree == 0, "alloc %d free %d", nalloc, nfree);
	for (int i = 0; i < nalloc; i++) {
		unsigned char *r = allocs[i].ptr;
		/* The ring's shared pages replaced the 0xa5 the allocator wrote. */
		CHECK("ring mapped over the allocation", r[0] != 0xa5 || r[allocs[i].size - 1] != 0xa5, "ring %d", i);
	}
	loopback_pair(a, b, LOOPBACK_ACCESS, 4);
	struct ibv_mr *mr = ibv_reg_mr(parent, buf, sizeof(buf), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	CHECK("reg_mr on the parent domain", mr, "errno %d", errno);
	for (int i = 0; i < 4096; i++)
		buf[i] = (char)(i * 13 + 1);
	struct ibv_sge rs = { (uintptr_t)buf + 4096, 4096, mr->lkey }, ss = { (uintptr_t)buf, 4096, mr->lkey };
	struct ibv_recv_wr rw = { .wr_id = 1, .sg_list = &rs, .num_sge = 1 }, *rbad;
	struct ibv_send_wr sw = { .wr_id = 2, .sg_list = &ss, .num_sge = 1, .opcode = IBV_WR_SEND,
				  .send_flags = IBV_SEND_SIGNALED }, *sbad;
	CHECK("post", !ibv_post_recv(b, &rw, &rbad) && !ibv_post_send(a, &sw, &sbad), "post");
	struct ibv_wc wc[2];
	int got = 0;
	for (long spins = 0; got < 2 && spins < 100000000; spins++) {
		int k = ibv_poll_cq(cq, 2 - got, wc + got);
		CHECK("poll", k >= 0, "%d", k);
		got += k;
	}
	CHECK("SEND over rings in allocated memory", got == 2 && wc[0].status == IBV_WC_SUCCESS &&
							     wc[1].status == IBV_WC_SUCCESS &&
							     !memcmp(buf, buf + 4096, 4096),
	      "got %d", got);
	CHECK("PD busy", ibv_dealloc_pd(parent) == EBUSY, "dealloc");
	CHECK("destroy", !ibv_destroy_qp(a) && !ibv_destroy_qp(b) && !ibv_dereg_mr(mr), "destroy");
	CHECK("rings freed", nfree == 4, "free %d", nfree);
	OK("QPs on a parent domain");

	/* USE_DEFAULT: the library's own memory, nothing to free; NULL: ENOMEM. */
	answer_default = 1;
	a = loopback_qp(16, 1, NULL);
	CHECK("default memory", nalloc == 4, "alloc %d", nalloc);
	CHECK("destroy", !ibv_destroy_qp(a) && nfree == 4, "free %d", nfree);
	answer_default = 0;
	answer_null = 1;
	struct ibv_qp_init_attr qa = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC, .cap = { 4, 4, 1, 1, 0 } };
	CHECK("allocator out of memory", !ibv_create_qp(parent, &qa) && errno == ENOMEM, "errno %d", errno);
	OK("USE_DEFAULT and NULL");

	CHECK("dealloc parent", ibv_dealloc_pd(parent) == 0, "dealloc");
	CHECK("dealloc td", ibv_dealloc_td(td) == 0, "td");
	CHECK("dealloc pd", ibv_dealloc_pd(prot) == 0, "pd");
	printf("all ok\n");
	return 0;
}
