"""PyTorch Lightning on zeroshard: `ZeroShardStrategy`, a data-parallel strategy whose model is a
zeroshard engine.

    trainer = L.Trainer(strategy=ZeroShardStrategy(stage=3), accelerator="cpu", devices=2)

It is DDP's strategy (launching, process group, sampler, barrier, reductions) with the model
wrapped by `zeroshard.initialize` instead of `DistributedDataParallel`, like Lightning's own
DeepSpeed strategy: `training_step` runs inside `engine(...)`, backward is `engine.backward`, and
every batch ends with `engine.step()`, which steps the optimizer at accumulation boundaries (the
strategy handles gradient accumulation). Lightning's checkpoints are routed to the engine's sharded
checkpoints: the checkpoint path becomes a directory, Lightning's own state (loops, callbacks,
schedulers, hyper-parameters) rides along as the engine's client state. Requires
`pip install zeroshard[lightning]`; nothing in the core imports this module.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.types import LRSchedulerConfig

from zeroshard.compat.api import initialize
from zeroshard.config import ConfigError, read_config

__all__ = ["ZeroShardPrecision", "ZeroShardStrategy"]

# Trainer(precision=...) -> the config section that gives the engine that precision.
_PRECISION_SECTIONS = {
    "32-true": None,
    "bf16-mixed": "bf16",
    "bf16-true": "bf16",
    "16-mixed": "fp16",
    "16-true": "fp16",
}
_CHECKPOINT_TAG = "checkpoint"  # one engine checkpoint per Lightning checkpoint directory


class ZeroShardPrecision(Precision):
    """Backward and optimizer step through the engine; precision itself is the engine's (the
    config's `bf16`/`fp16` sections, which the strategy fills from `Trainer(precision=...)`)."""

    def __init__(self, precision: str = "32-true"):
        self.precision = precision

    def backward(self, tensor, model: pl.LightningModule, optimizer, *args, **kwargs) -> None:
        if model.automatic_optimization:
            # Lightning divided the loss by accumulate_grad_batches, and so does engine.backward:
            # undo Lightning's (exact when the number of batches accumulated is a power of two).
            tensor = tensor * model.trainer.accumulate_grad_batches
        model.trainer.strategy.engine.backward(tensor, *args, **kwargs)

    def optimizer_step(self, optimizer, model: pl.LightningModule, closure, **kwargs) -> Any:
        result = closure()  # training_step and backward
        if model.automatic_optimization and result is None:
            raise RuntimeError(
                "training_step returned None (skip this batch): ZeroShardStrategy needs every rank to "
                "run backward on every batch, its collectives are matched across ranks"
            )
        self._after_closure(model, optimizer)
        model.trainer.strategy.engine.step()
        return result

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=GradClipAlgorithmType.NORM) -> None:
        """The engine clips, with the config's `gradient_clipping` (from `Trainer(gradient_clip_val=)`)."""


