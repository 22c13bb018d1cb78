"""Activation checkpointing: per-unit checkpointing from the config and the
`checkpoint(fn, *args)` API give results bit-for-bit equal to the oracle at stages 0-3 (2 ranks, fp32);
under stage 3 recomputation runs on gathered parameters, costs no extra all-gather, and every unit is
freed after backward; fewer activations are kept; options that mean nothing here are reported."""

from __future__ import annotations

import warnings

import pytest
import torch

import zeroshard
from tests.harness import run_distributed, subtests
from tests.reference import gpt_batches, gpt_loss, train_single
from tests.zs_common import adamw, assert_close, make_config, train_engine
from zeroshard import checkpointing
from zeroshard.config import ConfigKeyNotActedOnWarning
from zeroshard.core.unit import UnitState
from zeroshard.tools.models.gpt import GPT, tiny_gpt_config

STEPS = 3
CONFIG = tiny_gpt_config(n_layer=4)
BATCHES = gpt_batches(CONFIG, batch_size=4)


class PairCheckpointedGPT(GPT):
    """A model that checkpoints pairs of blocks itself, as Megatron-style code calls DeepSpeed's API."""

    def forward(self, idx, targets=None):
        B, T = idx.shape
        x = self.drop(self.tok_emb(idx) + self.pos_emb(torch.arange(T)))  # (B, T, C)
        for i in range(0, len(self.blocks), 2):
            x = checkpointing.checkpoint(self._pair, x, i)  # a non-tensor argument, as DeepSpeed allows
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        loss = torch.nn.functional.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T))
        return logits, loss

    def _pair(self, x, i):
        return self.blocks[i + 1](self.blocks[i](x))


def _model_fn(cls=GPT, **overrides):
    def build():
        torch.manual_seed(0)
        return cls(tiny_gpt_config(n_layer=4, **overrides))

    return build


def _checkpointed_config(stage: int) -> dict:
    config = make_config(stage)
    config["zeroshard"]["activation_checkpointing_units"] = True
    return config


def _against_oracle(stage: int, api: str) -> None:
    ref = train_single(
        _model_fn(),
        BATCHES,
        optimizer_fn=adamw,
        steps=STEPS,
        world_size=2,
        reduce_every_micro_step=True,
        record_params=True,
    )
    if api == "units":
        ours = train_engine(_model_fn(), BATCHES, config=_checkpointed_config(stage), steps=STEPS, record_params=True)
    else:
        ours = train_engine(
            _model_fn(PairCheckpointedGPT), BATCHES, config=make_config(stage), steps=STEPS, record_params=True
        )
    if torch.distributed.get_rank() != 0:  # train_single reports rank 0's losses
        ours["losses"] = ref["losses"]
    assert_close(ours, ref, exact=True, what=f"checkpointing ({api}) at stage {stage}")


def _one_step_observed(checkpointed: bool, dropout: float = 0.0) -> dict:
    """Stage 3, one step: all-gathers, block forwards, activation bytes kept by autograd, final params."""
    model = _model_fn(dropout=dropout)()
    config = _checkpointed_config(3) if checkpointed else make_config(3)
    engine, *_ = zeroshard.initialize(model=model, optimizer=adamw(model.parameters()), config=config)
    forwards = [0]
    for block in model.blocks:
        block.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    saved = [0]

    def pack(tensor):
        if not isinstance(tensor, torch.nn.Parameter):
            saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    inputs, targets = BATCHES(0, 0, engine.global_rank)
    gathers_before = engine.comm.counter.calls["all_gather"]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # sees what is kept outside regions
        loss = gpt_loss(engine, inputs, targets)
    engine.backward(loss)
    assert all(u.state is UnitState.SHARDED for u in engine.units if u.reshards), "a unit stayed gathered"
    assert all(p.numel() == 0 for u in engine.units if u.reshards for g in u.groups for p in g.params)
    gathers = engine.comm.counter.calls["all_gather"] - gathers_before
    engine.step()
    with engine.gathered_parameters(list(model.parameters())):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.destroy()
    return {"gathers": gathers, "forwards": forwards[0], "saved": saved[0], "loss": loss.item(), "params": params}


def _stage3_recomputation() -> None:
    plain, ckpt = _one_step_observed(False), _one_step_observed(True)
    blocks = CONFIG.n_layer
    assert plain["forwards"] == blocks and ckpt["forwards"] == 2 * blocks, (plain["forwards"], ckpt["forwards"])
    # The unit is gathered once for its backward and the recomputation runs inside that gathering.
    assert ckpt["gathers"] == plain["gathers"], (ckpt["gathers"], plain["gathers"])
    assert ckpt["saved"] < plain["saved"] / 2, (ckpt["saved"], plain["saved"])
    assert ckpt["loss"] == plain["loss"]
    for name, value in plain["params"].items():
        assert torch.equal(ckpt["params"][name], value), name


