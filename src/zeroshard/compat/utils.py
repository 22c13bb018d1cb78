"""`deepspeed.utils`: the logger and the `safe_get_full_*` / `safe_set_full_*` accessors.

DeepSpeed-aware code reads one parameter's fp32 master weights, gradient or optimizer state in full
with `safe_get_full_fp32_param(param)` (and writes them with `safe_set_full_*`), whatever the ZeRO
stage. Here they are read from the engine's flat groups: this rank's slice of the group (its master,
its reduced gradient, its optimizer state, laid out like the master) is all-gathered over the ranks
when the stage shards it, and the parameter's elements are cut out of the full buffer.

[Note: safe accessors are collective]
At stages 1-3 the full values exist on no single rank, so every rank must call these functions for
the same parameters in the same order (as DeepSpeed requires at stage 3); at stage 0 they
communicate nothing. The setters take the full value on every rank; each rank keeps its own part and
the unsharded parameters are refreshed from the new masters.
"""

from __future__ import annotations

import logging

import torch

from zeroshard.compat import zero_to_fp32  # deepspeed.utils.zero_to_fp32
from zeroshard.core.registry import engine_of

__all__ = [
    "log_dist",
    "logger",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "zero_to_fp32",
]

logger = logging.getLogger("zeroshard")  # DeepSpeed's `deepspeed.utils.logger`


def log_dist(message: str, ranks=None, level: int = logging.INFO) -> None:
    """Log `message` on the ranks listed (None or [-1]: every rank), prefixed by the rank."""
    import torch.distributed as dist  # only to read this process's rank

    rank = dist.get_rank() if dist.is_initialized() else 0
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, "[Rank %d] %s", rank, message)


def _locate(param, what: str):
    """(sharded, group, slot) of an engine's parameter."""
    sharded = engine_of(param)
    if sharded is None:
        raise ValueError(
            f"{what}: the tensor {tuple(getattr(param, 'shape', ()))} is not a parameter of a "
            "zeroshard engine (pass a parameter of the model given to initialize())"
        )
    sharded.wait_parameters()  # [Note: deferred parameter gather] in core/param_gather.py
    _, group = sharded._param_groups[id(param)]
    index = next(i for i, p in enumerate(group.params) if p is param)
    return sharded, group, group.layout.slots[index]


def _gather(sharded, group, local: torch.Tensor, what: str) -> torch.Tensor:
    """The full 1-D buffer (padded_numel) of a tensor laid out like `group.master` (see [Note: safe
    accessors are collective])."""
    local = local.detach().float()
    if not group.sharded_master:
        return local
    comm = sharded.comm
    full = torch.empty(group.layout.padded_numel, dtype=torch.float32, device=comm.device)
    comm.all_gather(full, local.to(comm.device).contiguous(), what, counts=group.layout.counts)
    return full


def _cut(full: torch.Tensor, slot, device) -> torch.Tensor:
    return full[slot.offset : slot.offset + slot.numel].view(slot.shape).clone().to(device)


def _with_master(group, fn):
    if group.master_store is not None:
        group.master_store.prefetch([group.master])
        group.master_store.ready([group.master])
    try:
        return fn()
    finally:
        group.release_master()


def safe_get_full_fp32_param(param) -> torch.Tensor | None:
    """The parameter's fp32 master weights in full (a copy); None for a frozen parameter, as in
    DeepSpeed (it has no optimizer-owned master). Collective at stages 1-3."""
    sharded, group, slot = _locate(param, "safe_get_full_fp32_param")
    if not group.trainable:
        return None
    full = _with_master(group, lambda: _gather(sharded, group, group.master, f"safe_get_full_fp32_param({slot.name})"))
    return _cut(full, slot, group.device)


def safe_get_full_grad(param) -> torch.Tensor | None:
    """The parameter's gradient in full, fp32, as the optimizer will see it: after the backward of an
    accumulation boundary it is reduced (averaged over ranks; with fp16 still multiplied by the loss
    scale, as DeepSpeed keeps it until the step). None for a frozen parameter. Collective at stages 1-3."""
    sharded, group, slot = _locate(param, "safe_get_full_grad")
    if not group.trainable:
        return None
    full = _gather(sharded, group, group.grad_for_optimizer(), f"safe_get_full_grad({slot.name})")
    return _cut(full, slot, group.device)


def safe_get_full_optimizer_state(param, optim_state_key: str) -> torch.Tensor | None:
    """Optimizer state `optim_state_key` ("exp_avg", "exp_avg_sq", "step", ...) of the parameter in
    full; None before the first step. Collective at stages 1-3 for elementwise states."""
    sharded, group, slot = _locate(param, "safe_get_full_optimizer_state")
    state = sharded.optimizer.group_state(group) if group.trainable else {}
    if not state:
        return None  # a frozen parameter, or before the first step, as DeepSpeed
    if optim_state_key not in state:
        raise KeyError(
            f"safe_get_full_optimizer_state: no optimizer state {optim_state_key!r} for "
            f"'{slot.name}'; it has {sorted(state)}"
        )
    value = state[optim_state_key]
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value.clone() if isinstance(value, torch.Tensor) else value
    full = _gather(sharded, group, value, f"safe_get_full_optimizer_state({slot.name}, {optim_state_key})")
    return _cut(full, slot, group.device)