class ZeroShardStrategy(DDPStrategy):
    """Train with ZeRO stage `stage` (0-3). `config`: a DeepSpeed-style config, dict or JSON path;
    `stage` overrides its `zero_optimization.stage`. The Trainer owns `gradient_accumulation_steps`
    (`accumulate_grad_batches`), `gradient_clipping` (`gradient_clip_val`, by norm) and precision;
    giving the config a different value is an error. The optimizer and scheduler come from
    `configure_optimizers` unless the config has an `optimizer` section."""

    strategy_name = "zeroshard"

    def __init__(
        self,
        stage: int | None = None,
        config: Mapping | str | os.PathLike | None = None,
        *,
        accelerator=None,
        parallel_devices=None,
        cluster_environment=None,
        checkpoint_io=None,
        process_group_backend: str | None = None,
        timeout=default_pg_timeout,
        start_method: str = "popen",
    ):
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        raw = read_config(config)
        if stage is not None:
            raw["zero_optimization"] = {**raw.get("zero_optimization", {}), "stage": stage}
        self.config = raw
        self.engine = None

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True

    # -- setup: the engine in place of DistributedDataParallel --------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        self.accelerator.setup(trainer)
        self.precision_plugin = ZeroShardPrecision(getattr(self.precision_plugin, "precision", "32-true"))
        module = self.lightning_module
        if self.engine is not None and self.engine.module is module:  # a later fit/validate/test
            self.model = self.engine
        elif trainer.state.fn == TrainerFn.FITTING:
            self.model_to_device()
            self._build_engine(trainer, module)
        else:  # evaluation without training: a replicated module, nothing to shard
            self.model_to_device()

    def _build_engine(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        config = self._trainer_config(trainer)
        optimizer, scheduler_configs = None, []
        if "optimizer" not in config:
            optimizers, scheduler_configs = _init_optimizers_and_lr_schedulers(module)
            if len(optimizers) != 1:
                raise ValueError(
                    f"ZeroShardStrategy trains with one optimizer; configure_optimizers gave {len(optimizers)}"
                )
            optimizer = optimizers[0]
        self.engine, *_ = initialize(model=module, optimizer=optimizer, config=config)
        if self.engine.lr_scheduler is not None:  # the config's scheduler: Lightning steps it, as DeepSpeed's
            scheduler_configs = [LRSchedulerConfig(self.engine.lr_scheduler, interval="step")]
            self.engine.lr_scheduler = None
        self.model = self.engine
        # Lightning sees the torch optimizer, re-pointed at this rank's shards: learning-rate monitors,
        # schedulers from configure_optimizers and zero_grad work on it; only the engine steps it.
        self.optimizers = [self.engine.optimizer.optimizer]
        self.lr_scheduler_configs = scheduler_configs

    def _trainer_config(self, trainer: pl.Trainer) -> dict:
        config = dict(self.config)
        owned = {"gradient_accumulation_steps": trainer.accumulate_grad_batches}
        if trainer.gradient_clip_val:
            if trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
                raise ConfigError("ZeroShardStrategy clips by global norm only: use gradient_clip_algorithm='norm'")
            owned["gradient_clipping"] = float(trainer.gradient_clip_val)
        elif config.get("gradient_clipping", "auto") == "auto":
            config["gradient_clipping"] = 0.0  # Lightning's "no clipping", not DeepSpeed's default of 1.0
        section = _PRECISION_SECTIONS.get(self.precision_plugin.precision, KeyError)
        if section is KeyError:
            raise ConfigError(
                f"Trainer(precision={self.precision_plugin.precision!r}) is not supported by "
                f"ZeroShardStrategy; allowed: {sorted(_PRECISION_SECTIONS)}"
            )
        for key, value in owned.items():
            if config.get(key, "auto") not in ("auto", value):
                raise ConfigError(
                    f"config '{key}' is {config[key]!r} but the Trainer gives {value!r}: remove it "
                    "from the config or make them agree"
                )
            config[key] = value
        if section is not None:
            if config.get(section, {}).get("enabled") is False:
                raise ConfigError(
                    f"Trainer(precision={self.precision_plugin.precision!r}) but config '{section}' is disabled"
                )
            config[section] = {**config.get(section, {}), "enabled": True}
        return config

    def configure_ddp(self) -> None:
        raise AssertionError("ZeroShardStrategy wraps the model with a zeroshard engine, never DDP")

    def teardown(self) -> None:
        """As Strategy.teardown, but the module stays where the engine's buffers are: moving it to
        the CPU would detach its parameters from the engine's flat buffers."""
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # -- checkpoints: directories written by the engine ---------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the engine's checkpoint holds the weights, sharded

    def optimizer_state(self, optimizer) -> dict[str, torch.Tensor]:
        return {}  # likewise the optimizer state

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError("ZeroShardStrategy writes checkpoints itself: storage_options is not supported")
        filepath = self.broadcast(str(filepath))  # one directory for every rank
        client_state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        self.engine.save_checkpoint(filepath, tag=_CHECKPOINT_TAG, client_state=client_state)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        if self.engine is None:
            raise RuntimeError(
                f"{checkpoint_path} is a zeroshard checkpoint, loaded by the engine that fit() builds; "
                "to evaluate without training, write a full state dict first (`zeroshard "
                "consolidate`) and load it into the module"
            )
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        _, client_state = self.engine.load_checkpoint(
            self.broadcast(str(checkpoint_path)), load_optimizer_states=fitting, load_lr_scheduler_states=False
        )
        if client_state is None:
            raise RuntimeError(f"{checkpoint_path} holds no zeroshard checkpoint")
        return client_state

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine must exist to load its checkpoint

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine restored it

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # the engine restored the weights in load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass
