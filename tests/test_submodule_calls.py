"""Calling modules inside a stage-3 model directly, outside the engine's forward (1 and 2 gloo ranks):
PEFT's `generate` (which runs the base model's forward, never the PeftModel's) through
`engine.module.generate(...)` as DeepSpeed scripts call it, at stages 0-3, gives the tokens of the same
model unsharded, and training around it keeps DDP's losses bit for bit; the base model's forward,
`get_input_embeddings()(ids)`, a vision tower of the root unit and a layer inside a block, each called
on its own, give the unsharded model's outputs; after each call, and after one that raises, nothing is
left gathered. See [Note: calls below a unit's module] in core/wrap.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroshard
from tests.extras import needs
from tests.harness import run_distributed, subtests
from tests.hf_models import ENV, VOCAB, batches, causal_lm_loss, peft_fn, prompt_and_length
from tests.reference import train_ddp
from tests.zs_common import adamw, assert_close, full_params, make_config
from zeroshard.core.unit import UnitState

pytestmark = [needs("transformers", extra="hf"), needs("peft", extra="dev")]


def _engine(model: nn.Module, stage: int):
    return zeroshard.initialize(model=model, optimizer=adamw(model.parameters()), config=make_config(stage))[0]


def _nothing_gathered(engine, after: str) -> None:
    left = [u.name for u in engine.units if u.reshards and u.state is not UnitState.SHARDED]
    assert not left, f"units left gathered after {after}: {left}"
    if engine.zero_optimization_stage() == 3:
        assert all(p.numel() == 0 for p in engine.module.parameters()), f"parameters left gathered after {after}"


def _generate(model, rank: int, stage: int, world: int) -> torch.Tensor:
    prompt, new_tokens = prompt_and_length(rank)  # rank 1 stops first: synced_gpus keeps rank 0 company
    return model.generate(
        input_ids=prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        synced_gpus=stage == 3 and world > 1,  # as DeepSpeed-Chat passes it
    )


def _peft_generate(kind: str, stage: int) -> None:
    """`engine.module.generate()` of a PEFT model, and the base model's forward and the input embedding
    called on their own, equal the unsharded PEFT model's."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    oracle = peft_fn(kind)().eval()
    engine = _engine(peft_fn(kind)(), stage)
    engine.eval()
    model = engine.module
    with torch.no_grad():
        got, expected = _generate(model, rank, stage, world), _generate(oracle, rank, stage, world)
        assert torch.equal(got, expected), f"{kind} stage {stage}: generate gave\n{got}\nunsharded\n{expected}"
        _nothing_gathered(engine, "generate()")
        ids = got[:, :8]
        base = model.get_base_model()  # the transformers model under the adapters
        assert torch.equal(base(input_ids=ids).logits, oracle.get_base_model()(input_ids=ids).logits)
        _nothing_gathered(engine, "the base model's forward")
        assert torch.equal(model.get_input_embeddings()(ids), oracle.get_input_embeddings()(ids))
        _nothing_gathered(engine, "get_input_embeddings()(ids)")
    engine.destroy()


def _prefetch_order_after_a_lone_call(kind: str) -> None:
    """Stage 3: the input embedding called on its own before any generation records a one-unit
    inference order; the first `generate()` records the whole model's instead, so later passes
    prefetch (each layer finds the next one gathering ahead of it)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    engine = _engine(peft_fn(kind)(), 3)
    engine.eval()
    model, lifecycle = engine.module, engine.lifecycle
    with torch.no_grad():
        for _ in range(2):
            model.get_input_embeddings()(torch.arange(2, 10).reshape(1, 8))
        assert [u.name for u in lifecycle.inference_order] == ["<root>"]
        _generate(model, rank, 3, world)
    assert [u.name for u in lifecycle.inference_order] == [u.name for u in [engine.units[-1], *engine.units[:-1]]]
    layers = engine.units[:-1]
    ahead = []  # at each layer's forward: is the next layer already gathering or gathered?
    hooks = [
        unit.module.register_forward_pre_hook(
            lambda module, args, i=i: ahead.append(layers[i + 1].state is not UnitState.SHARDED)
        )
        for i, unit in enumerate(layers[:-1])
    ]
    with torch.no_grad():
        _generate(model, rank, 3, world)
    for hook in hooks:
        hook.remove()
    assert ahead and all(ahead), ahead
    _nothing_gathered(engine, "generate()")
    engine.destroy()


def _training_around_generate(kind: str) -> None:
    """Stage 3: two steps, `engine.module.generate()`, a third step: the losses and parameters of DDP's
    three steps, bit for bit (generation changes nothing a step reads)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    build = peft_fn(kind)
    ref = train_ddp(build, batches, optimizer_fn=adamw, steps=3, reduce_every_micro_step=True, loss_fn=causal_lm_loss)
    engine = _engine(build(), 3)
    losses = []
    for step in range(3):
        if step == 2:
            engine.eval()
            with torch.no_grad():
                _generate(engine.module, rank, 3, world)
            _nothing_gathered(engine, "generate() between steps")
            engine.train()
        loss = causal_lm_loss(engine, *batches(step, 0, rank))
        engine.backward(loss)
        engine.step()
        losses.append([loss.item()])
    assert_close({"losses": losses, "params": full_params(engine)}, ref, exact=True, what=f"{kind} around generate")
    engine.destroy()


