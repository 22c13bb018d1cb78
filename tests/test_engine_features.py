"""Engine options against the oracle (2 ranks, bit-for-bit): persistence threshold, no overlap,
optimizer param groups, wrap by class name, optimizer + scheduler from the DeepSpeed config, the
DeepSpeed "Adam" semantics; and destroy() leaving nothing behind."""

from __future__ import annotations

import gc

import psutil
import pytest
import torch

import zeroshard
from tests.harness import run_distributed, subtests
from tests.reference import gpt_batches, train_single
from tests.zs_common import adamw, assert_close, gpt_model_fn, make_config, train_engine
from zeroshard.compat.schedulers import WarmupLR
from zeroshard.tools.models.gpt import tiny_gpt_config

STEPS = 6
BATCHES = gpt_batches(tiny_gpt_config(), batch_size=4)


def _grouped_adamw(params):
    """HF-style groups: no weight decay for biases and norms."""
    params = list(params)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 5e-3}], lr=1e-2
    )


def _fused_adamw(params):
    """What the config's "Adam" builds: DeepSpeed's FusedAdam is torch's fused kernel here."""
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)


def _sgd_momentum(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)


def _against_oracle(stage: int, option: str) -> None:
    config, optimizer_fn, ref_optimizer_fn, scheduler_fn = make_config(stage), adamw, adamw, None
    if option == "persistence threshold":
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 100  # norms, biases
    elif option == "no overlap":
        config["zero_optimization"]["overlap_comm"] = False
    elif option == "param groups":
        optimizer_fn = ref_optimizer_fn = _grouped_adamw
    elif option == "sgd momentum":
        optimizer_fn = ref_optimizer_fn = _sgd_momentum
    elif option == "wrap by class":
        config["zeroshard"]["wrap_modules"] = ["CausalSelfAttention", "MLP"]
    elif option == "config optimizer and scheduler":
        # DeepSpeed's "Adam" is AdamW (adam_w_mode defaults to true) with weight_decay default 0.
        config["optimizer"] = {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.1}}
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 4}}
        optimizer_fn = None
        ref_optimizer_fn = _fused_adamw
        scheduler_fn = lambda opt: WarmupLR(opt, warmup_max_lr=1e-2, warmup_num_steps=4)  # noqa: E731
    ref = train_single(
        gpt_model_fn(),
        BATCHES,
        optimizer_fn=ref_optimizer_fn,
        steps=STEPS,
        world_size=2,
        reduce_every_micro_step=True,
        lr_scheduler_fn=scheduler_fn,
        record_params=True,
    )
    ours = train_engine(
        gpt_model_fn(), BATCHES, config=config, optimizer_fn=optimizer_fn, steps=STEPS, record_params=True
    )
    if torch.distributed.get_rank() != 0:  # train_single reports rank 0's losses
        ours["losses"] = ref["losses"]
    assert_close(ours, ref, exact=True, what=f"{option} at stage {stage}")


def _destroy_releases_everything(stage: int) -> dict:
    """Build and destroy engines repeatedly: hooks gone, RSS flat after the first rounds."""
    rss = []
    for _ in range(6):
        model = gpt_model_fn(n_layer=4, n_embd=128)()
        engine = train_engine_once(model, stage)
        engine.destroy()
        hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
        assert hooks == 0, f"{hooks} module hooks left"
        assert all(not getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters())
        del engine, model
        gc.collect()
        rss.append(psutil.Process().memory_info().rss)
    growth = rss[-1] - rss[2]
    assert growth < 8 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB over 3 rebuilds: {rss}"
    return {"stage": stage, "rss_mib": [round(r / 2**20, 1) for r in rss]}


def train_engine_once(model, stage):
    engine, *_ = zeroshard.initialize(model=model, optimizer=adamw(model.parameters()), config=make_config(stage))
    inputs, targets = BATCHES(0, 0, engine.global_rank)
    _, loss = engine(inputs, targets)
    engine.backward(loss)
    engine.step()
    return engine


def _worker(rank: int, world: int) -> dict:
    options = [
        "persistence threshold",
        "no overlap",
        "param groups",
        "sgd momentum",
        "wrap by class",
        "config optimizer and scheduler",
    ]
    subtests([dict(stage=s, option=o) for o in options for s in (1, 3)], _against_oracle)
    return {"rss": subtests([dict(stage=s) for s in (0, 3)], _destroy_releases_everything)}


@pytest.mark.slow
def test_engine_options_match_oracle_and_destroy_is_clean():
    # glibc returns freed blocks to the OS above this size, so RSS reflects live memory.
    run_distributed(_worker, 2, timeout=600, env={"MALLOC_MMAP_THRESHOLD_": "65536"})
