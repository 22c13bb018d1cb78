"""DeepSpeed's lr schedules: the warmup curves against values computed by hand from DeepSpeed's
formulas; OneCycle and LRRangeTest against the curves DeepSpeed 0.19.8 wrote into
tests/data/deepspeed/schedules.json (make_schedules.py there)."""

import json
import logging
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zeroshard
from zeroshard.compat.schedulers import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)
from zeroshard.config import ConfigError, load_config

DEEPSPEED_CURVES = json.loads((Path(__file__).parent / "data/deepspeed/schedules.json").read_text())


class DuckOptimizer:
    """Not a torch Optimizer: the schedules only need ``param_groups``."""

    def __init__(self, *lrs):
        self.param_groups = [{"lr": lr, "params": []} for lr in lrs]


def _lr_at(scheduler, iteration):
    scheduler.step(iteration)
    return scheduler.optimizer.param_groups[0]["lr"]


# --- WarmupLR -------------------------------------------------------------------------------------


def test_warmup_lr_log():
    opt = DuckOptimizer(0.5)
    s = WarmupLR(opt, warmup_min_lr=0.001, warmup_max_lr=0.01, warmup_num_steps=10)
    # Construction writes the lr of iteration -1 (warmup_min_lr) for the first optimizer step.
    assert opt.param_groups[0]["lr"] == 0.001 and s.get_last_lr() == [0.001] and s.last_batch_iteration == -1
    expected = {
        0: 0.001,  # log(1) = 0
        1: 0.001 + 0.009 * math.log(2) / math.log(10),
        4: 0.001 + 0.009 * math.log(5) / math.log(10),
        9: 0.01,
        10: 0.01,
        500: 0.01,
    }
    for iteration, lr in expected.items():
        assert _lr_at(s, iteration) == pytest.approx(lr, rel=1e-12, abs=0)


def test_warmup_lr_linear_and_stepping():
    opt = DuckOptimizer(0.5)
    s = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=10, warmup_type="linear")
    lrs = []
    for _ in range(12):
        s.step()
        lrs.append(s.get_last_lr()[0])
    assert lrs == pytest.approx([0.0, 0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008, 0.009, 0.01, 0.01])
    assert s.last_batch_iteration == 11


def test_warmup_lr_max_defaults_to_group_zero_lr():
    opt = DuckOptimizer(0.3, 0.7)
    s = WarmupLR(opt, warmup_num_steps=4, warmup_type="linear")
    assert s.max_lrs == [0.3, 0.3]  # DeepSpeed takes group 0's lr for every group
    assert _lr_at(s, 2) == pytest.approx(0.15)


def test_warmup_num_steps_below_two_is_two():
    s = WarmupLR(DuckOptimizer(1.0), warmup_max_lr=1.0, warmup_num_steps=1, warmup_type="linear")
    assert s.warmup_num_steps == 2 and _lr_at(s, 1) == pytest.approx(0.5)


def test_per_group_min_and_max():
    opt = DuckOptimizer(1.0, 1.0)
    s = WarmupLR(opt, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 0.2], warmup_num_steps=4, warmup_type="linear")
    s.step(2)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.5, 0.15])
    with pytest.raises(ValueError, match="expected 2 values for warmup_min_lr"):
        WarmupLR(opt, warmup_min_lr=[0.0, 0.1, 0.2])


# --- WarmupDecayLR --------------------------------------------------------------------------------


def test_warmup_decay_lr():
    s = WarmupDecayLR(
        DuckOptimizer(0.5),
        total_num_steps=20,
        warmup_min_lr=0.0,
        warmup_max_lr=0.01,
        warmup_num_steps=10,
        warmup_type="linear",
    )
    # gamma = (T - i) / max(1, T - W) after warmup, floored at 0.
    expected = {5: 0.005, 9: 0.009, 10: 0.01, 11: 0.009, 15: 0.005, 19: 0.001, 20: 0.0, 30: 0.0}
    for iteration, lr in expected.items():
        assert _lr_at(s, iteration) == pytest.approx(lr, abs=1e-15)