def _whole_model_generate(kind: str) -> None:
    """Stage 3, `generate_gather: "whole"`: `engine.generate()` gathers the model once per call (the
    all-gathered bytes are one model's, however many tokens), gives the unsharded model's tokens
    without `synced_gpus`, and frees everything when it returns; "units" gathers per token."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    oracle = peft_fn(kind)().eval()
    prompt, new_tokens = prompt_and_length(rank)  # rank 1 stops first
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    expected = oracle.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), **kwargs)
    gathered = {}
    for mode in ("whole", "units"):
        model = peft_fn(kind)()
        config = {**make_config(3), "zeroshard": {"comm_timeout_s": 60, "generate_gather": mode}}
        engine = zeroshard.initialize(model=model, optimizer=adamw(model.parameters()), config=config)[0]
        engine.eval()
        counter = engine.comm.counter
        before = counter.paper["all_gather"]
        got = engine.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), **kwargs)
        gathered[mode] = counter.paper["all_gather"] - before
        assert torch.equal(got, expected), f"{kind} {mode}: generate gave\n{got}\nunsharded\n{expected}"
        _nothing_gathered(engine, f"generate() gathering {mode}")
        model_bytes = 4 * sum(u.numel for u in engine.units if u.reshards)
        engine.destroy()
    if world > 1:  # one rank copies its shard in place of all-gathers: [Note: gathering in place at one rank]
        assert gathered["whole"] == model_bytes, (gathered, model_bytes)
        forwards = 8  # "units": synced_gpus runs as many as the longest rank's
        assert gathered["units"] == forwards * model_bytes, (gathered, model_bytes, forwards)


class Captioner(nn.Module):
    """A vision tower in the root unit (not in the largest ModuleList), two blocks, an untied head."""

    def __init__(self):
        super().__init__()
        self.vision = nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 16))
        self.embed = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.LayerNorm(16)) for _ in range(2))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, pixels, ids):  # (B, 12), (B, T) -> (B, T, V)
        hidden = self.embed(ids) + self.vision(pixels)[:, None]  # (B, T, C)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


def _captioner() -> Captioner:
    torch.manual_seed(0)
    return Captioner()


def _captioner_loss(model, inputs, targets):
    pixels = torch.linspace(-1, 1, 12).expand(inputs.shape[0], 12) * (inputs[:, :1] / VOCAB)  # (B, 12)
    logits = model(pixels, inputs)  # (B, T, V)
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _vision_tower_by_hand(stage: int) -> None:
    """The vision tower (root unit), a Linear inside a block, the head: each called on its own between
    training steps gives the unsharded model's outputs; a call that raises leaves nothing gathered; the
    training around the calls keeps DDP's losses bit for bit."""
    rank = torch.distributed.get_rank()
    ref = train_ddp(
        _captioner, batches, optimizer_fn=adamw, steps=2, reduce_every_micro_step=True, loss_fn=_captioner_loss
    )
    engine = _engine(_captioner(), stage)
    assert [u.name for u in engine.units] == ["blocks.0", "blocks.1", "head", "<root>"]
    losses = []
    pixels, hidden = torch.randn(3, 12), torch.randn(3, 16)
    for step in range(2):
        loss = _captioner_loss(engine, *batches(step, 0, rank))
        engine.backward(loss)
        engine.step()
        losses.append([loss.item()])
        oracle = _captioner()
        oracle.load_state_dict(full_params(engine))
        model = engine.module
        with torch.no_grad():
            for name, call in {
                "vision": lambda m: m.vision(pixels),
                "blocks.1.0": lambda m: m.blocks[1][0](hidden),
                "head": lambda m: m.head(hidden),
            }.items():
                assert torch.equal(call(model), call(oracle)), f"stage {stage}: {name} called on its own"
                _nothing_gathered(engine, f"{name} called on its own")
        with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
            model.vision(torch.randn(3, 5))
        _nothing_gathered(engine, "a call that raised")
    assert_close({"losses": losses, "params": full_params(engine)}, ref, exact=True, what=f"captioner stage {stage}")
    engine.destroy()


def _worker(rank: int, world_size: int) -> None:
    cases = [dict(case="generate", kind=k, stage=s) for k in ("llama", "gpt2") for s in (0, 1, 2, 3)]
    cases += [dict(case="vision", stage=s) for s in (1, 3)]
    cases += [dict(case="whole", kind="llama"), dict(case="order", kind="llama")]
    if world_size == 2:
        cases += [dict(case="around", kind="llama")]

    def run(case: str, **kw):
        if case == "generate":
            return _peft_generate(kw["kind"], kw["stage"])
        if case == "vision":
            return _vision_tower_by_hand(kw["stage"])
        if case == "whole":
            return _whole_model_generate(kw["kind"])
        if case == "order":
            return _prefetch_order_after_a_lone_call(kw["kind"])
        return _training_around_generate(kw["kind"])

    subtests(cases, run)


@pytest.mark.parametrize("world_size", [1, 2])
def test_submodule_calls_gather_what_they_need(world_size):
    run_distributed(_worker, world_size, timeout=300, env=ENV)
