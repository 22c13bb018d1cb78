"""What happens to gradients between two optimizer steps.

Item 8, several backward() calls before one step() (a GAN's or a multi-loss script's pattern, with
gradient_accumulation_steps 1): gradients of every backward since the last step are summed, as in
torch; each backward is averaged over the ranks as DDP averages one backward. Oracle: the
single-process emulation of 2 ranks (tests/reference.train_single with reduce_every_micro_step, the
backwards being its micro steps), bit for bit, at every stage, with and without offload; both
patterns: two forwards and backwards, and one forward whose graph is backpropagated twice
(retain_graph).

Item 3, zero_grad(): discards every gradient accumulated since the last step and goes back to the
start of the accumulation window (DeepSpeed's meaning). A run that drops a micro-batch (backward,
then zero_grad() instead of step()) equals, bit for bit, the run that never had it; without the
zero_grad() the gradient norm differs, so the comparison can fail.

Also the stage-0 norm, summed when asked ([Note: the stage-0 norm, computed when asked]): asked by
one rank alone right after step() it is the oracle's norm (no collective, so nothing hangs and the
run goes on equal to the oracle), and stays; first asked after the next backward it is None, with
a warning.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import zeroshard
from tests.harness import run_distributed, subtests
from tests.reference import gpt_batches, gpt_loss, train_single
from tests.zs_common import adamw, assert_close, gpt_model_fn, make_config
from zeroshard.tools.models.gpt import tiny_gpt_config

STEPS = 3
BATCHES = gpt_batches(tiny_gpt_config(), batch_size=4)
SETTINGS = [
    dict(stage=0, offload=None),
    dict(stage=1, offload=None),
    dict(stage=2, offload=None),
    dict(stage=3, offload=None),
    dict(stage=1, offload="cpu"),
    dict(stage=2, offload="cpu"),
    dict(stage=3, offload="cpu"),
    dict(stage=3, offload="nvme"),
]


def _config(stage: int, offload: str | None, nvme: str, gas: int = 1, clip: float = 0.0) -> dict:
    zero = {}
    if offload:  # small sub-groups, so that the streamed step cuts every shard
        zero = {"offload_optimizer": {"device": offload, "nvme_path": nvme}, "sub_group_size": 1000}
    return make_config(stage, gas, clip, **zero)


def _engine(stage, offload, nvme, gas=1, clip=0.0):
    model = gpt_model_fn()()
    engine, *_ = zeroshard.initialize(
        model=model, optimizer=adamw(model.parameters()), config=_config(stage, offload, nvme, gas, clip)
    )
    return engine


def _params(engine) -> dict:
    with engine.gathered_parameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


# ---------------------------------------------------------------- item 8


def _two_backwards(stage, offload, nvme, retain_graph: bool) -> None:
    engine = _engine(stage, offload, nvme)
    rank = engine.global_rank
    out = {"losses": [], "params_per_step": []}
    for step in range(STEPS):
        losses = []
        if retain_graph:  # one forward, its graph backpropagated twice
            loss = gpt_loss(engine, *BATCHES(step, 0, rank))
            engine.backward(loss / 2, retain_graph=True)
            engine.backward(loss / 2)
            losses = [loss.item()] * 2
        else:
            for micro in range(2):
                loss = gpt_loss(engine, *BATCHES(step, micro, rank))
                engine.backward(loss / 2)
                losses.append(loss.item())
        engine.step()
        out["losses"].append(losses)
        out["params_per_step"].append(_params(engine))
    out["params"] = _params(engine)
    engine.destroy()
    batches = (lambda step, micro, r: BATCHES(step, 0, r)) if retain_graph else BATCHES
    ref = train_single(
        gpt_model_fn(),
        batches,
        optimizer_fn=adamw,
        steps=STEPS,
        grad_accum=2,
        reduce_every_micro_step=True,
        world_size=2,
        record_params=True,
    )
    if rank != 0:  # train_single reports rank 0's losses
        out["losses"] = ref["losses"]
    assert_close(out, ref, exact=True, what=f"stage {stage} offload {offload} retain_graph {retain_graph}")


# ---------------------------------------------------------------- item 3


def _drop_run(stage, offload, nvme, gas: int, drop: str | None) -> dict:
    """STEPS steps; at step 1 a micro-batch is dropped: `drop` = "zero_grad" (its backward, then
    zero_grad(), then the whole step again), "kept" (its backward, no zero_grad()), None (never had it)."""
    engine = _engine(stage, offload, nvme, gas)
    rank = engine.global_rank
    norms = []
    for step in range(STEPS):
        first = 0
        if step == 1 and drop is not None:
            if gas > 1:  # the window's first micro step is done, then the bad one comes
                engine.backward(gpt_loss(engine, *BATCHES(step, 0, rank)))
                engine.step()
                first = 1
            engine.backward(gpt_loss(engine, *BATCHES(99, 0, rank)))  # the dropped micro-batch
            if drop == "zero_grad":
                engine.zero_grad()
                assert engine.micro_steps == engine.global_steps * gas, "back at the window's start"
                first = 0
        for micro in range(first, gas):
            engine.backward(gpt_loss(engine, *BATCHES(step, micro, rank)))
            engine.step()
        norms.append(engine.get_global_grad_norm())
    out = {"norms": norms, "params": _params(engine), "steps": engine.global_steps}
    engine.destroy()
    return out


def _zero_grad_case(stage, offload, nvme, gas) -> dict:
    clean = _drop_run(stage, offload, nvme, gas, None)
    dropped = _drop_run(stage, offload, nvme, gas, "zero_grad")
    kept = _drop_run(stage, offload, nvme, gas, "kept")
    assert dropped["steps"] == clean["steps"] == STEPS
    assert dropped["norms"] == clean["norms"], (dropped["norms"], clean["norms"])
    for name, value in clean["params"].items():
        assert torch.equal(dropped["params"][name], value), f"'{name}' differs"
    assert kept["norms"][1] != clean["norms"][1], "the dropped micro-batch changes the gradient"
    return {"clean": clean["norms"][1], "kept": kept["norms"][1]}


# ---------------------------------------------------------------- the stage-0 norm, when asked


def _norm_when_asked(clip: float) -> dict:
    engine = _engine(0, None, "", clip=clip)
    rank = engine.global_rank
    norms, losses = [], []
    for step in range(STEPS):
        loss = gpt_loss(engine, *BATCHES(step, 0, rank))
        engine.backward(loss)
        engine.step()
        losses.append([loss.item()])
        if rank == 0 or clip:  # rank 1 never asks: a collective here would hang rank 0
            norms.append(engine.get_global_grad_norm())
    engine.backward(gpt_loss(engine, *BATCHES(STEPS, 0, rank)))  # overwrites the last step's gradient
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        late = engine.get_global_grad_norm()
    params = _params(engine)
    engine.destroy()
    ref = train_single(gpt_model_fn(), BATCHES, optimizer_fn=adamw, steps=STEPS, clip=clip, world_size=2)
    what = f"stage 0 clip {clip}"
    for a, b in zip(norms, ref["grad_norms"]):
        assert abs(a - b) <= 1e-12 * b, (what, a, b)
    assert len(norms) == (STEPS if rank == 0 or clip else 0), what
    if clip or rank == 0:  # computed for clipping, or asked in time: still there, no warning
        assert late == norms[-1] and not caught, (what, late, [str(w.message) for w in caught])
    else:  # never asked before the next backward overwrote the gradient
        assert late is None, (what, late)
        assert any("computed when asked" in str(w.message) for w in caught), (what, [str(w.message) for w in caught])
    ours = losses if rank == 0 else ref["losses"]  # train_single reports rank 0's losses
    assert_close({"losses": ours, "params": params}, ref, exact=True, what=what)
    return {"clip": clip, "norms": norms}


def _worker(rank: int, world: int, *, tmp: str) -> dict:
    nvme = os.path.join(tmp, f"nvme{rank}")
    backwards = subtests([dict(s, nvme=nvme, retain_graph=r) for s in SETTINGS for r in (False, True)], _two_backwards)
    norms = subtests([dict(s, nvme=nvme, gas=g) for s in SETTINGS for g in (1, 2)], _zero_grad_case)
    asked = subtests([dict(clip=0.0), dict(clip=0.05)], _norm_when_asked)
    return {"backwards": backwards, "norms": norms, "asked": asked}


@pytest.mark.slow
def test_backwards_sum_and_zero_grad_discards(tmp_path):
    report = run_distributed(_worker, 2, timeout=900, tmp=str(tmp_path))[0]
    print("grad norm at the step with a dropped micro-batch (clean vs kept):", report["norms"])
