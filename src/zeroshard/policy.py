"""ZeRO stages as data (ZeRO, arXiv 1910.02054, §5.1–5.3).

A stage differs from another only in *what* is partitioned across the data-parallel ranks. One code
path reads these flags; there is no class per stage.
"""
from __future__ import annotations

from dataclasses import dataclass


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
