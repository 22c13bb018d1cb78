"""The policies a user sets, one per keyword of `zeroshard.shard`: `stage` (StagePolicy),
`precision` (PrecisionPolicy), `offload` (an OffloadPolicy: `zeroshard.CPUOffload()`,
`zeroshard.NVMeOffload(path)` from offload/policy.py, or a `Placement` of stores), `gathering`
(GatheringPolicy) and `communication` (CommunicationPolicy). Each is a frozen value checked when it is
made; the core reads them and nothing else of the user's intent.

ZeRO stages are data (ZeRO, arXiv 1910.02054, §5.1–5.3): a stage differs from another only in *what*
is partitioned across the data-parallel ranks. One code path reads these flags; there is no class
per stage.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from zeroshard.core.placement import OffloadContext, Placement


class Reduction(enum.Enum):
    """How a unit's gradients are reduced at the end of its backward (chosen from the policy alone)."""

    ALL_REDUCE = "all-reduce"  # stage 0: every rank keeps and updates the whole gradient, as DDP does
    REDUCE_SCATTER_IN_PLACE = "reduce-scatter in place"  # stage 1: the full buffer persists, a rank reads its slice
    REDUCE_SCATTER_TO_SHARD = "reduce-scatter to shard"  # stages 2/3: only the shard persists


@dataclass(frozen=True)
class StagePolicy:
    """What each rank keeps only 1/N of."""

    shard_optimizer: bool  # P_os: optimizer states (and fp32 master weights)
    shard_gradients: bool  # P_g: gradients are reduce-scattered as soon as a unit's are ready
    shard_parameters: bool  # P_p: parameters are gathered around each unit's forward and backward

    def __post_init__(self) -> None:
        # Each stage partitions a superset of the previous one (paper, Figure 1).
        if self.shard_parameters and not self.shard_gradients:
            raise ValueError("sharding parameters requires sharding gradients")
        if self.shard_gradients and not self.shard_optimizer:
            raise ValueError("sharding gradients requires sharding optimizer states")

    @property
    def reduction(self) -> Reduction:
        if not self.shard_optimizer:
            return Reduction.ALL_REDUCE
        return Reduction.REDUCE_SCATTER_TO_SHARD if self.shard_gradients else Reduction.REDUCE_SCATTER_IN_PLACE

    @property
    def stage(self) -> int:
        return int(self.shard_optimizer) + int(self.shard_gradients) + int(self.shard_parameters)


STAGES: dict[int, StagePolicy] = {
    0: StagePolicy(False, False, False),  # plain data parallelism (DDP)
    1: StagePolicy(True, False, False),
    2: StagePolicy(True, True, False),
    3: StagePolicy(True, True, True),
}


def stage_policy(stage: int) -> StagePolicy:
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r} is not a ZeRO stage; allowed: 0, 1, 2, 3")
    return STAGES[stage]


@dataclass(frozen=True)
class PrecisionPolicy:
    """`param_dtype`: what parameters compute in; `reduce_dtype`: what gradients are accumulated and
    reduced in; `master_dtype`: what the optimizer steps, the master weights, and so what torch's
    optimizers keep their states in (they make them like the tensor they step). fp32 by default
    (ZeRO's mixed-precision Adam); bfloat16 with bfloat16 parameters makes the parameters their own
    masters ([Note: bf16 master weights] in core/precision.py)."""

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.master_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"PrecisionPolicy.master_dtype={self.master_dtype}: torch.float32 or torch.bfloat16")
        if self.master_dtype == torch.bfloat16 and self.param_dtype != torch.bfloat16:
            raise ValueError(
                f"PrecisionPolicy.master_dtype=torch.bfloat16 needs param_dtype=torch.bfloat16, got {self.param_dtype}"
            )

    @property
    def params_are_masters(self) -> bool:
        """Do the parameters compute in the master's dtype (then they can be the master itself)?"""
        return self.param_dtype == self.master_dtype


@runtime_checkable
class OffloadPolicy(Protocol):
    """Where the states that need not stay in compute memory live (`shard(offload=...)`).

    `zeroshard.CPUOffload()` and `zeroshard.NVMeOffload(path)` (offload/policy.py) work out this
    rank's store directories and sizes themselves; a `Placement` (core/placement.py) hands over
    stores built by the caller. The core asks for the stores and never for the kind of policy."""

    def build(self, context: OffloadContext) -> Placement:
        """The stores for this rank's states."""


