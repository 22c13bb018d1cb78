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

[Note: where zero.Init's slices live]
A slice lives on the engine's device by default ("device"); `remote_device="cpu"` keeps it in host
memory (page-locked with pin_memory, where a GPU exists), `"nvme"` in a file of an NVMe store of its
own under `offload_param.nvme_path` (offload/store.py), one memory-mapped file per slice. A slice in a
file is written back and dropped from memory as soon as it is cut, and again after every read, so
building a model needs memory for the module under construction only, whatever the model's size; the
file is deleted when the engine has taken its parameter, and the store when its last file is gone.
The full tensors a constructor makes and frees (a 2048 x 2048 fp32 weight is 16 MB) come from
glibc's heap once its mmap threshold has risen past them, and freed heap memory stays with the
process, growing with the model although none of it is in use (measured:
docs/bench/offload_nvme_lowbit.txt). With slices in files, each slice's release trims the heap
(malloc_trim), which gives it back ([Note: trimming the heap] in core/heap.py). Collectives run on
`Partition.device` (the GPU under NCCL): a slice elsewhere is copied there for them.

`_SHARDS` below is one of the weak maps of [Note: the parameter registry] (core/registry.py): a
partitioned parameter's record, from its partitioning until an engine takes it. Each record is also
held in the core's registry with `materialize` as its hand-over, which the core calls unit by unit
while it lays out the engine's flat groups.
"""

from __future__ import annotations

import contextlib
import enum
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from zeroshard.core import registry
from zeroshard.core.comm import Communicator
from zeroshard.core.heap import trim_heap
from zeroshard.offload.store import NVMeStore

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
    device: torch.device  # where collectives run and, after the context, stubs live
    dtype: torch.dtype | None  # shards are cast to it (Init(dtype=...)); None keeps each parameter's
    comm_timeout_s: float = 300.0
    check_collectives: bool = False
    comm: Communicator | None = None  # open only inside the Init context
    live: list = field(default_factory=list)  # parameters UNSHARDED by Init's initialisation tracking
    home: str = "device"  # where slices live: "device", "cpu" or "nvme" ([Note: where zero.Init's slices live])
    store: NVMeStore | None = None  # the slices' files when home is "nvme"
    pin_memory: bool = False  # home "cpu" with a GPU: page-locked slices
    made: int = 0  # slices made so far: names their files
    orphans: list = field(default_factory=list)  # records of parameters freed before an engine took them

    def communicator(self) -> Communicator:
        return self.comm or Communicator(self.comm_timeout_s, self.check_collectives)

    def new_slice(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled 1-D slice in the slices' home."""
        if self.store is not None:
            self.made += 1
            return self.store.tensor(f"zero_init.{self.made}", numel, dtype)  # a new file reads as zeros
        if self.home == "cpu":
            pin = self.pin_memory and self.device.type == "cuda"
            return torch.zeros(numel, dtype=dtype, pin_memory=pin)
        return torch.zeros(numel, dtype=dtype, device=self.device)

    def settle(self, slices) -> None:
        """`slices` were just written or read: a file's pages go back to disk and out of memory, and
        so does the heap memory of the full tensors freed since ([Note: where zero.Init's slices live])."""
        if self.store is not None:
            self.store.release(slices)
            trim_heap()

    def retire(self, slices) -> None:
        """`slices` are no longer needed: their files go, with those of parameters freed meanwhile."""
        orphans = []
        while self.orphans:  # pop: a finalizer may append meanwhile
            orphans.append(self.orphans.pop())
        if self.store is not None:
            self.store.drop([*slices, *(record.shard for record in orphans)])

    def close_if_done(self) -> None:
        """The store goes with its last file (the engine has taken every parameter)."""
        self.retire([])
        if self.store is not None and self.store.empty:
            self.store.destroy()
            self.store = None


@dataclass(eq=False)
class ParamShard:
    partition: Partition
    shape: torch.Size  # of the full parameter
    dtype: torch.dtype  # of the full parameter
    device: torch.device  # of the full parameter and its stub
    shard: torch.Tensor  # 1-D, numel = ceil(numel / world_size), in the partition's home
    state: ShardState = ShardState.SHARDED
    # When the parameter is freed before an engine takes it (a weight replaced by a tied one), its
    # slice is retired at the partition's next use: a finalizer may run on any thread, the store's
    # own included, so it only queues the record.
    forget: weakref.finalize | None = None


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
        if partition.store is not None:
            record.forget = weakref.finalize(param, partition.orphans.append, record)
            record.forget.atexit = False  # at exit the store removes its directory itself
    else:  # partitioned again after Init's mode made it full: `.data = ...` may have changed anything
        partition.retire([record.shard])
        record.shape, record.dtype, record.device, record.shard = data.shape, data.dtype, data.device, shard
    release(param, record)


def _broadcast_and_cut(
    data: torch.Tensor, partition: Partition, comm: Communicator, src: int, what: str
) -> torch.Tensor:
    """This rank's slice (1-D, numel = ceil(numel / world), zero padded) of rank `src`'s `data`."""
    full = data.to(partition.device).contiguous()  # collectives run on partition.device (NCCL: the GPU)
    comm.broadcast(full, src, what)
    numel, rank = full.numel(), partition.rank
    shard_numel = -(-numel // partition.world_size)  # ceil
    shard = partition.new_slice(shard_numel, partition.dtype or full.dtype)
    lo, hi = min(rank * shard_numel, numel), min((rank + 1) * shard_numel, numel)
    shard[: hi - lo].copy_(full.reshape(-1)[lo:hi])
    partition.settle([shard])
    return shard


def gather_param(param: nn.Parameter, record: ParamShard, comm: Communicator, what: str) -> None:
    """`.data` <- the full parameter, all-gathered from every rank's slice."""
    partition = record.partition
    shard = record.shard.to(partition.device)  # a slice in host memory or a file goes where collectives run
    full = torch.empty(shard.numel() * partition.world_size, dtype=shard.dtype, device=shard.device)
    comm.all_gather(full, shard, f"zero: gather {what}")  # 1-D, numel = world * shard_numel, padded
    partition.settle([record.shard])
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
    old = record.shard
    record.shard = _broadcast_and_cut(
        param.data, record.partition, comm, modifier_rank, "GatheredParameters: values of the modifier rank"
    )
    record.partition.retire([old])


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
        todo.setdefault((record.shard.dtype, record.partition.device), []).append((param, record))
    for items in todo.values():
        _gather_together(items, comm)
        for param, record in items:
            del _SHARDS[param]
            if record.forget is not None:
                record.forget.detach()
            record.partition.retire([record.shard])
    for partition in {id(r.partition): r.partition for items in todo.values() for _, r in items}.values():
        partition.close_if_done()


def _gather_together(items: list, comm: Communicator) -> None:
    device = items[0][1].partition.device  # where collectives run
    local = torch.cat([record.shard.to(device) for _, record in items])  # 1-D, this rank's slices back to back
    out = torch.empty(comm.world_size * local.numel(), dtype=local.dtype, device=local.device)
    comm.all_gather(out, local, f"zero.Init slices of {len(items)} parameters for the engine's flat layout")
    by_rank = out.view(comm.world_size, local.numel())  # (world, sum of shard_numel)
    offset = 0
    for param, record in items:
        size = record.shard.numel()
        full = by_rank[:, offset : offset + size].reshape(-1)  # a copy: rank-major = the flattened parameter
        param.data = full[: record.shape.numel()].view(record.shape).to(record.device, record.dtype)
        offset += size