def _dropout_replayed() -> None:
    """Recomputation replays the RNG state, so dropout masks (and results) are those of the forward."""
    plain, ckpt = _one_step_observed(False, dropout=0.2), _one_step_observed(True, dropout=0.2)
    assert ckpt["loss"] == plain["loss"]
    for name, value in plain["params"].items():
        assert torch.equal(ckpt["params"][name], value), name


def _transformers_layers_routed() -> None:
    """`cpu_checkpointing` routes a transformers model's own checkpointed layers through zeroshard's
    `checkpoint` ([Note: transformers' checkpointed layers in host memory]); on a CPU it has nothing to
    move, and training is bit for bit that of transformers' own checkpointing."""
    from zeroshard.tools.models import words

    def lm_loss(engine, inputs, targets):
        return engine(input_ids=inputs, labels=targets).loss

    def model_fn():
        model = words.llama(vocab=43, hidden=32, layers=2)
        model.activation_checkpointing_enable()
        return model

    def batches(step, micro, rank):
        ids = torch.randint(0, 43, (4, 12), generator=torch.Generator().manual_seed(100 * step + 10 * rank + micro))
        return ids, ids

    routed = make_config(3)
    routed["activation_checkpointing"] = {"cpu_checkpointing": True}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigKeyNotActedOnWarning)  # "no GPU in this run"
        model = model_fn()
        engine, *_ = zeroshard.initialize(model=model, optimizer=adamw(model.parameters()), config=routed)
        layers = engine.module.model.layers
        assert all(
            m.gradient_checkpointing and m._gradient_checkpointing_func is checkpointing.checkpoint for m in layers
        )
        engine.destroy()
        ours = train_engine(model_fn, batches, config=routed, steps=STEPS, loss_fn=lm_loss, record_params=True)
    theirs = train_engine(model_fn, batches, config=make_config(3), steps=STEPS, loss_fn=lm_loss, record_params=True)
    assert_close(ours, theirs, exact=True, what="transformers' layers checkpointed by zeroshard")
    checkpointing.reset()


def _worker(rank: int, world: int) -> None:
    subtests([dict(stage=s, api=a) for s in (0, 1, 2, 3) for a in ("units", "function")], _against_oracle)
    subtests([{}], _stage3_recomputation)
    subtests([{}], _dropout_replayed)


@pytest.mark.slow
def test_activation_checkpointing_matches_oracle_and_frees_units():
    run_distributed(_worker, 2, timeout=300)


def _transformers_worker(rank: int, world: int) -> None:
    subtests([{}], _transformers_layers_routed)


def test_cpu_checkpointing_routes_transformers_layers():
    pytest.importorskip("transformers", reason="the [hf] extra installs transformers")
    run_distributed(_transformers_worker, 2, timeout=180)


def test_options_without_effect_are_reported_once_by_name():
    checkpointing.reset()
    try:
        with pytest.warns(ConfigKeyNotActedOnWarning) as caught:
            policy = checkpointing.configure(
                None,
                deepspeed_config={
                    "activation_checkpointing": {
                        "partition_activations": True,
                        "cpu_checkpointing": True,
                        "number_checkpoints": 4,
                        "contiguous_memory_optimization": True,
                        "synchronize_checkpoint_boundary": True,
                        "profile": True,
                    }
                },
            )
        messages = " ".join(str(w.message) for w in caught)
        for key in (
            "partition_activations",
            "cpu_checkpointing",
            "number_checkpoints",
            "contiguous_memory_optimization",
            "synchronize_checkpoint_boundary",
            "profile",
        ):
            assert f"activation_checkpointing.{key}'" in messages, key
        assert checkpointing.is_configured() and not policy.cpu_checkpointing  # CPU run: a no-op
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            checkpointing.configure()  # nothing set: nothing to report
        with pytest.raises(ValueError, match="model parallelism"):
            checkpointing.configure(object())
    finally:
        checkpointing.reset()


def test_checkpoint_function_single_process():
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    expected = torch.autograd.grad(layer(x).tanh().sum(), (x, layer.weight))
    got = torch.autograd.grad(
        checkpointing.checkpoint(lambda t, scale: layer(t).tanh() * scale, x, 1.0).sum(), (x, layer.weight)
    )
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert zeroshard.checkpointing.non_reentrant_checkpoint is checkpointing.checkpoint
