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
        raise ValueError(f"zero_optimization.stage={stage!r} is not a ZeRO stage; allowed: 0, 1, 2, 3")
    return STAGES[stage]
