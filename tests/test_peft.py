"""PEFT fine-tuning on zeroshard (2 and 4 gloo ranks, transformers GPT-2 and Llama built from configs):
LoRA adapters on frozen base weights train with the losses and parameters of DDP at every stage, bit for
bit at 2 ranks, also with gradient accumulation and clipping, with CPU offload, under activation
checkpointing (reentrant and not), and across a checkpoint save and load. Frozen models in general:
a frozen embedding, adapters on one layer only (a fully frozen layer above an adapted one is read by
backward to carry the gradient down, and is freed again once it has: [Note: frozen parameters in
backward] in core/lifecycle.py). At stage 3 the frozen base is partitioned like everything else (each
rank holds 1/N of it), and `save_pretrained` of the PEFT model writes an adapter that
`PeftModel.from_pretrained` loads with the engine's logits."""

from __future__ import annotations

import os

import pytest
import torch

import zeroshard
from tests.extras import needs
from tests.harness import run_distributed, subtests
from tests.hf_models import ENV, batches, causal_lm_loss, model_fn, peft_fn
from tests.reference import train_ddp
from tests.zs_common import adamw, assert_close, full_params, make_config
from zeroshard.core.unit import UnitState

pytestmark = [needs("transformers", extra="hf"), needs("peft", extra="dev")]

STEPS = 3
BLOCKS = {"gpt2": "transformer.h", "llama": "model.layers"}


def _train(engine, steps: range, gas: int = 1) -> list[list[float]]:
    rank, losses = torch.distributed.get_rank(), []
    for step in steps:
        micro_losses = []
        for micro in range(gas):
            loss = causal_lm_loss(engine, *batches(step, micro, rank))
            engine.backward(loss)
            engine.step()
            micro_losses.append(loss.item())
        losses.append(micro_losses)
    return losses


def _engine(build, stage: int, **config):
    model = build()
    return zeroshard.initialize(model=model, optimizer=adamw(model.parameters()), config=make_config(stage, **config))[
        0
    ]


def _against_ddp(
    kind: str,
    stage: int,
    *,
    exact: bool,
    gas: int = 1,
    clip: float = 0.0,
    layers=None,
    checkpointing=None,
    offload: bool = False,
    modules_to_save=None,
) -> None:
    build = peft_fn(kind, layers, checkpointing, modules_to_save)
    ref = train_ddp(
        build,
        batches,
        optimizer_fn=adamw,
        steps=STEPS,
        grad_accum=gas,
        clip=clip,
        reduce_every_micro_step=stage >= 2,  # stages 2/3 reduce each micro-batch's gradient as it comes
        loss_fn=causal_lm_loss,
    )
    zero = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}} if offload else {}
    engine = _engine(build, stage, gas=gas, clip=clip, **zero)
    trainable = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or "modules_to_save" in n for n in trainable), sorted(trainable)
    ours = {"losses": _train(engine, range(STEPS), gas), "params": full_params(engine)}
    what = f"{kind} stage {stage} gas {gas} clip {clip} layers {layers} checkpointing {checkpointing} offload {offload}"
    assert_close(ours, ref, exact=exact, what=what)
    engine.destroy()


def _frozen_layer_freed_in_backward(kind: str) -> None:
    """Adapters on block 0 only: block 1 is all frozen, and backward reads it (the gradient to block 0
    flows through it). It is gathered for that and freed once its inputs' gradients are in, before
    block 0's adapters get theirs; at most two blocks are gathered at once."""
    engine = _engine(peft_fn(kind, layers=[0]), 3)
    blocks = [u for u in engine.units if u.name != "<root>"]
    assert [u.name.removeprefix("base_model.model.") for u in blocks] == [f"{BLOCKS[kind]}.{i}" for i in (0, 1)]
    first, second = blocks
    assert not second.trainable_params and second.frozen
    seen = []  # block 1's state when block 0's adapter gets its gradient
    adapter = next(p for n, p in first.module.named_parameters() if "lora_A" in n)
    handle = adapter.register_hook(lambda grad: seen.append(second.state))
    live = engine.lifecycle.live
    _train(engine, range(1))
    live.reset_peak()
    _train(engine, range(1, 2))
    handle.remove()
    assert seen == [UnitState.SHARDED, UnitState.SHARDED], seen
    root = next(u for u in engine.units if u.name == "<root>")
    assert live.peak <= root.numel * root.reshards + 2 * max(u.numel for u in blocks), (live.peak, root.numel)
    engine.destroy()


def _frozen_base_partitioned(kind: str) -> None:
    """At stage 3 every rank holds 1/N of the frozen base (within padding), as of the trainable part."""
    engine = _engine(peft_fn(kind), 3)
    world = torch.distributed.get_world_size()
    frozen = [g for g in engine.groups if not g.trainable]
    total = sum(p.numel() for p in model_fn(kind)().parameters())  # the base model: all of it frozen
    assert sum(g.layout.numel for g in frozen) == total
    held = sum(g.layout.shard_numel for g in frozen)
    assert total / world <= held <= total / world + world * len(frozen), (held, total, world)
    engine.destroy()


