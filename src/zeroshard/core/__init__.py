"""The core runtime of ZeRO: stages as policies, flat shards, units and their lifecycle, the
communicator, precision, the sharded optimizer, and `shard()`, the composable entry point.

It imports no other zeroshard layer (tests/test_layers.py checks that it imports nothing above it;
the config layer below it it does not use either): it knows nothing of configs, DeepSpeed names or
files. docs/architecture.md walks through it.
"""

from zeroshard.core.comm import CollectiveError, Communicator
from zeroshard.core.mesh import ZeroGroups, from_mpu
from zeroshard.core.placement import OffloadContext, Placement, Store
from zeroshard.core.policy import (
    STAGES,
    CommunicationPolicy,
    GatheringPolicy,
    OffloadPolicy,
    PrecisionPolicy,
    Reduction,
    StagePolicy,
    stage_policy,
)
from zeroshard.core.precision import DynamicLossScaler
from zeroshard.core.sharded import Sharded, shard

__all__ = [
    "CollectiveError",
    "CommunicationPolicy",
    "Communicator",
    "DynamicLossScaler",
    "GatheringPolicy",
    "OffloadContext",
    "OffloadPolicy",
    "Placement",
    "PrecisionPolicy",
    "Reduction",
    "STAGES",
    "Sharded",
    "StagePolicy",
    "Store",
    "ZeroGroups",
    "from_mpu",
    "shard",
    "stage_policy",
]
