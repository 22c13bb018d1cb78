"""zero.GatheredParameters: what the modifier rank changes inside the context is what
every rank sees after it, and what training continues from (bit-for-bit against the oracle started from
the same change), at stages 0-3 on a live engine and on a model built under zero.Init before
initialize; other ranks' changes, and all changes without a modifier rank, are discarded."""

from __future__ import annotations

import torch

import zeroshard
from tests.harness import run_distributed, subtests
from tests.reference import gpt_batches, gpt_loss, train_single
from tests.zs_common import adamw, assert_close, full_params, gpt_model_fn, make_config
from zeroshard.compat.zero import GatheredParameters
from zeroshard.tools.models.gpt import tiny_gpt_config

STEPS = 2
BATCHES = gpt_batches(tiny_gpt_config(), batch_size=4)


def _targets(model) -> list:
    return [model.blocks[0].mlp.fc.weight, model.ln_f.bias, model.tok_emb.weight]  # a tied weight too


@torch.no_grad()
def _change(model, rank: int) -> None:
    """Rank 0's change is the one to keep; rank 1 changes something else, to be discarded."""
    fc, bias, emb = _targets(model)
    if rank == 0:
        fc.mul_(0.5)
        bias.fill_(0.25)
        emb[3].add_(1.0)
    else:
        fc.zero_()
        bias.fill_(-7.0)


def _changed_model_fn():
    def build():
        model = gpt_model_fn()()
        _change(model, rank=0)
        return model

    return build


def _train(engine) -> dict:
    out = {"losses": []}
    for step in range(STEPS):
        inputs, targets = BATCHES(step, 0, engine.global_rank)
        loss = gpt_loss(engine, inputs, targets)
        engine.backward(loss)
        engine.step()
        out["losses"].append([loss.item()])
    out["params"] = full_params(engine)
    engine.destroy()
    return out


def _check_against_oracle(ours: dict, what: str) -> None:
    ref = train_single(
        _changed_model_fn(), BATCHES, optimizer_fn=adamw, steps=STEPS, world_size=2, reduce_every_micro_step=True
    )
    if torch.distributed.get_rank() != 0:  # train_single reports rank 0's losses
        ours["losses"] = ref["losses"]
    assert_close(ours, ref, exact=True, what=what)


def _expect_targets(model, expected_model, engine=None) -> None:
    """Every rank sees `expected_model`'s values for the target parameters (gathered again)."""
    targets = _targets(model)
    context = engine.gathered_parameters(targets) if engine is not None else GatheredParameters(targets)
    with context:
        for got, want in zip(targets, _targets(expected_model)):
            assert torch.equal(got.detach(), want.detach()), "a change was lost or a discarded one kept"


def _on_engine(stage: int) -> None:
    model = gpt_model_fn()()
    engine, *_ = zeroshard.initialize(model=model, optimizer=adamw(model.parameters()), config=make_config(stage))
    rank = engine.global_rank
    with GatheredParameters(_targets(model), modifier_rank=0):
        _change(model, rank)
    _expect_targets(model, _changed_model_fn()(), engine)
    _check_against_oracle(_train(engine), f"GatheredParameters on an engine at stage {stage}")


def _without_modifier_changes_are_discarded() -> None:
    model = gpt_model_fn()()
    engine, *_ = zeroshard.initialize(model=model, optimizer=adamw(model.parameters()), config=make_config(3))
    with GatheredParameters(_targets(model)):
        assert all(p.numel() for p in _targets(model)), "not gathered"
        _change(model, engine.global_rank)
    _expect_targets(model, gpt_model_fn()(), engine)
    engine.destroy()


def _before_initialize(stage: int) -> None:
    torch.manual_seed(0)
    with zeroshard.zero.Init():
        model = zeroshard.tools.models.GPT(tiny_gpt_config())
    rank = torch.distributed.get_rank()
    with GatheredParameters(_targets(model)):  # inspection: the values of normal construction
        for got, want in zip(_targets(model), _targets(gpt_model_fn()())):
            assert torch.equal(got.detach(), want.detach())
        _change(model, rank)  # no modifier: discarded
    with GatheredParameters(_targets(model), modifier_rank=0):
        _change(model, rank)
    assert all(p.untyped_storage().nbytes() <= p.element_size() for p in model.parameters()), "left gathered"
    _expect_targets(model, _changed_model_fn()())
    engine, *_ = zeroshard.initialize(model=model, optimizer=adamw(model.parameters()), config=make_config(stage))
    _check_against_oracle(_train(engine), f"GatheredParameters before initialize, stage {stage}")


def _inside_init() -> None:
    """Post-hoc initialisation inside the Init context, the way DeepSpeed documents it."""
    torch.manual_seed(0)
    with zeroshard.zero.Init():
        model = zeroshard.tools.models.GPT(tiny_gpt_config())
        with GatheredParameters(_targets(model), modifier_rank=0):
            _change(model, torch.distributed.get_rank())
    _expect_targets(model, _changed_model_fn()())


def _plain_parameters_need_nothing() -> None:
    layer = torch.nn.Linear(3, 3)
    before = layer.weight.detach().clone()
    with GatheredParameters(layer.weight, modifier_rank=0), GatheredParameters([layer.bias], enabled=False):
        assert torch.equal(layer.weight.detach(), before)


def _worker(rank: int, world: int) -> None:
    subtests([dict(stage=s) for s in (0, 1, 2, 3)], _on_engine)
    subtests([dict(stage=s) for s in (1, 3)], _before_initialize)
    subtests([{}], _without_modifier_changes_are_discarded)
    subtests([{}], _inside_init)
    subtests([{}], _plain_parameters_need_nothing)


def test_gathered_parameters_modify_on_one_rank():
    run_distributed(_worker, 2, timeout=300)
