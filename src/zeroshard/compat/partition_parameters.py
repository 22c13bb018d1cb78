"""`deepspeed.runtime.zero.partition_parameters`: where scripts import `ZeroParamStatus`, `Init` and
`GatheredParameters` from.

`ZeroParamStatus` is DeepSpeed's name for a stage-3 parameter's state; zeroshard's own states are
those of a unit ([Note: unit states] in core/unit.py), which this enum mirrors value for value.
"""

from __future__ import annotations

import enum

from zeroshard.compat.zero import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus"]


class ZeroParamStatus(enum.Enum):
    AVAILABLE = 1  # gathered: the full parameter is usable (UNSHARDED)
    NOT_AVAILABLE = 2  # only this rank's shard is held (SHARDED)
    INFLIGHT = 3  # a gather is under way (GATHERING)
