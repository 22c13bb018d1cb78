"""[Note: DCP checkpoints] (zeroshard/checkpoint/dcp.py), against torch's FSDP2 on gloo: a DCP checkpoint
FSDP2 wrote loads into zeroshard at every stage and training goes on as FSDP2's does; one zeroshard wrote
loads into FSDP2 with `dcp.load` + `set_state_dict` and FSDP2 goes on as zeroshard does (Adam moments
included); either loads at another world size with the same values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zeroshard
from tests.harness import run_distributed, subtests
from tests.reference import gpt_batches, gpt_loss
from tests.zs_common import full_params, gpt_model_fn, make_config
from zeroshard.checkpoint import CheckpointError
from zeroshard.tools.models.gpt import tiny_gpt_config

LR = 1e-2
BATCHES = gpt_batches(tiny_gpt_config(), batch_size=4)


def _fsdp2(seed: int = 0):
    from torch.distributed.fsdp import fully_shard

    model = gpt_model_fn(seed)()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)


def _fsdp2_params(model) -> dict:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _fsdp2_moments(model, optimizer) -> dict:
    return {n: optimizer.state[p]["exp_avg"].full_tensor().clone() for n, p in model.named_parameters()}


def _train(step_fn, model, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = gpt_loss(model, *BATCHES(step, 0, dist.get_rank()))
        step_fn(loss)
        losses.append(loss.item())
    return losses


def _fsdp2_step(optimizer):
    def step(loss):
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def _engine_step(engine):
    def step(loss):
        engine.backward(loss)
        engine.step()

    return step


def _engine(stage: int, seed: int = 5):
    model = gpt_model_fn(seed)()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    engine, *_ = zeroshard.initialize(model=model, optimizer=optimizer, config=make_config(stage))
    return engine


def _moments(engine) -> dict:
    return {n: zeroshard.utils.safe_get_full_optimizer_state(p, "exp_avg") for n, p in engine.module.named_parameters()}


def _assert_equal(ours: dict, theirs: dict, what: str) -> None:
    assert ours.keys() == theirs.keys(), (what, sorted(ours.keys() ^ theirs.keys()))
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), (
            f"{what}: '{name}' differs by {(ours[name] - theirs[name]).abs().max()}"
        )


def _from_fsdp2(root: Path, stage: int) -> None:
    """FSDP2 trains 2 steps and saves; zeroshard loads and trains 2 more: FSDP2's losses and values."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = _fsdp2()
    _train(_fsdp2_step(optimizer), model, range(2))
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(root / f"fsdp2-{stage}"))
    saved = _fsdp2_params(model), _fsdp2_moments(model, optimizer)
    expected = _train(_fsdp2_step(optimizer), model, range(2, 4))
    engine = _engine(stage)
    engine.load_dcp(root / f"fsdp2-{stage}")
    _assert_equal(full_params(engine), saved[0], f"stage {stage}: parameters loaded from FSDP2")
    _assert_equal(_moments(engine), saved[1], f"stage {stage}: Adam's exp_avg loaded from FSDP2")
    assert _train(_engine_step(engine), engine, range(2, 4)) == expected, f"stage {stage}: losses after loading"
    _assert_equal(full_params(engine), _fsdp2_params(model), f"stage {stage}: parameters 2 steps later")
    engine.destroy()


def _to_fsdp2(root: Path, stage: int) -> None:
    """zeroshard trains 2 steps and saves; FSDP2 loads (dcp.load, set_state_dict) and trains 2 more."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    engine = _engine(stage, seed=0)
    _train(_engine_step(engine), engine, range(2))
    engine.save_dcp(root / f"zs-{stage}")
    saved = full_params(engine), _moments(engine)
    expected = _train(_engine_step(engine), engine, range(2, 4))
    model, optimizer = _fsdp2(seed=7)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(root / f"zs-{stage}"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _assert_equal(_fsdp2_params(model), saved[0], f"stage {stage}: parameters FSDP2 loaded")
    _assert_equal(_fsdp2_moments(model, optimizer), saved[1], f"stage {stage}: exp_avg FSDP2 loaded")
    assert _train(_fsdp2_step(optimizer), model, range(2, 4)) == expected, f"stage {stage}: FSDP2's losses"
    _assert_equal(_fsdp2_params(model), full_params(engine), f"stage {stage}: parameters 2 steps later")
    engine.destroy()


def _errors(root: Path) -> None:
    engine = _engine(1)
    with pytest.raises(CheckpointError, match="not a DCP checkpoint"):
        engine.load_dcp(root)
    other = gpt_model_fn(0, n_embd=64)()  # another width: every shape differs
    optimizer = torch.optim.AdamW(other.parameters(), lr=LR)
    wide, *_ = zeroshard.initialize(model=other, optimizer=optimizer, config=make_config(1))
    wide.save_dcp(root / "wide")
    with pytest.raises(CheckpointError, match=r"'model\.\S+' is \[\d+(, \d+)*\], the model's"):
        engine.load_dcp(root / "wide")
    wide.destroy()
    engine.destroy()


def _two_ranks(rank: int, world: int, root: str) -> None:
    root = Path(root)
    subtests([dict(stage=s) for s in (0, 1, 2, 3)], lambda stage: _from_fsdp2(root, stage))
    subtests([dict(stage=s) for s in (1, 3)], lambda stage: _to_fsdp2(root, stage))
    _errors(root)
    engine = _engine(3, seed=0)
    _train(_engine_step(engine), engine, range(2))
    engine.save_dcp(root / "at2")
    values = full_params(engine), _moments(engine)  # collective
    if rank == 0:
        torch.save(values, root / "at2.pt")
    engine.destroy()


def _four_ranks(rank: int, world: int, root: str) -> None:
    """The 2-rank checkpoint at 4 ranks: into zeroshard (stage 2) and into FSDP2, the same values."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    root = Path(root)
    params, moments = torch.load(root / "at2.pt")
    engine = _engine(2)
    engine.load_dcp(root / "at2")
    _assert_equal(full_params(engine), params, "parameters at 4 ranks")
    _assert_equal(_moments(engine), moments, "exp_avg at 4 ranks")
    engine.destroy()
    model, optimizer = _fsdp2(seed=7)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(root / "at2"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _assert_equal(_fsdp2_params(model), params, "FSDP2 at 4 ranks")


def test_dcp_checkpoints_move_between_fsdp2_and_zeroshard(tmp_path):
    run_distributed(_two_ranks, 2, timeout=300, root=str(tmp_path))
    run_distributed(_four_ranks, 4, timeout=300, root=str(tmp_path))
