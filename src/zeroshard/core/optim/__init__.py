"""The optimizer step over this rank's shards, one concept in several modules.

`ZeroOptimizer` (optimizer.py) is the torch optimizer the user passed, re-pointed at the fp32 master
shards of the flat groups (groups.py). Its step computes the global gradient norm in fp64 (norm.py),
steps parameters that got no gradient on any rank around (masked.py), leaves the masters and optimizer
state whole or refuses further use when the update fails half-way (rollback.py), and with offloaded
optimizer states streams the update through the store one sub-group at a time (streamed.py). The
collectives it needs go through the Communicator (core/comm.py); the units and flat groups it steps
are built by core/shard.py.
"""

from zeroshard.core.optim.optimizer import ZeroOptimizer

__all__ = ["ZeroOptimizer"]
