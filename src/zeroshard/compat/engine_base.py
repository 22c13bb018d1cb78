"""What both engines are: the training engine (compat/engine.py) and the one `initialize` builds
without an optimizer (compat/inference.py). One base class, so the two cannot drift apart.

It shows the core object an engine wraps, `self.sharded`, read-only, and DeepSpeed's engine accessors
that scripts and DeepSpeed's own tests call beyond the training loop. Each accessor reads the parsed
config, the core's parts or the counters the base starts; without an optimizer they answer as
DeepSpeed's engine does then (`get_lr()` is [], the gradient norm None, no step skipped).
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from zeroshard.checkpoint.manifest import MANIFEST, rank_file
from zeroshard.compat.accelerator import get_accelerator
from zeroshard.inference import generate as generation

if TYPE_CHECKING:
    from zeroshard.core.optim.optimizer import ZeroOptimizer
    from zeroshard.core.precision import DynamicLossScaler
    from zeroshard.core.sharded import Sharded


def _core(name: str, attribute: str | None = None) -> property:
    """The core's `attribute` (default `name`) as a read-only property: the engine shows the parts
    of `Sharded` that are private to it, for the checkpoint package and for DeepSpeed's accessors."""
    attribute = attribute or name
    return property(lambda self: getattr(self.sharded, attribute), doc=f"The core's `{name}` (read-only).")


