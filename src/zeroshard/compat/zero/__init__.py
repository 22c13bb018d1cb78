"""`zeroshard.zero`: DeepSpeed's `deepspeed.zero` namespace. `Init` builds a model already partitioned
(init.py); `GatheredParameters` gives full parameters on demand (gathered.py); partition.py holds the
per-parameter slices ([Note: per-parameter partitioning]) until an engine takes them."""

from zeroshard.compat.zero.gathered import GatheredParameters
from zeroshard.compat.zero.init import Init

__all__ = ["GatheredParameters", "Init"]
