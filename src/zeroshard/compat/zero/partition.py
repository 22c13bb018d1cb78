"""Parameters partitioned outside an engine (built under `zero.Init`): one record per parameter, how a
rank's slice is cut, and how the full tensor is gathered back.

[Note: per-parameter partitioning]
Under zero.Init each floating parameter is flattened and cut into `world_size` equal slices of
`shard_numel = ceil(numel / world_size)` elements, zero padded at the end; rank r keeps slice r. Before
cutting, rank 0's values are broadcast, so every rank keeps a slice of the same tensor, exactly as
`zeroshard.initialize` broadcasts rank 0's parameters (DDP's rule). The parameter's `.data` becomes a
*stub*: a tensor of the full shape, dtype and device that owns a single NaN element (expanded with zero
strides), so shape queries keep working, an accidental read shows NaN and an accidental in-place write
fails (torch refuses to write through overlapping memory). `zeroshard.initialize` gathers the
parameters back unit by unit while it lays out that unit's flat groups ([Note: flat layout]), so no
rank ever holds more than one unit in full.

`_SHARDS` below is one of the weak maps of [Note: the parameter registry] (core/registry.py): a
partitioned parameter's record, from its partitioning until an engine takes it. Each record is also
held in the core's registry with `materialize` as its hand-over, which the core calls unit by unit
while it lays out the engine's flat groups.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from zeroshard.core import registry
from zeroshard.core.comm import Communicator

_SHARDS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # see [Note: the parameter registry]


class ShardState(enum.Enum):
    SHARDED = "sharded"  # `.data` is a stub; `shard` holds this rank's slice
    UNSHARDED = "unsharded"  # `.data` is full, being initialised under Init; `shard` is stale
    GATHERED = "gathered"  # `.data` is full inside GatheredParameters; `shard` is current


@dataclass(eq=False)
class Partition:
    """What the parameters of one Init context share."""

    world_size: int
    rank: int
    device: torch.device  # where shards (and, after the context, stubs) live
    dtype: torch.dtype | None  # shards are cast to it (Init(dtype=...)); None keeps each parameter's
    comm_timeout_s: float = 300.0
    check_collectives: bool = False
    comm: Communicator | None = None  # open only inside the Init context
    live: list = field(default_factory=list)  # parameters UNSHARDED by Init's initialisation tracking

    def communicator(self) -> Communicator:
        return self.comm or Communicator(self.comm_timeout_s, self.check_collectives)


@dataclass(eq=False)
class ParamShard:
    partition: Partition
    shape: torch.Size  # of the full parameter
    dtype: torch.dtype  # of the full parameter
    device: torch.device  # of the full parameter and its stub
    shard: torch.Tensor  # 1-D, numel = ceil(numel / world_size), on partition.device
    state: ShardState = ShardState.SHARDED


def record_of(param) -> ParamShard | None:
    return _SHARDS.get(param) if isinstance(param, nn.Parameter) else None


def is_stub(param) -> bool:
    record = record_of(param)
    return record is not None and record.state is ShardState.SHARDED


def records_of(partition: Partition) -> list[tuple[nn.Parameter, ParamShard]]:
    return [(p, r) for p, r in list(_SHARDS.items()) if r.partition is partition]


def stub(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Full shape, one element of storage (see [Note: per-parameter partitioning])."""
    return torch.full((), float("nan"), dtype=dtype, device=device).expand(shape)


# -- cutting and gathering --------------------------------------------------------------------------------
def partition_param(param: nn.Parameter, partition: Partition, comm: Communicator, what: str) -> None:
    """Full `.data` -> this rank's slice of rank 0's values; `.data` becomes a stub."""
    data = param.data
    shard = _broadcast_and_cut(data, partition, comm, 0, f"zero.Init: rank 0's values of {what}")
    record = _SHARDS.get(param)
    if record is None:
        record = _SHARDS[param] = ParamShard(partition, data.shape, data.dtype, data.device, shard)
        registry.hold(param, materialize)  # the engine takes its values unit by unit
    else:  # partitioned again after Init's mode made it full: `.data = ...` may have changed anything
        record.shape, record.dtype, record.device, record.shard = data.shape, data.dtype, data.device, shard
    release(param, record)


