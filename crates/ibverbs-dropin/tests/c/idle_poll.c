// SPDX-License-Identifier: GPL-2.0-or-later
/*
 * Polls an idle CQ made without a completion channel POLLS times and
 * prints how often the program slept meanwhile ("voluntary N": its
 * voluntary context switches). Beside an rnicd under ordinary scheduling
 * ibv_poll_cq naps on the context's idle channel after a few empty polls,
 * up to 1 ms each; beside a real-time rnicd it only yields (pace.rs,
 * docs/ibverbs.md "What works").
 */
#define _GNU_SOURCE
#include <sys/resource.h>

#include "check.h"

#define POLLS 200

int main(void)
{
	struct ibv_wc wc;
	struct rusage before, after;

	open_device();
	cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	CHECK("create_cq", cq, "errno %d", errno);
	CHECK("getrusage", getrusage(RUSAGE_THREAD, &before) == 0, "errno %d", errno);
	for (int i = 0; i < POLLS; i++)
		CHECK("poll_cq", ibv_poll_cq(cq, 1, &wc) == 0, "an idle CQ returned a completion or an error");
	CHECK("getrusage", getrusage(RUSAGE_THREAD, &after) == 0, "errno %d", errno);
	printf("voluntary %ld\n", after.ru_nvcsw - before.ru_nvcsw);
	CHECK("destroy_cq", ibv_destroy_cq(cq) == 0, "errno %d", errno);
	CHECK("close", ibv_close_device(ctx) == 0, "errno %d", errno);
	printf("all ok\n");
	return 0;
}
