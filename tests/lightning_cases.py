"""The rank side of tests/test_integration_lightning.py: a LightningModule over the tiny GPT, the
same training as a plain engine loop, and the cases that compare them. A module of its own so that
collecting the tests does not import Lightning."""

from __future__ import annotations

import os

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import zeroshard
from tests.harness import subtests
from tests.reference import gpt_batches
from tests.zs_common import adamw, full_params, gpt_model_fn, make_config
from zeroshard.tools.models.gpt import tiny_gpt_config

MICRO = 2
ROWS = 32  # 8 micro batches per rank


class TinyGPT(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = gpt_model_fn()()
        self.losses: list[float] = []

    def forward(self, inputs, targets):
        return self.net(inputs, targets)

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        _, loss = self.net(inputs, targets)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return adamw(self.parameters())


def dataset(rows: int = ROWS) -> TensorDataset:
    inputs, targets = gpt_batches(tiny_gpt_config(), batch_size=rows)(0, 0, 0)  # (rows, T) each
    return TensorDataset(inputs, targets)


def strategy_config(stage: int) -> dict:
    config = make_config(stage, micro=MICRO)
    del config["gradient_accumulation_steps"], config["gradient_clipping"]  # the Trainer owns them
    return config


def lightning_trainer(stage: int, accumulate: int, clip: float, steps: int, root: str, **kwargs):
    from zeroshard.integrations.lightning import ZeroShardStrategy

    return L.Trainer(
        strategy=ZeroShardStrategy(stage=stage, config=strategy_config(stage)),
        accelerator="cpu",
        devices=2,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip or None,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        **kwargs,
    )


def plain_loop(stage: int, accumulate: int, clip: float, steps: int) -> dict:
    """The same training without Lightning: the engine, one batch per micro step, drawn by the sampler
    Lightning puts on a training loader (shuffled, seed 0, even when the loader does not shuffle)."""
    module = TinyGPT()
    config = make_config(stage, gas=accumulate, clip=clip, micro=MICRO)
    engine, *_ = zeroshard.initialize(model=module, optimizer=module.configure_optimizers(), config=config)
    data = dataset()
    sampler = DistributedSampler(data, num_replicas=engine.world_size, rank=engine.global_rank, shuffle=True, seed=0)
    losses = []
    for inputs, targets in list(DataLoader(data, batch_size=MICRO, sampler=sampler))[: steps * accumulate]:
        _, loss = engine(inputs, targets)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    out = {"losses": losses, "params": full_params(engine)}
    engine.destroy()
    return out


def _against_plain_loop(stage: int, accumulate: int, clip: float, root: str) -> None:
    steps = 3
    module = TinyGPT()
    trainer = lightning_trainer(stage, accumulate, clip, steps, root, enable_checkpointing=False)
    trainer.fit(module, DataLoader(dataset(), batch_size=MICRO, shuffle=False))
    engine = trainer.strategy.engine
    assert engine.zero_optimization_stage() == stage and engine.global_steps == steps == trainer.global_step
    ours = {"losses": module.losses, "params": full_params(engine)}
    engine.destroy()
    ref = plain_loop(stage, accumulate, clip, steps)
    assert ours["losses"] == ref["losses"], (ours["losses"], ref["losses"])
    for name, value in ref["params"].items():
        assert torch.equal(ours["params"][name], value), f"stage {stage}: '{name}' differs"


def _resume(root: str) -> None:
    """Two epochs of two steps, uninterrupted, against one epoch, `trainer.save_checkpoint`, and a new
    Trainer fitting the second epoch from that checkpoint. (Lightning itself does not resume a plain
    DataLoader exactly from a checkpoint its ModelCheckpoint wrote inside an epoch, whatever the
    strategy, so the periodic checkpoints are only checked to be the engine's.)"""
    from lightning.pytorch.callbacks import ModelCheckpoint

    loader = DataLoader(dataset(rows=4 * MICRO), batch_size=MICRO, shuffle=False)  # 2 batches per rank
    periodic = ModelCheckpoint(
        dirpath=os.path.join(root, "periodic"), every_n_train_steps=1, save_top_k=2, monitor="step", mode="max"
    )
    uninterrupted = TinyGPT()
    trainer = lightning_trainer(3, 1, 0.0, -1, root, max_epochs=2, callbacks=[periodic])
    trainer.fit(uninterrupted, loader)
    expected = full_params(trainer.strategy.engine)
    trainer.strategy.engine.destroy()
    kept = sorted(os.listdir(os.path.join(root, "periodic")))  # top-k removed the older directories
    assert kept == ["epoch=1-step=3.ckpt", "epoch=1-step=4.ckpt"], kept
    assert os.path.isfile(os.path.join(root, "periodic", kept[-1], "checkpoint", "manifest.json"))

    half = TinyGPT()
    trainer = lightning_trainer(3, 1, 0.0, -1, root, max_epochs=1, enable_checkpointing=False)
    trainer.fit(half, loader)
    checkpoint = os.path.join(root, "epoch1.ckpt")
    trainer.save_checkpoint(checkpoint)
    trainer.strategy.engine.destroy()

    resumed = TinyGPT()
    trainer = lightning_trainer(3, 1, 0.0, -1, root, max_epochs=2, enable_checkpointing=False)
    trainer.fit(resumed, loader, ckpt_path=checkpoint)
    assert trainer.global_step == 4 and half.losses + resumed.losses == uninterrupted.losses, (
        half.losses,
        resumed.losses,
        uninterrupted.losses,
    )
    for name, value in full_params(trainer.strategy.engine).items():
        assert torch.equal(value, expected[name]), f"resumed run differs at '{name}'"
    trainer.strategy.engine.destroy()


def worker(rank: int, world_size: int, root: str) -> None:
    cases = [
        dict(stage=2, accumulate=1, clip=0.0),
        dict(stage=3, accumulate=1, clip=0.0),
        dict(stage=3, accumulate=2, clip=0.05),
    ]
    subtests(cases, lambda **case: _against_plain_loop(root=root, **case))
    _resume(root)
