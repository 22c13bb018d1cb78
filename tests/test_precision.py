"""bf16 / fp16 compute with fp32 master shards, and fp16 dynamic loss scaling.

The oracle is the same recipe written out in one process for 2 emulated ranks: a low-precision copy
of the model computes each rank's gradients, which are averaged the way DDP does (each times 1/N,
summed in rank order) in the reduce dtype, converted to fp32, unscaled, and applied by AdamW to an
fp32 master model whose values are then copied into the low-precision model.
"""

from __future__ import annotations

import copy

import pytest
import torch

import zeroshard
from tests.harness import run_distributed, subtests
from tests.reference import gpt_batches, gpt_loss, sum_in_order
from tests.zs_common import gather_masters, gpt_model_fn, make_config
from zeroshard.tools.models.gpt import tiny_gpt_config

STEPS = 20
BATCHES = gpt_batches(tiny_gpt_config(), batch_size=4)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = 2e-3  # relative, per tensor norm, after 20 steps (measured: 0 at 2 ranks; see below)


def _mixed_reference(dtype: torch.dtype, steps: int, world: int, scale: float) -> dict:
    master = gpt_model_fn()()
    compute = copy.deepcopy(master).to(dtype)
    optimizer = torch.optim.AdamW(master.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(steps):
        per_rank = []
        for rank in range(world):
            compute.zero_grad(set_to_none=True)
            loss = gpt_loss(compute, *BATCHES(step, 0, rank))
            (loss.float() * scale).backward()
            per_rank.append([p.grad * (1.0 / world) for p in compute.parameters()])
            losses.append(loss.item()) if rank == 0 else None
        for p32, grads in zip(master.parameters(), zip(*per_rank)):
            total = sum_in_order(list(grads))
            p32.grad = total.float() * (1.0 / scale) if scale != 1.0 else total.float()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p16, p32 in zip(compute.parameters(), master.parameters()):
                p16.copy_(p32)
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in master.named_parameters()}}


def _config(stage: int, precision: str, **fp16) -> dict:
    config = make_config(stage)
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    else:
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, **fp16}
    return config


def _engine(config):
    model = gpt_model_fn()()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    engine, *_ = zeroshard.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _masters(engine) -> list[torch.Tensor]:
    return [g.master.detach().clone() for g in engine.groups]


def _matches_recipe(stage: int, precision: str) -> dict:
    dtype = DTYPES[precision]
    engine = _engine(_config(stage, precision))
    rank = engine.global_rank
    assert all(p.dtype == dtype for p in engine.module.parameters())
    assert all(g.master.dtype == torch.float32 for g in engine.groups)
    losses = []
    for step in range(STEPS):
        _, loss = engine(*BATCHES(step, 0, rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    # Compare the fp32 master weights: gather them through the engine's groups.
    full = gather_masters(engine)
    assert engine.skipped_steps == 0
    engine.destroy()
    scale = 2.0**8 if precision == "fp16" else 1.0
    ref = _mixed_reference(dtype, STEPS, engine_world(), scale)
    worst = 0.0
    for name, value in ref["params"].items():
        error = float((full[name] - value).norm() / value.norm().clamp_min(1e-12))
        worst = max(worst, error)
        assert error <= TOLERANCE, (precision, stage, name, error)
    if rank == 0:
        assert max(abs(a - b) for a, b in zip(losses, ref["losses"])) <= 1e-2, (losses, ref["losses"])
    assert sum(losses[-3:]) < 0.8 * sum(losses[:3]), f"loss must fall: {losses}"
    return {
        "precision": precision,
        "stage": stage,
        "worst_relative_error": worst,
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }


def engine_world() -> int:
    return torch.distributed.get_world_size()


def _overflow_skips_everywhere(stage: int) -> dict:
    engine = _engine(_config(stage, "fp16", hysteresis=1))
    rank = engine.global_rank
    inject = {"on": False}
    weight = engine.module.blocks[0].mlp.fc.weight

    def poison(grad):  # rank 1 only: an inf in one gradient
        return grad * float("inf") if inject["on"] and rank == 1 else grad

    handle = weight.register_hook(poison)
    for step in range(4):
        inject["on"] = step == 2
        if step == 2:
            before = _masters(engine)
            states = copy.deepcopy(engine.optimizer.state_dict()["state"])
            scale_before = engine.get_loss_scale()
        _, loss = engine(*BATCHES(step, 0, rank))
        engine.backward(loss)
        engine.step()
        if step == 2:
            assert engine.skipped_steps == 1, "every rank skips the overflowing step"
            assert engine.get_loss_scale() == scale_before / 2, "and halves the scale"
            assert all(torch.equal(a, b) for a, b in zip(before, _masters(engine))), "masters untouched"
            after = engine.optimizer.state_dict()["state"]
            for key, state in states.items():
                for name, value in state.items():
                    assert torch.equal(torch.as_tensor(value), torch.as_tensor(after[key][name])), name
    assert engine.skipped_steps == 1 and engine.global_steps == 4
    handle.remove()
    engine.destroy()
    return {"stage": stage, "scale": scale_before}


def _scale_grows_after_window() -> None:
    engine = _engine(_config(2, "fp16", loss_scale_window=3))
    start = engine.get_loss_scale()
    scales = []
    for step in range(4):
        _, loss = engine(*BATCHES(step, 0, engine.global_rank))
        engine.backward(loss)
        engine.step()
        scales.append(engine.get_loss_scale() / start)
    # DeepSpeed 0.19.8: 3 clean steps make a window; the 4th step doubles the scale.
    assert scales == [1, 1, 1, 2], scales
    engine.destroy()


def _worker(rank: int, world: int) -> dict:
    recipe = subtests([dict(stage=s, precision=p) for p in ("bf16", "fp16") for s in range(4)], _matches_recipe)
    subtests([dict(stage=s) for s in range(4)], _overflow_skips_everywhere)
    subtests([{}], _scale_grows_after_window)
    return {"recipe": recipe}


@pytest.mark.parametrize("world", [2])
@pytest.mark.slow
def test_mixed_precision(world):
    reports = run_distributed(_worker, world, timeout=600)
    assert reports[0]["recipe"], reports


def test_unsupported_half_precision_is_named(monkeypatch):
    """A torch build without fp16 kernels on this device fails at initialize, naming fp16."""
    from zeroshard.core.precision import check_supported

    def no_half_layer_norm(*args, **kwargs):
        raise RuntimeError("\"LayerNormKernelImpl\" not implemented for 'Half'")

    monkeypatch.setattr(torch.nn.functional, "layer_norm", no_half_layer_norm)
    with pytest.raises(RuntimeError, match="cannot train in fp16 on cpu"):
        check_supported(torch.float16, torch.device("cpu"))
    check_supported(torch.float32, torch.device("cpu"))  # fp32 needs no probe
