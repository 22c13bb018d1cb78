"""zeroshard: ZeRO (Zero Redundancy Optimizer) data parallelism for PyTorch.

Two ways in:
  * `zeroshard.shard(model, optimizer, stage=...)` — the composable core (zeroshard/core/), no config,
    configured by policy objects (PrecisionPolicy, Placement, GatherPolicy, CommPolicy);
  * `zeroshard.initialize(model=..., config=...)` — DeepSpeed's call shape (zeroshard/compat/):
    `import zeroshard as deepspeed` runs a DeepSpeed ZeRO training script; see README.md.
The layers are drawn in docs/architecture.md.
"""

from zeroshard.compat import paths as _paths
from zeroshard.compat.accelerator import get_accelerator
from zeroshard.compat.api import add_config_arguments, init_distributed, initialize
from zeroshard.compat.engine import ZeroEngine
from zeroshard.config import ConfigError, load_config
from zeroshard.core import (
    STAGES,
    CollectiveError,
    CommPolicy,
    DynamicLossScaler,
    GatherPolicy,
    Placement,
    PrecisionPolicy,
    Sharded,
    StagePolicy,
    shard,
    stage_policy,
)
from zeroshard.core.optim.declared import register_whole_parameter_optimizer
from zeroshard.core.optim.muon import MuonWithAdamW
from zeroshard.version import __version__

_paths.install(__name__)  # zeroshard.zero, zeroshard.checkpointing, ... (DeepSpeed's module paths)

__all__ = [
    "CollectiveError",
    "CommPolicy",
    "ConfigError",
    "DynamicLossScaler",
    "GatherPolicy",
    "MuonWithAdamW",
    "Placement",
    "PrecisionPolicy",
    "STAGES",
    "Sharded",
    "StagePolicy",
    "ZeroEngine",
    "accelerator",
    "add_config_arguments",
    "checkpointing",
    "comm",
    "compression",
    "get_accelerator",
    "init_distributed",
    "initialize",
    "load_config",
    "ops",
    "register_whole_parameter_optimizer",
    "runtime",
    "shard",
    "stage_policy",
    "utils",
    "zero",
    "__version__",
]