def _resumes_from_checkpoint(kind: str, stage: int, root: str) -> None:
    build = peft_fn(kind)
    straight = _engine(build, stage)
    expected = {"losses": _train(straight, range(4)), "params": full_params(straight)}
    straight.destroy()
    first = _engine(build, stage)
    _train(first, range(2))
    path = os.path.join(root, f"{kind}-{stage}")
    first.save_checkpoint(path)
    first.destroy()
    resumed = _engine(peft_fn(kind), stage)
    resumed.load_checkpoint(path)
    ours = {"losses": [[0.0]] * 2 + _train(resumed, range(2, 4)), "params": full_params(resumed)}
    expected["losses"][:2] = [[0.0]] * 2
    assert_close(ours, expected, exact=True, what=f"{kind} stage {stage} resumed")
    resumed.destroy()


def _saves_adapter(kind: str, root: str, persistent: bool) -> None:
    """`save_pretrained` of the PEFT model at stage 3: the adapters are whole on every rank when they
    are below the persistence threshold; otherwise gathered first, as with DeepSpeed."""
    import peft

    rank = torch.distributed.get_rank()
    threshold = 100_000 if persistent else 0
    engine = _engine(peft_fn(kind), 3, stage3_param_persistence_threshold=threshold)
    _train(engine, range(2))
    model = engine.module
    adapters = [p for n, p in model.named_parameters() if "lora_" in n]
    out = os.path.join(root, f"adapter-{kind}-{persistent}")
    with zeroshard.zero.GatheredParameters(adapters, enabled=not persistent):
        if rank == 0:
            model.save_pretrained(out)
    engine.eval()
    probe = torch.arange(2, 18).reshape(2, 8)  # (2, T)
    with torch.no_grad():
        logits = engine(input_ids=probe).logits
    engine.destroy()
    torch.distributed.barrier()
    loaded = peft.PeftModel.from_pretrained(model_fn(kind)(), out).eval()
    with torch.no_grad():
        reloaded = loaded(input_ids=probe).logits
    assert torch.equal(reloaded, logits), f"{kind}: logits differ by {(reloaded - logits).abs().max()}"


def _worker_2(rank: int, world_size: int, root: str) -> None:
    cases = [dict(case="ddp", kind=k, stage=s) for k in ("gpt2", "llama") for s in (0, 1, 2, 3)]
    cases += [
        dict(case="ddp", kind="llama", stage=3, gas=2, clip=1.0),
        dict(case="ddp", kind="gpt2", stage=2, gas=2, clip=1.0),
        dict(case="ddp", kind="gpt2", stage=3, offload=True),
        dict(case="ddp", kind="llama", stage=3, layers=[0]),
        dict(case="ddp", kind="gpt2", stage=1, layers=[1]),
        dict(case="ddp", kind="llama", stage=3, checkpointing="reentrant"),
        dict(case="ddp", kind="gpt2", stage=3, checkpointing="non-reentrant"),
        # the root's trainable head gets its gradient first; the frozen final norm is read after it
        dict(case="ddp", kind="llama", stage=3, modules_to_save=["lm_head"]),
        dict(case="freed", kind="llama"),
        dict(case="partitioned", kind="gpt2"),
        dict(case="resume", kind="llama", stage=3),
        dict(case="resume", kind="gpt2", stage=1),
        dict(case="save", kind="gpt2", persistent=True),
        dict(case="save", kind="llama", persistent=False),
    ]

    def run(case: str, kind: str, **kw):
        if case == "ddp":
            return _against_ddp(kind, kw.pop("stage"), exact=True, **kw)
        if case == "freed":
            return _frozen_layer_freed_in_backward(kind)
        if case == "partitioned":
            return _frozen_base_partitioned(kind)
        if case == "resume":
            return _resumes_from_checkpoint(kind, kw["stage"], root)
        return _saves_adapter(kind, root, kw["persistent"])

    subtests(cases, run)


@pytest.mark.slow
def test_lora_matches_ddp_and_saves_adapters_at_two_ranks(tmp_path):
    run_distributed(_worker_2, 2, timeout=600, env=ENV, root=str(tmp_path))


def _worker_4(rank: int, world_size: int) -> None:
    cases = [dict(kind="gpt2", stage=3), dict(kind="llama", stage=3), dict(kind="llama", stage=1)]
    subtests(cases, lambda kind, stage: _against_ddp(kind, stage, exact=False))
    _frozen_base_partitioned("llama")


@pytest.mark.slow
def test_lora_matches_ddp_at_four_ranks():
    run_distributed(_worker_4, 4, timeout=600, env=ENV)
