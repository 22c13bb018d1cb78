"""DeepSpeed's warmup lr schedules (``deepspeed/runtime/lr_schedules.py``) with the same formulas.

They drive any object with a ``param_groups`` list of dicts (our ZeRO optimizer wrapper is not a
``torch.optim.Optimizer`` subclass).

[Note: which step an lr applies to]
As in DeepSpeed, the constructor (with ``last_batch_iteration == -1``) already writes the lr of
"iteration -1" into the param groups, and the engine calls ``step()`` once *after* every optimizer step
that was applied (DeepSpeed skips it on an fp16 overflow). So optimizer step k (0-based) runs with the
lr of iteration k - 1:

    step 0: iteration -1 = warmup_min_lr (WarmupLR/WarmupDecayLR) or 0.0 (WarmupCosineLR)
    step 1: iteration 0  = warmup_min_lr (log warmup: log(1) = 0; linear: 0 / warmup steps)
    step k: iteration k - 1

Nobody calls ``step()`` at construction; ``last_batch_iteration`` is the iteration whose lr is in the
param groups.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, Protocol, cast

import torch

from zeroshard.config.schema import SchedulerConfig

__all__ = ["WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "build_scheduler"]

log = logging.getLogger(__name__)


class HasParamGroups(Protocol):
    param_groups: list[dict[str, Any]]


def build_scheduler(section: SchedulerConfig | None, optimizer: HasParamGroups):
    """The schedule described by the config's ``scheduler`` section, or None when there is none."""
    if section is None:
        return None
    kwargs = section.params.model_dump()
    cls = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}
    return cls[section.type](optimizer, **kwargs)


class _Schedule:
    """Shared stepping, state and lr writing; subclasses define ``get_lr`` for the current iteration."""

    def __init__(
        self, optimizer: HasParamGroups, warmup_num_steps: int, warmup_type: str, last_batch_iteration: int
    ) -> None:
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")
        self.optimizer = optimizer
        self.warmup_type = warmup_type
        # DeepSpeed clamps to 2 so that log(warmup_num_steps) is not 0.
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] | None = None

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to the next iteration (or to ``last_batch_iteration``) and write its lr."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._write_lr()

    def get_last_lr(self) -> list[float]:
        """The lr last written into the param groups."""
        if self._last_lr is None:
            raise RuntimeError("need to call step() first")
        return self._last_lr

    def state_dict(self) -> dict[str, int]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, int]) -> None:
        # Like DeepSpeed: the param groups get the restored lr at the next step(), not now.
        self.last_batch_iteration = state["last_batch_iteration"]

    def _warmup_fraction(self) -> float:
        """0 -> 1 over the warmup steps: log(i + 1) / log(W) or i / W, for iteration i < W."""
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
        return self.last_batch_iteration / self.warmup_num_steps

    def _write_lr(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)  # keep a tensor lr a tensor (captured graphs read it in place)
            else:
                group["lr"] = lr
        self._last_lr = [float(group["lr"]) for group in self.optimizer.param_groups]


def _per_group(value: float | Sequence[float], groups: int, name: str) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(f"expected {groups} values for {name} (one per param group), got {len(value)}")
        return [float(v) for v in value]
    return [float(cast(float, value))] * groups  # one number (a list or tuple was handled above)


class WarmupLR(_Schedule):
    """lr = min + (max - min) * gamma, gamma rising 0 -> 1 over warmup_num_steps, then 1.

    ``warmup_max_lr=None`` takes the lr of param group 0 (DeepSpeed's WarmupLR).
    """

    def __init__(
        self,
        optimizer: HasParamGroups,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        groups = len(optimizer.param_groups)
        if warmup_max_lr is None:
            warmup_max_lr = float(optimizer.param_groups[0]["lr"])
        self.min_lrs = _per_group(warmup_min_lr, groups, "warmup_min_lr")
        self.max_lrs = _per_group(warmup_max_lr, groups, "warmup_max_lr")
        self.delta_lrs = [big - small for big, small in zip(self.max_lrs, self.min_lrs)]
        if last_batch_iteration == -1:
            self._write_lr()

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [low + delta * gamma for low, delta in zip(self.min_lrs, self.delta_lrs)]

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_fraction()
        return 1.0


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then gamma = (T - i) / max(1, T - W) decaying linearly to 0 at T = total_num_steps."""

    def __init__(
        self,
        optimizer: HasParamGroups,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        if total_num_steps < self.warmup_num_steps:
            log.warning("total_num_steps %d is less than warmup_num_steps %d", total_num_steps, warmup_num_steps)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_fraction()
        remaining = float(self.total_num_steps - self.last_batch_iteration)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_Schedule):
    """lr = base_lr * ratio, base_lr = each group's lr at construction.

    Warmup (i < W): ratio = warmup_min_ratio + (1 - warmup_min_ratio) * warmup_fraction(i).
    Then: ratio = max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * (i - W + 1) / (T - W))) / 2).
    """

    def __init__(
        self,
        optimizer: HasParamGroups,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        if total_num_steps == self.warmup_num_steps:
            # DeepSpeed divides by total - warmup after warmup and would raise ZeroDivisionError there.
            raise ValueError(
                f"WarmupCosineLR needs total_num_steps != warmup_num_steps "
                f"(both {total_num_steps}; warmup_num_steps is at least 2)"
            )
        if total_num_steps < self.warmup_num_steps:
            log.warning("total_num_steps %d is less than warmup_num_steps %d", total_num_steps, warmup_num_steps)
        self.org_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        if last_batch_iteration == -1:
            self._write_lr()

    def get_lr(self) -> list[float]:
        # DeepSpeed returns [0.0] before the first step(), which zeroes only group 0's lr; we zero
        # every group, as was evidently meant.
        if self.last_batch_iteration < 0:
            return [0.0] * len(self.org_lrs)
        ratio = self.get_lr_ratio()
        return [base * ratio for base in self.org_lrs]

    def get_lr_ratio(self) -> float:
        """Fraction of the construction-time lr for the current iteration."""
        if self.last_batch_iteration < 0:
            return 0.0
        if self.last_batch_iteration < self.warmup_num_steps:
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * self._warmup_fraction()
        real_last_step = self.last_batch_iteration - self.warmup_num_steps + 1
        real_total_steps = self.total_num_steps - self.warmup_num_steps
        cosine = (1 + math.cos(math.pi * real_last_step / real_total_steps)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)
