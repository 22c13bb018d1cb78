"""transformers' `HfDeepSpeedConfig` and `is_deepspeed_zero3_enabled` for scripts that run with
`import zeroshard as deepspeed`: the one-line replacement of

    from transformers.integrations.deepspeed import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

is `from zeroshard.integrations.hf import HfDeepSpeedConfig, is_deepspeed_zero3_enabled`.

transformers' object belongs to the deepspeed package: constructing it checks the installed
`deepspeed` distribution, and while it lives, `from_pretrained` and `resize_token_embeddings` import
`deepspeed` and partition the model with it, which zeroshard cannot train (`initialize` refuses it).
This one answers the same queries about the config (`is_zero3()`, `get_value(...)`, ...) and tells
transformers nothing: `from_pretrained` builds the whole model on each rank and `initialize` partitions
it. A model too large for one rank is built under `zeroshard.zero.Init` instead (docs/integrations.md).
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

from zeroshard.config import read_config

__all__ = ["HfDeepSpeedConfig", "is_deepspeed_zero3_enabled"]

_live: weakref.ref[HfDeepSpeedConfig] | None = None  # the latest one constructed, as in transformers


class HfDeepSpeedConfig:
    """A DeepSpeed config (a dict or a path to a JSON file) and queries on it, with accelerate's
    `HfDeepSpeedConfig` methods. Keep it referenced while `is_deepspeed_zero3_enabled()` should
    see it. It does not make `from_pretrained` partition the model (the module docstring says why)."""

    def __init__(self, config_file_or_dict):
        global _live
        self.config: dict[str, Any] = copy.deepcopy(read_config(config_file_or_dict))
        self._stage = self.get_value("zero_optimization.stage", -1)
        devices = {
            self.get_value("zero_optimization.offload_optimizer.device"),
            self.get_value("zero_optimization.offload_param.device"),
        }
        self._offload = self._stage in (2, 3) and bool(devices & {"cpu", "nvme"})
        _live = weakref.ref(self)

    def find_config_node(self, ds_key_long: str) -> tuple[dict | None, str]:
        """(the dict holding the last key of the dotted `ds_key_long`, that key); (None, key) if absent."""
        *nodes, key = ds_key_long.split(".")
        config: Any = self.config
        for node in nodes:
            config = config.get(node)
            if config is None:
                return None, key
        return config, key

    def get_value(self, ds_key_long: str, default=None):
        config, key = self.find_config_node(ds_key_long)
        return default if config is None else config.get(key, default)

    def is_true(self, ds_key_long: str) -> bool:
        """True only if the value is set and true."""
        value = self.get_value(ds_key_long)
        return False if value is None else bool(value)

    def is_false(self, ds_key_long: str) -> bool:
        """True only if the value is set and false."""
        value = self.get_value(ds_key_long)
        return False if value is None else not bool(value)

    def is_zero2(self) -> bool:
        return self._stage == 2

    def is_zero3(self) -> bool:
        return self._stage == 3

    def is_offload(self) -> bool:
        return self._offload


def is_deepspeed_zero3_enabled() -> bool:
    """Whether the latest `HfDeepSpeedConfig` built here is alive and says stage 3 (a script asks this
    to turn on `generate(synced_gpus=True)` or to gather parameters)."""
    config = _live() if _live is not None else None
    return config is not None and config.is_zero3()