def _broadcast_and_cut(
    data: torch.Tensor, partition: Partition, comm: Communicator, src: int, what: str
) -> torch.Tensor:
    """This rank's slice (1-D, numel = ceil(numel / world), zero padded) of rank `src`'s `data`."""
    full = data.to(partition.device).contiguous()  # collectives run on the shard device (NCCL: the GPU)
    comm.broadcast(full, src, what)
    numel, rank = full.numel(), partition.rank
    shard_numel = -(-numel // partition.world_size)  # ceil
    shard = torch.zeros(shard_numel, dtype=partition.dtype or full.dtype, device=partition.device)
    lo, hi = min(rank * shard_numel, numel), min((rank + 1) * shard_numel, numel)
    shard[: hi - lo].copy_(full.reshape(-1)[lo:hi])
    return shard


def gather_param(param: nn.Parameter, record: ParamShard, comm: Communicator, what: str) -> None:
    """`.data` <- the full parameter, all-gathered from every rank's slice."""
    shard = record.shard
    full = torch.empty(shard.numel() * record.partition.world_size, dtype=shard.dtype, device=shard.device)
    comm.all_gather(full, shard, f"zero: gather {what}")  # 1-D, numel = world * shard_numel, padded
    param.data = full[: record.shape.numel()].view(record.shape).to(record.device, record.dtype)


def release(param: nn.Parameter, record: ParamShard) -> None:
    """Back to the stub; the slice in `record.shard` is what stays."""
    param.data = stub(record.shape, record.dtype, record.device)
    record.state = ShardState.SHARDED


# -- zero.Init's live parameters ---------------------------------------------------------------------------
def unshard_for_op(partition: Partition, params: list, overwritten) -> None:
    """Make `params` full for an operation that reads them, or that overwrites `overwritten` entirely (then
    no values are needed: an empty tensor, so an init draws exactly the random numbers it draws normally).
    Other live parameters are partitioned again first, so at most one operation's worth is full."""
    keep = {id(p) for p in params}
    for param in [p for p in partition.live if id(p) not in keep]:
        repartition_live(partition, param)
    for param in params:
        record = _SHARDS[param]
        if param is overwritten:
            param.data = torch.empty(record.shape, dtype=record.dtype, device=record.device)
        else:
            assert partition.comm is not None  # open: inside the Init context
            gather_param(param, record, partition.comm, "a parameter read during construction")
        record.state = ShardState.UNSHARDED
        partition.live.append(param)


def repartition_live(partition: Partition, param: nn.Parameter) -> None:
    partition.live[:] = [p for p in partition.live if p is not param]  # by identity: `==` compares values
    if _SHARDS[param].state is ShardState.UNSHARDED:
        assert partition.comm is not None  # open: inside the Init context
        partition_param(param, partition, partition.comm, "a parameter initialised during construction")


# -- GatheredParameters on partitioned parameters ----------------------------------------------------------
@contextlib.contextmanager
def gathered(params: list, modifier_rank: int | None):
    """Full parameters inside the block; with `modifier_rank`, that rank's values are kept on exit."""
    records = [(p, _SHARDS[p]) for p in params]
    open_comm = next((r.partition.comm for _, r in records if r.partition.comm is not None), None)
    comm = open_comm or records[0][1].partition.communicator()  # all ranks call this: new_group is safe
    try:
        with torch._C.DisableTorchFunction():
            for param, record in records:
                if record.state is ShardState.UNSHARDED:
                    repartition_live(record.partition, param)  # its values are current: cut them first
                assert record.state is ShardState.SHARDED, (record.state, "parameter gathered twice")
                gather_param(param, record, comm, "GatheredParameters")
                record.state = ShardState.GATHERED
        yield
    finally:
        with torch._C.DisableTorchFunction():
            for param, record in records:
                if modifier_rank is not None:
                    partition_modified(param, record, comm, modifier_rank)
                release(param, record)
        if open_comm is None:
            comm.destroy()


def partition_modified(param: nn.Parameter, record: ParamShard, comm: Communicator, modifier_rank: int) -> None:
    record.shard = _broadcast_and_cut(
        param.data, record.partition, comm, modifier_rank, "GatheredParameters: values of the modifier rank"
    )


# -- handing over to an engine -------------------------------------------------------------------------------
def materialize(params: list, comm: Communicator) -> None:
    """Full values for the partitioned ones among `params` (one unit), with one all-gather per dtype;
    they stop being tracked here: the engine's flat groups own them from now on."""
    todo: dict[tuple, list] = {}
    for param in params:
        record = record_of(param)
        if record is None:
            continue
        if record.state is not ShardState.SHARDED:
            raise RuntimeError(
                "zeroshard.initialize was called inside zero.Init or GatheredParameters: "
                "leave those contexts before initializing the engine"
            )
        if record.partition.world_size != comm.world_size:
            raise ValueError(
                f"the model was partitioned by zero.Init over {record.partition.world_size} ranks, "
                f"the engine runs on {comm.world_size}: build it again under the engine's world"
            )
        todo.setdefault((record.shard.dtype, record.shard.device), []).append((param, record))
    for items in todo.values():
        _gather_together(items, comm)
        for param, _ in items:
            del _SHARDS[param]


def _gather_together(items: list, comm: Communicator) -> None:
    local = torch.cat([record.shard for _, record in items])  # 1-D, this rank's slices back to back
    out = torch.empty(comm.world_size * local.numel(), dtype=local.dtype, device=local.device)
    comm.all_gather(out, local, f"zero.Init slices of {len(items)} parameters for the engine's flat layout")
    by_rank = out.view(comm.world_size, local.numel())  # (world, sum of shard_numel)
    offset = 0
    for param, record in items:
        size = record.shard.numel()
        full = by_rank[:, offset : offset + size].reshape(-1)  # a copy: rank-major = the flattened parameter
        param.data = full[: record.shape.numel()].view(record.shape).to(record.device, record.dtype)
        offset += size
