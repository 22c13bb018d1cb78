"""Stage 3 really frees gathered parameters between uses — measured as process memory, not from our
own bookkeeping. Autograd saves views of parameters for backward (a Linear saves `weight.t()`), so a
unit whose buffer is merely dropped after forward would stay in memory until its backward."""
from __future__ import annotations

import gc

import psutil
import torch
from torch import nn

import zeroshard
from tests.harness import run_distributed
from tests.zs_common import make_config

WIDTH, BLOCKS = 1024, 8  # one unit = 2 x 1024 x 1024 fp32 = 8 MiB; the model = 64 MiB
UNIT_MIB = 2 * WIDTH * WIDTH * 4 / 2**20


class Deep(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH, bias=False), nn.Tanh(),
                                                  nn.Linear(WIDTH, WIDTH, bias=False)) for _ in range(BLOCKS))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x.square().mean()


def _rss_mib() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


def _worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = Deep()
    engine, *_ = zeroshard.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                                      config=make_config(3, micro=2))
    x = torch.randn(2, WIDTH)
    for _ in range(2):  # warm up: first step records the order, allocator settles
        engine.backward(engine(x))
        engine.step()
    before = _rss_mib()
    loss = engine(x)
    after_forward = _rss_mib()
    engine.backward(loss)
    engine.step()
    after_step = _rss_mib()
    engine.destroy()
    return {"forward_growth_mib": after_forward - before, "step_growth_mib": after_step - before}


def test_forward_keeps_about_one_unit_gathered():
    reports = run_distributed(_worker, 2, timeout=300, env={"MALLOC_MMAP_THRESHOLD_": "65536"})
    for report in reports:
        # Current unit + the prefetched next one, not all eight (64 MiB) of them.
        assert report["forward_growth_mib"] < 3 * UNIT_MIB, report
        assert report["step_growth_mib"] < 3 * UNIT_MIB, report
