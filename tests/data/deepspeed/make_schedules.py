"""Writes tests/data/deepspeed/schedules.json: DeepSpeed 0.19.8's OneCycle and LRRangeTest curves.

DeepSpeed is not a dependency of zeroshard: this script runs in a separate virtual environment
with torch and deepspeed==0.19.8 installed (no processes, no accelerator needed):

    cd tests/data/deepspeed
    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python make_schedules.py

Each case builds a torch optimizer ("adam": torch.optim.Adam with betas (0.9, 0.999), "sgd":
torch.optim.SGD with momentum 0.9) with one param group per entry of ``lrs``, builds the schedule
with ``params``, records every group's lr and momentum (``betas[0]`` for Adam, ``momentum`` for SGD)
after construction, then after each of STEPS calls to ``step()``. tests/test_schedulers.py checks
that zeroshard's schedules write exactly these values.
"""

from __future__ import annotations

import json
import os

import torch
from deepspeed.runtime.lr_schedules import LRRangeTest, OneCycle

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 50

CASES = [
    {
        "name": "onecycle_adam_decay",
        "type": "OneCycle",
        "optimizer": "adam",
        "lrs": [0.01],
        "params": {
            "cycle_min_lr": 1e-4,
            "cycle_max_lr": 1e-3,
            "cycle_first_step_size": 10,
            "decay_step_size": 5,
            "decay_lr_rate": 0.1,
            "cycle_min_mom": 0.85,
            "cycle_max_mom": 0.95,
            "decay_mom_rate": 0.01,
        },
    },
    {
        "name": "onecycle_stairs_two_groups",
        "type": "OneCycle",
        "optimizer": "adam",
        "lrs": [0.01, 0.02],
        "params": {
            "cycle_min_lr": [1e-4, 2e-4],
            "cycle_max_lr": [1e-3, 3e-3],
            "cycle_first_step_size": 12,
            "cycle_second_step_size": 8,
            "cycle_first_stair_count": 4,
            "cycle_second_stair_count": 2,
            "cycle_min_mom": [0.8, 0.7],
            "cycle_max_mom": [0.9, 0.95],
        },
    },
    {
        "name": "onecycle_no_momentum_lr_decay",
        "type": "OneCycle",
        "optimizer": "adam",
        "lrs": [0.01],
        "params": {
            "cycle_min_lr": 0.001,
            "cycle_max_lr": 0.01,
            "cycle_first_step_size": 7,
            "decay_step_size": 3,
            "decay_lr_rate": 0.5,
            "cycle_momentum": False,
        },
    },
    {
        "name": "onecycle_sgd_momentum_untouched",
        "type": "OneCycle",
        "optimizer": "sgd",
        "lrs": [0.1],
        "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 5, "cycle_second_step_size": 15},
    },
    {
        "name": "onecycle_resumed_at_17",
        "type": "OneCycle",
        "optimizer": "adam",
        "lrs": [0.01],
        "params": {
            "cycle_min_lr": 1e-4,
            "cycle_max_lr": 1e-3,
            "cycle_first_step_size": 10,
            "decay_step_size": 4,
            "decay_lr_rate": 0.2,
            "decay_mom_rate": 0.02,
            "last_batch_iteration": 17,
        },
    },
    {"name": "lrrt_defaults", "type": "LRRangeTest", "optimizer": "sgd", "lrs": [0.1], "params": {}},
    {
        "name": "lrrt_continuous",
        "type": "LRRangeTest",
        "optimizer": "adam",
        "lrs": [0.01],
        "params": {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 5, "lr_range_test_step_rate": 3.0},
    },
    {
        "name": "lrrt_staircase_two_groups",
        "type": "LRRangeTest",
        "optimizer": "adam",
        "lrs": [0.01, 0.02],
        "params": {
            "lr_range_test_min_lr": [1e-3, 2e-3],
            "lr_range_test_step_size": 4,
            "lr_range_test_step_rate": 0.5,
            "lr_range_test_staircase": True,
        },
    },
]


def _optimizer(kind: str, lrs: list[float]) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs]
    if kind == "adam":
        return torch.optim.Adam(groups, betas=(0.9, 0.999))
    return torch.optim.SGD(groups, momentum=0.9)


def _snapshot(optimizer: torch.optim.Optimizer, kind: str) -> dict[str, list[float]]:
    lrs = [float(group["lr"]) for group in optimizer.param_groups]
    if kind == "adam":
        return {"lr": lrs, "mom": [float(group["betas"][0]) for group in optimizer.param_groups]}
    return {"lr": lrs, "mom": [float(group["momentum"]) for group in optimizer.param_groups]}


def run(case: dict) -> dict:
    optimizer = _optimizer(case["optimizer"], case["lrs"])
    cls = {"OneCycle": OneCycle, "LRRangeTest": LRRangeTest}[case["type"]]
    scheduler = cls(optimizer, **case["params"])
    curve = [_snapshot(optimizer, case["optimizer"])]
    for _ in range(STEPS):
        scheduler.step()
        curve.append(_snapshot(optimizer, case["optimizer"]))
    return {**case, "curve": curve, "state_dict": scheduler.state_dict()}


def main() -> None:
    out = {"deepspeed": __import__("deepspeed").__version__, "steps": STEPS, "cases": [run(c) for c in CASES]}
    with open(os.path.join(HERE, "schedules.json"), "w") as handle:
        json.dump(out, handle, indent=None, separators=(",", ":"))
        handle.write("\n")


if __name__ == "__main__":
    main()