def test_warmup_decay_lr_log_warmup():
    s = WarmupDecayLR(DuckOptimizer(0.5), total_num_steps=100, warmup_max_lr=0.02, warmup_num_steps=8)
    assert _lr_at(s, 3) == pytest.approx(0.02 * math.log(4) / math.log(8))
    assert _lr_at(s, 54) == pytest.approx(0.02 * (100 - 54) / (100 - 8))


# --- WarmupCosineLR -------------------------------------------------------------------------------


def test_warmup_cosine_lr():
    opt = DuckOptimizer(0.1)
    s = WarmupCosineLR(
        opt, total_num_steps=20, warmup_min_ratio=0.1, warmup_num_steps=10, cos_min_ratio=0.01, warmup_type="linear"
    )
    assert opt.param_groups[0]["lr"] == 0.0  # iteration -1, as DeepSpeed

    def cosine(k):  # k = i - W + 1
        return 0.01 + 0.99 * (1 + math.cos(math.pi * k / 10)) / 2

    expected = {
        0: 0.1 * 0.1,
        5: 0.1 * (0.1 + 0.9 * 0.5),
        10: 0.1 * cosine(1),  # 0.0975773...
        14: 0.1 * 0.505,
        19: 0.1 * 0.01,
        # DeepSpeed does not clamp past total_num_steps: the cosine rises again.
        29: 0.1 * 1.0,
    }
    for iteration, lr in expected.items():
        assert _lr_at(s, iteration) == pytest.approx(lr, rel=1e-12), iteration
    assert expected[10] == pytest.approx(0.0975773, rel=1e-6)  # the hand value, written out


def test_warmup_cosine_lr_scales_each_group_and_log_warmup():
    opt = DuckOptimizer(0.1, 0.02)
    s = WarmupCosineLR(opt, total_num_steps=100, warmup_num_steps=10)
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]
    s.step(3)
    ratio = math.log(4) / math.log(10)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1 * ratio, 0.02 * ratio])
    assert s.get_lr_ratio() == pytest.approx(ratio)


def test_warmup_cosine_lr_total_equal_to_warmup_is_an_error():
    with pytest.raises(ValueError, match="total_num_steps != warmup_num_steps"):
        WarmupCosineLR(DuckOptimizer(0.1), total_num_steps=10, warmup_num_steps=10)


# --- state, resume, tensors -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda opt, it: WarmupLR(opt, warmup_max_lr=0.01, warmup_num_steps=10, last_batch_iteration=it),
        lambda opt, it: WarmupDecayLR(opt, 50, warmup_num_steps=10, last_batch_iteration=it),
        lambda opt, it: WarmupCosineLR(opt, 50, warmup_num_steps=10, last_batch_iteration=it),
        lambda opt, it: OneCycle(opt, 0.01, 0.1, 0.5, 5, decay_step_size=2, last_batch_iteration=it),
        lambda opt, it: LRRangeTest(opt, 0.01, 4, last_batch_iteration=it),
    ],
    ids=["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"],
)
def test_state_dict_resume_matches_uninterrupted(make):
    straight = make(DuckOptimizer(0.1), -1)
    for _ in range(15):
        straight.step()
    assert straight.state_dict() == {"last_batch_iteration": 14}

    resumed_opt = DuckOptimizer(0.1)
    resumed = make(resumed_opt, 3)
    assert resumed_opt.param_groups[0]["lr"] == 0.1  # not -1: nothing written until step()
    with pytest.raises(RuntimeError, match="call step"):
        resumed.get_last_lr()
    resumed.load_state_dict(straight.state_dict())
    straight.step()
    resumed.step()
    assert resumed.get_last_lr() == straight.get_last_lr()
    assert resumed.last_batch_iteration == 15


def test_tensor_lr_stays_a_tensor():
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([param], lr=torch.tensor(0.01))
    lr_tensor = opt.param_groups[0]["lr"]
    s = WarmupLR(opt, warmup_max_lr=0.01, warmup_num_steps=10, warmup_type="linear")
    s.step(4)
    assert opt.param_groups[0]["lr"] is lr_tensor and float(lr_tensor) == pytest.approx(0.004)
    assert s.get_last_lr() == pytest.approx([0.004])


