"""Rank side of `zeroshard advise --measure-bandwidth`: the interconnect's all-reduce bus bandwidth.

Bus bandwidth as nccl-tests defines it: an all-reduce of S bytes over N ranks makes each rank send
2(N-1)/N * S through a ring, so busbw = 2(N-1)/N * S / time. That is the rate at which one rank's link
moves the (N-1)/N share of the paper's volume the advisor divides by. Collectives go through zeroshard's
`Communicator`, like every other collective of ours.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from zeroshard.core.comm import Communicator
from zeroshard.tools.bench.rank import RankContext, run_rank


def work(ctx: RankContext) -> dict:
    spec, n = ctx.spec, ctx.world_size
    comm = Communicator(timeout_s=600.0, check_collectives=False)
    tensor = torch.ones(spec["bytes"] // 4, dtype=torch.float32, device=ctx.device)  # 1-D fp32
    times = []
    total = spec["warmup"] + spec["repeats"]
    for i in range(total):
        comm.barrier("bandwidth probe: start together")
        started = time.perf_counter()
        comm.all_reduce(tensor, "bandwidth probe")
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        slowest = torch.tensor([time.perf_counter() - started], dtype=torch.float64, device=ctx.device)
        comm.all_reduce(slowest, "bandwidth probe: slowest rank", op="max", kind="control")
        if i >= spec["warmup"]:
            times.append(float(slowest.item()))
        ctx.progress(event="step", step=i + 1, total=total)
    median = statistics.median(times)
    size = tensor.numel() * tensor.element_size()
    bus = 2 * (n - 1) / n * size / median if n > 1 else float("inf")
    comm.destroy()
    return {
        "ranks": n,
        "bytes": size,
        "median_s": median,
        "times_s": times,
        "bus_bandwidth": bus,
        "device": str(ctx.device),
        "backend": dist.get_backend(),
    }


if __name__ == "__main__":
    run_rank(work)
