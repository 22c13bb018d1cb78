"""Apply sharding to a module: split its parameters into units and flat groups.

This is the PyTorch-native layer under the engine: it knows nothing about configs, schedulers or
loss scaling. `shard_module` returns the units; `Lifecycle` (lifecycle.py) drives them.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from zeroshard.core.comm import Communicator
from zeroshard.core.group import FlatGroup
from zeroshard.core.policy import StagePolicy
from zeroshard.core.placement import Placement
from zeroshard.core.precision import PrecisionPolicy
from zeroshard.core.unit import Unit
from zeroshard.core.wrap import assign_owners, unit_modules
from zeroshard.core.partition import materialize

log = logging.getLogger(__name__)

PERSISTENT = "<persistent>"


def shard_module(model: nn.Module, policy: StagePolicy, comm: Communicator, *,
                 optimizer_groups: dict[int, int], precision: PrecisionPolicy = PrecisionPolicy(),
                 persistence_threshold: int = 0, wrap_modules: list[str] | None = None,
                 placement: Placement | None = None) -> list[Unit]:
    """Build the units of `model`. `optimizer_groups`: id(param) -> index of its optimizer param group.

    Rank 0's values are broadcast first, as DDP does, so that every rank starts from the same model.
    Parameters with fewer than `persistence_threshold` elements stay unsharded at stage 3 (their
    gathering would cost more in latency than it saves in memory), like DeepSpeed's
    `stage3_param_persistence_threshold`.
    """
    named = list(model.named_parameters())  # tied parameters appear once, under their first name
    if not named:
        raise ValueError("the model has no parameters: there is nothing for zeroshard to shard or train")
    for name, param in named:
        if not param.is_floating_point():
            raise ValueError(f"parameter '{name}' has dtype {param.dtype}; zeroshard trains floating-point "
                             "parameters only")
    modules = unit_modules(model, wrap_modules)
    owners = assign_owners(model, modules)
    buckets: dict[str, list[tuple[str, nn.Parameter]]] = {name: [] for name, _ in modules}
    buckets[PERSISTENT] = []
    for name, param in named:
        persistent = policy.shard_parameters and param.numel() < persistence_threshold
        buckets[PERSISTENT if persistent else owners[id(param)]].append((name, param))
    module_of = dict(modules)
    units = []
    for unit_name, members in buckets.items():
        if not members:
            continue
        reshards = policy.shard_parameters and unit_name != PERSISTENT
        materialize([param for _, param in members], comm)  # built under zero.Init: one unit in full at a time
        groups = _build_groups(members, policy, comm, optimizer_groups, precision, reshards,
                               placement or Placement())
        units.append(Unit(unit_name, module_of.get(unit_name), groups, comm, reshards))
    log.info("zeroshard: %d units, %s", len(units), ", ".join(f"{u.name}={u.numel}" for u in units))
    return units


def _build_groups(members, policy: StagePolicy, comm: Communicator, optimizer_groups, precision,
                  reshards: bool, placement: Placement) -> list[FlatGroup]:
    by_key: dict[tuple, list[tuple[str, nn.Parameter]]] = {}
    for name, param in members:
        index = optimizer_groups.get(id(param)) if param.requires_grad else None
        by_key.setdefault((index is not None, index), []).append((name, param))
    groups = []
    for (_, index), items in sorted(by_key.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        names, params = [n for n, _ in items], [p for _, p in items]
        for name, param in items:
            # Same start on every rank (DDP broadcasts rank 0's parameters too).
            comm.broadcast(param.data, 0, f"initial broadcast of '{name}'")
        trainable = index is not None
        groups.append(FlatGroup(
            names, params, policy=policy, precision=precision, world_size=comm.world_size, rank=comm.rank,
            reshards=reshards, optimizer_group=index,
            master_store=_master_store(placement, precision, reshards, trainable),
            grad_store=placement.optimizer_store if trainable else None))
    return groups


def _master_store(placement: Placement, precision: PrecisionPolicy, reshards: bool, trainable: bool):
    """Where a group's fp32 master lives. At stage 3 the master shard is what gets gathered, so it
    follows offload_param; otherwise it follows offload_optimizer when it is a copy of its own (mixed
    precision). An fp32 master that is the parameter storage itself (stages 0-2) stays put."""
    if reshards and placement.param_store is not None:
        return placement.param_store
    separate_copy = precision.param_dtype != torch.float32
    return placement.optimizer_store if (trainable and separate_copy) else None