class EngineBase(nn.Module):
    """A model under ZeRO as DeepSpeed's engine shows it. Subclasses build `self.sharded` (the core's
    `Sharded`) in their `__init__`, and set `lr_scheduler`."""

    sharded: Sharded  # set by the subclass
    _boundary_override: bool | None  # set_gradient_accumulation_boundary(); None: the micro-step counter decides

    def __init__(self, model: nn.Module, config):
        super().__init__()
        self.config = config
        self.module = model
        self._start_counting()

    # -- the core's parts, read-only -------------------------------------------------------------------
    comm = _core("comm")
    policy = _core("policy")
    precision = _core("precision")
    units = _core("units", "_units")
    groups = _core("groups", "_groups")
    lifecycle = _core("lifecycle", "_lifecycle")
    placement = _core("placement", "_placement")

    @property
    def optimizer(self) -> ZeroOptimizer | None:
        """The core's optimizer wrapper; None on an engine built without an optimizer."""
        return self.sharded.optimizer

    @property
    def loss_scaler(self) -> DynamicLossScaler | None:
        return self.sharded.loss_scaler

    def zero_optimization_stage(self) -> int:
        return self.policy.stage

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    @property
    def global_rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    # -- reports ----------------------------------------------------------------------------------------
    def num_parameters(self) -> int:
        return self.sharded.num_parameters()

    def memory_report(self) -> dict[str, int]:
        """Bytes of model states this rank holds (counted from its tensors), by kind."""
        return self.sharded.memory_report()

    def comm_report(self) -> dict:
        return self.sharded.comm_report()

    def _start_counting(self) -> None:
        """The counters DeepSpeed's engine starts with; `ZeroEngine.step` advances them."""
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self._boundary_override = None
        self._in_no_sync = False
        self._step_applied = False

    # -- generation -------------------------------------------------------------------------------------
    def generate(self, *args, **kwargs):
        """`engine.module.generate(...)` under `torch.no_grad()`, safe on a stage-3 model of several ranks,
        gathering as the config's `zeroshard.generate_gather` says (`zeroshard.inference.generate`).
        Nothing stays gathered afterwards, even on error. The train/eval mode is left as it is."""
        return generation.generate(self.sharded, *args, gather=self.config.zeroshard.generate_gather, **kwargs)

    # -- batch sizes, the optimizer -------------------------------------------------------------------
    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    @property
    def basic_optimizer(self) -> torch.optim.Optimizer | None:
        """The torch optimizer the engine steps: the client's own, what a client callable built, or
        the one built from the config's 'optimizer' section (DeepSpeed's name); None without one."""
        return self.optimizer.optimizer if self.optimizer is not None else None

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups] if self.optimizer is not None else []

    def get_global_grad_norm(self) -> float | None:
        """The last step's norm before clipping; at stage 0 without clipping or loss scaling it is
        summed when first asked, up to the next backward ([Note: the stage-0 norm, computed when
        asked] in core/optim/norm.py; DeepSpeed's stage-0 engine returns None there)."""
        return self.optimizer.last_grad_norm if self.optimizer is not None else None

    def get_loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    @property
    def skipped_steps(self) -> int:
        return self.optimizer.skipped_steps if self.optimizer is not None else 0

    # -- precision ------------------------------------------------------------------------------------
    def fp16_enabled(self) -> bool:
        return bool(self.config.fp16.enabled)

    def bfloat16_enabled(self) -> bool:
        return bool(self.config.bf16.enabled)

    bf16_enabled = bfloat16_enabled

    def amp_enabled(self) -> bool:
        return False

    def torch_autocast_enabled(self) -> bool:
        return bool(self.config.torch_autocast.enabled)

    def torch_autocast_dtype(self) -> torch.dtype | None:
        return self.config.torch_autocast.torch_dtype if self.torch_autocast_enabled() else None

    def dynamic_loss_scale(self) -> bool:
        return self.fp16_enabled() and self.config.fp16.dynamic_loss_scale

    def communication_data_type(self) -> torch.dtype:
        return self.precision.reduce_dtype

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        return self.precision.param_dtype, self.precision.reduce_dtype

    # -- ZeRO -----------------------------------------------------------------------------------------
    def zero_optimization(self) -> bool:
        return self.policy.stage > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self.policy.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.policy.stage >= 3

    def zero_cpu_offload(self) -> bool:
        opt = self.config.zero_optimization.offload_optimizer
        return opt is not None and opt.device == "cpu"

    def zero_offload_optimizer(self):
        return self.config.zero_optimization.offload_optimizer

    def zero_offload_param(self):
        return self.config.zero_optimization.offload_param

    def gradient_clipping(self) -> float:
        return float(self.config.gradient_clipping)

    def steps_per_print(self) -> int | None:
        return None  # monitoring: zeroshard logs through python logging

    def empty_partition_cache(self) -> None:
        """Free every gathered stage-3 unit now (DeepSpeed: release the parameter cache), e.g. between
        evaluation and training. Nothing to free at stages 0-2, or while a forward/backward runs."""
        if self.lifecycle.phase.value != "idle":
            raise RuntimeError("empty_partition_cache() called during forward or backward")
        for unit in self.units:
            unit.reshard()
        get_accelerator().empty_cache()

    # -- gradient accumulation ------------------------------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override the micro-step counter: the next backward reduces (True) or only accumulates
        (False), and `step()` steps the optimizer when it is True. As in DeepSpeed, set it before each
        forward/backward and finish with True."""
        self._boundary_override = bool(is_boundary)

    @contextlib.contextmanager
    def no_sync(self):
        """Backwards inside accumulate without reducing (DDP's no_sync); the next backward outside
        reduces everything. Stages 2/3 partition gradients as they are produced, so, as in
        DeepSpeed, they refuse it; `step()` inside is an error."""
        if self.zero_optimization_partition_gradients():
            raise RuntimeError(
                f"no_sync() is incompatible with the gradient partitioning of ZeRO stage "
                f"{self.zero_optimization_stage()} (as in DeepSpeed): use stage 0 or 1, or "
                "gradient_accumulation_steps"
            )
        if self._in_no_sync:
            raise RuntimeError("no_sync() context manager reentry is unsupported")
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    def was_step_applied(self) -> bool:
        """Did the last `step()` at an accumulation boundary update the weights (False after an fp16
        overflow skipped it)?"""
        return self._step_applied

    # -- where the engine lives -----------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return (
            torch.device(self.comm.device.type, self.comm.device.index)
            if self.comm.device.type != "cpu"
            else torch.device("cpu")
        )

    @property
    def dp_world_size(self) -> int:
        return self.comm.world_size

    @property
    def mp_world_size(self) -> int:
        return 1

    # -- checkpoint file names (DeepSpeed's tests look for them after save_checkpoint) -----------------
    def _get_ckpt_name(self, checkpoints_path, tag, mp_placeholder=None) -> str:
        """The file that describes a checkpoint: its manifest."""
        return os.path.join(str(checkpoints_path), str(tag), MANIFEST)

    def _get_zero_ckpt_name(self, checkpoints_path, tag) -> str:
        """This rank's shard file (master weights and optimizer state)."""
        return os.path.join(str(checkpoints_path), str(tag), rank_file(self.comm.rank))

    _get_optimizer_ckpt_name = _get_zero_ckpt_name