def _write_own_pieces(group, slot, value: torch.Tensor, target: torch.Tensor | None) -> None:
    if tuple(value.shape) != tuple(slot.shape):
        raise ValueError(f"'{slot.name}' has shape {tuple(slot.shape)}, the value given {tuple(value.shape)}")
    flat = value.detach().reshape(-1)
    for piece_slot, lo, hi, view in group.master_pieces(target):
        if piece_slot == slot:
            view.copy_(flat[lo:hi].to(view.device, view.dtype))


@torch.no_grad()
def safe_set_full_fp32_param(param, value: torch.Tensor) -> None:
    """Replace the parameter's fp32 master weights with `value` (full shape, the same on every rank);
    the unsharded parameters follow. Collective (see [Note: safe accessors are collective])."""
    sharded, group, slot = _locate(param, "safe_set_full_fp32_param")
    _with_master(group, lambda: _write_own_pieces(group, slot, value, None))
    sharded.refresh_parameters()


@torch.no_grad()
def safe_set_full_optimizer_state(param, value: torch.Tensor, optim_state_key: str) -> None:
    """Replace optimizer state `optim_state_key` of the parameter with `value` (full shape, the same on
    every rank). Only after the first step, when the state exists."""
    sharded, group, slot = _locate(param, "safe_set_full_optimizer_state")
    optimizer = sharded.optimizer
    state = optimizer.group_state(group) if group.trainable else {}
    if optim_state_key not in state:
        raise KeyError(
            f"safe_set_full_optimizer_state: no optimizer state {optim_state_key!r} for '{slot.name}' "
            f"(it has {sorted(state) or 'none: the optimizer has not stepped yet'})"
        )
    target = state[optim_state_key]
    if not isinstance(target, torch.Tensor) or target.dim() == 0:
        state[optim_state_key] = value
    else:
        _write_own_pieces(group, slot, value, target)
    optimizer.load_group_state(group, state)


@torch.no_grad()
def safe_set_full_grad(param, value: torch.Tensor) -> None:
    """Replace the parameter's reduced gradient with `value` (full shape, the same on every rank), between
    a boundary backward and the step. Each rank writes its own part; nothing is communicated."""
    _, group, slot = _locate(param, "safe_set_full_grad")
    if not group.trainable:
        raise ValueError(f"safe_set_full_grad: '{slot.name}' is frozen (requires_grad=False): it has no gradient")
    _write_own_pieces(group, slot, value, group.grad_for_optimizer())


# -- this rank's part only (DeepSpeed's safe_*_local_*): no communication ----------------------------------
def _local_piece(group, slot, tensor: torch.Tensor) -> torch.Tensor:
    """1-D: the elements of the parameter in this rank's part of `tensor` (laid out like the master);
    empty when this rank's shard holds none of it."""
    for piece_slot, _, _, view in group.master_pieces(tensor):
        if piece_slot == slot:
            return view
    return tensor.new_empty(0)


def safe_get_local_fp32_param(param) -> torch.Tensor | None:
    _, group, slot = _locate(param, "safe_get_local_fp32_param")
    return _local_piece(group, slot, group.master).detach().clone() if group.trainable else None


def safe_get_local_grad(param) -> torch.Tensor | None:
    _, group, slot = _locate(param, "safe_get_local_grad")
    return _local_piece(group, slot, group.grad_for_optimizer()).float().clone() if group.trainable else None


def safe_get_local_optimizer_state(param, optim_state_key: str) -> torch.Tensor | None:
    sharded, group, slot = _locate(param, "safe_get_local_optimizer_state")
    state = sharded.optimizer.group_state(group) if group.trainable else {}
    value = state.get(optim_state_key)
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    return _local_piece(group, slot, value).clone()


@torch.no_grad()
def safe_set_local_fp32_param(param, value: torch.Tensor) -> None:
    """Set this rank's part (as `safe_get_local_fp32_param` returns it). Every rank calls it: the
    unsharded parameters are refreshed from the masters, a collective."""
    sharded, group, slot = _locate(param, "safe_set_local_fp32_param")
    _local_piece(group, slot, group.master).copy_(value.reshape(-1))
    sharded.refresh_parameters()


@torch.no_grad()
def safe_set_local_grad(param, value: torch.Tensor) -> None:
    _, group, slot = _locate(param, "safe_set_local_grad")
    _local_piece(group, slot, group.grad_for_optimizer()).copy_(value.reshape(-1))


@torch.no_grad()
def safe_set_local_optimizer_state(param, value: torch.Tensor, optim_state_key: str) -> None:
    sharded, group, slot = _locate(param, "safe_set_local_optimizer_state")
    state = sharded.optimizer.group_state(group)
    if optim_state_key not in state:
        raise KeyError(f"safe_set_local_optimizer_state: no optimizer state {optim_state_key!r} for '{slot.name}'")
    _local_piece(group, slot, state[optim_state_key]).copy_(value.reshape(-1))
    sharded.optimizer.load_group_state(group, state)
