"""Shared by the checkpoint tests: build an engine like a user does, train micro steps, read back."""

from __future__ import annotations

import torch

import zeroshard
from tests.reference import gpt_batches, gpt_loss
from tests.zs_common import adamw, gpt_model_fn, make_config
from zeroshard.tools.models.gpt import tiny_gpt_config

SCHEDULER = {
    "type": "WarmupLR",
    "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02, "warmup_num_steps": 6, "warmup_type": "linear"},
}


def build_engine(
    stage: int,
    *,
    seed: int = 0,
    gas: int = 1,
    clip: float = 0.0,
    micro: int = 4,
    scheduler: bool = True,
    optimizer_fn=adamw,
    zero: dict | None = None,
    precision: str = "fp32",
    extras: dict | None = None,
    **model_overrides,
):
    model = gpt_model_fn(seed, **model_overrides)()
    config = make_config(stage, gas, clip, micro, **(zero or {}))
    if precision != "fp32":  # fp16: a short window, so that the loss scale moves within a test
        config[precision] = {"enabled": True, **({"loss_scale_window": 2} if precision == "fp16" else {})}
    config["zeroshard"]["comm_timeout_s"] = 30
    config["zeroshard"].update(extras or {})
    if scheduler:
        config["scheduler"] = SCHEDULER
    engine, _, _, _ = zeroshard.initialize(model=model, optimizer=optimizer_fn(model.parameters()), config=config)
    return engine


def train_micro_steps(engine, batches, start: int, count: int) -> dict:
    """Micro steps [start, start + count) of a run (step = index // gas, micro = index % gas)."""
    gas, rank = engine.gradient_accumulation_steps(), engine.global_rank
    losses, lrs = [], []
    for index in range(start, start + count):
        inputs, targets = batches(index // gas, index % gas, rank)
        loss = gpt_loss(engine, inputs, targets)
        engine.backward(loss)
        lrs.append(engine.get_lr())
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "lrs": lrs}


def full_params(engine) -> dict[str, torch.Tensor]:
    module = engine.module
    with engine.gathered_parameters(list(module.parameters())):
        return {n: p.detach().clone() for n, p in module.named_parameters()}


def tiny_batches(seed: int = 0):
    return gpt_batches(tiny_gpt_config(), batch_size=4, seed=seed)


def assert_equal_params(ours: dict, ref: dict, what: str) -> None:
    assert ours.keys() == ref.keys(), what
    for name in ref:
        difference = (ours[name] - ref[name]).abs().max()
        assert torch.equal(ours[name], ref[name]), f"{what}: '{name}' differs by {difference}"