# --- from the config ------------------------------------------------------------------------------


def test_build_scheduler_from_config():
    cfg = load_config(
        {
            "scheduler": {
                "type": "WarmupDecayLR",
                "params": {
                    "total_num_steps": 20,
                    "warmup_max_lr": 0.01,
                    "warmup_num_steps": 10,
                    "warmup_type": "linear",
                },
            }
        },
        1,
    )
    opt = DuckOptimizer(0.5)
    s = build_scheduler(cfg.scheduler, opt)
    assert isinstance(s, WarmupDecayLR) and opt.param_groups[0]["lr"] == 0.0
    assert _lr_at(s, 15) == pytest.approx(0.005)
    assert build_scheduler(None, opt) is None


def test_build_cosine_from_config_uses_optimizer_lr():
    cfg = load_config(
        {"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10}}}, 1
    )
    s = build_scheduler(cfg.scheduler, DuckOptimizer(0.2))
    assert isinstance(s, WarmupCosineLR) and s.org_lrs == [0.2] and s.cos_min_ratio == 0.0001


# --- OneCycle and LRRangeTest against DeepSpeed 0.19.8 ---------------------------------------------


def _optimizer_like(case: dict) -> DuckOptimizer:
    """The param groups make_schedules.py gave DeepSpeed's schedule: torch Adam's or SGD's keys."""
    opt = DuckOptimizer(*case["lrs"])
    for group in opt.param_groups:
        group.update({"betas": (0.9, 0.999)} if case["optimizer"] == "adam" else {"momentum": 0.9})
    return opt


def _snapshot(opt: DuckOptimizer, case: dict) -> dict:
    moms = [g["betas"][0] if case["optimizer"] == "adam" else g["momentum"] for g in opt.param_groups]
    return {"lr": [g["lr"] for g in opt.param_groups], "mom": moms}


@pytest.mark.parametrize("case", DEEPSPEED_CURVES["cases"], ids=lambda case: case["name"])
def test_curve_equals_deepspeed(case):
    opt = _optimizer_like(case)
    cls = {"OneCycle": OneCycle, "LRRangeTest": LRRangeTest}[case["type"]]
    scheduler = cls(opt, **case["params"])
    curve = [_snapshot(opt, case)]
    for _ in range(DEEPSPEED_CURVES["steps"]):
        scheduler.step()
        curve.append(_snapshot(opt, case))
        assert scheduler.get_last_lr() == curve[-1]["lr"]
    assert curve == case["curve"]  # exactly: same floats, step by step
    assert scheduler.state_dict() == case["state_dict"]
    # [Note: OneCycle momentum]: the second beta is the optimizer's own (DeepSpeed writes 0.99).
    assert all(g.get("betas", (0, 0.999))[1] == 0.999 for g in opt.param_groups)


def test_onecycle_without_betas_warns_and_keeps_momentum(caplog):
    opt = DuckOptimizer(0.1)
    opt.param_groups[0]["momentum"] = 0.9
    with caplog.at_level(logging.WARNING, logger="zeroshard.compat.schedulers"):
        s = OneCycle(opt, 0.01, 0.1, cycle_first_step_size=4)
    assert "cycle_momentum is disabled" in caplog.text and "DuckOptimizer" in caplog.text
    assert not s.cycle_momentum and s.get_mom() is None
    s.step(2)
    assert opt.param_groups[0] == {"lr": pytest.approx(0.01 + 0.09 * 3 / 4), "params": [], "momentum": 0.9}


def test_onecycle_tensor_beta_stays_a_tensor():
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([param], lr=0.01, betas=(torch.tensor(0.9), torch.tensor(0.999)))
    beta1 = opt.param_groups[0]["betas"][0]
    s = OneCycle(opt, 0.001, 0.01, cycle_first_step_size=4, cycle_min_mom=0.8, cycle_max_mom=0.9)
    s.step(1)  # scale 2/4: momentum halfway from max to min
    assert opt.param_groups[0]["betas"][0] is beta1 and float(beta1) == pytest.approx(0.85)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda o: OneCycle(o, 0.1, 1.0, cycle_first_step_size=0), "cycle_first_step_size must be positive, got 0"),
        (lambda o: OneCycle(o, 0.1, 1.0, cycle_second_step_size=-1), "cycle_second_step_size must be non-negative"),
        (lambda o: OneCycle(o, [0.1, 0.2], 1.0), "expected 1 values for cycle_min_lr"),
        (lambda o: LRRangeTest(o, lr_range_test_step_size=0), "lr_range_test_step_size must be a positive integer"),
        (lambda o: LRRangeTest(o, lr_range_test_step_size=2.5), "lr_range_test_step_size must be a positive integer"),
    ],
)
def test_cycle_schedule_arguments_are_checked(make, message):
    with pytest.raises(ValueError, match=message):
        make(DuckOptimizer(0.1))


