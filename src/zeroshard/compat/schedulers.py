"""DeepSpeed's lr schedules (``deepspeed/runtime/lr_schedules.py``) with the same formulas: the warmup
schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR), OneCycle and LRRangeTest.

They drive any object with a ``param_groups`` list of dicts, not only a ``torch.optim.Optimizer``.

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

__all__ = ["LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "build_scheduler"]

log = logging.getLogger(__name__)

# DeepSpeed's names for the schedules and their config keys, which its scripts import from here.
LR_RANGE_TEST, ONE_CYCLE = "LRRangeTest", "OneCycle"
WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR = "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]
LR_RANGE_TEST_MIN_LR, LR_RANGE_TEST_STEP_RATE = "lr_range_test_min_lr", "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE, LR_RANGE_TEST_STAIRCASE = "lr_range_test_step_size", "lr_range_test_staircase"
CYCLE_FIRST_STEP_SIZE, CYCLE_FIRST_STAIR_COUNT = "cycle_first_step_size", "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE, CYCLE_SECOND_STAIR_COUNT = "cycle_second_step_size", "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR, CYCLE_MAX_LR, DECAY_LR_RATE = "cycle_min_lr", "cycle_max_lr", "decay_lr_rate"
CYCLE_MIN_MOM, CYCLE_MAX_MOM, DECAY_MOM_RATE = "cycle_min_mom", "cycle_max_mom", "decay_mom_rate"
WARMUP_MIN_LR, WARMUP_MAX_LR, WARMUP_NUM_STEPS = "warmup_min_lr", "warmup_max_lr", "warmup_num_steps"
WARMUP_TYPE, WARMUP_LOG_RATE, WARMUP_LINEAR_RATE = "warmup_type", "log", "linear"
WARMUP_MIN_RATIO, COS_MIN_RATIO, TOTAL_NUM_STEPS = "warmup_min_ratio", "cos_min_ratio", "total_num_steps"


class HasParamGroups(Protocol):
    param_groups: list[dict[str, Any]]


def build_scheduler(section: SchedulerConfig | None, optimizer: HasParamGroups):
    """The schedule described by the config's ``scheduler`` section, or None when there is none."""
    if section is None:
        return None
    kwargs = section.params.model_dump()
    cls = {
        "WarmupLR": WarmupLR,
        "WarmupDecayLR": WarmupDecayLR,
        "WarmupCosineLR": WarmupCosineLR,
        "OneCycle": OneCycle,
        "LRRangeTest": LRRangeTest,
    }
    return cls[section.type](optimizer, **kwargs)


class _Schedule:
    """Shared stepping, state and lr writing; subclasses define ``get_lr`` for the current iteration."""

    def __init__(self, optimizer: HasParamGroups, last_batch_iteration: int) -> None:
        self.optimizer = optimizer
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

    def _write_lr(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)  # keep a tensor lr a tensor (captured graphs read it in place)
            else:
                group["lr"] = lr
        self._last_lr = [float(group["lr"]) for group in self.optimizer.param_groups]


class _WarmupSchedule(_Schedule):
    """A schedule with a log or linear warmup over ``warmup_num_steps``."""

    def __init__(
        self, optimizer: HasParamGroups, warmup_num_steps: int, warmup_type: str, last_batch_iteration: int
    ) -> None:
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")
        super().__init__(optimizer, last_batch_iteration)
        self.warmup_type = warmup_type
        # DeepSpeed clamps to 2 so that log(warmup_num_steps) is not 0.
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)

    def _warmup_fraction(self) -> float:
        """0 -> 1 over the warmup steps: log(i + 1) / log(W) or i / W, for iteration i < W."""
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
        return self.last_batch_iteration / self.warmup_num_steps


def _per_group(value: float | Sequence[float], groups: int, name: str) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(f"expected {groups} values for {name} (one per param group), got {len(value)}")
        return [float(v) for v in value]
    return [float(cast(float, value))] * groups  # one number (a list or tuple was handled above)


class WarmupLR(_WarmupSchedule):
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


class WarmupCosineLR(_WarmupSchedule):
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


