"""zeroshard: ZeRO (Zero Redundancy Optimizer) data parallelism for PyTorch.

Two ways in:
  * `zeroshard.shard(model, optimizer, stage=...)` — the composable core (zeroshard/core/), no config,
    configured by the policies of core/policy.py (`PrecisionPolicy`, `CPUOffload` / `NVMeOffload`,
    `GatheringPolicy`, `CommunicationPolicy`), one per keyword;
  * `zeroshard.initialize(model=..., config=...)` — DeepSpeed's call shape (zeroshard/compat/):
    `import zeroshard as deepspeed` runs a DeepSpeed ZeRO training script; see README.md.
The layers are drawn in docs/architecture.md.

`import zeroshard` imports the core and the offload policies only. The DeepSpeed surface, the config
layer and DeepSpeed's module paths (`zeroshard.zero`, `zeroshard.runtime...`) are imported on first
use ([Note: DeepSpeed's paths on first use] in compat/paths.py).
"""

from __future__ import annotations

import importlib

from zeroshard.compat import paths as _paths
from zeroshard.core import (
    STAGES,
    CollectiveError,
    CommunicationPolicy,
    DynamicLossScaler,
    GatheringPolicy,
    Placement,
    PrecisionPolicy,
    Sharded,
    StagePolicy,
    shard,
    stage_policy,
)
from zeroshard.offload.policy import CPUOffload, NVMeOffload
from zeroshard.version import __version__

# name -> the module that defines it, imported when the name is first read.
_ON_FIRST_USE = {
    "ConfigError": "zeroshard.config",
    "load_config": "zeroshard.config",
    "MuonWithAdamW": "zeroshard.core.optim.muon",
    "register_whole_parameter_optimizer": "zeroshard.core.optim.declared",
    "ZeroEngine": "zeroshard.compat.engine",
    "add_config_arguments": "zeroshard.compat.api",
    "init_distributed": "zeroshard.compat.api",
    "initialize": "zeroshard.compat.api",
    "get_accelerator": "zeroshard.compat.accelerator",
}

_paths.install_on_first_use(__name__)  # import statements of zeroshard.zero, zeroshard.runtime...


def __getattr__(name: str):
    if name in _ON_FIRST_USE:
        value = getattr(importlib.import_module(_ON_FIRST_USE[name]), name)
    elif name in _paths.ROOTS:
        _paths.install(__name__)  # sets every root as an attribute of this module
        value = globals()[name]
    else:
        raise AttributeError(f"module 'zeroshard' has no attribute '{name}'")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "CPUOffload",
    "CollectiveError",
    "CommunicationPolicy",
    "ConfigError",
    "DynamicLossScaler",
    "GatheringPolicy",
    "MuonWithAdamW",
    "NVMeOffload",
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
