"""Apply sharding to a module: split its parameters into units and flat groups.

This is the PyTorch-native layer under the engine: it knows nothing about configs, schedulers or
loss scaling. `shard_module` returns the units; `Lifecycle` (lifecycle.py) drives them.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from zeroshard.core import backend, registry
from zeroshard.core.comm import Communicator
from zeroshard.core.group import FlatGroup
from zeroshard.core.mesh import local_tensor
from zeroshard.core.owners import OwnerPlan
from zeroshard.core.placement import Placement
from zeroshard.core.policy import PrecisionPolicy, StagePolicy
from zeroshard.core.unit import Links, Unit
from zeroshard.core.wrap import assign_owners, unit_modules

log = logging.getLogger(__name__)

PERSISTENT = "<persistent>"


def shard_module(
    model: nn.Module,
    policy: StagePolicy,
    comm: Communicator,
    *,
    optimizer_groups: dict[int, int],
    precision: PrecisionPolicy = PrecisionPolicy(),
    persistence_threshold: int = 0,
    wrap_modules: list[str] | None = None,
    placement: Placement | None = None,
    partition: Communicator | None = None,
    links: Links = Links(),
    owner_plan: OwnerPlan | None = None,
) -> list[Unit]:
    """Build the units of `model`. `optimizer_groups`: id(param) -> index of its optimizer param group.

    Rank 0's values (of `comm`'s group) are broadcast first, as DDP does, so that every rank starts from the same model.
    Parameters with fewer than `persistence_threshold` elements stay unsharded at stage 3 (their
    gathering would cost more in latency than it saves in memory).
    `partition`: the group the flat layouts are sliced over (default `comm`; a MiCS shard group), and
    `links` the unit's other communicators ([Note: ZeRO++ and MiCS] in unit.py).
    `owner_plan`: given, the optimizer param groups it names (`owner_plan.groups`) need whole parameters,
    and their flat groups are laid out by owner ([Note: whole-parameter ownership] in owners.py).
    """
    partition = partition or comm
    named = list(model.named_parameters())  # tied parameters appear once, under their first name
    if not named:
        raise ValueError("the model has no parameters: there is nothing for zeroshard to shard or train")
    for name, param in named:
        if not param.is_floating_point():
            raise ValueError(
                f"parameter '{name}' has dtype {param.dtype}; zeroshard trains floating-point parameters only"
            )
    modules = unit_modules(model, wrap_modules)
    owners = assign_owners(model, modules)
    buckets: dict[str, list[tuple[str, nn.Parameter]]] = {name: [] for name, _ in modules}
    buckets[PERSISTENT] = []
    for name, param in named:
        persistent = policy.shard_parameters and local_tensor(param).numel() < persistence_threshold
        buckets[PERSISTENT if persistent else owners[id(param)]].append((name, param))
    module_of = dict(modules)
    if owner_plan is not None and policy.shard_optimizer and not policy.shard_parameters:
        buckets = _span_whole_parameters(buckets, owner_plan, optimizer_groups)
    units = []
    for unit_name, members in buckets.items():
        if not members:
            continue
        reshards = policy.shard_parameters and unit_name != PERSISTENT
        registry.take_values([param for _, param in members], comm)  # built under zero.Init: one unit in full at a time
        groups = _build_groups(
            members,
            policy,
            comm,
            optimizer_groups,
            precision,
            reshards,
            placement or Placement(),
            partition,
            owner_plan,
        )
        units.append(Unit(unit_name, module_of.get(unit_name), groups, partition, reshards, links))
    log.info("zeroshard: %d units, %s", len(units), ", ".join(f"{u.name}={u.numel}" for u in units))
    if owner_plan is not None and owner_plan.numel:
        log.info("zeroshard: whole-parameter optimizer: %s", owner_plan.summary())
    return units


def _span_whole_parameters(buckets: dict, owner_plan: OwnerPlan, optimizer_groups: dict[int, int]) -> dict:
    """Stages 1/2: the whole parameters of consecutive units moved into the first unit of their span
    ([Note: spans of units] in owners.py); `owner_plan.span_units` records the spans."""

    def whole(param) -> bool:
        return param.requires_grad and optimizer_groups.get(id(param)) in owner_plan.groups

    names = [name for name, members in buckets.items() if any(whole(p) for _, p in members)]
    shapes = [[local_tensor(p).shape for _, p in buckets[name] if whole(p)] for name in names]
    spans = owner_plan.plan_spans(shapes)
    out = {name: [(n, p) for n, p in members if not whole(p)] for name, members in buckets.items()}
    for span in spans:
        leader = names[span[0]]
        out[leader] = [(n, p) for i in span for n, p in buckets[names[i]] if whole(p)] + out[leader]
        owner_plan.span_units.append([names[i] for i in span])
    return out


def _build_groups(
    members,
    policy: StagePolicy,
    comm: Communicator,
    optimizer_groups,
    precision,
    reshards: bool,
    placement: Placement,
    partition: Communicator,
    owner_plan: OwnerPlan | None = None,
) -> list[FlatGroup]:
    by_key: dict[tuple, list[tuple[str, nn.Parameter]]] = {}
    for name, param in members:
        index = optimizer_groups.get(id(param)) if param.requires_grad else None
        by_key.setdefault((index is not None, index), []).append((name, param))
    # Stages 2/3 free a unit's full gradient after its reduction, stage 3 its gathered parameters after
    # use (not the persistent unit's, which has reshards False): such units' groups may be capped in
    # size ([Note: gathered buffers under glibc's mmap ceiling] in backend.py).
    freed = policy.shard_gradients and (reshards or not policy.shard_parameters)
    itemsize = max(precision.param_dtype.itemsize, precision.reduce_dtype.itemsize)  # gathered, full gradient
    cap = backend.flat_group_numel(comm.device, itemsize) if freed else None
    whole_groups = owner_plan.groups if owner_plan is not None else frozenset()
    keyed = [  # whole parameters are never cut into capped chunks: their span is what balances them
        (key, chunk)
        for key, items in sorted(by_key.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0))
        for chunk in (_chunks(items, cap) if cap is not None and key[1] not in whole_groups else [items])
    ]
    groups = []
    for (_, index), items in keyed:
        names, params = [n for n, _ in items], [p for _, p in items]
        for name, param in items:
            # Same start on every rank (DDP broadcasts rank 0's parameters too); rank 0 of `comm`'s
            # group, the dp group under model parallelism, so that tp slices stay distinct. Parameters
            # on the meta device have no values yet ([Note: deferred values] in group.py).
            if param.device.type != "meta":
                comm.broadcast(local_tensor(param.detach()), 0, f"initial broadcast of '{name}'")
        trainable = index is not None
        owners = None  # [Note: whole-parameter ownership] in owners.py
        # Frozen parameters are laid out whole only in resharding groups (whose shards a store packs).
        if owner_plan is not None and index in owner_plan.groups and policy.shard_optimizer and (trainable or reshards):
            owners = owner_plan.assign([local_tensor(p).shape for p in params])
        device = comm.device if params[0].device.type == "meta" else params[0].device
        master_store, compute_shard = _master_placement(placement, precision, device, reshards, trainable)
        groups.append(
            FlatGroup(
                names,
                params,
                policy=policy,
                precision=precision,
                world_size=partition.world_size,
                rank=partition.rank,
                reshards=reshards,
                optimizer_group=index,
                owners=owners,
                uneven=owners is not None and owner_plan is not None and owner_plan.uneven,
                master_store=master_store,
                compute_shard=compute_shard,
                grad_store=placement.optimizer_store if trainable else None,
                device=comm.device,
            )
        )
    return groups


def _chunks(items: list[tuple[str, nn.Parameter]], max_numel: int) -> list[list]:
    """`items` in order, cut into runs of at most `max_numel` elements (a larger parameter alone)."""
    chunks: list[list] = [[]]
    numel = 0
    for name, param in items:
        size = local_tensor(param).numel()
        if chunks[-1] and numel + size > max_numel:
            chunks.append([])
            numel = 0
        chunks[-1].append((name, param))
        numel += size
    return chunks


def _master_placement(
    placement: Placement, precision: PrecisionPolicy, device: torch.device, reshards: bool, trainable: bool
):
    """(store of the group's fp32 master or None, whether a stage-3 group keeps a compute-dtype shard on
    `device` to gather from); see [Note: master placement].

    [Note: master placement]
    Where a master goes is decided by *device*, not by dtype: the optimizer step runs where the
    optimizer states are, so with an optimizer store the master must be a tensor the store's device can
    step in place.
      * Stage 3 with a parameter store: the parameter shard lives in the param store and is also the
        master (ZeRO-Infinity); every gather reads it from there.
      * An optimizer store whose memory the compute device cannot address (a GPU computing, host memory
        or NVMe files storing): the master is a separate fp32 copy in the store whatever the compute
        dtype, and the step runs there (states created next to it). Updated values go back to the
        device parameters (stages 1/2: this rank's slice of the full buffer, then the all-gather) or
        to a compute-dtype shard kept on the device (stage 3: what the all-gather reads, so gathers
        never cross the host link). Each reduced gradient shard crosses device -> host once.
      * Otherwise the master stays in compute memory. In fp32 it *is* the parameter storage (a view of
        the full buffer at stages 0-2, the shard itself at stage 3): zero copy. On a CPU-only machine
        this holds with a CPU or NVMe store too: host memory is compute memory there, and a separate
        master in the store would cost 4 bytes per parameter (and an NVMe round trip) for nothing.
        In bf16/fp16 the master is a copy anyway and goes to the optimizer store if there is one.
    """
    if reshards and placement.param_store is not None:
        return placement.param_store, False
    store = placement.optimizer_store if trainable else None
    if store is None:
        return None, False
    if not store.addressable_from(device):
        return store, reshards
    return (None if precision.params_are_masters else store), False
