"""Whole-parameter optimizers (Muon) over flat groups: which param groups need whole parameters, the
matrices a rank owns as views of its master shard, and their state in the flat form checkpoints use.

A whole-parameter group's flat layout keeps each parameter inside its owner's slice ([Note:
whole-parameter ownership] in core/owners.py), so a rank's master shard holds whole matrices and
padding. The torch optimizer steps one view per owned matrix, shaped like the parameter, with the
matching view of the reduced gradient shard as its `.grad`; parameters owned elsewhere are not in
this rank's optimizer at all, so each update (Muon's Newton-Schulz) runs on exactly one rank.
Its per-parameter state (Muon's momentum) is the parameter's shape; `flat_state` lays it out like
the master, which is the form every checkpoint reader re-slices by parameter name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zeroshard.core.group import FlatGroup
from zeroshard.core.optim import declared
from zeroshard.core.optim.muon import MuonWithAdamW


def whole_param_groups(optimizer: torch.optim.Optimizer | None) -> frozenset[int]:
    """Indices of the param groups whose update needs whole parameters."""
    needs = declared.whole_groups_rule(optimizer) if optimizer is not None else None
    if optimizer is None or needs is None:
        return frozenset()
    return frozenset(i for i, g in enumerate(optimizer.param_groups) if needs(g))


@dataclass(frozen=True)
class Owned:
    """A parameter whose update this rank computes."""

    slot: int  # index into group.layout.slots
    lo: int  # its elements in group.master: [lo, hi)
    hi: int
    view: torch.Tensor  # group.master[lo:hi] shaped like the parameter: what the torch optimizer steps


def owned(group: FlatGroup) -> list[Owned]:
    """The parameters of `group` that lie whole in this rank's master (all of them at stage 0)."""
    start, end = group.opt_range
    out = []
    for index, slot in enumerate(group.layout.slots):
        if start <= slot.offset and slot.offset + slot.numel <= end:
            lo, hi = slot.offset - start, slot.offset + slot.numel - start
            out.append(Owned(index, lo, hi, group.master[lo:hi].view(slot.shape)))
        elif slot.offset < end and start < slot.offset + slot.numel:
            raise AssertionError(f"'{slot.name}' is cut by this rank's shard: its flat group is not owner-aligned")
    return out


def state_keys(optimizer: torch.optim.Optimizer, index: int) -> tuple[str, ...]:
    """The per-parameter state a step of param group `index` creates (Muon: momentum_buffer), asked
    of a twin over a 2 x 2 matrix with the group's hyper-parameters."""
    hyper = {k: v for k, v in optimizer.param_groups[index].items() if k != "params"}
    probe = torch.zeros(2, 2, requires_grad=True)
    group = [{**hyper, "params": [probe]}]
    if isinstance(optimizer, MuonWithAdamW):
        twin: torch.optim.Optimizer = MuonWithAdamW(group, muon=optimizer.muon_class)
    else:
        twin = type(optimizer)(group)  # type: ignore[call-arg]  # the subclass's constructor
    probe.grad = torch.ones(2, 2)
    twin.step()
    return tuple(twin.state.get(probe, {}))


def flat_state(state: dict, matrices: list[Owned], master: torch.Tensor, keys: tuple[str, ...] = ()) -> dict:
    """One flat group's optimizer state shaped like `master`: each owned parameter's tensors at its
    place, zeros elsewhere (also for `keys` no owned parameter has yet: a rank that owns nothing in
    the group, or whose parameters have had no gradient, saves what every other rank saves; Muon's
    momentum starts from zeros anyway); {} when `keys` is empty and nothing has state."""
    out: dict = {key: torch.zeros(master.numel(), dtype=master.dtype, device=master.device) for key in keys}
    for matrix in matrices:
        for key, value in state.get(matrix.view, {}).items():
            if not isinstance(value, torch.Tensor) or value.shape != matrix.view.shape:
                raise ValueError(f"optimizer state '{key}' is not shaped like its parameter: cannot be saved flat")
            if key not in out:
                out[key] = torch.zeros(master.numel(), dtype=value.dtype, device=value.device)
            out[key][matrix.lo : matrix.hi].copy_(value.reshape(-1))
    return out


def load_flat_state(state: dict, matrices: list[Owned], flat: dict) -> None:
    """Inverse of `flat_state`: each owned parameter's state from its place in `flat` (copies)."""
    for matrix in matrices:
        state.pop(matrix.view, None)
        if flat:
            state[matrix.view] = {
                key: value[matrix.lo : matrix.hi].view(matrix.view.shape).clone() for key, value in flat.items()
            }