@pytest.mark.parametrize(
    "params, message",
    [
        ({"cycle_max_lr": 0.1}, "scheduler.params.cycle_min_lr"),
        ({"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 0}, "cycle_first_step_size"),
        ({"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_min_mom": 1.5}, "cycle_min_mom"),
        ({"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_min_momentum": 0.8}, "did you mean"),
    ],
)
def test_onecycle_config_errors_name_the_key(params, message):
    with pytest.raises(ConfigError, match=message):
        load_config({"scheduler": {"type": "OneCycle", "params": params}}, 1)


def test_build_cycle_schedules_from_config():
    cfg = load_config({"scheduler": {"type": "onecycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1}}}, 1)
    assert cfg.scheduler.type == "OneCycle"
    s = build_scheduler(cfg.scheduler, DuckOptimizer(0.5))
    assert isinstance(s, OneCycle) and s.first_step_size == s.second_step_size == 2000.0
    assert s.optimizer.param_groups[0]["lr"] == 0.01
    cfg = load_config({"scheduler": {"type": "LRRangeTest", "params": {"lr_range_test_step_size": 10}}}, 1)
    s = build_scheduler(cfg.scheduler, DuckOptimizer(0.5))
    assert isinstance(s, LRRangeTest) and s.min_lr == [1e-3] and not s.staircase
    with pytest.raises(ConfigError, match="lr_range_test_step_size"):
        load_config({"scheduler": {"type": "LRRangeTest", "params": {"lr_range_test_step_size": 0}}}, 1)


def test_deepspeed_import_path():
    from zeroshard.runtime.lr_schedules import LRRangeTest as RangeTestByPath, OneCycle as OneCycleByPath

    assert OneCycleByPath is OneCycle and RangeTestByPath is LRRangeTest
    assert zeroshard.runtime.lr_schedules.OneCycle is OneCycle


def test_onecycle_from_config_drives_the_engine(tmp_path):
    """initialize() with a config OneCycle in a process group of this process alone: the engine's
    lr and betas[0] follow DeepSpeed's curve step by step."""
    case = next(c for c in DEEPSPEED_CURVES["cases"] if c["name"] == "onecycle_adam_decay")
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": case["lrs"][0]}},
        "scheduler": {"type": "OneCycle", "params": case["params"]},
        "zero_optimization": {"stage": 2},
    }
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "pg"), 1), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        engine, optimizer, _, scheduler = zeroshard.initialize(model=model, config=config)
        assert isinstance(scheduler, OneCycle) and engine.lr_scheduler is scheduler
        seen = []
        for _ in range(25):
            seen.append({"lr": engine.get_lr(), "mom": [g["betas"][0] for g in optimizer.param_groups]})
            engine.backward(engine(torch.randn(2, 4)).square().mean())
            engine.step()
        assert seen == case["curve"][:25]
        assert optimizer.param_groups[0]["betas"][1] == 0.999
        engine.destroy()
    finally:
        dist.destroy_process_group()