class LRRangeTest(_Schedule):
    """The lr range test (Smith, arXiv 1803.09820): lr = min_lr * (1 + step_rate * interval).

    interval = (i + 1) / step_size, or floor((i + 1) / step_size) with ``lr_range_test_staircase``,
    for iteration i; the lr grows without bound, to find the largest lr that still trains.
    """

    def __init__(
        self,
        optimizer: HasParamGroups,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        if isinstance(lr_range_test_step_size, bool) or not isinstance(lr_range_test_step_size, int):
            raise ValueError(f"lr_range_test_step_size must be a positive integer, got {lr_range_test_step_size!r}")
        if lr_range_test_step_size <= 0:
            raise ValueError(f"lr_range_test_step_size must be a positive integer, got {lr_range_test_step_size}")
        super().__init__(optimizer, last_batch_iteration)
        self.min_lr = _per_group(lr_range_test_min_lr, len(optimizer.param_groups), "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        if last_batch_iteration == -1:
            self._write_lr()

    def get_lr(self) -> list[float]:
        interval: float = float(self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        increase = 1 + self.step_rate * interval
        return [low * increase for low in self.min_lr]


class OneCycle(_Schedule):
    """The 1cycle policy (Smith, arXiv 1803.09820): one cycle of lr up and down, then decay.

    Cycle (iteration i < first + second step size): lr rises linearly from ``cycle_min_lr`` to
    ``cycle_max_lr`` over ``cycle_first_step_size`` iterations and falls back over
    ``cycle_second_step_size`` (default: the first), in ``cycle_*_stair_count`` flat stairs when that
    is above 0. Momentum moves the other way, from ``cycle_max_mom`` down to ``cycle_min_mom`` and back.
    Decay (after the cycle, d iterations in): lr = cycle_min_lr / (1 + decay_lr_rate * d / decay_step_size)
    and momentum = cycle_max_mom * (1 + decay_mom_rate * d / decay_step_size); a ``decay_step_size``
    or rate of 0 holds cycle_min_lr / cycle_max_mom.

    [Note: OneCycle momentum]
    As in DeepSpeed, momentum is cycled only in param groups that have ``betas`` (Adam-style
    optimizers), as ``betas[0]``; for other optimizers (SGD's ``momentum``) ``cycle_momentum`` is
    turned off with a warning, and construction writes ``cycle_min_mom`` (the first ``step()`` moves it
    next to ``cycle_max_mom``). DeepSpeed also sets ``betas[1]`` to 0.99 whenever it writes
    ``betas``; zeroshard keeps each group's own ``betas[1]``, the second moment's decay being no part
    of the 1cycle policy.
    """

    def __init__(
        self,
        optimizer: HasParamGroups,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self._init_cycle(cycle_first_step_size, cycle_second_step_size, cycle_first_stair_count)
        self.second_stair_count = (
            cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        groups = len(optimizer.param_groups)
        self.min_lrs = _per_group(cycle_min_lr, groups, "cycle_min_lr")
        self.max_lrs = _per_group(cycle_max_lr, groups, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.decay_mom_rate = decay_mom_rate
        self.cycle_momentum = cycle_momentum and self._has_betas()
        self.min_moms: list[float] = []
        self.max_moms: list[float] = []
        if self.cycle_momentum:
            self.min_moms = _per_group(cycle_min_mom, groups, "cycle_min_mom")
            self.max_moms = _per_group(cycle_max_mom, groups, "cycle_max_mom")
        if last_batch_iteration == -1:
            self._write_lr()
            if self.cycle_momentum:
                self._write_momentum(self.min_moms)

    def _init_cycle(self, first_step_size: int, second_step_size: int | None, first_stair_count: int) -> None:
        if first_step_size <= 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {first_step_size}")
        if second_step_size is not None and second_step_size < 0:
            raise ValueError(f"cycle_second_step_size must be non-negative (or None), got {second_step_size}")
        self.first_step_size = float(first_step_size)
        self.second_step_size = self.first_step_size if second_step_size is None else float(second_step_size)
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = first_stair_count

    def _has_betas(self) -> bool:
        if all("betas" in group for group in self.optimizer.param_groups):
            return True
        name = type(getattr(self.optimizer, "optimizer", self.optimizer)).__name__
        log.warning("cycle_momentum is disabled: the param groups of optimizer %s have no 'betas'", name)
        return False

    def step(self, last_batch_iteration: int | None = None) -> None:
        super().step(last_batch_iteration)
        momentums = self.get_mom()
        if momentums is not None:
            self._write_momentum(momentums)

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs)]
        if self.decay_step_size == 0 or self.decay_lr_rate == 0:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * self._decay_interval()
        return [low / factor for low in self.min_lrs]

    def get_mom(self) -> list[float] | None:
        """``betas[0]`` of each param group for the current iteration; None without cycle_momentum."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [high - (high - low) * scale for low, high in zip(self.min_moms, self.max_moms)]
        if self.decay_step_size == 0 or self.decay_mom_rate == 0:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * self._decay_interval()
        return [high * factor for high in self.max_moms]

    def _decay_interval(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def _scale_factor(self) -> float:
        """0 -> 1 over the first half of the cycle, 1 -> 0 over the second."""
        iteration = self.last_batch_iteration + 1
        cycle = math.floor(1 + iteration / self.total_size)
        x = 1.0 + iteration / self.total_size - cycle  # position in the cycle, [0, 1)
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            # Stairs are counted from the integer position, as DeepSpeed does: the float scale at the top
            # of an asymmetric cycle lands just under 1.0 and would floor a whole stair down.
            in_cycle = iteration % self.total_size
            if in_cycle <= self.first_step_size:
                position = in_cycle * stairs / self.first_step_size
            else:
                position = (self.total_size - in_cycle) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def _write_momentum(self, momentums: list[float]) -> None:
        for group, momentum in zip(self.optimizer.param_groups, momentums):
            betas = group["betas"]
            if isinstance(betas[0], torch.Tensor):
                betas[0].fill_(momentum)
            else:
                group["betas"] = (momentum, *betas[1:])
