"""What a step that fails in its update leaves ([Note: failed optimizer steps] in core/optim/rollback.py).

Two ranks, a tiny GPT, two param groups (decay / no decay), torch's AdamW, plain and fused. The
default ("fail_stop") copies nothing and trains bit for bit like `transactional_step: "copy"`, which
copies masters and optimizer state every step. A failure before the update changes nothing with
either; one during the update (a bad `lr` that only the last param group's update rejects, after
earlier flat groups were updated) is undone with "copy", and by default refuses every later call,
naming how many flat groups changed; Ctrl-C during the update stays a KeyboardInterrupt and
refuses later calls the same way.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import zeroshard
from tests.failure_helpers import Injected, assert_same_state, training_state
from tests.harness import run_distributed, subtests
from tests.reference import gpt_batches, gpt_loss
from tests.zs_common import gpt_model_fn, make_config
from zeroshard.core.optim.masked import SlotStates
from zeroshard.core.optim.rollback import UpdateFailed
from zeroshard.tools.models.gpt import tiny_gpt_config

STEPS = 3
BATCHES = gpt_batches(tiny_gpt_config(), batch_size=4)


def _adamw(model, fused: bool):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2, fused=fused
    )


def _engine(stage: int, on_failed_update: str | None = None, fused: bool = False):
    model = gpt_model_fn()()
    config = make_config(stage)
    config["zeroshard"]["comm_timeout_s"] = 20
    if on_failed_update is not None:
        config["zeroshard"]["transactional_step"] = on_failed_update
    engine, *_ = zeroshard.initialize(model=model, optimizer=_adamw(model, fused), config=config)
    return engine


def _micro(engine, step: int) -> float:
    loss = gpt_loss(engine, *BATCHES(step, 0, engine.global_rank))
    engine.backward(loss)
    engine.step()
    return loss.item()


def _alike_case(stage: int, fused: bool) -> None:
    """The default and "copy" train alike; only "copy" copies (masters and Adam's two moments)."""
    runs = {}
    for mode in (None, "copy"):
        engine = _engine(stage, mode, fused)
        losses = [_micro(engine, step) for step in range(STEPS)]
        runs[mode] = (losses, training_state(engine), engine.optimizer.snapshot_peak_bytes)
        masters = sum(g.master.numel() * 4 for g in engine.optimizer.groups)
        engine.destroy()
    assert runs["copy"][0] == runs[None][0], (runs["copy"][0], runs[None][0])
    assert_same_state(runs["copy"][1], runs[None][1], f"stage {stage}: 'copy' against the default")
    assert runs[None][2] == 0, f"the default copied {runs[None][2]} bytes"
    assert runs["copy"][2] >= 3 * masters, f"'copy' copied {runs['copy'][2]} bytes, masters are {masters}"


def _before_update_case(stage: int, mode: str | None) -> None:
    """A failure after the norm and before any group's update changes nothing, in either mode: the
    same step runs again after zero_grad()."""
    engine = _engine(stage, mode)
    _micro(engine, 0)
    before = training_state(engine)
    with mock.patch.object(SlotStates, "plan", side_effect=Injected("planning failed")):
        with pytest.raises(Injected):
            _micro(engine, 1)
    assert_same_state(training_state(engine), before, f"stage {stage}: a step that failed before its update")
    engine.zero_grad()
    _micro(engine, 1)
    engine.destroy()


def _during_update_case(stage: int, mode: str | None) -> None:
    """An lr only the last param group's update rejects: undone with "copy"; by default every later
    call refuses, naming the groups that changed."""
    engine = _engine(stage, mode)
    _micro(engine, 0)
    before = training_state(engine)
    engine.optimizer.param_groups[-1]["lr"] = torch.tensor([1e-2, 1e-2])  # torch's __init__ refuses it
    expected = (RuntimeError, TypeError) if mode == "copy" else UpdateFailed  # torch raises either
    with pytest.raises(expected) as caught:
        _micro(engine, 1)
    engine.optimizer.param_groups[-1]["lr"] = 1e-2
    if mode == "copy":
        assert not isinstance(caught.value, UpdateFailed), caught.value
        assert_same_state(training_state(engine), before, f"stage {stage}: a step the last param group's lr failed")
        engine.zero_grad()
        _micro(engine, 1)
    else:
        total = len(engine.optimizer.groups)
        assert f"of {total} flat groups" in str(caught.value) and "Load the last checkpoint" in str(caught.value)
        engine.zero_grad()
        with pytest.raises(UpdateFailed, match=r"forward\(\) refused"):
            _micro(engine, 1)
        with pytest.raises(UpdateFailed, match=r"step\(\) refused"):
            engine.optimizer.step()
    engine.destroy()


def _interrupted_case(stage: int) -> None:
    """Ctrl-C during the update stays a KeyboardInterrupt; by default every later call refuses."""
    engine = _engine(stage)
    _micro(engine, 0)
    inner = engine.optimizer.optimizer
    real_step = inner.step

    def interrupted(*args, **kwargs):
        real_step(*args, **kwargs)
        raise KeyboardInterrupt

    inner.step = interrupted
    with pytest.raises(KeyboardInterrupt):
        _micro(engine, 1)
    inner.step = real_step
    engine.zero_grad()
    with pytest.raises(UpdateFailed, match=r"step\(\) refused"):
        engine.optimizer.step()
    engine.destroy()


def _worker(rank: int, world: int) -> None:
    subtests([dict(stage=s, fused=f) for s in (0, 1, 2, 3) for f in (False, True)], _alike_case)
    subtests([dict(stage=s, mode=m) for s in (0, 3) for m in (None, "copy")], _before_update_case)
    subtests([dict(stage=s, mode=m) for s in (0, 1, 3) for m in (None, "copy")], _during_update_case)
    subtests([dict(stage=s) for s in (0, 3)], _interrupted_case)


def test_failed_updates_refuse_by_default_and_are_undone_with_copy():
    run_distributed(_worker, 2, timeout=600)
