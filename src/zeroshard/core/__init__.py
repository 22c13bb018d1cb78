"""The core runtime of ZeRO: stages as policies, flat shards, units and their lifecycle, the
communicator, precision, the sharded optimizer, and `shard()`, the composable entry point.

It imports no other zeroshard layer (tests/test_layers.py checks this from the source): it knows
nothing of configs, DeepSpeed names or files. docs/architecture.md walks through it.
"""
from zeroshard.core.comm import CollectiveError, Communicator
from zeroshard.core.placement import Placement, Store
from zeroshard.core.policy import STAGES, Reduction, StagePolicy, stage_policy
from zeroshard.core.precision import DynamicLossScaler, PrecisionPolicy
from zeroshard.core.sharded import Sharded, shard

__all__ = ["CollectiveError", "Communicator", "DynamicLossScaler", "Placement", "PrecisionPolicy", "Reduction",
           "STAGES", "Sharded", "StagePolicy", "Store", "shard", "stage_policy"]