@dataclass(frozen=True)
class GatheringPolicy:
    """Which modules become units (gathered, freed and reduced together) and the bounds above.

    `wrap`: class names of the modules that become units; None = the blocks of the model's largest
    ModuleList (wrap.py). Every other parameter belongs to the root unit.
    `persistence_threshold`: at stage 3, a parameter with fewer elements than this stays whole on
    every rank (norms, biases), saving collectives on small tensors for a little memory.
    `prefetch_numel`, `max_live_numel`, `reuse_distance`: [Note: bounded gathering] in gathered.py."""

    wrap: tuple[str, ...] | None = None
    persistence_threshold: int = 0
    prefetch_numel: int = 1  # below one unit's size: "the next unit only"
    max_live_numel: int | None = None
    reuse_distance: int = 1  # only a unit used again at once (the root) stays gathered

    def __post_init__(self):
        if self.wrap is not None:
            if isinstance(self.wrap, str) or not all(isinstance(name, str) for name in self.wrap):
                raise ValueError(f"GatheringPolicy.wrap={self.wrap!r}: module class names (a list of str), or None")
            object.__setattr__(self, "wrap", tuple(self.wrap))
        for name in ("persistence_threshold", "prefetch_numel", "max_live_numel", "reuse_distance"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(
                    f"GatheringPolicy.{name} must be an integer >= 0 (elements)"
                    f"{', or None' * (name == 'max_live_numel')}, got {value!r}"
                )

    def live_allows(self, live: int, numel: int) -> bool:
        """May `numel` more elements be gathered (or kept) beside `live`?"""
        return self.max_live_numel is None or live + numel <= self.max_live_numel


@dataclass(frozen=True)
class CommunicationPolicy:
    """How the ranks communicate.

    `timeout_s`: seconds a collective may take before it is reported as a hang (a CollectiveError
    on every rank). `check_collectives`: the debug mode that checks every collective across ranks
    before it is used ([Note: asynchronous collective check] in consistency.py); off, each step
    still compares the ranks' collectives ([Note: collective fingerprint]).
    `overlap_comm`: a unit's gradient reduction stays in flight while the next unit's backward
    computes, and at stage 3 the next unit is gathered ahead ([Note: one reduction in flight] in
    lifecycle.py); off, each reduction is waited for and nothing is gathered ahead.
    `overlap_param_gather`: stages 1/2, step() only issues the all-gather of updated parameters and
    each unit waits for its own before its next forward ([Note: deferred parameter gather]).

    At stage 3, ZeRO++ (Wang et al., arXiv 2306.10209) and MiCS (Zhang et al., arXiv 2205.00119),
    off by default ([Note: ZeRO++ and MiCS] in unit.py):
    `shard_size` (MiCS): partition over groups of this many consecutive ranks and replicate across
    the groups; None = over every rank.
    `secondary_size` (hpZ): after a unit's forward keep a second copy of its parameters partitioned
    over groups of this many consecutive ranks (a node), which the backward gathers from; None = off.
    `quantize_weights` (qwZ): the parameter all-gather sends int8 blocks.
    `quantize_gradients` (qgZ): the gradient reduce-scatter does too.
    `block`: elements per quantization block ([Note: block quantization] in quantize.py).
    `ranks_per_node`: for counting bytes over the slow link; None = torchrun's LOCAL_WORLD_SIZE."""

    timeout_s: float = 300.0
    check_collectives: bool = False
    overlap_comm: bool = True
    overlap_param_gather: bool = True
    shard_size: int | None = None
    secondary_size: int | None = None
    quantize_weights: bool = False
    quantize_gradients: bool = False
    block: int = 256
    ranks_per_node: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or self.timeout_s <= 0:
            raise ValueError(f"CommunicationPolicy.timeout_s={self.timeout_s!r}: seconds, > 0")
        for name in ("shard_size", "secondary_size", "ranks_per_node"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"CommunicationPolicy.{name}={value!r}: an int >= 1, or None")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"CommunicationPolicy.block={self.block!r}: an int >= 1")

    @property
    def plain(self) -> bool:
        """No ZeRO++ or MiCS: stage 3 as the paper has it."""
        return (self.shard_size, self.secondary_size, self.quantize_weights, self.quantize_gradients) == (
            None,
            None,
            False,
            False,
        )

    def check(self, stage: StagePolicy, world_size: int) -> None:
        if not self.plain and not stage.shard_parameters:
            raise ValueError(
                "CommunicationPolicy.shard_size / secondary_size / quantize_weights / quantize_gradients act "
                f"at ZeRO stage 3 only (got stage {stage.stage})"
            )
        shard = self.shard_size or world_size
        if world_size % shard:
            raise ValueError(
                f"CommunicationPolicy.shard_size={self.shard_size} must divide the data-parallel world size {world_size}"
            )
        if self.secondary_size is not None and shard % self.secondary_size:
            raise ValueError(
                f"CommunicationPolicy.secondary_size={self.secondary_size} must divide the partition group "
                f"size {shard} (CommunicationPolicy.shard_size, or the data-parallel world size)"
            )
