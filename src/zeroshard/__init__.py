"""zeroshard: ZeRO (Zero Redundancy Optimizer) data parallelism for PyTorch.

`import zeroshard as deepspeed` runs a DeepSpeed ZeRO training script; see README.md.
"""
from . import checkpointing, zero
from .api import add_config_arguments, init_distributed, initialize
from .comm import CollectiveError
from .config import ConfigError, load_config
from .engine import ZeroEngine
from .policy import STAGES, StagePolicy, stage_policy

__version__ = "0.1.0"

__all__ = [
    "CollectiveError", "ConfigError", "add_config_arguments", "STAGES", "StagePolicy", "ZeroEngine", "init_distributed",
    "checkpointing", "initialize", "load_config", "stage_policy", "zero", "__version__",
]
