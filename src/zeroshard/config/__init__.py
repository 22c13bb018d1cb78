"""The config layer: a DeepSpeed JSON config parsed once, at the edge, into typed sections.

`read_config(config)` is the one entry every reader uses (the engine, the integrations, the CLI),
and `load_config(config, world_size)` validates what it read; `schema` holds the sections,
`not_acted_on` the one table of keys accepted but not acted on. Nothing here imports another
zeroshard layer.
"""

from zeroshard.config.parse import (
    ConfigError,
    ConfigKeyNotActedOnWarning,
    ZeroShardConfig,
    load_config,
    read_config,
    warn_not_acted_on,
)

__all__ = [
    "ConfigError",
    "ConfigKeyNotActedOnWarning",
    "ZeroShardConfig",
    "load_config",
    "read_config",
    "warn_not_acted_on",
]
