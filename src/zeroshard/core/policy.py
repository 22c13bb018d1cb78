"""ZeRO stages as data (ZeRO, arXiv 1910.02054, §5.1–5.3).

A stage differs from another only in *what* is partitioned across the data-parallel ranks. One code
path reads these flags; there is no class per stage.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


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
class CommPolicy:
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
            raise ValueError(f"CommPolicy.timeout_s={self.timeout_s!r}: seconds, > 0")
        for name in ("shard_size", "secondary_size", "ranks_per_node"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"CommPolicy.{name}={value!r}: an int >= 1, or None")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"CommPolicy.block={self.block!r}: an int >= 1")

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
                "CommPolicy.shard_size / secondary_size / quantize_weights / quantize_gradients act "
                f"at ZeRO stage 3 only (got stage {stage.stage})"
            )
        shard = self.shard_size or world_size
        if world_size % shard:
            raise ValueError(
                f"CommPolicy.shard_size={self.shard_size} must divide the data-parallel world size {world_size}"
            )
        if self.secondary_size is not None and shard % self.secondary_size:
            raise ValueError(
                f"CommPolicy.secondary_size={self.secondary_size} must divide the partition group "
                f"size {shard} (CommPolicy.shard_size, or the data-parallel world size)"
            )
