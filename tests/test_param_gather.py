"""`zeroshard.overlap_param_gather` (on by default): the all-gather of updated parameters after a
step overlaps the next forward ([Note: deferred parameter gather] in core/param_gather.py).

Against DDP, bit for bit at 2 ranks (stages 1/2, with and without accumulation, gradient clipping,
the parameters read between step and forward through every reader that must wait first, and the
script's own reads after `wait_parameters()`, [Note: reads before the next forward]); the gathers
really are left in flight by step(). Failed calls with the gathers in flight, and a step that fails
on one rank named at the healthy rank's next forward, are tests/test_failures.py's cases: its
engines run the default config.
"""

from __future__ import annotations

import pytest
import torch

import zeroshard
from tests.harness import run_distributed, subtests
from tests.reference import gpt_batches, gpt_loss, train_ddp
from tests.zs_common import adamw, assert_close, full_params, gpt_model_fn, make_config, train_engine
from zeroshard.tools.models.gpt import tiny_gpt_config

STEPS = 4
BATCHES = gpt_batches(tiny_gpt_config(), batch_size=4)


def _config(stage: int, gas: int = 1, clip: float = 0.0, **zero) -> dict:
    config = make_config(stage, gas, clip, **zero)
    config["zeroshard"]["overlap_param_gather"] = True
    return config


def _parity_case(stage: int, gas: int, clip: float) -> None:
    ref = train_ddp(
        gpt_model_fn(),
        BATCHES,
        optimizer_fn=adamw,
        steps=STEPS,
        grad_accum=gas,
        clip=clip,
        reduce_every_micro_step=stage >= 2,
        record_params=True,
    )
    # record_params reads the parameters after every step through gathered_parameters, which waits.
    ours = train_engine(gpt_model_fn(), BATCHES, config=_config(stage, gas, clip), steps=STEPS, record_params=True)
    assert_close(ours, ref, exact=True, what=f"stage {stage} gas {gas} clip {clip}")
    reductions = gas if stage == 2 else 1  # stage 2 reduce-scatters every micro step
    assert ours["comm_per_step"] == pytest.approx((reductions + 1) * ours["num_parameters"] * 4, rel=0.02)


def _plain_config(stage: int) -> dict:
    config = make_config(stage)
    config["zeroshard"]["overlap_param_gather"] = False
    return config


def _readers_case(stage: int) -> None:
    """Each reader, called right after step() with the gathers in flight, sees the updated values:
    those a run without the option has after its step."""
    plain_config = _plain_config(stage)
    runs = {}
    for overlap in (False, True):
        model = gpt_model_fn()()
        engine, *_ = zeroshard.initialize(
            model=model, optimizer=adamw(model.parameters()), config=_config(stage) if overlap else plain_config
        )
        seen = []
        for step in range(3):
            engine.backward(gpt_loss(engine, *BATCHES(step, 0, engine.global_rank)))
            engine.step()
            if overlap:
                assert engine.sharded._deferred_gather.pending, "step() waited for the gathers"
            reader = step % 3
            if reader == 0:
                seen.append({k: v.clone() for k, v in engine.module.state_dict().items()})
            elif reader == 1:
                seen.append(full_params(engine))
            else:
                seen.append([m.clone() for m in engine.sharded.state_dict()["masters"]])
                seen.append({n: p.detach().clone() for n, p in engine.module.named_parameters()})
            assert not (overlap and engine.sharded._deferred_gather.pending), f"reader {reader} did not wait"
        runs[overlap] = seen
        engine.destroy()
    for a, b in zip(runs[False], runs[True]):
        pairs = zip(a.values(), b.values()) if isinstance(a, dict) else zip(a, b)
        for x, y in pairs:
            assert torch.equal(x, y)


# The script's own reads between step() and the next forward, each in a step of its own: what it
# reads (a clone), and whether it must have waited for the gathers.
SCRIPT_READS = [
    (
        "EMA lerp_ over detached parameters",
        True,
        lambda model, ema: (
            [e.lerp_(p.detach(), 0.5) for e, p in zip(ema, model.parameters())] and [e.clone() for e in ema]
        ),
    ),
    ("p.data.clone()", True, lambda model, ema: [p.data.clone() for p in model.parameters()]),
    ("a view of p.data taken before the step", True, lambda model, ema: [v.clone() for v in ema.views]),
    (
        "torch._foreach_mul over the parameters",
        True,
        lambda model, ema: torch._foreach_mul([p.detach() for p in model.parameters()], 1.0),
    ),
    ("p.norm() for a log line", True, lambda model, ema: [p.norm().detach() for p in model.parameters()]),
    (
        "metadata: shape, dtype, .grad, numel(), module.zero_grad()",
        False,
        lambda model, ema: (
            model.zero_grad()
            or [
                torch.tensor([p.numel(), p.dim()] + list(p.shape))
                for p in model.parameters()
                if p.grad is None and p.dtype == torch.float32
            ]
        ),
    ),
]


class _Ema(list):
    views: list


def _script_reads_case(stage: int) -> None:
    """With the default config, step() returns with the gathers in flight; metadata reads leave them
    so, and each script read in SCRIPT_READS, made after `engine.wait_parameters()` as the rule
    says, sees what a run without the overlap sees."""
    runs = {}
    for overlap in (False, True):
        model = gpt_model_fn()()
        config = make_config(stage) if overlap else _plain_config(stage)  # make_config: the default, on
        engine, *_ = zeroshard.initialize(model=model, optimizer=adamw(model.parameters()), config=config)
        ema = _Ema(p.detach().clone() for p in model.parameters())
        ema.views = [p.data[:3] for p in model.parameters()]  # taken before any step
        seen = []
        for step, (what, waits, read) in enumerate(SCRIPT_READS):
            engine.backward(gpt_loss(engine, *BATCHES(step, 0, engine.global_rank)))
            engine.step()
            gather = engine.sharded._deferred_gather
            assert not overlap or gather.pending, f"step() waited for the gathers: {what}"
            if waits:
                engine.wait_parameters()
            seen.append(read(model, ema))
            assert not (overlap and waits) or not gather.pending, what
            assert not (overlap and not waits) or gather.pending, f"{what} waited for the gathers"
        engine(BATCHES(0, 0, engine.global_rank)[0])  # the next forward waits for the rest
        runs[overlap] = seen
        engine.destroy()
    for (what, _, _), plain, overlapped in zip(SCRIPT_READS, runs[False], runs[True]):
        assert all(torch.equal(a, b) for a, b in zip(plain, overlapped)), what


def _parity_worker(rank: int, world: int) -> None:
    cases = [dict(stage=s, gas=g, clip=c) for s in (1, 2) for g, c in ((1, 0.0), (2, 0.05))]
    subtests(cases, _parity_case)
    subtests([dict(stage=s) for s in (1, 2)], _readers_case)
    subtests([dict(stage=s) for s in (1, 2)], _script_reads_case)


def test_overlapped_gather_matches_ddp_bit_for_bit():
    run_distributed(_parity_worker, 2, timeout=600)
