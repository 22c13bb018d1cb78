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


@dataclass(frozen=True)
class CommPolicy:
    """How stage 3 communicates: ZeRO++ (Wang et al., arXiv 2306.10209) and MiCS (Zhang et al., arXiv
    2205.00119). The defaults are plain stage 3. See [Note: ZeRO++ and MiCS] in unit.py.

    `shard_size` (MiCS, DeepSpeed's `mics_shard_size`): partition over groups of this many
    consecutive ranks and replicate across the groups; None = over every rank.
    `secondary_size` (hpZ, `zero_hpz_partition_size`): after a unit's forward keep a second copy of
    its parameters partitioned over groups of this many consecutive ranks (a node), which the
    backward gathers from; None = off.
    `quantize_weights` (qwZ, `zero_quantized_weights`): the parameter all-gather sends int8 blocks.
    `quantize_gradients` (qgZ, `zero_quantized_gradients`): the gradient reduce-scatter does too.
    `block`: elements per quantization block ([Note: block quantization] in quantize.py).
    `ranks_per_node`: for counting bytes over the slow link; None = torchrun's LOCAL_WORLD_SIZE."""

    shard_size: int | None = None
    secondary_size: int | None = None
    quantize_weights: bool = False
    quantize_gradients: bool = False
    block: int = 256
    ranks_per_node: int | None = None

    def __post_init__(self) -> None:
        for name in ("shard_size", "secondary_size", "ranks_per_node"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"CommPolicy.{name}={value!r}: an int >= 1, or None")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"CommPolicy.block={self.block!r}: an int >= 1")

    @property
    def plain(self) -> bool:
        return self == CommPolicy(ranks_per_node=self.ranks_per_node)

    def check(self, stage: StagePolicy, world_size: int) -> None:
        """Errors name DeepSpeed's keys: the engine's config reaches the core through this."""
        if not self.plain and not stage.shard_parameters:
            raise ValueError("mics_shard_size / zero_hpz_partition_size / zero_quantized_weights / "
                             f"zero_quantized_gradients act at ZeRO stage 3 only (got stage {stage.stage})")
        shard = self.shard_size or world_size
        if world_size % shard:
            raise ValueError(f"zero_optimization.mics_shard_size={self.shard_size} must divide the data-parallel "
                             f"world size {world_size}")
        if self.secondary_size is not None and shard % self.secondary_size:
            raise ValueError(f"zero_optimization.zero_hpz_partition_size={self.secondary_size} must divide the "
                             f"partition group size {shard} (mics_shard_size, or the data-parallel world size)")
